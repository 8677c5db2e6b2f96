"""The run lock under a launcher that starts every rank itself (torchrun, srun): a busy run_dir ends every rank
within moments with the lock's one line and exit code 2; a rank other than 0 goes on where the lock is free or its
own job's rank 0 holds it. Real processes hold the lock; the ranks are real `fw fit` processes."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_ddp import two_process_sft

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID",
                 "SLURM_NTASKS", "SLURM_RESTART_COUNT", "LSB_JOBID", "FW_RUN_LOCK", "NODE_RANK")
# a holder of run_dir's lock: prints "held" once it holds it, then sleeps until killed
HOLDER = ("import sys, time\nfrom framework.run_lock import RunLock\n"
          "with RunLock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**launcher: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **launcher)
    env.pop("FW_DEBUG", None)
    return env


def torchrun_env(rank: int, port: int) -> dict:
    """What torchrun sets for a worker of a 2-process job on one host (its agent left out)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0"}


def slurm_env(rank: int, port: int) -> dict:
    """What srun sets for a task of a 2-task step on one node (Lightning derives the port from the job id)."""
    return {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0", "SLURM_JOB_ID": str(port), "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "train",
            "SLURM_NODELIST": "localhost"}


def hold(run_dir: Path, **launcher: str) -> subprocess.Popen:
    """A process holding run_dir's lock (under the launcher environment `launcher`)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=ROOT, env=_env(**launcher),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def fit_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(two_process_sft(tmp_path / "run")))   # JSON is YAML
    return path


@pytest.mark.parametrize("launcher", [torchrun_env, slurm_env], ids=["torchrun", "srun"])
def test_a_busy_run_dir_ends_every_rank_a_launcher_started(tmp_path, launcher):
    """Another fit holds run_dir; the launcher starts both ranks of a 2-process job. Rank 0 used to end with the
    lock's line while rank 1 waited in the process group's set-up for rank 0, through SIGTERM, until torch's
    timeout (30 minutes); now both end with the line and exit code 2 before the process group is set up."""
    holder = hold(tmp_path / "run")
    config, port = fit_config(tmp_path), _free_port()
    ranks = [subprocess.Popen([sys.executable, "-m", "framework", "fit", "--config", str(config)], cwd=ROOT,
                              env=_env(**launcher(rank, port)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for rank in (0, 1)]
    try:
        ended = [proc.communicate(timeout=150) for proc in ranks]
    finally:
        for proc in ranks:
            if proc.poll() is None:   # blocked in torch's C++ store, where SIGTERM waits for the timeout
                os.killpg(proc.pid, signal.SIGKILL)
        holder.kill()
        holder.wait()
    line = (f"fw: error: run_dir {tmp_path / 'run'} is in use by another fw fit (pid {holder.pid}); wait for it to "
            "end or choose another run_dir")
    for proc, (_, err) in zip(ranks, ended):
        assert (proc.returncode, err.splitlines()) == (2, [line]), err[-3000:]
    assert sorted(os.listdir(tmp_path / "run")) == [".lock"]


def _check(run_dir: Path, port: int) -> str:
    """`refuse_another_run(run_dir)` in a process of rank 1 of a torchrun job on `port`: "ok" where it returns,
    else the FwError's line."""
    script = ("import sys\nfrom framework.errors import FwError\nfrom framework.run_lock import refuse_another_run\n"
              "try:\n    refuse_another_run(sys.argv[1])\nexcept FwError as e:\n    print(e)\n"
              "else:\n    print('ok')\n")
    return subprocess.run([sys.executable, "-c", script, str(run_dir)], cwd=ROOT, env=_env(**torchrun_env(1, port)),
                          stdout=subprocess.PIPE, text=True, timeout=60, check=True).stdout


def test_a_rank_goes_on_where_its_own_rank_zero_holds_the_lock_or_none_does(tmp_path):
    """Rank 1 goes on at once where the lock file does not exist (a run_dir on each node's own disk), where its
    holder has ended (another job's header or this job's, left behind), and where its own job's rank 0 holds it."""
    run_dir, port = tmp_path / "run", _free_port()
    assert _check(run_dir, port) == "ok\n"
    for earlier_port in (_free_port(), port):
        earlier = hold(run_dir, **torchrun_env(0, earlier_port))
        earlier.kill()
        earlier.wait()
        assert _check(run_dir, port) == "ok\n"
    holder = hold(run_dir, **torchrun_env(0, port))
    try:
        assert _check(run_dir, port) == "ok\n"
    finally:
        holder.kill()
        holder.wait()


def test_another_jobs_lock_ends_rank_one_with_the_lock_line(tmp_path):
    """A torchrun job on another port holds the lock: rank 1 of this one ends within moments with rank 0's line."""
    run_dir = tmp_path / "run"
    holder = hold(run_dir, **torchrun_env(0, _free_port()))
    try:
        start = time.monotonic()
        out = _check(run_dir, _free_port())
        assert time.monotonic() - start < 15
    finally:
        holder.kill()
        holder.wait()
    assert out == (f"run_dir {run_dir} is in use by another fw fit (pid {holder.pid}); wait for it to end or choose "
                   "another run_dir\n")


def test_rank_zero_is_not_refused_by_another_ranks_probe(tmp_path):
    """Another rank's probe holds the lock shared for a moment; rank 0's exclusive lock waits it out instead of
    calling run_dir busy."""
    import fcntl
    import threading

    from framework.run_lock import RunLock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").write_text("")
    fd = os.open(run_dir / ".lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    threading.Timer(0.3, os.close, args=(fd,)).start()
    with RunLock(run_dir):
        assert (run_dir / ".lock").read_text().split("\n")[0] == str(os.getpid())
