"""The RL recipes' flow around the losses (rollout -> rewards -> advantages -> update), checked against values
worked out by hand on tiny inputs."""
import math

import pytest
import torch

from framework.errors import FwError
from framework.rewards import score_rollout
from recipes.advantages import grpo_advantages

RAISE = {"on_error": "raise", "max_error_fraction": 0.5, "timeout_s": None}
ZERO = {"on_error": "zero", "max_error_fraction": 1.0, "timeout_s": None}


@pytest.mark.parametrize("huge", [1e39, -1e39, 10**39])
def test_a_reward_beyond_float32_is_a_failed_sample_not_an_infinite_reward(huge):
    """Rewards train as float32: a finite Python number past its range (about 3.4e38) would reach the advantages as
    an infinity, and the run would stop later on a NaN loss that blames the learning rate. It is a failed sample,
    named as such, under either on_error."""
    def reward(prompt, completion, metadata):
        return huge if completion == "big" else float(len(completion))

    prompts, completions, metadatas = ["p"] * 4, ["big", "a", "bb", "ccc"], [{}] * 4
    with pytest.raises(FwError, match=r"reward failed on 1 of 4 samples; first: sample 0: returned .*float32"):
        score_rollout(reward, prompts, completions, metadatas, RAISE)
    rewards, errors = score_rollout(reward, prompts, completions, metadatas, ZERO)
    assert errors == 1 and rewards.tolist() == [0.0, 1.0, 2.0, 3.0]
    # the group's advantages by hand: mean 1.5, unbiased std sqrt(5/3)
    std = math.sqrt(5 / 3)
    expected = [(r - 1.5) / (std + 1e-4) for r in (0.0, 1.0, 2.0, 3.0)]
    assert grpo_advantages(rewards, 4, "group", 1e-4).tolist() == pytest.approx(expected, rel=1e-6)


def test_the_largest_float32_reward_is_still_a_reward():
    top = float(torch.finfo(torch.float32).max)
    rewards, errors = score_rollout(lambda p, c, m: top, ["p"], ["c"], [{}], RAISE)
    assert errors == 0 and rewards.tolist() == [top]


class HugeForOddCompletions:
    """1e39 (a finite Python float, an infinity in float32) for completions starting with an odd code point."""

    def __call__(self, prompt: str, completion: str, metadata: dict) -> float:
        return 1e39 if completion and ord(completion[0]) % 2 else 0.0


def test_fit_stops_on_a_reward_past_float32_naming_the_reward(tmp_path):
    from test_grpo import config

    from framework.trainer import fit

    cfg = config(tmp_path / "run", reward={"name": None, "class_path": "test_rl_flow_review.HugeForOddCompletions"})
    with pytest.raises(FwError, match=r"reward failed on \d+ of 16 samples; first: sample \d+: returned 1e\+39"):
        fit(cfg)
