"""`FwModule`: the LightningModule holding the policy (and value / reference models) for every recipe.

The recipe owns the loss and the data; this module owns the models, optimizers, LR schedule, gradient
clipping, the fw optimizer-step hooks, metrics aggregation and what goes into checkpoints.

One optimizer-step path for both optimization modes (see framework/callbacks.py for the order):
- automatic: Lightning calls `optimizer_step` once per accumulation window; the precision plugin runs
  the closure, then `on_before_optimizer_step` (clip + fw `before_optimizer_step`), then the step.
- manual: the recipe calls `step_optimizer`, which steps the policy through Lightning's optimizer
  wrapper (so `global_step` counts policy steps) and the critic directly (so it does not).
"""

from __future__ import annotations

import copy
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

from framework.callbacks import fire
from framework.errors import FwError
from framework.metrics import StepMetrics


def build_tokenizer(cfg: dict):
    """`tokenizer.path`, else the policy directory's tokenizer, else the built-in character tokenizer."""
    from framework.tokenizer import Tokenizer

    path = cfg["tokenizer"]["path"] or cfg["model"]["policy"]["path"]
    return Tokenizer.from_pretrained(path) if path else Tokenizer.builtin()


class LRSchedule:
    """LR multiplier after `step` optimizer steps: linear warmup, then constant / linear / cosine decay
    to `min_lr_ratio` at `total_steps`."""

    def __init__(self, name: str, warmup_steps: int, total_steps: int, min_lr_ratio: float):
        if name not in ("constant", "linear", "cosine"):
            raise FwError(f"scheduler.name: unknown schedule {name!r}; expected constant, linear or cosine")
        self.name, self.warmup_steps, self.total_steps, self.min_lr_ratio = (
            name, warmup_steps, total_steps, min_lr_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.name == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        decay = 1.0 - progress if self.name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


def rng_state() -> dict[str, Any]:
    """torch / CUDA / Python / NumPy generator states as tensors and plain values (torch.load-safe).

    CUDA: the state of this process's current device only (`cuda_device`), restored onto the current
    device of whichever process loads it, so it follows the rank and not the device index.
    """
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_device"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda_device" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_device"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def gather_rng_states() -> list[dict[str, Any]] | None:
    """Every rank's `rng_state()` in rank order (a collective) under torch.distributed; None on one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return states


def choose_rng_state(checkpoint: dict[str, Any], rank: int, world_size: int) -> dict[str, Any] | None:
    """The RNG state a rank restores: its own when the checkpoint was saved by as many processes, else
    rank 0's (`fw_rng`) on every rank, as in a fresh run, where every rank is seeded alike."""
    per_rank = checkpoint.get("fw_rng_ranks")
    if per_rank is not None and len(per_rank) == world_size:
        return per_rank[rank]
    return checkpoint.get("fw_rng")


def _tokenizer_files(tokenizer) -> dict[str, bytes]:
    """tokenizer.json + tokenizer_config.json, so a checkpoint's policy/ is a complete HF directory."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


class HfLayout:
    """Where each HF tensor of a model lives in the module's state dict (fused weights split by rows).

    Computed once on the unwrapped model, so checkpoints convert from / to any full state dict (one
    device, DDP, FSDP's gathered one) without reading the live, possibly sharded, parameters.
    """

    def __init__(self, model: torch.nn.Module, prefix: str):
        names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self.pieces: dict[str, tuple[str, int | None, int | None]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for hf, (tensor, lo, hi) in model.hf_targets().items():
            key = prefix + names[id(tensor)]
            self.pieces[hf] = (key, lo, hi)
            self.shapes[key] = tuple(tensor.shape)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-named CPU copies (views of fused weights would share storage, which safetensors refuses)."""
        return {hf: (state_dict[key] if lo is None else state_dict[key][lo:hi]).detach().to("cpu", copy=True)
                for hf, (key, lo, hi) in self.pieces.items()}

    def from_hf(self, hf: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
        """The module's state-dict entries rebuilt from HF-named tensors; every tensor must be there."""
        missing, unexpected = sorted(set(self.pieces) - set(hf)), sorted(set(hf) - set(self.pieces))
        if missing or unexpected:
            raise FwError(f"{source}: missing tensors {missing[:8]}, unexpected tensors {unexpected[:8]}")
        out: dict[str, torch.Tensor] = {}
        for name, (key, lo, hi) in self.pieces.items():
            value = hf[name]
            if key not in out:
                out[key] = torch.empty(self.shapes[key], dtype=value.dtype, device=value.device)
            dest = out[key] if lo is None else out[key][lo:hi]
            if tuple(value.shape) != tuple(dest.shape):
                raise FwError(f"{source}: tensor {name} has shape {tuple(value.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(value)
        return out


class FwModule(lightning.LightningModule):
    """Models + optimizers + the fw step path; `training_step` and the data belong to the recipe."""

    def __init__(self, cfg: dict):
        super().__init__()
        from framework.models import build_policy
        from recipes import RECIPES

        self.cfg = cfg
        self.tokenizer = build_tokenizer(cfg)
        if cfg["recipe"] not in RECIPES:
            raise FwError(f"recipe: unknown recipe {cfg['recipe']!r}; known: {', '.join(sorted(RECIPES))}")
        self.recipe = RECIPES[cfg["recipe"]](cfg, self.tokenizer)
        self.policy = build_policy(cfg["model"]["policy"], self.tokenizer)
        self.value = self._build_value() if self.recipe.needs_value_model() else None
        self.reference = self._build_reference() if self.recipe.needs_reference_model() else None
        self.automatic_optimization = self.recipe.automatic_optimization
        self.policy_version = 0
        self.step_metrics = StepMetrics()
        self.last_metrics: dict[str, float] = {}
        self._roles: dict[int, str] = {}
        self._manual_clip: float | None | bool = False   # False: not inside step_optimizer
        self._pending_rng: dict | None = None
        self._flush_time = time.perf_counter()
        self._tokenizer_files = _tokenizer_files(self.tokenizer)
        self._layouts = {"policy": HfLayout(self.policy, "policy.")}
        if self.value is not None:
            self._layouts["value"] = HfLayout(self.value, "value.")

    # ----------------------------------------------------------------- models
    def _build_value(self):
        from framework.models import Qwen3ValueModel, load_pretrained, load_value_model
        from framework.models.hf_io import VALUE_ARCHITECTURE, read_config, resolve_dtype

        path = self.cfg["model"]["value"]["path"]
        if path is None:
            return Qwen3ValueModel.from_policy(self.policy)
        dtype = resolve_dtype(self.cfg["model"]["policy"]["dtype"])
        if VALUE_ARCHITECTURE in (read_config(path)[1].get("architectures") or []):
            return load_value_model(path, dtype)
        return Qwen3ValueModel.from_policy(load_pretrained(path, dtype))   # warm start from another LM

    def _build_reference(self):
        from framework.models import load_pretrained

        path = self.cfg["model"]["reference"]["path"]
        ref = copy.deepcopy(self.policy) if path is None else load_pretrained(
            path, self.cfg["model"]["policy"]["dtype"])
        ref.requires_grad_(False)
        return ref.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()
        return self

    # ------------------------------------------------------------- optimizers
    def _adamw(self, model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
        o = self.cfg["optimizer"]
        params = [p for p in model.parameters() if p.requires_grad]
        fused = o["fused"]
        if fused == "auto":
            # Not under 16-mixed: Lightning leaves unscaling to a fused optimizer's step, which comes after
            # fw's clipping and grad-norm metric (they need unscaled gradients).
            fused = all(p.device.type == "cuda" for p in params) and self.cfg["trainer"]["precision"] != "16-mixed"
        # Weight decay on matrices only: norms' gains and biases are not decayed.
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(o["betas"]),
                                 eps=o["eps"], fused=bool(fused))

    def configure_optimizers(self):
        o, s = self.cfg["optimizer"], self.cfg["scheduler"]
        policy_opt = self._adamw(self.policy, o["lr"], o["weight_decay"])
        schedule = LRSchedule(s["name"], s["warmup_steps"], self.cfg["trainer"]["max_steps"], s["min_lr_ratio"])
        # Wrapped in a plain function so LambdaLR's checkpoint keeps only the step count: a resumed run
        # follows its own config (e.g. a longer max_steps), not the schedule parameters of the old one.
        scheduler = torch.optim.lr_scheduler.LambdaLR(policy_opt, lambda step: schedule(step))
        optimizers = [policy_opt]
        self._roles = {id(policy_opt): "policy"}
        if self.value is not None:
            c = self.cfg["ppo"]["critic"]
            critic_opt = self._adamw(self.value, c["lr"], c["weight_decay"])
            optimizers.append(critic_opt)
            self._roles[id(critic_opt)] = "critic"
        return optimizers, [{"scheduler": scheduler, "interval": "step", "frequency": 1}]

    def optimizer_role(self, optimizer: Any) -> str:
        """"policy" or "critic" for one of this module's optimizers (raw or Lightning-wrapped)."""
        raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return self._roles[id(raw)]

    def _max_grad_norm(self, role: str) -> float | None:
        if self._manual_clip is not False:
            return self._manual_clip
        return self.cfg["optimizer"]["max_grad_norm"] if role == "policy" else self.cfg["ppo"]["critic"]["max_grad_norm"]

    def _clip(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
        """Clip this optimizer's gradients to `max_norm` (None: measure only); returns the norm before."""
        max_norm = math.inf if max_norm is None else max_norm
        strategy_model = self.trainer.strategy.model
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(strategy_model, FullyShardedDataParallel):
            # Sharded gradients: only FSDP can compute the global norm.
            return strategy_model.clip_grad_norm_(max_norm)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        role = self.optimizer_role(optimizer)
        norm = self._clip(optimizer, self._max_grad_norm(role))
        self.log_metric("grad_norm" if role == "policy" else f"{role}_grad_norm", norm)
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

    def step_optimizer(self, optimizer: Any, max_grad_norm: float | None) -> None:
        """Manual optimization: clip to `max_grad_norm` (None: no clipping), fire `before_optimizer_step`,
        step, fire `after_optimizer_step`, zero the gradients, then step the LR schedule (policy only).

        The policy steps through Lightning's wrapper, so `trainer.global_step` counts policy steps; the
        critic steps directly, so it does not.
        """
        raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        role = self.optimizer_role(raw)
        if role == "policy":
            wrapped = next(o for o in self._lightning_optimizers() if o.optimizer is raw)
            self._manual_clip = max_grad_norm
            try:
                wrapped.step()   # precision plugin -> on_before_optimizer_step -> raw.step()
            finally:
                self._manual_clip = False
        else:
            self._manual_clip = max_grad_norm
            try:
                self._before_step(raw)
            finally:
                self._manual_clip = False
            raw.step()
        if role == "policy":
            self.policy_version += 1
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

        `weight` defaults to 1 / world size: each rank's value is one vote and each call site one vote per
        step in all, so a logging interval that a resume on another number of processes cut in two still
        weighs its steps equally. Weights that count something global (tokens, sequences) need no care.
        """
        if weight is None:
            weight = 1.0 / (self.trainer.world_size if self._trainer is not None else 1)
        self.step_metrics.update(name, value, weight, reduce)

    def logging_this_step(self) -> bool:
        """Whether the optimizer step in progress will be logged (for metrics too costly for every step)."""
        step = self.trainer.global_step + 1
        return step % self.cfg["trainer"]["log_every_n_steps"] == 0 or step >= self.trainer.max_steps

    def flush_metrics(self) -> dict[str, float]:
        """Reduce the interval's metrics (on every rank), add tokens/s, send them to every logger."""
        metrics = self.step_metrics.compute()
        now = time.perf_counter()
        if "tokens" in metrics:
            metrics["tokens_per_s"] = metrics["tokens"] / max(now - self._flush_time, 1e-9)
        self._flush_time = now
        if self.device.type == "cuda":
            metrics["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.last_metrics = metrics
        for logger in self.trainer.loggers:
            logger.log_metrics(metrics, step=self.trainer.global_step)
        return metrics

    # ------------------------------------------------------------ the recipe
    def train_dataloader(self):
        return self.recipe.train_dataloader(self)

    def training_step(self, batch: Any, batch_idx: int):
        return self.recipe.training_step(self, batch, batch_idx)

    def on_train_start(self) -> None:
        self._flush_time = time.perf_counter()

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
            config = model.config.to_hf(dtype_name(next(iter(tensors.values())).dtype))
            if name == "value":
                config["architectures"] = [VALUE_ARCHITECTURE]
            components[name] = {"config": config, "state_dict": tensors}
        if "policy" in components:
            components["policy"]["files"] = dict(self._tokenizer_files)
        for key in [k for k in sd if k.startswith(("policy.", "value.", "reference."))]:
            del sd[key]
        checkpoint["fw_components"] = components
        checkpoint["policy_version"] = self.policy_version
        checkpoint["fw_recipe"] = self.recipe.state_dict()
        checkpoint["fw_rng"] = rng_state()
        checkpoint["fw_rng_ranks"] = gather_rng_states()   # None on one process
        checkpoint["fw_step_metrics"] = self.step_metrics.state()   # reduced over ranks

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Rebuild the weights' state-dict entries from `fw_components` for Lightning to load.

        The reference model is never saved: it is rebuilt from its source, so its current weights stand.
        """
        components = checkpoint.pop("fw_components", None)
        if not components or "policy" not in components:
            raise FwError("checkpoint: no policy weights (fw_components.policy); not an fw checkpoint")
        if self.value is not None and "value" not in components:
            raise FwError("checkpoint: no value/ component, but this recipe trains a value model; "
                          "a PPO run resumes only from a checkpoint that holds its critic")
        sd = checkpoint["state_dict"]
        for name, layout in self._layouts.items():
            sd.update(layout.from_hf(components[name]["state_dict"], f"checkpoint {name}/"))
        if self.reference is not None:
            sd.update({f"reference.{k}": v for k, v in self.reference.state_dict().items()})
        self.policy_version = int(checkpoint["policy_version"])
        # The recipe state (data position) is global, the same on every rank; see the recipes for how a
        # changed number of processes continues.
        self.recipe.load_state_dict(checkpoint["fw_recipe"])
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self._trainer is not None else (0, 1)
        self._pending_rng = choose_rng_state(checkpoint, rank, world)
        self.step_metrics.load_state(checkpoint.get("fw_step_metrics") or {"metrics": {}, "last": {}},
                                     holder=rank == 0)
