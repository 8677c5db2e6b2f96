"""build_trainer: the `trainer:` section becomes a Lightning Trainer; unsupported settings are refused."""

import pytest
from lightning.pytorch.strategies import DDPStrategy

from framework.config import resolve
from framework.errors import FwError
from framework.trainer import build_trainer


def _cfg(tmp_path, recipe, **trainer):
    return resolve({"recipe": recipe, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
                    "data": {"task": {"name": "digits"}},
                    "trainer": {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False, **trainer}})


def test_ppo_under_ddp_lets_ddp_find_unused_parameters(tmp_path):
    # the policy loss leaves the critic without gradients and vice versa: plain DDP would stop the run
    strategy = build_trainer(_cfg(tmp_path, "ppo", strategy="ddp")).strategy
    assert isinstance(strategy, DDPStrategy) and strategy._ddp_kwargs.get("find_unused_parameters") is True
    grpo = build_trainer(_cfg(tmp_path, "grpo", strategy="ddp")).strategy
    assert isinstance(grpo, DDPStrategy) and not grpo._ddp_kwargs.get("find_unused_parameters")


def test_float64_on_cuda_is_refused_with_the_key(tmp_path):
    with pytest.raises(FwError, match="trainer.precision: 64-true runs on the CPU only"):
        build_trainer(_cfg(tmp_path, "sft", accelerator="gpu", precision="64-true"))


def test_fp16_loss_scaling_combinations_that_would_clip_scaled_gradients_are_refused(tmp_path):
    with pytest.raises(FwError, match="optimizer.fused: true cannot be combined with trainer.precision: 16-mixed"):
        build_trainer(resolve({**_cfg(tmp_path, "sft", precision="16-mixed"), "optimizer": {"fused": True}}))
    with pytest.raises(FwError, match="16-mixed is not supported by recipe ppo"):
        build_trainer(_cfg(tmp_path, "ppo", precision="16-mixed"))
