"""The shipped RL jobs learn: train.yaml (GRPO) and recipes/ppo.yaml, run as written but with fewer steps,
take the digits reward from near chance to near perfect."""
from pathlib import Path

import pytest

from framework.config import load_config
from framework.metrics import read_metrics
from framework.trainer import fit

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path, steps", [("train.yaml", 40), ("recipes/ppo.yaml", 55)])
def test_reward_rises(tmp_path, path, steps):
    cfg = load_config([str(ROOT / path)], [f"--run_dir={tmp_path / 'run'}", f"--trainer.max_steps={steps}",
                                           "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
                                           "--logging.csv=false", "--logging.tensorboard=false",
                                           f"--checkpoint.every_n_steps={steps}"])
    fit(cfg)
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(rewards) == steps
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert start < 0.15, rewards    # a random-init model hits the digit ~2% of the time
    assert end > 0.85, rewards
