"""What the memory plan counts beside the job's tensors: on CPU the process itself."""

from pathlib import Path

from framework import memory_plan as mp
from framework.cli import main
from framework.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "train.yaml")
CPU = ["--trainer.accelerator=cpu"]


def vm_rss() -> float:
    """This process's resident memory as the kernel reports it in /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_the_cpu_plan_counts_the_process_resident_memory_outside_the_allocator():
    before = vm_rss()
    plan = mp.estimate(load_config([TRAIN], CPU))
    after = vm_rss()
    (baseline,) = [r for r in plan.rows if r.name == "process baseline"]
    assert baseline.phases == ("held",) and baseline.outside_allocator
    assert before - 2**20 <= baseline.bytes <= after + 2**20, (before, baseline.bytes, after)
    assert plan.total_bytes - plan.allocated_bytes == baseline.bytes
    assert "  process baseline " in plan.table()
    # a GPU's plan is unchanged: the process's host memory is not on the GPU
    gpu = mp.estimate(load_config([TRAIN], []), gpu_gib=80.0)
    assert not [r for r in gpu.rows if r.name == "process baseline"]


def test_a_cpu_fit_that_fits_only_without_the_process_is_refused(tmp_path, capsys):
    """A limit above the job's tensors by half the process's resident memory: the check passed it, and the job
    could run out of memory once it built them."""
    tensors = mp.estimate(load_config([TRAIN], CPU)).allocated_bytes
    limit = (tensors + vm_rss() / 2) / mp.GIB
    run_dir = tmp_path / "run"
    code = main(["fit", "--config", TRAIN, *CPU, f"--run_dir={run_dir}", f"--trainer.memory_limit_gib={limit}"])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("fw: error: ")]
    assert line.startswith("fw: error: memory plan: the job needs ") and "the biggest row is process baseline" in line
    assert "  process baseline " in err and "Traceback" not in err and not (run_dir / "config.yaml").exists()
    # with room for the process too, it fits
    room = mp.estimate(load_config([TRAIN], [*CPU, f"--trainer.memory_limit_gib={limit + vm_rss() / mp.GIB}"]))
    assert room.fits, room.table()

