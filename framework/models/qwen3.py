"""The Qwen3 dense decoder: trunk, causal-LM policy and its KV cache.

Every norm, rotary, activation and attention call goes through `ops_cuda`, so CUDA kernels replace the
torch references without touching this file. Q/K/V and gate/up are fused in memory (one matmul
each); `hf_targets` maps HF's tensor names on disk to (tensor, row range) pieces of the fused weights.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import ops_cuda
from framework.errors import FwError
from framework.models import recompute
from framework.models.qwen3_config import Qwen3Config
from framework.models.recompute import cheap
from ops_cuda.qk_norm_rope_write import as_pool

# HF name -> (tensor in our module, first row, last row) of a fused weight; rows None = whole tensor.
HfTargets = dict[str, tuple[Tensor, int | None, int | None]]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return ops_cuda.rms_norm(x, self.weight, self.eps)


def _norm_cast(x: Tensor, weight: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    return ops_cuda.rms_norm(x, weight, eps).to(dtype)


def _normed(norm: RMSNorm, h: Tensor, consumer: nn.Module) -> Tensor:
    """The input of the matmul `consumer` after a norm. Under selective recomputation the norm's output is
    cast to autocast's dtype here, as the matmul would cast it, so that the tensor the matmul keeps is the
    marked one. Only for a plain nn.Linear, the cast's one user: the gradients of a cast with several users
    (a LoRA layer's base and adapters) would add up in its lower precision."""
    if not recompute.active() or type(consumer) is not nn.Linear:
        return norm(h)
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    return cheap(_norm_cast, h, norm.weight, norm.eps, dtype)


def _project(proj: nn.Module, x: Tensor, batch: PagedBatch) -> Tensor:
    """proj(x) in a paged forward: a plain nn.Linear's weight (or its copy in batch.casts) through ops_cuda.linear,
    which takes a decode step's few rows to fw's split-K GEMM. Adapters (LoRA) keep their own forward."""
    if type(proj) is not nn.Linear or proj.bias is not None:
        return proj(x)
    return ops_cuda.linear(x, _weight(proj.weight, batch))


def _weight(w: Tensor, batch: PagedBatch) -> Tensor:
    """The tensor a paged forward multiplies by for weight `w`: its compute-dtype copy where the batch carries one."""
    return w if batch.casts is None else batch.casts.get(w, w)


def _head_logits(h: Tensor, w: Tensor) -> Tensor:
    """h @ w.T for sampling: the operands in the dtype the matmul computes in (autocast's for float32 weights in an
    autocast region, else the weight's), 16-bit products accumulated in float32 and returned in float32, as the
    trainer's logprob operator (ops_cuda.linear_logprob) forms its logits; rounded to 16 bits first, the
    behaviour logprobs would differ from the trainer's by that rounding of every logit."""
    device = h.device.type
    autocast = w.dtype == torch.float32 and torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else w.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return ops_cuda.linear(h.to(dtype), w)
    with torch.autocast(device, enabled=False):
        h, w = h.to(dtype), w.to(dtype)
        if h.is_cuda:   # cuBLAS writes its float32 accumulators without rounding them to 16 bits
            return torch.mm(h, w.t(), out_dtype=torch.float32)
        return F.linear(h.float(), w.float())   # exact products of 16-bit values, summed in float32


def _paged_compute_dtype(t: Tensor, pool: Tensor) -> torch.dtype:
    """The dtype a paged forward's attention computes in: the pool's, or for a float8 pool (rollout.kv_cache_dtype)
    that of `t`, the projection's output (autocast's or the model's)."""
    return t.dtype if pool.dtype == torch.float8_e4m3fn else pool.dtype


@dataclass
class KVCache:
    """Keys/values of every layer for a batch of right-padded rows; row b holds `lengths[b]` tokens."""

    k: Tensor        # [L, B, Hk, S, D]
    v: Tensor        # [L, B, Hk, S, D]
    lengths: Tensor  # LongTensor [B]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


class DecodeStep(NamedTuple):
    """Where one decode step writes, shared by all layers: row b's new token goes to slot positions[b]."""

    rows: Tensor       # arange(B)
    positions: Tensor  # [B] cache lengths before the step = the new tokens' positions
    lengths: Tensor    # [B] positions + 1: what each row attends to after writing


class Packing(NamedTuple):
    """The sequences of packed rows, flattened row after row (ops_cuda.varlen_attention's arguments)."""

    cu_seqlens: Tensor  # int32 [S + 1]: sequence i is tokens cu_seqlens[i] .. cu_seqlens[i+1] - 1
    max_seqlen: int


class SharedPrompts(NamedTuple):
    """Sequences in groups that share a prompt, each prompt's tokens once: the prompts of all groups first, then
    every sequence's own tokens (its completion), group after group, in one packed row. A prompt attends causally
    to itself; a completion attends to its group's prompt and to itself up to each token
    (ops_cuda.shared_prompt_attention). The same states as each sequence laid out whole, for fewer tokens."""

    prompt_tokens: int   # the prompts' tokens, first in the row
    cu_prompts: Tensor   # int32 [G + 1] over them
    max_prompt: int
    cu_groups: Tensor    # int32 [G + 1] over the completions' tokens, counted from the first: each group's
    max_group: int
    cu_seqs: Tensor      # int32 [S + 1] over the row: each prompt, then each non-empty completion
    max_seq: int


@dataclass
class PagedKVCache:
    """Keys/values of every layer in fixed-size blocks of one pool; a row's positions live in the blocks its
    block table names (framework/rollout/block_manager.py hands them out)."""

    k: Tensor        # [L, num_blocks, Hk, block_size, D]
    v: Tensor        # [L, num_blocks, Hk, block_size, D]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]


class FlashPrefill(NamedTuple):
    """A prefill's attention by varlen flash attention (CUDA) instead of the pool-reading reference: cu_q and max_q
    over the rows' new tokens, cu_k and max_k over their whole contexts (int32 cu). context_blocks/offsets [Nk] locate
    every context position in the pools, gathered after the writes; None when no row has a cached prefix, so the new
    tokens' own keys/values are the contexts (cu_k is cu_q)."""

    cu_q: Tensor
    max_q: int
    cu_k: Tensor
    max_k: int
    context_blocks: Tensor | None = None
    context_offsets: Tensor | None = None


class PagedBatch(NamedTuple):
    """One forward over a paged cache, shared by all layers: N new tokens of R rows, each token's k/v written at
    (write_blocks[i], write_offsets[i]) before the attention reads the rows' contexts."""

    positions: Tensor       # [N] the tokens' positions in their rows
    write_blocks: Tensor    # [N]
    write_offsets: Tensor   # [N]
    block_tables: Tensor    # [R, M] int64
    lengths: Tensor         # [R] each row's context length after the writes
    cu_seqlens: Tensor | None  # [R + 1]: row r's tokens (prefill); None: one token a row, N == R (decode)
    flash: FlashPrefill | None = None   # a prefill on CUDA; None: the reference (the CPU's exact path)
    packs: Tensor | None = None   # decode: [R, 3] rows sharing their first positions (ops_cuda.paged_decode_attention)
    # matmul weight -> its copy in the compute dtype, which the rollout engine keeps across calls under autocast
    # (Qwen3ForCausalLM.paged_matmul_weights), so that its decode graphs read the same copies at every call
    casts: dict[Tensor, Tensor] | None = None


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=False)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def _qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, d] -> q [B, T, Hq, D], k, v [B, T, Hk, D] with QK-norm then RoPE applied."""
        B, T, _ = x.shape
        q, k, v = cheap(ops_cuda.qk_norm_rope, self.qkv_proj(x).reshape(B * T, -1), positions.reshape(B * T),
                        self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.config.rope_theta,
                        self.num_kv_heads)
        return (q.view(B, T, self.num_heads, self.head_dim), k.view(B, T, self.num_kv_heads, self.head_dim),
                v.view(B, T, self.num_kv_heads, self.head_dim))

    def forward(self, x: Tensor, positions: Tensor, packed: Packing | SharedPrompts | None,
                cache: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Causal attention over the rows of x; `packed` rows hold several sequences, each attending
        only to itself through ops_cuda.varlen_attention (no [T, T] mask), or groups of sequences that
        share a prompt (SharedPrompts).

        With `cache` = (k_cache, v_cache) of this layer, [B, Hk, S, D], the new keys/values are also
        written at cache positions 0..T-1 (prefill).
        """
        B, T, _ = x.shape
        q, k, v = self._qkv(x, positions)
        if cache is not None:
            cache[0][:, :, :T] = k.transpose(1, 2)
            cache[1][:, :, :T] = v.transpose(1, 2)
        if packed is None:
            out = ops_cuda.attention(q, k, v, None, self.scale)
        else:
            q = q.reshape(B * T, self.num_heads, self.head_dim)
            k = k.reshape(B * T, self.num_kv_heads, self.head_dim)
            v = v.reshape(B * T, self.num_kv_heads, self.head_dim)
            if isinstance(packed, SharedPrompts):
                out = ops_cuda.shared_prompt_attention(q, k, v, packed.prompt_tokens, packed.cu_prompts,
                                                       packed.cu_groups, packed.cu_seqs, packed.max_prompt,
                                                       packed.max_group, packed.max_seq, self.scale)
            else:
                out = ops_cuda.varlen_attention(q, k, v, packed.cu_seqlens, packed.max_seqlen, self.scale)
        return self.o_proj(out.reshape(B, T, self.config.q_size))

    def decode(self, x: Tensor, step: DecodeStep, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """One new token per row, x [B, 1, d]: writes its k/v at step.positions, attends to 0..position."""
        q, k, v = self._qkv(x, step.positions[:, None])
        k_cache[step.rows, :, step.positions] = k[:, 0]
        v_cache[step.rows, :, step.positions] = v[:, 0]
        out = ops_cuda.decode_attention(q[:, 0], k_cache, v_cache, step.lengths, self.scale)
        return self.o_proj(out.reshape(x.shape[0], 1, self.config.q_size))

    def paged(self, x: Tensor, batch: PagedBatch, k_pool: Tensor, v_pool: Tensor) -> Tensor:
        """Packed tokens x [N, d]: writes their k/v into the pools, then attends over each row's context."""
        f = batch.flash
        if f is None or f.context_blocks is not None:   # QK-norm, RoPE and the writes in one op
            qkv = _project(self.qkv_proj, x, batch)
            qkv = qkv.to(_paged_compute_dtype(qkv, k_pool))
            q = ops_cuda.qk_norm_rope_write(qkv, batch.positions, self.q_norm.weight, self.k_norm.weight,
                                            self.q_norm.eps, self.config.rope_theta, k_pool, v_pool,
                                            batch.write_blocks, batch.write_offsets)
        else:   # the new tokens are the whole contexts: their k/v serve the attention as the pool holds them
            q, k, v = (t[0] for t in self._qkv(x[None], batch.positions[None]))
            q = q.to(_paged_compute_dtype(q, k_pool))
            # the attention reads the values the pool holds (float8: rounded), as the decode steps and a prefill
            # that recomputes a preempted row do, so that every path sees the same keys and values
            k, v = as_pool(k, k_pool), as_pool(v, v_pool)
            k_pool[batch.write_blocks, :, batch.write_offsets] = k
            v_pool[batch.write_blocks, :, batch.write_offsets] = v
        if batch.cu_seqlens is None:
            out = ops_cuda.paged_decode_attention(q, k_pool, v_pool, batch.block_tables, batch.lengths, self.scale,
                                                  batch.packs)
        elif f is not None:
            if f.context_blocks is not None:   # cached prefix and new tokens, packed row after row
                k = k_pool[f.context_blocks, :, f.context_offsets]
                v = v_pool[f.context_blocks, :, f.context_offsets]
            out = ops_cuda.varlen_suffix_attention(q, k.to(q.dtype), v.to(q.dtype), f.cu_q, f.cu_k, f.max_q,
                                                   f.max_k, self.scale)
        else:
            out = ops_cuda.paged_prefill_attention(q, k_pool, v_pool, batch.block_tables, batch.cu_seqlens,
                                                   batch.lengths, self.scale)
        return _project(self.o_proj, out.reshape(x.shape[0], self.config.q_size).to(x.dtype), batch)


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(cheap(ops_cuda.swiglu, self.gate_up_proj(x)))

    def paged(self, x: Tensor, batch: PagedBatch) -> Tensor:
        """`forward` of a paged forward's packed tokens x [N, d] (no gradients)."""
        return _project(self.down_proj, ops_cuda.swiglu(_project(self.gate_up_proj, x, batch)), batch)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, h: Tensor, positions: Tensor, packed: Packing | SharedPrompts | None,
                cache: tuple[Tensor, Tensor] | None = None) -> Tensor:
        h = h + self.self_attn(_normed(self.input_layernorm, h, self.self_attn.qkv_proj), positions, packed, cache)
        return h + self.mlp(_normed(self.post_attention_layernorm, h, self.mlp.gate_up_proj))

    def decode(self, h: Tensor, step: DecodeStep, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        h = h + self.self_attn.decode(self.input_layernorm(h), step, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def _add_norm(x: Tensor, h: Tensor, norm: RMSNorm) -> tuple[Tensor, Tensor]:
    """(h + x, norm(h + x)): one kernel (ops_cuda.add_rms_norm) where x's dtype promotes to h's. Under autocast
    the norm comes out in autocast's dtype, which the next matmul would cast it to, and no cast kernel runs."""
    if torch.promote_types(x.dtype, h.dtype) != h.dtype:
        h = h + x
        return h, norm(h)
    device = h.device.type
    out = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return ops_cuda.add_rms_norm(x, h, norm.weight, norm.eps, out if out in (x.dtype, h.dtype) else None)


def _norm_of_sum(h: Tensor, weight: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """The norm output that `add_rms_norm` gave with the sum h: the same kernel on h + 0, which is h exactly."""
    return ops_cuda.add_rms_norm(h.new_zeros(h.shape, dtype=dtype), h, weight, eps, dtype)[1]


def _add_then_norm(x: Tensor, h: Tensor, norm: RMSNorm) -> tuple[Tensor, Tensor]:
    """`_add_norm` in the training forward: under selective recomputation the norm's output is recomputed in the
    backward from the sum, which the add's backward keeps anyway."""
    h, y = _add_norm(x, h, norm)
    if recompute.active() and torch.promote_types(x.dtype, h.dtype) == h.dtype:   # the fused kernel ran
        recompute.recomputed_as(y, _norm_of_sum, h, norm.weight, norm.eps, y.dtype)
    return h, y


def checkpointing_mode(mode: bool | str) -> bool | str:
    """`mode` if it is one of model.policy.gradient_checkpointing's values (False, True, "selective")."""
    if mode is not False and mode is not True and mode != "selective":
        raise FwError(f"gradient_checkpointing must be false, true or \"selective\", got {mode!r}")
    return mode


def _embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without its normal(0, 1) draw on the meta device (see `init_weights`)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class Qwen3Model(nn.Module):
    """The trunk: embeddings, decoder layers and the final norm (shared by policy and value model)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing: bool | str = False   # model.policy.gradient_checkpointing

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                cache: KVCache | None = None, packing: Packing | SharedPrompts | None = None) -> Tensor:
        """Final normalised hidden states [B, T, d]. position_ids given = rows may be packed: a position
        that is not previous+1 starts a new sequence (the sequence bounds are found once, for all layers,
        with two device syncs). `packing` gives those bounds instead, e.g. from a packer that knows them on
        the host, so the forward does not sync, or lays out groups that share a prompt (SharedPrompts)."""
        B, T = input_ids.shape
        packed = None
        if position_ids is None:
            if packing is not None:
                raise FwError("packing needs the position_ids of the packed rows")
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        elif position_ids.shape != input_ids.shape:
            raise FwError(f"position_ids shape {tuple(position_ids.shape)} != input_ids shape "
                          f"{tuple(input_ids.shape)}")
        else:
            packed = packing if packing is not None else Packing(*ops_cuda.packed_sequences(position_ids))
        # one [B * T] copy, saved once, that every layer's QK-norm with RoPE reads as its view
        position_ids = position_ids.contiguous()
        h = self.embed_tokens(input_ids)
        mode = self.gradient_checkpointing if self.training and torch.is_grad_enabled() else False
        # under torch.compile the partitioner chooses what to recompute itself
        selective = mode == "selective" and not torch.compiler.is_compiling()
        if (mode is False or selective) and self._fuses_adds():
            with recompute.SelectiveRecompute() if selective else nullcontext():
                return self._fused_adds(h, position_ids, packed, cache)
        with recompute.SelectiveRecompute() if selective else nullcontext():
            for i, layer in enumerate(self.layers):
                layer_cache = (cache.k[i], cache.v[i]) if cache is not None else None
                if mode is True:
                    h = checkpoint(layer, h, position_ids, packed, layer_cache, use_reentrant=False)
                else:
                    h = layer(h, position_ids, packed, layer_cache)
        return self.norm(h)

    def _fuses_adds(self) -> bool:
        """Whether every norm output feeds a plain nn.Linear: then the forward may emit it in autocast's dtype
        (`_add_norm`). A LoRA layer's input has several users, whose gradients would add up in that dtype."""
        return all(type(layer.self_attn.qkv_proj) is nn.Linear and type(layer.mlp.gate_up_proj) is nn.Linear
                   for layer in self.layers)

    def _fused_adds(self, h: Tensor, positions: Tensor, packed: Packing | SharedPrompts | None,
                    cache: KVCache | None) -> Tensor:
        """The layers with each residual add run together with the norm after it (the layer's second norm, or the
        next layer's first), forward and backward (ops_cuda.add_rms_norm): the same maths as the layers' own
        forwards, with three memory passes over the residual stream fewer per add. The decoder layers' own
        `forward` (and hooks on the layers themselves) do not run here; their attention and MLP modules' do."""
        first = self.layers[0]
        x = _normed(first.input_layernorm, h, first.self_attn.qkv_proj)
        for i, layer in enumerate(self.layers):
            layer_cache = (cache.k[i], cache.v[i]) if cache is not None else None
            h, x = _add_then_norm(layer.self_attn(x, positions, packed, layer_cache), h,
                                  layer.post_attention_layernorm)
            if i + 1 < len(self.layers):
                h, x = _add_then_norm(layer.mlp(x), h, self.layers[i + 1].input_layernorm)
            else:
                h = h + layer.mlp(x)
        return self.norm(h)

    def decode(self, tokens: Tensor, cache: KVCache) -> Tensor:
        """Hidden state [B, d] of one new token per row, written at `cache.lengths` (then lengths += 1)."""
        if tokens.dim() != 1 or tokens.shape[0] != cache.lengths.shape[0]:
            raise FwError(f"decode: tokens must be [B={cache.lengths.shape[0]}], got {tuple(tokens.shape)}")
        # No host-side check of lengths < max_len here: a sync per token would stall the GPU (and CUDA
        # graph capture); the caller sizes the cache, and an overflow fails the cache index.
        positions = cache.lengths.clone()
        step = DecodeStep(torch.arange(len(positions), device=positions.device), positions, positions + 1)
        h = self.embed_tokens(tokens[:, None])
        for i, layer in enumerate(self.layers):
            h = layer.decode(h, step, cache.k[i], cache.v[i])
        cache.lengths.copy_(step.lengths)
        return self.norm(h[:, 0])

    def paged(self, tokens: Tensor, batch: PagedBatch, cache: PagedKVCache) -> Tensor:
        """Final normalised hidden states [N, d] of packed new tokens [N] over a paged cache. Each residual add
        runs with the norm after it (the next layer's input norm, or the final one)."""
        h = self.embed_tokens(tokens)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        x = self.layers[0].input_layernorm(h) if len(self.layers) else self.norm(h)
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms)):
            h, x = _add_norm(layer.self_attn.paged(x, batch, cache.k[i], cache.v[i]), h, layer.post_attention_layernorm)
            h, x = _add_norm(layer.mlp.paged(x, batch), h, next_norm)
        return x

    def hf_targets(self, prefix: str = "model.") -> HfTargets:
        c = self.config
        t: HfTargets = {f"{prefix}embed_tokens.weight": (self.embed_tokens.weight, None, None),
                        f"{prefix}norm.weight": (self.norm.weight, None, None)}
        for i, layer in enumerate(self.layers):
            p = f"{prefix}layers.{i}."
            qkv = layer.self_attn.qkv_proj.weight
            gate_up = layer.mlp.gate_up_proj.weight
            t.update({
                f"{p}self_attn.q_proj.weight": (qkv, 0, c.q_size),
                f"{p}self_attn.k_proj.weight": (qkv, c.q_size, c.q_size + c.kv_size),
                f"{p}self_attn.v_proj.weight": (qkv, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size),
                f"{p}self_attn.o_proj.weight": (layer.self_attn.o_proj.weight, None, None),
                f"{p}self_attn.q_norm.weight": (layer.self_attn.q_norm.weight, None, None),
                f"{p}self_attn.k_norm.weight": (layer.self_attn.k_norm.weight, None, None),
                f"{p}mlp.gate_proj.weight": (gate_up, 0, c.intermediate_size),
                f"{p}mlp.up_proj.weight": (gate_up, c.intermediate_size, 2 * c.intermediate_size),
                f"{p}mlp.down_proj.weight": (layer.mlp.down_proj.weight, None, None),
                f"{p}input_layernorm.weight": (layer.input_layernorm.weight, None, None),
                f"{p}post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, None, None),
            })
        return t


def init_weights(module: nn.Module, std: float) -> None:
    """HF's initialisation: normal(0, std) for linear and embedding weights, zero biases, unit norms.

    Nothing is drawn on the meta device: its tensors have no values, and a normal draw's meta kernel imports
    torch._dynamo, which every command that builds a model there (a checkpoint's load, a preset's init) would
    otherwise wait for at its start.
    """
    for m in module.modules():
        if any(p.is_meta for p in m.parameters(recurse=False)):
            continue
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)


def target_views(targets: HfTargets) -> dict[str, Tensor]:
    """HF-named views of the module's tensors (no copies)."""
    return {name: (t if lo is None else t[lo:hi]).detach() for name, (t, lo, hi) in targets.items()}


def load_targets(targets: HfTargets, sd: dict[str, Tensor], strict: bool = True,
                       source: str = "state dict") -> None:
    """Copy HF-named tensors into the module; strict = every target present and nothing else."""
    if strict:
        missing = sorted(set(targets) - set(sd))
        unexpected = sorted(set(sd) - set(targets))
        if missing or unexpected:
            raise FwError(f"{source}: missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                          f"unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    for name, value in sd.items():
        if name in targets:
            copy_into(targets, name, value, source)


# what a stored weight may be: a copy converts between these exactly or by rounding; any other dtype (an integer,
# bool, complex, float8 or packed float4 tensor) is not a plain weight, and copy_ would turn it into wrong numbers
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_weight_dtype(name: str, value: Tensor, source: str) -> None:
    """Refuse a stored tensor `name` whose dtype is not a plain floating-point weight's (WEIGHT_DTYPES)."""
    if value.dtype not in WEIGHT_DTYPES:
        raise FwError(f"{source}: tensor {name} has dtype {str(value.dtype).removeprefix('torch.')}, expected "
                      "float32, bfloat16, float16 or float64")


def copy_into(targets: HfTargets, name: str, value: Tensor, source: str) -> None:
    """Copy one HF tensor into its (slice of a) parameter, converting dtype/device; checks the shape and dtype."""
    t, lo, hi = targets[name]
    dest = t if lo is None else t[lo:hi]
    check_weight_dtype(name, value, source)
    if tuple(value.shape) != tuple(dest.shape):
        raise FwError(f"{source}: tensor {name} has shape {tuple(value.shape)}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(value)


class Qwen3ForCausalLM(nn.Module):
    """The policy: trunk + LM head (the embedding matrix when `tie_word_embeddings`)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.keep_logits: bool | None = None  # model.policy.keep_logits; None: keep unless checkpointing
        init_weights(self, config.initializer_range)

    @property
    def lm_head_weight(self) -> Tensor:
        """[V, d]: the output projection (the input embedding when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def gradient_checkpointing(self) -> bool | str:
        """False, True (whole layers recomputed in the backward) or "selective" (their cheap ops only)."""
        return self.model.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, mode: bool | str) -> None:
        self.model.gradient_checkpointing = checkpointing_mode(mode)

    @property
    def saves_logits(self) -> bool:
        """Whether the loss keeps its logits for the backward (ops_cuda.linear_logprob's save_logits): as
        keep_logits says, and when it is None unless activations are recomputed at all."""
        return self.gradient_checkpointing is False if self.keep_logits is None else self.keep_logits

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                return_hidden: bool = False, packing: Packing | SharedPrompts | None = None) -> Tensor:
        """Logits [B, T, V], or the final normalised hidden states [B, T, d] with return_hidden
        (`packing`: see Qwen3Model.forward)."""
        h = self.model(input_ids, position_ids, packing=packing)
        return h if return_hidden else F.linear(h, self.lm_head_weight)

    def new_kv_cache(self, batch_size: int, max_len: int, device: torch.device | str | None = None,
                     dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache for `batch_size` rows of up to `max_len` tokens (model's device/dtype by default)."""
        ref = self.lm_head_weight
        c = self.config
        shape = (c.num_hidden_layers, batch_size, c.num_key_value_heads, max_len, c.head_dim)
        kw = {"device": device or ref.device, "dtype": dtype or ref.dtype}
        return KVCache(k=torch.zeros(shape, **kw), v=torch.zeros(shape, **kw),
                       lengths=torch.zeros(batch_size, dtype=torch.long, device=kw["device"]))

    def new_paged_kv_cache(self, num_blocks: int, block_size: int, device: torch.device | str | None = None,
                           dtype: torch.dtype | None = None) -> PagedKVCache:
        """A pool of `num_blocks` blocks of `block_size` positions (model's device/dtype by default)."""
        ref = self.lm_head_weight
        c = self.config
        shape = (c.num_hidden_layers, num_blocks, c.num_key_value_heads, block_size, c.head_dim)
        kw = {"device": device or ref.device, "dtype": dtype or ref.dtype}
        return PagedKVCache(k=torch.zeros(shape, **kw), v=torch.zeros(shape, **kw))

    @torch.no_grad()
    def forward_paged(self, tokens: Tensor, batch: PagedBatch, cache: PagedKVCache, last: Tensor) -> Tensor:
        """Runs packed new tokens [N] through the paged cache; returns the logits [len(last), V] at the token
        indices `last` (each row's last new token, for sampling), in float32 for a 16-bit model (`_head_logits`)."""
        h = self.model.paged(tokens, batch, cache)
        return _head_logits(h[last], _weight(self.lm_head_weight, batch))

    def paged_matmul_weights(self) -> list[Tensor] | None:
        """The weights a paged forward multiplies by (each layer's four projections, then the LM head), or None where
        an adapter (LoRA) wraps a projection: its own forward does that projection's matmuls."""
        projs = [p for layer in self.model.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                            layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if any(type(p) is not nn.Linear or p.bias is not None for p in projs):
            return None
        return [p.weight for p in projs] + [self.lm_head_weight]

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, lengths: Tensor, cache: KVCache) -> Tensor:
        """Run right-padded prompts [B, T] (row b has lengths[b] real tokens) into an empty cache.

        Returns the logits [B, V] at each row's last real token; afterwards cache.lengths = lengths.
        """
        B, T = input_ids.shape
        if cache.lengths.shape[0] != B or int(cache.lengths.max()) != 0:
            raise FwError(f"prefill needs an empty cache for {B} rows (got lengths "
                          f"{cache.lengths.tolist()[:8]})")
        if T > cache.max_len:
            raise FwError(f"prefill: {T} prompt tokens do not fit the cache (max_len {cache.max_len})")
        lengths = lengths.to(device=input_ids.device, dtype=torch.long)
        if int(lengths.min()) < 1 or int(lengths.max()) > T:
            raise FwError(f"prefill: lengths must be in 1..{T}, got {lengths.tolist()[:8]}")
        # Right padding: a real token never attends to the pad tokens after it, so plain causal
        # attention is exact; pad keys written past lengths[b] are overwritten by decode.
        h = self.model(input_ids, None, cache)
        cache.lengths.copy_(lengths)
        last = h[torch.arange(B, device=h.device), lengths - 1]
        return F.linear(last, self.lm_head_weight)

    @torch.no_grad()
    def decode(self, tokens: Tensor, cache: KVCache) -> Tensor:
        """Append one token per row at position cache.lengths; returns its logits [B, V]."""
        return F.linear(self.model.decode(tokens, cache), self.lm_head_weight)

    def hf_targets(self) -> HfTargets:
        t = self.model.hf_targets()
        if self.lm_head is not None:
            t["lm_head.weight"] = (self.lm_head.weight, None, None)
        return t

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Tensors under HF's exact names and layouts (views of the fused weights)."""
        return target_views(self.hf_targets())

    def load_hf_state_dict(self, sd: dict[str, Tensor], strict: bool = True) -> None:
        """Load HF-named tensors; a tied model also accepts an `lm_head.weight` equal to the embedding."""
        sd = dict(sd)
        if self.lm_head is None and "lm_head.weight" in sd:
            check_weight_dtype("lm_head.weight", sd["lm_head.weight"], "state dict")
            check_tied_head(sd.pop("lm_head.weight"), sd.get("model.embed_tokens.weight"), "state dict")
        load_targets(self.hf_targets(), sd, strict)


def check_tied_head(lm_head: Tensor, embed: Tensor | None, source: str) -> None:
    """Some tied checkpoints store lm_head.weight too; accept it only as a copy of the embedding."""
    if embed is None or lm_head.shape != embed.shape or not torch.equal(lm_head.to(embed), embed):
        raise FwError(f"{source}: tensor lm_head.weight is present and differs from model.embed_tokens.weight, "
                      "but tie_word_embeddings is true")
