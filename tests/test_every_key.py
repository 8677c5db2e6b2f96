"""Bad values of config keys, in a config file or on the command line: `fw validate` exits 2 with one line at the
key (in the file, at its line; on the command line, naming the argument) that says what is expected.

The config files are written here, line by line, so the line of each key is known.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.cli import main


def _put(data: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        if not isinstance(data.get(key), dict):
            data[key] = {}
        data = data[key]
    data[path[-1]] = value


def _write(data: dict, path: Path) -> dict:
    """`data` as block YAML with JSON flow values; returns the line of every key."""
    lines: list[str] = []
    where: dict = {}

    def block(d: dict, prefix: tuple, indent: int) -> None:
        for key, value in d.items():
            where[prefix + (key,)] = len(lines) + 1
            if isinstance(value, dict) and value:
                lines.append(" " * indent + f"{key}:")
                block(value, prefix + (key,), indent + 2)
            else:
                lines.append(" " * indent + f"{key}: {json.dumps(value)}")
    block(data, (), 0)
    path.write_text("\n".join(lines) + "\n")
    return where


def _base(recipe: str, tmp: Path) -> dict:
    data = {"recipe": recipe, "run_dir": str(tmp / "run"), "model": {"policy": {"preset": "tiny"}}}
    if recipe == "sft":
        rows = [{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}] * 4
        (tmp / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        data["data"] = {"path": str(tmp / "chats.jsonl")}
    else:
        data["data"] = {"task": {"name": "digits"}, "chat_template": False}
        data["reward"] = {"name": "numeric_match"}
    return data


def _validate(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main(["validate", *argv])
    out, err = capsys.readouterr()
    assert out == "" or code == 0
    return code, err.splitlines()




@pytest.mark.parametrize("arg, expected", [
    ("--name=[1]", "name: expected a string, got a list"),
    ("--data.task.name={a: 1}", "data.task.name: expected a string or null, got a mapping"),
    ("--eval.path=[x.jsonl, 5]", "eval.path[1]: expected a string, got the number 5")])
def test_a_flow_list_or_mapping_on_the_command_line_is_one_for_a_string_key_too(tmp_path, capsys, arg, expected):
    """A list or mapping refused by a key that takes text was taken as the text spelling it: `--name=[1]` named the
    run '[1]', `--eval.path=[x.jsonl, 5]` looked for a file '[x.jsonl, 5]'. In a file each is refused."""
    config = tmp_path / "c.yaml"
    _write(_base("grpo", tmp_path), config)
    assert _validate(["--config", str(config), arg], capsys) == (2, [f"override '{arg}': {expected}"])


def test_a_data_path_given_on_the_command_line_over_a_task_is_shown_at_the_argument(tmp_path, capsys):
    base = _base("grpo", tmp_path)
    config = tmp_path / "base.yaml"
    task_line = _write(base, config)[("data", "task")]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1=", "answer": "2"}\n')
    code, lines = _validate(["--config", str(config), f"--data.path={prompts}"], capsys)
    assert (code, lines) == (2, [(f"override '--data.path={prompts}': data.path: set either data.task or "
                                  "data.path (JSONL), not both")])
    # written in the file, it is shown where the task is, as before
    both = tmp_path / "both.yaml"
    _write({**base, "data": {**base["data"], "path": str(prompts)}}, both)
    code, lines = _validate(["--config", str(both)], capsys)
    assert (code, lines) == (2, [(f"{both}:{task_line}:3: data.task: set either data.task or data.path "
                                  "(JSONL), not both")])
