"""An adversarial review of the built-in rewards and tasks: every expected score is worked out by hand."""
import ast
import json
import subprocess
import sys
import time
from collections import Counter
from fractions import Fraction

import pytest

from framework.rewards import (
    CountdownReward,
    ExactMatch,
    FormatReward,
    NumericMatch,
    evaluate_expression,
    extract_number,
)
from framework.tasks import Arithmetic, Countdown, Digits


def meta(answer, **extra):
    return {"answer": answer, **extra}


# ---------------------------------------------------------------- numeric_match

@pytest.mark.parametrize("completion, answer, expected", [
    ("#### 1,234", "1234", 1.0),                       # GSM8K's final line, thousands separator
    ("\\boxed{1,000,000}", "1000000", 1.0),
    ("\\boxed{007}", "7", 1.0),                         # leading zeros
    ("\\boxed{1.0}", "1", 1.0),                         # 1.0 is 1
    ("\\boxed{0.50}", "1/2", 1.0),
    ("\\boxed{.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{-5}", "5", 0.0),                          # the sign counts
    ("\\boxed{\u22125}", "-5", 1.0),                    # the Unicode minus is a minus
    ("\\boxed{-5}", "\u22125", 1.0),
    ("\\boxed{\\frac{-3}{4}}", "-0.75", 1.0),
    ("\\boxed{0.333}", "1/3", 0.0),                     # no tolerance beyond abs_tol 1e-9
    ("\\boxed{\\left(\\frac{1}{2}\\right)}", "0.5", 1.0),   # nested braces inside the box
    ("\\boxed{3}\n\\boxed{4}", "4", 1.0),               # several boxes: the last one counts
    ("\\boxed{3}\n\\boxed{4}", "3", 0.0),
    ("The answer is 42.", "42", 1.0),                   # trailing punctuation
    ("The answer is 42!", "42", 1.0),
    ("  \n 42 \n", "42", 1.0),                          # whitespace and newlines only
    ("42", "42", 1.0),                                  # a completion that is only the answer
    ("", "0", 0.0),                                     # an empty completion
    ("\\boxed{}", "0", 0.0),
])
def test_numeric_match_by_hand(completion, answer, expected):
    assert NumericMatch()("p", completion, meta(answer)) == expected


@pytest.mark.parametrize("completion, number", [
    ("The area is \\boxed{25 \\text{ cm}^2}", 25),      # a unit's power is no answer
    ("The area is \\boxed{25\\,\\mathrm{m}^{2}}", 25),
    ("so the area is 25 m^2.", 25),
    ("\\boxed{3 \\text{ mol of } H_2}", 3),               # nor a subscript
    ("x_1 = 3 and x_2 = 7", 7),
    ("\\boxed{x^2}", None),
    ("\\boxed{1.5 \\times 10^{-7}}", Fraction(15, 10 ** 8)),   # the power of ten of a number is part of it
])
def test_an_exponent_or_a_subscript_is_not_the_answer(completion, number):
    assert extract_number(completion) == number


# ---------------------------------------------------------------- exact_match

@pytest.mark.parametrize("completion, answer, expected", [
    ("<answer>5</answer>", "5", 1.0),
    ("<answer>5</answer> \\boxed{6}", "5", 1.0),          # the tag before any box
    ("5\n", "5", 1.0),
    ("\\boxed{5}\\boxed{6}", "6", 1.0),                  # the last box
    ("5", "5", 1.0),
    ("The answer is 5", "5", 0.0),                      # no tag, no box: the whole text
])
def test_exact_match_by_hand(completion, answer, expected):
    assert ExactMatch()("p", completion, meta(answer)) == expected


# ---------------------------------------------------------------- format

@pytest.mark.parametrize("completion, expected", [
    ("<think>2+2</think>\n<answer>4</answer>", 1.0),
    ("\n<think>\na\n</think>\n\n<answer>\n4\n</answer>\n", 1.0),
    ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0),    # two answers: something else
    ("<think>a</think><answer>1</answer> more <answer>2</answer>", 0.0),
    ("<think>a</think><answer>1</answer>junk</answer>", 0.0),
    ("<think>a</think><think>b</think><answer>1</answer>", 0.0),      # two thoughts
    ("<think>a</think>junk<answer>1</answer>", 0.0),
    ("<think>a</think><answer> </answer>", 0.0),
])
def test_think_answer_is_one_thought_then_one_answer(completion, expected):
    assert FormatReward("think_answer")("p", completion, {}) == expected


# ---------------------------------------------------------------- countdown

NUMBERS = {"numbers": [1, 2, 3, 4], "target": 10}


@pytest.mark.parametrize("completion, at_most_once, exactly_once", [
    ("<answer>1+2+3+4</answer>", 1.0, 1.0),
    ("<answer>4*3-2</answer>", 1.0, 0.0),               # 1 unused: fine unless use_all
    ("<answer>4*3-2*1</answer>", 1.0, 1.0),              # precedence: 12 - 2
    ("<answer>(4*3-2)*1</answer>", 1.0, 1.0),
    ("<answer>4*(3-2)</answer>", 0.0, 0.0),              # parentheses: 4, not 10
    ("<answer>4*3-2-1+1</answer>", 0.0, 0.0),            # 1 used twice
    ("<answer>12-2</answer>", 0.0, 0.0),                 # 12 is no given number (digits joined)
    ("<answer>10</answer>", 0.0, 0.0),
    ("<answer>(1/2+1/2)*4+3*2</answer>", 0.0, 0.0),      # right value, but 2 used twice
    ("<answer>(1/4+3/4)*2</answer>", 0.0, 0.0),          # value 2
    ("<answer>4/(2-2)</answer>", 0.0, 0.0),              # division by zero
    ("<answer>2/4*(3+1)*... </answer>", 0.0, 0.0),
    ("<answer>__import__('os').system('true')</answer>", 0.0, 0.0),
])
def test_countdown_by_hand(completion, at_most_once, exactly_once):
    assert CountdownReward()("p", completion, NUMBERS) == at_most_once
    assert CountdownReward(use_all=True)("p", completion, NUMBERS) == exactly_once


@pytest.mark.parametrize("completion, at_most_once, exactly_once", [
    ("<answer>4 * 3 \u2212 2</answer>", 1.0, 0.0),       # the Unicode minus
    ("\\boxed{4 \\times 3 - 2 \\div 1}", 1.0, 1.0),      # LaTeX operators in a box
    ("\\boxed{4 \\cdot 3 - 2}", 1.0, 0.0),
    ("\\boxed{4 \\cdots 3}", 0.0, 0.0),                  # no operator
])
def test_countdown_reads_the_unicode_minus_and_latex_operators(completion, at_most_once, exactly_once):
    assert CountdownReward()("p", completion, NUMBERS) == at_most_once
    assert CountdownReward(use_all=True)("p", completion, NUMBERS) == exactly_once


@pytest.mark.parametrize("completion, answer, expected", [
    ("<answer>\\boxed{5}</answer>", "5", 1.0),
    ("<answer>The capital is \\boxed{Paris}.</answer>", "Paris", 1.0),
    ("<answer>\\boxed{5}</answer>", "6", 0.0),
    ("<answer>\\boxed{4}, no: \\boxed{5}</answer>", "5", 1.0),   # the last box in the tag
])
def test_a_box_inside_the_answer_tag_is_the_answer(completion, answer, expected):
    assert ExactMatch()("p", completion, meta(answer)) == expected


def test_a_box_inside_the_answer_tag_is_the_countdown_expression():
    for use_all in (False, True):
        assert CountdownReward(use_all=use_all)("p", "<answer>\\boxed{1+2+3+4}</answer>", NUMBERS) == 1.0
        assert CountdownReward(use_all=use_all)("p", "<answer>so \\boxed{(1+2+3)*4}</answer>", NUMBERS) == 0.0


def test_non_integer_intermediate_results_are_exact():
    # 4 / (1 - 2/3) = 12 through the non-integer 1/3; floats would give 11.999999999999998
    assert CountdownReward()("p", "<answer>4/(1-2/3)</answer>", {"numbers": [1, 2, 3, 4], "target": 12}) == 1.0
    # 1/3 times 3 is 1 exactly
    assert evaluate_expression("1/3*3")[0] == 1


UNSAFE = ["9**9**9", "9^9^9", "2**99999", "__import__('os')", "eval('1')", "1e9999", "1.5+1", "-1+2",
          "(" * 10000 + "1" + ")" * 10000]


def test_the_countdown_parser_never_evaluates_python():
    # in a child process: an expression handed to Python's eval (9**9**9) would hang the test session, not fail it
    code = ("import json, sys\nfrom framework.rewards import evaluate_expression, ExpressionError\n"
            "for text in json.load(sys.stdin):\n"
            "    try:\n        evaluate_expression(text)\n    except ExpressionError:\n        continue\n"
            "    raise SystemExit(f'accepted {text[:20]!r}')\n")
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(UNSAFE), capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_long_expression_is_scored_quickly():
    # 3000 multiplications of 100-digit numbers: a 300k-character completion, far beyond any rollout
    text = "<answer>" + "*".join(["9" * 100] * 3000) + "</answer>"
    start = time.monotonic()
    assert CountdownReward()("p", text, NUMBERS) == 0.0
    assert time.monotonic() - start < 10


# ---------------------------------------------------------------- tasks

def _steps(expression: str) -> list[Fraction]:
    """The value of every operation in `expression`, innermost first, by Python's own parser."""
    values = []

    def walk(node):
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        left, right = walk(node.left), walk(node.right)
        value = {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right,
                 ast.Div: left / right if right else None}[type(node.op)]
        values.append(value)
        return value

    walk(ast.parse(expression, mode="eval").body)
    return values


@pytest.mark.parametrize("num_numbers, max_number, max_target", [(2, 10, 100), (4, 50, 1000), (6, 9, 200)])
def test_countdown_targets_are_reached_through_positive_integers(num_numbers, max_number, max_target):
    task = Countdown(num_numbers=num_numbers, max_number=max_number, max_target=max_target, seed=7)
    for i in range(200):
        md = task.sample(i)["metadata"]
        steps = _steps(md["answer"])
        # exact divisions only and no negative (nor zero) intermediate result, as the task promises
        assert all(v is not None and v.denominator == 1 and v >= 1 for v in steps), md
        assert steps[-1] == md["target"] and 1 <= md["target"] <= max_target
        literals = [int(n) for n in md["answer"].replace("(", " ").replace(")", " ").translate(
            str.maketrans("+-*/", "    ")).split()]
        assert Counter(literals) == Counter(md["numbers"]) and all(1 <= n <= max_number for n in md["numbers"])


@pytest.mark.parametrize("make", [lambda s: Digits(num_digits=4, rule="sum", seed=s), lambda s: Arithmetic(seed=s),
                                  lambda s: Countdown(seed=s)])
def test_each_seed_gives_its_own_stream_and_the_same_one_again(make):
    first, again, other = ([make(seed).sample(i)["prompt"] for i in range(50)] for seed in (3, 3, 4))
    assert first == again
    assert sum(a != b for a, b in zip(first, other)) > 40


def test_each_tasks_answer_scores_one_with_its_own_reward_and_a_wrong_one_zero():
    from framework.rewards import REWARDS

    for task in (Digits(num_digits=3, rule="max", seed=2), Arithmetic(digits=3, seed=2),
                 Countdown(num_numbers=3, max_number=20, max_target=300, seed=2)):
        reward = REWARDS[task.reward_name]()
        for i in range(100):
            sample, pair = task.sample(i), task.sft_example(i)
            assert reward(sample["prompt"], pair["completion"], sample["metadata"]) == 1.0
            md = sample["metadata"]
            if isinstance(task, Digits):
                wrong = str((int(md["answer"]) + 1) % 10)
                assert md["answer"] == str(max(md["digits"]))
            elif isinstance(task, Arithmetic):
                right = {"+": md["a"] + md["b"], "-": md["a"] - md["b"], "*": md["a"] * md["b"]}[md["op"]]
                assert md["answer"] == str(right)
                wrong = str(right + 1)
            else:
                wrong = f"<answer>{md['answer']}+1</answer>"   # 1 then is used twice or is no given number
            assert reward(sample["prompt"], wrong, md) == 0.0, (md, wrong)
