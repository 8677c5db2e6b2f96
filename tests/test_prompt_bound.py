"""The prompt length the memory plan counts (recipes.rl.longest_prompt): a procedural task's stated widest prompts
bound every sample it draws, under the built-in tokenizer and Qwen3's; a class_path task may state them too; a
2-process job measures a JSONL dataset on rank 0 only."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripts.qwen_tokenizer import qwen_tokenizer_dir

from framework.config import resolve
from framework.tasks import build_task, render_prompt
from framework.tokenizer import Tokenizer
from recipes.rl import PLAN_PROMPTS, longest_prompt

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = 20_000
SEEDS = (0, 1, 7, 12345)

# The parameters each built-in task takes, spread over their allowed ranges, with templates whose text touches the
# numbers (a digit next to a letter or a sign) and one chat rendering.
CASES = [
    ({"name": "digits"}, False),
    ({"name": "digits", "init_args": {"num_digits": 7, "rule": "sum", "template": "Digits:{digits}->"}}, True),
    ({"name": "arithmetic", "init_args": {"digits": 1}}, False),
    ({"name": "arithmetic", "init_args": {"digits": 3, "ops": "-", "allow_negative": False,
                                          "template": "Q{a} {op}= {b}?"}}, True),
    ({"name": "arithmetic", "init_args": {"digits": 18, "ops": "*+"}}, False),
    ({"name": "countdown"}, True),
    ({"name": "countdown", "init_args": {"num_numbers": 2, "max_number": 9, "max_target": 20}}, False),
    ({"name": "countdown", "init_args": {"num_numbers": 6, "max_number": 100, "max_target": 1000}}, False),
    ({"name": "countdown", "init_args": {"num_numbers": 3, "max_number": 99, "max_target": 50,
                                         "template": "{numbers}=>{target}!"}}, True),
]


def task_cfg(task: dict, chat_template: bool, seed: int = 0, **data) -> dict:
    return resolve({"recipe": "grpo", "seed": seed, "model": {"policy": {"preset": "tiny"}},
                    "data": {"task": task, "chat_template": chat_template, **data}})


@pytest.fixture(scope="module")
def tokenizers():
    return {"builtin": Tokenizer.builtin(), "qwen3": Tokenizer.from_pretrained(qwen_tokenizer_dir())}


@pytest.mark.parametrize("task, chat_template", CASES, ids=lambda c: json.dumps(c) if isinstance(c, dict) else str(c))
def test_no_sample_of_a_built_in_task_outgrows_its_widest_prompt(tokenizers, task, chat_template):
    """20,000 samples over four seeds: none has more tokens than longest_prompt says, under the built-in character
    tokenizer and Qwen3's (which splits numbers into single digits); digits and arithmetic, whose prompts all have
    the same digit counts, reach it exactly. The first PLAN_PROMPTS samples miss countdown's widest (a run's
    prompts would outgrow the plan)."""
    # one resolved config: its data section is the same whatever the seed, which build_task takes on its own
    cfg = task_cfg(task, chat_template)
    prompts = []
    for seed in SEEDS:
        sampled = build_task(cfg["data"], seed=seed)
        prompts += [sampled.sample(i)["prompt"] for i in range(SAMPLES // len(SEEDS))]
    # the most tokens of the distinct prompts are the most of all: a narrow task repeats most of its prompts
    prompts = list(dict.fromkeys(prompts))
    thinking = cfg["tokenizer"]["enable_thinking"]
    for name, tok in tokenizers.items():
        counts = tok.token_counts([render_prompt(p, tok, chat_template, thinking) for p in prompts])
        bound = longest_prompt(cfg, tok)
        assert max(counts) <= bound, name
        if task["name"] != "countdown":
            assert max(counts) == bound, name


@pytest.mark.parametrize("name", ["builtin", "qwen3"])
def test_countdowns_widest_prompt_has_every_number_and_the_target_at_their_most_digits(tokenizers, name):
    """Countdown over 6 numbers up to 100 with targets up to 1000 is bounded by the prompt written out by hand with
    100 six times and 1000, which its first PLAN_PROMPTS samples do not reach."""
    tok = tokenizers[name]
    task = {"name": "countdown", "init_args": {"num_numbers": 6, "max_number": 100, "max_target": 1000}}
    text = ("Using the numbers 100, 100, 100, 100, 100, 100, write an expression equal to 1000. Use + - * / and "
            "parentheses, each number at most once. Put the expression in <answer></answer>.")
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], enable_thinking=False)
    assert longest_prompt(task_cfg(task, True), tok) == len(tok.encode(rendered))


class Widening:
    """A class_path task: prompt ``i`` is ``i % 1000 + 1`` x's; it states its widest prompt."""

    reward_name = "exact_match"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def sample(self, index: int) -> dict:
        return {"prompt": "x" * (index % 1000 + 1), "answer": "1", "metadata": {"answer": "1"}}

    def widest_prompts(self) -> list[str]:
        return ["x" * 1000]


class Unstated(Widening):
    """The same prompts, no bound stated: the plan reads the first PLAN_PROMPTS samples."""

    widest_prompts = None


def test_a_class_path_task_may_state_its_widest_prompts(tok):
    """A class_path task's widest_prompts() sets the prompt length (1000 characters, one token each); one that
    states none is measured by its first PLAN_PROMPTS samples (1..256 characters)."""
    stated = task_cfg({"class_path": "test_prompt_bound.Widening"}, False)
    assert longest_prompt(stated, tok) == 1000
    unstated = task_cfg({"class_path": "test_prompt_bound.Unstated"}, False)
    assert longest_prompt(unstated, tok) == PLAN_PROMPTS


SPY = """
import json, os, sys
from lightning.pytorch.utilities import rank_zero_only
from framework.config import resolve
from framework.tokenizer import Tokenizer
from framework.trainer import fit
from recipes.rl import LONGEST_PROMPT_ENV

measure = Tokenizer.most_tokens


def most_tokens(self, texts):
    # each call, by the rank of the process that makes it
    with open(os.path.join(sys.argv[2], f"measured-rank{rank_zero_only.rank}"), "a") as f:
        f.write(f"{len(texts)}\\n")
    return measure(self, texts)


Tokenizer.most_tokens = most_tokens
fit(resolve(json.loads(sys.argv[1])))
# the figure each process holds: rank 1 inherits it from rank 0, which starts it
with open(os.path.join(sys.argv[2], f"figure-rank{rank_zero_only.rank}"), "w") as f:
    f.write(os.environ.get(LONGEST_PROMPT_ENV, ""))
"""


@pytest.mark.slow   # one 2-process Lightning start-up
def test_two_processes_measure_a_dataset_on_rank_zero_only(tmp_path):
    """A 2-process GRPO fit on a JSONL file: rank 0 renders and tokenizes every prompt once (its memory plan, before
    torch.distributed starts) and hands the figure on in its environment; rank 1, which Lightning starts after
    that from rank 0, takes it from there and measures nothing. The figure is the most tokens of any rendered prompt."""
    tok = Tokenizer.builtin()
    texts = [f"What is {'1' * n} + 2?" for n in (3, 40, 7, 90, 12, 5)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "answer": "1"}) + "\n" for t in texts))
    run, spies = tmp_path / "run", tmp_path / "spies"
    spies.mkdir()
    cfg = {"recipe": "grpo", "seed": 3, "run_dir": str(run), "model": {"policy": {"preset": "tiny"}},
           "data": {"path": str(prompts), "chat_template": True},
           "rollout": {"prompts_per_step": 1, "max_new_tokens": 2, "temperature": 1.0},
           "grpo": {"group_size": 2, "minibatches": 1},
           "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": 1,
                       "enable_progress_bar": False},
           "checkpoint": {"every_n_steps": 100}, "logging": {"csv": False, "tensorboard": False}}
    script = tmp_path / "spy_script.py"
    script.write_text(SPY)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, str(script), json.dumps(cfg), str(spies)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (spies / "measured-rank0").read_text() == f"{len(texts)}\n"   # once, every prompt
    assert not (spies / "measured-rank1").exists()
    longest = max(len(tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))) for t in texts)
    for rank in (0, 1):
        assert json.loads((spies / f"figure-rank{rank}").read_text())["longest"] == longest
