"""Bad input that once ended in a traceback, a message without its line, or a config accepted with a meaning the
user did not write: each must be one line at FILE:LINE:COL naming the key, with exit code 2 (or, for an override's
raw text, a config that holds exactly that text). None of these starts a fit."""

import sys
from pathlib import Path

import pytest

from framework import yaml12
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


# ------------------------------------------------------------------ the config file's text

@pytest.mark.parametrize("char", ["\x00", "\x1b", "\x7f", "\ufffe"])
def test_a_character_yaml_refuses_is_one_line_at_its_position(tmp_path, capsys, char):
    """PyYAML's reader refuses control characters (a pasted terminal colour, a NUL) before parsing, with an error
    that has no position."""
    path = config(tmp_path, GRPO + f"name: ab{char}c\n")
    code = ord(char)
    assert fw(capsys, "validate", "--config", path) == (
        2, "", (f"{path}:6:9: YAML syntax error: the character U+{code:04X} is not allowed in YAML text; remove it, or "
               f'write it as the escape "\\u{code:04x}" inside double quotes\n'))


def test_the_escape_that_the_message_suggests_reads_back_as_the_character(tmp_path):
    assert yaml12.load('name: "ab\\u001bc"\n') == {"name": "ab\x1bc"}


def test_a_line_counts_from_the_breaks_yaml_counts(tmp_path, capsys):
    path = config(tmp_path, GRPO.replace("\n", "\r\n") + "seed: 1\r\nname: x\x07\r\n")
    code, _, err = fw(capsys, "validate", "--config", path)
    assert (code, err.split(": YAML")[0]) == (2, f"{path}:7:8")


@pytest.mark.parametrize("value", ["ab\x01c", "caf\udce9"])   # \udce9: a Latin-1 byte in argv on a UTF-8 system
def test_an_override_holding_a_character_yaml_refuses_is_its_text(tmp_path, capsys, value):
    path = config(tmp_path, GRPO)
    code, out, err = fw(capsys, "print-config", "--config", path, f"--name={value}")
    assert (code, err) == (0, "")
    assert yaml12.load(out)["name"] == value


def test_a_config_file_not_in_utf8_is_named_at_the_line_and_column_of_the_byte(tmp_path, capsys):
    path = config(tmp_path, (GRPO + "name: caf\xe9\n").encode("latin-1"))
    assert fw(capsys, "validate", "--config", path) == (
        2, "", f"{path}:6:10: not UTF-8 (byte 0xe9); save the file as UTF-8\n")


def test_an_empty_later_config_file_is_not_asked_for_recipe_and_model(tmp_path, capsys):
    """The first file holds them; a later file (an overlay whose every line is commented out) needs neither."""
    first, later = config(tmp_path, GRPO), config(tmp_path, "# seed: 3\n", "later.yaml")
    code, _, err = fw(capsys, "validate", "--config", first, "--config", later)
    assert (code, err) == (2, (f"{later}:1:1: the config file is empty; a later --config is merged over the earlier "
                              "ones: give it a key to change, or leave it out\n"))
    code, _, err = fw(capsys, "validate", "--config", later)
    assert (code, err) == (2, (f"{later}:1:1: the config file is empty; expected a mapping with at least 'recipe' and "
                              "'model'\n"))


# ------------------------------------------------------------------ overrides

@pytest.mark.parametrize("key", ["name", "run_dir"])
def test_an_override_of_a_quoted_empty_string_is_empty(tmp_path, capsys, key):
    """`--name=''` is the empty string, as `name: ''` is in a file; it once became the two quote characters (a run
    directory named '')."""
    path = config(tmp_path, GRPO)
    assert fw(capsys, "validate", "--config", path, f"--{key}=''") == (
        2, "", f"override '--{key}=''': {key}: must not be empty\n")


def test_an_override_of_a_number_for_a_string_key_stays_its_text(tmp_path, capsys):
    path = config(tmp_path, GRPO)
    code, out, err = fw(capsys, "print-config", "--config", path, "--name=007", '--run_dir="x y"')
    assert (code, err) == (0, "")
    printed = yaml12.load(out)
    assert (printed["name"], Path(printed["run_dir"]).name) == ("007", "x y")


# ------------------------------------------------------------------ keys and values as messages show them

@pytest.mark.parametrize("text, expected", [
    ("1: 2\n", "6:1: 1: unknown key '1' (allowed here: recipe, seed, "),
    ("trainer:\n  true: 1\n", "7:3: trainer.true: unknown key 'true' (allowed here: accelerator, "),
    ("null: 1\n", "6:1: null: unknown key 'null' (allowed here: recipe, "),
    ("trainer:\n  1: 1\n  1: 2\n", "8:3: trainer.1: duplicate key '1' (first defined at line 7)"),
    ("trainer:\n  false: 1\n  false: 2\n", "8:3: trainer.false: duplicate key 'false' (first defined at line 7)")],
    ids=["int", "bool", "null", "duplicate int", "duplicate bool"])
def test_a_key_yaml_reads_as_no_string_is_named_as_written(tmp_path, capsys, text, expected):
    """`1:` was shown as the list index `[1]`, `true:` as `trainer[True]`, `null:` as `None`."""
    path = config(tmp_path, GRPO + text)
    code, _, err = fw(capsys, "validate", "--config", path)
    assert code == 2 and err.startswith(f"{path}:{expected}") and len(err.splitlines()) == 1, err


def test_a_long_wrong_string_is_quoted_cut_short(tmp_path, capsys):
    """A text pasted under the wrong key was quoted whole: a message line of any length."""
    path = config(tmp_path, GRPO + f"seed: {'x' * 200_000}\n")
    assert fw(capsys, "validate", "--config", path) == (
        2, "", f"{path}:6:7: seed: expected an integer, got the string '{'x' * 100}…'\n")


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


# ------------------------------------------------------------------ plug-ins

REWARDS = """
class NoMetadata:
    def __call__(self, prompt, completion):
        return 1.0

class BadBatch:
    def __call__(self, prompt, completion, metadata):
        return 1.0
    def batch(self, completions):
        return [1.0] * len(completions)

class Flexible:
    def __call__(self, *args, **kwargs):
        return 1.0

class KeywordsOnly:
    def batch(self, prompts, completions, metadatas, *, scale=1.0):
        return [scale] * len(prompts)
"""


@pytest.mark.parametrize("name, expected", [
    ("NoMetadata", ("reward.class_path: bad_sig_rewards.NoMetadata builds a reward that fw cannot call as it scores "
                   "a sample, reward(prompt, completion, metadata): its __call__(prompt, completion): too many "
                   "positional arguments")),
    ("BadBatch", ("reward.class_path: bad_sig_rewards.BadBatch builds a reward that fw cannot call as it scores a "
                 "rollout batch, reward.batch(prompts, completions, metadatas): its batch(completions): too many "
                 "positional arguments")),
    ("Flexible", None), ("KeywordsOnly", None)], ids=["no metadata", "bad batch", "flexible", "keywords only"])
def test_a_reward_that_cannot_take_fws_call_is_refused_before_the_run(tmp_path, capsys, monkeypatch, name, expected):
    """It failed at the first rollout, after the models were built and the run directory written."""
    (tmp_path / "bad_sig_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bad_sig_rewards", raising=False)
    path = config(tmp_path, GRPO + f"reward:\n  class_path: bad_sig_rewards.{name}\n")
    code, out, err = fw(capsys, "validate", "--config", path)
    if expected is None:
        assert (code, err) == (0, "")
    else:
        assert (code, out, err) == (2, "", f"{path}:7:15: {expected}\n")


@pytest.mark.parametrize("task, reward, expected", [
    ("digits", "  name: exact_match\n  init_args: {extract: no}\n",
     ("8:14: reward.init_args: exact_match: extract must be true or false, got 'no' (YAML 1.2 reads on/off/yes/no "
      "as strings: write true or false)")),
    ("countdown", "  init_args: {use_all: 'false'}\n",
     "7:14: reward.init_args: countdown: use_all must be true or false, got 'false'"),
    ("countdown", "  init_args: {use_all: true, format_score: 0.1}\n", None)],
    ids=["exact_match", "countdown", "valid"])
def test_a_builtin_rewards_switch_that_is_no_bool_is_refused(tmp_path, capsys, task, reward, expected):
    """`extract: no` is the string 'no', which is true: the reward extracted answers the user said not to."""
    path = config(tmp_path, GRPO.replace("{name: digits}", f"{{name: {task}}}") + "reward:\n" + reward)
    code, _, err = fw(capsys, "validate", "--config", path)
    assert (code, err) == ((0, "") if expected is None else (2, f"{path}:{expected}\n"))


# ------------------------------------------------------------------ built-in tasks' arguments

@pytest.mark.parametrize("task, init_args, expected", [
    ("arithmetic", "{allow_negative: no}", ("arithmetic task: allow_negative must be true or false, got 'no' (YAML "
                                           "1.2 reads on/off/yes/no as strings: write true or false)")),
    ("digits", "{num_digits: true}", "digits task: num_digits must be an int >= 1, got True"),
    ("arithmetic", "{digits: true}", "arithmetic task: digits must be an int in 1..18, got True"),
    ("countdown", "{max_target: true}", "countdown task: max_target must be an int >= 1, got True"),
    ("arithmetic", "{ops: 5}", "arithmetic task: ops must be a non-empty selection of '+-*', got 5"),
    ("digits", "{rule: [next]}", "digits task: rule must be one of copy, last, next, sum, max, got ['next']")],
    ids=["allow_negative no", "num_digits true", "digits true", "max_target true", "ops 5", "rule list"])
def test_a_task_argument_of_the_wrong_kind_is_refused(tmp_path, capsys, task, init_args, expected):
    """`allow_negative: no` is the string 'no', which is true: the task drew negative answers the user turned off."""
    path = config(tmp_path, GRPO.replace("{name: digits}", f"{{name: {task}, init_args: {init_args}}}"))
    code, _, err = fw(capsys, "validate", "--config", path)
    assert (code, err) == (2, (f"{path}:5:{len('  task: {name: ' + task + ', init_args: ') + 1}: "
                              f"data.task.init_args: {expected}\n"))


def test_a_task_argument_named_by_a_number_is_named_in_the_message(tmp_path, capsys):
    path = config(tmp_path, GRPO.replace("{name: digits}", "{name: digits, init_args: {1: 2}}"))
    assert fw(capsys, "validate", "--config", path) == (
        2, "", (f"{path}:5:35: data.task.init_args: 'digits' has no parameter(s) 1; it takes num_digits, rule, "
               "template, seed\n"))
