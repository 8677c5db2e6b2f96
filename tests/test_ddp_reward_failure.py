"""A reward that fails on one rank of a 2-process GRPO run (CPU, gloo): `fw fit` stops every process at the same
point and exits with 2 and one `fw: error:` line naming the rank, as for one process (no traceback, no rank
left waiting in a collective)."""

import time

import pytest
import torch.distributed as dist
from test_ddp import run_fit


class RankedReward:
    """0.0 for every sample, except that it raises on the ranks `raise_on` and never returns on `hang_on`."""

    def __init__(self, raise_on: list = (), hang_on: list = ()):
        self.raise_on, self.hang_on = list(raise_on), list(hang_on)

    def __call__(self, prompt, completion, metadata):
        rank = dist.get_rank()
        if rank in self.hang_on:
            time.sleep(3600)
        if rank in self.raise_on:
            raise ValueError(f"cannot parse the completion on rank {rank}")
        return 0.0


RAISE_AT = f"{__file__}:{RankedReward.__call__.__code__.co_firstlineno + 5}"   # the line of its raise


def fw_fit_two_ranks(tmp_path, reward_args: dict, **reward) -> tuple[int, str, float]:
    """`python -m framework fit` of a 2-rank GRPO run: (exit code, stderr, seconds)."""
    cfg = {"recipe": "grpo", "seed": 0, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
           "data": {"task": {"name": "digits"}, "chat_template": False},
           "rollout": {"prompts_per_step": 2, "max_new_tokens": 2},
           "reward": {"class_path": "test_ddp_reward_failure.RankedReward", "init_args": reward_args,
                      "on_error": "raise", **reward},
           "grpo": {"group_size": 2},
           "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": 2,
                       "enable_progress_bar": False},
           "logging": {"csv": False, "tensorboard": False}}
    start = time.monotonic()
    proc = run_fit(tmp_path, cfg, timeout=600)
    return proc.returncode, proc.stderr, time.monotonic() - start


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("fw: error:")]


@pytest.mark.slow   # a 2-process Lightning start-up
def test_a_reward_failing_on_one_rank_stops_every_rank_with_one_line(tmp_path):
    code, err, _ = fw_fit_two_ranks(tmp_path, {"raise_on": [1]})
    assert code == 2, err
    (line,) = error_lines(err)
    assert line.startswith("fw: error: global rank 1: reward failed on 4 of 4 samples; first: sample 0: raised "
                           f"ValueError: cannot parse the completion on rank 1 (at {RAISE_AT}); prompt="), err
    assert line.endswith("(set reward.on_error: zero to count and zero such samples)"), err
    assert "Traceback" not in err and "[rank" not in err, err


@pytest.mark.slow   # a 2-process Lightning start-up
def test_a_reward_failing_on_one_rank_and_hanging_on_the_other_is_reported_once(tmp_path):
    # rank 0 waits for rank 1 to give up on its call, then both raise rank 0's failure, which names rank 1 too
    code, err, seconds = fw_fit_two_ranks(tmp_path, {"raise_on": [0], "hang_on": [1]}, timeout_s=2)
    assert code == 2, err
    (line,) = error_lines(err)
    assert line.startswith("fw: error: global rank 0 (global rank 1 too): reward failed on 4 of 4 samples; "
                           "first: sample 0: raised ValueError: cannot parse the completion on rank 0 "
                           f"(at {RAISE_AT}); "), err
    assert "Traceback" not in err and "[rank" not in err, err
    assert seconds < 300
