"""JSONL files: every record with its FILE:LINE location, for error messages that point at the line."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from framework.errors import FwError


class NotUtf8(FwError):
    """A file with a byte that is not UTF-8, at `line` and `col` (1-based), and why (`reason`)."""

    def __init__(self, path: str | Path, line: int, col: int, reason: str):
        self.path, self.line, self.col, self.reason = str(path), line, col, reason
        super().__init__(f"{path}:{line}:{col}: {reason}")


# The first bytes of the binary files data is often shipped in, with what each is and what to do with it. A text file
# may begin with them too, so they name a file only when it is not UTF-8.
CONTAINERS = (
    (b"\x1f\x8b", "a gzip-compressed file", "decompress it (gunzip)"),
    (b"BZh", "a bzip2-compressed file", "decompress it (bunzip2)"),
    (b"\xfd7zXZ\x00", "an xz-compressed file", "decompress it (unxz)"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "decompress it (unzstd)"),
    (b"PK\x03\x04", "a zip archive", "extract it (unzip)"),
    (b"PAR1", "a Parquet file", "convert it"),
)


@dataclass(frozen=True)
class Row:
    """One non-blank line: its record, or why it is not a JSON object (`problem`, at `col`)."""

    line: int
    col: int
    record: dict | None
    problem: str | None


def json_type_name(value: object) -> str:
    """What a parsed JSON value is, in JSON's words (`an array`, `a string`, `null`), for messages about data."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    names = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def decode_utf8(raw: bytes, path: str | Path, text: str = "UTF-8 text") -> str:
    """`raw` (the bytes of file `path`) as text; NotUtf8 at the line and column of the first byte that is not UTF-8,
    or at 1:1 naming a compressed file or archive (`CONTAINERS`), which is not the `text` expected of it."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        for magic, what, fix in CONTAINERS:
            if raw.startswith(magic):
                raise NotUtf8(path, 1, 1, f"{what}, not {text}; {fix} first") from None
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise NotUtf8(path, line, col, f"not UTF-8 (byte 0x{raw[e.start]:02x}); save the file as UTF-8") from None


def _text(path: str | Path, key: str) -> tuple[str, NotUtf8 | None]:
    """The file as text, without the byte-order mark some editors begin UTF-8 files with, and None; or, for a file
    with a byte that is not UTF-8, the text of the lines before the byte's and the NotUtf8 at its line and column.
    FwError naming config key `key` when the file cannot be read."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise FwError(f"{key}: cannot read {path}: {e.strerror or e}") from None
    try:
        return decode_utf8(raw, path, "JSON Lines text (one JSON object per line)").removeprefix("\ufeff"), None
    except NotUtf8 as e:
        # the lines before the byte's decode: their rows are read (and their problems reported) before the byte
        before = b"\n".join(raw.split(b"\n")[:e.line - 1]) if e.line > 1 else b""
        return before.decode("utf-8").removeprefix("\ufeff"), e


# A `\u` escape of half of a UTF-16 surrogate pair (after an even number of backslashes, so not the text `\\u...`):
# json joins a high and a low half into one character, and reads a half alone into a str that is no text (no
# encoding writes it, a tokenizer refuses it).
_HALVES = re.compile(r"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
                     r"|\\u[dD][89a-fA-F][0-9a-fA-F]{2})")


class _Duplicate(Exception):
    """A JSON object with a key written twice: json keeps the last value and drops the first unsaid."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's pairs as a dict; _Duplicate when a key is written twice."""
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Duplicate(key)
            seen.add(key)
    return record


def _parse(line: str) -> tuple[object, int, str | None]:
    """(the line's JSON value, 0, None), or (None, the 1-based column, why it cannot be read)."""
    try:
        value = json.loads(line, object_pairs_hook=_unique)
    except _Duplicate as e:
        return None, 1, (f"duplicate key {e.key!r} in a JSON object: a reader keeps one of its values and drops the "
                         "other; write the key once")
    except json.JSONDecodeError as e:
        # some messages end in "at", which the column completes ("Unterminated string starting at")
        return None, e.colno, f"not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
    except RecursionError:
        return None, 1, "not valid JSON (nested too deeply to read)"
    except ValueError:   # int() refuses more than sys.get_int_max_str_digits() digits
        limit = sys.get_int_max_str_digits()
        long = re.search(rf"\d{{{limit + 1},}}", line)
        return None, long.start() + 1 if long else 1, (f"not valid JSON (a number of more than {limit} digits, more "
                                                       "than Python reads; write it as a string)")
    lone = next((m for m in _HALVES.finditer(line) if len(m.group(1)) == 6), None) if "\\u" in line else None
    if lone is not None:
        return None, lone.start(1) + 1, (f"not valid JSON text ({lone.group(1)} is half of a UTF-16 surrogate pair, "
                                         "without its other half: no character)")
    return value, 0, None


def rows(path: str | Path, key: str = "data.path") -> Iterator[Row]:
    """Every non-blank line of a JSONL file, parsed; FwError if the file cannot be read (naming `key`, the config key
    that named the file), NotUtf8 after the rows before a byte that is not UTF-8."""
    text, not_utf8 = _text(path, key)
    # JSON strings may hold U+2028, U+2029 and U+0085 raw, which str.splitlines() would also split at
    for lineno, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        record, col, problem = _parse(line)
        if problem:
            yield Row(lineno, col, None, problem)
            continue
        if not isinstance(record, dict):
            yield Row(lineno, 1, None, f"expected a JSON object, got {json_type_name(record)}")
            continue
        yield Row(lineno, 1, record, None)
    if not_utf8 is not None:
        raise not_utf8


def read_jsonl(path: str | Path, key: str = "data.path") -> list[tuple[str, dict]]:
    """Every record of a JSONL file with its `FILE:LINE` location; blank lines are skipped. `key` is the config key
    that named the file, for the error when it cannot be read."""
    records = []
    for row in rows(path, key):
        where = f"{path}:{row.line}"
        if row.problem:
            raise FwError(f"{where}: {row.problem}")
        records.append((where, row.record))
    return records
