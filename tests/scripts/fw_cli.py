"""`fw` as a process target: the exit code of `framework.cli.main(argv)` becomes the process's."""

from __future__ import annotations

import sys


def run(argv: list[str]) -> None:
    from framework.cli import main

    sys.exit(main(argv))


if __name__ == "__main__":
    run(sys.argv[1:])
