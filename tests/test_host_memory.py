"""A CPU job is checked against the machine's memory: one whose plan passes it is refused before it starts."""

from pathlib import Path

import pytest

from framework import memory_plan as mp
from framework.cli import main
from framework.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "train.yaml")
# Qwen3-8B's float32 weights, gradients and AdamW moments alone are about 120 GiB
HUGE = ["--model.policy.preset=qwen3-8b", "--trainer.accelerator=cpu"]


def mem_total() -> float:
    """The machine's memory as the kernel reports it in /proc/meminfo, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return float(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_the_host_memory_is_the_machines_or_its_containers_limit():
    total, what = mp.host_memory()
    if what == "this machine's memory":
        assert abs(total - mem_total()) <= 64 * 2**20, (total, mem_total())   # the kernel's own reservations aside
    else:
        assert what == "this container's memory limit" and 0 < total < mem_total()


def test_a_cpu_job_is_planned_against_the_machines_memory_shared_by_its_processes():
    total, what = mp.host_memory()
    plan = mp.estimate(load_config([TRAIN], ["--trainer.accelerator=cpu"]))
    assert plan.limit_bytes == total and plan.limit_source.startswith(what) and plan.fits
    two = mp.estimate(load_config([TRAIN], ["--trainer.accelerator=cpu", "--trainer.devices=2",
                                            "--trainer.strategy=ddp"]))
    assert two.limit_bytes == total / 2 and "over its 2 processes" in two.limit_source
    given = mp.estimate(load_config([TRAIN], ["--trainer.accelerator=cpu", "--trainer.memory_limit_gib=1000"]))
    assert given.limit_bytes == 1000 * 2**30 and given.limit_source == "trainer.memory_limit_gib"


def test_a_cpu_fit_past_the_machines_memory_is_refused_before_it_starts(tmp_path, capsys):
    """It used to start, and ended in the allocator's traceback once the memory ran out (or in the kernel's
    out-of-memory kill)."""
    total, _ = mp.host_memory()
    needs = mp.estimate(load_config([TRAIN], [*HUGE, "--trainer.memory_limit_gib=100000"])).total_bytes
    if needs <= total:
        pytest.skip(f"this machine holds {total / 2**30:.0f} GiB, more than the job's plan")
    run_dir = tmp_path / "run"
    code = main(["fit", "--config", TRAIN, *HUGE, f"--run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("fw: error: ")]
    assert line.startswith("fw: error: memory plan: the job needs ") and "GiB limit (this " in line, line
    assert "trainer.memory_limit_gib sets another" in line and "Traceback" not in err
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()
