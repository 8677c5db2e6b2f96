"""The optimizers: one builder for every optimizer role (the policy, PPO's critic), from `optimizer:`.

`optimizer.name: adamw` is torch's AdamW; `adamw8bit`, `stochastic_rounding` and `cpu_offload` select
torchao's (the `lean` extra, imported only when asked for): `AdamW8bit` keeps both moments in 8 bits
with block-wise scales, `_AdamW(bf16_stochastic_round=True)` (or `AdamW8bit` with it) computes the AdamW
step in float32 and rounds it into the bfloat16 weights stochastically, and `CPUOffloadOptimizer` keeps
the chosen optimizer's states and step on the CPU. Unless offloaded, the first two step through
`ops_cuda.adamw_step`: torchao's states and arithmetic, one CUDA launch for many parameters. Every variant
gets the same parameter groups (no weight decay on 1-D parameters), betas, eps, lr and weight decay.

The trained weights (`trained_dtype`) decide what may step them: bfloat16 ones only with stochastic rounding, float16
ones only with torch's AdamW (`adamw8bit` keeps no master copy), which `optimizer_problems` checks before the run.
torch's AdamW steps float16 weights through `Float32StateAdamW`, fused or not: float32 moments and a float32 master
copy of each weight (in float16, eps is 0, the second moment is 0 for gradients below about 5e-3, and nearest
rounding drops updates below half a float16 step, as it does bfloat16's).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.adamw import adamw

from framework.config import uses_cuda
from framework.config import world_size as job_processes
from framework.errors import FwError
from framework.precision import CONVERTS_TO, trained_dtype

LEAN_INSTALL = "pip install 'fw[lean]'"


def _lean_keys(o: dict) -> list[str]:
    """The `optimizer:` settings that need torchao, as `key: value`."""
    return [key for key, on in (("optimizer.name: adamw8bit", o["name"] == "adamw8bit"),
                                ("optimizer.stochastic_rounding: true", o["stochastic_rounding"]),
                                ("optimizer.cpu_offload: true", o["cpu_offload"])) if on]


def _uses_torchao_step(o: dict) -> bool:
    return o["name"] == "adamw8bit" or o["stochastic_rounding"]


def _trained_by(cfg: dict) -> str:
    """The setting that makes the trained weights 16-bit, for a message."""
    precision = cfg["trainer"]["precision"]
    return f"trainer.precision: {precision}" if precision in CONVERTS_TO else \
        f"model.policy.dtype: {cfg['model']['policy']['dtype']}"


@contextlib.contextmanager
def float32_default_dtype() -> Iterator[None]:
    """torch's default dtype set to float32 for the block: the optimizer states a step creates take it (torchao's
    step counters and 8-bit block scales), and bf16-true precision's forward context, in which manual optimization
    steps, sets it to bfloat16. A bfloat16 step counter stops counting at 256."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(default)


def optimizer_problems(cfg: dict, world_size: int | None = None) -> list[str]:
    """What keeps the `optimizer:` settings of a resolved config from running, one `key: message` line
    each (empty: they run). `world_size`, when known, replaces the process count read from `trainer:`."""
    o, t = cfg["optimizer"], cfg["trainer"]
    problems = []
    lean = _lean_keys(o)
    if lean and importlib.util.find_spec("torchao") is None:
        problems.append(f"{lean[0]} needs torchao: {LEAN_INSTALL}")
    dtype = trained_dtype(cfg)
    if o["stochastic_rounding"] and dtype != "bfloat16":
        if cfg["model"]["policy"]["lora"] is not None:
            problems.append(f"optimizer.stochastic_rounding: true rounds bfloat16 weights, but the trained weights "
                            f"(LoRA's adapters, and under PPO the critic) are {dtype} here; set trainer.precision: "
                            "bf16-true (it converts them to bfloat16) or stochastic_rounding: false")
        else:
            problems.append(f"optimizer.stochastic_rounding: true rounds bfloat16 weights, but they are {dtype} "
                            "here; set model.policy.dtype: bfloat16 or trainer.precision: bf16-true")
    if dtype == "bfloat16" and not o["stochastic_rounding"]:
        # Adam moves a weight by about lr a step; nearest rounding drops any change below half a bfloat16 step
        # (2^-9 to 2^-8 of the weight), which at the usual learning rates is most of them. Stochastic rounding moves
        # the weights by the update on average.
        if cfg["trainer"]["precision"] not in CONVERTS_TO:
            fp32 = "model.policy.dtype: null (float32 weights; trainer.precision: bf16-mixed computes in bfloat16)"
        elif cfg["model"]["policy"]["lora"] is not None:
            fp32 = "trainer.precision: bf16-mixed (float32 adapters and critic, bfloat16 compute)"
        else:
            fp32 = "trainer.precision: bf16-mixed with model.policy.dtype: null (float32 weights, bfloat16 compute)"
        problems.append(f"{_trained_by(cfg)} makes the trained weights bfloat16, and AdamW without a float32 master "
                        "copy rounds most of their updates away; set optimizer.stochastic_rounding: true (torchao), "
                        f"or {fp32}")
    if dtype == "float16" and o["name"] == "adamw8bit":
        # Float32StateAdamW's float32 master copy is torch's AdamW's; torchao's 8-bit step updates the float16
        # weight itself, where nearest rounding drops every change below half a float16 step (2^-11 of the weight)
        problems.append(f"optimizer.name: adamw8bit keeps no float32 master copy, and {_trained_by(cfg)} makes the "
                        "trained weights float16, whose rounding drops most AdamW updates; use optimizer.name: "
                        "adamw (float32 moments and master copy, 12 B a parameter), or trainer.precision: bf16-true "
                        "with optimizer.stochastic_rounding: true")
    if dtype == "float16" and t["precision"] == "16-mixed":
        problems.append(f"{_trained_by(cfg)} makes the trained weights float16, whose gradients trainer.precision: "
                        "16-mixed cannot unscale (its loss scaler refuses float16 gradients); use "
                        "model.policy.dtype: null or trainer.precision: 16-true")
    if o["fused"] is True and _uses_torchao_step(o):
        # name only the settings this config has, so the message never points at a key the user left alone
        why = [k for k, on in (("optimizer.name: adamw8bit", o["name"] == "adamw8bit"),
                               ("optimizer.stochastic_rounding: true", o["stochastic_rounding"])) if on]
        problems.append(f"optimizer.fused: true selects torch AdamW's fused kernel, but {' and '.join(why)} "
                        f"step{'' if len(why) > 1 else 's'} torchao's states with fw's own kernel; use auto or false")
    if o["cpu_offload"]:
        if not uses_cuda(t):
            problems.append("optimizer.cpu_offload: true moves the optimizer states from a CUDA GPU to the CPU, "
                            "but this run has no CUDA GPU (trainer.accelerator: "
                            f"{t['accelerator']}{'' if t['accelerator'] == 'cpu' else ', none visible'})")
        elif (world_size if world_size is not None else job_processes(cfg)) > 1:
            problems.append("optimizer.cpu_offload: true runs in a single process only (the offloaded step reads "
                            "each GPU's own gradients, before they are averaged over processes); set "
                            "trainer.devices: 1 and trainer.num_nodes: 1")
        if t["precision"] == "16-mixed":
            problems.append("optimizer.cpu_offload: true cannot be combined with trainer.precision: 16-mixed (the "
                            "loss scaler would unscale the host copies of the gradients); use bf16-mixed or bf16-true")
    return problems


def allow_optimizer_states(cfg: dict) -> None:
    """Let a weights-only `torch.load` of a checkpoint rebuild the optimizer states of `cfg`'s kind:
    `adamw8bit` holds its moments as torchao's `OptimState8bit` tensors. Call it before the load."""
    if cfg["optimizer"]["name"] == "adamw8bit" and importlib.util.find_spec("torchao") is not None:
        _torchao_optim()
        from torchao.optim.subclass_8bit import OptimState8bit

        torch.serialization.add_safe_globals([OptimState8bit])


def param_groups(model: torch.nn.Module, settings: dict) -> list[dict]:
    """The parameter groups of one role: matrices decayed by the role's `weight_decay`, norms' gains
    (and any bias) not; empty groups left out."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": settings["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def hyperparameters(settings: dict, cfg: dict) -> dict[str, Any]:
    """What every group of a role's optimizer takes from the config: lr (the role's), betas and eps."""
    o = cfg["optimizer"]
    return {"lr": settings["lr"], "betas": tuple(o["betas"]), "eps": o["eps"]}


def build_optimizer(model: torch.nn.Module, settings: dict, cfg: dict) -> torch.optim.Optimizer:
    """The optimizer of one role over `model`'s trainable parameters: `lr` and `weight_decay` from
    `settings` (the role's config section), the kind, betas and eps from `optimizer:`."""
    o = cfg["optimizer"]
    groups = param_groups(model, settings)
    params = [p for g in groups for p in g["params"]]
    kwargs: dict[str, Any] = hyperparameters(settings, cfg)
    if _uses_torchao_step(o):
        optim = _torchao_optim()
        cls = optim.AdamW8bit if o["name"] == "adamw8bit" else optim._AdamW
        kwargs["bf16_stochastic_round"] = o["stochastic_rounding"]
        if not o["cpu_offload"]:   # the offloaded step runs on the CPU through torchao's own compiled step
            cls = _fused_class(cls)
    else:
        # the offloaded optimizer steps host copies of the parameters in their dtype, so the class applies there too
        cls = Float32StateAdamW if any(p.dtype == torch.float16 for p in params) else torch.optim.AdamW
        kwargs["fused"] = _fused(o["fused"], params, cfg)
    if o["cpu_offload"]:
        return _offloaded_class()(groups, optimizer_class=cls, **kwargs)
    return cls(groups, **kwargs)


def _fused(fused: bool | str, params: list[torch.Tensor], cfg: dict) -> bool:
    return uses_fused_adamw(cfg, any(p.dtype == torch.float16 for p in params),
                            all(p.device.type == "cuda" for p in params)) if fused == "auto" else bool(fused)


def uses_fused_adamw(cfg: dict, float16: bool, on_cuda: bool) -> bool:
    """Whether torch's AdamW built for `cfg` takes its fused kernel: `optimizer.fused`, or under auto the choice for
    parameters that are (`float16`) float16 and (`on_cuda`) on CUDA. The memory plan counts the step's buffers by
    it."""
    fused = cfg["optimizer"]["fused"]
    if fused != "auto":
        return bool(fused)
    if cfg["optimizer"]["cpu_offload"]:
        return True   # the offloaded step runs on the CPU, where torch has a fused AdamW too
    if float16:
        return True   # the float32 master copies step through the fused kernel, as float16 weights always have
    # Not under 16-mixed: Lightning leaves unscaling to a fused optimizer's step, which comes after fw's
    # clipping and grad-norm metric (they need unscaled gradients).
    return on_cuda and cfg["trainer"]["precision"] != "16-mixed"


def _closure_loss(closure: Any) -> Any:
    """The loss of an optimizer step's `closure` (re-evaluated with gradients on), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Float32StateAdamW(torch.optim.AdamW):
    """torch's AdamW whose float16 parameters keep float32 moments and a float32 master copy in their state.

    In float16 the second moment underflows: its first value, (1 - beta2) g^2, is below half float16's smallest
    value (2^-25) for gradients below about 5e-3 at beta2 0.999, so it stays 0 and the update is m / eps, about
    lr * g / 1e-8. And nearest rounding into float16 drops every update below half a float16 step (2^-11 of the
    weight, 4.9e-4 for the norms' gains of 1), which at the usual learning rates is most of them.

    Each parameter steps alone: a float32 copy of its gradient, torch's AdamW arithmetic (the fused kernel under
    `fused`) on its master copy and moments, then the master rounded into the weight, so the step's only buffer is
    one parameter's gradient in float32. Parameters of other dtypes step in place, with moments
    of their own dtype, as torch's AdamW does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # a loss scaler must unscale the gradients itself: this step reads none of its scale or inf flags
        self._step_supports_amp_scaling = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            if group["amsgrad"] or group["differentiable"]:
                raise FwError("fw's float16 AdamW step has no amsgrad and is not differentiable")
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise FwError("fw's float16 AdamW step takes dense gradients only")
                state = self.state[p]
                master = self._master(p, state, group)
                grad = p.grad if master is p else p.grad.float()
                adamw([master], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]],
                      foreach=False, capturable=group["capturable"], fused=group["fused"], amsgrad=False,
                      beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                      eps=group["eps"], maximize=group["maximize"])
                del grad   # before the next parameter's copy: the step holds one parameter's at a time
                if master is not p:
                    p.copy_(master)
        return loss

    @staticmethod
    def _master(p: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        """The tensor the step updates (a float16 parameter's float32 master copy, else the parameter), with the
        state created on the first step, and a master copy added to a state loaded without one."""
        wide = p.dtype == torch.float16
        if not state:
            on_device = group["fused"] or group["capturable"]   # where torch's AdamW keeps its step counter
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            moments = torch.float32 if wide else p.dtype
            state["exp_avg"] = torch.zeros_like(p, dtype=moments, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=moments, memory_format=torch.preserve_format)
        if not wide:
            return p
        if "master" not in state:
            state["master"] = p.detach().float()
        return state["master"]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, which casts every floating state tensor to its parameter's dtype, with the float32 moments
        and master copies of float16 parameters taken from `state_dict` instead (float16 moments of a state saved
        before fw kept float32 ones are widened)."""
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params, strict=True):
            if p.dtype != torch.float16 or i not in saved:
                continue
            for key in ("exp_avg", "exp_avg_sq", "master"):
                if key in saved[i]:
                    self.state[p][key] = saved[i][key].to(device=p.device, dtype=torch.float32)


@contextlib.contextmanager
def _quiet(*loggers: str) -> Iterator[None]:
    """Raise `loggers` to ERROR for the duration."""
    saved = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


@functools.cache
def _torchao_optim() -> Any:
    """`torchao.optim`, or an FwError naming the setting that needs it.

    The import is quiet: torchao logs a warning for each of its C++ extensions that does not load
    against this torch build (they hold quantization kernels; its optimizers are Python and
    torch.compile), and torch's pytree module logs a deprecation for one of torchao's registrations.
    torch warns once per process that torchao's state tensor subclass has no stable hash for the AOT
    autograd cache; the compiled step then runs uncached, correctly.
    """
    try:
        with _quiet("torchao", "torch.utils._pytree"):
            import torchao.optim
    except ImportError as e:
        raise FwError(f"torchao does not import ({e}); the lean optimizers need it: {LEAN_INSTALL}") from e
    warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching", category=UserWarning)
    return torchao.optim


def _float32_counts(state: dict) -> None:
    """A loaded state made where torch's default dtype was bfloat16 (a checkpoint of an earlier run): its step
    counter and 8-bit block scales in float32, as the kernel takes them."""
    if state["step"].dtype != torch.float32:
        state["step"] = state["step"].float()
    for key in ("exp_avg", "exp_avg_sq"):
        moment = state[key]
        if hasattr(moment, "codes") and moment.scale.dtype != torch.float32:
            moment.scale = moment.scale.float()


@functools.cache
def _fused_class(base: type) -> type:
    """torchao's `base` optimizer (AdamW8bit or _AdamW: their states, state dict and arithmetic) whose step runs
    `ops_cuda.adamw_step` over all parameters of a group at once, instead of torchao's compiled call per parameter
    (one host round trip each: on a 0.6B model, host time longer than the update's own device time)."""
    import ops_cuda

    class FusedStep(base):
        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            loss = _closure_loss(closure)
            for index, group in enumerate(self.param_groups):
                if group.get("amsgrad"):
                    raise FwError("fw's fused AdamW step has no amsgrad")
                # parameters at the same step count go together (a parameter without a gradient skips a step)
                by_step: dict[int, list[torch.Tensor]] = {}
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise FwError("fw's fused AdamW step takes dense gradients only")
                    state = self.state[p]
                    if not state:
                        with float32_default_dtype():
                            state["step"] = torch.tensor(0.0)
                            state["exp_avg"] = self._new_buffer(p, True)
                            state["exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    by_step.setdefault(int(state["step"]), []).append(p)
                for step, params in by_step.items():
                    self._fused_update(group, params, step, index)
            return loss

        def load_state_dict(self, state_dict: dict) -> None:
            super().load_state_dict(state_dict)
            for state in self.state.values():
                if state:
                    _float32_counts(state)

        def _fused_update(self, group: dict, params: list[torch.Tensor], step: int, index: int) -> None:
            moments = [(self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]) for p in params]
            empty = params[0].new_empty(0, dtype=torch.float32)
            # 8-bit moments carry their code maps; every state of a kind holds the same one
            qmaps = next(((m.qmap, v.qmap) for m, v in moments if hasattr(m, "codes")), (empty, empty))

            def parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return (t.codes, t.scale) if hasattr(t, "codes") else (t, empty)

            m_parts = [parts(m) for m, _ in moments]
            v_parts = [parts(v) for _, v in moments]
            # Stochastic rounding's noise: a function of the run's seed, the group and the step, so that a resumed
            # run rounds as the uninterrupted one did.
            seed = (torch.initial_seed() * 1_000_003 + index * 7_919 + step) % 2**63
            ops_cuda.adamw_step(params, [p.grad for p in params], [m for m, _ in m_parts], [s for _, s in m_parts],
                                [v for v, _ in v_parts], [s for _, s in v_parts], *qmaps,
                                lr=float(group["lr"]), betas=group["betas"], weight_decay=group["weight_decay"],
                                eps=group["eps"], step=step,
                                stochastic_round=self.bf16_stochastic_round, seed=seed)

    FusedStep.__name__ = FusedStep.__qualname__ = base.__name__
    return FusedStep


@functools.cache
def _offloaded_class() -> type:
    """torchao's CPUOffloadOptimizer with what Lightning and fw's clipping read from an optimizer."""
    base = _torchao_optim().CPUOffloadOptimizer

    class OffloadedOptimizer(base):
        """CPUOffloadOptimizer whose `param_groups` (the host copies of the large parameters and the
        on-device small ones) hold finished gradients, with the `state` and `defaults` that Lightning
        expects of an optimizer (torchao's class skips `Optimizer.__init__`)."""

        @property
        def param_groups(self) -> list[dict]:
            # Backward hooks copy the gradients to the host on a side stream; clipping and the grad-norm
            # metric read them through param_groups before the step would wait for them.
            self.stream.synchronize()
            return super().param_groups

        @property
        def state(self) -> dict:
            # Lightning moves `optimizer.state` to the GPU after loading a checkpoint: only the on-device
            # optimizer's states belong there, the offloaded ones stay in CPU memory.
            return self.d_opt.state if self.d_opt is not None else {}

        @property
        def defaults(self) -> dict:
            inner = self.d_opt if self.d_opt is not None else next(iter(self.optim_dict.values()))
            return inner.defaults

    return OffloadedOptimizer


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of `grads`, on the first one's device, accumulated and returned in float32 (float64 for
    float64 gradients): in 16-bit gradients' own dtype it would be rounded to three digits, the clip with it, and in
    float16 it overflows at 65504 while every gradient is finite, which zeroes them and reads as a divergence."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g.detach())
    acc = {key: torch.promote_types(key[1], torch.float32) for key in groups}
    dtype = torch.float64 if torch.float64 in acc.values() else torch.float32
    norms = [torch.linalg.vector_norm(torch.stack(torch._foreach_norm(group, 2.0, dtype=acc[key])))
             .to(grads[0].device, dtype) for key, group in groups.items()]
    return torch.linalg.vector_norm(torch.stack(norms))
