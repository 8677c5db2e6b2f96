"""DDP: 2 CPU processes (gloo) with batch B train exactly like 1 process with batch 2B."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework.callbacks import Callback
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


def fit_in_subprocess(tmp_path, cfg: dict, resume: str = "", check: bool = True,
                      source: str = SCRIPT) -> subprocess.CompletedProcess:
    """`fit(cfg)` in a fresh Python process (Lightning's DDP launcher starts rank 1 by re-running the same
    script with the same arguments), by the script `source`. `tests/` is importable there, for callbacks given by
    class_path."""
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


@pytest.mark.slow   # a 2-process Lightning start-up
def test_a_finished_two_process_fit_leaves_no_trainer_behind(tmp_path):
    """Once `fit` returns, every rank's trainer and module (the model, its optimizer state) can be freed: a script
    that fits again (a sweep) does not hold each earlier run's until it exits. Global rank 0 keeps an exit hook,
    which waits for the other ranks' departures from its store."""
    cfg = {"recipe": "sft", "seed": 5, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
           "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 64,
                    "batch_size": 2},
           "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": 1,
                       "enable_progress_bar": False},
           "checkpoint": {"every_n_steps": 100}, "logging": {"csv": False, "tensorboard": False}}
    fit_in_subprocess(tmp_path, cfg, source=KEPT_SCRIPT)
    kept = [json.loads((tmp_path / f"kept.{rank}.json").read_text()) for rank in (0, 1)]
    assert kept == [[False, False], [False, False]]
