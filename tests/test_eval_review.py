"""Evaluation, attacked where test_eval.py does not reach: pass@k at its edges against the Codex product form, RL
metrics of rewards of every kind (outside [0, 1], NumPy floats) against hand counts and the same over any number of
ranks (uneven splits, ranks with no prompt), SFT's token-weighted loss with rows cut by data.max_seq_len over any
number of ranks against float64, eval data smaller than eval.max_prompts, eval.max_new_tokens, rewards that return
what is not a float, and a held-out set chosen without a reward (fw validate) still checked for what the reward
reads."""

import itertools
import json
import math

import numpy as np
import pytest
import torch

from framework.config import resolve
from framework.errors import FwError
from framework.evaluation import Evaluation, check_held_out, pass_at_k
from framework.models import build_policy
from framework.rollout import stop_token_ids
from framework.tasks import Digits
from framework.tokenizer import build_tokenizer

K = 4   # samples per prompt


def rl_config(run_dir, reward, **eval_changes):
    return resolve({
        "recipe": "grpo", "seed": 5, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
        "data": {"task": {"name": "digits", "init_args": {"num_digits": 3, "rule": "next"}}, "chat_template": False},
        "rollout": {"prompts_per_step": 2, "max_new_tokens": 2}, "reward": reward, "grpo": {"group_size": 4},
        "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False},
        "logging": {"csv": False, "tensorboard": False},
        "eval": {"every_n_steps": 1, "max_prompts": 5, "samples_per_prompt": K, **eval_changes}})


# ---------------------------------------------------------------- pass@k


@pytest.mark.parametrize(("n", "c", "k"), [(200, 13, 10), (200, 0, 200), (200, 200, 1), (50, 1, 50), (50, 49, 2),
                                           (1, 0, 1), (1, 1, 1), (7, 3, 5)])
def test_pass_at_k_against_the_codex_product_form(n, c, k):
    """1 - C(n-c, k)/C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i), in float64, at large n and at c = 0, c = n, k = n."""
    reference = 1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))
    assert pass_at_k(n, c, k) == pytest.approx(reference, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 1, 4), (3, 4, 2), (3, -1, 1), (3, 1, 0), (0, 0, 1)])
def test_pass_at_k_refuses_what_has_no_estimate(n, c, k):
    with pytest.raises(ValueError, match=rf"n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


# ---------------------------------------------------------------- RL metrics


class CountingReward:
    """Sample i of prompt p (in the order scored) gets FULL[i % 3] for i < wanted(p), else PART[i % 4]: every prompt
    a known number of full-credit samples, whatever the completion or the rank scoring it."""

    FULL = (1.0, np.float64(2.0), np.float32(1.0))   # >= 1: correct, a value above 1 and NumPy floats among them
    PART = (0.0, 0.5, -1.0, np.float64(0.25))

    def __init__(self):
        self.scored: dict[str, list[float]] = {}

    @staticmethod
    def wanted(prompt: str) -> int:
        return sum(map(ord, prompt)) % (K + 1)

    def __call__(self, prompt, completion, metadata):
        i = len(values := self.scored.setdefault(prompt, []))
        value = self.FULL[i % 3] if i < self.wanted(prompt) else self.PART[i % 4]
        values.append(float(value))
        return value


def test_rl_metrics_against_hand_counts_on_any_number_of_ranks(tmp_path):
    """Accuracy counts rewards >= 1, pass@k (k = n) a prompt with any of them, pass@1 c/n, mean@k and reward_mean the
    rewards as scored (2.0 and -1.0 too); each of 1, 2, 3 and 8 ranks (5 prompts: uneven, some ranks with none)
    scoring every world_size-th prompt gives the same sums."""
    cfg = rl_config(tmp_path / "run", {"class_path": "test_eval_review.CountingReward"}, max_new_tokens=1)
    tokenizer = build_tokenizer(cfg)
    policy = build_policy(cfg["model"]["policy"], tokenizer, seed=0)
    evaluation = Evaluation(cfg, tokenizer)
    metrics = evaluation.run(policy)
    scored = evaluation.reward_fn.scored
    assert len(scored) == 5 and all(len(v) == K for v in scored.values())
    counts = [sum(v >= 1 for v in values) for values in scored.values()]
    assert 0 in counts and any(0 < c < K for c in counts)   # the counts below tell pass@k from pass@1 and accuracy
    rewards = [v for values in scored.values() for v in values]
    assert metrics == pytest.approx({
        "eval/reward_mean": sum(rewards) / 20, "eval/accuracy": sum(counts) / 20,
        "eval/pass@k": sum(c > 0 for c in counts) / 5, "eval/pass@1": sum(c / K for c in counts) / 5,
        "eval/mean@k": sum(sum(v) / K for v in scored.values()) / 5, "eval/response_len": 1.0, "eval/prompts": 5},
        abs=1e-12)
    for world_size in (2, 3, 8):
        evaluation.reward_fn = CountingReward()
        with torch.no_grad():
            sums = [evaluation._rl_sums(policy, rank, world_size) for rank in range(world_size)]
        assert all(error is None for _, error in sums)
        total = torch.stack([s for s, _ in sums]).sum(0).tolist()
        assert evaluation._rl_metrics(total) == pytest.approx(metrics, abs=1e-12), world_size
        assert evaluation.reward_fn.scored == scored


class RecordingReward:
    """0.0 for every completion, each recorded under its prompt in the order scored."""

    def __init__(self):
        self.scored: dict[str, list[str]] = {}

    def __call__(self, prompt, completion, metadata):
        self.scored.setdefault(prompt, []).append(completion)
        return 0.0


def test_sampled_eval_draws_the_same_completions_on_any_number_of_ranks_and_batches(tmp_path):
    """Sampling at temperature 1, fp32 on CPU: each eval sample is keyed by its index in the eval set, so 1, 2 and 3
    ranks, and batches of 1, 2 or 5 prompts (rollout.prompts_per_step), draw exactly the same completions. Before,
    the seed of a call mixed the rank and the batch's index in: the completions differed."""
    cfg = rl_config(tmp_path / "run", {"class_path": "test_eval_review.RecordingReward"}, max_new_tokens=6,
                    temperature=1.0)
    tokenizer = build_tokenizer(cfg)
    policy = build_policy(cfg["model"]["policy"], tokenizer, seed=0)
    evaluation = Evaluation(cfg, tokenizer)
    evaluation.run(policy)
    want = evaluation.reward_fn.scored
    assert len(want) == 5 and all(len(set(v)) > 1 for v in want.values())   # sampled, not one greedy completion
    for world_size, per_step in ((1, 1), (1, 5), (2, 2), (3, 1), (3, 2)):
        evaluation.reward_fn = RecordingReward()
        cfg["rollout"]["prompts_per_step"] = per_step
        with torch.no_grad():
            for rank in range(world_size):
                evaluation._rl_sums(policy, rank, world_size)
        assert evaluation.reward_fn.scored == want, (world_size, per_step)


def test_eval_max_prompts_beyond_the_eval_file_and_eval_max_new_tokens(tmp_path):
    """An eval.path of 3 records with eval.max_prompts 64 evaluates those 3; eval.max_new_tokens bounds the
    completions below rollout.max_new_tokens, and null leaves rollout's."""
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": f"{n} ->", "answer": str(n)}) + "\n" for n in (11, 22, 33)))
    reward = {"class_path": "test_eval_review.CountingReward"}
    lens = {}
    for limit in (1, None):
        cfg = rl_config(tmp_path / "run", reward, path=str(held), max_prompts=64, max_new_tokens=limit,
                        temperature=0.0)
        cfg["rollout"]["max_new_tokens"] = 3
        tokenizer = build_tokenizer(cfg)
        evaluation = Evaluation(cfg, tokenizer)
        policy = build_policy(cfg["model"]["policy"], tokenizer, seed=0)
        with torch.no_grad():   # no stop token is ever the greedy choice
            policy.lm_head_weight[sorted(stop_token_ids(tokenizer, policy))] = 0.0
        metrics = evaluation.run(policy)
        assert metrics["eval/prompts"] == 3 and sorted(evaluation.reward_fn.scored) == ["11 ->", "22 ->", "33 ->"]
        lens[limit] = metrics["eval/response_len"]
    assert lens == {1: 1.0, None: 3.0}


class BadReward:
    """Returns `VALUE` (set by the test below) for every sample."""

    VALUE = 0.0

    def __call__(self, prompt, completion, metadata):
        return self.VALUE


@pytest.mark.parametrize(("value", "what"), [(float("nan"), "nan, expected a finite float"),
                                             (None, "NoneType None, expected a float"),
                                             (True, "bool True, expected a float")])
def test_a_reward_that_returns_no_float_fails_the_evaluation_or_scores_zero(tmp_path, monkeypatch, value, what):
    """NaN, None and a bool are failed samples: reward.on_error raise fails the evaluation at its first batch
    (rollout.prompts_per_step prompts) naming them, zero scores
    them 0."""
    monkeypatch.setattr(BadReward, "VALUE", value)
    for on_error in ("raise", "zero"):
        cfg = rl_config(tmp_path / "run", {"class_path": "test_eval_review.BadReward", "on_error": on_error,
                                           "max_error_fraction": 1.0}, max_new_tokens=1)
        tokenizer = build_tokenizer(cfg)
        evaluation = Evaluation(cfg, tokenizer)
        policy = build_policy(cfg["model"]["policy"], tokenizer, seed=0)
        if on_error == "raise":
            with pytest.raises(FwError, match=f"reward failed on {2 * K} of {2 * K} samples.*{what}"):
                evaluation.run(policy)
        else:
            metrics = evaluation.run(policy)
            assert metrics["eval/reward_mean"] == 0.0 and metrics["eval/pass@k"] == 0.0


# ---------------------------------------------------------------- held-out set chosen without a reward


class Unanswered(Digits):
    """Digits whose samples keep no reference answer in their metadata."""

    def sample(self, index):
        return {**super().sample(index), "metadata": {}}


def test_a_held_out_set_chosen_without_a_reward_is_checked_when_scored(tmp_path):
    """`fw fit` chooses the held-out set once, for its validation (no reward built) and its evaluation: the
    evaluation still names a sample without the metadata its reward reads, as it does when it chooses alone."""
    cfg = rl_config(tmp_path / "run", {"name": "numeric_match"})
    cfg["data"]["task"] = {"class_path": "test_eval_review.Unanswered", "init_args": {}}
    check_held_out(cfg)
    with pytest.raises(FwError, match=r"^data\.task: Unanswered\.sample\(\d+\): metadata has no 'answer', which the "
                                      r"reward 'numeric_match' reads \(it is empty\)$"):
        Evaluation(cfg, build_tokenizer(cfg))


# ---------------------------------------------------------------- SFT


def test_sft_loss_is_token_weighted_over_rows_cut_by_max_seq_len_on_any_number_of_ranks(tmp_path):
    """eval/loss is the nll of every target kept within data.max_seq_len over their count (not a mean of the
    examples' means): against float64, with an example cut, one whose prompt fills the row (no target, a batch of
    its own) and 1, 2, 3 and 8 ranks."""
    from framework.data import IGNORE, encode_record, truncate

    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text(json.dumps({"prompt": "train me", "completion": "ok"}) + "\n")
    records = [{"prompt": "a", "completion": "b c d e f"}, {"prompt": "x" * 40, "completion": "y"},
               {"prompt": "what is 2+2", "completion": "4"}, {"prompt": "q", "completion": "z" * 60},
               {"prompt": "hello", "completion": "world"}]
    held.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = resolve({
        "recipe": "sft", "seed": 1, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
        "data": {"path": str(train), "max_seq_len": 24, "batch_size": 1, "chat_template": False},
        "trainer": {"accelerator": "cpu", "max_steps": 1, "enable_progress_bar": False},
        "logging": {"csv": False, "tensorboard": False},
        "eval": {"path": str(held), "every_n_steps": 1, "max_prompts": 8}})
    tokenizer = build_tokenizer(cfg)
    policy = build_policy(cfg["model"]["policy"], tokenizer, seed=0)
    evaluation = Evaluation(cfg, tokenizer)
    metrics = evaluation.run(policy)

    nll = count = 0.0
    kept = []
    for r in records:
        full = encode_record(r, "auto", tokenizer, cfg, "ref", train_on_prompt=False)
        ex = truncate(full, 24)
        targets = torch.tensor(ex.targets)
        keep = targets != IGNORE
        kept.append((int(keep.sum()), sum(t != IGNORE for t in full.targets)))
        if not keep.any():
            continue
        with torch.no_grad():
            hidden = policy(torch.tensor([ex.ids]), return_hidden=True)[0].double()
        logp = torch.log_softmax(hidden[keep] @ policy.lm_head_weight.detach().double().T, -1)
        nll -= float(logp.gather(1, targets[keep][:, None]).sum())
        count += float(keep.sum())
    assert kept[1][0] == 0 and 0 < kept[3][0] < kept[3][1]   # a row with no target left, a row cut
    assert metrics["eval/tokens"] == count
    assert metrics["eval/loss"] == pytest.approx(nll / count, rel=1e-5)
    assert metrics["eval/perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    for world_size in (2, 3, 8):
        with torch.no_grad():
            total = sum(evaluation._sft_sums(policy, rank, world_size) for rank in range(world_size)).tolist()
        assert evaluation._sft_metrics(total) == pytest.approx(metrics, rel=1e-6), world_size


def test_the_codex_reference_is_the_subset_count():
    """The product form above is the subset count it stands for (so the reference is not the code restated)."""
    for n, c, k in [(6, 2, 3), (5, 0, 5), (4, 4, 2)]:
        subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
        product = 1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))
        assert product == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
