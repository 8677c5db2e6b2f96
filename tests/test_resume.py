"""Exact resume on CPU: a run interrupted at step k (mid-epoch, mid-accumulation-free boundary, also mid
logging interval) and resumed from its last checkpoint logs the same metrics for every later step, and
ends with the same weights, as an uninterrupted run."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from framework.callbacks import Callback
from framework.config import resolve
from framework.errors import FwError
from framework.metrics import read_metrics
from framework.trainer import fit

TIMING = {"tokens_per_s"}   # wall-clock dependent


class CrashAt(Callback):
    """Simulates a crash right after optimizer step `step` (after the checkpoint of an earlier step)."""

    def __init__(self, step: int):
        self.step = step

    def after_optimizer_step(self, trainer, module, optimizer):
        if module.policy_version == self.step:
            raise RuntimeError(f"simulated crash after step {self.step}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """10 chats at 4 per optimizer step (2 micro-batches of 2 rows, one chat per row): epochs end
    mid-step and the checkpoint at step 4 (position 16) falls in the middle of the second epoch."""
    lines = Path("recipes/data/arithmetic_chat.jsonl").read_text().splitlines()[:10]
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def config(run_dir, data, log_every, callbacks=()):
    return resolve({
        "recipe": "sft", "seed": 3, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
        "data": {"path": data, "max_seq_len": 96, "batch_size": 2},
        "optimizer": {"lr": 3e-3, "max_grad_norm": 0.5, "weight_decay": 0.01},
        "scheduler": {"name": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1},
        "trainer": {"accelerator": "cpu", "max_steps": 9, "accumulate_grad_batches": 2,
                    "log_every_n_steps": log_every, "enable_progress_bar": False},
        "checkpoint": {"every_n_steps": 4, "keep_last": None},
        "logging": {"csv": True, "tensorboard": False},
        "callbacks": list(callbacks)})


def comparable(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def final_weights(run_dir):
    return load_file(str(Path(run_dir) / "checkpoints" / "step-000009" / "policy" / "model.safetensors"))


@pytest.mark.parametrize("log_every, crash_at", [(1, 6), (3, 5)])
def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path, data, log_every, crash_at):
    straight = tmp_path / "straight"
    fit(config(straight, data, log_every))

    broken = tmp_path / "broken"
    crash = {"class_path": "test_resume.CrashAt", "init_args": {"step": crash_at}}
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(config(broken, data, log_every, [crash]))
    logged = [r["step"] for r in read_metrics(broken / "metrics.jsonl")]
    # The crash left lines past the checkpoint (step 5 when logging every step): the resume drops them.
    assert logged == ([1, 2, 3, 4, 5] if log_every == 1 else [3])
    state = torch.load(broken / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=False)
    position = state["fw_recipe"]["position"]
    assert position == 16   # mid-epoch, in the second epoch

    trainer = fit(config(broken, data, log_every), resume="last")
    assert trainer.global_step == 9 and trainer.lightning_module.policy_version == 9

    expected = comparable(read_metrics(straight / "metrics.jsonl"))
    got = comparable(read_metrics(broken / "metrics.jsonl"))
    assert [r["step"] for r in expected] == ([*range(1, 10)] if log_every == 1 else [3, 6, 9])
    assert got == expected   # exact: same numbers for every step, before and after the resume
    a, b = final_weights(straight), final_weights(broken)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if log_every == 1:
        # Resuming a finished run trains no more steps and leaves its metrics alone.
        trainer = fit(config(straight, data, log_every), resume="last")
        assert trainer.global_step == 9
        assert comparable(read_metrics(straight / "metrics.jsonl")) == expected


def test_resume_last_without_checkpoint_is_an_error(tmp_path, data):
    with pytest.raises(FwError, match="no complete checkpoint"):
        fit(config(tmp_path / "empty", data, 1), resume="last")


def test_config_written_to_run_dir(tmp_path, data):
    cfg = config(tmp_path / "run", data, 1)
    cfg["trainer"]["max_steps"] = 1
    fit(cfg)
    from framework.config import load_config

    assert load_config([str(tmp_path / "run" / "config.yaml")], []) == cfg
    assert json.loads((tmp_path / "run" / "checkpoints" / "step-000001" / "manifest.json").read_text())


def test_fresh_run_over_existing_checkpoints_is_refused_before_writing(tmp_path, data):
    cfg = config(tmp_path / "run", data, 1)
    cfg["trainer"]["max_steps"] = 1
    fit(cfg)
    run = tmp_path / "run"
    before = {p: p.read_bytes() for p in (run / "config.yaml", run / "metrics.jsonl")}
    other = config(run, data, 1)
    other["optimizer"]["lr"] = 1e-4
    with pytest.raises(FwError, match="already holds checkpoints"):
        fit(other)
    assert {p: p.read_bytes() for p in before} == before   # the earlier run's files are untouched
