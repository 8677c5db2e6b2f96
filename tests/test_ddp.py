"""DDP: 2 CPU processes (gloo) with batch B train exactly like 1 process with batch 2B. Several fits in one job (a
script's) each leave no trainer behind, and each fit's failure ends every rank as a first fit's does."""

import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

from framework.callbacks import Callback, ProgressBar
from framework.errors import FwError, raise_on_every_rank
from framework.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, sys
from framework.config import resolve
from framework.trainer import fit
fit(resolve(json.loads(sys.argv[1])), resume=sys.argv[2] or None)
"""
# the fit, then whether the process still holds its trainer and its module: kept.<rank>.json beside the run_dir
KEPT_SCRIPT = """
import gc, json, sys, weakref
from pathlib import Path
from framework.config import resolve
from framework.trainer import fit
cfg = json.loads(sys.argv[1])
trainer = fit(resolve(cfg))
rank, refs = trainer.global_rank, [weakref.ref(trainer), weakref.ref(trainer.lightning_module)]
del trainer
gc.collect()
Path(cfg["run_dir"]).parent.joinpath(f"kept.{rank}.json").write_text(json.dumps([r() is not None for r in refs]))
"""
# the fits of a list of configs in one process, as a script or a notebook may run them, each FwError reported as `fw
# fit` reports it and the script going on; after each fit, on every rank, its exit code, the time it returned or
# raised, and whether the process still holds its trainer and module (Watched), in fits.<rank>.json beside the first
# run_dir; the script's exit code is the last fit's
FITS_SCRIPT = """
import gc, json, sys, time
from pathlib import Path
import torch.distributed as dist
import test_ddp
from framework.config import resolve
from framework.errors import FwError
from framework.trainer import fit
cfgs, ends = json.loads(sys.argv[1]), []
for cfg in cfgs:
    try:
        fit(resolve(cfg))
        code = 0
    except FwError as e:
        if not e.quiet:
            print(f"fw: error: {e}", file=sys.stderr, flush=True)
        code = 2
    ended = time.time()
    gc.collect()
    ends.append({"code": code, "ended": ended, "kept": [r() is not None for r in test_ddp.FITTED[-1]]})
    Path(cfgs[0]["run_dir"]).parent.joinpath(f"fits.{dist.get_rank()}.json").write_text(json.dumps(ends))
sys.exit(code)
"""
# two fits of Lightning's demo model by two Trainers that share one StopEveryRankOnError, as a user's own Trainer may
# reuse a callback object, the second failing on global rank argv[1], its FwError reported as `fw fit` reports it
REUSED_SCRIPT = """
import json, sys
import lightning
from lightning.pytorch.demos.boring_classes import BoringModel
import test_ddp
from framework.callbacks import StopEveryRankOnError
from framework.errors import FwError
shared = StopEveryRankOnError()
for fail_on in (None, json.loads(sys.argv[1])):
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[shared, test_ddp.Watched(fail_on)])
    try:
        trainer.fit(BoringModel())
    except FwError as e:
        print(f"fw: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
"""


def fit_in_subprocess(tmp_path, cfg: dict | list | int, resume: str = "", check: bool = True,
                      source: str = SCRIPT) -> subprocess.CompletedProcess:
    """`fit(cfg)` in a fresh Python process (Lightning's DDP launcher starts rank 1 by re-running the same
    script with the same arguments), by the script `source`, which gets `cfg` as JSON (FITS_SCRIPT: a list of
    configs). `tests/` is importable there, for callbacks given by class_path."""
    script = tmp_path / "train_script.py"
    script.write_text(source)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, str(script), json.dumps(cfg), resume], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def train(tmp_path, name, devices, batch_size):
    cfg = {"recipe": "sft", "seed": 5, "run_dir": str(tmp_path / name), "model": {"policy": {"preset": "tiny"}},
           "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 96,
                    "batch_size": batch_size},
           "optimizer": {"lr": 3e-3, "max_grad_norm": 0.5},
           "trainer": {"accelerator": "cpu", "devices": devices, "strategy": "ddp" if devices > 1 else "auto",
                       "max_steps": 4, "enable_progress_bar": False},
           "checkpoint": {"every_n_steps": 100}, "logging": {"csv": False, "tensorboard": False}}
    fit_in_subprocess(tmp_path, cfg)
    return read_metrics(tmp_path / name / "metrics.jsonl")


@pytest.mark.slow   # two Lightning process start-ups: long on a 2-core machine
def test_two_processes_match_one_on_the_same_global_batch(tmp_path):
    one = train(tmp_path, "one", devices=1, batch_size=4)
    two = train(tmp_path, "two", devices=2, batch_size=2)
    assert [m["step"] for m in one] == [m["step"] for m in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert b["tokens"] == a["tokens"]   # the two ranks together saw the single process's batch
        for key in ("loss", "token_accuracy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
        assert b["lr"] == a["lr"]


class PublishNewer(Callback):
    """In the process that launches the others (no LOCAL_RANK yet) moves checkpoint `held` back into `into`, as a
    run still writing there publishes a newer checkpoint while the resume starts; on every rank writes the
    checkpoint the trainer resumed from to `<out>.<rank>`."""

    def __init__(self, held: str, into: str, out: str):
        self.out = out
        if "LOCAL_RANK" not in os.environ:
            os.rename(held, Path(into) / Path(held).name)

    def on_train_start(self, trainer, module):
        Path(f"{self.out}.{trainer.global_rank}").write_text(str(trainer.ckpt_path))


@pytest.mark.slow   # a 1-process and a 2-process Lightning start-up
def test_every_rank_resumes_from_the_checkpoint_the_launching_process_resolved(tmp_path):
    """`--resume` at another run's directory on 2 processes: Lightning starts rank 1 by running the command again,
    after the other run has published a newer checkpoint; rank 1 still loads the one rank 0 resolved and loads."""
    from framework import checkpoint as ck

    source = tmp_path / "source"
    cfg = {"recipe": "sft", "seed": 5, "run_dir": str(source), "model": {"policy": {"preset": "tiny"}},
           "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 96,
                    "batch_size": 2},
           "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False},
           "checkpoint": {"every_n_steps": 1, "keep_last": None}, "logging": {"csv": False, "tensorboard": False}}
    fit_in_subprocess(tmp_path, cfg)
    held = tmp_path / ck.step_dir_name(2)
    os.rename(ck.checkpoints_dir(source) / held.name, held)   # published once the resume has resolved step 1
    out = tmp_path / "resumed_from"
    cfg.update(run_dir=str(tmp_path / "two"),
               callbacks=[{"class_path": "test_ddp.PublishNewer",
                           "init_args": {"held": str(held), "into": str(ck.checkpoints_dir(source)),
                                         "out": str(out)}}])
    cfg["trainer"].update(devices=2, strategy="ddp", max_steps=3)
    fit_in_subprocess(tmp_path, cfg, resume=str(source))
    first = str(ck.checkpoints_dir(source) / ck.step_dir_name(1))
    assert (ck.checkpoints_dir(source) / held.name).is_dir()   # the newer one was there when rank 1 started
    assert [Path(f"{out}.{rank}").read_text() for rank in (0, 1)] == [first, first]


def two_process_sft(run_dir: Path) -> dict:
    """A config of one SFT step of the tiny preset in 2 CPU processes (DDP) that writes no logs and no checkpoint."""
    return {"recipe": "sft", "seed": 5, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
            "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 64,
                     "batch_size": 2},
            "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": 1,
                        "enable_progress_bar": False},
            "checkpoint": {"every_n_steps": 100}, "logging": {"csv": False, "tensorboard": False}}


@pytest.mark.slow   # a 2-process Lightning start-up
def test_a_finished_two_process_fit_leaves_no_trainer_behind(tmp_path):
    """Once `fit` returns, every rank's trainer and module (the model, its optimizer state) can be freed: a script
    that fits again (a sweep) does not hold each earlier run's until it exits. Global rank 0 keeps an exit hook,
    which waits for the other ranks' departures from its store."""
    fit_in_subprocess(tmp_path, two_process_sft(tmp_path / "run"), source=KEPT_SCRIPT)
    kept = [json.loads((tmp_path / f"kept.{rank}.json").read_text()) for rank in (0, 1)]
    assert kept == [[False, False], [False, False]]


FITTED: list = []   # per fit of this process, weak references to its trainer and its module (Watched)


class Watched(Callback):
    """Adds weak references to the fit's trainer and module to FITTED; with `fail_on`, raises a FwError at the first
    batch end on that global rank alone, or with `every_rank` on every rank (`raise_on_every_rank`, as a reward's
    failure is raised)."""

    def __init__(self, fail_on: int | None = None, every_rank: bool = False):
        self.fail_on, self.every_rank = fail_on, every_rank

    def setup(self, trainer, module, stage):
        FITTED.append((weakref.ref(trainer), weakref.ref(module)))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        error = FwError(f"my_callback: failed on rank {self.fail_on}") if trainer.global_rank == self.fail_on else None
        if self.every_rank:
            raise_on_every_rank(error, collective=True)
        elif error is not None:
            raise error


class AckBar(ProgressBar):
    """fw's bar, drawing nothing; writes the time to `out` as global rank 0 first ends its line, which it does when
    it sees another rank's failure (before that rank reports it) or meets its own."""

    def __init__(self, out: str):
        super().__init__(refresh_rate=0)
        self.out = out

    def end_line(self) -> None:
        if self.trainer.is_global_zero and not os.path.exists(self.out):
            Path(self.out).write_text(str(time.time()))
        super().end_line()


def fits_config(tmp_path, name: str, **watched) -> dict:
    return {"recipe": "sft", "seed": 5, "run_dir": str(tmp_path / name), "model": {"policy": {"preset": "tiny"}},
            "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 96,
                     "batch_size": 2},
            "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": 1,
                        "enable_progress_bar": False},
            "callbacks": [{"class_path": "test_ddp.Watched", "init_args": watched}],
            "checkpoint": {"every_n_steps": 100}, "logging": {"csv": False, "tensorboard": False}}


def run_fit(tmp_path: Path, cfg: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m framework fit` of `cfg` (written to tmp_path/config.yaml) in a new process, its output captured."""
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(cfg))   # JSON is YAML
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
    env.pop("FW_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "framework", "fit", "--config", str(path)], check=False, cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def without_plans(stderr: str) -> list[str]:
    """The lines of `stderr` but empty ones and the memory plans' tables and verdicts, which global rank 0 prints as
    each fit starts."""
    return [line for line in stderr.splitlines() if line and not line.startswith(("fw plan: ", "  ", "fits: "))]


def fit_all(tmp_path, cfgs: list[dict]) -> tuple[int, list[str], dict[int, list[dict]]]:
    """FITS_SCRIPT's fits of `cfgs` on 2 processes: the exit code, the lines of stderr other than the memory plans'
    tables (which global rank 0 prints as each fit starts), and each rank's record of the fits it ended."""
    proc = fit_in_subprocess(tmp_path, cfgs, check=False, source=FITS_SCRIPT)
    lines = without_plans(proc.stderr)
    ends = {rank: json.loads(path.read_text()) for rank in (0, 1) if (path := tmp_path / f"fits.{rank}.json").exists()}
    return proc.returncode, lines, ends


@pytest.mark.slow   # a 2-process Lightning start-up
@pytest.mark.parametrize("rank", [0, 1])
def test_a_second_fit_failing_on_one_rank_ends_every_rank_as_a_first_would(tmp_path, rank):
    """Two fits in one job (a script that fits twice keeps its process group and its store): the first runs to its
    end, the second fails on one rank. The job ends as it would in a first fit: with the failed rank's exit code and
    its one line, the failed rank reporting only after global rank 0 has seen its failure, and global rank 0, which
    hosts the store, ending after the other rank's last use of it (else that rank prints a warning, a C++ stack and
    its own traceback). The failed rank's caller can free the trainer and the module."""
    acked = tmp_path / "acked"
    second = fits_config(tmp_path, "second", fail_on=rank)
    second["callbacks"].append({"class_path": "test_ddp.AckBar", "init_args": {"out": str(acked)}})
    second["trainer"]["enable_progress_bar"] = True
    code, lines, ends = fit_all(tmp_path, [fits_config(tmp_path, "first"), second])
    assert code == 2, lines
    assert lines == [f"fw: error: global rank {rank}: my_callback: failed on rank {rank}"]
    assert [end["code"] for end in ends[rank]] == [0, 2]
    assert [end["code"] for end in ends[1 - rank]] == [0]   # ended in the second fit, as the failed rank reported
    assert float(acked.read_text()) <= ends[rank][1]["ended"]
    assert ends[rank][1]["kept"] == [False, False]


@pytest.mark.slow   # a 2-process Lightning start-up
def test_a_fit_after_one_that_failed_on_every_rank_runs_to_its_end(tmp_path):
    """A script goes on after a fit that failed on every rank (as a reward's failure does) and fits again: the first
    fit's failure is not taken for one of the second, which runs to its end on every rank."""
    first = fits_config(tmp_path, "first", fail_on=1, every_rank=True)
    code, lines, ends = fit_all(tmp_path, [first, fits_config(tmp_path, "second")])
    assert code == 0, lines
    assert lines == ["fw: error: global rank 1: my_callback: failed on rank 1"]   # from global rank 0 alone
    assert [[end["code"] for end in ends[rank]] for rank in (0, 1)] == [[2, 0], [2, 0]]


@pytest.mark.slow   # a 2-process Lightning start-up
def test_a_fit_that_failed_on_every_rank_leaves_no_trainer_behind(tmp_path):
    """The error of a fit that fails on every rank reaches the caller on every rank, which may go on (a sweep): each
    rank's trainer and module can be freed there, as a finished fit's are; the exit hooks that finish the failure's
    report (global rank 0's, and the other rank's, whose error is quiet) hold its store alone."""
    code, lines, ends = fit_all(tmp_path, [fits_config(tmp_path, "run", fail_on=1, every_rank=True)])
    assert code == 2, lines
    assert lines == ["fw: error: global rank 1: my_callback: failed on rank 1"]
    assert [ends[rank][0]["kept"] for rank in (0, 1)] == [[False, False], [False, False]]


@pytest.mark.slow   # a 2-process Lightning start-up
def test_a_callback_reused_by_a_second_trainer_ends_its_failure_as_a_first_would(tmp_path):
    """A StopEveryRankOnError that a second Trainer reuses watches the second fit's failure on keys of its own: the
    job ends with the failed rank's one line, global rank 0 (the failed one, which hosts the store) ending after the
    other rank's last use of it, without that rank's warning, C++ stack or traceback."""
    proc = fit_in_subprocess(tmp_path, 0, check=False, source=REUSED_SCRIPT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("fw: ", "[rank"))]
    assert lines == ["fw: error: global rank 0: my_callback: failed on rank 0"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception raised from" not in proc.stderr, proc.stderr[-3000:]
