"""User-facing errors: the CLI prints them without a traceback and exits with code 2."""

from __future__ import annotations

from dataclasses import dataclass


class FwError(Exception):
    """A problem caused by the user's input (config, paths, arguments); its message is the whole story.

    `every_rank`: every process of a multi-process job raised it together (`raise_on_every_rank`), its message
    naming the rank that failed. `quiet`: such an error on a process other than global rank 0, which leaves the
    line to global rank 0 (the CLI exits 2 without printing it)."""

    every_rank: bool = False
    quiet: bool = False


class DiskFull(FwError):
    """A run file (a checkpoint's, a log's) found no room while it was written: the file system ran out of space
    (or quota), or the file reached the process's file size limit (`ulimit -f`)."""


def what_raised(e: BaseException) -> str:
    """What user code did, for a message that names the call: `raised ValueError: ...` or `called sys.exit(7)`."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    return f"raised {type(e).__name__}: {e}"


def raise_on_every_rank(error: FwError | None, collective: bool) -> None:
    """Raise `error` (when not None). With `collective` under several processes a collective instead (call it at
    the same point on every rank): every rank raises the failure of the lowest rank that failed, naming it, so that
    no rank is left waiting in a collective the failed one never reaches; on ranks other than global rank 0 the
    error is `quiet`."""
    import torch.distributed as dist

    if not (collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        if error is not None:
            raise error
        return
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if error is None else str(error))
    failed = [rank for rank, message in enumerate(found) if message is not None]
    if not failed:
        return
    also = ""
    if len(failed) > 1:
        also = f" (global rank{'s' if len(failed) > 2 else ''} {', '.join(map(str, failed[1:]))} too)"
    shared = FwError(f"global rank {failed[0]}{also}: {found[failed[0]]}")
    shared.every_rank = True
    shared.quiet = dist.get_rank() != 0
    raise shared from error


@dataclass(frozen=True)
class Problem:
    """One problem in a config: where it was written and what is wrong."""

    file: str  # a config file path, "<override>" style label, or "<dict>" for Python-built configs
    line: int | None  # 1-based; None when there is no position (e.g. a missing file)
    col: int | None  # 1-based
    key_path: str  # dotted path like "trainer.max_steps"; "" for the whole document
    message: str

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}:{self.col if self.col is not None else 1}"
        key = f" {self.key_path}:" if self.key_path else ""
        return f"{where}:{key} {self.message}"


class ConfigError(FwError):
    """Every problem found in a config; str() gives one `FILE:LINE:COL: key.path: message` line each."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))
