"""SIGKILL at random moments, including during saves: the newest complete checkpoint always loads and verifies.

The writer (tests/scripts/ckpt_writer.py) saves ~12 MB checkpoints in a loop with AtomicCheckpointIO's
writer, re-publishing the previous step every third step, pruning to keep_last=2, and restarting from the
newest checkpoint like `--resume last`. Writers are real processes forked from a forkserver that has torch
and fw preloaded, so a kill cycle costs a fraction of a second instead of a fresh interpreter's import time.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scripts.ckpt_writer import assert_same, expected, write_forever

from framework import checkpoint as ck

WRITER = Path(__file__).parent / "scripts" / "ckpt_writer.py"


def _hidden_leftovers(run_dir: Path) -> list[str]:
    d = ck.checkpoints_dir(run_dir)
    return [n for n in os.listdir(d) if n.startswith(".")] if d.is_dir() else []


class KillLog:
    """Checks the run dir after each kill and keeps score."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.newest = 0
        self.kills_mid_save = 0

    def check_after_kill(self) -> None:
        if _hidden_leftovers(self.run_dir):
            self.kills_mid_save += 1  # staging/replaced/trash dirs exist only while a save or prune runs
        latest = ck.find_latest(self.run_dir)
        if self.newest:
            assert latest is not None, "a published checkpoint disappeared after a kill"
        if latest is None:
            return
        loaded = ck.read_checkpoint_dir(latest, verify=True)
        step, version = loaded["global_step"], loaded["recipe_state"]["version"]
        assert Path(latest).name == ck.step_dir_name(step)
        assert step >= self.newest, f"newest checkpoint went back from step {self.newest} to {step}"
        self.newest = step
        assert_same(expected(step, version), loaded)
        # every checkpoint still listed is complete and intact, and pruning keeps at most keep_last + 1
        # (a kill between publish and prune), never fewer than one
        listed = ck.list_checkpoints(self.run_dir)
        assert 1 <= len(listed) <= 3, listed
        for path in listed:
            ck.verify_checkpoint(path)


def _forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "framework.checkpoint", "scripts.ckpt_writer"])
    return ctx


def _kill_cycles(run_dir: Path, kills: int, seed: int) -> KillLog:
    ctx = _forkserver()
    rng = random.Random(seed)
    log = KillLog(run_dir)
    for i in range(kills):
        proc = ctx.Process(target=write_forever, args=(str(run_dir), i % 2 == 0))
        proc.start()
        time.sleep(rng.uniform(0.02, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL, f"writer exited on its own with {proc.exitcode}"
        log.check_after_kill()
    return log


def test_sigkill_writer_many_times(tmp_path):
    log = _kill_cycles(tmp_path / "run", kills=36, seed=0)
    assert log.newest >= 10, "the writer barely progressed; the test did not exercise much"
    assert log.kills_mid_save >= 5, f"only {log.kills_mid_save} of 36 kills landed during a save"


@pytest.mark.slow
def test_sigkill_writer_many_more_times(tmp_path):
    log = _kill_cycles(tmp_path / "run", kills=200, seed=1)
    assert log.kills_mid_save >= 30


@pytest.mark.slow
def test_sigkill_writer_script(tmp_path):
    """The same with the writer as a fresh interpreter (no forkserver), killed once it has started saving."""
    run_dir = tmp_path / "run"
    log = KillLog(run_dir)
    rng = random.Random(2)
    for i in range(4):
        args = [sys.executable, str(WRITER), str(run_dir)] + ([] if i % 2 else ["--no-exchange"])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.Popen(args, env=env)
        start = log.newest
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            latest = ck.find_latest(run_dir)  # wait until it publishes something new, then a little more
            if latest and int(Path(latest).name.split("-")[1]) > start:
                break
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        log.check_after_kill()
    assert log.newest > 4
