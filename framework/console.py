"""fw's lines on stderr, each a line of its own above the progress bar during a fit.

Lightning's bar (tqdm) is drawn on stdout and leaves its line unfinished, and a terminal shows stdout and stderr on
one screen, so a plain print to stderr during a fit lands after the bar on the same line. `say` clears tqdm's bars
while it writes (tqdm's `external_write_mode`) and draws them again below the line; with no bar it prints the line
as `print(line, file=sys.stderr)` does. `last_resort_above_bars` makes the logging records that no handler takes
(fw's reward warnings, unless the user configures logging) go the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from tqdm import tqdm


def hand_started_node() -> int:
    """The node of a job started by hand on each node: NODE_RANK (or GROUP_RANK) where no launcher numbers the
    processes itself (RANK, SLURM_PROCID, JSM_NAMESPACE_RANK), else 0."""
    if any(k in os.environ for k in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")):
        return 0
    return int(os.environ.get("NODE_RANK") or os.environ.get("GROUP_RANK") or 0)


def first_process() -> bool:
    """Whether this is the job's first process, the one that speaks: Lightning's `rank_zero_only.rank` once Lightning
    is imported (a fit numbers its processes there), else the guess Lightning makes at import from the launcher's
    variables, read without importing it (seconds of `fw validate`'s time for a warning). A process of a later node
    of a job started by hand on each node (NODE_RANK above 0, no launcher's RANK) is never the first, though
    Lightning's guess says so until the fit numbers it (framework/trainer.py)."""
    if hand_started_node() > 0:
        return False
    if "lightning.fabric" in sys.modules:   # the same object as lightning.pytorch's
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        return rank_zero_only.rank == 0
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):   # Lightning's order
        if os.environ.get(key) is not None:
            return int(os.environ[key]) == 0
    return True


def say(line: str, flush: bool = False) -> None:
    """`line` on stderr, as `print(line, file=sys.stderr, flush=flush)` writes it, on a line of its own above any
    tqdm progress bar on the terminal: the bars are cleared while it is written and drawn again below it."""
    with tqdm.external_write_mode(file=sys.stderr):
        print(line, file=sys.stderr, flush=flush)


class _SayHandler(logging.Handler):
    """Python's handler of last resort (`logging.lastResort`: the record's message on stderr, from WARNING up),
    writing through `say`."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            say(self.format(record), flush=True)   # a StreamHandler flushes each record
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - as logging's own handlers do: a failed write is reported, not raised
            self.handleError(record)


@contextlib.contextmanager
def last_resort_above_bars() -> Iterator[None]:
    """While inside, a logging record that no handler takes is written by `say` instead of `logging.lastResort`;
    a user's logging configuration (any handler on the record's way) takes records as before."""
    before = logging.lastResort
    if before is not None:   # None: a user's choice, which Python's own handling of such records follows
        logging.lastResort = _SayHandler(before.level)
    try:
        yield
    finally:
        logging.lastResort = before
