"""A corpus of broken configs: each must fail `fw validate` with exit code 2, one line per problem
at FILE:LINE:COL with the key path, and no traceback.

Each file in tests/bad_configs/ states what it expects in trailing comments:
`# expect: LINE:COL: key.path: message` (one per problem, in order; `…` stands for any text; a line not
starting with a digit is matched as it is, e.g. for overrides) and optionally `# args: --a.b=v ...`.
"""

import shlex
from pathlib import Path

import pytest

from framework.cli import main

CORPUS = Path(__file__).parent / "bad_configs"
FILES = sorted(CORPUS.glob("*.yaml"))


def expectations(path: Path) -> tuple[list[str], list[str]]:
    expects, args = [], []
    for line in path.read_text().splitlines():
        if line.startswith("# expect: "):
            text = line[len("# expect: "):]
            expects.append(f"{path}:{text}" if text[:1].isdigit() else text)
        elif line.startswith("# args: "):
            args += shlex.split(line[len("# args: "):])
    return expects, args


def matches(line: str, pattern: str) -> bool:
    """`pattern` with `…` gaps: the first piece starts the line, the rest follow in order."""
    pieces = pattern.split("…")
    if not line.startswith(pieces[0]):
        return False
    pos = len(pieces[0])
    for piece in pieces[1:]:
        found = line.find(piece, pos)
        if found < 0:
            return False
        pos = found + len(piece)
    return pos == len(line) or pattern.endswith("…")


def run_fw(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_corpus_is_big_enough():
    assert len(FILES) >= 25
    for path in FILES:
        assert expectations(path)[0], f"{path.name} states no expected error"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_bad_config(path, capsys):
    expects, args = expectations(path)
    code, out, err = run_fw(["validate", "--config", str(path), *args], capsys)
    lines = err.splitlines()
    assert code == 2, err
    assert out == ""
    assert "Traceback" not in err
    assert len(lines) == len(expects), err
    for line, pattern in zip(lines, expects, strict=True):
        assert matches(line, pattern), f"\n got: {line}\nwant: {pattern}"


def test_missing_config_file(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert run_fw(["validate", "--config", str(missing)], capsys) == (2, "", f"{missing}: config file not found\n")


def test_directory_as_config(tmp_path, capsys):
    code, _, err = run_fw(["validate", "--config", str(tmp_path)], capsys)
    assert (code, err) == (2, f"{tmp_path}: is a directory, expected a YAML config file\n")


def test_problem_in_the_second_of_two_configs(tmp_path, capsys):
    first = CORPUS.parent.parent / "train.yaml"
    second = tmp_path / "more.yaml"
    second.write_text("trainer:\n  max_steps: -5\n")
    code, _, err = run_fw(["validate", "--config", str(first), "--config", str(second)], capsys)
    assert (code, err) == (2, f"{second}:2:14: trainer.max_steps: must be >= 1, got -5\n")


def test_override_repairs_a_bad_file(capsys):
    path = CORPUS / "wrong_type_integer.yaml"
    code, out, err = run_fw(["validate", "--config", str(path), "--trainer.max_steps=10", "--data.task.name=digits"],
                            capsys)
    assert (code, err) == (0, "")
    assert out == f"{path}: valid (recipe grpo)\n"
