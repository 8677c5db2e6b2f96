"""JSONL files: every record with its FILE:LINE location, for error messages that point at the line."""

from __future__ import annotations

import json
from pathlib import Path

from framework.errors import FwError


def read_jsonl(path: str | Path) -> list[tuple[str, dict]]:
    """Every record of a JSONL file with its `FILE:LINE` location; blank lines are skipped."""
    records = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise FwError(f"data.path: cannot read {path}: {e.strerror or e}") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise FwError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise FwError(f"{where}: expected a JSON object, got {type(record).__name__}")
        records.append((where, record))
    return records
