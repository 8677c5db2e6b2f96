"""Built-in rewards, the countdown expression checker, user rewards and the on_error policy."""
import logging
import math
import re
import sys
import threading
import time
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
    score_rollout,
)

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
    ("so 3 apples and 5 pears: 8", 8.0),
    ("total -12.5 dollars", -12.5),
    ("1,234,567 people", 1234567.0),
    ("the ratio is 3/4", 0.75),
    ("\\boxed{\\frac{3}{4}} and 9 later", 0.75),
    ("first 12 then \\boxed{7} then 99", 7.0),
    ("\\boxed{x = {2}} 5", 2.0),          # nested braces inside the box
    ("no digits here", None),
    ("value .5", 0.5),
])
def test_extract_number(text, number):
    got = extract_number(text)
    assert got == number if number is None else math.isclose(got, number)


def test_last_boxed_balances_braces_and_skips_truncated_box():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{5} then \\boxed{6") == "5"
    assert last_boxed("nothing") is None


@pytest.mark.parametrize("completion, answer, expected", [
    ("12*12 = 144", "144", 1.0),
    ("It is \\boxed{144.0000001}", "144", 1.0),       # within rel_tol 1e-6
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
    with pytest.raises(ValueError, match="holds no number"):
        NumericMatch()("p", "3", meta("three"))
    with pytest.raises(FwError, match="rel_tol"):
        NumericMatch(rel_tol=-1)


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


@pytest.mark.parametrize("text", ["", "1+", "(1+2", "1+2)", "2**3", "-1+2", "3/0", "__import__('os')", "1 2"])
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
        task = build_task({**data, "task": {"name": name, "init_args": {}}})
        assert type(build_reward(base, task)) is cls, name
    jsonl = tmp_path / "math.jsonl"
    jsonl.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    assert type(build_reward(base, build_task({**data, "path": str(jsonl), "task": None}))) is NumericMatch
    with pytest.raises(FwError, match="reward.name: not set, and the task .object. names no reward"):
        build_reward(base, object())


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

    with pytest.raises(FwError, match="returned 1 values for 2 samples"):
        score_rollout(Short(), ["a", "b"], ["x", "y"], [{}] * 2, ZERO)


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

    with pytest.raises(FwError, match=r"^reward batch\(\) did not return within reward.timeout_s = 0.2 s \("):
        score_rollout(Stuck(), ["p"], ["c"], [{}], {**ZERO, "timeout_s": 0.2})


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

    with pytest.raises(FwError, match="returned 0 values for 1 samples"):
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
