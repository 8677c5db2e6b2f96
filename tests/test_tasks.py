"""Procedural tasks (seeded, pure in the index), JSONL prompts, build_task, render_prompt."""
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from framework import tasks
from framework.errors import FwError
from framework.jsonl import read_jsonl
from framework.rewards import REWARDS, evaluate_expression
from framework.tasks import TASKS, Arithmetic, Countdown, Digits, JsonlPrompts, Task, build_task, render_prompt


def data_cfg(**over):
    cfg = {"path": None, "task": None, "prompt_key": "prompt", "answer_key": "answer", "shuffle": True}
    cfg.update(over)
    return cfg


FACTORIES = [
    lambda seed: Digits(seed=seed),
    lambda seed: Digits(num_digits=3, rule="sum", seed=seed),
    lambda seed: Arithmetic(seed=seed),
    lambda seed: Countdown(seed=seed),
]


@pytest.mark.parametrize("make", FACTORIES)
def test_sample_is_pure_in_seed_and_index(make):
    forward = [make(0).sample(i) for i in range(20)]
    again = make(0)
    backward = [again.sample(i) for i in reversed(range(20))][::-1]
    assert forward == backward                       # order of calls and instance do not matter
    assert len({json.dumps(s, sort_keys=True) for s in forward}) > 5
    assert [make(1).sample(i) for i in range(20)] != forward
    for s in forward:
        assert set(s) == {"prompt", "answer", "metadata"} and s["metadata"]["answer"] == s["answer"]
        assert isinstance(s["prompt"], str) and isinstance(s["answer"], str)


def test_samples_identical_across_processes():
    code = ("from framework.tasks import Countdown, Arithmetic;"
            "print([Countdown(seed=3).sample(i) for i in (0, 7)], Arithmetic(seed=3).sample(5))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(h), "PATH": ""}, cwd=".").stdout for h in (1, 2)}
    assert len(runs) == 1 and "target" in runs.pop()


@pytest.mark.parametrize("rule, check", [
    ("copy", lambda d: d[0]), ("last", lambda d: d[-1]), ("next", lambda d: (d[0] + 1) % 10),
    ("sum", lambda d: sum(d) % 10), ("max", max),
])
def test_digits_rules(rule, check):
    task = Digits(num_digits=3, rule=rule, seed=5)
    for i in range(50):
        s = task.sample(i)
        digits = [int(c) for c in s["prompt"][:-1]]
        assert s["prompt"].endswith("=") and len(digits) == 3 and s["answer"] == str(check(digits))
        assert REWARDS[task.reward_name]()("", s["answer"], s["metadata"]) == 1.0


def test_digits_answers_are_roughly_uniform():
    counts = Counter(Digits(seed=0).sample(i)["answer"] for i in range(2000))
    assert set(counts) == {str(d) for d in range(10)} and min(counts.values()) > 140


def test_arithmetic_answers_and_options():
    task = Arithmetic(digits=3, ops="+-*", seed=1)
    ops = Counter()
    for i in range(300):
        s = task.sample(i)
        md = s["metadata"]
        assert 100 <= md["a"] <= 999 and 100 <= md["b"] <= 999
        assert s["prompt"] == f"{md['a']}{md['op']}{md['b']}="
        expected = {"+": md["a"] + md["b"], "-": md["a"] - md["b"], "*": md["a"] * md["b"]}[md["op"]]
        assert s["answer"] == str(expected)
        assert REWARDS[task.reward_name]()("", f"so it is {expected}", md) == 1.0
        ops[md["op"]] += 1
    assert set(ops) == {"+", "-", "*"}
    nonneg = Arithmetic(digits=1, ops=["-"], allow_negative=False, template="What is {a} {op} {b}?")
    samples = [nonneg.sample(i) for i in range(100)]
    assert all(int(s["answer"]) >= 0 for s in samples) and samples[0]["prompt"].startswith("What is ")


def test_countdown_is_always_solvable_by_its_answer():
    task = Countdown(num_numbers=4, max_number=30, max_target=500, seed=2)
    reward = REWARDS[task.reward_name](use_all=True)
    for i in range(200):
        s = task.sample(i)
        md = s["metadata"]
        value, used = evaluate_expression(s["answer"])
        assert value == md["target"] and 1 <= md["target"] <= 500
        assert Counter(used) == Counter(md["numbers"]) and all(1 <= n <= 30 for n in md["numbers"])
        assert str(md["target"]) in s["prompt"] and ", ".join(map(str, md["numbers"])) in s["prompt"]
        pair = task.sft_example(i)
        assert reward(pair["prompt"], pair["completion"], md) == 1.0


def test_sft_example_is_prompt_and_answer():
    task = Arithmetic(seed=4)
    assert task.sft_example(3) == {"prompt": task.sample(3)["prompt"], "completion": task.sample(3)["answer"]}


@pytest.mark.parametrize("cls, kwargs, message", [
    (Digits, {"num_digits": 0}, "num_digits must be an int >= 1"),
    (Digits, {"rule": "mul"}, "rule must be one of copy, last, next, sum, max"),
    (Digits, {"template": "{x}"}, "may only use the fields {digits}"),
    (Digits, {"template": "{digits.x}"}, "AttributeError: 'str' object has no attribute 'x'"),
    (Arithmetic, {"template": "{a[0]}"}, "TypeError: 'int' object is not subscriptable"),
    (Arithmetic, {"ops": "+/"}, "ops must be a non-empty selection"),
    (Arithmetic, {"ops": ["+-"]}, "ops must be a non-empty selection"),
    (Arithmetic, {"ops": [""]}, "ops must be a non-empty selection"),
    (Arithmetic, {"digits": 0}, "digits must be an int in 1..18"),
    (Countdown, {"num_numbers": 1}, "num_numbers must be an int in 2..8"),
])
def test_bad_init_args(cls, kwargs, message):
    with pytest.raises(FwError, match=message.replace("{", "\\{").replace("}", "\\}")):
        cls(**kwargs)


def test_templates_index_and_format_their_fields_as_the_task_fills_them():
    # digits is a string of digits, a and b are ints: what works on those works in the template
    assert Digits(template="first {digits[0]} of {digits}", seed=1).sample(0)["prompt"].startswith("first ")
    prompt = Arithmetic(template="{a:06d}{op}{b:06d}=", seed=1).sample(0)["prompt"]
    assert len(prompt) == 14 and prompt.endswith("=")


@pytest.mark.parametrize("cls, kwargs, missing", [
    (Digits, {"template": "Next digit:"}, "{digits}"),
    (Digits, {"template": "{{digits}}="}, "{digits}"),   # escaped braces: the literal text, not the field
    (Arithmetic, {"template": "{a} ? {b} ="}, "{op}"),
    (Arithmetic, {"template": "{a}{op}=", "ops": "+"}, "{b}"),
    (Countdown, {"template": "Use {numbers}."}, "{target}"),
])
def test_a_template_that_leaves_out_what_the_answer_depends_on_is_refused(cls, kwargs, missing):
    """Every prompt of such a template reads the same across the field it leaves out while the answers differ:
    nothing could learn it. Formatting did not catch it (an unused field is no error to str.format)."""
    assert kwargs["template"].format(digits="12", a=1, op="+", b=2, numbers="1, 2", target=3)   # it formats
    with pytest.raises(FwError) as caught:
        cls(**kwargs)
    assert str(caught.value) == (f"{cls.__name__.lower()} task: template {kwargs['template']!r} leaves out {missing}, "
                                 "which the answer depends on")


def test_one_operator_needs_no_op_field_in_the_template():
    sample = Arithmetic(ops="+", template="{a} plus {b} is", seed=2).sample(0)
    a, b = sample["metadata"]["a"], sample["metadata"]["b"]
    assert sample["prompt"] == f"{a} plus {b} is" and sample["answer"] == str(a + b)


def test_negative_index_rejected():
    with pytest.raises(FwError, match="index must be an int >= 0"):
        Digits().sample(-1)


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_prompts_epochs_and_metadata(tmp_path):
    rows = [{"question": f"q{i}", "solution": i * 10, "level": i % 2} for i in range(5)]
    path = write_jsonl(tmp_path / "math.jsonl", rows[:3] + [""] + rows[3:])
    task = JsonlPrompts(path, prompt_key="question", answer_key="solution", shuffle=True, seed=7)
    assert len(task) == 5
    epoch0 = [task.sample(i)["prompt"] for i in range(5)]
    epoch1 = [task.sample(i)["prompt"] for i in range(5, 10)]
    assert sorted(epoch0) == sorted(epoch1) == [f"q{i}" for i in range(5)]
    assert epoch0 != epoch1                         # reshuffled per epoch
    again = JsonlPrompts(path, prompt_key="question", answer_key="solution", shuffle=True, seed=7)
    assert [again.sample(i)["prompt"] for i in (9, 3, 7)] == [epoch1[4], epoch0[3], epoch1[2]]
    s = next(task.sample(i) for i in range(5) if task.sample(i)["prompt"] == "q4")
    assert s["answer"] == "40"
    assert s["metadata"] == {"level": 0, "answer": "40", "fw_location": f"{path}:6"}  # line 4 is blank
    ordered = JsonlPrompts(path, "question", "solution", shuffle=False)
    assert [ordered.sample(i)["prompt"] for i in range(7)] == ["q0", "q1", "q2", "q3", "q4", "q0", "q1"]


def test_a_jsonl_records_own_fields_reach_the_reward_as_written(tmp_path):
    """A mixed dataset routes its rewards by a field such as `source`: the record's fields arrive in the metadata
    unchanged; fw adds the reference answer under "answer" (as README says) and the record's place as fw_location."""
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "2+2", "solution": 4, "source": "gsm8k", "id": 7}])
    (sample,) = [JsonlPrompts(path, prompt_key="prompt", answer_key="solution", shuffle=False).sample(0)]
    assert sample["metadata"] == {"source": "gsm8k", "id": 7, "answer": "4", "fw_location": f"{path}:1"}


def test_jsonl_messages_prompt_and_several_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "answer": "y", "answer_extra": 1}])
    task = build_task(data_cfg(path=[a, b], shuffle=False), seed=0)
    assert task.sample(0)["prompt"] == [{"role": "user", "content": "hi"}]
    assert task.sample(1)["metadata"]["answer_extra"] == 1 and task.sample(1)["metadata"]["fw_location"] == f"{b}:1"


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "p", "answer": "a"', "not valid JSON"),
    ('["p", "a"]', "expected a JSON object, got an array"),
    ('"p"', "expected a JSON object, got a string"),
    ('{"prompt": "p", "answer": {"a": 1}}', "'answer' must be a string or a number, got an object"),
    ('{"prompt": "p"}', "missing key 'answer'"),
    ('{"prompt": "", "answer": "a"}', "'prompt' is an empty string"),
    ('{"prompt": [{"role": "user"}], "answer": "a"}',
     r"messages\[0\] \(user\): content must be a string, got null"),
    ('{"prompt": [{"role": "tool", "content": "x"}], "answer": "a"}', r"messages\[0\]: role 'tool' is not supported"),
    ('{"prompt": [["user", "x"]], "answer": "a"}', r"messages\[0\]: expected a \{role, content\} object, got an array"),
    ('{"prompt": [{"content": "x"}], "answer": "a"}', r"messages\[0\]: missing 'role'"),
    ('{"prompt": "p", "answer": null}', "'answer' must be a string or a number"),
])
def test_jsonl_malformed_line_names_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": "ok", "answer": "1"}', "", line])
    with pytest.raises(FwError, match=f"bad.jsonl:3: .*{message}"):
        JsonlPrompts(path, "prompt", "answer", True)


def test_a_jsonl_file_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Windows editors save UTF-8 with a byte-order mark; the file's records are the same as without one."""
    lines = ['{"prompt": "2+2", "answer": "4"}', '{"prompt": "3+3", "answer": "6"}']
    plain = tmp_path / "plain.jsonl"
    plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
    marked = tmp_path / "marked.jsonl"
    marked.write_text("\n".join(lines) + "\n", encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    assert [r for _, r in read_jsonl(marked)] == [r for _, r in read_jsonl(plain)] == [json.loads(x) for x in lines]


def test_jsonl_missing_and_empty_files(tmp_path):
    with pytest.raises(FwError, match="cannot read .*nope.jsonl"):
        JsonlPrompts(str(tmp_path / "nope.jsonl"), "prompt", "answer", True)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(FwError, match="no records"):
        JsonlPrompts(str(tmp_path / "empty.jsonl"), "prompt", "answer", True)


def test_build_task_builtin_and_seed():
    task = build_task(data_cfg(task={"name": "digits", "init_args": {"num_digits": 2}}), seed=3)
    assert isinstance(task, Digits) and task.seed == 3 and task.num_digits == 2
    pinned = build_task(data_cfg(task={"name": "arithmetic", "init_args": {"seed": 9}}), seed=3)
    assert pinned.seed == 9
    assert set(TASKS) == {"digits", "arithmetic", "countdown"}


@pytest.mark.parametrize("cfg, message", [
    (data_cfg(), "set data.task .* or data.path"),
    (data_cfg(task={"name": "digits"}, path="x.jsonl"), "either data.task or data.path"),
    (data_cfg(task={"name": "sudoku", "init_args": {}}), "unknown task 'sudoku'; built-ins are arithmetic"),
    (data_cfg(task={"name": "digits", "init_args": {"digitz": 2}}), "'digits' has no parameter.* digitz"),
])
def test_build_task_errors(cfg, message):
    with pytest.raises(FwError, match=message):
        build_task(cfg, seed=0)


class Squares(Task):
    """A user task as the README describes one: no constructor of its own, a pure function of (seed, index)."""

    def sample(self, index):
        n = random.Random(f"{self.seed}:{index}").randint(10, 10 ** 6)
        return self._make(f"{n}^2=", str(n * n))


class KeywordsTask(Squares):
    """A user task that forwards its keyword arguments to the base class."""

    def __init__(self, size=1, **kwargs):
        super().__init__(**kwargs)
        self.size = size


class SeedlessTask:
    """A task-like class with no seed parameter: fw must not pass one."""

    def __init__(self, size=1):
        self.size = size

    def sample(self, index):
        return {"prompt": "p", "answer": "a", "metadata": {"answer": "a"}}


def test_class_path_tasks_get_the_runs_seed():
    def build(class_path, run_seed, **init_args):
        return build_task(data_cfg(task={"class_path": class_path, "init_args": init_args}), seed=run_seed)

    for class_path in ("tests.test_tasks.Squares", "tests.test_tasks.KeywordsTask"):
        one, two = build(class_path, 1), build(class_path, 2)
        assert (one.seed, two.seed) == (1, 2), class_path
        assert [one.sample(i)["prompt"] for i in range(5)] != [two.sample(i)["prompt"] for i in range(5)]
        assert build(class_path, 1, seed=9).seed == 9          # init_args wins
    assert build("tests.test_tasks.KeywordsTask", 3, size=4).size == 4
    assert build("tests.test_tasks.SeedlessTask", 3, size=2).size == 2


def test_hopeless_countdown_parameters_are_refused_at_once():
    start = time.monotonic()
    for kwargs in ({"num_numbers": 8, "max_number": 1000, "max_target": 1},
                   {"num_numbers": 8, "max_number": 1000, "max_target": 10}):
        with pytest.raises(FwError, match="countdown task: with num_numbers = 8, max_number = 1000 and max_target = "
                                          r"1.*raise max_target, or lower max_number or num_numbers"):
            Countdown(**kwargs)
        with pytest.raises(FwError, match="max_target"):
            build_task(data_cfg(task={"name": "countdown", "init_args": kwargs}), seed=0)
    assert time.monotonic() - start < 10
    Countdown(num_numbers=6, max_number=100, max_target=100).sample(0)     # slow-ish but fine: accepted


def test_countdown_sampling_gives_up_with_an_error(monkeypatch):
    task = Countdown(seed=1)
    draws = []

    def out_of_range(rng):
        draws.append(1)
        assert len(draws) < 10_000, "the sample kept drawing"
        return [50, 50, 50, 50], 50 ** 4, "50*50*50*50"

    monkeypatch.setattr(tasks, "COUNTDOWN_MAX_DRAWS", 20)
    monkeypatch.setattr(task, "_build", out_of_range)
    with pytest.raises(FwError, match="none of 20 random expressions for sample 3 comes out at most max_target"):
        task.sample(3)
    assert len(draws) == 20


def test_build_task_from_class_path():
    task = build_task(data_cfg(task={"class_path": "framework.tasks.Digits", "init_args": {"rule": "next"}}), seed=0)
    assert isinstance(task, Digits) and task.rule == "next"
    with pytest.raises(FwError, match="needs a sample"):
        build_task(data_cfg(task={"class_path": "collections.Counter", "init_args": {}}), seed=0)


class Given(Task):
    """A user task whose sample(index) is `samples[index]`."""

    def __init__(self, samples):
        super().__init__()
        self.samples = samples

    def sample(self, index):
        return self.samples[index]


@pytest.mark.parametrize("prompt, problem", [
    ("", "prompt is an empty string"),
    ([], "prompt must be a non-empty string or a non-empty list of {role, content} messages"),
    ([{"role": "user"}], "prompt messages[0] (user): content must be a string, got null"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": ["u"]}],
     "prompt messages[1] (user): content must be a string, got an array"),
    ([{"content": "u"}], "prompt messages[0]: missing 'role' (one of system, user, assistant)"),
])
def test_checked_sample_names_the_task_and_index_of_a_prompt_that_cannot_be_generated_from(prompt, problem):
    """An empty prompt (no token to continue) or a chat the template cannot render fails at generation or rendering,
    which knows neither the task nor the sample; checked_sample says both, as for its other problems."""
    good = {"prompt": "1=", "answer": "1", "metadata": {"answer": "1"}}
    task = Given([good, {**good, "prompt": prompt}])
    assert tasks.checked_sample(task, 0) is good
    with pytest.raises(FwError) as caught:
        tasks.checked_sample(task, 1)
    assert str(caught.value) == f"data.task: Given.sample(1): {problem}"


def test_an_sft_example_may_have_an_empty_prompt_or_a_blank_one():
    """SFT trains on the answer after the prompt, which may be empty, as an SFT record's may; a blank prompt is one
    token, for generation as for SFT."""
    task = Given([{"prompt": "", "answer": "1", "metadata": {}}, {"prompt": " ", "answer": "2", "metadata": {}}])
    assert [task.sft_example(i) for i in (0, 1)] == [{"prompt": "", "completion": "1"},
                                                      {"prompt": " ", "completion": "2"}]
    assert tasks.checked_sample(task, 1)["prompt"] == " "


def test_a_sample_without_the_metadata_keys_its_reward_reads_is_named():
    """exact_match and numeric_match read metadata["answer"] on every call, countdown its numbers and target: a sample
    without them is refused at data.task with its index. The format reward and a user's reward state no key they
    read, so the same sample passes."""
    from framework.rewards import CountdownReward, ExactMatch, FormatReward, NumericMatch, check_metadata

    sample = {"prompt": "1=", "answer": "1", "metadata": {"numbers": [1, 2]}}
    task = Given([sample] * 4)
    for reward, name, missing in ((ExactMatch(), "exact_match", "'answer'"),
                                  (NumericMatch(), "numeric_match", "'answer'"),
                                  (CountdownReward(), "countdown", "'target'")):
        with pytest.raises(FwError) as caught:
            check_metadata(task, 3, tasks.checked_sample(task, 3), reward)
        assert str(caught.value) == (f"data.task: Given.sample(3): metadata has no {missing}, which the reward "
                                     f"{name!r} reads (its keys: 'numbers')")
    for reward in (FormatReward(), lambda prompt, completion, metadata: 1.0):
        check_metadata(task, 3, sample, reward)
    with pytest.raises(FwError, match=r"^data.task: Given.sample\(0\): metadata has no 'answer', which the reward "
                                      r"'exact_match' reads \(it is empty\)$"):
        check_metadata(task, 0, {**sample, "metadata": {}}, ExactMatch())
    check_metadata(task, 0, {**sample, "metadata": {"answer": "1"}}, NumericMatch())


@pytest.mark.parametrize("metadata, problem", [
    ({"numbers": ["3", "8"], "target": 24}, "metadata 'numbers' must be a list of finite numbers, got ['3', '8']"),
    ({"numbers": "3 8", "target": 24}, "metadata 'numbers' must be a list of finite numbers, got '3 8'"),
    ({"numbers": [3, True], "target": 24}, "metadata 'numbers' must be a list of finite numbers, got [3, True]"),
    ({"numbers": [3, 8], "target": "24"}, "metadata 'target' must be a finite number, got '24'"),
    ({"numbers": [3, 8], "target": float("nan")}, "metadata 'target' must be a finite number, got nan"),
])
def test_countdown_metadata_of_another_kind_is_named(metadata, problem):
    """countdown compares the expression's numbers with metadata's: strings never match, so before this check every
    completion of such a sample scored the format score, silently."""
    from framework.rewards import CountdownReward, check_metadata

    reward = CountdownReward(format_score=0.1)
    sample = {"prompt": "3 8 -> 24", "answer": "3*8", "metadata": metadata}
    with pytest.raises(FwError) as caught:
        check_metadata(Given([sample]), 0, sample, reward)
    assert str(caught.value) == f"data.task: Given.sample(0): {problem}, which the reward 'countdown' reads"
    good = {**sample, "metadata": {"numbers": [3, 8.0], "target": 24}}
    check_metadata(Given([good]), 0, good, reward)
    assert reward("", "<answer>3*8</answer>", good["metadata"]) == 1.0


@pytest.mark.parametrize("keys", [("level"), ["level"], {"level"}, ("level",)], ids=["str", "list", "set", "tuple"])
def test_metadata_keys_written_as_a_string_or_a_set_name_their_keys(keys):
    """`metadata_keys = ("level")` (a string: the tuple's comma forgotten) names the key `level`, as a set of keys
    does; before, anything but a tuple or list was taken for no keys, and a sample without `level` passed until the
    reward's KeyError at scoring."""
    from framework.rewards import check_metadata

    class Levelled:
        metadata_keys = keys

        def __call__(self, prompt, completion, metadata):
            return float(metadata["level"])

    sample = {"prompt": "1=", "answer": "1", "metadata": {"answer": "1"}}
    with pytest.raises(FwError) as caught:
        check_metadata(Given([sample]), 0, sample, Levelled())
    assert str(caught.value) == ("data.task: Given.sample(0): metadata has no 'level', which the reward 'Levelled' "
                                 "reads (its keys: 'answer')")
    check_metadata(Given([sample]), 0, {**sample, "metadata": {"answer": "1", "level": 2}}, Levelled())


def test_a_sample_without_a_key_is_said_to_lack_it():
    """A user task's sample without `answer` was refused as "answer must be a string, got NoneType", as if the
    task had set it to None; the line names the key that is missing."""
    sample = {"prompt": "1=", "metadata": {"answer": "1"}}
    with pytest.raises(FwError) as caught:
        tasks.checked_sample(Given([sample]), 0)
    assert str(caught.value) == ("data.task: Given.sample(0) returned a dict without 'answer', expected a dict with "
                                 "prompt, answer and metadata (its keys: 'prompt', 'metadata')")
    with pytest.raises(FwError, match=r"^data.task: Given.sample\(0\): answer must be a string .*, got NoneType$"):
        tasks.checked_sample(Given([{**sample, "answer": None}]), 0)


def _validate_with_picky(tmp_path: Path, problem: str) -> tuple[Path, subprocess.CompletedProcess]:
    """`fw validate` of the digits task under a class_path reward `picky.Picky` whose metadata_problem returns the
    expression `problem` (line 3 of picky.py): the config and the finished process."""
    (tmp_path / "picky.py").write_text(
        "class Picky:\n"
        "    def metadata_problem(self, metadata):\n"
        f"        return {problem}\n"
        "    def __call__(self, prompt, completion, metadata):\n"
        "        return 0.0\n")
    config = tmp_path / "train.yaml"
    config.write_text("recipe: grpo\nmodel: {policy: {preset: tiny}}\ndata: {task: {name: digits}}\n"
                      "reward: {class_path: picky.Picky}\n")
    done = subprocess.run([sys.executable, "-m", "framework", "validate", "--config", str(config)],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=300,
                          check=False)
    return config, done


def test_a_user_rewards_metadata_problem_is_asked_without_metadata_keys(tmp_path):
    """README: a class_path reward's metadata_problem(metadata), if it has one, refuses a sample; a reward that
    states no metadata_keys still has its metadata_problem asked, at `fw validate` as at every draw."""
    config, done = _validate_with_picky(tmp_path, "None if isinstance(metadata['answer'], int) else "
                                                  "'answer must be an int'")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (f"{config}:3:14: data.task: Digits.sample(0): answer must be an int, which the "
                                   "reward 'Picky' reads")


def test_a_user_rewards_metadata_problem_that_raises_is_one_line_at_its_class_path(tmp_path):
    """A metadata_problem that raises (user code, as a reward that raises is) is one line at reward.class_path naming
    the call and the user's line, exit 2, not a traceback out of fw validate."""
    config, done = _validate_with_picky(tmp_path, "metadata['level']")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (f"{config}:4:22: reward.class_path: Picky.metadata_problem(Digits.sample(0)'s "
                                   f"metadata) raised KeyError: 'level' (at {tmp_path / 'picky.py'}:3)")


class Template:
    """A chat-template renderer standing in for the tokenizer: records what it was asked."""

    def apply_chat_template(self, messages, add_generation_prompt=True, enable_thinking=False):
        body = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "") + ("<think>" if enable_thinking else "")


def test_render_prompt():
    assert render_prompt("7=", None, chat_template=False, enable_thinking=False) == "7="
    assert render_prompt("7=", Template(), chat_template=True, enable_thinking=False) == "<user>7=<assistant>"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert render_prompt(msgs, Template(), True, enable_thinking=True) == "<system>s<user>u<assistant><think>"
    with pytest.raises(FwError, match="chat_template is false but the prompt is a list of messages"):
        render_prompt(msgs, None, chat_template=False, enable_thinking=False)


def test_fw_validate_names_hopeless_countdown_parameters(tmp_path, monkeypatch):
    from framework.config import ConfigError
    from framework.validate import validate_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.yaml").write_text("recipe: grpo\nmodel:\n  policy:\n    preset: tiny\ndata:\n"
                                         "  task: {name: countdown, init_args: {num_numbers: 8, max_number: 1000, "
                                         "max_target: 1}}\n")
    with pytest.raises(ConfigError, match=r"train.yaml:6:\d+: data.task.init_args: countdown task: .*max_target = 1"):
        validate_config(["train.yaml"])
