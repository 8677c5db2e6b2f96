"""`fw` as a process target whose stdout and stderr go to a file, for tests that read what it printed."""

from __future__ import annotations

import os
import sys


def run_logged(argv: list[str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from framework.cli import main

    sys.exit(main(argv))
