"""Rewards for RL: built-in verifiers, user rewards, and batch scoring with error policy.

A reward is a callable ``reward(prompt: str, completion: str, metadata: dict) -> float``, or an
object with a batched method ``batch(prompts, completions, metadatas) -> list[float]`` (used when
present). ``metadata`` is the task sample's metadata; tasks always put the reference answer under
``metadata["answer"]`` (see framework/tasks.py), which is what the built-ins compare against.

Built-ins (``REWARDS``, selected by ``reward.name``, constructed with ``reward.init_args``):

- ``exact_match``: 1.0 when the extracted answer equals ``metadata["answer"]`` after normalisation
  (strip, collapse whitespace, case-fold, drop one trailing period), else 0.0.
- ``numeric_match``: 1.0 when the extracted number equals the numeric answer within tolerance
  (``rel_tol`` 0 and ``abs_tol`` 1e-9 by default), compared as exact fractions. The number is the
  last number in the last ``\\boxed{...}`` when there is one, else in the completion, an exponent or
  a subscript being none (the 2 of ``25 m^2``); ``-1,234.5``, ``1.5e-07``, ``3/4``, ``\\frac{3}{4}``,
  ``2\\frac{1}{2}`` and ``10,\\!000`` are understood. The reference must be one number (``parse_reference``).
- ``format``: 1.0 when the completion carries its final answer in the required form: ``boxed``
  (a non-empty ``\\boxed{...}``), ``answer_tag`` (a non-empty ``<answer>...</answer>``) or
  ``think_answer`` (one ``<think>...</think>`` then one ``<answer>...</answer>`` and nothing else).
- ``countdown``: 1.0 when the expression (from ``<answer>``, ``\\boxed{}`` or the last line) uses
  only the given numbers, each at most once (all of them with ``use_all``), with ``+ - * /`` and
  parentheses, and evaluates exactly to the target; ``format_score`` for a well-formed expression
  that misses. Parsed by a small recursive-descent parser over fractions, never ``eval``.
"""
from __future__ import annotations

import inspect
import logging
import math
import numbers
import operator
import re
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from collections.abc import Set as AbstractSet
from fractions import Fraction
from typing import Any

import torch

from framework.config import defaults
from framework.errors import FwError, raise_on_every_rank, what_raised
from framework.signals import Interrupted
from framework.yaml12 import bool_hint

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- answer extraction

_BOXED = re.compile(r"\\boxed\{")
_BRACE = re.compile(r"[{}]")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or None.

    A box whose braces never close (a truncated completion) is skipped for an earlier one. One pass
    pairs every brace, so a completion of many unclosed boxes costs no more than its length.
    """
    starts = [m.end() - 1 for m in _BOXED.finditer(text)]   # each box's opening brace
    if not starts:
        return None
    closing: dict[int, int] = {}
    open_braces: list[int] = []
    for m in _BRACE.finditer(text):
        if m.group() == "{":
            open_braces.append(m.start())
        elif open_braces:
            closing[open_braces.pop()] = m.start()
    for brace in reversed(starts):
        if brace in closing:
            return text[brace + 1:closing[brace]]
    return None


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def last_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` in ``text``, or None."""
    found = _ANSWER_TAG.findall(text)
    return found[-1] if found else None


def tagged_answer(text: str) -> str | None:
    """Content of the last ``<answer>`` tag (of the last ``\\boxed{}`` in it, when it holds one), else of the last
    ``\\boxed{}``, else None."""
    found = last_answer_tag(text)
    if found is None:
        return last_boxed(text)
    boxed = last_boxed(found)   # <answer>\boxed{5}</answer>: the answer is 5, not the LaTeX around it
    return found if boxed is None else boxed


def extract_answer(text: str) -> str:
    """The final answer of a completion: ``tagged_answer``, else the text."""
    found = tagged_answer(text)
    return text if found is None else found


def normalize_text(text: str) -> str:
    """Strip, collapse whitespace, case-fold and drop one trailing period."""
    text = " ".join(str(text).split()).casefold()
    return text[:-1].rstrip() if text.endswith(".") else text


# Longer numbers are no answer: int() refuses thousands of digits, and 10 ** exponent must stay cheap.
MAX_NUMBER_DIGITS = 500
MAX_EXPONENT = 1000


def _frac_arg(name: str) -> str:
    """One argument of ``\\frac``: a braced number or, LaTeX-style, one bare digit (``\\frac12``)."""
    return rf"(?:\{{\s*(?P<{name}>[-+]?\d+(?:\.\d+)?)\s*\}}|(?P<{name}_digit>\d))"


_DECIMAL = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"   # thousands commas optional
_TIMES_TEN = r"\s*(?:\\times|\\cdot|×)\s*10\s*\^\s*(?:\{\s*(?P<pow>[-+]?\d+)\s*\}|(?P<pow_bare>[-+]?\d+))"
_NUMBER = re.compile(
    # a mixed number: 2\frac{1}{2} is 2 + 1/2
    rf"(?P<whole>[-+]?\d+)[ \t]*\\frac\s*{_frac_arg('mixed_num')}\s*{_frac_arg('mixed_den')}"
    rf"|(?P<frac_sign>[-+]?)\\frac\s*{_frac_arg('frac_num')}\s*{_frac_arg('frac_den')}"
    # 1,234.5 / -.5 / 1.5e-07 / 1.5 \times 10^{-7}, optionally over an integer: 3/4
    rf"|(?P<decimal>[-+]?{_DECIMAL}(?:[eE][-+]?\d+)?)(?:{_TIMES_TEN})?"
    r"(?:\s*/\s*(?P<den>[-+]?\d+)(?!\d|\.\d))?",
    re.ASCII)
_LATEX_SPACING = [
    (re.compile(r"\\[dt]frac"), r"\\frac"),       # \dfrac and \tfrac are \frac in another size
    (re.compile(r"\\!"), ""),                      # 10,\!000: a negative thin space after the comma
    (re.compile(r"\{,\}"), ","),                   # 1{,}000: a comma set as an ordinary symbol
    (re.compile(r"(?<=\d)\\[,;: ](?=\d)"), ""),    # 1\,000: a thin space between digit groups
    (re.compile("\u2212"), "-"),                   # the Unicode minus sign
]


def _plain(text: str) -> str:
    """``text`` with the LaTeX spacing and spellings of numbers reduced to the forms ``_NUMBER`` reads."""
    for pattern, replacement in _LATEX_SPACING:
        text = pattern.sub(replacement, text)
    return text


def _value(match: re.Match) -> Fraction | None:
    """The exact value of a ``_NUMBER`` match, or None (zero denominator, too many digits, huge exponent)."""
    if sum(c.isdigit() for c in match.group(0)) > MAX_NUMBER_DIGITS:
        return None

    def arg(name: str) -> Fraction:
        return Fraction(match.group(name) or match.group(name + "_digit"))

    g = match.group
    if g("whole") is not None:
        num, den = arg("mixed_num"), arg("mixed_den")
        if den == 0:
            return None
        whole = Fraction(g("whole"))
        sign = -1 if g("whole").startswith("-") else 1
        return whole + sign * num / den
    if g("frac_sign") is not None:
        num, den = arg("frac_num"), arg("frac_den")
        return None if den == 0 else (-num if g("frac_sign") == "-" else num) / den
    mantissa, _, exponent = g("decimal").replace(",", "").lower().partition("e")
    power = int(exponent or 0) + int(g("pow") or g("pow_bare") or 0)
    if abs(power) > MAX_EXPONENT:
        return None
    value = Fraction(mantissa) * Fraction(10) ** power
    if g("den") is not None:
        den = int(g("den"))
        return None if den == 0 else value / den
    return value


# What comes before an exponent or a subscript, which are no answer: the 2 of 25 cm^2 or of H_2. A number's own
# power of ten (1.5 \times 10^{-7}) is read with it.
_SCRIPT_BEFORE = re.compile(r"[\^_]\s*\{?\s*$")


def parse_number(text: str) -> Fraction | None:
    """The exact value of the last number in ``text`` that is no exponent or subscript, or None.

    Understood: thousands commas, decimals, exponents (``1.5e-07``, ``1.5 \\times 10^{-7}``), ``a/b``,
    ``\\frac{a}{b}`` (also ``\\dfrac``, ``\\tfrac``, ``\\frac12``), mixed numbers (``2\\frac{1}{2}``) and
    the LaTeX digit-group spacing ``10,\\!000``, ``1{,}000``, ``1\\,000``.
    """
    text = _plain(str(text))
    found = None
    for match in _NUMBER.finditer(text):
        if not _SCRIPT_BEFORE.search(text, max(match.start() - 8, 0), match.start()):
            found = match
    return _value(found) if found else None


def extract_number(completion: str) -> Fraction | None:
    """The completion's numeric answer: from the last ``\\boxed{}`` when present, else its last number."""
    boxed = last_boxed(completion)
    return parse_number(boxed if boxed is not None else completion)


# Marks around a reference's number that carry no value; the completions' reading skips them too.
_REFERENCE_MARKS = re.compile(r"^\\?\$\s*|\s*(?:\\?%|\^\s*\\circ|\^\s*\{\s*\\circ\s*\}|°)$")


def _exact(number: numbers.Real) -> Fraction:
    """A finite real number as a fraction; a float as the shortest decimal that prints as it (0.1 is 1/10)."""
    if isinstance(number, numbers.Rational):
        return Fraction(int(number.numerator), int(number.denominator))
    return Fraction(repr(float(number)))


def parse_reference(answer: Any) -> Fraction:
    """The reference answer ``answer`` as an exact number; ValueError unless it is one number.

    A real number is taken as is (a float as the decimal it prints as); text must be one number as
    ``parse_number`` reads them and nothing else, optionally inside ``$...$`` or ``\\boxed{}``, with a
    leading ``\\$`` or a trailing ``%`` / ``^\\circ``.
    """
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        if not math.isfinite(answer):
            raise ValueError(f"the reference answer {answer!r} is not a finite number")
        return _exact(answer)
    text = str(answer).strip()
    while len(text) > 1 and text[0] == text[-1] == "$":   # $...$ and $$...$$
        text = text[1:-1].strip()
    if text.startswith("\\boxed{") and last_boxed(text) == text[len("\\boxed{"):-1]:   # one box, all of it
        text = text[len("\\boxed{"):-1].strip()
    match = _NUMBER.fullmatch(_REFERENCE_MARKS.sub("", _plain(text)).strip())
    if match is None:
        raise ValueError(f"the reference answer {answer!r} is not one number (numeric_match reads integers, "
                         "decimals, exponents, a/b, \\frac{a}{b} and mixed numbers)")
    value = _value(match)
    if value is None:
        raise ValueError(f"the reference answer {answer!r} has a zero denominator, more than {MAX_NUMBER_DIGITS} "
                         f"digits or an exponent beyond {MAX_EXPONENT}")
    return value


# ---------------------------------------------------------------- built-in rewards

def _need_bools(reward: str, **switches: Any) -> None:
    """FwError naming the first of a built-in's `switches` that is no bool: `extract: no` is the string 'no', which
    Python takes for true."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise FwError(f"{reward}: {name} must be true or false, got {value!r}{bool_hint(value)}")


def _reference(metadata: dict) -> Any:
    if "answer" not in metadata:
        raise KeyError("the sample's metadata has no 'answer' (tasks put the reference answer there)")
    return metadata["answer"]


class ExactMatch:
    """1.0 when the completion's answer equals ``metadata["answer"]`` after normalisation.

    ``extract``: take the answer from ``<answer>``/``\\boxed{}`` when present (else the whole text);
    ``normalize``: apply ``normalize_text`` to both sides (else compare stripped strings).
    """

    metadata_keys = ("answer",)   # what every call reads of a sample's metadata (see check_metadata)

    def __init__(self, extract: bool = True, normalize: bool = True):
        _need_bools("exact_match", extract=extract, normalize=normalize)
        self.extract = extract
        self.normalize = normalize

    def __call__(self, prompt: str, completion: str, metadata: dict) -> float:
        got = extract_answer(completion) if self.extract else completion
        want = str(_reference(metadata))
        if self.normalize:
            return float(normalize_text(got) == normalize_text(want))
        return float(got.strip() == want.strip())


class NumericMatch:
    """1.0 when ``extract_number(completion)`` equals the reference answer within tolerance, else 0.0.

    Both sides are exact rationals; equal when ``|got - want| <= abs_tol + rel_tol * |want|``. The
    defaults (``rel_tol=0``, ``abs_tol=1e-9``) tell every two integers apart, however long, and forgive
    only the float noise of a decimal (``0.30000000000000004`` for ``0.3``). The reference must be one
    number (``parse_reference``); a completion's answer is its last ``\\boxed{}`` or last number.
    """

    metadata_keys = ("answer",)

    def __init__(self, rel_tol: float = 0.0, abs_tol: float = 1e-9):
        for name, tol in (("rel_tol", rel_tol), ("abs_tol", abs_tol)):
            if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not 0 <= tol < math.inf:
                raise FwError(f"numeric_match: {name} must be a finite number >= 0, got {tol!r}")
        self.rel_tol, self.abs_tol = _exact(rel_tol), _exact(abs_tol)

    def __call__(self, prompt: str, completion: str, metadata: dict) -> float:
        try:
            want = parse_reference(_reference(metadata))
        except ValueError as exc:   # name the record where the task says where it came from (JSONL)
            from framework.tasks import LOCATION_KEY

            where = metadata.get(LOCATION_KEY)
            raise ValueError(f"{where}: {exc}" if where else str(exc)) from None
        got = extract_number(completion)
        if got is None:
            return 0.0
        return float(abs(got - want) <= self.abs_tol + self.rel_tol * abs(want))


_THINK_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_THINK_ANSWER_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
FORMAT_STYLES = ("boxed", "answer_tag", "think_answer")


class FormatReward:
    """1.0 when the completion gives its final answer in the required form (see module doc)."""

    def __init__(self, style: str = "boxed"):
        if style not in FORMAT_STYLES:
            raise FwError(f"format reward: style must be one of {', '.join(FORMAT_STYLES)}, got {style!r}")
        self.style = style

    def __call__(self, prompt: str, completion: str, metadata: dict) -> float:
        if self.style == "boxed":
            found = last_boxed(completion)
        elif self.style == "answer_tag":
            found = last_answer_tag(completion)
        else:
            match = _THINK_ANSWER.fullmatch(completion)
            # one thought and one answer: the lazy groups of a full match would reach across a second tag pair
            found = match.group(1) if match and all(completion.count(t) == 1 for t in _THINK_ANSWER_TAGS) else None
        return float(found is not None and found.strip() != "")


# ---------------------------------------------------------------- countdown expressions

class ExpressionError(ValueError):
    """An arithmetic expression that is not well formed."""


_ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_EXPR_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")
_EXPR_SPELLINGS = {"\u00d7": "*", "\u00f7": "/", "x": "*", "\u2212": "-"}   # ×, ÷, x and the Unicode minus
_LATEX_OPERATOR = re.compile(r"\\(times|cdot|div)(?![A-Za-z])")   # what a \boxed{} answer writes
# Bounds on what a completion may ask of the parser: each level of parentheses costs a few Python
# frames (deep nests would exhaust the recursion limit), and int() refuses thousands of digits.
# Countdown needs far less: a handful of numbers, each a few digits.
MAX_PAREN_DEPTH = 32
MAX_LITERAL_DIGITS = 100


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """Value and integer literals of ``text``: integers, ``+ - * /`` (also ``× ÷ −``, LaTeX's ``\\times \\cdot
    \\div``) and parentheses.

    Exact rational arithmetic; no unary operators. Division by zero, parentheses nested deeper than
    ``MAX_PAREN_DEPTH``, a literal of more than ``MAX_LITERAL_DIGITS`` digits and anything else not
    well formed raise ``ExpressionError``. Never uses ``eval``.
    """
    tokens: list[str | int] = []
    depth = 0
    text = _LATEX_OPERATOR.sub(lambda m: "/" if m.group(1) == "div" else "*", text)
    for number, char in _EXPR_TOKEN.findall(text):
        if number:
            if len(number) > MAX_LITERAL_DIGITS:
                raise ExpressionError(f"a number of {len(number)} digits (at most {MAX_LITERAL_DIGITS})")
            tokens.append(int(number))
        elif char.strip():
            char = _EXPR_SPELLINGS.get(char, char)
            if char not in "+-*/()":
                raise ExpressionError(f"unexpected character {char!r}")
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth > MAX_PAREN_DEPTH:
                raise ExpressionError(f"parentheses nested deeper than {MAX_PAREN_DEPTH}")
            tokens.append(char)
    if not tokens:
        raise ExpressionError("empty expression")
    literals: list[int] = []
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def atom() -> Fraction:
        nonlocal pos
        tok = peek()
        if isinstance(tok, int):
            pos += 1
            literals.append(tok)
            return Fraction(tok)
        if tok == "(":
            pos += 1
            value = expr()
            if peek() != ")":
                raise ExpressionError("missing ')'")
            pos += 1
            return value
        raise ExpressionError(f"expected a number or '(' but found {tok!r}" if tok else "unexpected end")

    def chain(operand, ops: tuple[str, ...]) -> Fraction:
        """operand (op operand)*, left associative."""
        nonlocal pos
        value = operand()
        while peek() in ops:
            op = tokens[pos]
            pos += 1
            rhs = operand()
            if op == "/" and rhs == 0:
                raise ExpressionError("division by zero")
            value = _ARITHMETIC[op](value, rhs)
        return value

    def term() -> Fraction:
        return chain(atom, ("*", "/"))

    def expr() -> Fraction:
        return chain(term, ("+", "-"))

    value = expr()
    if pos != len(tokens):
        raise ExpressionError(f"unexpected {tokens[pos]!r} after a complete expression")
    return value, literals


def countdown_expression(completion: str) -> str:
    """The expression a countdown completion proposes: ``tagged_answer``, else its last line.

    A trailing ``= <target>`` is dropped.
    """
    found = tagged_answer(completion)
    if found is None:
        lines = [line for line in completion.strip().splitlines() if line.strip()]
        found = lines[-1] if lines else ""
    return found.split("=")[0]


class CountdownReward:
    """1.0 when the proposed expression reaches ``metadata["target"]`` from ``metadata["numbers"]``.

    Each number may be used at most once (exactly once each with ``use_all``); ``format_score`` is
    given for a well-formed expression that misses.
    """

    metadata_keys = ("numbers", "target")

    def __init__(self, use_all: bool = False, format_score: float = 0.0):
        _need_bools("countdown", use_all=use_all)
        self.use_all = use_all
        self.format_score = float(format_score)

    @staticmethod
    def metadata_problem(metadata: dict) -> str | None:
        """What is wrong with a sample's numbers and target (None: nothing): the expression's value and literals are
        numbers, so a string ("24", ["3", "8"]) would never match and every completion would score the format
        score."""
        def is_number(x: Any) -> bool:
            return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)

        numbers_, target = metadata["numbers"], metadata["target"]
        if not isinstance(numbers_, (list, tuple)) or not all(map(is_number, numbers_)):
            return f"metadata 'numbers' must be a list of finite numbers, got {numbers_!r:.80}"
        if not is_number(target):
            return f"metadata 'target' must be a finite number, got {target!r:.80}"
        return None

    def __call__(self, prompt: str, completion: str, metadata: dict) -> float:
        numbers_, target = metadata["numbers"], metadata["target"]
        try:
            value, literals = evaluate_expression(countdown_expression(completion))
        except ExpressionError:
            return 0.0
        used, available = Counter(literals), Counter(numbers_)
        uses_allowed = used == available if self.use_all else not (used - available)
        return 1.0 if uses_allowed and value == target else self.format_score


REWARDS: dict[str, type] = {
    "exact_match": ExactMatch,
    "numeric_match": NumericMatch,
    "format": FormatReward,
    "countdown": CountdownReward,
}


def check_metadata(task: Any, index: int, sample: dict, reward: Any) -> None:
    """FwError naming the task's sample `index` (a ``tasks.checked_sample``) when its metadata lacks a key that
    `reward` reads on every call (its ``metadata_keys``, which the built-ins state), or holds one of a kind the reward
    cannot score (its ``metadata_problem(metadata)``, a message or None, where it has one); a reward that states no
    keys is checked for none (a user's may read no key at all), but still by its ``metadata_problem``."""
    keys = getattr(reward, "metadata_keys", None)
    # `metadata_keys = ("answer")` is a string, not a tuple: it names one key, not its letters nor none
    keys = (keys,) if isinstance(keys, str) else tuple(keys) if isinstance(keys, Collection) else ()
    from framework.tasks import sample_name

    metadata = sample["metadata"]
    name = next((n for n, cls in REWARDS.items() if type(reward) is cls), type(reward).__name__)
    missing = [key for key in keys if key not in metadata]
    if missing:
        held = f"its keys: {', '.join(map(repr, metadata))}" if metadata else "it is empty"
        raise FwError(f"{sample_name(task, index)}: metadata has no {', '.join(map(repr, missing))}, which the reward "
                      f"{name!r} reads ({held})")
    problem = reward.metadata_problem(metadata) if callable(getattr(reward, "metadata_problem", None)) else None
    if problem:
        raise FwError(f"{sample_name(task, index)}: {problem}, which the reward {name!r} reads")


# ---------------------------------------------------------------- building and scoring

def build_reward(reward_cfg: dict, task: Any = None, check: bool = True) -> Callable[..., float] | Any:
    """The reward object of ``cfg["reward"]``: ``class_path`` + ``init_args``, else ``REWARDS[name]``;
    a null ``name`` means the task's own reward (``task.reward_name``), the one that verifies it. With ``check``,
    a JSONL task's answers are checked for ``numeric_match`` (``check_references``)."""
    init_args = reward_cfg["init_args"] or {}
    if reward_cfg["class_path"]:
        from framework.imports import import_object, instantiate_once

        if _is_reward_function(import_object(reward_cfg["class_path"])):   # would be called with init_args alone
            raise FwError(f"reward.class_path: {reward_cfg['class_path']!r} is a function of (prompt, completion, "
                          "metadata), a reward itself, but class_path names what fw calls with reward.init_args to "
                          "build the reward: a class whose instances are called so (its __call__), or a factory")

        reward = instantiate_once({"class_path": reward_cfg["class_path"], "init_args": init_args}, "reward")
        where = f"reward.class_path {reward_cfg['class_path']!r}"
    else:
        name = reward_cfg["name"]
        if name is None:
            name = getattr(task, "reward_name", None)
            if name is None:
                raise FwError(f"reward.name: not set, and the task ({type(task).__name__}) names no reward of its "
                              "own (reward_name); set reward.name to a built-in or reward.class_path")
        if not isinstance(name, str) or name not in REWARDS:
            if reward_cfg["name"] is None:   # the task's reward_name: the task's code is what to fix, not reward.name
                raise FwError(f"data.task: {type(task).__name__}.reward_name is {name!r}, not a built-in reward "
                              f"({', '.join(sorted(REWARDS))}); fix the task's reward_name, or set reward.name or "
                              "reward.class_path")
            raise FwError(f"reward.name: unknown reward {name!r}; built-ins are {', '.join(sorted(REWARDS))}")
        try:
            reward = REWARDS[name](**init_args)
        except TypeError as exc:
            raise FwError(f"reward.init_args for {name!r}: {exc}") from exc
        where = f"reward {name!r}"
    if not callable(reward) and not callable(getattr(reward, "batch", None)):
        raise FwError(f"{where}: a reward must be callable (prompt, completion, metadata) -> float "
                      "or have a batch(prompts, completions, metadatas) -> list[float] method")
    if check and isinstance(reward, NumericMatch):
        check_references(task)
    return reward


def _is_reward_function(target: Any) -> bool:
    """Whether `target` is a plain function that needs exactly the three arguments of a reward call."""
    if not inspect.isfunction(target):
        return False
    signature = inspect.signature(target)
    try:
        signature.bind("prompt", "completion", {})
    except TypeError:
        return False
    try:
        signature.bind()
    except TypeError:
        return True
    return False


def check_references(task: Any) -> None:
    """FwError naming the first record of a JSONL task whose answer is not one number, as ``numeric_match`` needs
    (``build_reward`` checks the task it is given; other tasks pass)."""
    from framework.tasks import LOCATION_KEY, JsonlPrompts

    if not isinstance(task, JsonlPrompts):   # procedural tasks make their answers; JSONL answers are data
        return
    bad = []
    for record in task.records:
        try:
            parse_reference(record["answer"])
        except ValueError as exc:
            bad.append(f"{record['metadata'][LOCATION_KEY]}: {exc}")
    if bad:
        more = {1: "", 2: " (and 1 more record)"}.get(len(bad), f" (and {len(bad) - 1} more records)")
        raise FwError(f"{bad[0]}{more}; fix the data, or score it with another reward (reward.name)")


def _shorten(text: Any, limit: int = 300) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[:limit] + "...'"


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _check_value(value: Any) -> float:
    """``value`` as a float that float32 holds finite, or TypeError / ValueError saying what it was."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r}, expected a float")
    try:
        value = float(value)
    except OverflowError:   # an int or Fraction beyond the float range
        raise ValueError(f"returned {_shorten(value, 60)}, too large for a float") from None
    if not math.isfinite(value):
        raise ValueError(f"returned {value}, expected a finite float")
    if abs(value) > _FLOAT32_MAX:   # the rollout holds rewards in float32, where this one would be an infinity
        raise ValueError(f"returned {value:g}, beyond the float32 range (+-{_FLOAT32_MAX:.4g}) rewards are held in")
    return value


def _user_line(frames: list[traceback.FrameSummary]) -> str:
    """`FILE:LINE` of the reward code in `frames` (outermost first): the innermost frame neither of this module nor
    of a library (the reward's line that called json or socket, not the line in json or socket), else the innermost
    not of this module; "" when every frame is this module's (a built-in reward)."""
    from framework.imports import user_frame

    own = [f for f in frames if f.filename != __file__]
    frame = user_frame(own, lambda file: False) or (own[-1] if own else None)
    return f"{frame.filename}:{frame.lineno}" if frame else ""


def _raised(exc: BaseException) -> str:
    """`what_raised(exc)` and where in the reward's code: `raised ValueError: ... (at my_rewards.py:12)`."""
    where = _user_line(traceback.extract_tb(exc.__traceback__))
    return what_raised(exc) + (f" (at {where})" if where else "")


class _Calls:
    """Which reward call the scoring thread is in and since when (what the timeout measures)."""

    def __init__(self) -> None:
        self.current: tuple[str, int | None, float] = ("batch()", None, time.monotonic())

    def enter(self, what: str, sample: int | None) -> None:
        self.current = (what, sample, time.monotonic())   # one tuple: read whole by the waiting thread


def _timed(work: Callable[[], Any], calls: _Calls, timeout_s: float | None, describe: Callable[[int], str]) -> Any:
    """``work()`` on a helper thread, stopped with ``FwError`` when one reward call in it outlasts ``timeout_s``.

    A Python call cannot be cancelled: a timed-out call is left running on its daemon thread, which
    ends with the process. ``timeout_s=None`` runs ``work`` on the calling thread.
    """
    if timeout_s is None:
        return work()
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which raises it
            outcome["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=run, name="fw-reward", daemon=True)
    thread.start()
    while True:
        what, sample, started = calls.current
        if done.wait(max(started + timeout_s - time.monotonic(), 0.0) + 0.01):
            break
        if calls.current[2] == started and time.monotonic() - started >= timeout_s:
            where = f"; {describe(sample)}" if sample is not None else ""
            frame = sys._current_frames().get(thread.ident)   # where the call is stuck
            stuck = _user_line(traceback.extract_stack(frame)) if frame is not None else ""
            where += f"; it is at {stuck}" if stuck else ""
            raise FwError(f"reward {what} did not return within reward.timeout_s = {timeout_s:g} s{where} "
                          "(a reward call cannot be cancelled, so the run stops; fix the reward or raise "
                          "reward.timeout_s)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def settings_problems(cfg: dict) -> list[str]:
    """`reward.max_error_fraction` set off its schema default while `reward.on_error` is raise, whose first failed
    sample stops the run (`score_rollout` reads the fraction under zero alone): one `key: message` line (it would
    change nothing), else none."""
    r = cfg["reward"]
    default = defaults(cfg["recipe"])["reward"]["max_error_fraction"]
    if r["on_error"] == "raise" and r["max_error_fraction"] != default:
        return [(f"reward.max_error_fraction: {r['max_error_fraction']} changes nothing while reward.on_error is "
                 "raise, which stops the run at the first failed sample; set on_error: zero to score failed samples "
                 f"0 up to that fraction, or leave max_error_fraction at {default}")]
    return []


def score_rollout(reward_fn: Any, prompts: list[str], completions: list[str], metadatas: list[dict],
                  settings: dict, collective: bool = False, failed: FwError | None = None) -> tuple[torch.Tensor, int]:
    """Rewards fp32 ``[N]`` for N samples and the number of samples whose reward failed.

    ``settings`` is the resolved ``reward:`` section (``on_error``, ``max_error_fraction``, ``timeout_s``).
    A reward that raises or returns NaN / inf / a non-number is reported with the offending sample
    (index, prompt, completion, error); ``on_error="raise"`` then raises ``FwError``, ``"zero"``
    logs a warning and scores the sample 0, unless more than ``max_error_fraction`` of the samples
    failed (with ``collective``, of every process's samples: the rollout batch), which raises ``FwError``. A
    ``batch`` call that fails (raises, or returns no sequence of one value a sample) is retried per sample when
    the reward is also callable, so only the offending samples are zeroed; otherwise the whole batch is. A call
    that takes longer than ``timeout_s`` raises ``FwError`` whatever ``on_error`` says. ``collective``: every process
    of a multi-process job calls this at the same point (the training step's rollouts; not evaluation, whose ranks
    may score different numbers of batches and raise together once all are scored), so such an error on one rank
    is raised on every rank (``framework.errors.raise_on_every_rank``). A KeyboardInterrupt in the reward raises
    ``framework.signals.Interrupted``: the run ends as Ctrl+C ends it (exit code 130), whatever ``on_error`` says.
    ``failed``: a problem of the samples found before they were generated (a key the reward reads missing from
    their metadata), raised in place of scoring them, as a failed reward is.
    """
    n = len(prompts)
    if not len(completions) == len(metadatas) == n:
        raise FwError(f"score_rollout: {n} prompts, {len(completions)} completions, {len(metadatas)} metadatas")
    if failed is not None:
        raise_on_every_rank(failed, collective)
    on_error = settings["on_error"]
    calls = _Calls()

    def sample(i: int) -> str:
        return f"sample {i}: prompt={_shorten(prompts[i])} completion={_shorten(completions[i])}"

    def score() -> tuple[list[tuple[int, str, BaseException | None]], list[float]]:
        try:
            return _score(reward_fn, prompts, completions, metadatas, calls)
        except KeyboardInterrupt:   # Ctrl+C's meaning, not a failed sample's: the run stops as on SIGINT
            what, i, _ = calls.current
            raise Interrupted(f"the reward {what}" + (f" on sample {i}" if i is not None else ""))

    error: FwError | None = None
    failures: list[tuple[int, str, BaseException | None]] = []
    values = [0.0] * n
    try:
        # the reward's own KeyboardInterrupt becomes Interrupted where it runs; one raised in this thread while it
        # waits for a timed call is the process's SIGINT (`fw eval` has no stop handler), not the reward's
        failures, values = _timed(score, calls, settings["timeout_s"], sample)
    except FwError as exc:   # a call past reward.timeout_s
        error = exc
    # the budget is of the rollout batch, every process's samples: the same batch split over more processes stops
    # exactly when one process holding all of it would (a collective, reached by every rank with the same on_error)
    failed_count, total, processes = len(failures), n, 1
    if on_error == "zero":
        failed_count, total, processes = _batch_counts(failed_count, n, collective)
    if failures:
        i, first, cause = failures[0]
        report = (f"reward failed on {len(failures)} of {n} samples; first: sample {i}: {first}; "
                  f"prompt={_shorten(prompts[i])} completion={_shorten(completions[i])}")
        fraction = settings["max_error_fraction"]
        if on_error == "raise":
            error = FwError(report + " (set reward.on_error: zero to count and zero such samples)")
        elif failed_count > fraction * total:
            batch = "the rollout batch" if processes == 1 else \
                f"the rollout batch ({failed_count} of its {total} samples on {processes} processes)"
            error = FwError(f"{report}: more than reward.max_error_fraction = {fraction:g} of {batch} failed, so "
                            "the reward is taken to be broken (fix it, or raise reward.max_error_fraction)")
        else:
            log.warning("%s; scored 0 (reward.on_error: zero)", report)
        if error is not None:
            error.__cause__ = cause   # --debug prints the reward's own traceback
    raise_on_every_rank(error, collective)
    return torch.tensor(values, dtype=torch.float32), len(failures)


def _batch_counts(failed: int, n: int, collective: bool) -> tuple[int, int, int]:
    """(failed samples, samples, processes) of the rollout batch: this process's alone, or with `collective` under
    several processes every process's (a collective: call it at the same point on every rank)."""
    import torch.distributed as dist

    if not (collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return failed, n, 1
    counts: list[tuple[int, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, (failed, n))
    return sum(c[0] for c in counts if c), sum(c[1] for c in counts if c), len(counts)


def _batch_values(result: Any, n: int) -> list | str:
    """`batch()`'s result as a list of its `n` values, or what is wrong with it: a mapping or set has no sample
    order (a dict would score its keys), a string's characters are not values, and a sequence of another length
    cannot be matched to the samples."""
    not_values = f"returned a value of type {type(result).__name__}, expected a sequence of {n} values, one per sample"
    if isinstance(result, (Mapping, AbstractSet, str, bytes)):
        return not_values
    try:
        items = iter(result)   # a class with __getitem__ alone iterates too
    except TypeError:
        return not_values
    values = list(items)
    if len(values) != n:
        return f"returned {len(values)} values for {n} samples"
    return values


def _score(reward_fn: Any, prompts: list[str], completions: list[str], metadatas: list[dict],
           calls: _Calls) -> tuple[list[tuple[int, str, BaseException | None]], list[float]]:
    """The failures (index, error, the reward's exception or None for a bad value) and values of every sample, failed
    ones 0; `calls` tracks each call."""
    n = len(prompts)
    failures: list[tuple[int, str, BaseException | None]] = []
    values: list[float] = [0.0] * n
    batch = getattr(reward_fn, "batch", None)
    per_sample = not callable(batch)
    if callable(batch):
        calls.enter("batch()", None)
        failed, cause = None, None
        try:
            # a generator's body is the reward's code too: what list() raises is the reward's failure
            result = _batch_values(batch(prompts, completions, metadatas), n)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code: any failure is reported, then retried
            failed, cause = f"batch() {_raised(exc)}", exc
        else:
            if isinstance(result, str):   # a result of no use: the call failed, as one that raises does
                failed = f"batch() {result}"
        if failed is not None:
            if not callable(reward_fn):
                failures = [(i, failed, cause) for i in range(n)]
            else:
                log.warning("reward %s; scoring the %d samples one call each instead", failed, n)
                per_sample = True
        else:
            for i, value in enumerate(result):
                try:
                    values[i] = _check_value(value)
                except (TypeError, ValueError) as exc:
                    failures.append((i, f"batch() {exc}", None))
    if per_sample:
        for i in range(n):
            calls.enter("call", i)
            try:
                value = reward_fn(prompts[i], completions[i], metadatas[i])
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code: a failure is reported with its sample
                failures.append((i, _raised(exc), exc))
                continue
            try:
                values[i] = _check_value(value)
            except (TypeError, ValueError) as exc:
                failures.append((i, str(exc), None))
    for i, _, _ in failures:
        values[i] = 0.0
    return failures, values
