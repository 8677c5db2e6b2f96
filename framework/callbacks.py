"""fw callbacks: Lightning's `Callback` plus hooks around every real optimizer step, and the built-ins.

Order around each optimizer step (automatic and manual optimization, every optimizer):
gradients final -> clipped -> `before_optimizer_step` -> `optimizer.step()` -> `after_optimizer_step`
-> LR scheduler stepped (policy). Accumulation micro-steps fire nothing. At the end of the batch the
metrics are logged (`MetricsLogger`, every `log_every_n_steps`), then user callbacks' and the
checkpoint callback's `on_train_batch_end` run, in that order.
"""

from __future__ import annotations

from typing import Any

import lightning
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf

from framework.cadence import crossed
from framework.errors import FwError


class Callback(lightning.Callback):
    """A Lightning callback with two more hooks, fired exactly once around every real optimizer step.

    `optimizer` is the torch optimizer being stepped: the policy's, or the critic's in PPO
    (`module.optimizer_role(optimizer)` says which). Count steps with `module.policy_version`: it is
    incremented between the two hooks of a policy step in both modes, whereas Lightning updates
    `trainer.global_step` after the hook under automatic optimization and before it under manual.
    """

    def before_optimizer_step(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                              optimizer: Any) -> None:
        """After gradients are final and clipped, before the parameters change."""

    def after_optimizer_step(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                             optimizer: Any) -> None:
        """After the parameters changed, before the LR scheduler steps (`module.last_metrics` holds the
        previously logged metrics; this step's are logged at the end of the batch)."""


def fire(trainer: lightning.Trainer, module: lightning.LightningModule, hook: str, optimizer: Any) -> None:
    """Call `hook` ("before_optimizer_step" / "after_optimizer_step") on every fw callback of the trainer."""
    for cb in trainer.callbacks:
        if isinstance(cb, Callback):
            getattr(cb, hook)(trainer, module, optimizer)


class ProgressBar(TQDMProgressBar):
    """Counts optimizer steps up to `max_steps` (the data is an endless stream, so batches have no total)."""

    SHOWN = ("loss", "token_accuracy", "reward/mean", "lr", "tokens_per_s")

    def on_train_epoch_start(self, trainer: lightning.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        bar = self.train_progress_bar
        bar.total = convert_inf(trainer.max_steps)
        bar.n = bar.initial = trainer.global_step
        bar.set_description("step")
        bar.refresh()

    def on_train_batch_end(self, trainer: lightning.Trainer, module: lightning.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if bar is not None and bar.n != trainer.global_step:
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, module), refresh=True)

    def get_metrics(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> dict[str, Any]:
        metrics = getattr(module, "last_metrics", {})
        return {k: f"{metrics[k]:.4g}" for k in self.SHOWN if k in metrics}


class LearningRateMonitor(Callback):
    """Logs each optimizer's learning rate as used by the step: `lr` (policy), `critic_lr` (PPO critic).

    Lightning's own monitor logs once per batch at its own step count, which differs from the policy
    step count when a recipe steps several times per batch; this one rides on the optimizer-step hooks.
    """

    def before_optimizer_step(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                              optimizer: Any) -> None:
        name = "lr" if module.optimizer_role(optimizer) == "policy" else f"{module.optimizer_role(optimizer)}_lr"
        module.log_metric(name, optimizer.param_groups[0]["lr"], reduce="last")


class MetricsLogger(lightning.Callback):
    """Sends the module's aggregated metrics to the loggers every `log_every_n_steps` policy steps.

    It runs in `on_train_batch_end` ahead of the checkpoint callback (the trainer puts it first), so a
    checkpoint published at step k always comes after the metrics of step k were handed to the loggers.
    Metrics are logged with `step` = the number of policy optimizer steps done (1 for the first step).
    """

    def __init__(self, log_every_n_steps: int):
        self.every = log_every_n_steps
        self.logged_step = 0

    def on_train_start(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        self.logged_step = self.start_step = trainer.global_step
        self.truncated = False

    def on_train_batch_end(self, trainer: lightning.Trainer, module: lightning.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self.logged_step:
            return
        if crossed(self.logged_step, step, self.every) or step >= trainer.max_steps:
            if not self.truncated:
                # A resumed run writes the steps after its checkpoint again: drop lines a crashed run
                # wrote past it (done at the first flush, once every start-up check has passed).
                for logger in trainer.loggers:
                    if hasattr(logger, "truncate_after"):
                        logger.truncate_after(self.start_step)
                self.truncated = True
            module.flush_metrics()
            self.logged_step = step


def builtin_callbacks(cfg: dict) -> list[lightning.Callback]:
    """Metrics logging, learning-rate monitor and the progress bar (when enabled), in that order;
    the trainer adds user callbacks and checkpointing after these."""
    out: list[lightning.Callback] = [MetricsLogger(cfg["trainer"]["log_every_n_steps"]), LearningRateMonitor()]
    if cfg["trainer"]["enable_progress_bar"]:
        out.append(ProgressBar())
    return out


def user_callbacks(cfg: dict) -> list[lightning.Callback]:
    """`callbacks: [{class_path, init_args}]` instantiated; each must be a Lightning callback."""
    from framework.imports import instantiate

    out = []
    for i, spec in enumerate(cfg["callbacks"]):
        cb = instantiate(spec)
        if not isinstance(cb, lightning.Callback):
            raise FwError(f"callbacks[{i}]: {spec['class_path']} is a {type(cb).__name__}, not a "
                          "lightning.Callback (subclass framework.callbacks.Callback)")
        out.append(cb)
    return out
