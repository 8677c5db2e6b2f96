"""Prompt sources for RL (and SFT): seeded procedural tasks and JSONL prompt datasets.

Every task is an endless, indexable stream: ``task.sample(index)`` returns
``{"prompt": str | list[message], "answer": str, "metadata": dict}`` and is a pure function of
(the task's seed, index), so a run that resumes at index k sees exactly the prompts it would have
seen. ``metadata`` always holds ``"answer"`` too (rewards read it there, see framework/rewards.py).
``task.sft_example(index)`` gives the same sample as an SFT pair (prompt -> the correct answer).
``task.reward_name`` names the built-in reward that verifies the task. Optionally,
``task.widest_prompts()`` bounds the prompt length (see ``Task``).

Built-ins (``TASKS``, chosen by ``data.task.name`` with ``data.task.init_args``):

- ``digits``: a few random digits and ``=``; the answer is one digit by a simple rule. Made so that a
  tiny random-init model learns it with GRPO in minutes on a CPU (a random digit is right 10% of
  the time). Use ``rollout.max_new_tokens: 1`` (or EOS) with ``exact_match``.
- ``arithmetic``: ``a+b=`` / ``a-b=`` / ``a*b=`` with ``digits``-digit operands; ``numeric_match``.
- ``countdown``: reach a target from given numbers with ``+ - * /``; always solvable (the target is
  built from the numbers); verified by the ``countdown`` reward.
- JSONL (``data.path``): one JSON object per line with ``data.prompt_key`` and ``data.answer_key``,
  visited in a seeded order reshuffled each epoch (``data.shuffle``).
"""
from __future__ import annotations

import inspect
import operator
import random
import string
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path
from typing import Any

from framework.errors import FwError
from framework.imports import InitArgsError
from framework.jsonl import json_type_name, read_jsonl
from framework.tokenizer import messages_problem
from framework.yaml12 import bool_hint

LOCATION_KEY = "fw_location"   # a JSONL prompt's `FILE:LINE`, in its sample's metadata

Sample = dict[str, Any]
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def _rng(seed: int, index: int, salt: str = "") -> random.Random:
    # String seeds go through sha512 in random.seed: stable across processes and PYTHONHASHSEED.
    return random.Random(f"{salt}:{seed}:{index}")


def _check_index(index: int) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise FwError(f"task sample index must be an int >= 0, got {index!r}")
    return index


class Task:
    """Common interface: ``sample(index)``, ``sft_example(index)``, ``reward_name``, ``seed``.

    Optional, for any task (a ``class_path`` one too): ``widest_prompts() -> list[prompt]``, prompts of which the
    longest, rendered as a sample's prompt is, has at least as many tokens as any sample's prompt. The memory plan
    (``recipes.rl.longest_prompt``) takes the prompt length from them; a task without a length (``__len__``) that
    does not state them is measured by its first samples, which may miss its widest ones. The built-ins state
    theirs for tokenizers that make each digit one token (the built-in character tokenizer, and Qwen3's, whose
    pre-tokenizer splits numbers into single digits): there a prompt's tokens depend on its numbers only through
    their digit counts, so each number at its most digits gives the most tokens.
    """

    reward_name = "exact_match"

    def __init__(self, seed: int = 0):
        self.seed = int(seed)

    def sample(self, index: int) -> Sample:
        raise NotImplementedError

    def sft_example(self, index: int) -> dict[str, Any]:
        """``{"prompt": ..., "completion": answer}`` for sample ``index``: SFT data from the task."""
        sample = checked_sample(self, index, sft=True)
        return {"prompt": sample["prompt"], "completion": sample["answer"]}

    def _make(self, prompt: Any, answer: str, **metadata: Any) -> Sample:
        return {"prompt": prompt, "answer": answer, "metadata": {**metadata, "answer": answer}}


DIGIT_RULES = {
    "copy": lambda d: d[0],
    "last": lambda d: d[-1],
    "next": lambda d: (d[0] + 1) % 10,
    "sum": lambda d: sum(d) % 10,
    "max": max,
}


class Digits(Task):
    """``num_digits`` random digits then ``=``; the answer is one digit given by ``rule``.

    Rules: ``copy`` (the first digit), ``last`` (the last digit), ``next`` (first + 1 mod 10),
    ``sum`` (sum of the digits mod 10), ``max`` (the largest digit). ``copy`` with one digit is the
    easiest; more digits or ``sum`` make it harder.
    """

    def __init__(self, num_digits: int = 1, rule: str = "copy", template: str = "{digits}=", seed: int = 0):
        super().__init__(seed)
        if not _is_int(num_digits) or num_digits < 1:
            raise FwError(f"digits task: num_digits must be an int >= 1, got {num_digits!r}")
        if not isinstance(rule, str) or rule not in DIGIT_RULES:
            raise FwError(f"digits task: rule must be one of {', '.join(DIGIT_RULES)}, got {rule!r}")
        _check_template("digits", template, {"digits": "1234"}, needed=["digits"])
        self.num_digits, self.rule, self.template = num_digits, rule, template

    def sample(self, index: int) -> Sample:
        rng = _rng(self.seed, _check_index(index), "digits")
        digits = [rng.randrange(10) for _ in range(self.num_digits)]
        answer = str(DIGIT_RULES[self.rule](digits))
        prompt = self.template.format(digits="".join(map(str, digits)))
        return self._make(prompt, answer, digits=digits, rule=self.rule)

    def widest_prompts(self) -> list[str]:
        """Every prompt has ``num_digits`` digits in the same template: any such prompt is the widest."""
        return [self.template.format(digits="9" * self.num_digits)]


class Arithmetic(Task):
    """``{a}{op}{b}=`` with ``digits``-digit operands and ``op`` drawn from ``ops``; integer answer.

    ``allow_negative: false`` orders the operands of ``-`` so the result is never negative.
    """

    reward_name = "numeric_match"

    def __init__(self, digits: int = 2, ops: str | list[str] = "+-*", allow_negative: bool = True,
                 template: str = "{a}{op}{b}=", seed: int = 0):
        super().__init__(seed)
        if not _is_int(digits) or not 1 <= digits <= 18:
            raise FwError(f"arithmetic task: digits must be an int in 1..18, got {digits!r}")
        chosen = list(ops) if isinstance(ops, (str, list)) else []   # list(5) would raise, not say what is wanted
        if not chosen or any(op not in ("+", "-", "*") for op in chosen):
            raise FwError(f"arithmetic task: ops must be a non-empty selection of '+-*', got {ops!r}")
        ops = chosen
        if not isinstance(allow_negative, bool):   # `no` is a string in YAML 1.2, and a true one in Python
            raise FwError(f"arithmetic task: allow_negative must be true or false, got {allow_negative!r}"
                          f"{bool_hint(allow_negative)}")
        # one operator needs no {op}: the template may write it ("{a}+{b}=")
        _check_template("arithmetic", template, {"a": 12, "op": "+", "b": 34},
                        needed=["a", "op", "b"] if len(set(ops)) > 1 else ["a", "b"])
        self.digits, self.ops, self.allow_negative, self.template = digits, ops, allow_negative, template

    def sample(self, index: int) -> Sample:
        rng = _rng(self.seed, _check_index(index), "arithmetic")
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        a, b = rng.randint(low, 10 ** self.digits - 1), rng.randint(low, 10 ** self.digits - 1)
        op = rng.choice(self.ops)
        if op == "-" and not self.allow_negative and a < b:
            a, b = b, a
        answer = str(OPERATORS[op](a, b))
        return self._make(self.template.format(a=a, op=op, b=b), answer, a=a, b=b, op=op)

    def widest_prompts(self) -> list[str]:
        """Both operands have ``digits`` digits in every sample; one prompt per operator, since an operator may
        merge with the template's text into tokens of its own."""
        top = 10 ** self.digits - 1
        return [self.template.format(a=top, op=op, b=top) for op in self.ops]


# A countdown sample is a random expression over random numbers, drawn again until its value is at
# most max_target. The constructor draws up to COUNTDOWN_PROBE_DRAWS expressions (the same ones whatever
# the seed) and refuses parameters under which fewer than COUNTDOWN_PROBE_HITS land in range: sampling
# would crawl. A sample that finds no target in COUNTDOWN_MAX_DRAWS draws is an error, not an endless loop.
COUNTDOWN_PROBE_DRAWS = 2000
COUNTDOWN_PROBE_HITS = 4
COUNTDOWN_MAX_DRAWS = 100_000

COUNTDOWN_TEMPLATE = ("Using the numbers {numbers}, write an expression equal to {target}. "
                      "Use + - * / and parentheses, each number at most once. "
                      "Put the expression in <answer></answer>.")


class Countdown(Task):
    """Reach ``target`` from ``num_numbers`` numbers in 1..``max_number`` with ``+ - * /``.

    The target is the value of a random expression over all the numbers (exact divisions only,
    no negative intermediate results), between 1 and ``max_target``, so every sample is solvable;
    that expression is the answer. Verified by the ``countdown`` reward. Parameters under which
    few random expressions come out at most ``max_target`` are refused (``FwError``).
    """

    reward_name = "countdown"

    def __init__(self, num_numbers: int = 4, max_number: int = 50, max_target: int = 1000,
                 template: str = COUNTDOWN_TEMPLATE, seed: int = 0):
        super().__init__(seed)
        if not _is_int(num_numbers) or not 2 <= num_numbers <= 8:
            raise FwError(f"countdown task: num_numbers must be an int in 2..8, got {num_numbers!r}")
        if not _is_int(max_number) or max_number < 2:
            raise FwError(f"countdown task: max_number must be an int >= 2, got {max_number!r}")
        if not _is_int(max_target) or max_target < 1:
            raise FwError(f"countdown task: max_target must be an int >= 1, got {max_target!r}")
        _check_template("countdown", template, {"numbers": "1, 2", "target": 3}, needed=["numbers", "target"])
        self.num_numbers, self.max_number, self.max_target = num_numbers, max_number, max_target
        self.template = template
        rng, hits, draws = random.Random("countdown-probe"), 0, 0
        while hits < COUNTDOWN_PROBE_HITS and draws < COUNTDOWN_PROBE_DRAWS:
            hits += self._build(rng)[1] <= max_target   # values are >= 1: no negatives, exact divisions
            draws += 1
        if hits < COUNTDOWN_PROBE_HITS:
            raise FwError(f"countdown task: with num_numbers = {num_numbers}, max_number = {max_number} and "
                          f"max_target = {max_target}, only {hits} of {draws} random expressions come out at most "
                          "max_target, so drawing samples would take too long; raise max_target, or lower "
                          "max_number or num_numbers")

    def _build(self, rng: random.Random) -> tuple[list[int], int, str]:
        numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
        pool = [(Fraction(n), str(n), True) for n in numbers]  # (value, text, is_atom)
        while len(pool) > 1:
            (a, ta, atom_a), (b, tb, atom_b) = (pool.pop(rng.randrange(len(pool))) for _ in range(2))
            ops = ["+", "*"] + (["-"] if a > b else []) + (["/"] if b not in (0, 1) and a % b == 0 else [])
            op = rng.choice(ops)
            value = OPERATORS[op](a, b)
            text = f"{ta if atom_a else f'({ta})'}{op}{tb if atom_b else f'({tb})'}"
            pool.append((value, text, False))
        value, text, _ = pool[0]
        return numbers, int(value), text

    def sample(self, index: int) -> Sample:
        rng = _rng(self.seed, _check_index(index), "countdown")
        for _ in range(COUNTDOWN_MAX_DRAWS):   # the constructor's probe makes a long search unlikely
            numbers, target, expression = self._build(rng)
            if 1 <= target <= self.max_target:
                break
        else:
            raise FwError(f"countdown task: with num_numbers = {self.num_numbers}, max_number = {self.max_number} "
                          f"and max_target = {self.max_target}, none of {COUNTDOWN_MAX_DRAWS} random expressions "
                          f"for sample {index} comes out at most max_target; raise max_target, or lower max_number "
                          "or num_numbers")
        prompt = self.template.format(numbers=", ".join(map(str, numbers)), target=target)
        return self._make(prompt, expression, numbers=numbers, target=target)

    def widest_prompts(self) -> list[str]:
        """Every number at ``max_number`` and the target at ``max_target``: the most digits each can have, in the
        same text (values never change a sample's characters other than digits)."""
        return [self.template.format(numbers=", ".join([str(self.max_number)] * self.num_numbers),
                                     target=self.max_target)]

    def sft_example(self, index: int) -> dict[str, Any]:
        """The solution wrapped in ``<answer></answer>``, as the default template asks."""
        sample = self.sample(index)
        return {"prompt": sample["prompt"], "completion": f"<answer>{sample['answer']}</answer>"}


def _is_int(value: Any) -> bool:
    """Whether `value` is an int and not a bool (`num_digits: true` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_template(task: str, template: Any, fields: dict[str, Any], needed: Iterable[str] = ()) -> None:
    """FwError unless `template` formats with `fields`, values of the types its task fills in, and uses each of the
    `needed` ones, those the answer depends on."""
    if not isinstance(template, str):
        raise FwError(f"{task} task: template must be a string, got {template!r}")
    try:
        template.format(**fields)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        raise FwError(f"{task} task: template {template!r} may only use the fields "
                      f"{', '.join('{' + f + '}' for f in sorted(fields))} ({type(exc).__name__}: {exc})") from exc
    used = {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(template) if name}
    missing = [f for f in needed if f not in used]
    if missing:   # prompts that differ there alone would read the same and want different answers
        raise FwError(f"{task} task: template {template!r} leaves out "
                      f"{', '.join('{' + f + '}' for f in missing)}, which the answer depends on")


def _check_prompt(prompt: Any) -> str | None:
    """Why ``prompt`` is not a non-empty string or a list of {role, content} messages, or None."""
    if isinstance(prompt, str):
        return None if prompt else "is an empty string"   # no token for the policy to continue
    if isinstance(prompt, list) and prompt:
        return messages_problem(prompt)
    return "must be a non-empty string or a non-empty list of {role, content} messages"


def prompt_record_problem(record: dict, prompt_key: str, answer_key: str) -> str | None:
    """What makes one JSONL record unusable as an RL prompt with an answer, or None."""
    for key in (prompt_key, answer_key):
        if key not in record:
            return (f"missing key {key!r} (keys: {', '.join(map(repr, record))}); "
                    "set data.prompt_key / data.answer_key to match the file")
    problem = _check_prompt(record[prompt_key])
    if problem:
        return f"{prompt_key!r} {problem}"
    answer = record[answer_key]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return f"{answer_key!r} must be a string or a number, got {json_type_name(answer)}"
    return None


class JsonlPrompts(Task):
    """Prompts and answers from JSONL file(s), in a seeded order reshuffled every epoch.

    Verified by ``numeric_match`` unless ``reward.name`` says otherwise (math data is the common case).

    Index ``i`` is record ``perm_e[i % n]`` of epoch ``e = i // n``. A line that is not a JSON object
    with a valid prompt and an answer is an ``FwError`` naming the file and line. ``prompt_key``, ``answer_key``
    and ``shuffle`` are the ``data`` section's, which ``build_task`` passes.
    """

    reward_name = "numeric_match"

    def __init__(self, path: str | list[str], prompt_key: str, answer_key: str, shuffle: bool, seed: int = 0,
                 key: str = "data.path"):
        super().__init__(seed)
        self.prompt_key, self.answer_key, self.shuffle = prompt_key, answer_key, shuffle
        self.records: list[Sample] = []
        for file in [path] if isinstance(path, (str, Path)) else list(path):
            self.records.extend(self._read(Path(file), key))
        if not self.records:
            raise FwError(f"{key} {path}: no records (every line is empty)")
        self._order: tuple[int, list[int]] | None = None

    def _read(self, file: Path, key: str) -> list[Sample]:
        records = []
        for where, record in read_jsonl(file, key):
            problem = prompt_record_problem(record, self.prompt_key, self.answer_key)
            if problem:
                raise FwError(f"{where}: {problem}")
            answer = record[self.answer_key]
            # the record's own fields as written (a `source` of a mixed dataset included), the reference answer
            # under "answer" as for every task, and where the record is under a key of fw's own
            metadata = {k: v for k, v in record.items() if k not in (self.prompt_key, self.answer_key)}
            metadata.update({"answer": str(answer), LOCATION_KEY: where})
            records.append({"prompt": record[self.prompt_key], "answer": str(answer), "metadata": metadata})
        return records

    def __len__(self) -> int:
        return len(self.records)

    def sample(self, index: int) -> Sample:
        epoch, offset = divmod(_check_index(index), len(self.records))
        if not self.shuffle:
            return self.records[offset]
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.records)))
            _rng(self.seed, epoch, "jsonl-epoch").shuffle(order)
            self._order = (epoch, order)
        return self.records[self._order[1][offset]]


TASKS: dict[str, type] = {"digits": Digits, "arithmetic": Arithmetic, "countdown": Countdown}


def _takes_seed(target: Any) -> bool:
    """Whether calling ``target`` accepts a ``seed`` keyword (a ``Task`` subclass does, by the base class)."""
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):   # no signature to read: pass nothing it may not take
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == "seed" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
               for p in parameters)


def build_task(data_cfg: dict, seed: int, path_key: str = "data.path") -> Task:
    """The prompt source of ``cfg["data"]``: ``task`` ({name|class_path, init_args}) or ``path`` (JSONL).

    ``seed`` (recipes pass ``cfg["seed"]``, evaluation its ``eval.seed``) seeds the task unless
    ``init_args`` sets one: a built-in, or a ``class_path`` class whose constructor takes ``seed``.
    ``path_key`` is the config key that set ``path``, for the errors of reading it.
    """
    task_cfg, path = data_cfg["task"], data_cfg["path"]
    if task_cfg and path:
        raise FwError("data: set either data.task or data.path (JSONL prompts), not both")
    if path:
        from framework.imports import once

        # read once a `fw fit` process (its checks, its memory plan and the run each ask for the prompts)
        args = (path, data_cfg["prompt_key"], data_cfg["answer_key"], data_cfg["shuffle"], seed)
        return once(path_key, args, lambda: JsonlPrompts(*args, key=path_key))
    if not task_cfg:
        raise FwError("data: RL needs prompts: set data.task (e.g. {name: digits}) or data.path (JSONL)")
    init_args = dict(task_cfg.get("init_args") or {})
    if task_cfg.get("class_path"):
        from framework.imports import import_object, instantiate_once

        cls_path = task_cfg["class_path"]
        if _takes_seed(import_object(cls_path)):
            init_args.setdefault("seed", seed)
        task = instantiate_once({"class_path": cls_path, "init_args": init_args}, "data.task")
        if not callable(getattr(task, "sample", None)):
            raise FwError(f"data.task.class_path {cls_path!r}: a task needs a sample(index) -> "
                          "{prompt, answer, metadata} method")
        return task
    name = task_cfg.get("name")
    if name not in TASKS:
        raise FwError(f"data.task.name: unknown task {name!r}; built-ins are {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    init_args.setdefault("seed", seed)
    unknown = set(init_args) - set(inspect.signature(cls).parameters)
    if unknown:
        names, takes = ", ".join(sorted(map(str, unknown))), ", ".join(inspect.signature(cls).parameters)
        raise InitArgsError(f"data.task.init_args: {name!r} has no parameter(s) {names}; it takes {takes}", unknown)
    return cls(**init_args)


def checked_sample(task: Any, index: int, sft: bool = False) -> Sample:
    """`task.sample(index)`, checked to be what the recipes read of it (a user's task class returns anything): a
    dict whose `prompt` is a non-empty string (empty too for `sft`, which trains on the answer after it, as an SFT
    record may) or a list of {role, content} messages, whose `answer` is a string and whose `metadata` is a dict;
    FwError otherwise, naming the task and the index. What the reward reads of the metadata is
    `rewards.check_metadata`'s."""
    sample = task.sample(index)
    name = sample_name(task, index)
    if not isinstance(sample, dict):
        raise FwError(f"{name} returned a {type(sample).__name__}, expected a dict with prompt, answer and metadata")
    missing = [key for key in ("prompt", "answer", "metadata") if key not in sample]
    if missing:   # said as missing: the type checks below would call an absent key a None
        held = f"its keys: {', '.join(map(repr, sample))}" if sample else "it is empty"
        raise FwError(f"{name} returned a dict without {', '.join(map(repr, missing))}, expected a dict with prompt, "
                      f"answer and metadata ({held})")
    prompt = sample.get("prompt")
    if not isinstance(prompt, (str, list)):
        raise FwError(f"{name}: prompt must be a string or a list of {{role, content}} messages, got "
                      f"{type(prompt).__name__} {prompt!r:.80}")
    problem = None if sft and prompt == "" else _check_prompt(prompt)
    if problem:   # here, not at generation or chat rendering, which know neither the task nor the index
        raise FwError(f"{name}: prompt {problem}")
    if not isinstance(sample.get("answer"), str):
        raise FwError(f"{name}: answer must be a string (the completion SFT trains on, the reference of the "
                      f"built-in rewards), got {type(sample.get('answer')).__name__}")
    if not isinstance(sample.get("metadata"), dict):
        raise FwError(f"{name}: metadata must be a dict (what the reward gets as its third argument), got "
                      f"{type(sample.get('metadata')).__name__}")
    return sample


def sample_name(task: Any, index: int) -> str:
    """How errors name sample `index` of `task`: at data.task, the key that chose it."""
    return f"data.task: {type(task).__name__}.sample({index})"


def render_prompt(prompt: str | list[dict], tokenizer: Any, chat_template: bool, enable_thinking: bool) -> str:
    """The text the policy continues: the chat template (a string becomes one user turn) or the raw prompt.
    `chat_template` and `enable_thinking` are data.chat_template and tokenizer.enable_thinking."""
    if not chat_template:
        if isinstance(prompt, str):
            return prompt
        raise FwError("data.chat_template is false but the prompt is a list of messages; "
                      "set data.chat_template: true or give plain-string prompts")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=enable_thinking)
