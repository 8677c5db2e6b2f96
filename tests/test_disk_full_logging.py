"""A disk that fills while `fw fit` logs: the run stops with exit 2 and one line naming the file, never hangs, keeps
its published checkpoints, and `--resume last` continues once there is room, each step once in metrics.jsonl.

Each case runs `fw fit` as a process on a real tmpfs (root only) that the test fills between two checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import TENSORBOARD_WRITERS, use_tensorboard_writer

from framework import checkpoint as ck
from framework.errors import FwError
from framework.metrics import read_metrics

REPO = Path(__file__).parents[1]
WAIT_S = 150   # for `fw fit` to stop once its disk is full; the old TensorBoard writer waited forever


def _mount(mnt: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")


@pytest.fixture
def mounts():
    """`mount(path, size)` mounts a real tmpfs at `path`; all are unmounted at the end."""
    done: list[Path] = []

    def mount(path: Path, size: str) -> Path:
        _mount(path, size)
        done.append(path)
        return path

    yield mount
    for path in reversed(done):
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], check=True)


def _fill(directory: Path) -> Path:
    """Write a file in `directory` until its file system has no room left; return it."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        block = b"\0" * (64 << 10)
        try:
            while True:
                f.write(block)
        except OSError:
            pass
    small = b"\0" * 512   # the last partial block
    with open(filler, "ab", buffering=0) as f:
        try:
            while True:
                f.write(small)
        except OSError:
            pass
    return filler


def _config(tmp_path: Path, run_dir: Path, tensorboard: bool, every: int) -> str:
    from test_resume import config

    cfg = config(run_dir, str(REPO / "recipes" / "data" / "arithmetic_chat.jsonl"), 1)
    cfg["trainer"]["max_steps"] = 400   # far more than the steps before the disk fills
    cfg["checkpoint"].update(every_n_steps=every, keep_last=1)
    cfg["logging"].update(csv=False, tensorboard=tensorboard)
    path = tmp_path / f"train-{tensorboard}.yaml"
    path.write_text(json.dumps(cfg))   # JSON is YAML
    return str(path)


# `python -m framework`, with Lightning's TensorBoard writer chosen first (conftest.use_tensorboard_writer's choice)
_WITH_WRITER = ("import sys, lightning.fabric.loggers.tensorboard as t; t._TENSORBOARD_AVAILABLE = {torch}; "
                "from framework.cli import main; sys.exit(main())")


def _fw(*argv: str, writer: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    start = ["-m", "framework"] if writer is None else ["-c", _WITH_WRITER.format(torch=writer == "torch")]
    return subprocess.Popen([sys.executable, *start, *argv], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _fit_until_the_disk_fills(config: str, run_dir: Path, full: Path, first: int,
                              writer: str | None = None) -> tuple[int, str]:
    """Start `fw fit` (TensorBoard through `writer`, or Lightning's choice), fill the file system of `full` once step
    `first` is published, return (exit code, stderr)."""
    proc = _fw("fit", "--config", config, writer=writer)
    published = ck.checkpoints_dir(run_dir) / ck.step_dir_name(first)
    deadline = time.monotonic() + 300
    while not published.is_dir():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"fw fit published no step {first} within 300 s"
        time.sleep(0.02)
    _fill(full)
    try:
        _, err = proc.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"fw fit still running {WAIT_S} s after its disk filled")
    return proc.returncode, err


def _error_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("fw: error:")]
    return line


def _resume_and_check(config: str, run_dir: Path, filler: Path, writer: str | None = None) -> None:
    """After freeing the space: `--resume last` to 4 steps past the newest checkpoint (TensorBoard through `writer`,
    as the run it resumes) finishes, and metrics.jsonl holds every step once, in order."""
    filler.unlink()
    newest = ck.read_manifest(ck.find_latest(run_dir))["step"]
    ck.verify_checkpoint(ck.find_latest(run_dir))
    proc = _fw("fit", "--config", config, "--resume", "last", f"--trainer.max_steps={newest + 4}", writer=writer)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, newest + 5))


@pytest.mark.parametrize("writer", TENSORBOARD_WRITERS)
def test_tensorboard_on_a_full_disk_stops_fit_with_one_line(tmp_path, mounts, writer):
    """TensorBoard's event file alone on the full file system (`logs/` is its own tmpfs): the writer thread meets
    ENOSPC when its buffer fills (some 20 steps of events, before the flush at the next checkpoint, 50 steps on) and
    the run stops with the line naming `logging.tensorboard` and the event file, instead of waiting forever to queue
    an event for a thread that has ended, and without the traceback of torch's writer thread, which re-raises the
    error its writer hands to fw."""
    if writer == "torch":
        pytest.importorskip("tensorboard")
    run_dir = tmp_path / "run"
    logs = mounts(run_dir / "logs", "1m")
    config = _config(tmp_path, run_dir, tensorboard=True, every=50)
    rc, err = _fit_until_the_disk_fills(config, run_dir, logs, 50, writer)
    assert rc == 2, err[-3000:]
    line = _error_line(err)
    assert line.startswith(f"fw: error: logging.tensorboard: {logs}/version_0/events.out.tfevents."), line
    assert "no space left on device" in line and "published checkpoints are intact" in line
    _resume_and_check(config, run_dir, logs / "filler", writer)


def test_metrics_jsonl_on_a_full_disk_stops_fit_with_one_line(tmp_path, mounts):
    """The whole run_dir on a full tmpfs, TensorBoard off: the first write to fail is metrics.jsonl's flush before
    the next checkpoint (30 steps of lines, more than the page a file's last write may still have room in), which
    names the file in one line."""
    fs = mounts(tmp_path / "fs", "8m")
    run_dir = fs / "run"
    config = _config(tmp_path, run_dir, tensorboard=False, every=30)
    rc, err = _fit_until_the_disk_fills(config, run_dir, fs, 30)
    assert rc == 2, err[-3000:]
    line = _error_line(err)
    assert line.startswith(f"fw: error: {run_dir / 'metrics.jsonl'}: no space left on device while writing the "
                           "run's metrics ("), line
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000030"]
    _resume_and_check(config, run_dir, fs / "filler")


def test_tensorboard_logger_whose_writer_thread_ended_raises_instead_of_waiting(tmp_path, monkeypatch):
    """tensorboardX queues events (10 at most) for its thread: with the thread gone, logging more than that
    raises a one-line error naming `logging.tensorboard`, and finalize returns, both without waiting for it."""
    from framework.loggers import RunTensorBoardLogger

    use_tensorboard_writer(monkeypatch, "tensorboardX")

    logger = RunTensorBoardLogger(tmp_path)
    events = logger.experiment.file_writer.event_writer
    events._worker.stop()   # the thread ends (as one that raised would)
    outcome: list[FwError | None] = []

    def log() -> None:
        try:
            for step in range(30):
                logger.log_metrics({"a": 1.0, "b": 2.0}, step=step)
            outcome.append(None)
        except FwError as e:
            outcome.append(e)
        logger.finalize("failed")

    thread = threading.Thread(target=log, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "log_metrics waits for a writer thread that has ended"
    (error,) = outcome
    assert isinstance(error, FwError) and "\n" not in str(error)
    assert str(error).startswith("logging.tensorboard: the thread writing ") and "has ended" in str(error)
