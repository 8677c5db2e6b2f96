"""Two nodes started by hand, as Lightning numbers a cluster without a launcher (NODE_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT on each node, no RANK): here two CPU processes of one process each (gloo) that share a
run_dir, as nodes on a shared file system do."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from framework import checkpoint as ck
from framework.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _cfg(run_dir: Path, nodes: int, max_steps: int) -> dict:
    return {"recipe": "sft", "seed": 5, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
            "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 96,
                     "batch_size": 2},
            "optimizer": {"lr": 3e-3},
            "trainer": {"accelerator": "cpu", "devices": 1, "num_nodes": nodes,
                        "strategy": "ddp" if nodes > 1 else "auto", "max_steps": max_steps,
                        "enable_progress_bar": False},
            "checkpoint": {"every_n_steps": 2}, "logging": {"csv": False, "tensorboard": False}}


def _write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A one-process run with checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("trained")
    assert main(["fit", "--config", str(_write(tmp / "one.yaml", _cfg(tmp / "run", 1, 4)))]) == 0
    assert [Path(p).name for p in ck.list_checkpoints(tmp / "run")] == ["step-000002", "step-000004"]
    return tmp / "run"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# fit() called from Python, as a user's script on each node would (`fw fit` numbers the process in its checks first)
SCRIPT = """
import sys
from framework.config import load_config
from framework.trainer import fit
fit(load_config([sys.argv[1]]), resume=sys.argv[2])
"""


def _two_nodes(config: Path, resumes: tuple[str, str], script: Path | None = None) -> list[subprocess.CompletedProcess]:
    """`fw fit --config config --resume resumes[n]` on nodes 0 and 1 at once; with `script`, that script with the
    arguments config and resume."""
    port = str(_free_port())
    procs = []
    for node, resume in enumerate(resumes):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node),
               "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK", "GROUP_RANK"):
            env.pop(key, None)
        command = [str(script), str(config), resume] if script else ["-m", "framework", "fit", "--config",
                                                                     str(config), "--resume", resume]
        procs.append(subprocess.Popen([sys.executable, *command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def test_two_nodes_resume_one_run_dir_with_one_first_process(tmp_path, trained):
    """Under `framework.trainer.fit` each node's first process used to count itself global rank 0 until Lightning
    numbered it, so both locked run_dir and one stopped on the other's lock. Now node 1 is rank 1 from the start: the
    two resume step 4 and train to step 6, and only node 0 prints the plan and the resume."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    script = tmp_path / "fit_script.py"
    script.write_text(SCRIPT)
    node0, node1 = _two_nodes(_write(tmp_path / "two.yaml", _cfg(run, 2, 6)), ("last", "last"), script)
    assert node0.returncode == 0, node0.stderr[-3000:]
    assert node1.returncode == 0, node1.stderr[-3000:]
    assert [Path(p).name for p in ck.list_checkpoints(run)] == ["step-000002", "step-000004", "step-000006"]
    assert f"fw: resuming {ck.checkpoints_dir(run) / 'step-000004'}" in node0.stderr
    assert "fw: resuming" not in node1.stderr and "fw plan" not in node1.stderr, node1.stderr[-3000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["num_nodes"] == 2


def test_nodes_that_resolve_different_checkpoints_are_refused_before_either_restores(tmp_path, trained):
    """Node 0 resumes another run's step 4, node 1 a copy of step 2: every rank would have trained from another
    state. Both end with exit code 2 before a step; node 0 names both checkpoints, and the run_dir gets nothing."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(ck.checkpoints_dir(trained) / "step-000004", ck.checkpoints_dir(a) / "step-000004")
    shutil.copytree(ck.checkpoints_dir(trained) / "step-000002", ck.checkpoints_dir(b) / "step-000002")
    run = tmp_path / "run"
    node0, node1 = _two_nodes(_write(tmp_path / "two.yaml", _cfg(run, 2, 6)), (str(a), str(b)))
    assert (node0.returncode, node1.returncode) == (2, 2), (node0.stderr[-3000:], node1.stderr[-3000:])
    line = node0.stderr.strip().splitlines()[-1]
    assert line == (f"fw: error: --resume: the processes resolved different checkpoints: global rank 0 "
                    f"{ck.checkpoints_dir(a) / 'step-000004'}, global rank 1 {ck.checkpoints_dir(b) / 'step-000002'}; "
                    "every process must start from one, so pass --resume with the path of a checkpoint that every "
                    "node reads alike"), node0.stderr[-3000:]
    assert "fw: error" not in node1.stderr and "Traceback" not in node1.stderr, node1.stderr[-3000:]
    assert not ck.list_checkpoints(run) and not (run / "config.yaml").exists()
    assert not (run / "metrics.jsonl").exists()
