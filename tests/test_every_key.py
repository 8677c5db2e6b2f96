"""Every key of the schema, given a bad value in a config file or on the command line: `fw validate` exits 2 with one
line at that key (in the file, at its line; on the command line, naming the argument) that says what is expected,
and no traceback.

The bad values are chosen by walking the schema file itself and kept only where the `jsonschema` library rejects
them for the key's own schema; the config files are written here, line by line, so the line of each key is known.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from framework.cli import main

SCHEMA = json.loads((Path(__file__).parents[1] / "schemas" / "train.schema.json").read_text())
RECIPES = ("sft", "grpo", "ppo")
# a message that says what the key takes, or what is wrong with the key itself
# (`is not allowed here: ` is followed by the key's description, which says it)
EXPECTED = re.compile(r"expected|must|needs|unknown key|missing required key|is not a dotted import path|"
                      r"is not allowed here: ")
# values of each JSON type, of which the first two that the key's schema rejects are tried
WRONG_TYPES = ["abc", 1.5, True, None, [1], 5, {"x": 1}]


def _types(sub: dict) -> list:
    t = sub.get("type", [])
    return t if isinstance(t, list) else [t]


def _out_of_range(sub: dict) -> list:
    """Values just past the key's bounds, not among its choices, empty, or off its pattern."""
    step = 1 if _types(sub) == ["integer"] or _types(sub) == ["integer", "null"] else 0.5
    out = [sub["minimum"] - step] if "minimum" in sub else []
    out += [sub["maximum"] + step] if "maximum" in sub else []
    out += [sub[k] for k in ("exclusiveMinimum", "exclusiveMaximum") if k in sub]
    if "enum" in sub:
        out.append(12 if all(type(v) is int for v in sub["enum"]) else "bogus_choice")
    if "anyOf" in sub:   # rollout.temperature's 0 or >= 1e-5, trainer.devices' 'auto', a count or a list
        out += [-2, 1e-6, 0, []]
    out += ["", "not a path"] if "minLength" in sub or "pattern" in sub else []
    items = sub.get("items") if isinstance(sub.get("items"), dict) else None
    if items and "properties" not in items:
        n = sub.get("minItems", 1)
        out += [[v] * n for v in ("abc", "", -1, 1, "bogus_item")]
        out += [[0.5] * (sub["minItems"] - 1)] if "minItems" in sub else []
        out += [[0.5] * (sub["maxItems"] + 1)] if "maxItems" in sub else []
    return out


def _keys(node: dict, prefix: tuple = ()) -> list[tuple[tuple, dict]]:
    out = []
    for key, sub in node.get("properties", {}).items():
        out.append((prefix + (key,), sub))
        out += _keys(sub, prefix + (key,))
    return out


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


def _cases(recipe: str) -> list[tuple[tuple, object, bool]]:
    """(key path, bad value, whether to give it on the command line too) of the keys of `recipe`'s section, and
    under grpo of every key outside the recipe sections too."""
    out = []
    for path, sub in _keys(SCHEMA):
        if path == ("recipe",) or (path[0] in RECIPES) != (path[0] == recipe) or \
                (recipe != "grpo" and path[0] not in RECIPES):
            continue
        valid = Draft202012Validator(sub).is_valid
        # a section's unknown key is a case of its own, below
        wrong = [v for v in WRONG_TYPES if not valid(v) and not (isinstance(v, dict) and "properties" in sub)]
        bad = wrong[:2] + [v for v in _out_of_range(sub) if not valid(v)]
        # on the command line, a scalar's text that the key takes as a string is that string (`--name=123`)
        shown = [v for v in bad if isinstance(v, (list, dict)) or not valid(json.dumps(v))]
        first = bad.index(shown[0]) if shown else -1
        out += [(path, v, i == first) for i, v in enumerate(bad)]
        if "properties" in sub:
            out.append((path + ("bogus_key",), 1, True))
    return out


def _validate(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main(["validate", *argv])
    out, err = capsys.readouterr()
    assert out == "" or code == 0
    return code, err.splitlines()


def _deviation(code: int, lines: list[str], where: str, dotted: str) -> str | None:
    """What is wrong with the answer to a bad value of `dotted`, whose lines should start with regex `where`."""
    if code != 2:
        return f"exit code {code}"
    if any("Traceback" in line for line in lines):
        return "a traceback"
    # one line; for a list, one at the list and one at each of its bad items at most (optimizer.betas: [1, 1])
    at = re.compile(where + re.escape(dotted) + r"(\[\d+\])?: ")
    places = {m.group(1) for m in map(at.match, lines) if m}
    if not lines or len(lines) != max(1, len(places)):
        return f"{len(lines)} lines"
    for line in lines:
        if not at.match(line):
            return "not at the key"
        if not EXPECTED.search(line):
            return "does not say what is expected"
    return None


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_key_with_a_bad_value(recipe, tmp_path, capsys):
    base = _base(recipe, tmp_path)
    config = tmp_path / "base.yaml"
    _write(base, config)
    code, lines = _validate(["--config", str(config)], capsys)
    assert code == 0, lines
    wrong = []
    for n, (path, value, on_command_line) in enumerate(_cases(recipe)):
        data = copy.deepcopy(base)
        policy = data["model"]["policy"]
        if path[:2] == ("model", "policy") and path[2:] in (("path",), ("preset",)):
            policy.pop("preset" if path[2] == "path" else "path", None)   # one of the two, as the schema wants
        if path[:3] == ("data", "task", "class_path") or path == ("reward", "class_path"):
            (data["data"]["task"] if path[0] == "data" else data["reward"]).pop("name")   # one of the two
        _put(data, path, value)
        dotted = ".".join(path)
        bad = tmp_path / f"bad{n}.yaml"
        line = _write(data, bad)[path]
        code, lines = _validate(["--config", str(bad)], capsys)
        problem = _deviation(code, lines, re.escape(f"{bad}:{line}:") + r"\d+: ", dotted)
        if problem:
            wrong.append(f"{dotted}: {value!r} in a file: {problem}: {lines}")
        if on_command_line and path[:2] not in (("model", "policy"), ("data", "task"), ("reward", "class_path")):
            arg = f"--{dotted}={json.dumps(value)}"
            code, lines = _validate(["--config", str(config), arg], capsys)
            problem = _deviation(code, lines, re.escape(f"override '{arg}': "), dotted)
            if problem:
                wrong.append(f"{arg}: {problem}: {lines}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("key, value, expected", [
    (("rollout", "block_size"), 12.5,
     "expected one of 8, 16, 32, 64, 128; got the number 12.5; the nearest allowed are 8 and 16"),
    (("rollout", "keep_engine"), None, "expected one of auto, true, false; got null"),
    (("grpo", "group_size"), 1.5, "expected an integer, got the number 1.5"),
    (("reward", "name"), "", "must not be empty")],
    ids=["choices and a type", "choices and types", "a type and a minimum", "empty registry name"])
def test_a_value_that_fails_several_rules_of_its_key_is_one_line(tmp_path, capsys, key, value, expected):
    """Each rule of a key that a value breaks was a line of its own: `block_size: 12.5` was not an integer and not
    one of the choices, `group_size: 1.5` not an integer and below 2, `name: ''` empty and no built-in."""
    data = _base("grpo", tmp_path)
    _put(data, key, value)
    config = tmp_path / "c.yaml"
    line = _write(data, config)[key]
    col = len(f"  {key[-1]}: ") + 1
    assert _validate(["--config", str(config)], capsys) == (2, [f"{config}:{line}:{col}: {'.'.join(key)}: {expected}"])
    arg = f"--{'.'.join(key)}={json.dumps(value)}"
    assert _validate(["--config", str(config), arg], capsys) == (2, [f"override '{arg}': {'.'.join(key)}: {expected}"])


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


def test_a_check_of_several_keys_shows_at_a_written_one_rather_than_a_default(tmp_path, capsys):
    """minibatches x accumulate_grad_batches against the rollout batch: with grpo.minibatches left to its default and
    trainer.accumulate_grad_batches written, the problem was shown as grpo.minibatches at the line of grpo's first
    key (group_size), a line that sets neither."""
    data = _base("grpo", tmp_path)
    data["rollout"] = {"prompts_per_step": 2}
    data["grpo"] = {"group_size": 2}
    data["trainer"] = {"accumulate_grad_batches": 8}
    config = tmp_path / "c.yaml"
    line = _write(data, config)[("trainer", "accumulate_grad_batches")]
    message = ("1 minibatches x trainer.accumulate_grad_batches (8) exceeds the 4 samples of one rollout batch "
               "(rollout.prompts_per_step x grpo.group_size)")
    assert _validate(["--config", str(config)], capsys) == (2, [
        f"{config}:{line}:28: trainer.accumulate_grad_batches: {message}"])
