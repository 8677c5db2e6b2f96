"""Multi-process (DDP) paths: what every rank decides together, checked on real gloo process groups."""

import json
import math
from pathlib import Path

import pytest
from test_ddp import run_fit

from framework.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]

ZERO_HALF = {"on_error": "zero", "max_error_fraction": 0.5, "timeout_s": None}


def _unparsable_unless_ok(prompt, completion, metadata):
    if completion != "ok":
        raise ValueError("unparsable")
    return 1.0


def _score_on(rank: int, store: str, out_dir: str, completions: list) -> None:
    """One of two gloo ranks: `score_rollout` of this rank's `completions[rank]` as a training step scores them
    (collective); what it returned or raised goes to `rank<rank>.json` in `out_dir`."""
    import torch.distributed as dist

    from framework.errors import FwError
    from framework.rewards import score_rollout

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mine = completions[rank]
    try:
        rewards, errors = score_rollout(_unparsable_unless_ok, ["p"] * len(mine), mine, [{}] * len(mine), ZERO_HALF,
                                        collective=True)
        got = {"rewards": rewards.tolist(), "errors": errors}
    except FwError as e:
        got = {"error": str(e)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def _score_two_ranks(tmp_path, completions: list) -> list[dict]:
    from scripts.preloaded import run_ranks

    run_ranks(_score_on, str(tmp_path / "store"), str(tmp_path), completions, timeout=120)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_reward_error_budget_is_of_the_rollout_batch_of_every_rank(tmp_path):
    """3 of rank 0's 4 samples fail and none of rank 1's: 3 of the batch's 8, not more than half, so both ranks go
    on (one process scoring all 8 would), the failed ones zeroed and counted."""
    zero, one = _score_two_ranks(tmp_path, [["ok", "x", "y", "z"], ["ok"] * 4])
    assert zero == {"rewards": [1.0, 0.0, 0.0, 0.0], "errors": 3}
    assert one == {"rewards": [1.0] * 4, "errors": 0}


def test_reward_error_budget_spent_over_the_ranks_stops_every_rank_naming_the_count(tmp_path):
    """2 of rank 0's 4 and 3 of rank 1's 4 fail: 5 of the batch's 8, more than half: every rank raises the first
    failing rank's failure, with the batch's count."""
    zero, one = _score_two_ranks(tmp_path, [["ok", "x", "ok", "y"], ["a", "b", "c", "ok"]])
    assert zero == one
    message = zero["error"]
    assert message.startswith("global rank 0 (global rank 1 too): reward failed on 2 of 4 samples; first: sample 1: "
                              "raised ValueError: unparsable"), message
    assert ("more than reward.max_error_fraction = 0.5 of the rollout batch (5 of its 8 samples on 2 processes) "
            "failed") in message, message


class NanOnRankOne(Callback):
    """Logs `user/ratio` on every rank at every optimizer step: 1.0, NaN on global rank 1."""

    def before_optimizer_step(self, trainer, module, optimizer):
        module.log_metric("user/ratio", math.nan if trainer.global_rank == 1 else 1.0)


NAN_SITE = f"{__file__}:{NanOnRankOne.before_optimizer_step.__code__.co_firstlineno + 1}"


@pytest.mark.slow   # a 2-process Lightning start-up
def test_a_nan_metric_of_one_rank_is_reported_once_naming_no_rank(tmp_path):
    """The NaN check reads flags reduced over the ranks, so every rank raises it at the same flush: global rank 0
    reports it (exit 2), not whichever rank claims the failure first, named as if the NaN were its own."""
    cfg = {"recipe": "sft", "seed": 5, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
           "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 64,
                    "batch_size": 2},
           "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": 2,
                       "log_every_n_steps": 1, "enable_progress_bar": False},
           "callbacks": [{"class_path": "test_ddp_review.NanOnRankOne"}],
           "checkpoint": {"every_n_steps": 100}, "logging": {"csv": False, "tensorboard": False}}
    proc = run_fit(tmp_path, cfg)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    line = (f"fw: error: metric 'user/ratio' is NaN, a value user code logged (module.log_metric at {NAN_SITE}); "
            "log finite values only")
    assert errors == [line], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
