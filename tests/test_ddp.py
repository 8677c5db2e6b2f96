"""DDP: 2 CPU processes (gloo) with batch B train exactly like 1 process with batch 2B."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, sys
from framework.config import resolve
from framework.trainer import fit
fit(resolve(json.loads(sys.argv[1])), resume=sys.argv[2] or None)
"""


def fit_in_subprocess(tmp_path, cfg: dict, resume: str = "", check: bool = True) -> subprocess.CompletedProcess:
    """`fit(cfg)` in a fresh Python process (Lightning's DDP launcher starts rank 1 by re-running the same
    script with the same arguments). `tests/` is importable there, for callbacks given by class_path."""
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
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
