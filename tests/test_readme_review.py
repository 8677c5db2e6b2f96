"""The README followed as a new user follows it: what a command says and does is what the README says it does."""

import os
import subprocess
import sys
from pathlib import Path

from framework.cli import main

REPO = Path(__file__).parents[1]

SFT = "recipe: sft\nmodel:\n  policy: {preset: tiny}\ndata:\n  path: d.jsonl\n"
GOOD = '{"prompt": "1+1=", "completion": "2"}\n'


def test_rows_before_a_byte_that_is_not_utf8_are_reported_before_it(tmp_path, capsys):
    """README: data files are checked row by row, a byte that is not UTF-8 ending its file's rows. The rows before
    it are text, so their problems are reported (at their lines, as in a UTF-8 file) and then the byte's."""
    data = tmp_path / "d.jsonl"
    data.write_bytes((GOOD + '{"prompt": "1+1="}\n' + "not json\n" + GOOD).encode() +
                     '{"prompt": "caf\xe9", "completion": "b"}\n'.encode("latin-1") + b"also not json\n")
    (tmp_path / "c.yaml").write_text(SFT)
    assert main(["validate", "--config", str(tmp_path / "c.yaml")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"{data}:2:1: data.path: expected a 'messages' list or 'prompt' and 'completion' keys, got keys ['prompt']",
        f"{data}:3:1: data.path: not valid JSON (Expecting value at column 1)",
        f"{data}:5:16: data.path: not UTF-8 (byte 0xe9); save the file as UTF-8",
    ]


def test_more_than_20_bad_rows_before_a_byte_that_is_not_utf8_are_counted(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"not json\n" * 23 + b"\xff\n")
    (tmp_path / "c.yaml").write_text(SFT)
    assert main(["validate", "--config", str(tmp_path / "c.yaml")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 22, lines
    bad_json = "data.path: not valid JSON (Expecting value at column 1)"
    assert lines[:20] == [f"{data}:{n}:1: {bad_json}" for n in range(1, 21)]
    assert lines[20:] == [f"{data}:24:1: data.path: not UTF-8 (byte 0xff); save the file as UTF-8",
                          f"{data}: data.path: 3 more bad rows not shown"]


def test_a_file_not_utf8_on_its_first_line_is_that_one_line(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "\xff"}\n' + GOOD.encode())
    (tmp_path / "c.yaml").write_text(SFT)
    assert main(["validate", "--config", str(tmp_path / "c.yaml")]) == 2
    assert capsys.readouterr().err == f"{data}:1:13: data.path: not UTF-8 (byte 0xff); save the file as UTF-8\n"


def test_a_bf16_mixed_fit_with_a_config_problem_says_that_problem_alone(tmp_path):
    """README: a config problem is one line, with exit code 2. fw fit checks its trainer settings on this machine
    by building Lightning's accelerator connector, which logs "Using bfloat16 Automatic Mixed Precision (AMP)";
    fw's own Trainer hides that line, and the check must too, or it comes before the problem."""
    (tmp_path / "c.yaml").write_text("recipe: grpo\nmodel:\n  policy: {preset: tiny}\ndata:\n  task: {name: digits}\n"
                                     "rollout: {max_new_tokens: 1}\ngrpo: {overlong: {buffer: 2}}\n"
                                     "trainer: {precision: bf16-mixed, accelerator: cpu}\n")
    shown = subprocess.run([sys.executable, "-m", "framework", "fit", "--config", str(tmp_path / "c.yaml"),
                            f"--run_dir={tmp_path / 'run'}"], check=False, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    assert (shown.returncode, shown.stdout) == (2, ""), shown
    assert shown.stderr == (f"{tmp_path / 'c.yaml'}:7:27: grpo.overlong.buffer: 2 exceeds rollout.max_new_tokens (1); "
                            "the penalty ramps over the last `buffer` tokens a completion may have\n"), shown.stderr
    assert not (tmp_path / "run").exists()
