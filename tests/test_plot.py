"""fw plot writes a valid PNG of the expected size from real metrics.jsonl files (one run or several)."""

import json
import struct
import warnings
import zlib
from pathlib import Path

import pytest

from framework.cli import main
from framework.metrics import read_metrics
from framework.plot import figure_size, series, smooth

pytest.importorskip("matplotlib")


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk, after checking the signature and the chunk's CRC."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16:16 + length]
    assert struct.unpack(">I", data[16 + length:20 + length])[0] == zlib.crc32(kind + body)
    assert data.endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", body[:8])


def write_run(run: Path, offset: float) -> None:
    run.mkdir(parents=True)
    lines = [{"step": 0, "eval/accuracy": 0.1 + offset}]
    lines += [{"step": s, "reward/mean": s / 10 + offset, "loss": 1 / s} for s in range(1, 11)]
    lines += [{"step": 5, "eval/accuracy": 0.5 + offset}, {"step": 10, "eval/accuracy": 0.9 + offset}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_plot_of_two_runs_is_a_png_of_the_expected_size(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, 0.0)
    write_run(b, 0.05)
    out = tmp_path / "cmp.png"
    assert main(["plot", "--run", str(a), "--run", str(b), "--metrics", "reward/mean,eval/accuracy,loss",
                 "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    # 3 panels in 2 columns: 2 x 5 in by 2 x 3.5 in at 100 dpi
    assert figure_size(3) == (1000, 700)
    assert png_size(out) == (1000, 700)


def test_plot_defaults_to_the_run_dir_and_known_metrics(tmp_path):
    write_run(tmp_path / "a", 0.0)
    assert main(["plot", "--run", str(tmp_path / "a")]) == 0
    # loss, reward/mean and eval/accuracy are in DEFAULT_METRICS: 3 panels
    assert png_size(tmp_path / "a" / "metrics.png") == (1000, 700)


def test_plot_defaults_show_the_losses_of_rl_runs(tmp_path):
    run = tmp_path / "ppo"
    run.mkdir()
    lines = [{"step": s, "policy/loss": 0.1 / s, "value/loss": 1 / s, "reward/mean": s / 10} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["plot", "--run", str(run)]) == 0
    # policy/loss, value/loss and reward/mean: 3 panels in 2 columns
    assert png_size(run / "metrics.png") == (1000, 700)


def test_plot_errors_are_one_line(tmp_path, capsys):
    write_run(tmp_path / "a", 0.0)
    assert main(["plot", "--run", str(tmp_path / "a"), "--metrics", "nope"]) == 2
    assert main(["plot", "--run", str(tmp_path / "missing")]) == 2
    assert main(["plot", "--run", str(tmp_path / "a"), "--out", str(tmp_path / "a.jpg")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(e.startswith("fw: error: ") for e in errors)
    assert "nope not in any run" in errors[0] and "no metrics.jsonl" in errors[1]
    assert errors[2] == f"fw: error: --out {tmp_path / 'a.jpg'}: fw plot writes PNG images; give a path ending in .png"
    assert not (tmp_path / "a.jpg").exists()   # PNG bytes under a .jpg name, before


def test_runs_without_a_default_metric_name_the_option_once(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "user/x": 0.5}) + "\n")
    assert main(["plot", "--run", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fw: error: none of loss, ") and err.endswith("is in the runs; name some with --metrics\n")


def test_an_out_that_cannot_be_written_is_one_line(tmp_path, capsys):
    """--out under a file, or a directory named like a PNG: one line each, exit 2, no traceback."""
    write_run(tmp_path / "a", 0.0)
    (tmp_path / "f").write_text("x")
    (tmp_path / "d.png").mkdir()
    for out in (tmp_path / "f" / "x.png", tmp_path / "f" / "sub" / "x.png", tmp_path / "d.png"):
        assert main(["plot", "--run", str(tmp_path / "a"), "--out", str(out)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    blocked = f"cannot create its folder: {tmp_path / 'f'} is a file"
    assert errors == [f"fw: error: --out {tmp_path / 'f' / 'x.png'}: {blocked}",
                      f"fw: error: --out {tmp_path / 'f' / 'sub' / 'x.png'}: {blocked}",
                      (f"fw: error: --out {tmp_path / 'd.png'}: a directory; give the image's file path, e.g. "
                       f"{tmp_path / 'd.png' / 'metrics.png'}")]


def test_series_and_smoothing():
    records = [{"step": 2, "x": 1.0}, {"step": 1, "x": 3.0}, {"step": 2, "x": 5.0}, {"step": 3, "x": "nan"}]
    assert series(records, "x") == ([1, 2], [3.0, 5.0])   # the later line of a step wins
    # debiased EMA, by hand: 0.5*0 + 0.5*2 = 1 -> 1/0.5 = 2; 0.5*1 + 0.5*4 = 2.5 -> 2.5/0.75
    assert smooth([2.0, 4.0], 0.5) == pytest.approx([2.0, 2.5 / 0.75])
    assert smooth([2.0, 4.0], 0.0) == [2.0, 4.0]


def test_values_near_the_float64_limit_are_drawn_scaled(tmp_path, capsys):
    """A diverged run's loss of +-1.7e308 (a range float64 cannot hold) is drawn in units of 1e308."""
    run = tmp_path / "r"
    run.mkdir()
    lines = [{"step": 1, "loss": 1.7e308}, {"step": 2, "loss": -1.7e308}, {"step": 3, "loss": 1.0},
             {"step": 3, "eval/loss": 1.7976931348623157e308}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["plot", "--run", str(run)]) == 0
    assert capsys.readouterr().err == ""
    assert png_size(run / "metrics.png") == (1000, 350)
    from framework.plot import _exponent

    assert (_exponent(1.7e308), _exponent(2e300), _exponent(1e300), _exponent(0.0)) == (308, 300, 0, 0)


def test_a_step_beyond_what_a_plot_draws_is_one_line(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 1}\n{"step": -1.7e308, "loss": 2}\n')
    assert main(["plot", "--run", str(run)]) == 2
    assert capsys.readouterr().err == (f"fw: error: --run {run}: a record of loss has step -1.7e+308, beyond what a "
                                       "plot can draw\n")
    assert not (run / "metrics.png").exists()


def test_a_step_past_the_float_range_is_one_line(tmp_path, capsys):
    """JSON integers have no bound: a step of 401 digits is a record read_metrics accepts (an int is finite) and
    one line from fw plot, not an OverflowError of a float conversion."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 1}\n{"step": 1' + "0" * 400 + ', "loss": 2}\n')
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 10 ** 400]
    assert main(["plot", "--run", str(run)]) == 2
    assert capsys.readouterr().err == (f"fw: error: --run {run}: a record of loss has step of 401 digits, beyond "
                                       "what a plot can draw\n")


def test_metrics_that_name_no_metric_are_one_line(tmp_path, capsys):
    """`--metrics ,` (or an empty value) names no metric: one line and exit 2, not a ZeroDivisionError traceback (a
    figure of no panel) nor the defaults in place of what the option asked for; no PNG is written."""
    write_run(tmp_path / "a", 0.0)
    for value in (",", "", " , "):
        assert main(["plot", "--run", str(tmp_path / "a"), "--metrics", value]) == 2, value
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [f"fw: error: --metrics {value!r} names no metric; give comma-separated names such as "
                      "loss,reward/mean, or leave --metrics out for the defaults" for value in (",", "", " , ")]
    assert not (tmp_path / "a" / "metrics.png").exists()


def test_a_plot_that_cannot_be_written_whole_keeps_the_earlier_png(tmp_path):
    """A real `fw plot` process whose file size limit (RLIMIT_FSIZE) is below its PNG's size fails at the write: one
    line, exit 2, and the PNG an earlier plot wrote there stays whole, with no partial file beside it."""
    import resource
    import subprocess
    import sys

    write_run(tmp_path / "a", 0.0)
    out = tmp_path / "curves.png"
    assert main(["plot", "--run", str(tmp_path / "a"), "--out", str(out), "--metrics", "loss"]) == 0
    before = out.read_bytes()
    limit = len(before) + 4096   # the one panel fits; four panels, twice its pixels, do not

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))   # Python ignores SIGXFSZ: a write gets EFBIG

    done = subprocess.run([sys.executable, "-m", "framework", "plot", "--run", str(tmp_path / "a"), "--out", str(out),
                           "--metrics", "loss,reward/mean,eval/accuracy,loss"], capture_output=True, text=True,
                          preexec_fn=limited, cwd=Path(__file__).parents[1], check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"fw: error: --out {out}: cannot write it: ") and done.stderr.count("\n") == 1
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "curves.png"]


@pytest.mark.parametrize("where", ["curves.png", "policy/curves.png", "new/curves.png"])
def test_fw_plot_writes_no_png_inside_a_checkpoint(tmp_path, capsys, where):
    """A PNG in a checkpoint directory is no file of its manifest, and the run's prune deletes it with the checkpoint:
    refused before anything is drawn, as fw eval refuses a report there and fw export an --out."""
    from scripts.ckpt_writer import policy_checkpoint

    from framework import checkpoint as ck
    from framework.config import resolve
    from framework.models import Qwen3ForCausalLM
    from framework.models.presets import preset_config
    from framework.tokenizer import Tokenizer

    tok = Tokenizer.builtin()
    model = Qwen3ForCausalLM(preset_config("tiny", tok.vocab_size, tok.eos_id, tok.pad_id))
    run = tmp_path / "run"
    checkpoint = ck.checkpoints_dir(run) / ck.step_dir_name(2)
    cfg = resolve({"recipe": "sft", "run_dir": str(run), "model": {"policy": {"preset": "tiny"}},
                   "data": {"task": {"name": "digits"}}})
    ck.write_checkpoint_dir(policy_checkpoint(model, tok, 2, tmp_path / "tok"), checkpoint, cfg)
    write_run(tmp_path / "a", 0.0)
    before = sorted(p for p in checkpoint.rglob("*"))
    out = checkpoint / where
    assert main(["plot", "--run", str(tmp_path / "a"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"fw: error: --out {out}: inside checkpoint {checkpoint}, whose files are those its manifest lists and "
         "which a prune deletes whole; give a path outside it")]
    assert sorted(p for p in checkpoint.rglob("*")) == before
    assert main(["plot", "--run", str(tmp_path / "a"), "--out", str(run / "curves.png")]) == 0   # beside it: fine


def test_a_panel_without_a_finite_value_says_so_and_no_library_warning_shows(tmp_path, capsys, monkeypatch):
    """A metric whose every value is null, NaN or infinite has nothing to draw: its panel says so in dark text
    rather than stay blank, and matplotlib's warning of a legend without labels is not printed. Runs named with a
    leading underscore (relative paths) are labelled in the legend as any other run, without that warning."""
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    lines = [{"step": 1, "loss": 1.0, "eval/loss": None}, {"step": 2, "loss": 0.5, "eval/loss": float("nan")},
             {"step": 3, "loss": 0.4, "eval/loss": float("inf")}]
    for run in ("_a", "_b"):
        Path(run).mkdir()
        Path(run, "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for runs in (["_a", "_b"], ["_a"]):
        out = tmp_path / f"{len(runs)}.png"
        argv = ["plot", *(a for run in runs for a in ("--run", run)), "--metrics", "loss,eval/loss", "--out", str(out)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(argv) == 0
        assert [str(w.message) for w in caught] == [] and capsys.readouterr() == (f"wrote {out}\n", "")
        # the right panel's middle (eval/loss), blank but for light grid lines unless text is there
        pixels = Image.open(out).convert("RGB")
        width, height = pixels.size
        middle = pixels.crop((width * 3 // 5, height * 2 // 5, width * 9 // 10, height * 3 // 5)).tobytes()
        assert sum(max(p) < 100 for p in zip(middle[0::3], middle[1::3], middle[2::3])) > 50, runs
