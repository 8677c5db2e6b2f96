"""User-facing errors: the CLI prints them without a traceback and exits with code 2."""

from __future__ import annotations

from dataclasses import dataclass


class FwError(Exception):
    """A problem caused by the user's input (config, paths, arguments); its message is the whole story.

    `quiet`: every process of a multi-process job raised it together, and this one leaves the line to global
    rank 0 (the CLI exits 2 without printing it)."""

    quiet: bool = False


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
