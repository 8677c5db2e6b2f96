"""The paged KV cache's size and the decode step's CUDA graphs.

`CacheSettings` are the `rollout` section's kv_cache_gib, max_num_seqs, block_size, admit_batch and kv_cache_dtype.
The pool holds keys and values in the rollout's compute dtype, or rounded to float8_e4m3fn (`pool_dtype`), and
as many blocks as the budget pays for (kv_cache_gib null: what the GPU has free, less `FREE_MARGIN_BYTES` for the
step's activations and logits; on CPU `CPU_KV_CACHE_GIB`), and never more than the call's rows could all use at
once. A smaller budget runs fewer rows at a time and preempts more (framework/rollout/scheduler.py): same tokens,
more steps and more recomputation.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from framework.errors import FwError
from framework.models.qwen3 import PagedBatch
from framework.rollout.scheduler import blocks_for

FREE_MARGIN_BYTES = 4 << 30   # left free beside a kv_cache_gib-null pool: activations, logits, sampler workspace
CPU_KV_CACHE_GIB = 4.0        # the pool's budget on CPU when kv_cache_gib is null
CPU_ROW_MULTIPLE = 16         # CPU batches are padded to a multiple of this (see _Run._prefill)
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class CacheSettings:
    """How large the paged cache is, how many rows decode together, how many join at once, and the pool's dtype."""

    kv_cache_gib: float | None
    max_num_seqs: int
    block_size: int
    admit_batch: int
    kv_cache_dtype: str

    @classmethod
    def from_config(cls, rollout: dict | None) -> CacheSettings:
        """From the `rollout` section of a resolved config; None: the schema's defaults."""
        if rollout is None:
            from framework.config import defaults

            rollout = defaults("grpo")["rollout"]
        return cls(rollout["kv_cache_gib"], rollout["max_num_seqs"], rollout["block_size"], rollout["admit_batch"],
                   rollout["kv_cache_dtype"])


# rollout.kv_cache_dtype -> the pool's dtype; None: the compute dtype
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "float8_e4m3": torch.float8_e4m3fn}


def pool_dtype(kv_cache_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The dtype the pool stores keys and values in under rollout.kv_cache_dtype, for a rollout computing in
    `compute` (autocast's dtype or the model's)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise FwError(f"rollout.kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or compute


def compute_dtype(device: torch.device, weights: torch.dtype) -> torch.dtype:
    """The dtype a rollout on `device` computes in, under the caller's autocast state: autocast's where it is on
    there (keys and values come out in it), else the `weights`' own."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else weights


def fp8_cuda_problem(compute: torch.dtype, config: Any = None) -> str | None:
    """Why a float8 pool cannot be decoded on CUDA by a rollout computing in `compute` (with `config`'s heads, when
    given), or None: the decode kernel takes 16-bit queries, head_dim 64 or 128, 2 or more query heads a kv head."""
    if compute not in (torch.bfloat16, torch.float16):
        return (f"float8_e4m3 needs a bfloat16 or float16 rollout on CUDA (trainer.precision bf16-mixed, or bfloat16 "
                f"policy weights); this one computes in {str(compute).removeprefix('torch.')}")
    if config is not None and (config.head_dim not in (64, 128)
                               or config.num_attention_heads < 2 * config.num_key_value_heads):
        return (f"float8_e4m3 needs head_dim 64 or 128 and 2 or more query heads a kv head on CUDA; this model has "
                f"head_dim {config.head_dim}, {config.num_attention_heads} / {config.num_key_value_heads} heads")
    return None


def block_bytes(config: Any, dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one block of a pool of `dtype`: keys and values of every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * block_size * config.head_dim * elem


def pool_blocks(settings: CacheSettings, config: Any, dtype: torch.dtype, device: torch.device,
                rows: Sequence[Any]) -> int:
    """Blocks of a pool of `dtype` (the pool's own) for a call over `rows` (each with .prompt and .limit), the scratch
    block included; never more than rollout.kv_cache_gib pays for (1 where it pays for fewer than 2)."""
    per_block = block_bytes(config, dtype, settings.block_size)
    need = sum(blocks_for(len(r.prompt), r.limit, settings.block_size) for r in rows) + 1
    if settings.kv_cache_gib is not None:
        # a set budget is never exceeded: one too small for a row's block and the scratch block leaves the rows
        # no block (the one block returned is the scratch), and the Scheduler's `check_rows_fit` refuses them
        return max(1, min(need, int(settings.kv_cache_gib * (1 << 30)) // per_block))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) - FREE_MARGIN_BYTES
    else:
        budget = int(CPU_KV_CACHE_GIB * (1 << 30))
    return max(2, min(need, budget // per_block))


def batch_bucket(rows: int, max_num_seqs: int, cpu: bool) -> int:
    """The batch size a decode step of `rows` runs at: a graph bucket on CUDA, a multiple of 16 on CPU."""
    if cpu:
        return -(-rows // CPU_ROW_MULTIPLE) * CPU_ROW_MULTIPLE
    for b in GRAPH_BUCKETS:
        if b >= rows:
            return b
    return -(-rows // 64) * 64


def decode_step(model: Any, cache: Any, inputs: Tensor, tables: Tensor,
                casts: dict[Tensor, Tensor] | None = None) -> Tensor:
    """One decode forward: inputs [B, 2] (the token fed, its position) or [B, 5] (and the row's pack, as
    ops_cuda.paged_decode_attention takes it), tables [B, M]; logits [B, V]; `casts`: PagedBatch.casts. All on the
    device, nothing read back, so that it can be captured in a CUDA graph."""
    # positions (and packs) made contiguous once: every layer's kernels would otherwise copy the strided columns
    tokens, positions = inputs[:, 0], inputs[:, 1].contiguous()
    packs = inputs[:, 2:].contiguous() if inputs.shape[1] > 2 else None
    bs = cache.block_size
    blk = tables.gather(1, (positions // bs)[:, None]).squeeze(1)
    batch = PagedBatch(positions=positions, write_blocks=blk, write_offsets=positions % bs, block_tables=tables,
                       lengths=positions + 1, cu_seqlens=None, packs=packs, casts=casts)
    return model.forward_paged(tokens, batch, cache, torch.arange(len(tokens), device=tokens.device))


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream on which every decode graph of `device` is captured, and each bucket's eager first step runs.

    cuBLAS keeps a workspace per stream for the life of the process, made at that stream's first matmul. Made
    by the eager step, it lies outside the graphs' pool, which then goes back whole with the graphs; one stream
    keeps one workspace, where a stream per capture left one in the pool of each.
    """
    device = torch.device(device)
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _CAPTURE_STREAMS[device]


def first_decode_step(model: Any, cache: Any, inputs: Tensor, tables: Tensor,
                      casts: dict[Tensor, Tensor] | None = None) -> Tensor:
    """`decode_step` run eagerly on the capture stream, ordered after the current stream's work and before what
    follows it there: the lazy set-up a capture must not record (cuBLAS handles and workspace, the
    decode-attention counters) is then done for the stream that captures."""
    stream, current = capture_stream(inputs.device), torch.cuda.current_stream(inputs.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        logits = decode_step(model, cache, inputs, tables, casts)
    current.wait_stream(stream)
    return logits


class DecodeGraph:
    """The decode step captured once for one (batch bucket, table width) and replayed per step: it reads
    the fed tokens and positions and the rows' block tables from static buffers and leaves the logits in a
    static one (overwritten by the next replay).

    Capture it only after `first_decode_step` of the same shapes, which did the lazy set-up. The capture is by
    hand rather than ``torch.cuda.graph``, whose entry empties the allocator cache: in an RL loop that would
    hand every training step's memory back at each rollout. All graphs of an engine share one memory pool.
    """

    def __init__(self, model: Any, cache: Any, inputs: Tensor, tables: Tensor, pool: Any,
                 casts: dict[Tensor, Tensor] | None = None) -> None:
        self.device = inputs.device
        self.inputs, self.tables = inputs.clone(), tables.clone()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):   # the model's device, whichever one is current
            stream, current = capture_stream(self.device), torch.cuda.current_stream()
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                # thread_local: CUDA calls of other threads (a DataLoader's pin-memory thread, a checkpoint
                # writer) stay legal during the capture; only this thread's are restricted.
                self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    self.logits = decode_step(model, cache, self.inputs, self.tables, casts)   # recorded, not run
                finally:
                    self.graph.capture_end()
            current.wait_stream(stream)

    def __call__(self, inputs: Tensor, tables: Tensor) -> Tensor:
        self.inputs.copy_(inputs)
        self.tables.copy_(tables)
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.logits
