"""`FwModule`: the LightningModule holding the policy (and value / reference models) for every recipe.

The recipe owns the loss and the data and trains through a `StepContext` (framework/recipe.py), which
`ModuleContext` provides; this module owns the models, optimizers, LR schedule, gradient clipping, the fw
optimizer-step hooks, metrics aggregation and what goes into checkpoints.

One optimizer-step path for both optimization modes (see framework/callbacks.py for the order):
- automatic: Lightning calls `optimizer_step` once per accumulation window; the precision plugin runs
  the closure, then `on_before_optimizer_step` (clip + fw `before_optimizer_step`), then the step.
- manual: the recipe calls `ctx.step(role)`, which steps the policy through Lightning's optimizer
  wrapper (so `global_step` counts policy steps) and any other role directly (so it does not).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import sys
import time
from typing import Any

import lightning
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

from framework.cadence import crossed
from framework.callbacks import check_restorable, fire
from framework.errors import FwError
from framework.metrics import StepMetrics
from framework.models.build import vocabulary_problem
from framework.models.hf_layout import HfLayout
from framework.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdaptersOff,
    adapter_config,
    adapters_detached,
    check_adapter_config,
    has_adapters,
    peft_targets,
)
from framework.optim import build_optimizer, float32_default_dtype, grad_norm, optimizer_problems
from framework.recipe import OptimizerRole, recipe_class
from framework.rng import choose_rng_state, gather_rng_states, rng_state, set_rng_state
from framework.schedule import LRSchedule
from framework.spans import span
from framework.tokenizer import build_tokenizer


class ModuleContext:
    """`framework.recipe.StepContext` over an `FwModule`: all of the module a recipe sees."""

    def __init__(self, module: FwModule):
        self._module = module

    @property
    def policy(self) -> torch.nn.Module:
        return self._module.policy

    @property
    def value(self) -> torch.nn.Module | None:
        return self._module.value

    @property
    def reference(self) -> torch.nn.Module | None:
        return self._module.reference

    @property
    def device(self) -> torch.device:
        return self._module.device

    @property
    def rank(self) -> int:
        return self._module.trainer.global_rank

    @property
    def world_size(self) -> int:
        return self._module.trainer.world_size

    @property
    def policy_version(self) -> int:
        return self._module.policy_version

    def steps_left(self) -> bool:
        max_steps = self._module.trainer.max_steps
        return max_steps is None or max_steps < 0 or self._module.policy_version < max_steps

    def backward(self, loss: torch.Tensor) -> None:
        with span("fw.backward"):
            self._module.manual_backward(loss)

    def step(self, role: str) -> None:
        with span("fw.optimizer_step"):
            self._module.step_optimizer(role)

    def log(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float | None = None,
            reduce: str = "mean") -> None:
        self._module.log_fw_metric(name, value, weight, reduce)

    def logging_this_step(self) -> bool:
        return self._module.logging_this_step()


class FwModule(lightning.LightningModule):
    """Models + optimizers + the fw step path; `training_step` and the data belong to the recipe."""

    def __init__(self, cfg: dict, device: torch.device | str | None = None):
        """`device`: where the models are built (None = the CPU); Lightning moves them to its device after."""
        super().__init__()
        from framework.models import build_policy

        self.cfg = cfg
        self._build_device = device
        recipe_cls = recipe_class(cfg["recipe"])
        self.requirements = recipe_cls.requirements(cfg)
        # each optimizer role's config section, resolved before any model is built
        self._settings = {role.name: self._role_settings(role) for role in self.requirements.optimizers}
        self.tokenizer = build_tokenizer(cfg)
        self.recipe = recipe_cls(cfg, self.tokenizer)
        # A LoRA run's checkpoints hold only the adapters: its base is rebuilt from the seed (presets).
        lora = cfg["model"]["policy"]["lora"]
        self.policy = build_policy(cfg["model"]["policy"], self.tokenizer, seed=cfg["seed"] if lora else None,
                                   device=device)
        self.value = self._build_value() if self.requirements.value_model else None
        self.reference = self._build_reference() if self.requirements.reference_model else None
        self.automatic_optimization = self.requirements.automatic_optimization
        self.context = ModuleContext(self)
        self.policy_version = 0
        self.step_metrics = StepMetrics()
        self.last_metrics: dict[str, float] = {}
        self.last_eval_metrics: dict[str, float] = {}   # the latest evaluation's (framework/evaluation.py)
        self._optimizer_of: dict[str, torch.optim.Optimizer] = {}   # role name -> its torch optimizer
        # role name -> its gradients' norm before the latest clip (on the device), for the non-finite guard
        self.grad_norms: dict[str, torch.Tensor] = {}
        self._pending_rng: dict | None = None
        self._flush_time = time.perf_counter()
        self._resumed_interval_s = 0.0   # the checkpoint's open logging interval, seconds so far (tokens/s)
        self._tokenizer_files = self.tokenizer.files()
        self._layouts = {"policy": HfLayout(self.policy, "policy.", peft_targets(self.policy) if lora else None)}
        if self.value is not None:
            self._layouts["value"] = HfLayout(self.value, "value.")

    # ----------------------------------------------------------------- models
    def _build_value(self):
        from framework.models import Qwen3ValueModel, load_pretrained, load_value_model
        from framework.models.hf_io import VALUE_ARCHITECTURE, read_config, resolve_dtype

        policy_cfg = self.cfg["model"]["policy"]
        # The critic trains every weight. Under LoRA it is float32, as the adapters are (a -true precision converts
        # both), not the frozen base's dtype: AdamW's updates would round away in bfloat16 weights
        # (framework/precision.py trained_dtype).
        dtype = resolve_dtype(None if policy_cfg["lora"] is not None else policy_cfg["dtype"])
        path = self.cfg["model"]["value"]["path"]
        if path is None:
            with adapters_detached(self.policy):   # under LoRA the critic is a full model on the base weights
                value = Qwen3ValueModel.from_policy(self.policy, dtype)
        else:
            config, raw = read_config(path)
            self._check_vocabulary(config, "model.value.path")
            if VALUE_ARCHITECTURE in (raw.get("architectures") or []):
                value = load_value_model(path, dtype, self._build_device)
            else:   # warm start from another LM
                value = Qwen3ValueModel.from_policy(load_pretrained(path, dtype, self._build_device))
        value.gradient_checkpointing = policy_cfg["gradient_checkpointing"]   # what fw plan counts for the critic
        return value

    def _build_reference(self):
        from framework.models import load_pretrained
        from framework.models.hf_io import read_config

        path = self.cfg["model"]["reference"]["path"]
        if path is None and has_adapters(self.policy):
            return AdaptersOff(self.policy)   # the base itself: no second copy of the weights
        if path is not None:
            self._check_vocabulary(read_config(path)[0], "model.reference.path")
        ref = copy.deepcopy(self.policy) if path is None else load_pretrained(
            path, self.cfg["model"]["policy"]["dtype"], self._build_device)
        ref.requires_grad_(False)
        return ref.eval()

    def _check_vocabulary(self, config: Any, key: str) -> None:
        """Refuse a model directory whose vocabulary does not hold every token id of the tokenizer."""
        problem = vocabulary_problem(self.tokenizer.vocab_size, config)
        if problem is not None:
            raise FwError(f"{key}: {problem}")

    def train(self, mode: bool = True):
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()
        return self

    # ------------------------------------------------------------- optimizers
    def _role_settings(self, role: OptimizerRole) -> dict:
        """The role's config section, which holds its lr, weight_decay and max_grad_norm."""
        section = self.cfg
        for key in role.section:
            section = section.get(key) if isinstance(section, dict) else None
        if not isinstance(section, dict) or {"lr", "weight_decay", "max_grad_norm"} - set(section):
            raise FwError(f"recipe {self.cfg['recipe']}: optimizer role '{role.name}' reads lr, weight_decay and "
                          f"max_grad_norm from config section {'.'.join(role.section)}, which this config does "
                          "not hold")
        return section

    def configure_optimizers(self):
        s = self.cfg["scheduler"]
        problems = optimizer_problems(self.cfg, self.trainer.world_size if self._trainer is not None else None)
        if problems:
            raise FwError("\n".join(problems))
        optimizers = []
        for role in self.requirements.optimizers:
            model = self.policy if role.model == "policy" else self.value
            optimizer = build_optimizer(model, self._settings[role.name], self.cfg)
            self._optimizer_of[role.name] = optimizer
            optimizers.append(optimizer)
        schedule = LRSchedule(s["name"], s["warmup_steps"], self.cfg["trainer"]["max_steps"], s["min_lr_ratio"])
        # Wrapped in a plain function so LambdaLR's checkpoint keeps only the step count: a resumed run
        # follows its own config (e.g. a longer max_steps), not the schedule parameters of the old one.
        scheduler = torch.optim.lr_scheduler.LambdaLR(self._optimizer_of["policy"], lambda step: schedule(step))
        return optimizers, [{"scheduler": scheduler, "interval": "step", "frequency": 1}]

    def optimizer_role(self, optimizer: Any) -> str:
        """The role ("policy", "critic", ...) of one of this module's optimizers (raw or Lightning-wrapped)."""
        raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return next(name for name, own in self._optimizer_of.items() if own is raw)

    def _clip(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
        """Clip this optimizer's gradients to `max_norm` (None: measure only); returns the norm before."""
        max_norm = math.inf if max_norm is None else max_norm
        strategy_model = self.trainer.strategy.model
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(strategy_model, FullyShardedDataParallel):
            # Sharded gradients: only FSDP can compute the global norm.
            return strategy_model.clip_grad_norm_(max_norm)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return torch.tensor(0.0)
        norm = grad_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        role = self.optimizer_role(optimizer)
        norm = self._clip(optimizer, self._settings[role]["max_grad_norm"])
        self.grad_norms[role] = norm
        self.log_fw_metric("grad_norm" if role == "policy" else f"{role}_grad_norm", norm)
        fire(self.trainer, self, "before_optimizer_step", optimizer)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Called by Lightning's precision plugin once per real step, after the closure (and after AMP
        # unscaling), in both optimization modes.
        self._before_step(optimizer)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Automatic optimization: Lightning calls this once per accumulation window."""
        optimizer.step(closure=optimizer_closure)
        self.policy_version += 1
        fire(self.trainer, self, "after_optimizer_step", optimizer.optimizer)

    def step_optimizer(self, role: str) -> None:
        """Manual optimization: clip to the role's `max_grad_norm`, fire `before_optimizer_step`, step, fire
        `after_optimizer_step`, zero the gradients, then step the LR schedule (policy only).

        The policy steps through Lightning's wrapper, so `trainer.global_step` counts policy steps; other
        roles step directly, so they do not.
        """
        raw = self._optimizer_of.get(role)
        if raw is None:
            raise FwError(f"step: no optimizer role {role!r}; recipe {self.cfg['recipe']} declares "
                          f"{', '.join(self._optimizer_of)}")
        # this runs inside training_step, under the precision plugin's forward context (see float32_default_dtype)
        with float32_default_dtype():
            if role == "policy":
                wrapped = next(o for o in self._lightning_optimizers() if o.optimizer is raw)
                wrapped.step()   # precision plugin -> on_before_optimizer_step -> raw.step()
                self.policy_version += 1
            else:
                self._before_step(raw)
                raw.step()
        fire(self.trainer, self, "after_optimizer_step", raw)
        raw.zero_grad(set_to_none=True)   # after the hook: it sees the gradients, as in automatic mode
        if role == "policy":
            schedulers = self.lr_schedulers()
            for sched in schedulers if isinstance(schedulers, list) else [schedulers]:
                if sched is not None and sched.optimizer is raw:
                    sched.step()

    def _lightning_optimizers(self) -> list[LightningOptimizer]:
        opts = self.optimizers()
        return opts if isinstance(opts, list) else [opts]

    # ---------------------------------------------------------------- metrics
    def log_metric(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float | None = None,
                   reduce: str = "mean") -> None:
        """Record a value for the current logging interval: `mean` (weighted), `sum`, `max`, `min` are
        reduced over micro-batches, steps and ranks; `last` keeps the latest value as is.

        `weight` (`mean` only) defaults to 1 / world size: each rank's value is one vote and each call site one vote per
        step in all, so a logging interval that a resume on another number of processes cut in two still
        weighs its steps equally. Weights that count something global (tokens, sequences) need no care.

        A name that fw writes itself (`loss`, `lr`, `reward/mean`, `eval/...`, `tokens_per_s`, ...) is refused with a
        ValueError: its value would be merged into fw's. fw's own metrics go through `log_fw_metric`.
        """
        if weight is not None and reduce != "mean":   # sum, max, min and last have no weights to apply
            raise ValueError(f"log_metric({name!r}): a weight applies to reduce='mean' only, not {reduce!r}")
        site = None
        if isinstance(name, str) and name not in self.step_metrics.by_user:   # its first write: where, for a refusal
            caller = sys._getframe(1)
            site = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        self._log(name, value, weight, reduce, user=True, site=site)

    def log_fw_metric(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float | None = None,
                      reduce: str = "mean") -> None:
        """`log_metric` for fw's own metrics (the recipe's `ctx.log`, the built-in callbacks): user code that logs
        one of their names through `log_metric` is refused (ValueError); when it logged the name first, fw's write is
        (FwError, naming the user's call)."""
        self._log(name, value, weight, reduce, user=False)

    def _log(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float | None, reduce: str,
             user: bool, site: str | None = None) -> None:
        if weight is None:
            weight = 1.0 / (self.trainer.world_size if self._trainer is not None else 1)
        self.step_metrics.update(name, value, weight, reduce, user=user, site=site)

    def logging_this_step(self) -> bool:
        """Whether the optimizer step in progress will be logged (for metrics too costly for every step)."""
        step = self.trainer.global_step + 1
        return crossed(step - 1, step, self.cfg["trainer"]["log_every_n_steps"]) or step >= self.trainer.max_steps

    @contextlib.contextmanager
    def off_the_clock(self) -> Any:
        """The time spent inside (an evaluation, a checkpoint's save) does not count toward `tokens_per_s`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._flush_time += time.perf_counter() - start

    @span("fw.metrics.flush")
    def flush_metrics(self) -> dict[str, float]:
        """Reduce the interval's metrics (on every rank), add tokens/s, send them to every logger."""
        metrics = self.step_metrics.compute()
        now = time.perf_counter()
        if "tokens" in metrics:
            metrics["tokens_per_s"] = metrics["tokens"] / max(now - self._flush_time, 1e-9)
        self._flush_time = now
        if self.device.type == "cuda":   # peaks since the run started, what the memory plan estimates
            metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            metrics["memory/reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        self.last_metrics = metrics
        # Lightning callbacks that monitor a metric (ModelCheckpoint, EarlyStopping) read it from here
        self.trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        for logger in self.trainer.loggers:
            logger.log_metrics(metrics, step=self.trainer.global_step)
        return metrics

    # ------------------------------------------------------------ the recipe
    def train_dataloader(self):
        return self.recipe.train_dataloader(self.context)

    def training_step(self, batch: Any, batch_idx: int):
        # named spans (framework.spans: torch.profiler ranges for benchmarks/fit_profile.py and trace_gaps.py, and
        # timed marks under a running SpanClock): the step, and inside it the recipe's phases, the backward and the
        # optimizer step
        with span("fw.training_step"):
            return self.recipe.training_step(self.context, batch, batch_idx)

    def on_train_start(self) -> None:
        # a resumed interval's tokens include the steps before the checkpoint: so does its time
        self._flush_time = time.perf_counter() - self._resumed_interval_s
        self._resumed_interval_s = 0.0
        if self.trainer.ckpt_path is not None:
            # Lightning has restored the checkpoint's lr, betas, ... and LambdaLR's base_lrs: the config's stand
            from framework.checkpoint.resume import reset_optimizers

            reset_optimizers(self)

    def on_train_end(self) -> None:
        release = getattr(self.recipe, "release", None)   # optional: a recipe holding memory between steps
        if callable(release):
            release()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._pending_rng is not None:
            # Restored here, not at load time: Lightning draws random numbers in between (e.g. the
            # DataLoader iterator's seed), which the uninterrupted run drew before the checkpoint.
            set_rng_state(self._pending_rng)
            self._pending_rng = None

    # ------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Weights leave `state_dict` for `fw_components` (HF layout, written as policy/ and value/)."""
        from framework.models.hf_io import VALUE_ARCHITECTURE, dtype_name

        sd = checkpoint["state_dict"]
        components = {}
        for name, layout in self._layouts.items():
            if not any(key in sd for key in layout.shapes):
                continue   # a rank that FSDP gave no full state dict: it writes nothing
            model = self.policy if name == "policy" else self.value
            tensors = layout.to_hf(sd)
            if name == "policy" and has_adapters(model):   # PEFT's adapter directory
                config = adapter_config(model, self.cfg["model"]["policy"]["path"])
                components[name] = {"config": None, "weights_file": ADAPTER_WEIGHTS, "state_dict": tensors,
                                    "files": {ADAPTER_CONFIG: (json.dumps(config, indent=2) + "\n").encode()}}
                continue
            config = model.config.to_hf(dtype_name(next(iter(tensors.values())).dtype))
            if name == "value":
                config["architectures"] = [VALUE_ARCHITECTURE]
            components[name] = {"config": config, "state_dict": tensors}
        if "policy" in components:
            components["policy"]["files"] = {**components["policy"].get("files", {}), **self._tokenizer_files}
        for key in [k for k in sd if k.startswith(("policy.", "value.", "reference."))]:
            del sd[key]
        checkpoint["fw_components"] = components
        checkpoint["policy_version"] = self.policy_version
        recipe_state = self.recipe.state_dict()
        # a plugin recipe's state is the user's: one a resume cannot load stops the save, not every later resume
        recipe = type(self.recipe)
        check_restorable(self.policy_version, f"the state of recipe {self.cfg['recipe']} "
                         f"({recipe.__module__}.{recipe.__qualname__})", recipe_state)
        checkpoint["fw_recipe"] = recipe_state
        checkpoint["fw_rng"] = rng_state()
        checkpoint["fw_rng_ranks"] = gather_rng_states()   # None on one process
        checkpoint["fw_step_metrics"] = self.step_metrics.state()   # reduced over ranks
        checkpoint["fw_interval_s"] = time.perf_counter() - self._flush_time

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Rebuild the weights' state-dict entries from `fw_components` for Lightning to load.

        The reference model is never saved: it is rebuilt from its source, so its current weights stand.
        """
        components = checkpoint.pop("fw_components", None)
        if not components or "policy" not in components:
            raise FwError("checkpoint: no policy weights (fw_components.policy); not an fw checkpoint")
        if self.value is not None and "value" not in components:
            raise FwError(f"checkpoint: no value/ component, but recipe {self.cfg['recipe']} trains a value model; "
                          "it resumes only from a checkpoint that holds its value model")
        sd = checkpoint["state_dict"]
        self._check_policy_kind(components["policy"])
        if has_adapters(self.policy):   # the base, which the checkpoint does not hold, stands as built
            sd.update({f"policy.{k}": v for k, v in self.policy.state_dict().items()})
        for name, layout in self._layouts.items():
            sd.update(layout.from_hf(components[name]["state_dict"], f"checkpoint {name}/"))
        if isinstance(self.reference, torch.nn.Module):
            sd.update({f"reference.{k}": v for k, v in self.reference.state_dict().items()})
        self.policy_version = int(checkpoint["policy_version"])
        # The recipe state (data position) is global, the same on every rank; see the recipes for how a
        # changed number of processes continues.
        self.recipe.load_state_dict(checkpoint["fw_recipe"])
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self._trainer is not None else (0, 1)
        self._pending_rng = choose_rng_state(checkpoint, rank, world)
        self.step_metrics.load_state(checkpoint.get("fw_step_metrics") or {"metrics": {}, "last": {}},
                                     holder=rank == 0)
        self._resumed_interval_s = float(checkpoint.get("fw_interval_s", 0.0))

    def _check_policy_kind(self, component: dict) -> None:
        """A LoRA run resumes from adapters saved with the same settings, a full run from full weights."""
        saved = component.get("files", {}).get(ADAPTER_CONFIG)
        lora = self.cfg["model"]["policy"]["lora"]
        if lora is None and saved is not None:
            raise FwError("checkpoint policy/ holds LoRA adapters but model.policy.lora is null; resume it with the "
                          "lora settings it was trained with (or export it with fw export --merge)")
        if lora is not None and saved is None:
            raise FwError("checkpoint policy/ holds a full model but model.policy.lora is set; a LoRA run resumes "
                          "only from a LoRA checkpoint")
        if lora is not None:
            check_adapter_config(json.loads(saved), lora, f"checkpoint policy/{ADAPTER_CONFIG}")
