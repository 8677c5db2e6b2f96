"""Bad input that once ended in a traceback, a message without its line, or a config accepted with a meaning the
user did not write: each must be one line at FILE:LINE:COL naming the key, with exit code 2 (or, for an override's
raw text, a config that holds exactly that text). None of these starts a fit."""

import sys
from pathlib import Path

import pytest

from framework.cli import main
from framework.errors import FwError
from framework.jsonl import read_jsonl

GRPO = "recipe: grpo\nmodel:\n  policy: {preset: tiny}\ndata:\n  task: {name: digits}\n"
SFT = "recipe: sft\nmodel:\n  policy: {preset: tiny}\ndata:\n  path: d.jsonl\n  chat_template: false\n"
GOOD_ROW = '{"prompt": "1+1=", "completion": "2"}\n'


def fw(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def config(tmp_path: Path, text: str | bytes, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


# ------------------------------------------------------------------ JSONL data files

def sft_with_rows(tmp_path: Path, rows: str) -> str:
    (tmp_path / "d.jsonl").write_text(rows, encoding="utf-8")
    return config(tmp_path, SFT)


def test_a_number_longer_than_python_reads_is_a_bad_row(tmp_path, capsys):
    limit = sys.get_int_max_str_digits()   # 4300 unless PYTHONINTMAXSTRDIGITS says otherwise; 0: no limit
    if not limit:
        pytest.skip("this Python reads integers of any length")
    before = '{"prompt": "a", "completion": "b", "n": '
    path = sft_with_rows(tmp_path, GOOD_ROW + before + "9" * (limit + 1) + "}\n")
    data = tmp_path / "d.jsonl"
    assert fw(capsys, "validate", "--config", path) == (
        2, "", (f"{data}:2:{len(before) + 1}: data.path: not valid JSON (a number of more than {limit} digits, more "
               "than Python reads; write it as a string)\n"))


def test_a_row_nested_deeper_than_python_parses_is_a_bad_row(tmp_path, capsys):
    path = sft_with_rows(tmp_path, '{"prompt": "a", "completion": "b", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    data = tmp_path / "d.jsonl"
    assert fw(capsys, "validate", "--config", path) == (
        2, "", f"{data}:1:1: data.path: not valid JSON (nested too deeply to read)\n")


@pytest.mark.parametrize("recipe", ["sft", "grpo"])
def test_a_lone_surrogate_escape_is_a_bad_row(tmp_path, capsys, recipe):
    """JSON may escape half of a UTF-16 pair alone (`\\ud800`), which is no character: a tokenizer fails on it."""
    if recipe == "sft":
        path = sft_with_rows(tmp_path, GOOD_ROW + '{"prompt": "1+\\uD800=", "completion": "2"}\n')
    else:
        (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n'
                                          '{"prompt": "1+\\uD800=", "answer": "2"}\n')
        path = config(tmp_path, "recipe: grpo\nmodel:\n  policy: {preset: tiny}\ndata:\n  path: d.jsonl\n"
                                "  chat_template: false\n")
    data = tmp_path / "d.jsonl"
    assert fw(capsys, "validate", "--config", path) == (
        2, "", (f"{data}:2:15: data.path: not valid JSON text (\\uD800 is half of a UTF-16 surrogate pair, without its "
               "other half: no character)\n"))


def test_a_surrogate_pair_escape_is_its_character(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "\\ud83d\\ude00 \\\\ud800", "completion": "b"}\n')
    assert read_jsonl(tmp_path / "d.jsonl") == [(f"{tmp_path / 'd.jsonl'}:1", {"prompt": "\U0001f600 \\ud800",
                                                                              "completion": "b"})]


@pytest.mark.parametrize("row", ['{"n": ' + "9" * 50_000 + "}", '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}",
                                 '{"p": "\\udfff"}'], ids=["long number", "deep nesting", "lone surrogate"])
def test_fit_reads_such_rows_as_errors_of_their_line(tmp_path, row):
    (tmp_path / "d.jsonl").write_text(GOOD_ROW + row + "\n")
    with pytest.raises(FwError, match=rf"^{tmp_path / 'd.jsonl'}:2: not valid JSON"):
        read_jsonl(tmp_path / "d.jsonl")
