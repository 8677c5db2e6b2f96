"""`fw plot`: PNG curves of runs' metrics.jsonl, one panel per metric, steps on x, one line per run.

Training metrics are drawn raw (faint) and smoothed with an exponential moving average; eval metrics,
which have a point every `eval.every_n_steps` steps only, are drawn as they are, with markers. Needs
matplotlib (`pip install 'fw[plot]'`); it draws off-screen (the Agg canvas), so no display is needed.
"""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

from framework.checkpoint.directory import enclosing_checkpoint
from framework.durable import file_in_the_way, replace_file
from framework.errors import FwError
from framework.metrics import read_metrics

# the losses (SFT's `loss`, GRPO's and PPO's `policy/loss`, PPO's critic `value/loss`), rewards and eval metrics
DEFAULT_METRICS = ("loss", "policy/loss", "value/loss", "reward/mean", "reward/accuracy", "eval/loss",
                   "eval/token_accuracy", "eval/reward_mean", "eval/accuracy", "eval/pass@k")
PANEL_INCHES = (5.0, 3.5)   # width, height of one panel
DPI = 100
COLUMNS = 2
# matplotlib's axis margins and ticks overflow float64 for a range wider than about 1.5e308: larger values are
# drawn scaled (steps, which are no measurement, are refused)
DRAWABLE = 1e300


def figure_size(panels: int) -> tuple[int, int]:
    """The PNG's (width, height) in pixels for `panels` metric panels."""
    cols = min(COLUMNS, panels)
    rows = math.ceil(panels / cols)
    return round(cols * PANEL_INCHES[0] * DPI), round(rows * PANEL_INCHES[1] * DPI)


def smooth(values: list[float], weight: float) -> list[float]:
    """Exponential moving average, debiased so the first points are not pulled towards 0."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i) if weight > 0 else v)
    return out


def series(records: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `metric`, finite values only, the last value per step (a resumed run's)."""
    by_step: dict[int, float] = {}
    for r in records:
        v = r.get(metric)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and r.get("step") is not None:
            by_step[int(r["step"])] = float(v)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _metrics_file(run: str | Path) -> Path:
    path = Path(run)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise FwError(f"--run {run}: no metrics.jsonl (give a run directory or its metrics.jsonl)")
    return path


def plot_runs(runs: list[str | Path], out: str | Path | None = None, metrics: list[str] | None = None,
              smoothing: float = 0.6) -> Path:
    """Write the PNG of `metrics` (default: those of `DEFAULT_METRICS` any run has) for `runs`; returns
    its path (default `<first run>/metrics.png`)."""
    if not 0 <= smoothing < 1:
        raise FwError(f"--smooth must be in [0, 1), got {smoothing:g}")
    if out is not None and Path(out).suffix.lower() != ".png":   # the bytes written are a PNG's whatever the name
        raise FwError(f"--out {out}: fw plot writes PNG images; give a path ending in .png")
    files = [_metrics_file(r) for r in runs]
    out = Path(out) if out is not None else Path(runs[0]) / "metrics.png" if Path(runs[0]).is_dir() else \
        Path(runs[0]).with_suffix(".png")
    _check_out(out)   # before the drawing
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise FwError("fw plot needs matplotlib: pip install 'fw[plot]'") from None
    data = {str(Path(r)): read_metrics(f) for r, f in zip(runs, files)}
    present = {k for records in data.values() for r in records for k in r}
    if metrics is None:
        metrics = [m for m in DEFAULT_METRICS if m in present]
        if not metrics:
            raise FwError(f"none of {', '.join(DEFAULT_METRICS)} is in the runs; name some with --metrics")
    missing = [m for m in metrics if m not in present]
    if missing:
        raise FwError(f"--metrics: {', '.join(missing)} not in any run (they have: "
                      f"{', '.join(sorted(present - {'step'}))})")
    width, height = figure_size(len(metrics))
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    cols = min(COLUMNS, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    colors = [f"C{i % 10}" for i in range(len(data))]
    for i, metric in enumerate(metrics):
        ax = fig.add_subplot(rows, cols, i + 1)
        curves = {name: series(records, metric) for name, records in data.items()}
        for name, (steps, _) in curves.items():
            if steps and max(abs(steps[0]), abs(steps[-1])) > DRAWABLE:
                raise FwError(f"--run {name}: a record of {metric} has step {_step_text(max(steps, key=abs))}, "
                              "beyond what a plot can draw")
        exponent = _exponent(max((abs(v) for _, values in curves.values() for v in values), default=0.0))
        if exponent:   # drawn in units of 10**exponent, which the axis's label names
            curves = {name: (steps, [v / 10.0 ** exponent for v in values]) for name, (steps, values) in curves.items()}
            ax.set_ylabel(f"×1e{exponent}")
        drawn = []   # (line, run) of each run with a finite value of the metric
        for (name, (steps, values)), color in zip(curves.items(), colors):
            if not steps:
                continue
            if metric.startswith("eval/"):
                (line,) = ax.plot(steps, values, marker="o", color=color)
            else:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                (line,) = ax.plot(steps, smooth(values, smoothing), color=color)
            drawn.append((line, name))
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if not drawn:   # every value null, NaN or infinite: said in the panel rather than left blank
            ax.text(0.5, 0.5, "no finite value" + (" in any run" if len(data) > 1 else ""), transform=ax.transAxes,
                    ha="center", va="center")
            ax.set_xticks([])   # the axes' 0 to 1 would read as steps and values
            ax.set_yticks([])
        elif len(data) > 1:
            # the lines and names given: matplotlib would leave out a run whose name starts with "_"
            ax.legend([line for line, _ in drawn], [name for _, name in drawn], fontsize="small")
    image = io.BytesIO()
    fig.savefig(image, dpi=DPI, format="png")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        replace_file(out, image.getvalue())   # whole or not at all: a failed write keeps an earlier PNG there
    except OSError as e:
        raise FwError(f"--out {out}: cannot write it: {e.strerror or e}") from None
    return out


def _step_text(step: int) -> str:
    """`step` in a line: %g where a float holds it, else its count of digits (an int past the float range)."""
    return f"{float(step):g}" if abs(step) <= sys.float_info.max else f"of {len(str(abs(step)))} digits"


def _exponent(largest: float) -> int:
    """The power of ten a panel whose largest |value| is `largest` is drawn in: 0 up to `DRAWABLE`, else that of
    `largest`, so the axis range stays far from the float64 limit."""
    return math.floor(math.log10(largest)) if largest > DRAWABLE else 0


def _check_out(out: Path) -> None:
    """FwError if the PNG cannot go to `out`: a directory there, a file where a folder of it must be, or a checkpoint
    directory around it."""
    if out.is_dir():
        raise FwError(f"--out {out}: a directory; give the image's file path, e.g. {out / 'metrics.png'}")
    blocking = file_in_the_way(out)
    if blocking is not None:
        raise FwError(f"--out {out}: cannot create its folder: {blocking} is a file")
    checkpoint = enclosing_checkpoint(out.parent)
    if checkpoint is not None:   # not a file of its manifest: a prune deletes it with the checkpoint
        raise FwError(f"--out {out}: inside checkpoint {checkpoint}, whose files are those its manifest lists and "
                      "which a prune deletes whole; give a path outside it")
