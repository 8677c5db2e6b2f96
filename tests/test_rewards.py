"""Built-in rewards, the countdown expression checker, user rewards and the on_error policy."""
import json
import logging
import os
import random
import re
import signal
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from framework.errors import FwError
from framework.rewards import (
    REWARDS,
    CountdownReward,
    ExactMatch,
    ExpressionError,
    FormatReward,
    NumericMatch,
    build_reward,
    evaluate_expression,
    extract_number,
    last_boxed,
    parse_reference,
    score_rollout,
)
from framework.signals import Interrupted

# reward sections as the schema resolves them; no timeout, and no failure share stops a run
RAISE = {"on_error": "raise", "max_error_fraction": 1.0, "timeout_s": None}
ZERO = {"on_error": "zero", "max_error_fraction": 1.0, "timeout_s": None}


def meta(answer, **extra):
    return {"answer": answer, **extra}


@pytest.mark.parametrize("completion, answer, expected", [
    ("42", "42", 1.0),
    ("  Paris. ", "paris", 1.0),
    ("New   York", "new york", 1.0),
    ("The answer is \\boxed{Paris}", "Paris", 1.0),
    ("<answer> 7 </answer> trailing", "7", 1.0),
    ("42!", "42", 0.0),
    ("4", "42", 0.0),
    ("", "0", 0.0),
])
def test_exact_match(completion, answer, expected):
    assert ExactMatch()("p", completion, meta(answer)) == expected


def test_exact_match_without_normalisation_is_case_sensitive():
    assert ExactMatch(normalize=False)("p", "Paris", meta("paris")) == 0.0
    assert ExactMatch(normalize=False)("p", " Paris\n", meta("Paris")) == 1.0
    assert ExactMatch(extract=False)("p", "\\boxed{3}", meta("3")) == 0.0


@pytest.mark.parametrize("text, number", [
    ("so 3 apples and 5 pears: 8", 8),
    ("total -12.5 dollars", Fraction(-25, 2)),
    ("1,234,567 people", 1234567),
    ("the ratio is 3/4", Fraction(3, 4)),
    ("the ratio is 3/4.", Fraction(3, 4)),          # a full stop is no decimal point
    ("\\boxed{\\frac{3}{4}} and 9 later", Fraction(3, 4)),
    ("first 12 then \\boxed{7} then 99", 7),
    ("\\boxed{x = {2}} 5", 2),          # nested braces inside the box
    ("no digits here", None),
    ("value .5", Fraction(1, 2)),
    ("1/25.5", Fraction(51, 2)),                   # a decimal is no denominator: the last number is 25.5
    # exponents, and the LaTeX forms of numbers
    ("it is 5e-05", Fraction(1, 20000)),
    ("\\boxed{1e+21}", 10 ** 21),
    ("\\boxed{1.5E-7}", Fraction(15, 10 ** 8)),
    ("\\boxed{1.5 \\times 10^{-7}}", Fraction(15, 10 ** 8)),
    ("\\boxed{2\\frac{1}{2}}", Fraction(5, 2)),     # a mixed number: 2 + 1/2, not 21/2
    ("\\boxed{-2\\frac{1}{2}}", Fraction(-5, 2)),
    ("\\boxed{\\frac12}", Fraction(1, 2)),         # brace-less arguments are one digit each
    ("\\boxed{\\dfrac{7}{4}}", Fraction(7, 4)),
    ("\\boxed{-\\tfrac{7}{4}}", Fraction(-7, 4)),
    ("\\boxed{1{,}000}", 1000),
    ("\\boxed{10,\\!000}", 10000),
    ("\\boxed{1\\,000\\,000}", 10 ** 6),
    pytest.param("\\boxed{1" + "0" * 600 + "}", None, id="600 digits"),   # more than any answer has: no number
    ("\\boxed{1e99999999}", None),                   # 10 ** 99999999 is too big to build
])
def test_extract_number(text, number):
    assert extract_number(text) == number


@pytest.mark.parametrize("answer, value", [
    ("10,\\!000", 10000), ("1{,}000", 1000), ("2\\frac{1}{2}", Fraction(5, 2)), ("\\frac12", Fraction(1, 2)),
    ("5e-05", Fraction(1, 20000)), ("1e+21", 10 ** 21), (" -3/4 ", Fraction(-3, 4)),
    ("$\\frac{14}{3}$", Fraction(14, 3)),
    ("\\boxed{0.25}", Fraction(1, 4)), ("25\\%", 25), ("90^\\circ", 90), ("\\$18.90", Fraction(189, 10)),
    (0.1, Fraction(1, 10)), (5e-05, Fraction(1, 20000)), (12345678901234567890, 12345678901234567890),
])
def test_parse_reference_reads_one_number(answer, value):
    assert parse_reference(answer) == value


@pytest.mark.parametrize("answer", ["x = 5", "3 or 4", "1,2345", "\\sqrt{2}", "2 apples", "1/0", "", "three",
                                    pytest.param("1" * 600, id="600 digits"), float("nan"), True])
def test_parse_reference_refuses_anything_but_one_number(answer):
    with pytest.raises(ValueError, match="reference answer"):
        parse_reference(answer)


def test_last_boxed_balances_braces_and_skips_truncated_box():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{5} then \\boxed{6") == "5"
    assert last_boxed("nothing") is None


def _last_boxed_by_scanning(text):
    """The plain definition: from the last box backwards, the first whose braces close."""
    for start in reversed([i for i in range(len(text)) if text.startswith("\\boxed{", i)]):
        depth, j = 1, start + len("\\boxed{")
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0:
            return text[start + len("\\boxed{"):j - 1]
    return None


def test_last_boxed_agrees_with_its_definition_and_stays_linear():
    rng = random.Random(1)
    parts = ["\\boxed{", "{", "}", "a", "7", " "]
    for _ in range(5000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 30)))
        assert last_boxed(text) == _last_boxed_by_scanning(text), text
    start = time.monotonic()
    assert last_boxed("\\boxed{" * 5000) is None and last_boxed("\\boxed{1}" + "\\boxed{" * 5000) == "1"
    assert time.monotonic() - start < 2           # a scan from every unclosed box would be quadratic


@pytest.mark.parametrize("completion, answer, expected", [
    ("12*12 = 144", "144", 1.0),
    ("It is \\boxed{144.0000000001}", "144", 1.0),    # within abs_tol 1e-9
    ("It is \\boxed{144.0000001}", "144", 0.0),
    ("\\boxed{144} and then 150", "144", 1.0),          # the box wins over the last number
    ("144 ... wait, 145", "144", 0.0),                  # last number
    ("-3", "-3", 1.0),
    ("0.1 + 0.2 = 0.30000000000000004", "0.3", 1.0),
    ("no number", "3", 0.0),
    ("1/0", "3", 0.0),
])
def test_numeric_match(completion, answer, expected):
    assert NumericMatch()("p", completion, meta(answer)) == expected


def test_numeric_match_tolerance_and_numeric_reference():
    assert NumericMatch(rel_tol=0.01, abs_tol=0)("p", "101", meta(100)) == 1.0
    assert NumericMatch(rel_tol=0.01, abs_tol=0)("p", "102", meta(100)) == 0.0
    with pytest.raises(ValueError, match="'three' is not one number"):
        NumericMatch()("p", "3", meta("three"))
    with pytest.raises(FwError, match="rel_tol"):
        NumericMatch(rel_tol=-1)


# ---------------------------------------------------------------- numeric_match tells integers apart

@pytest.mark.parametrize("want", [1_000_000, 15_240_680, 82_407_175_850, 84_964_651_349_707_900,
                                  371043028371043028 * 228988675228988675])
def test_numeric_match_rewards_no_wrong_integer(want):
    reward = NumericMatch()
    assert reward("p", f"\\boxed{{{want}}}", meta(str(want))) == 1.0
    for wrong in (want - 1, want + 1, want + 5, want + 10 ** (len(str(want)) // 2)):
        assert reward("p", f"\\boxed{{{wrong}}}", meta(str(want))) == 0.0, wrong
        assert reward("p", str(wrong), meta(want)) == 0.0, wrong          # an int reference too
    # beyond 2**53 a float comparison sees no difference even with no tolerance at all
    assert NumericMatch(rel_tol=0, abs_tol=0)("p", "84964651349707901", meta("84964651349707900")) == 0.0


def test_arithmetic_tasks_reward_only_the_exact_answer():
    from framework.tasks import build_task

    data = {"path": None, "prompt_key": "prompt", "answer_key": "answer", "shuffle": True}
    for digits in (4, 9, 18):
        task = build_task({**data, "task": {"name": "arithmetic", "init_args": {"digits": digits}}}, seed=0)
        reward = build_reward({"name": None, "class_path": None, "init_args": {}}, task)   # the task's own
        for i in range(100):
            md = task.sample(i)["metadata"]
            right = {"+": md["a"] + md["b"], "-": md["a"] - md["b"], "*": md["a"] * md["b"]}[md["op"]]
            assert reward("", f"so \\boxed{{{right}}}", md) == 1.0
            assert reward("", f"so \\boxed{{{right + 1}}}", md) == 0.0, (digits, i)


def test_numeric_match_tolerances_are_exact():
    # 0.4 - 0.1 is 0.30000000000000004 in floats, which would miss a tolerance of exactly 0.3
    assert NumericMatch(rel_tol=0, abs_tol=0.3)("p", "0.4", meta("0.1")) == 1.0
    assert NumericMatch(rel_tol=0, abs_tol=0.3)("p", "0.41", meta("0.1")) == 0.0
    assert NumericMatch(rel_tol=0.1, abs_tol=0)("p", "1.1", meta("1")) == 1.0
    # no relative tolerance by default: 1e-6 of a million would forgive a wrong answer
    assert NumericMatch()("p", "1000001", meta("1000000")) == 0.0
    for bad in ({"abs_tol": float("nan")}, {"rel_tol": float("inf")}, {"abs_tol": "0.1"}):
        with pytest.raises(FwError, match="must be a finite number >= 0"):
            NumericMatch(**bad)


# ---------------------------------------------------------------- numeric_match reads references as written

def test_jsonl_float_answers_are_read_as_written(tmp_path):
    from framework.tasks import build_task

    path = tmp_path / "sci.jsonl"
    answers = [1 / 20000, 1e21, 1.5e-7]     # json.dumps writes 5e-05, 1e+21, 1.5e-07
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(answers)))
    data = {"task": None, "path": str(path), "prompt_key": "prompt", "answer_key": "answer", "shuffle": False}
    task = build_task(data, seed=0)
    reward = build_reward({"name": None, "class_path": None, "init_args": {}}, task)
    right = ["\\boxed{0.00005}", "\\boxed{1000000000000000000000}", "\\boxed{0.00000015}"]
    wrong = [["\\boxed{-5}", "\\boxed{0.0005}"], ["\\boxed{21}", "\\boxed{1e20}"], ["\\boxed{-7}", "\\boxed{0}"]]
    for i in range(3):
        md = task.sample(i)["metadata"]
        assert reward("", right[i], md) == 1.0, md
        assert [reward("", w, md) for w in wrong[i]] == [0.0, 0.0], md


@pytest.mark.parametrize("completion, reference, expected", [
    ("\\boxed{2\\frac{1}{2}}", "2.5", 1.0),
    ("\\boxed{2.5}", "2\\frac{1}{2}", 1.0),
    ("\\boxed{10.5}", "2\\frac{1}{2}", 0.0),
    ("\\boxed{10000}", "10,\\!000", 1.0),
    ("\\boxed{0}", "10,\\!000", 0.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{\\frac12}", "0.5", 1.0),
    ("\\boxed{12}", "\\frac12", 0.0),
])
def test_numeric_match_reads_latex_numbers(completion, reference, expected):
    assert NumericMatch()("p", completion, meta(reference)) == expected


def test_a_jsonl_reference_that_is_not_one_number_is_refused_naming_its_line(tmp_path):
    from framework.tasks import build_task

    path = tmp_path / "math.jsonl"
    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "area?", "answer": "12 square units"},
            {"prompt": "root?", "answer": "\\sqrt{2}"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"task": None, "path": str(path), "prompt_key": "prompt", "answer_key": "answer", "shuffle": False}
    task = build_task(data, seed=0)
    base = {"name": None, "class_path": None, "init_args": {}}
    with pytest.raises(FwError, match=re.escape(f"{path}:2: the reference answer '12 square units' is not one "
                                                "number") + r" .*\(and 1 more record\); fix the data"):
        build_reward(base, task)                  # numeric_match, the JSONL task's own reward
    assert isinstance(build_reward({**base, "name": "exact_match"}, task), ExactMatch)   # text answers are fine there
    # a reference met only while scoring (another task's) names its record too
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: the reference answer")):
        NumericMatch()("p", "12", task.sample(1)["metadata"])


@pytest.mark.parametrize("style, completion, expected", [
    ("boxed", "so \\boxed{4}", 1.0),
    ("boxed", "so \\boxed{ }", 0.0),
    ("boxed", "so 4", 0.0),
    ("answer_tag", "<answer>4</answer>", 1.0),
    ("answer_tag", "<answer>4", 0.0),
    ("think_answer", "<think>2+2</think>\n<answer>4</answer>", 1.0),
    ("think_answer", "<think>2+2</think><answer>4</answer> extra", 0.0),
    ("think_answer", "<answer>4</answer>", 0.0),
])
def test_format_reward(style, completion, expected):
    assert FormatReward(style)("p", completion, {}) == expected


def test_format_reward_rejects_unknown_style():
    with pytest.raises(FwError, match="style must be one of boxed, answer_tag, think_answer"):
        FormatReward("xml")


@pytest.mark.parametrize("text, value, literals", [
    ("1+2*3", 7, [1, 2, 3]),
    ("(1+2)*3", 9, [1, 2, 3]),
    ("8/3*3", 8, [8, 3, 3]),            # exact rationals: no float rounding
    ("10-4-3", 3, [10, 4, 3]),          # left associative
    ("24 / (8 - 2) × 3", 12, [24, 8, 2, 3]),
])
def test_evaluate_expression(text, value, literals):
    got, used = evaluate_expression(text)
    assert got == value and used == literals


@pytest.mark.parametrize("text", ["", "1+", "(1+2", "1+2)", "2**3", "-1+2", "3/0", "__import__('os')", "1 2",
                                  pytest.param("(" * 200 + "3" + ")" * 200, id="200 nested parentheses"),
                                  pytest.param("1" * 5000, id="5000 digits"), "2/(3-3)"])
def test_evaluate_expression_rejects(text):
    with pytest.raises(ExpressionError):
        evaluate_expression(text)


@pytest.mark.parametrize("completion, expected", [
    ("<answer>(6+4)*5</answer>", 1.0),
    ("I think \\boxed{5*(4+6)}", 1.0),
    ("working...\n50/1*1", 0.0),        # 1 is not among the numbers
    ("<answer>(6+4)*5 = 50</answer>", 1.0),
    ("<answer>6*5+4*5</answer>", 0.0),  # 5 used twice
    ("<answer>6*4+5</answer>", 0.0),    # wrong value
    ("<answer>import os</answer>", 0.0),
])
def test_countdown_reward(completion, expected):
    md = {"numbers": [6, 4, 5, 9], "target": 50, "answer": "(6+4)*5"}
    assert CountdownReward()("p", completion, md) == expected


def test_countdown_use_all_and_format_score():
    md = {"numbers": [6, 4, 5], "target": 50}
    assert CountdownReward(use_all=True)("p", "<answer>(6+4)*5</answer>", md) == 1.0
    md = {"numbers": [6, 4, 5, 9], "target": 50}
    assert CountdownReward(use_all=True)("p", "<answer>(6+4)*5</answer>", md) == 0.0
    assert CountdownReward(format_score=0.1)("p", "<answer>6+4</answer>", md) == 0.1
    assert CountdownReward(format_score=0.1)("p", "<answer>6+</answer>", md) == 0.0


def _fraction_eval(text: str) -> Fraction:
    """Python's own evaluation of an expression the countdown parser accepted, over exact fractions."""
    text = text.replace("×", "*").replace("÷", "/").replace("x", "*")
    return eval(re.sub(r"\d+", lambda m: f"F('{m.group()}')", text), {"F": Fraction, "__builtins__": {}})


def test_countdown_reward_scores_any_text_without_raising():
    md = {"numbers": [3, 5, 7, 9], "target": 24, "answer": "(3+5)*(9-7)-..."}
    reward = CountdownReward()
    rng = random.Random(0)
    alphabet = "0123456789+-*/()×÷x .="
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(3000)]
    accepted = 0
    for text in fuzz:
        try:
            value, _ = evaluate_expression(text.split("=")[0])
        except ExpressionError:
            value = None
        else:                       # what the parser accepts, Python reads the same way
            accepted += 1
            assert value == _fraction_eval(text.split("=")[0]), text
        score = reward("p", f"<answer>{text}</answer>", md)
        assert score in (0.0, 1.0) and (score == 1.0) <= (value == 24), text
    assert accepted > 100                         # the fuzz reaches the arithmetic, not only the rejections
    extremes = ["(" * n + "3" + ")" * n for n in (33, 200, 5000)] + [
        "(" * 3000, ")" * 3000, "9" * 101, "1" * 5000, "9" * 4301 + "+3", "3/0", "3/(5-5)", "0/0", "2**3**99999999"]
    for text in extremes:
        with pytest.raises(ExpressionError):
            evaluate_expression(text)
    assert evaluate_expression("9*" * 3000 + "9")[0] == 9 ** 3001       # long chains are loops, not recursion
    assert evaluate_expression("3/" * 3000 + "5")[0] == Fraction(1, 3 ** 2998 * 5)
    texts = fuzz + extremes
    rewards, errors = score_rollout(reward, ["p"] * len(texts), [f"<answer>{t}</answer>" for t in texts],
                                    [md] * len(texts), RAISE)
    assert errors == 0 and set(rewards.tolist()) <= {0.0, 1.0}
    assert reward("p", "<answer>" + "(" * 32 + "3*5+9" + ")" * 32 + "</answer>", md) == 1.0   # as deep as allowed


def test_build_reward_builtins_and_errors():
    base = {"name": "numeric_match", "class_path": None, "init_args": {}, "on_error": "raise"}
    assert isinstance(build_reward(base), NumericMatch)
    r = build_reward({**base, "name": "format", "init_args": {"style": "answer_tag"}})
    assert isinstance(r, FormatReward) and r.style == "answer_tag"
    assert set(REWARDS) >= {"exact_match", "numeric_match", "format", "countdown"}
    with pytest.raises(FwError, match="unknown reward 'nope'.*exact_match"):
        build_reward({**base, "name": "nope"})
    with pytest.raises(FwError, match="reward.init_args for 'numeric_match'"):
        build_reward({**base, "init_args": {"tolerance": 1}})


def test_unset_reward_name_takes_the_tasks_own_reward(tmp_path):
    from framework.tasks import build_task

    base = {"name": None, "class_path": None, "init_args": {}, "on_error": "raise"}
    data = {"path": None, "prompt_key": "prompt", "answer_key": "answer", "shuffle": True}
    expected = {"digits": ExactMatch, "arithmetic": NumericMatch, "countdown": CountdownReward}
    for name, cls in expected.items():
        task = build_task({**data, "task": {"name": name, "init_args": {}}}, seed=0)
        assert type(build_reward(base, task)) is cls, name
    jsonl = tmp_path / "math.jsonl"
    jsonl.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    assert type(build_reward(base, build_task({**data, "path": str(jsonl), "task": None}, seed=0))) is NumericMatch
    with pytest.raises(FwError, match="reward.name: not set, and the task .object. names no reward"):
        build_reward(base, object())


def test_a_tasks_unknown_reward_name_is_the_tasks_error_not_reward_names(tmp_path, capsys):
    """A null reward.name takes the task's reward_name: a misspelt one is the task's to fix, and fw validate says so
    at data.task (the config has no reward.name to point at)."""
    from framework.cli import main

    (tmp_path / "spelt_tasks.py").write_text(
        "from framework.tasks import Task\n\n\n"
        "class Spelt(Task):\n"
        "    reward_name = 'exactmatch'\n\n"
        "    def sample(self, index):\n"
        "        return {'prompt': '1=', 'answer': '2', 'metadata': {'answer': '2'}}\n\n\n"
        "class Listed(Spelt):\n"
        "    reward_name = ['exact_match']\n")
    config = tmp_path / "train.yaml"
    config.write_text(f"recipe: grpo\nrun_dir: {tmp_path / 'run'}\nmodel:\n  policy: {{preset: tiny}}\n"
                      "data:\n  task: {class_path: spelt_tasks.Spelt}\n")
    assert main(["validate", "--config", str(config)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"{config}:6:9: data.task: Spelt.reward_name is 'exactmatch', not a built-in reward (countdown, "
         "exact_match, format, numeric_match); fix the task's reward_name, or set reward.name or reward.class_path")]
    assert main(["validate", "--config", str(config), "--data.task.class_path=spelt_tasks.Listed"]) == 2
    assert "data.task: Listed.reward_name is ['exact_match'], not a built-in reward" in capsys.readouterr().err
    assert main(["validate", "--config", str(config), "--reward.name=exact_match"]) == 0


class LengthPenalty:
    """A user reward written as a test fixture: importable by class_path."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def __call__(self, prompt, completion, metadata):
        return -self.scale * len(completion)


class BatchedReward:
    def __init__(self, bad_index: int = -1):
        self.bad_index = bad_index

    def batch(self, prompts, completions, metadatas):
        return [float("nan") if i == self.bad_index else float(len(c)) for i, c in enumerate(completions)]


def test_build_reward_from_class_path():
    cfg = {"name": None, "class_path": "tests.test_rewards.LengthPenalty", "init_args": {"scale": 2.0},
           "on_error": "raise"}
    reward = build_reward(cfg)
    rewards, errors = score_rollout(reward, ["a", "b"], ["xyz", ""], [{}, {}], RAISE)
    assert rewards.tolist() == [-6.0, 0.0] and errors == 0


def length_reward(prompt, completion, metadata):
    """A reward written as a function, as other frameworks take them."""
    return float(len(completion))


def make_length_penalty(scale: float = 1.0):
    """A factory: what class_path may name besides a class."""
    return LengthPenalty(scale)


def test_a_reward_function_named_by_class_path_is_told_apart_from_a_class():
    """class_path names what fw builds the reward from with init_args: a reward function itself would be called with
    init_args alone and fail on its missing (prompt, completion, metadata), so it is named as such instead."""
    cfg = {"name": None, "class_path": "tests.test_rewards.length_reward", "init_args": {}, "on_error": "raise"}
    with pytest.raises(FwError) as info:
        build_reward(cfg)
    assert str(info.value) == (
        "reward.class_path: 'tests.test_rewards.length_reward' is a function of (prompt, completion, metadata), a "
        "reward itself, but class_path names what fw calls with reward.init_args to build the reward: a class whose "
        "instances are called so (its __call__), or a factory")
    factory = build_reward({**cfg, "class_path": "tests.test_rewards.make_length_penalty", "init_args": {"scale": 3}})
    assert type(factory).__name__ == "LengthPenalty" and factory.scale == 3


def test_score_rollout_batched_form_is_used():
    rewards, errors = score_rollout(BatchedReward(), ["a", "b", "c"], ["x", "yy", ""], [{}] * 3, RAISE)
    assert rewards.dtype == torch.float32 and rewards.tolist() == [1.0, 2.0, 0.0] and errors == 0


def test_score_rollout_raise_names_the_sample():
    def reward(prompt, completion, metadata):
        if completion == "boom":
            raise RuntimeError("parser exploded")
        return 1.0

    with pytest.raises(FwError) as info:
        score_rollout(reward, ["p0", "p1", "p2"], ["ok", "boom", "ok"], [{}] * 3, RAISE)
    message = str(info.value)
    assert "sample 1" in message and "RuntimeError: parser exploded" in message
    assert "'p1'" in message and "'boom'" in message and "on_error: zero" in message


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0", None, True, [1.0]])
def test_score_rollout_bad_values_zeroed_and_counted(bad, caplog):
    def reward(prompt, completion, metadata):
        return bad if completion == "bad" else 0.5

    with caplog.at_level(logging.WARNING, logger="framework.rewards"):
        rewards, errors = score_rollout(reward, ["a", "b", "c"], ["bad", "fine", "bad"], [{}] * 3, ZERO)
    assert rewards.tolist() == [0.0, 0.5, 0.0] and errors == 2
    assert "2 of 3 samples; first: sample 0" in caplog.text
    with pytest.raises(FwError, match="expected a"):
        score_rollout(reward, ["a"], ["bad"], [{}], RAISE)


def test_score_rollout_accepts_numpy_like_and_tensor_scalars():
    values = iter([torch.tensor(0.25), 3])
    rewards, errors = score_rollout(lambda p, c, m: next(values), ["a", "b"], ["x", "y"], [{}, {}], RAISE)
    assert rewards.tolist() == [0.25, 3.0] and errors == 0


def test_a_huge_integer_reward_is_a_failed_sample_not_a_crash():
    def reward(prompt, completion, metadata):
        return 10**400 if completion == "big" else 1

    rewards, errors = score_rollout(reward, ["a", "b"], ["big", "ok"], [{}] * 2, ZERO)
    assert rewards.tolist() == [0.0, 1.0] and errors == 1
    with pytest.raises(FwError, match="sample 0: returned 1000.*too large for a float"):
        score_rollout(reward, ["a"], ["big"], [{}], RAISE)


def test_a_reward_calling_sys_exit_is_a_failed_sample_not_the_end_of_fit():
    """A reward is user code: its sys.exit(7) fails its sample (named, one line) instead of ending the run with
    exit code 7 and no word, under a timeout's helper thread as without one."""
    def reward(prompt, completion, metadata):
        if completion == "quit":
            sys.exit(7)
        return 1.0

    for timeout_s in (None, 30):
        settings = {**ZERO, "timeout_s": timeout_s}
        rewards, errors = score_rollout(reward, ["a", "b", "c"], ["ok", "quit", "ok"], [{}] * 3, settings)
        assert rewards.tolist() == [1.0, 0.0, 1.0] and errors == 1
        with pytest.raises(FwError, match=r"sample 1: called sys.exit\(7\)"):
            score_rollout(reward, ["a", "b"], ["ok", "quit"], [{}] * 2, {**RAISE, "timeout_s": timeout_s})


def test_a_batch_returning_a_mapping_is_refused_not_read_by_its_keys(caplog):
    """A dict has no sample order: {0: 0.0, 1: 0.0} would otherwise score its keys 0 and 1."""
    class Keyed:
        def batch(self, prompts, completions, metadatas):
            return {i: 0.0 for i in range(len(completions))}

    with pytest.raises(FwError, match="sample 0: batch\\(\\) returned a value of type dict, expected a sequence of 2 "
                                      "values, one per sample;"):
        score_rollout(Keyed(), ["a", "b"], ["x", "y"], [{}] * 2, RAISE)

    class KeyedButCallable(Keyed):
        def __call__(self, prompt, completion, metadata):
            return 0.25

    with caplog.at_level(logging.WARNING, logger="framework.rewards"):
        rewards, errors = score_rollout(KeyedButCallable(), ["a", "b"], ["x", "y"], [{}] * 2, RAISE)
    assert rewards.tolist() == [0.25, 0.25] and errors == 0
    assert "reward batch() returned a value of type dict, expected a sequence of 2 values, one per sample; scoring " \
           "the 2 samples one call each instead" in caplog.text


def test_score_rollout_batched_nan_and_failures():
    rewards, errors = score_rollout(BatchedReward(bad_index=1), ["a"] * 3, ["x", "yy", "zzz"], [{}] * 3, ZERO)
    assert rewards.tolist() == [1.0, 0.0, 3.0] and errors == 1

    class Broken:
        def batch(self, prompts, completions, metadatas):
            raise KeyError("target")

    rewards, errors = score_rollout(Broken(), ["a", "b"], ["x", "y"], [{}] * 2, ZERO)
    assert rewards.tolist() == [0.0, 0.0] and errors == 2
    with pytest.raises(FwError, match="batch\\(\\) raised KeyError"):
        score_rollout(Broken(), ["a"], ["x"], [{}], RAISE)

    class BrokenBatchButCallable(Broken):
        def __call__(self, prompt, completion, metadata):
            return 1 / len(completion)

    rewards, errors = score_rollout(BrokenBatchButCallable(), ["a", "b"], ["xx", ""], [{}] * 2, ZERO)
    assert rewards.tolist() == [0.5, 0.0] and errors == 1   # retried per sample: only the offender zeroed

    class Short:
        def batch(self, prompts, completions, metadatas):
            return [1.0]

    # a result of another length is a failed call, as a raise is: every sample fails, past max_error_fraction
    with pytest.raises(FwError, match="reward failed on 2 of 2 samples; first: sample 0: batch\\(\\) returned 1 "
                                      "values for 2 samples;.*more than reward.max_error_fraction"):
        score_rollout(Short(), ["a", "b"], ["x", "y"], [{}] * 2, {**ZERO, "max_error_fraction": 0.5})
    rewards, errors = score_rollout(Short(), ["a", "b"], ["x", "y"], [{}] * 2, ZERO)
    assert rewards.tolist() == [0.0, 0.0] and errors == 2

    class ShortButCallable(Short):
        def __call__(self, prompt, completion, metadata):
            return float(len(completion))

    rewards, errors = score_rollout(ShortButCallable(), ["a", "b"], ["x", "yy"], [{}] * 2, RAISE)
    assert rewards.tolist() == [1.0, 2.0] and errors == 0   # retried per sample, as a raising batch() is

    class Text:
        def batch(self, prompts, completions, metadatas):
            return "10"   # two characters for two samples: not two values

    with pytest.raises(FwError, match="batch\\(\\) returned a value of type str, expected a sequence of 2 values"):
        score_rollout(Text(), ["a", "b"], ["x", "y"], [{}] * 2, RAISE)

    class Indexed:   # the old sequence protocol: __getitem__ until IndexError, no __iter__
        def __init__(self, values):
            self.values = values

        def __getitem__(self, i):
            return self.values[i]

    class ByIndex:
        def batch(self, prompts, completions, metadatas):
            return Indexed([float(len(c)) for c in completions])

    class Number:
        def batch(self, prompts, completions, metadatas):
            return 1.0

    rewards, errors = score_rollout(ByIndex(), ["a", "b"], ["x", "yy"], [{}] * 2, RAISE)
    assert rewards.tolist() == [1.0, 2.0] and errors == 0
    with pytest.raises(FwError, match="batch\\(\\) returned a value of type float, expected a sequence of 2 values"):
        score_rollout(Number(), ["a", "b"], ["x", "y"], [{}] * 2, RAISE)


def test_score_rollout_rejects_mismatched_lengths():
    with pytest.raises(FwError, match="2 prompts, 1 completions"):
        score_rollout(ExactMatch(), ["a", "b"], ["b"], [meta("b")] * 2, RAISE)


def test_missing_answer_is_reported_as_the_samples_error():
    with pytest.raises(FwError, match="KeyError.*no 'answer'"):
        score_rollout(ExactMatch(), ["a"], ["b"], [{}], RAISE)


# ---------------------------------------------------------------- a broken or hanging reward stops the run

def test_a_reward_failing_on_most_samples_stops_the_run_under_on_error_zero():
    def reward(prompt, completion, metadata):
        if completion != "ok":
            raise ValueError("unparsable")
        return 1.0

    half = {**ZERO, "max_error_fraction": 0.5}
    # 2 of 4 failed: not more than half, so zeroed and counted
    rewards, errors = score_rollout(reward, ["p"] * 4, ["ok", "x", "ok", "y"], [{}] * 4, half)
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0] and errors == 2
    # 3 of 4 failed: more than half
    with pytest.raises(FwError) as info:
        score_rollout(reward, ["p"] * 4, ["ok", "x", "y", "z"], [{}] * 4, half)
    message = str(info.value)
    assert "reward failed on 3 of 4 samples; first: sample 1: raised ValueError: unparsable" in message
    assert "reward.max_error_fraction = 0.5" in message
    # a reward that fails on every sample stops under any fraction below 1
    with pytest.raises(FwError, match="reward failed on 2 of 2 samples"):
        score_rollout(reward, ["p"] * 2, ["x", "y"], [{}] * 2, {**ZERO, "max_error_fraction": 0.99})


def test_a_hanging_reward_call_is_ended_by_the_timeout_naming_its_sample():
    release = threading.Event()

    def reward(prompt, completion, metadata):
        if completion == "hang":
            release.wait(30)
        return 1.0

    start = time.monotonic()
    try:
        with pytest.raises(FwError) as info:
            score_rollout(reward, ["p0", "p1", "p2"], ["ok", "ok", "hang"], [{}] * 3, {**ZERO, "timeout_s": 0.3})
    finally:
        release.set()
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert message.startswith("reward call did not return within reward.timeout_s = 0.3 s; sample 2: ")
    assert "prompt='p2' completion='hang'" in message


def test_the_timeout_is_per_call_and_a_batch_call_is_one_call():
    def slowish(prompt, completion, metadata):
        time.sleep(0.1)
        return 0.5

    # 6 calls of 0.1 s each take longer than the 0.25 s limit of one call: no timeout
    rewards, errors = score_rollout(slowish, ["p"] * 6, ["c"] * 6, [{}] * 6, {**RAISE, "timeout_s": 0.25})
    assert rewards.tolist() == [0.5] * 6 and errors == 0

    class Stuck:
        def batch(self, prompts, completions, metadatas):
            time.sleep(2)
            return [1.0] * len(prompts)

    with pytest.raises(FwError, match=r"^reward batch\(\) did not return within reward.timeout_s = 0.2 s; it is at "):
        score_rollout(Stuck(), ["p"], ["c"], [{}], {**ZERO, "timeout_s": 0.2})


def test_a_failing_reward_is_placed_at_its_own_line_and_debug_shows_its_traceback():
    """The one line names the file and line of the reward's code that failed (the reward's call into json, not
    json's own line), and the reward's exception is the FwError's cause, which --debug prints."""
    def reward(prompt, completion, metadata):
        if completion == "quit":
            sys.exit(7)
        return json.loads(completion)["score"]

    quit_line = reward.__code__.co_firstlineno + 2
    loads_line = reward.__code__.co_firstlineno + 3
    for timeout_s in (None, 30):
        with pytest.raises(FwError) as info:
            score_rollout(reward, ["a", "b"], ['{"score": 1}', "not json"], [{}] * 2, {**RAISE, "timeout_s": timeout_s})
        assert f"sample 1: raised JSONDecodeError: Expecting value: line 1 column 1 (char 0) (at {__file__}:" \
               f"{loads_line}); prompt='b'" in str(info.value)
        assert isinstance(info.value.__cause__, json.JSONDecodeError)
        with pytest.raises(FwError, match=re.escape(f"sample 0: called sys.exit(7) (at {__file__}:{quit_line});")):
            score_rollout(reward, ["a"], ["quit"], [{}], {**RAISE, "timeout_s": timeout_s})

    class Broken:
        def batch(self, prompts, completions, metadatas):
            return [float(c) for c in completions]

    batch_line = Broken.batch.__code__.co_firstlineno + 1
    with pytest.raises(FwError, match=re.escape(f"sample 0: batch() raised ValueError: could not convert string to "
                                                f"float: 'x' (at {__file__}:{batch_line}); ")):
        score_rollout(Broken(), ["a"], ["x"], [{}], RAISE)
    # a built-in's failure is fw's to place: no line of fw's is named
    with pytest.raises(FwError, match=r"raised KeyError: .*no 'answer'.*\"; prompt='a'") as info:
        score_rollout(ExactMatch(), ["a"], ["b"], [{}], RAISE)
    assert "(at " not in str(info.value)


def test_a_hanging_reward_is_named_at_the_line_it_is_stuck_at():
    release = threading.Event()

    def reward(prompt, completion, metadata):
        release.wait(30)
        return 1.0

    try:
        with pytest.raises(FwError) as info:
            score_rollout(reward, ["p"], ["c"], [{}], {**ZERO, "timeout_s": 0.2})
    finally:
        release.set()
    # the reward's own line, not threading's inside Event.wait
    assert f"sample 0: prompt='p' completion='c'; it is at {__file__}:{reward.__code__.co_firstlineno + 1} (a " \
           "reward call cannot be cancelled" in str(info.value)


def test_rewards_run_on_a_helper_thread_only_when_timed():
    threads = []

    def reward(prompt, completion, metadata):
        threads.append(threading.current_thread())
        if completion == "bad":
            raise FwError("the reward's own user error")
        return 1.0

    score_rollout(reward, ["p"], ["c"], [{}], RAISE)
    score_rollout(reward, ["p"], ["c"], [{}], {**RAISE, "timeout_s": 10})
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()
    # an error on the helper thread reaches the caller as it was raised
    with pytest.raises(FwError, match="reward failed on 1 of 1 samples; first: sample 0: raised FwError"):
        score_rollout(reward, ["p"], ["bad"], [{}], {**RAISE, "timeout_s": 10})

    class Short:
        def batch(self, prompts, completions, metadatas):
            return []

    with pytest.raises(FwError, match="sample 0: batch\\(\\) returned 0 values for 1 samples"):
        score_rollout(Short(), ["p"], ["c"], [{}], {**RAISE, "timeout_s": 10})


def test_the_readme_reward_example_scores_a_rollout(tmp_path, monkeypatch):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Rewards and tasks", 1)[1].split("\n## ", 1)[0]
    (tmp_path / "my_readme_reward.py").write_text(re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        reward = build_reward({"name": None, "class_path": "my_readme_reward.LengthPenalty", "init_args": {"budget": 2},
                               "on_error": "raise"})
    finally:
        sys.modules.pop("my_readme_reward", None)
    rewards, errors = score_rollout(reward, ["3="] * 3, ["4", "5", "4   "], [meta("4")] * 3, RAISE)
    assert errors == 0 and rewards.tolist() == pytest.approx([1.0, 0.0, 1.0 - 0.01 * 2])   # "4   ": 2 past the budget


@pytest.mark.parametrize("timeout_s", [None, 30.0], ids=["same-thread", "timed-thread"])
def test_a_keyboard_interrupt_the_reward_raises_is_named_with_its_sample(timeout_s):
    def reward(prompt, completion, metadata):
        if completion == "stop":
            raise KeyboardInterrupt
        return 1.0

    with pytest.raises(Interrupted) as info:
        score_rollout(reward, ["p"] * 3, ["ok", "stop", "ok"], [{}] * 3, {**ZERO, "timeout_s": timeout_s})
    assert str(info.value) == "interrupted: KeyboardInterrupt in the reward call on sample 1"
    assert info.value.exit_code == 130


def test_ctrl_c_while_a_timed_reward_runs_is_not_the_rewards_keyboard_interrupt():
    """Without fw fit's stop handler (`fw eval`), SIGINT raises KeyboardInterrupt in the thread that waits for the
    timed reward call: it stays a KeyboardInterrupt (the CLI's plain "interrupted"), not the reward's."""
    release = threading.Event()

    def reward(prompt, completion, metadata):
        os.kill(os.getpid(), signal.SIGINT)
        release.wait(30)
        return 1.0

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            score_rollout(reward, ["p"], ["c"], [{}], {**ZERO, "timeout_s": 30.0})
    finally:
        release.set()
        signal.signal(signal.SIGINT, previous)
    assert not isinstance(info.value, Interrupted) and type(info.value) is KeyboardInterrupt


@pytest.mark.parametrize("name, switch", [("exact_match", "extract"), ("exact_match", "normalize"),
                                          ("countdown", "use_all")])
def test_a_built_in_rewards_switch_must_be_a_bool_wherever_it_is_built(name, switch):
    """`extract: no` is the string 'no' (YAML 1.2), which Python takes for true: refused by the reward itself, so
    `fw eval`, which builds it without `fw validate`'s checks, refuses it too."""
    with pytest.raises(FwError, match=rf"^{name}: {switch} must be true or false, got 'no' \(YAML 1\.2 reads"):
        REWARDS[name](**{switch: "no"})
    assert REWARDS[name](**{switch: False}) is not None
