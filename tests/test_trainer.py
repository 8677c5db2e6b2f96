"""build_trainer: the `trainer:` section becomes a Lightning Trainer; unsupported settings are refused."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from framework.config import load_config, resolve
from framework.errors import FwError
from framework.trainer import KeepOnDevice, build_trainer, fit


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


def test_float16_autocast_on_the_cpu_is_refused_with_the_key(tmp_path, capsys):
    """Lightning trains a CPU job asked for 16-mixed in bf16-mixed (a warning, not the recorded precision): fw
    refuses it at trainer.precision's line, before anything is written."""
    from framework.cli import main

    with pytest.raises(FwError, match="trainer.precision: 16-mixed .* does not run on the CPU"):
        build_trainer(_cfg(tmp_path, "sft", precision="16-mixed"))
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: sft\nrun_dir: {tmp_path / 'run'}\nmodel:\n  policy:\n    preset: tiny\n"
                      "data:\n  task:\n    name: digits\ntrainer:\n  accelerator: cpu\n  precision: 16-mixed\n")
    assert main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{config}:11:14: trainer.precision: 16-mixed") and err.count("\n") == 1, err
    assert "bf16-mixed" in err
    assert not (tmp_path / "run").exists()


def test_float16_autocast_under_accelerator_auto_is_valid_for_validate_off_the_gpu(tmp_path, capsys):
    """`fw validate` on a machine without a GPU checks a config meant for one: accelerator auto is not the CPU
    there, while `fw fit` on this machine refuses it."""
    from framework.cli import main

    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: sft\nrun_dir: {tmp_path / 'run'}\nmodel:\n  policy:\n    preset: tiny\n"
                      "data:\n  task:\n    name: digits\ntrainer:\n  accelerator: auto\n  precision: 16-mixed\n")
    assert main(["validate", "--config", str(config)]) == 0, capsys.readouterr().err
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        capsys.readouterr()
        assert main(["fit", "--config", str(config)]) == 2
        assert "16-mixed (float16 autocast) does not run on the CPU" in capsys.readouterr().err


def test_fp16_loss_scaling_combinations_that_would_clip_scaled_gradients_are_refused(tmp_path):
    with pytest.raises(FwError, match="optimizer.fused: true cannot be combined with trainer.precision: 16-mixed"):
        build_trainer(resolve({**_cfg(tmp_path, "sft", precision="16-mixed"), "optimizer": {"fused": True}}))
    with pytest.raises(FwError, match="16-mixed is not supported by recipe ppo"):
        build_trainer(_cfg(tmp_path, "ppo", precision="16-mixed"))


def test_keep_on_device_only_for_one_process_jobs(tmp_path):
    """keep_on_device gives a one-process job (CPU, or CUDA with one device) the strategy that leaves its state
    where it trained; several processes and a strategy the config names keep Lightning's; without it nothing
    changes."""
    assert type(build_trainer(_cfg(tmp_path, "sft")).strategy) is SingleDeviceStrategy
    kept = build_trainer(_cfg(tmp_path, "sft"), keep_on_device=True).strategy
    assert isinstance(kept, KeepOnDevice) and kept.root_device == torch.device("cpu")
    assert not isinstance(build_trainer(_cfg(tmp_path, "grpo", strategy="ddp"), keep_on_device=True).strategy,
                          KeepOnDevice)
    two = _cfg(tmp_path, "sft", devices=2)
    assert isinstance(build_trainer(two, keep_on_device=True).strategy, DDPStrategy)


@pytest.mark.parametrize("accelerator, devices, gpus, want", [
    ("cpu", 1, 0, "cpu"), ("cpu", "auto", 2, "cpu"), ("cpu", 2, 0, None),
    ("auto", "auto", 0, None), ("gpu", 1, 0, None),        # without CUDA Lightning may pick Apple's or XLA's
    ("auto", "auto", 1, "cuda:0"), ("gpu", 1, 4, "cuda:0"), ("cuda", [3], 4, "cuda:3"), ("gpu", -1, 1, "cuda:0"),
    ("auto", "auto", 2, None), ("gpu", [0, 1], 2, None), ("gpu", 2, 4, None), ("mps", 1, 0, None)])
def test_one_device_maps_the_trainer_section_as_lightning_does(tmp_path, monkeypatch, accelerator, devices, gpus,
                                                               want):
    """Which device KeepOnDevice gets: the CPU, or the one CUDA device a one-process job runs on; None leaves the
    strategy to Lightning. The GPU count is what this function reads of the machine."""
    from framework.trainer import _one_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    cfg = _cfg(tmp_path, "sft", accelerator=accelerator, devices=devices)
    got = _one_device(cfg)
    assert (str(got) if got is not None else None) == want
    assert _one_device(_cfg(tmp_path, "sft", accelerator=accelerator, devices=devices, strategy="ddp")) is None


def _grpo(run_dir, accelerator):
    return resolve({"recipe": "grpo", "seed": 2, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
                    "data": {"task": {"name": "digits"}}, "reward": {"name": "numeric_match"},
                    "rollout": {"prompts_per_step": 2, "max_new_tokens": 2}, "grpo": {"group_size": 2},
                    "trainer": {"accelerator": accelerator, "devices": 1, "max_steps": 2,
                                "enable_progress_bar": False},
                    "checkpoint": {"every_n_steps": 1000}, "logging": {"csv": False, "tensorboard": False}})


def test_a_fit_that_keeps_its_state_on_the_device_ends_and_saves_as_any_other(tmp_path):
    """A real GRPO fit through KeepOnDevice (`fw fit`'s path) ends and publishes its last checkpoint like any other
    (where the state is afterwards tells the two strategies apart on a GPU only: the test below)."""
    from framework.checkpoint import find_latest

    trainer = fit(_grpo(tmp_path / "run", "cpu"), keep_on_device=True)
    assert isinstance(trainer.strategy, KeepOnDevice)
    assert Path(find_latest(tmp_path / "run")).name == "step-000002"


@pytest.mark.gpu
def test_keep_on_device_leaves_the_state_on_the_gpu_and_lightning_moves_it(tmp_path):
    """On CUDA, Lightning's teardown copies the module and the optimizer states to host memory; KeepOnDevice, which
    `fw fit` runs, leaves both on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    where = {}
    for keep in (False, True):
        trainer = fit(_grpo(tmp_path / f"run-{keep}", "gpu"), keep_on_device=keep)
        states = [t for s in trainer.optimizers[0].state.values() for t in s.values() if torch.is_tensor(t)]
        where[keep] = ({p.device.type for p in trainer.lightning_module.parameters()},
                       {t.device.type for t in states if t.dim()})
    assert where == {False: ({"cpu"}, {"cpu"}), True: ({"cuda"}, {"cuda"})}


# ------------------------------------------------------------------------------------------ config.yaml


class LoggerThatCannotStart(Logger):
    """A logger whose service is out of reach: it fails as the run hands it the config (as W&B's init does)."""

    name, version = "unreachable", "0"

    def log_hyperparams(self, params, *args, **kwargs):
        raise ConnectionError("cannot reach the logging service")

    def log_metrics(self, metrics, step=None):
        pass


class FailsAtTrainStart(Callback):
    """Fails as training starts, after the checkpoint's restore."""

    def on_train_start(self, trainer, module):
        raise RuntimeError("a start-up failure")


def _sft(run_dir, lr, max_steps, **extra):
    return resolve({"recipe": "sft", "seed": 0, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
                    "data": {"path": str(Path("recipes/data/arithmetic_chat.jsonl").resolve()), "max_seq_len": 64,
                             "batch_size": 2},
                    "optimizer": {"lr": lr},
                    "trainer": {"accelerator": "cpu", "max_steps": max_steps, "enable_progress_bar": False},
                    "checkpoint": {"every_n_steps": 1}, "logging": {"tensorboard": False}, **extra})


@pytest.mark.parametrize("failure", [
    {"logging": {"tensorboard": False, "loggers": [{"class_path": "test_trainer.LoggerThatCannotStart"}]}},
    {"callbacks": [{"class_path": "test_trainer.FailsAtTrainStart"}]},
], ids=["logger", "callback"])
def test_a_resume_that_fails_at_start_up_leaves_config_yaml_as_it_was(tmp_path, failure):
    run = tmp_path / "run"
    fit(_sft(run, 1e-3, 1))
    saved = (run / "config.yaml").read_bytes()
    assert load_config([str(run / "config.yaml")])["optimizer"]["lr"] == 1e-3
    with pytest.raises((FwError, RuntimeError), match="logging service|start-up failure"):
        fit(_sft(run, 5e-4, 2, **failure), resume="last")
    assert (run / "config.yaml").read_bytes() == saved   # nothing ran: it still records the first run
    fit(_sft(run, 5e-4, 2), resume="last")   # the resume that runs records its own settings
    assert load_config([str(run / "config.yaml")])["optimizer"]["lr"] == 5e-4


def test_a_resume_that_takes_no_step_still_records_its_config(tmp_path):
    """A run resumed at its trainer.max_steps starts, restores and ends without a step; config.yaml records it."""
    run = tmp_path / "run"
    fit(_sft(run, 1e-3, 1))
    fit(_sft(run, 5e-4, 1), resume="last")
    assert load_config([str(run / "config.yaml")])["optimizer"]["lr"] == 5e-4
