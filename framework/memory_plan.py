"""The memory plan: what a job holds on each GPU, counted from its config before anything is built.

`estimate(cfg)` gathers what the count needs without loading any weights (the model's shape from its preset
or config.json, the recipe's `batch_shapes`, the world size, the device's memory) and calls `build_plan`, a
pure function of those. Each row is one kind of memory and the phase of a training step in which it is live:
`held` through the whole step, or one of `rollout` (generation), `score` (no-grad forwards over the whole
rollout batch), `train` (the policy's forward and backward), `backward` (the end of the policy's backward, where a
manual-optimization recipe with one micro-batch a step holds its gradients but no longer its activations), `critic`
(PPO's value update) and `step` (the optimizer step). The total is what is held plus the largest phase.

The activation count follows what each op saves for its backward (ops_cuda/*.py's autograd registrations,
scaled_dot_product_attention, nn.Linear) in framework/models/qwen3.py's layer; `layer_saved_bytes` spells it
out. The constants below are what the count cannot derive from shapes: calibrating the plan on a GPU means
adjusting them.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import pairwise
from types import FrameType
from typing import Any

from framework.config import uses_cuda, world_size
from framework.errors import FwError, what_raised
from framework.imports import is_user_file
from framework.models.qwen3_config import Qwen3Config
from framework.precision import AUTOCAST_TO, CONVERTS_TO, trained_dtype
from framework.recipe import BatchShapes, Requirements
from framework.signals import Interrupted, Stopped

GIB = 2**30

# Outside torch's allocator (not in max_memory_allocated): the CUDA context, the kernels' images (fw's
# extension, cuBLAS, cuDNN) and the NCCL buffers of several processes.
CUDA_CONTEXT_BYTES = 0.75 * GIB
CUDA_CONTEXT_BYTES_DDP = 0.5 * GIB   # added per process when several processes communicate
# Inside it: cuBLAS workspaces and the rounding of small blocks, whatever the model.
ALLOCATOR_WORKSPACE_BYTES = 0.25 * GIB
# torchao's AdamW8bit: per moment an 8-bit code per element and a float32 scale per block of 256.
ADAMW8BIT_BYTES_PER_MOMENT = 1 + 4 / 256
# torchao's AdamW8bit quantizes a moment only of a tensor this large, whose size the block divides.
ADAMW8BIT_MIN_ELEMENTS = 4096
ADAMW8BIT_BLOCK = 256
# ops_cuda.adamw_step's torch reference, the CPU kernel of fw's step for torchao's optimizers: the most bytes it holds
# per element of the tensor it steps (one tensor at a time), from the profiler's memory timeline. Plain moments of
# float32 weights: the weight after decay, both new moments and the update's quotients; other dtypes add float32
# copies of the weight, the gradient and both moments, stochastic rounding (bfloat16) its noise and masks; 8-bit
# moments add quantize's int64 codes and float32 lookups, and the new block scales (2 x 4 / 256).
REFERENCE_STEP_BYTES = {(False, False, False): 24, (False, True, False): 36, (False, True, True): 41,
                        (True, False, False): 61 + 8 / 256, (True, True, False): 65 + 8 / 256,
                        (True, True, True): 65 + 8 / 256}   # (8-bit moments, weights not float32, rounded)
# Gradients of the activations in flight during the backward, in layers' worth of saved activations.
BACKWARD_IN_FLIGHT_LAYERS = 1.0
# The loss's own float32 tensors per loss token (logprobs scattered to [rows, width], ratios, masks, advantages).
LOSS_BYTES_PER_TOKEN = 64
# linear_logprob's CUDA tiles (ops_cuda/csrc/linear_logprob.cu: kTileRows x kTileCols of float32 logits; the
# Hopper kernel's 16-bit tile of kSm90TileRows rows is the same size).
LOGPROB_TILE_ROWS = 4096
LOGPROB_TILE_COLS = 8192
# ops_cuda/linear_logprob.py: columns per offset of the kept logits, and the reference's float32 tile.
SAVED_LOGITS_CHUNK = 256
REFERENCE_LOGITS_TILE_BYTES = 1 << 28
# The most float32 tiles the reference holds at once, in its backward (the loss's first op there, with every
# activation still held): a tile's log-probabilities, probabilities and gradient while the next tile's logits are
# made, and the gradient's product terms; its forward holds fewer.
REFERENCE_LOGITS_TILES = 6
# A suggestion that does not fit on its own must save at least this share of what the job needs beyond its limit
# (8-bit states of LoRA's adapters save a tenth of a GiB of a job tens of GiB over).
USEFUL_SHARE = 0.01
PHASES = ("rollout", "score", "train", "backward", "critic", "step")
ENGINE_CASTS = "rollout weight casts"   # the plan row of a kept rollout engine's compute-dtype weights

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Row:
    """One kind of memory: its bytes on the GPU, the phase in which they are live, and how it was counted."""

    name: str
    bytes: float
    phases: tuple[str, ...]      # ("held",) or some of PHASES
    how: str
    host_bytes: float = 0.0      # kept in CPU memory instead (optimizer.cpu_offload)
    outside_allocator: bool = False


@dataclass(frozen=True)
class Suggestion:
    """Overrides that shrink the plan, and the total they give."""

    overrides: tuple[str, ...]
    total_bytes: float
    fits: bool | None

    @property
    def text(self) -> str:
        return " ".join(self.overrides)


# The keys that set a built-in recipe's sequences and batch: a refusal with no change that fits names them.
SHAPE_KEYS = {"sft": "data.max_seq_len, data.batch_size",
              "grpo": "rollout.max_new_tokens, rollout.prompts_per_step, grpo.group_size",
              "ppo": "rollout.max_new_tokens, rollout.prompts_per_step, ppo.samples_per_prompt"}


@dataclass
class Plan:
    """The rows of one job's memory per GPU, the limit it must fit in, and what to change when it does not."""

    title: str
    rows: list[Row]
    limit_bytes: float | None = None
    limit_source: str = ""
    suggestions: list[Suggestion] = field(default_factory=list)
    together: Suggestion | None = None   # the suggestions applied one after another until the job fits
    keeps_engine: bool | None = None     # rollout.keep_engine resolved (None: the job does not generate)
    warnings: list[str] = field(default_factory=list)   # what fits but may not do what the user meant
    shape_keys: str = ""                 # the keys that set the job's sequences and batch (SHAPE_KEYS)

    def phase_bytes(self, phase: str) -> float:
        return sum(r.bytes for r in self.rows if phase in r.phases)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase_bytes)

    @property
    def total_bytes(self) -> float:
        """Held memory plus the largest phase: the peak of a step on one GPU."""
        return self.phase_bytes("held") + self.phase_bytes(self.peak_phase)

    @property
    def allocated_bytes(self) -> float:
        """The total without what lies outside torch's allocator: compare with torch.cuda.max_memory_allocated."""
        return self.total_bytes - sum(r.bytes for r in self.rows if r.outside_allocator)

    @property
    def host_bytes(self) -> float:
        return sum(r.host_bytes for r in self.rows)

    @property
    def fits(self) -> bool | None:
        """None when no limit is known (CPU without trainer.memory_limit_gib)."""
        return None if self.limit_bytes is None else self.total_bytes <= self.limit_bytes

    @property
    def biggest(self) -> Row:
        return max(self.rows, key=lambda r: r.bytes)

    def table(self) -> str:
        """The plan as aligned text: one row per kind of memory, the total against the limit, suggestions,
        then the warnings."""
        return "\n".join(self._table_lines() + [f"warning: {w}" for w in self.warnings])

    def _table_lines(self) -> list[str]:
        name_w = max(len(r.name) for r in self.rows)
        phase_w = max(len("+".join(r.phases)) for r in self.rows)
        lines = [self.title, f"  {'':<{name_w}}  {'GiB':>7}  {'phase':<{phase_w}}  counted as"]
        for r in self.rows:
            lines.append(f"  {r.name:<{name_w}}  {r.bytes / GIB:7.1f}  {'+'.join(r.phases):<{phase_w}}  {r.how}")
        phases = ", ".join(f"{p} {self.phase_bytes(p) / GIB:.1f}" for p in PHASES if self.phase_bytes(p) > 0)
        lines.append(f"  {'total':<{name_w}}  {self.total_bytes / GIB:7.1f}  {'':<{phase_w}}  held "
                     f"{self.phase_bytes('held') / GIB:.1f} + the largest phase ({phases or 'none'}); "
                     f"{self.allocated_bytes / GIB:.1f} in torch's allocator")
        if self.host_bytes:
            lines.append(f"  {'host memory':<{name_w}}  {self.host_bytes / GIB:7.1f}  {'':<{phase_w}}  "
                         "pinned CPU memory (optimizer.cpu_offload)")
        if self.limit_bytes is None:
            lines.append(f"  {'limit':<{name_w}}  {'-':>7}  {'':<{phase_w}}  {self.limit_source}")
            return lines
        lines.append(f"  {'limit':<{name_w}}  {self.limit_bytes / GIB:7.1f}  {'':<{phase_w}}  {self.limit_source}")
        if self.fits:
            lines.append(f"fits: {(self.limit_bytes - self.total_bytes) / GIB:.1f} GiB to spare")
            return lines
        verdict = "does not fit: {} GiB > {} GiB".format(*_gib_apart(self.total_bytes, self.limit_bytes))
        lines.append(verdict + ("; try one of:" if self.suggestions else ""))
        width = max([len(s.text) for s in self.suggestions] + [0])
        for s in self.suggestions:
            lines.append(f"  {s.text:<{width}}  -> {s.total_bytes / GIB:.1f} GiB{' (fits)' if s.fits else ''}")
        if self.together is not None:
            lines.append(f"{self._together_label()}: {self.together.text}  -> "
                         f"{self.together.total_bytes / GIB:.1f} GiB{' (fits)' if self.together.fits else ''}")
        return lines

    def _together_label(self) -> str:
        """"together", said to keep full fine-tuning when it does and a LoRA suggestion is listed beside it."""
        lora = any("--model.policy.lora" in s.text for s in self.suggestions)
        full = self.together is not None and "--model.policy.lora" not in self.together.text
        return "together, full fine-tuning" if lora and full else "together"

    def refusal(self) -> str:
        """One line: why the job does not fit and what to try first."""
        b = self.biggest
        total, limit = _gib_apart(self.total_bytes, self.limit_bytes)
        line = (f"memory plan: the job needs {total} GiB per process, more than the "
                f"{limit} GiB limit ({self.limit_source}); the biggest row is {b.name} "
                f"({_gib(b.bytes)} GiB)")
        together = self.together
        if not any(s.fits for s in self.suggestions) and not (together is not None and together.fits):
            # a change that does not fit is no advice: say how far the most that fw can change gets
            closest = together or min(self.suggestions, key=lambda s: s.total_bytes, default=None)
            if closest is not None:
                line += (f"; no change fw knows fits, {'all of ' if closest is together else ''}{closest.text} "
                         f"still needs {_gib(closest.total_bytes)} GiB")
            keys = f" ({self.shape_keys})" if self.shape_keys else ""
            return line + (f"; shorten the sequences or shrink the batch{keys}, or give each process more memory; "
                           "`fw plan --config ...` prints the whole plan")
        first = self.suggestions[0] if self.suggestions and self.suggestions[0].fits else together
        line += f"; try {'all of ' if first is together else ''}{first.text} ({_gib(first.total_bytes)} GiB)"
        if together is not None and together is not first and together.fits:
            keeps = ", keeping full fine-tuning," if self._together_label() != "together" else ""
            line += f"; or{keeps} all of {together.text} ({_gib(together.total_bytes)} GiB)"
        return line + "; `fw plan --config ...` prints the whole plan"


# ------------------------------------------------------------------------------------------- counting

def _gib(n: float) -> str:
    """GiB with one decimal; small amounts with two significant digits, so a tiny limit reads as itself."""
    return f"{n / GIB:.1f}" if n >= 0.05 * GIB else f"{n / GIB:.2g}"


def _gib_apart(more: float, less: float) -> tuple[str, str]:
    """`_gib` of a total and the smaller limit it passes, with as many decimals as they need to read apart (a job
    over its limit by less than 0.05 GiB would read "80.0 GiB > 80.0 GiB")."""
    a, b = _gib(more), _gib(less)
    for digits in range(2, 10):
        if a != b:
            break
        a, b = f"{more / GIB:.{digits}f}", f"{less / GIB:.{digits}f}"
    return a, b


def _bytes(dtype: str) -> int:
    return _BYTES[dtype]


def param_dtype(cfg: dict) -> str:
    """The policy's parameter dtype in training: model.policy.dtype (null = float32) unless a *-true
    precision converts the module."""
    return CONVERTS_TO.get(cfg["trainer"]["precision"]) or cfg["model"]["policy"]["dtype"] or "float32"


def compute_dtype(cfg: dict) -> str:
    """The dtype of the matmuls' operands: autocast's under a *-mixed precision, else the parameters'."""
    return AUTOCAST_TO.get(cfg["trainer"]["precision"]) or param_dtype(cfg)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a Qwen3 model by kind."""

    embed: int               # vocab x hidden (also the LM head when tied)
    lm_head: int             # vocab x hidden when untied, else 0
    layer_linear: int        # one layer's qkv, o, gate_up and down projections
    layer_norm: int          # one layer's four norm gains
    layers: int
    final_norm: int

    @property
    def trunk(self) -> int:
        return self.embed + self.layers * (self.layer_linear + self.layer_norm) + self.final_norm

    @property
    def total(self) -> int:
        return self.trunk + self.lm_head

    @property
    def matmul(self) -> int:
        """Weights that enter a matmul (what autocast casts): the projections and the LM head."""
        return self.layers * self.layer_linear + self.embed


def param_counts(m: Qwen3Config) -> ParamCounts:
    d, inter = m.hidden_size, m.intermediate_size
    linear = d * (m.q_size + 2 * m.kv_size) + m.q_size * d + d * 2 * inter + inter * d
    return ParamCounts(embed=m.vocab_size * d, lm_head=0 if m.tie_word_embeddings else m.vocab_size * d,
                       layer_linear=linear, layer_norm=2 * d + 2 * m.head_dim, layers=m.num_hidden_layers,
                       final_norm=d)


def _step_order(m: Qwen3Config, lora: dict | None) -> list[list[int]]:
    """Elements of the trainable tensors by parameter group (framework/optim.py param_groups: the matrices, then the
    norms' gains), each in the model's order (the fused projections count as one); under LoRA the adapters' (A:
    rank x in, B: out x rank, for each target of each layer) in one group, in no particular order."""
    if lora is not None:
        dims = lora_dims(m)
        return [[lora["rank"] * n for target in lora["targets"] for n in dims[target]] * m.num_hidden_layers]
    d, inter, embed = m.hidden_size, m.intermediate_size, m.vocab_size * m.hidden_size
    layer = [d * (m.q_size + 2 * m.kv_size), m.q_size * d, d * 2 * inter, inter * d]
    matrices = [embed] + layer * m.num_hidden_layers + ([] if m.tie_word_embeddings else [embed])
    return [matrices, [d, m.head_dim, m.head_dim, d] * m.num_hidden_layers + [d]]


def lora_dims(m: Qwen3Config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection that can take an adapter."""
    d, inter = m.hidden_size, m.intermediate_size
    return {"q_proj": (d, m.q_size), "k_proj": (d, m.kv_size), "v_proj": (d, m.kv_size), "o_proj": (m.q_size, d),
            "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}


def lora_params(m: Qwen3Config, lora: dict) -> int:
    """Adapter parameters: A [rank, in] and B [out, rank] for each target of each layer."""
    dims = lora_dims(m)
    return m.num_hidden_layers * lora["rank"] * sum(sum(dims[t]) for t in lora["targets"])


# The fused modules that adapters sit on (framework/models/lora.py projections), by the PEFT targets each holds.
_LORA_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                 "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _adapted(lora: dict) -> dict[str, list[str]]:
    """The fused modules with adapters, each with its targets."""
    return {module: [t for t in names if t in lora["targets"]] for module, names in _LORA_MODULES.items()
            if set(names) & set(lora["targets"])}


def layer_saved_bytes(m: Qwen3Config, seq_len: int, packed: bool, residual_bytes: int, compute_bytes: int,
                      backend: str = "cuda", lora: dict | None = None, selective: bool = False,
                      adapter_bytes: int | None = None) -> float:
    """Bytes per token that one decoder layer's forward keeps for the backward (framework/models/qwen3.py).

    residual_bytes: the residual stream's dtype (the parameters'); compute_bytes: the matmuls' (autocast's
    under *-mixed). backend "cuda" (flash attention) or "cpu" (the CPU flash kernel, the varlen reference).
    Packed rows (ops_cuda.varlen_attention) keep the same tensors as plain causal rows, plus the sequence
    bounds that every layer shares (4 bytes a sequence, left out). selective: gradient_checkpointing
    "selective", under which the outputs of the norms, of QK-norm with RoPE and of SwiGLU are recomputed
    (framework/models/recompute.py). Under LoRA the frozen projections keep nothing of their inputs (their weights
    need no gradient): an input is kept where an adapter's A multiplies it, in adapter_bytes (`adapter_bytes`; None:
    compute_bytes). This is a layer whose input needs a gradient: under LoRA every layer but the first
    (`first_layer_unsaved_bytes`).
    """
    d, q, kv, inter = m.hidden_size, m.q_size, m.kv_size, m.intermediate_size
    residual = 2 * d                 # the layer's input (input_layernorm) and its mid-point (post_attention_layernorm)
    compute = (q + 2 * kv            # qkv_proj's output (QK-norm's backward reads it)
               + q                   # attention's output, o_proj's input
               + 2 * inter)          # gate_up_proj's output (swiglu)
    if not selective:
        compute += q + 2 * kv        # q and k after QK-norm and RoPE, and v's copy (attention)
        if lora is None:
            compute += (d            # qkv_proj's input, the normed hidden state
                        + d          # gate_up_proj's input, the normed mid-point
                        + inter)     # swiglu's output, down_proj's input
    lse = 4 * m.num_attention_heads  # attention's float32 logsumexp per head
    adapters = 0.0 if lora is None else _adapter_saved_bytes(m, lora, residual_bytes, compute_bytes, backend,
                                                             selective, adapter_bytes or compute_bytes)
    return residual * residual_bytes + compute * compute_bytes + lse + adapters


def _adapter_saved_bytes(m: Qwen3Config, lora: dict, residual_bytes: int, compute_bytes: int, backend: str,
                         selective: bool, adapter_bytes: int) -> float:
    """Bytes per token that one layer's adapters keep (framework/models/lora.py LoraLinear.delta), in the dtype they
    multiply in (adapter_bytes: autocast's, else the adapters' own, into which delta casts a module's input): each B
    keeps A's output; A keeps its module's input, or under dropout each adapter's dropped input, and the dropout its
    mask. The attention keeps its output, o_proj's input, itself: A keeps a second copy in another dtype. Under
    selective recomputation SwiGLU's output, down_proj's input, is recomputed (a copy in another dtype is not), while
    a norm's output feeding adapters is kept (framework/models/qwen3.py _normed)."""
    dims = lora_dims(m)
    saved = 0.0
    cast = adapter_bytes != compute_bytes
    for module, targets in _adapted(lora).items():
        width = dims[targets[0]][0]
        saved += len(targets) * lora["rank"] * adapter_bytes
        if lora["dropout"] > 0:
            mask = _mask_bytes(module, residual_bytes, compute_bytes, backend)
            saved += len(targets) * width * (adapter_bytes + mask)
        elif cast or (module != "o_proj" and not (module == "down_proj" and selective)):
            saved += width * adapter_bytes
    return saved


def _mask_bytes(module: str, residual_bytes: int, compute_bytes: int, backend: str) -> int:
    """Bytes per element of a dropout's mask on `module`'s input: CUDA's fused dropout keeps a bool mask, the CPU's
    the scaled noise it multiplies by, in the input's dtype (the norms' outputs keep the residual stream's)."""
    if backend == "cuda":
        return 1
    return residual_bytes if module in ("qkv_proj", "gate_up_proj") else compute_bytes


def first_layer_unsaved_bytes(m: Qwen3Config, residual_bytes: int, compute_bytes: int, lora: dict,
                              selective: bool = False, backend: str = "cuda",
                              adapter_bytes: int | None = None) -> float:
    """Bytes per token that the first layer keeps less than `layer_saved_bytes` under LoRA, where the frozen
    embedding gives its input no gradient: its input, and before the first adapter of the layer the attention's
    tensors (no adapter on q, k or v) and the mid-point with gate_up's output (none on o_proj either), and the
    dropout masks of inputs that need no gradient."""
    d, q, kv = m.hidden_size, m.q_size, m.kv_size
    adapted = _adapted(lora)
    same = (adapter_bytes or compute_bytes) == compute_bytes and lora["dropout"] == 0   # A keeps the input itself
    unsaved = d * residual_bytes
    if "qkv_proj" not in adapted:
        unsaved += (q + 2 * kv) * compute_bytes * (1 if selective else 2) + 4 * m.num_attention_heads
        if "o_proj" not in adapted or not same:   # else A keeps the attention's output in its place
            unsaved += q * compute_bytes
        if "o_proj" not in adapted:
            unsaved += d * residual_bytes
            # gate_up's output, unless an adapter needs it: gate_up's own, or under selective recomputation
            # down_proj's, whose A keeps SwiGLU's output as the recipe that recomputes it from gate_up's output
            keeps = "gate_up_proj" in adapted or (selective and "down_proj" in adapted and same)
            unsaved += 0 if keeps else 2 * m.intermediate_size * compute_bytes
    if lora["dropout"] > 0:
        dims, graded = lora_dims(m), False   # graded: whether the module's input needs a gradient
        for module in _LORA_MODULES:
            if module in adapted and not graded:
                targets = adapted[module]
                unsaved += len(targets) * dims[targets[0]][0] * _mask_bytes(module, residual_bytes, compute_bytes,
                                                                           backend)
            graded |= module in adapted
    return unsaved


def lora_weight_copies_bytes(m: Qwen3Config, lora: dict, adapter_bytes: int, one_layer: bool = False) -> float:
    """Bytes a forward keeps of the A matrices concatenated, in the adapters' compute dtype (adapter_bytes), for one
    matmul in a module with several adapters (none under dropout, where each adapter multiplies on its own), in the
    layers where the module's input needs a gradient; `one_layer`: in a layer whose input does (a recomputed layer
    under gradient checkpointing)."""
    if lora["dropout"] > 0:
        return 0.0
    dims, adapted = lora_dims(m), _adapted(lora)
    per_layer = {module: len(targets) * lora["rank"] * dims[targets[0]][0] * adapter_bytes
                 for module, targets in adapted.items() if len(targets) > 1}
    if one_layer:
        return sum(per_layer.values())
    first = per_layer.get("gate_up_proj", 0) if {"qkv_proj", "o_proj"} & set(adapted) else 0
    return (m.num_hidden_layers - 1) * sum(per_layer.values()) + first


def model_saved_bytes(m: Qwen3Config, residual_bytes: int, trains_embedding: bool = True) -> int:
    """Bytes per token kept outside the layers: the input ids (the embedding's, unless it is frozen), the positions
    (QK-norm with RoPE) and the final norm's input."""
    return 8 * trains_embedding + 8 + m.hidden_size * residual_bytes


def no_grad_peak_bytes(m: Qwen3Config, residual_bytes: int, compute_bytes: int) -> int:
    """Bytes per token live at the widest point of a no-grad forward: the residual, the normed mid-point (and
    its cast), gate_up's output and swiglu's output, while swiglu runs."""
    cast = compute_bytes if compute_bytes != residual_bytes else 0
    return (m.hidden_size * (2 * residual_bytes + cast) + 3 * m.intermediate_size * compute_bytes)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,.0f}"


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


def _quantized(n: int) -> bool:
    """Whether torchao's AdamW8bit keeps a tensor of `n` elements in 8-bit moments (else plain ones)."""
    return n >= ADAMW8BIT_MIN_ELEMENTS and n % ADAMW8BIT_BLOCK == 0


def _optimizer_state_bytes(o: dict, sizes: list[int], dtype: str) -> tuple[float, str]:
    """(bytes of the optimizer's states, how) for trainable tensors of `sizes` elements in `dtype`."""
    params = sum(sizes)
    if o["name"] == "adamw8bit":
        # a tensor too small (or not a whole number of blocks) keeps both moments in its own dtype
        plain = sum(n for n in sizes if not _quantized(n))
        how = f"2 moments x {_count(params - plain)} params x 8 bits + block scales"
        if plain:
            how += f", 2 x {_count(plain)} small-tensor params x {_bytes(dtype)} B ({dtype})"
        return 2 * (params - plain) * ADAMW8BIT_BYTES_PER_MOMENT + 2 * plain * _bytes(dtype), how
    if dtype == "float16" and not o["stochastic_rounding"]:
        # framework/optim.py Float32StateAdamW: float16 moments underflow and nearest rounding drops small updates
        return 3 * 4 * params, f"2 moments + a master copy x {_count(params)} params x 4 B (float32)"
    # torch's and torchao's AdamW keep both moments in the parameters' dtype
    return 2 * _bytes(dtype) * params, f"2 moments x {_count(params)} params x {_bytes(dtype)} B ({dtype})"


def _value_sizes(m: Qwen3Config) -> list[int]:
    """Elements of each tensor of a critic on `m`'s trunk (framework/models/value.py): the trunk and v_head's weight
    and bias."""
    trunk = [n for group in _step_order(replace(m, tie_word_embeddings=True), None) for n in group]
    return trunk + [m.hidden_size, 1]


def _step_buffer_bytes(cfg: dict, backend: str, dtype: str, model: Qwen3Config, params: int) -> tuple[float, str]:
    """(bytes, how) of what the optimizer step allocates on the process's device beside the gradients, for the
    `params` trainable parameters of `model` in `dtype`."""
    from framework.optim import uses_fused_adamw

    o, lora = cfg["optimizer"], cfg["model"]["policy"]["lora"]
    order = _step_order(model, lora)
    sizes = [n for group in order for n in group]
    if o["cpu_offload"]:
        return 0.0, "none on the GPU: the step runs on the host"
    if o["name"] == "adamw8bit" or o["stochastic_rounding"]:
        if backend == "cuda":
            return 0.0, "none: fw's fused kernel updates in place"

        def reference(n: int) -> float:
            quantized = o["name"] == "adamw8bit" and _quantized(n)
            rounded = o["stochastic_rounding"] and dtype == "bfloat16"
            return REFERENCE_STEP_BYTES[quantized, dtype != "float32", rounded] * n

        return max(map(reference, sizes)), "the CPU reference of fw's AdamW kernel, one tensor at a time"
    largest, b = max(sizes), _bytes(dtype)
    fused = uses_fused_adamw(cfg, dtype == "float16", backend == "cuda")
    if dtype == "float16":   # Float32StateAdamW: one parameter at a time from a float32 copy of its gradient
        return largest * 4 * (1 if fused else 3), ("one parameter's gradient in float32" +
                                                   ("" if fused else ", and sqrt(v) and its quotient"))
    if fused:
        return 0.0, "none: torch's fused AdamW updates in place"
    if backend == "cuda":   # torch's foreach AdamW: sqrt(v) of every tensor at once
        return params * b, "AdamW's intermediate sqrt(v) of every parameter (foreach)"
    return _loop_buffer_elements(lora, sizes, order) * b, \
        "sqrt(v) and its quotient of one parameter, beside the previous one's quotient (CPU AdamW's loop)"


def _loop_buffer_elements(lora: dict | None, sizes: list[int], order: list[list[int]]) -> int:
    """The most elements torch's single-tensor AdamW (the CPU's) holds beside the states: sqrt(v) of the tensor it
    steps and its quotient by the bias correction, while its loop variable still holds the previous tensor's
    quotient. `order`: each parameter group's tensor sizes in the order the optimizer steps them. Under LoRA, whose
    adapters step in their ParameterDicts' order, the largest tensor twice and the second largest, a bound."""
    if lora is not None:
        first, second = (sorted(sizes, reverse=True) + [0])[:2]
        return 2 * first + second
    return max(max([2 * group[0]] + [a + 2 * b for a, b in pairwise(group)]) for group in order if group)


def _logits_rows(m: Qwen3Config, n: int, compute: str, keep: bool, backend: str,
                 weight_grad: bool = True) -> tuple[float, str]:
    """Bytes of the loss's linear_logprob for `n` tokens, with the hidden states it keeps, and how."""
    held, transient, how = _logits_parts(m, n, compute, keep, backend, weight_grad)
    return held + transient, how


def _logits_parts(m: Qwen3Config, n: int, compute: str, keep: bool, backend: str,
                  weight_grad: bool = True) -> tuple[float, float, str]:
    """`_logits_rows` in two parts: what the loss's forward leaves held for its backward, what only its forward's or
    its backward's run holds (its logits tiles, the backward's buffers), and how."""
    c, v, d = _bytes(compute), m.vocab_size, m.hidden_size
    kept_inputs = n * (d * c + 8 + 4 + 4 + 16)   # hidden, targets, logsumexp, entropy; the gather's indices
    loss = n * LOSS_BYTES_PER_TOKEN
    if keep:
        saved = n * v * 2 + n * -(-v // SAVED_LOGITS_CHUNK) * 4
        how = f"{n:,} tokens x {v:,} kept float16 logits"
    elif backend == "cuda":
        saved = min(n, LOGPROB_TILE_ROWS) * min(v, LOGPROB_TILE_COLS) * 4
        how = f"{n:,} tokens, logits recomputed in {LOGPROB_TILE_ROWS} x {LOGPROB_TILE_COLS} tiles"
    else:
        rows = max(1, min(n, REFERENCE_LOGITS_TILE_BYTES // (4 * v)))
        saved = REFERENCE_LOGITS_TILES * rows * v * 4
        how = f"{n:,} tokens, logits recomputed in float32 tiles of {rows} rows"
    # the backward: grad_hidden in float32 across vocabulary tiles, and one tile's grad_weight rows (none for a
    # frozen LM head, as under LoRA)
    backward = (n * d * 4 if v > LOGPROB_TILE_COLS else 0) + (min(v, LOGPROB_TILE_COLS) * d * 4 if weight_grad else 0)
    held = kept_inputs + loss + (saved if keep else 0)
    return held, backward + (0 if keep else saved), how + " + hidden states and the backward's buffers"


def accuracy_peak_bytes(m: Qwen3Config, n: int, chunk: int, residual_bytes: int, compute_bytes: int) -> float:
    """The most bytes SFT's token accuracy holds at once over `n` tokens (recipes/sft.py `_accuracy`), a bound: one
    chunk's logits in the matmul's dtype, under autocast (weights in another dtype than the matmul's) the casts of
    the LM head and of the chunk's hidden states, made at each use (a detached weight is not in autocast's cache),
    and its argmax's int64 indices and their comparison's bools."""
    v, d, rows = m.vocab_size, m.hidden_size, min(n, chunk)
    casts = (v * d + rows * d) * compute_bytes if residual_bytes != compute_bytes else 0
    return rows * v * compute_bytes + casts + rows * (8 + 1)


def build_plan(cfg: dict, model: Qwen3Config, requirements: Requirements, shapes: BatchShapes | None, *,
               world_size: int = 1, backend: str = "cuda", limit_bytes: float | None = None,
               limit_source: str = "", reference: Qwen3Config | None = None,
               value: Qwen3Config | None = None, process_bytes: float | None = None,
               accuracy_chunk: int | None = None) -> Plan:
    """The memory plan of `cfg` (a resolved config) on one of `world_size` processes: a pure function.

    model: the policy's shape; reference / value: those of model.reference.path / model.value.path (None =
    the policy's). shapes None: the recipe declares none, so nothing that depends on the batch is counted.
    backend: "cuda" or "cpu" (which attention kernels save what; no CUDA context on CPU). process_bytes: on CPU,
    the process's own memory before the job builds anything (`process_resident_bytes`); None: not counted.
    accuracy_chunk: the tokens per logits chunk of a recipe that computes token accuracy on logged steps (SFT's
    ACCURACY_CHUNK); None: it computes none.
    """
    policy_cfg, o, t = cfg["model"]["policy"], cfg["optimizer"], cfg["trainer"]
    pdt, cdt = param_dtype(cfg), compute_dtype(cfg)
    pb, cb = _bytes(pdt), _bytes(cdt)
    counts = param_counts(model)
    lora = policy_cfg["lora"]
    rows: list[Row] = []
    # adapters are float32 unless a *-true precision converts them with the rest of the module
    adt = CONVERTS_TO.get(t["precision"], "float32")
    trainable = lora_params(model, lora) if lora is not None else counts.total
    tdt = adt if lora is not None else pdt

    rows.append(Row("policy weights", counts.total * pb, ("held",),
                    f"{_count(counts.total)} params x {pb} B ({pdt})"
                    + ("; tied embedding and LM head" if model.tie_word_embeddings else "")))
    if lora is not None:
        rows.append(Row("LoRA adapters", trainable * _bytes(adt), ("held",),
                        f"{_count(trainable)} params (rank {lora['rank']} x {len(lora['targets'])} targets x "
                        f"{model.num_hidden_layers} layers) x {_bytes(adt)} B ({adt})"))
    casts = pdt == "float32" and t["precision"] in AUTOCAST_TO
    if casts:
        # autocast caches the casts of trainable weights for its whole region (the training step); frozen
        # weights (LoRA's base) are cast again at each use, and the backward keeps those casts
        rows.append(Row("autocast weight casts", counts.matmul * cb, ("train",) if lora is not None else ("held",),
                        f"{_count(counts.matmul)} matmul weights x {cb} B ({cdt}) "
                        + ("kept by the backward" if lora is not None else "cached by autocast")))
    grad_bytes = trainable * _bytes(tdt)
    # Manual optimization (framework/module.py step_optimizer) sets the gradients to None after each step: with one
    # micro-batch a step none are live in the forward, and the backward frees each layer's activations as it makes
    # that layer's gradients. Else a micro-batch's forward runs beside the gradients of those before it (or, under
    # automatic optimization, of the previous step, which Lightning sets to None only before the backward).
    one_micro = not requirements.automatic_optimization and t["accumulate_grad_batches"] == 1 and shapes is not None
    rows.append(Row("gradients", grad_bytes, ("backward", "step") if one_micro else ("train", "step"),
                    f"{_count(trainable)} trainable params x {_bytes(tdt)} B ({tdt})"
                    + ("; none in the forward: set to None after each step of one micro-batch" if one_micro else "")))
    states, how = _optimizer_state_bytes(o, [n for group in _step_order(model, lora) for n in group], tdt)
    if o["cpu_offload"]:
        # torchao's CPUOffloadOptimizer: states, a copy of each parameter and of its gradient in pinned memory
        host = states + 2 * trainable * _bytes(tdt)
        rows.append(Row("optimizer states", 0.0, ("held",), f"on the host: {how} + parameter and gradient copies",
                        host_bytes=host))
    else:
        rows.append(Row("optimizer states", states, ("held",),
                        how + ("; no float32 master copy (stochastic rounding)" if o["stochastic_rounding"] else "")))
    buffers, how = _step_buffer_bytes(cfg, backend, tdt, model, trainable)
    if buffers:
        rows.append(Row("optimizer step buffers", buffers, ("step",), how))

    if requirements.reference_model and (lora is None or cfg["model"]["reference"]["path"] is not None):
        ref = param_counts(reference or model)
        rdt = CONVERTS_TO.get(t["precision"]) or policy_cfg["dtype"] or "float32"
        rows.append(Row("reference model", ref.total * _bytes(rdt), ("held",),
                        f"{_count(ref.total)} params x {_bytes(rdt)} B ({rdt}), frozen"))
    value_grads = 0.0
    vdt = trained_dtype(cfg)   # the critic trains every weight: in the dtype of what the optimizers step
    vb = _bytes(vdt)
    if requirements.value_model:
        val = param_counts(value or model)
        vsizes = _value_sizes(value or model)
        vparams = sum(vsizes)
        vstate, vhow = _optimizer_state_bytes(o, vsizes, vdt)
        value_grads = vparams * vb
        on_gpu = 0.0 if o["cpu_offload"] else vstate
        value_casts = val.layers * val.layer_linear * cb if vdt == "float32" and t["precision"] in AUTOCAST_TO else 0
        rows.append(Row("value model", vparams * vb + on_gpu + value_casts, ("held",),
                        f"{_count(vparams)} params x {vb} B ({vdt}) + " + (f"states on the host ({vhow})"
                                                                            if o["cpu_offload"] else vhow)
                        + (" + autocast casts" if value_casts else ""),
                        host_bytes=vstate + 2 * vparams * vb if o["cpu_offload"] else 0.0))

    if world_size > 1 and not t["strategy"].startswith(("fsdp", "deepspeed")):
        rows.append(Row("DDP gradient buckets", grad_bytes + value_grads, ("held",),
                        f"a flat copy of the gradients ({world_size} processes)"))

    if shapes is None:
        rows.append(Row("activations", 0.0, ("train",),
                        f"not counted: recipe {cfg['recipe']} declares no batch_shapes (framework.recipe.Recipe)"))
    else:
        grads = None
        if one_micro:   # the backward's first gradients (the LM head's, and one layer's), and a tied embedding's
            if lora is None:
                head = (counts.embed if model.tie_word_embeddings else counts.lm_head) + counts.final_norm
                grads = _BackwardGrads((head + counts.layer_linear + counts.layer_norm) * _bytes(tdt),
                                       counts.embed * _bytes(tdt) if model.tie_word_embeddings else 0.0)
            else:
                grads = _BackwardGrads(trainable / model.num_hidden_layers * _bytes(tdt), 0.0)
        _batch_rows(rows, cfg, model, shapes, backend, pb, cb, value_grads, value or model, grads, vb, accuracy_chunk)
        if casts and lora is None and shapes.rollout_rows:
            # framework/rollout/engine.py: under autocast the engine multiplies by its own copies of the weights,
            # which a kept engine holds through the update (its decode graphs read them at the next rollout); in the
            # rollout itself they stand in for the autocast casts above
            rows.append(Row(ENGINE_CASTS, counts.matmul * cb, ("train", "backward", "step") if one_micro else
                            ("train", "step"),
                            f"{_count(counts.matmul)} matmul weights x {cb} B ({cdt}), the rollout engine's copies"))

    if backend == "cuda":
        context = CUDA_CONTEXT_BYTES + (CUDA_CONTEXT_BYTES_DDP if world_size > 1 else 0)
        rows.append(Row("CUDA context", context, ("held",), "driver context and kernel images, outside torch's "
                        "allocator", outside_allocator=True))
        rows.append(Row("workspaces", ALLOCATOR_WORKSPACE_BYTES, ("held",), "cuBLAS workspaces, allocator rounding"))
    elif process_bytes:
        # on CPU the job's tensors share the limit with the process that makes them
        rows.append(Row("process baseline", process_bytes, ("held",), "this process's resident memory (VmRSS) "
                        "before the job builds anything: Python, torch and the imported libraries, the tokenizer; "
                        "outside torch's allocator", outside_allocator=True))

    source = policy_cfg["preset"] or policy_cfg["path"]
    title = (f"fw plan: recipe {cfg['recipe']}, {source} ({_count(counts.total)} params, "
             f"{model.num_hidden_layers} layers), {t['precision']}, {pdt} weights, "
             f"{world_size} process{'es' if world_size > 1 else ''}; memory per "
             + ("GPU" if backend == "cuda" else "process (CPU)"))
    plan = Plan(title, rows, limit_bytes, limit_source, shape_keys=SHAPE_KEYS.get(cfg["recipe"], ""))
    return _keep_engine(plan, cfg["rollout"]["keep_engine"])


def _keep_engine(plan: Plan, setting: bool | str) -> Plan:
    """rollout.keep_engine applied: a kept engine holds its KV cache (and under autocast its weight casts) through
    every phase. "auto" keeps it when the plan still fits so, or when no limit is known."""
    i = next((i for i, r in enumerate(plan.rows) if r.name == "KV cache"), None)
    if i is None:
        return plan
    row = plan.rows[i]
    text = {True: "true", False: "false"}.get(setting, setting)
    held = replace(row, phases=("held",), how=f"{row.how}; kept between rollouts (rollout.keep_engine {text})")
    kept = replace(plan, rows=plan.rows[:i] + [held] + plan.rows[i + 1:], keeps_engine=True)
    if setting is True or (setting == "auto" and kept.fits is not False):
        return kept
    plan.rows = [r for r in plan.rows if r.name != ENGINE_CASTS]   # a released engine drops its copies too
    i = next(i for i, r in enumerate(plan.rows) if r.name == "KV cache")
    plan.keeps_engine = False
    if setting == "auto":
        plan.rows[i] = replace(row, how=f"{row.how}; handed back after each rollout (rollout.keep_engine auto: "
                                        "held through the update it would not fit)")
    return plan


def _kv_block(cfg: dict, model: Qwen3Config, cb: int) -> tuple[int, int]:
    """(bytes per element, bytes per block) of the rollout's KV pool: autocast's dtype or the model's (`cb`), or
    rollout.kv_cache_dtype's."""
    from framework.rollout.kv_cache import KV_CACHE_DTYPES

    ro = cfg["rollout"]
    stored = KV_CACHE_DTYPES[ro["kv_cache_dtype"]]
    kb = cb if stored is None else stored.itemsize
    return kb, 2 * model.num_hidden_layers * model.kv_size * ro["block_size"] * kb


def kv_pool_blocks(cfg: dict, model: Qwen3Config, backend: str) -> tuple[int, int, str] | None:
    """(blocks, bytes a block, what sets the budget) of the largest KV pool the rollout engine makes, its scratch
    block included, where the config fixes the budget (framework/rollout/kv_cache.py pool_blocks):
    rollout.kv_cache_gib, or off CUDA the engine's fixed budget. None on CUDA without kv_cache_gib, where the budget
    is what the GPU has free when the pool is made: the plan's total bounds that."""
    from framework.rollout.kv_cache import CPU_KV_CACHE_GIB

    gib = cfg["rollout"]["kv_cache_gib"]
    if gib is not None:
        what = f"rollout.kv_cache_gib {gib}"
    elif backend != "cuda":
        gib, what = CPU_KV_CACHE_GIB, f"rollout.kv_cache_gib null: {CPU_KV_CACHE_GIB:g} GiB off CUDA"
    else:
        return None
    block = _kv_block(cfg, model, _bytes(compute_dtype(cfg)))[1]
    # as pool_blocks: a set budget too small for 2 blocks gets 1, the scratch block, and no row fits
    floor = 2 if cfg["rollout"]["kv_cache_gib"] is None else 1
    return max(floor, int(gib * (1 << 30)) // block), block, what


def kv_row_problem(cfg: dict, model: Qwen3Config, backend: str, prompt_len: int, new_tokens: int,
                   limit_key: str) -> str | None:
    """Why the rollout engine would refuse a row of `prompt_len` prompt tokens and `new_tokens` new ones (its
    RowTooLong, framework/rollout/scheduler.py) in the pool that `kv_pool_blocks` says, with the largest value of
    `limit_key` (the setting of `new_tokens`) and the least rollout.kv_cache_gib that hold it; None when it fits or
    the pool's budget is not fixed by the config."""
    from framework.rollout.scheduler import blocks_for

    pool = kv_pool_blocks(cfg, model, backend)
    if pool is None:
        return None
    blocks, block, what = pool
    bs = cfg["rollout"]["block_size"]
    need, holds = blocks_for(prompt_len, new_tokens, bs), blocks - 1
    if need <= holds:
        return None
    gib = math.ceil((need + 1) * block / GIB * 100) / 100
    while int(gib * GIB) // block < need + 1:   # a hundredth whose float lies just below the bytes it names
        gib = round(gib + 0.01, 2)
    most = holds * bs - prompt_len + 1   # every prompt token and every new token but the last is written
    fits = f"{limit_key} {most} at most" if most >= 1 else f"not even the prompt fits, whatever {limit_key}"
    return (f"one row of the longest prompt ({prompt_len:,} tokens) + {new_tokens:,} new tokens needs {need:,} KV "
            f"blocks of {bs} positions, the pool holds {holds:,} ({what}), and the rollout engine would refuse it: "
            f"{fits}, or rollout.kv_cache_gib {gib} or more")


@dataclass(frozen=True)
class _BackwardGrads:
    """Gradients that the backward of one micro-batch a step makes beside the activations it holds: at its start
    (`first`: the LM head's, the final norm's and one layer's), and at its end (`embedding`: a tied embedding's dense
    gradient, made before it adds into the LM head's)."""

    first: float
    embedding: float


def _batch_rows(rows: list[Row], cfg: dict, model: Qwen3Config, shapes: BatchShapes, backend: str, pb: int,
                cb: int, value_grads: float, value: Qwen3Config, grads: _BackwardGrads | None, vb: int,
                accuracy_chunk: int | None = None) -> None:
    """The rows that depend on the recipe's batch: KV cache, no-grad scoring, activations, logits, token accuracy's
    logits (`accuracy_chunk`: see `build_plan`); with `grads` (one micro-batch a step of a manual-optimization
    recipe) the backward's gradients beside its activations. vb: the bytes of the critic's parameters, whose forwards
    run in its dtype (or autocast's)."""
    policy_cfg = cfg["model"]["policy"]
    layers = model.num_hidden_layers
    if shapes.rollout_rows:
        from framework.rollout.scheduler import blocks_for

        # framework/rollout/kv_cache.py: a pool of blocks of block_size positions, in autocast's dtype under
        # *-mixed, else the model's, or float8 (rollout.kv_cache_dtype): what every row of the rollout could use at
        # once (its prompt + its limit, block-rounded, and the scratch block), capped by rollout.kv_cache_gib
        ro = cfg["rollout"]
        bs = ro["block_size"]
        kb, block = _kv_block(cfg, model, cb)
        per_row = blocks_for(shapes.prompt_len, shapes.new_tokens, bs)
        blocks = shapes.rollout_rows * per_row + 1
        how = (f"{blocks} blocks ({shapes.rollout_rows} rows x {per_row} + scratch) x {bs} positions x 2 x {layers} "
               f"layers x {model.num_key_value_heads} kv heads x {model.head_dim} x {kb} B")
        pool = kv_pool_blocks(cfg, model, backend)
        if pool is not None and pool[0] < blocks:
            blocks = pool[0]
            how = f"{pool[2]}: {blocks} block{'s' * (blocks != 1)} of {bs} positions x {block} B"
        rows.append(Row("KV cache", blocks * block, ("rollout",), how))
        prefill = shapes.rollout_rows * shapes.prompt_len * no_grad_peak_bytes(model, pb, cb)
        at_once = min(shapes.rollout_rows, ro["max_num_seqs"])
        # the step's logits (float32: framework/models/qwen3.py's _head_logits, or float64) and sampling's float32
        decode = at_once * model.vocab_size * (max(cb, 4) + 8)
        rows.append(Row("rollout buffers", prefill + decode, ("rollout",),
                        f"prefill of {shapes.rollout_rows} x {shapes.prompt_len} prompt tokens + decode logits"))
    if shapes.scoring_rows:
        tokens = shapes.scoring_rows * shapes.seq_len
        n = shapes.scoring_rows * shapes.new_tokens
        score = tokens * (no_grad_peak_bytes(model, pb, cb) + model.hidden_size * pb) + n * (model.hidden_size * cb + 8)
        score += min(n, LOGPROB_TILE_ROWS) * min(model.vocab_size, LOGPROB_TILE_COLS) * 4
        if value_grads:   # the critic's values of every row, in its own dtype, one forward after the other
            vcb = cb if cfg["trainer"]["precision"] in AUTOCAST_TO else vb
            score = max(score, tokens * (no_grad_peak_bytes(value, vb, vcb) + value.hidden_size * vb + 4))
        rows.append(Row("scoring forward", score, ("score",),
                        f"no-grad forward of {shapes.scoring_rows} rows x {shapes.seq_len} tokens (reference or "
                        "values): its widest point and the hidden states"))

    tokens = shapes.tokens or shapes.rows * shapes.seq_len
    what = (f"{shapes.rows} rows of at most {shapes.seq_len}, each group's prompt once" if shapes.tokens
            else f"{shapes.rows} rows x {shapes.seq_len}")
    ckpt = policy_cfg["gradient_checkpointing"] is True
    selective = policy_cfg["gradient_checkpointing"] == "selective"
    lora = policy_cfg["lora"]
    # the adapters multiply in autocast's dtype, else in their own (float32 unless a -true precision converts them)
    ab = cb if cfg["trainer"]["precision"] in AUTOCAST_TO else _bytes(CONVERTS_TO.get(cfg["trainer"]["precision"],
                                                                                         "float32"))
    per_layer = layer_saved_bytes(model, shapes.seq_len, shapes.packed, pb, cb, backend, lora, selective, ab)
    extra = model_saved_bytes(model, pb, trains_embedding=lora is None)
    # the activations' gradients have the shapes of everything a layer keeps, recomputed or not
    in_flight = BACKWARD_IN_FLIGHT_LAYERS * (layer_saved_bytes(model, shapes.seq_len, shapes.packed, pb, cb, backend,
                                                               lora, adapter_bytes=ab) if selective else per_layer)
    if ckpt:
        per_token = layers * model.hidden_size * pb + per_layer + in_flight + extra
        how = (f"{tokens:,} tokens ({what}) x ({layers} layer inputs x "
               f"{_kib(model.hidden_size * pb)} + one layer's recompute {_kib(per_layer)} + in flight)")
    else:
        first = 0.0 if lora is None else first_layer_unsaved_bytes(model, pb, cb, lora, selective, backend, ab)
        per_token = layers * per_layer - first + in_flight + extra
        how = (f"{tokens:,} tokens ({what}) x ({layers} layers x "
               f"{_kib(per_layer)}{', cheap ops recomputed' if selective else ''}"
               f"{', less in the first' if first else ''} + in flight)")
    copies = 0.0 if lora is None else lora_weight_copies_bytes(model, lora, ab, one_layer=ckpt)
    rows.append(Row("activations", tokens * per_token + copies, ("train",),
                    how + (f" + {_kib(copies)} of LoRA's concatenated A" if copies else "")))
    keep = policy_cfg["keep_logits"]
    keep = (policy_cfg["gradient_checkpointing"] is False if keep is None else keep) and cb == 2
    held, transient, how = _logits_parts(model, shapes.loss_tokens, "bfloat16" if cb == 2 else "float32", keep,
                                         backend, weight_grad=lora is None)
    rows.append(Row("logits buffers", held + transient, ("train",), how))
    if accuracy_chunk:
        # between the loss's forward and the backward, with every activation held: the loss's logits tiles, its
        # backward's buffers and the activations' gradients in flight (under checkpointing, one layer's recompute)
        # are not live then, so only what the accuracy holds beyond them raises the step's peak
        n = shapes.loss_tokens
        peak = accuracy_peak_bytes(model, n, accuracy_chunk, pb, cb)
        later = transient + tokens * (in_flight + (per_layer if ckpt else 0))
        rows.append(Row("accuracy logits", max(0.0, peak - later), ("train",),
                        f"token accuracy on logged steps: {min(n, accuracy_chunk):,} tokens x "
                        f"{model.vocab_size:,} logits x {cb} B"
                        + (" + the LM head's cast" if pb != cb else "")
                        + f", {_gib(peak)} GiB less the loss's logits tiles and the backward's buffers, not live "
                        "then"))
    if grads is not None:
        made = "one layer's adapters' gradients" if lora is not None else "the LM head's and one layer's gradients"
        rows.append(Row("first gradients", grads.first, ("train",),
                        made + ", made while the forward's activations are held"))
        # at the backward's end: the first layer's activations and those in flight, or a tied embedding's gradient
        last = (model.hidden_size * pb if ckpt else 0) + per_layer + in_flight + extra
        end = max(tokens * last, tokens * (extra + model.hidden_size * pb) + grads.embedding)
        rows.append(Row("last activations", end, ("backward",),
                        f"{tokens:,} tokens x the first layer's activations and those in flight"
                        + (", or the embedding's gradient" if grads.embedding else "") + ", beside every gradient"))
    if value_grads:
        vcb = cb if cfg["trainer"]["precision"] in AUTOCAST_TO else vb
        v_layer = layer_saved_bytes(value, shapes.seq_len, shapes.packed, vb, vcb, backend, selective=selective)
        v_full = layer_saved_bytes(value, shapes.seq_len, shapes.packed, vb, vcb, backend)
        v_tokens = (value.num_hidden_layers * (value.hidden_size * vb if ckpt else v_layer)
                    + (v_layer if ckpt else 0) + BACKWARD_IN_FLIGHT_LAYERS * v_full
                    + model_saved_bytes(value, vb))
        update = value_grads + tokens * v_tokens
        how = (f"the value model's gradients + its activations of {tokens:,} tokens (the policy's gradients are freed "
               "by then)")
        if grads is not None:   # as the policy's: the larger of the backward's start and its end
            v = param_counts(value)
            v_first = (v.layer_linear + v.layer_norm + v.final_norm + value.hidden_size + 1) * vb   # and the head's
            v_last = ((value.hidden_size * vb if ckpt else 0) + v_layer + BACKWARD_IN_FLIGHT_LAYERS * v_full
                      + model_saved_bytes(value, vb))
            update = max(tokens * v_tokens + v_first, value_grads + tokens * v_last)
            how = (f"the larger of its activations of {tokens:,} tokens with one layer's gradients, and all its "
                   "gradients with the first layer's activations (the policy's gradients are freed by then)")
        rows.append(Row("critic update", update, ("critic",), how))


# ------------------------------------------------------------------------------------------ gathering

def _backend(cfg: dict, gpu_gib: float | None = None) -> str:
    """The device the plan is for: the trainer's, and with `--gpu-gib` under `trainer.accelerator: auto` a GPU (a
    job planned against a GPU's memory is a GPU job, on a machine without one too)."""
    if gpu_gib is not None and cfg["trainer"]["accelerator"] == "auto":
        return "cuda"
    return "cuda" if uses_cuda(cfg["trainer"]) else "cpu"


def _device_memory(cfg: dict) -> tuple[float, str] | None:
    """(bytes, name) of this process's CUDA device. Not asked under a fork-based strategy, where initialising
    CUDA before Lightning forks would break the children."""
    import torch

    if "fork" in cfg["trainer"]["strategy"] or "notebook" in cfg["trainer"]["strategy"]:
        return None
    devices = cfg["trainer"]["devices"]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    index = devices[local] if isinstance(devices, list) and local < len(devices) else local
    props = torch.cuda.get_device_properties(index)
    return float(props.total_memory), f"{props.name} (GPU {index})"


def _model_configs(cfg: dict, tokenizer: Any, requirements: Requirements,
                   ) -> tuple[Qwen3Config, Qwen3Config | None, Qwen3Config | None]:
    """The shapes of the policy, and of the reference and value models that the recipe builds from their paths (None:
    from the policy, or not at all). A path the recipe does not read is not read here either."""
    from framework.models.build import policy_config
    from framework.models.hf_io import read_config

    model = policy_config(cfg["model"]["policy"], tokenizer)
    if model is None:
        raise FwError("model.policy: set exactly one of path (an HF checkpoint directory) or preset")
    ref_path = cfg["model"]["reference"]["path"] if requirements.reference_model else None
    value_path = cfg["model"]["value"]["path"] if requirements.value_model else None
    return (model, read_config(ref_path)[0] if ref_path else None,
            read_config(value_path)[0] if value_path else None)


def _limit(cfg: dict, backend: str, gpu_gib: float | None) -> tuple[float | None, str]:
    if gpu_gib is not None:
        return gpu_gib * GIB, "--gpu-gib"
    limit = cfg["trainer"]["memory_limit_gib"]
    if limit is not None:
        return limit * GIB, "trainer.memory_limit_gib"
    if backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None, "unknown: no CUDA device on this machine (pass --gpu-gib)"
        found = _device_memory(cfg)
        if found is not None:
            return found
        return None, "unknown: a fork-based strategy (set trainer.memory_limit_gib)"
    found = host_memory()
    if found is None:
        return None, "unknown on CPU: this machine's memory could not be read (set trainer.memory_limit_gib)"
    total, what = found
    per_node = world_size(cfg, backend) // cfg["trainer"]["num_nodes"]
    share = f", over its {per_node} processes" if per_node > 1 else ""
    return total / per_node, f"{what}{share}; trainer.memory_limit_gib sets another"


def host_memory() -> tuple[float, str] | None:
    """The bytes of memory this process's machine has, or its cgroup's limit where that is lower, and what they are;
    None where neither can be read. A CPU job's plan is checked against it: a job past it cannot run, however the
    rest of the machine is used."""
    try:
        total = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
    what = "this machine's memory"
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total, what = float(text), "this container's memory limit"
        break
    return total, what


def process_resident_bytes() -> float | None:
    """This process's resident memory now (/proc/self/status VmRSS), else its peak so far (getrusage); None where
    neither can be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB, bytes on macOS
    return float(peak) * (1 if sys.platform == "darwin" else 1024) or None


def _get(cfg: dict, dotted: str) -> Any:
    node = cfg
    for key in dotted.split("."):
        node = node[key]
    return node


def _set(cfg: dict, dotted: str, value: Any) -> None:
    node = cfg
    *parents, last = dotted.split(".")
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[last] = value


class _Planner:
    """Everything `build_plan` needs that is read once, so that suggestions only recount."""

    def __init__(self, cfg: dict, gpu_gib: float | None):
        from framework.recipe import recipe_class
        from framework.tokenizer import build_tokenizer

        self.recipe = recipe_class(cfg["recipe"])
        self.tokenizer = build_tokenizer(cfg)
        self.model, self.reference, self.value = _model_configs(cfg, self.tokenizer, self.requirements(cfg))
        self.backend = _backend(cfg, gpu_gib)
        self.world = world_size(cfg, self.backend)
        self.limit, self.source = _limit(cfg, self.backend, gpu_gib)
        # read last, with the tokenizer and the libraries the plan needs loaded: what the job starts from on CPU
        self.process = process_resident_bytes() if self.backend == "cpu" else None

    def shapes(self, cfg: dict) -> BatchShapes | None:
        """The recipe's batch shapes of `cfg`, which read the task's prompts (user code: `user_code`)."""
        method = getattr(self.recipe, "batch_shapes", None)
        if not callable(method):
            return None
        with user_code(self.recipe):
            return method(cfg, self.tokenizer)

    def requirements(self, cfg: dict) -> Requirements:
        with user_code(self.recipe):
            return self.recipe.requirements(cfg)

    def plan(self, cfg: dict, shapes: BatchShapes | None) -> Plan:
        return build_plan(cfg, self.model, self.requirements(cfg), shapes, world_size=self.world,
                          backend=self.backend, limit_bytes=self.limit, limit_source=self.source,
                          reference=self.reference, value=self.value, process_bytes=self.process,
                          accuracy_chunk=getattr(self.recipe, "ACCURACY_CHUNK", None))

    def variant(self, cfg: dict, changes: dict[str, Any]) -> dict:
        """`cfg` with dotted `changes` applied (schema-valid values: no second validation)."""
        new = copy.deepcopy(cfg)
        for key, value in changes.items():
            _set(new, key, value)
        return new

    def refuses(self, cfg: dict) -> bool:
        """Whether `fw fit` refuses `cfg` for a setting a suggestion changes: the optimizer's settings with the
        trained weights' dtype (framework/optim.py, on this job's processes) or a precision the recipe does not
        support. A missing torchao is no refusal here: installing it is part of the advice, which fit gives."""
        from framework.optim import LEAN_INSTALL, optimizer_problems

        if any(not problem.endswith(LEAN_INSTALL) for problem in optimizer_problems(cfg, self.world)):
            return True
        return cfg["trainer"]["precision"] in self.requirements(cfg).unsupported_precisions


def _function(frame: FrameType) -> str:
    """The name of the function `frame` runs, with its class (`Task.sample`): Python 3.11's co_qualname, else the
    class of its `self` or `cls`."""
    code = frame.f_code
    if hasattr(code, "co_qualname"):
        return code.co_qualname
    owner = frame.f_locals.get("self", frame.f_locals.get("cls"))
    if owner is None:
        return code.co_name
    return f"{(owner if isinstance(owner, type) else type(owner)).__qualname__}.{code.co_name}"


@contextlib.contextmanager
def user_code(recipe: type) -> Iterator[None]:
    """Around what the plan calls that runs user code (a task's prompts, a plugin recipe's methods): what that code
    raises, sys.exit() too, becomes one line at the key that names it, with the call fw made and the user's line that
    raised (the traceback under --debug), as `fw validate` says it; a KeyboardInterrupt there (Ctrl+C, or the code's
    own) ends the plan as Ctrl+C ends fw, exit code 130, with the same call and line. What raises outside the user's
    code (no line of it in the traceback) is fw's own failure, and passes unchanged."""
    try:
        yield
    except (FwError, Stopped):
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as e:   # user code: said as one line
        users = []   # (file, line, function) of the user's frames, from fw's call inwards
        tb = e.__traceback__
        while tb is not None:
            if is_user_file(tb.tb_frame.f_code.co_filename):
                users.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, _function(tb.tb_frame)))
            tb = tb.tb_next
        if not users:
            raise
        call = users[0][2]   # the user's function that fw called
        at = f" (at {users[-1][0]}:{users[-1][1]})"   # the line that raised, in it or deeper
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"{call}{at}") from e
        key = "recipe" if call.startswith(f"{recipe.__qualname__}.") else "data.task"
        raise FwError(f"{key}: {call} {what_raised(e)}{at}") from e


def _lora_defaults() -> dict:
    """model.policy.lora's defaults, from the schema."""
    import json

    from framework.config import schema_text

    lora = json.loads(schema_text())["properties"]["model"]["properties"]["policy"]["properties"]["lora"]
    return {key: prop["default"] for key, prop in lora["properties"].items()}


_SPLIT_ROWS = "fewer rows per micro-batch"
_FEWER_PROMPTS = "fewer prompts per rollout, as many per optimizer step"


def _kv_cap(cfg: dict, model: Qwen3Config, plan: Plan, shapes: BatchShapes | None) -> dict[str, Any] | None:
    """A smaller rollout.kv_cache_gib (the same tokens in more decode steps) that brings the plan to its limit, where
    the KV pool is held through the step or lives in its largest phase; never one that admits fewer than
    rollout.admit_batch of the longest rows at once. None when no smaller pool helps."""
    kv = next((r for r in plan.rows if r.name == "KV cache"), None)
    if kv is None or shapes is None or plan.limit_bytes is None:
        return None
    if "held" not in kv.phases and plan.peak_phase not in kv.phases:
        return None
    ro = cfg["rollout"]
    block = _kv_block(cfg, model, _bytes(compute_dtype(cfg)))[1]
    from framework.rollout.scheduler import blocks_for

    per_row = blocks_for(shapes.prompt_len, shapes.new_tokens, ro["block_size"])
    least = (min(shapes.rollout_rows, ro["admit_batch"]) * per_row + 1) * block
    want = kv.bytes - (plan.total_bytes - plan.limit_bytes)
    gib = max(math.floor(want / GIB * 100), math.ceil(least / GIB * 100)) / 100
    return {"rollout.kv_cache_gib": gib} if gib * GIB < kv.bytes else None


def _candidates(cfg: dict, plan: Plan, shapes: BatchShapes | None, backend: str, model: Qwen3Config,
                section: str = "") -> list[dict[str, Any]]:
    """Changes that shrink the plan, those that keep the update's maths first. `section`: an RL recipe's config
    section (`grpo`, `ppo`), whose minibatches split the rollout batch into optimizer steps."""
    p, o = cfg["model"]["policy"], cfg["optimizer"]
    prompts = cfg["rollout"]["prompts_per_step"]
    out: list[dict[str, Any]] = []
    if plan.keeps_engine and cfg["rollout"]["keep_engine"] is True:   # its KV cache held through the update
        out.append({"rollout.keep_engine": "auto"})
    if p["gradient_checkpointing"] is False:
        out.append({"model.policy.gradient_checkpointing": "selective"})
    if p["gradient_checkpointing"] is not True:
        out.append({"model.policy.gradient_checkpointing": True})
    keeps = next((r for r in plan.rows if r.name == "logits buffers" and "kept" in r.how), None)
    if keeps is not None:
        out.append({"model.policy.keep_logits": False})
    if shapes is not None and shapes.rows > 1:
        out.append({_SPLIT_ROWS: True})   # which keys split the micro-batch: `_fewer_rows` asks the recipe
    cap = _kv_cap(cfg, model, plan, shapes)
    if cap is not None:
        out.append(cap)
    states = next(r.bytes for r in plan.rows if r.name == "optimizer states")
    if backend == "cuda" and not o["cpu_offload"] and states > 0:
        out.append({"optimizer.cpu_offload": True})
    if o["name"] == "adamw":
        out.append({"optimizer.name": "adamw8bit"})
    if p["lora"] is not None and param_dtype(cfg) == "float32" and cfg["trainer"]["precision"] in AUTOCAST_TO:
        # LoRA's frozen base in bfloat16 under autocast: the adapters (and a critic) stay float32, so no rounding
        out.append({"model.policy.dtype": "bfloat16"})
    if param_dtype(cfg) == "float32" or trained_dtype(cfg) == "float32":
        # every weight in bfloat16, the trained ones too (under LoRA the adapters and a critic): what is already so
        # is left out of the overrides
        lean = {"model.policy.dtype": "bfloat16", "trainer.precision": "bf16-true",
                "optimizer.stochastic_rounding": True}
        out.append({k: v for k, v in lean.items() if _get(cfg, k) != v})
    if shapes is not None and shapes.rollout_rows and _fewer_prompts(cfg, section):
        # the same samples in each optimizer step, from smaller rollouts: which ones, `_fewer_prompts` says
        out.append({_FEWER_PROMPTS: True})
    if p["lora"] is None:
        out.append({"model.policy.lora": _lora_defaults()})
    if shapes is not None and shapes.rollout_rows and plan.peak_phase == "rollout" and prompts > 1:
        out.append({"rollout.prompts_per_step": prompts // 2})
    return out


def _overrides(changes: dict[str, Any]) -> tuple[str, ...]:
    def text(v: Any) -> str:
        return "true" if v is True else "false" if v is False else str(v)

    out = []
    for key, value in changes.items():
        if key == "model.policy.lora":   # a new adapter section: its rank is the override, the rest defaults
            out.append(f"--model.policy.lora.rank={value['rank']}")
        else:
            out.append(f"--{key}={text(value)}")
    return tuple(out)


def _fewer_rows(planner: _Planner, cfg: dict, shapes: BatchShapes) -> list[tuple[dict[str, Any], BatchShapes]]:
    """Splits of the micro-batch, each with its shapes, fewest extra micro-batches first: more
    accumulate_grad_batches where that shrinks the recipe's micro-batch (RL), else a data.batch_size divided by
    what multiplies the accumulation, which keeps the step's batch (SFT)."""
    acc, batch_size = cfg["trainer"]["accumulate_grad_batches"], cfg["data"]["batch_size"]
    out: list[tuple[dict[str, Any], BatchShapes]] = []
    last = shapes.rows
    for factor in (2, 4, 8, 16, 32, 64, 128):
        options = [{"trainer.accumulate_grad_batches": acc * factor}]
        if batch_size % factor == 0:
            options.append({"data.batch_size": batch_size // factor, "trainer.accumulate_grad_batches": acc * factor})
        for option in options:
            try:
                trial = planner.shapes(planner.variant(cfg, option))
            except FwError:
                continue
            if trial is not None and trial.rows < last:
                out.append((option, trial))
                last = trial.rows
                break
        else:
            break
    return out


def _fewer_prompts(cfg: dict, section: str) -> list[dict[str, Any]]:
    """Smaller rollout batches with as many samples in each optimizer step, the smallest change first:
    rollout.prompts_per_step and the section's minibatches divided by the same factor. In RL,
    trainer.accumulate_grad_batches splits each minibatch into micro-batches and leaves the samples of an optimizer
    step as they are, so fewer prompts with more accumulation would shrink them; fewer prompts in as many fewer
    minibatches keep each optimizer step's prompts and samples (and the micro-batches), and so the samples drawn per
    optimizer step, trading optimizer steps a rollout for rollouts. Empty with one minibatch, where the rollout batch
    is one optimizer step's and no smaller one keeps it."""
    sec = cfg.get(section) if section else None
    if not isinstance(sec, dict) or not isinstance(sec.get("minibatches"), int):
        return []
    prompts, minibatches = cfg["rollout"]["prompts_per_step"], sec["minibatches"]
    common = math.gcd(prompts, minibatches)
    return [{"rollout.prompts_per_step": prompts // k, f"{section}.minibatches": minibatches // k}
            for k in range(2, common + 1) if common % k == 0]


def suggest(planner: _Planner, cfg: dict, plan: Plan, shapes: BatchShapes | None) -> None:
    """Fill `plan.suggestions` (fitting ones first) and `plan.together` when the plan does not fit."""
    found: list[tuple[dict[str, Any], Plan]] = []
    gap = plan.total_bytes - plan.limit_bytes
    section = getattr(planner.recipe, "section", "")
    for changes in _candidates(cfg, plan, shapes, planner.backend, planner.model, section):
        if _SPLIT_ROWS in changes:
            options = _fewer_rows(planner, cfg, shapes)
        elif _FEWER_PROMPTS in changes:
            options = [(option, None) for option in _fewer_prompts(cfg, section)]
        else:
            options = [(changes, None)]
        best = None
        for option, option_shapes in options:
            new = planner.variant(cfg, option)
            if planner.refuses(new):
                continue
            try:
                # the shapes of the changed config: fewer prompts, or a dtype that lays prompts out once
                trial = planner.plan(new, option_shapes or planner.shapes(new))
            except FwError:
                continue
            best = (option, trial)
            if trial.fits:
                break
        # a change that does not fit is advice only if it closes a share of the gap worth the change
        if best is not None and (best[1].fits or plan.total_bytes - best[1].total_bytes >= USEFUL_SHARE * gap):
            found.append(best)
    # the ones that fit in the order of the candidates (the least intrusive first), then the closest to fitting
    ranked = sorted(range(len(found)), key=lambda i: (not found[i][1].fits,
                                                      0.0 if found[i][1].fits else found[i][1].total_bytes, i))
    plan.suggestions = [Suggestion(_overrides(found[i][0]), found[i][1].total_bytes, found[i][1].fits)
                        for i in ranked]
    # no full fine-tuning change fits alone: the fewest of them that fit together, LoRA last if they never do
    full = [(changes, trial) for changes, trial in found if "model.policy.lora" not in changes]
    if not any(trial.fits for _, trial in full) and len(found) > 1:
        best = _combine(planner, cfg, [changes for changes, _ in full])
        if (best is None or not best[1].fits) and len(full) < len(found):
            best = _combine(planner, cfg, [changes for changes, _ in found])
        if best is not None:
            plan.together = Suggestion(_overrides(best[0]), best[1].total_bytes, best[1].fits)


def _combine(planner: _Planner, cfg: dict, pool: list[dict[str, Any]]) -> tuple[dict[str, Any], Plan] | None:
    """The changes of `pool` applied one after another until the job fits (but for one that makes it larger), then
    each dropped that the fit does not need, the first applied first: (the changes, their plan), or the last
    combination that does not fit."""
    def merged(used: list[dict[str, Any]]) -> dict[str, Any]:
        return {k: v for changes in used for k, v in changes.items()}

    def trial(used: list[dict[str, Any]]) -> Plan | None:
        new = planner.variant(cfg, merged(used))
        if planner.refuses(new):
            return None
        try:
            return planner.plan(new, planner.shapes(new))
        except FwError:
            return None

    used: list[dict[str, Any]] = []
    best = None
    for changes in pool:
        result = trial([*used, changes])
        if result is None or (best is not None and result.total_bytes > best.total_bytes):
            continue   # refused, or another value of a key changed before undoes more than it saves
        used.append(changes)
        best = result
        if result.fits:
            break
    if best is None:
        return None
    if not best.fits:   # what is left may be the KV pool: a smaller one sized to what the other changes leave
        new = planner.variant(cfg, merged(used))
        cap = _kv_cap(new, planner.model, best, planner.shapes(new))
        result = trial([*used, cap]) if cap is not None else None
        if result is not None and result.total_bytes < best.total_bytes:
            used.append(cap)
            best = result
    if best.fits:
        for changes in list(used):
            rest = [c for c in used if c is not changes]
            result = trial(rest) if rest else None
            if result is not None and result.fits:
                used, best = rest, result
    return merged(used), best


def estimate(cfg: dict, gpu_gib: float | None = None) -> Plan:
    """The memory plan of a resolved config on this machine: its model's shape read without loading weights,
    the recipe's batch shapes, the world size and the limit (`gpu_gib`, else trainer.memory_limit_gib, else the
    CUDA device's memory, else none); with suggestions when it does not fit."""
    planner = _Planner(cfg, gpu_gib)
    if planner.backend == "cuda" and not uses_cuda(cfg["trainer"]):
        # a GPU plan on a machine without one (`--gpu-gib` under accelerator auto): the recipe's shapes (shared
        # prompts) and the optimizer's checks (cpu_offload) see the GPU that `fw fit` will run on
        cfg = planner.variant(cfg, {"trainer.accelerator": "gpu"})
    shapes = planner.shapes(cfg)
    plan = planner.plan(cfg, shapes)
    plan.warnings.extend(position_warnings(planner.model, shapes))
    if plan.fits is False:
        suggest(planner, cfg, plan, shapes)
    return plan


def position_warnings(model: Qwen3Config, shapes: BatchShapes | None) -> list[str]:
    """A line when the longest row the job can form passes the policy's `max_position_embeddings`: the
    model computes there (RoPE has no table to run out of) but was not trained there."""
    if shapes is None or shapes.seq_len <= model.max_position_embeddings:
        return []
    if shapes.rollout_rows:
        what = (f"the longest prompt ({shapes.prompt_len:,} tokens) plus rollout.max_new_tokens "
                f"({shapes.new_tokens:,})")
    else:
        what = "data.max_seq_len"
    line = (f"{what} allows rows of {shapes.seq_len:,} tokens, more than the policy's max_position_embeddings "
            f"({model.max_position_embeddings:,}), the positions it is made for; fw applies no RoPE scaling")
    return [line]


def check_fits(cfg: dict, rank: int = 0, show: bool = True) -> Plan:
    """`fw fit`'s check before anything is built: FwError when the plan does not fit, after its table on
    stderr (rank 0); with `show`, the table of a plan that fits too (else the caller prints it later)."""
    plan = estimate(cfg)
    if rank == 0 and (show or plan.fits is False):
        print(plan.table(), file=sys.stderr, flush=True)
    if plan.fits is False:
        raise FwError(plan.refusal())
    return plan

