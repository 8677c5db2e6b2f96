"""One `fw fit` per run directory: an exclusive `flock` on `<run_dir>/.lock`, held for the whole run.

Two runs in one directory would interleave their metrics and checkpoints. The lock file holds the
holder's pid, so the run that is refused can name it. The kernel drops the lock when the holder's
process ends, however it ends; the file itself stays (removing it would let a third run lock a new
file while a second still waits on the old one).

Global rank 0 takes the lock. The other processes of a multi-process run look at it once, before the process group
exists (`refuse_another_run`): under a launcher that starts every rank itself (torchrun, srun, a start by hand on
each node) they would otherwise wait in the process group's set-up, which outlasts SIGTERM, until its timeout when
rank 0 ends on a busy run_dir. Besides its pid the holder writes a token of its own, which the processes that
Lightning starts from it inherit, and the identity of its launch from the environment, the same on every rank of
one launch and on every host, so that a rank tells its own job's rank 0 from another run without a pid.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import final

from framework.errors import FwError

LOCK_FILE = ".lock"
TOKEN_ENV = "FW_RUN_LOCK"   # the token of the lock this process holds, for the ranks Lightning starts from it
# what every rank of one launch shares, and another launch differs in (its job, its step, its restart, its store)
LAUNCH_KEYS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_STEP_ID",
               "SLURM_RESTART_COUNT", "LSB_JOBID", "MASTER_ADDR", "MASTER_PORT")
SETTLE_S = 2.0       # how long another header may stand before a rank > 0 calls it another run's, not rank 0's
POLL_S = 0.05        # how often a rank > 0 reads the lock file meanwhile
CONTENDED_S = 1.0    # how long rank 0 retries a lock that only the other ranks' probes hold


def launch_identity() -> str:
    """What the launcher's environment says this job is; "" where it says nothing (fw's own launch)."""
    return " ".join(f"{k}={os.environ[k]}" for k in LAUNCH_KEYS if os.environ.get(k)).replace("\n", " ")


def _in_use(run_dir: Path, holder: str) -> FwError:
    who = f"pid {holder}" if holder.isdigit() else "a process that is starting"
    return FwError(f"run_dir {run_dir} is in use by another fw fit ({who}); wait for it to end or choose another "
                   "run_dir")


@final
class RunLock:
    """Context manager holding `<run_dir>/.lock`; FwError naming the holder's pid when it is taken."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._token_before: str | None = None

    def __enter__(self) -> RunLock:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:   # read-only or special file systems, where access() says yes to root
            raise FwError(f"run_dir {self.run_dir}: cannot create {self.path}: {exc.strerror or exc}") from None
        launch = launch_identity()
        deadline = time.monotonic() + CONTENDED_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                busy = exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
                if busy and time.monotonic() < deadline and _only_probed(fd):
                    time.sleep(0.01)
                    continue
                holder = os.pread(fd, 64, 0).decode(errors="replace").partition("\n")[0].strip()
                os.close(fd)
                if not busy:
                    raise FwError(f"run_dir {self.run_dir}: cannot lock {self.path}: {exc.strerror}") from exc
                raise _in_use(self.run_dir, holder) from None
        token = uuid.uuid4().hex
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{token}\n{launch}\n".encode(), 0)
        self._fd = fd
        self._token_before = os.environ.get(TOKEN_ENV)
        os.environ[TOKEN_ENV] = token
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd is not None:
            os.close(self._fd)   # releases the lock
            self._fd = None
            if self._token_before is None:
                os.environ.pop(TOKEN_ENV, None)
            else:
                os.environ[TOKEN_ENV] = self._token_before


def _only_probed(fd: int) -> bool:
    """Whether the lock that refused an exclusive lock on `fd` is held only shared: by the other ranks' probes
    (`_held`), which end at once, and not by another run."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _read(path: Path) -> list[str] | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FwError(f"run_dir {path.parent}: cannot read {path}: {exc.strerror or exc}") from None


def _held(path: Path) -> bool:
    """Whether a process holds the lock: a shared lock taken and dropped at once, which a holder's exclusive lock
    refuses (rank 0 retries its own for a moment, so that this probe cannot refuse it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise FwError(f"run_dir {path.parent}: cannot read {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise FwError(f"run_dir {path.parent}: cannot lock {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)   # drops the shared lock
    return False


def refuse_another_run(run_dir: str | os.PathLike, settle_s: float = SETTLE_S) -> None:
    """On a process of global rank > 0, before the process group exists: FwError with rank 0's line when another
    run holds `<run_dir>/.lock`. A lock that is free, a file that does not exist (a run_dir local to each node),
    or no launch identity to judge by: it goes on, as rank 0 takes the lock or ends with its own line."""
    path = Path(run_dir) / LOCK_FILE
    token, launch = os.environ.get(TOKEN_ENV), launch_identity()
    if not (token or launch):   # nothing to tell this job's rank 0 from another run by
        return
    deadline = time.monotonic() + settle_s
    while True:
        lines = _read(path)
        if lines is None or not _held(path):
            return
        if (token and lines[1:2] == [token]) or (launch and lines[2:3] == [launch]):
            return
        # held under another header: another run's, unless this job's rank 0 is writing its own just now
        if time.monotonic() >= deadline and _read(path) == lines:
            raise _in_use(Path(run_dir), lines[0].strip() if lines else "")
        time.sleep(POLL_S)
