"""One `fw fit` per run directory: an exclusive `flock` on `<run_dir>/.lock`, held for the whole run.

Two runs in one directory would interleave their metrics and checkpoints. The lock file holds the
holder's pid, so the run that is refused can name it. The kernel drops the lock when the holder's
process ends, however it ends; the file itself stays (removing it would let a third run lock a new
file while a second still waits on the old one).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from types import TracebackType
from typing import final

from framework.errors import FwError

LOCK_FILE = ".lock"


@final
class RunLock:
    """Context manager holding `<run_dir>/.lock`; FwError naming the holder's pid when it is taken."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:   # read-only or special file systems, where access() says yes to root
            raise FwError(f"run_dir {self.run_dir}: cannot create {self.path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FwError(f"run_dir {self.run_dir}: cannot lock {self.path}: {exc.strerror}") from exc
            who = f"pid {holder}" if holder.isdigit() else "a process that is starting"
            raise FwError(f"run_dir {self.run_dir} is in use by another fw fit ({who}); wait for it to end or "
                          "choose another run_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd is not None:
            os.close(self._fd)   # releases the lock
            self._fd = None
