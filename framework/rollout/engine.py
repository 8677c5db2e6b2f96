"""Generation over a paged KV cache with continuous batching: rows join the running batch as blocks free up
and take blocks as they grow (the newest row is preempted and recomputed later when none is free), prompts of
a group are prefilled once, and one forward per step decodes every running row, the rows of a group side by side so
that the decode attention can read their shared prompt blocks once (`decode_packs`).

A `RolloutEngine` holds the pool of KV blocks (`framework/rollout/kv_cache.py` sizes it from
`rollout.kv_cache_gib`; it holds the compute dtype, or float8 e4m3 as `rollout.kv_cache_dtype` says), its
bookkeeping (`block_manager.py`), and on CUDA one decode graph per batch-size bucket, captured once and replayed
by every later step and call of that bucket (under autocast the matmuls read the engine's copies of the weights in
the compute dtype, refreshed at each call, so that the graphs stay valid). `generate` runs one call on a fresh engine
and hands its memory back; the RL recipes keep one engine across rollouts when `rollout.keep_engine` says so
(recipes/rl.py).

Stopping, per row: an EOS id (the EOS token is kept as the row's last completion token, with its logprob, so
the trainer learns to emit it; it is left out of the text), a stop string (the token whose text completes it is
the row's last token; the text keeps the stop string and is cut right after it), or ``max_new_tokens`` (one
limit for all rows, or one per row). A finished row's blocks go back at once. Sampling noise is keyed by
(seed, row, step), so the result does not depend on the KV budget or on which rows share a step; ``row_keys``
names the rows for it otherwise than by their index in the call (an evaluation keys each sample by its index in the
eval set, so that any split of the set over calls and ranks draws the same samples).

Behaviour logprobs are the chosen tokens' log probabilities under the temperature-scaled FULL softmax (top-k /
top-p / min-p only restrict which token may be drawn), i.e. what the trainer recomputes: a distribution
renormalised over the allowed tokens would bias the importance ratio. At temperature 0 (greedy) they are
under the unscaled softmax.
"""
from __future__ import annotations

import array
import contextlib
import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

import ops_cuda
from framework.allocator import release_cached, to_device
from framework.errors import FwError
from framework.models.modes import eval_mode
from framework.models.qwen3 import FlashPrefill, PagedBatch
from framework.rollout.block_manager import BlockManager
from framework.rollout.kv_cache import (
    CacheSettings,
    DecodeGraph,
    batch_bucket,
    compute_dtype,
    decode_step,
    first_decode_step,
    fp8_cuda_problem,
    pool_blocks,
    pool_dtype,
)
from framework.rollout.sampling import SamplingParams, draw
from framework.rollout.scheduler import RowState, Scheduler, check_rows_fit
from framework.rollout.timeline import Timeline
from framework.tokenizer import TURN_END

FINISH_REASONS = ("eos", "stop", "length")
_MASK63 = (1 << 63) - 1


@dataclass
class Rollout:
    """The result of ``generate`` for B prompts (tensors on the model's device)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    tokens: Tensor            # LongTensor [B, T]: prompt + completion, right-padded with the pad id
    prompt_lens: Tensor       # LongTensor [B]
    completion_lens: Tensor   # LongTensor [B]
    logprobs: Tensor          # float32 [B, Tc]: behaviour logprob of completion token j, 0 past the end
    finish_reasons: list[str]  # "eos" | "stop" | "length"
    texts: list[str]          # decoded completions ([] when generate got no tokenizer)
    policy_version: int

    @property
    def completion_mask(self) -> Tensor:
        """bool [B, Tc]: True at real completion tokens (aligned with ``logprobs``)."""
        steps = torch.arange(self.logprobs.shape[1], device=self.logprobs.device)
        return steps[None, :] < self.completion_lens[:, None]


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """The tokenizer's EOS, the chat template's turn end and the model's own: config.json's eos_token_id and its
    generation_config.json's (one id or a list each; Qwen3's releases name <|endoftext|> in the second only, as
    transformers' `generate` reads it). A row ends on any of them. The turn end counts because it closes every
    assistant turn the template renders, also under a base checkpoint, whose tokenizer and config name only
    <|endoftext|>."""
    generation = getattr(model, "generation_config", None) or {}
    ids = [i for eos in (model.config.eos_token_id, generation.get("eos_token_id"))
           for i in (eos if isinstance(eos, list) else [eos])]
    return sorted({tokenizer.eos_id, tokenizer.token_to_id(TURN_END), *ids} - {None})


def step_seed(seed: int, step: int) -> int:
    """The sampler seed of decode step ``step``: distinct per step, a pure function of (seed, step)."""
    # splitmix64-style mixing, kept below 2**63 so it fits the op's int64 seed argument.
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 31)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 29)) & _MASK63


def context_positions(rows: list[RowState], tables: Tensor, block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(blocks [Nk], offsets [Nk], cu [R + 1]) of every context position 0..context - 1 of `rows`, row after row,
    in a pool whose block tables (host, indexed by row id) are `tables`."""
    counts = torch.tensor([s.context for s in rows], dtype=torch.long)
    cu = torch.zeros(len(rows) + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=cu[1:])
    owner = torch.repeat_interleave(torch.tensor([s.row for s in rows], dtype=torch.long), counts)
    pos = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], counts)
    return tables[owner, pos // block_size], pos % block_size, cu


def shared_decode() -> bool:
    """Whether a call whose prompts repeat decodes with packs (FW_DECODE_SHARED=0 turns it off, to compare)."""
    return os.environ.get("FW_DECODE_SHARED", "1") != "0"


def longest_first() -> bool:
    """Whether a CUDA decode step orders its rows by context length, longest first (FW_DECODE_ORDER=admission keeps
    the scheduler's order, to compare)."""
    return os.environ.get("FW_DECODE_ORDER", "longest") != "admission"


def decode_packs(rows: list[RowState], block_size: int) -> tuple[list[RowState], list[tuple[int, int, int]]]:
    """The decode batch's order and each row's pack (first row, rows, shared positions), as
    ops_cuda.paged_decode_attention takes them: rows whose full prompt blocks are the same blocks of the pool (a
    group's samples) are consecutive and one pack. A row's shared positions are its prompt's full blocks, whatever
    its pack."""
    def shared_blocks(s: RowState) -> list[int]:
        return s.blocks[:len(s.prompt) // block_size]

    ordered = sorted(rows, key=lambda s: (shared_blocks(s), s.row))
    packs: list[tuple[int, int, int]] = []
    for head, members in itertools.groupby(ordered, key=shared_blocks):
        n = len(list(members))
        for size in [n] if head else [1] * n:   # rows without a full prompt block share nothing
            packs += [(len(packs), size, len(head) * block_size)] * size
    return ordered, packs


def row_states(prompts: list[list[int]], params: SamplingParams) -> list[RowState]:
    """The rows of a `generate` call over `prompts`, each with its limit."""
    limits = params.row_limits(len(prompts)) or [params.longest] * len(prompts)
    return [RowState(row=b, prompt=list(map(int, p)), limit=n) for b, (p, n) in enumerate(zip(prompts, limits))]


def check_fresh_pool(rows: list[RowState], settings: CacheSettings, config: Any, weights: torch.dtype,
                     device: torch.device) -> None:
    """Refuse `rows` (`row_states`) as `generate`'s fresh engine does once its pool is made, before any model is:
    from the model's `config` (its shapes) and its `weights`' dtype, under the caller's autocast state. Where the
    budget is what the GPU has free (kv_cache_gib null), the memory free now bounds the pool the engine makes once
    the weights are there: a row refused here is refused there too."""
    dtype = pool_dtype(settings.kv_cache_dtype, compute_dtype(device, weights))
    check_rows_fit(rows, settings.block_size, pool_blocks(settings, config, dtype, device, rows))


def _check_prompts(prompts: list[list[int]], params: SamplingParams, tokenizer: Any, vocab_size: int,
                   row_keys: Sequence[int] | None = None) -> None:
    if not prompts:
        raise FwError("generate: no prompts")
    if row_keys is not None:
        if len(row_keys) != len(prompts):
            raise FwError(f"generate: {len(row_keys)} row keys for {len(prompts)} prompts")
        if not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 2**63 for k in row_keys):
            raise FwError("generate: row keys must be ints in [0, 2**63)")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise FwError(f"generate: prompt {i} is empty (a prompt needs at least one token)")
        # an id past the embedding fails deep inside it on CPU, and poisons the CUDA context on a GPU
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= vocab_size:
            raise FwError(f"generate: prompt {i} holds token id {int(lo if lo < 0 else hi)}, outside the model's "
                          f"vocabulary [0, {vocab_size})")
    if params.stop and tokenizer is None:
        raise FwError("generate: stop strings need a tokenizer to decode the completions")


def _find_stop(text: str, stop: Sequence[str]) -> int | None:
    """End offset of the earliest-ending first occurrence of a stop string in ``text``, or None."""
    ends = [i + len(s) for s in stop if (i := text.find(s)) != -1]
    return min(ends) if ends else None


class RolloutEngine:
    """The paged KV cache of one model, its block bookkeeping and its decode graphs, kept across calls.

    The pool is allocated on the first call, sized by `settings` (and by what that call can use at most); a
    later call that could use more blocks grows it, within the budget.
    `release()` hands the pool, the graphs and the weights' copies (`_weight_casts`) back.
    """

    def __init__(self, model: Any, settings: CacheSettings | None = None, cuda_graph: bool = True) -> None:
        self.model = model
        self.settings = settings or CacheSettings.from_config(None)
        self.cuda_graph = cuda_graph
        self.cache = None
        self.blocks: BlockManager | None = None
        self.graphs: dict[tuple, DecodeGraph] = {}
        self.warm: set[tuple] = set()
        self.graph_pool = None
        # under autocast: the matmul weights' copies in the compute dtype, refreshed at each call, which the
        # graphs read (PagedBatch.casts); `graph_casts` is the dict the graphs were captured with
        self.casts: dict[Tensor, Tensor] | None = None
        self.graph_casts: dict[Tensor, Tensor] | None = None
        # the autocast state (on, dtype) the graphs were captured under: a call under another one drops them
        self.graph_region: tuple[bool, torch.dtype] | None = None
        self.prefill_tokens = 0     # context tokens computed by prefill (all calls): group sharing shows here
        self.peak_rows = 0          # most rows decoding together (all calls)
        self.preemptions = 0        # rows preempted for want of a block, to be recomputed (all calls)
        self.timeline: Timeline | None = None   # set one to time every step of later calls

    def release(self) -> None:
        """Drop the pool, the graphs and their memory."""
        device = self.model.lm_head_weight.device
        self.cache, self.blocks, self.casts = None, None, None
        self._drop_graphs()
        release_cached(device)

    def _drop_graphs(self) -> None:
        """Forget the decode graphs and their pool: the allocator frees a pool whose graphs are all gone,
        so the next capture takes a new one."""
        self.graphs.clear()
        self.warm.clear()
        self.graph_pool = None
        self.graph_casts = None
        self.graph_region = None

    def _mark(self, part: str) -> None:
        if self.timeline is not None:
            self.timeline.host(part)

    def _weight_casts(self, weights: list[Tensor] | None, dtype: torch.dtype) -> dict[Tensor, Tensor] | None:
        """Under autocast to `dtype`: the copies of the model's matmul `weights` (`paged_matmul_weights`) in `dtype`,
        made at the first call and refreshed in place at each later one (the weights change between rollouts, the
        copies' memory does not), or None where autocast's own casts serve (adapters wrap a projection: `weights` is
        None) or no weight needs a cast."""
        if weights is None or all(w.dtype == dtype for w in weights):
            self.casts = None
            return None
        old = self.casts
        if (old is None or len(old) != len(weights) or any(a is not b for a, b in zip(old, weights))
                or any(c.dtype != dtype for c in old.values())):
            self._drop_graphs()   # they read the old copies, whose memory goes before the new ones are made
            self.casts = None
            self.casts = {w: torch.empty_like(w, dtype=dtype) for w in weights}
        torch._foreach_copy_(list(self.casts.values()), weights)
        return self.casts

    def _ensure_cache(self, seqs: list[RowState], compute: torch.dtype, device: torch.device) -> None:
        c = self.model.config
        bs = self.settings.block_size
        dtype = pool_dtype(self.settings.kv_cache_dtype, compute)
        if dtype == torch.float8_e4m3fn and device.type == "cuda":
            problem = fp8_cuda_problem(compute, c)
            if problem:
                raise FwError(f"rollout.kv_cache_dtype: {problem}")
        n = pool_blocks(self.settings, c, dtype, device, seqs)
        # a pool smaller than this call could use grows (the graphs read the old one, so they go too)
        if self.cache is None or self.cache.k.dtype != dtype or self.cache.num_blocks < n:
            self._drop_graphs()
            if self.cache is not None:
                self.cache = None
                release_cached(device)
            n = pool_blocks(self.settings, c, dtype, device, seqs)   # with the old pool's memory free again
            self.cache = self.model.new_paged_kv_cache(n, bs, device=device, dtype=dtype)
        # fresh bookkeeping every call: the weights may have changed since, so no cached prefix carries over
        self.blocks = BlockManager(self.cache.num_blocks, bs)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, *, eos_ids: Sequence[int] = (),
                 tokenizer: Any = None, seed: int = 0, policy_version: int = 0,
                 row_keys: Sequence[int] | None = None) -> Rollout:
        """Sample completions of ``prompts`` (token id lists) as ``params`` says; see `generate`."""
        if self.timeline is not None:
            self.timeline.enter()
        model = self.model
        _check_prompts(prompts, params, tokenizer, model.config.vocab_size, row_keys)
        device = model.lm_head_weight.device
        seqs = row_states(prompts, params)
        pad_id = tokenizer.pad_id if tokenizer is not None and tokenizer.pad_id is not None else 0
        autocast = torch.is_autocast_enabled(device.type)
        # Under autocast (e.g. Lightning's bf16-mixed) keys/values come out in the autocast dtype: the cache
        # takes it, as the computation that fills it does, unless rollout.kv_cache_dtype rounds them to float8.
        dtype = compute_dtype(device, model.lm_head_weight.dtype)
        # Under autocast the matmuls read the engine's copies of the weights in the compute dtype, refreshed at each
        # call (`_weight_casts`), so that the decode graphs captured in one call replay in the next ones, reading the
        # same copies. Where adapters wrap a projection, autocast's casts serve instead, cached for the call whatever
        # the caller's region says (Lightning's turns the cache off): the graphs captured after a bucket's first step
        # read those casts instead of casting every weight again at each replay, and go at the end of the call.
        # Weights already in the compute dtype need no cast: the graphs read the weights themselves, as without
        # autocast, and stay valid across calls.
        region = torch.autocast(device.type, dtype, cache_enabled=True) if autocast else contextlib.nullcontext()
        weights = model.paged_matmul_weights() if autocast else None
        per_call = autocast and weights is None   # the graphs read this call's casts
        try:
            with region, eval_mode(model):
                casts = self._weight_casts(weights, dtype) if autocast else None
                self._mark("weight copies")
                self._ensure_cache(seqs, dtype, device)
                self._mark("pool")
                # the graphs read other copies (or the weights themselves), or ran their kernels under another
                # autocast state: in and out dtypes of the ops autocast routes
                if casts is not self.graph_casts or self.graph_region != (autocast, dtype):
                    self._drop_graphs()
                self.graph_casts, self.graph_region = casts, (autocast, dtype)
                _Run(self, seqs, params, {int(e) for e in eos_ids}, tokenizer, seed, device, casts, row_keys).run()
                self._mark("drain")   # the last steps' tokens read back
        finally:
            if per_call:   # autocast's casts, made anew by the next call
                self._drop_graphs()
            if autocast:
                torch.clear_autocast_cache()   # the enclosing region keeps its cache otherwise
        self._mark("restore")
        with record_function("fw.rollout.result"):
            result = _result(seqs, prompts, pad_id, tokenizer, params.stop, device, policy_version)
        if self.timeline is not None:
            self.timeline.exit()
        return result


@dataclass
class _Issued:
    """Sampled tokens on their way to the host: tokens and logprobs of `rows`, in that order."""

    rows: list[RowState]
    out: Tensor        # float64 [2, B] on the host (pinned and filled asynchronously on CUDA)
    ready: Any         # the CUDA event after the copy; None on CPU


class _Run:
    """One `generate` call on an engine: admission, prefill, decode steps and stopping.

    The host runs one step behind the device: it queues a step's forward and sampling, then reads the
    previous step's tokens (ready by then) to stop rows and admit others, while the device computes. A row
    that ends on EOS or a stop string therefore runs one step more, whose token is dropped; a row at its
    limit is never queued past it, since the host counts the tokens it has queued. The fed tokens stay on
    the device, and what the host sends it goes through pinned memory without waiting for the device.

    Blocks are allocated as rows grow (framework/rollout/scheduler.py): before a decode step is queued, the
    rows whose write crosses into a new block get it, or rows are preempted. A preempted row's tokens in
    flight are kept (their steps were queued before its blocks went back, and the device runs queued work in
    order), so nothing is recomputed but its context's keys/values; readmitted, its next token is drawn from the
    prefill's logits with the (row, step) key its decode step would have had. The device's block tables
    learn only what changed: the admitted rows' table rows with the prefill's inputs, the new entries with
    the decode step's, in the same transfers.
    """

    def __init__(self, engine: RolloutEngine, seqs: list[RowState], params: SamplingParams, eos: set[int],
                 tokenizer: Any, seed: int, device: torch.device, casts: dict[Tensor, Tensor] | None,
                 row_keys: Sequence[int] | None = None) -> None:
        self.e, self.seqs, self.params, self.eos, self.tok = engine, seqs, params, eos, tokenizer
        self.casts = casts
        self.device = device
        self.key = step_seed(seed, 0)
        # the sampler's row ids, by row index (the last one a padding row's); None: the index itself
        self.keys_dev = (None if row_keys is None else
                         torch.tensor([*row_keys, 0], dtype=torch.long).to(device, non_blocking=True))
        self.bs = engine.settings.block_size
        longest = max(len(s.prompt) + s.limit for s in seqs)
        # block-table width: a power of two, so that calls of similar lengths share their decode graphs
        self.width = 1 << max(0, (-(-longest // self.bs) - 1).bit_length())
        self.sched = Scheduler(seqs, engine.blocks, engine.settings.max_num_seqs, engine.settings.admit_batch)
        self.cpu = device.type == "cpu"
        # every row's block table, written at admission and extended on the device as the row grows; the last
        # row, all scratch, serves the padding rows of a batch. On CPU the device's table is the host's itself.
        self.tables = torch.zeros(len(seqs) + 1, self.width, dtype=torch.long)
        self.tables_dev = self.tables if self.cpu else torch.zeros_like(self.tables, device=device)
        self.last_dev = torch.zeros(len(seqs) + 1, dtype=torch.long, device=device)   # each row's last token
        # the tokens whose text the stop check decodes: a stop string of n characters is at most 4n UTF-8 bytes,
        # at least one a token; 4 more keep the window's first tokens, which decode differently alone (a
        # character cut, a leading space dropped), off the stop string
        self.window = 4 * max(map(len, params.stop), default=0) + 4
        # a call whose prompts repeat (a group's samples) decodes with packs, whose rows read their shared prompt
        # blocks once
        self.share = shared_decode() and len({tuple(s.prompt) for s in seqs}) < len(seqs)
        self.packed: tuple[tuple[int, ...], list[RowState], list[tuple[int, int, int]]] = ((), [], [])
        # elsewhere a CUDA step's rows go longest context first (`_decode`); the CPU's attention has no such order
        self.longest_first = not self.share and not self.cpu and longest_first()

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self.e.preemptions += self.sched.preemptions

    def _loop(self) -> None:
        pending: list[_Issued] = []
        while True:
            issued = []
            new = self.sched.admit()
            if new:
                with record_function("fw.rollout.prefill"):
                    issued.append(self._prefill(new))
            rows = [s for s in self.sched.running if s.issued < s.limit]
            if rows:
                with record_function("fw.rollout.decode"):
                    rows, changed = self.sched.grow(rows)
                    if rows:
                        issued.append(self._decode(rows, changed))
            self.e.peak_rows = max(self.e.peak_rows, len(self.sched.running))
            received = bool(pending)
            with record_function("fw.rollout.receive"):
                for record in pending:
                    self._receive(record)
            pending = issued
            if not pending and self.sched.done:
                return
            if not pending and not received:   # cannot happen: a row always fits an empty pool (Scheduler checks)
                raise FwError("rollout: the scheduler stalled with rows waiting and none running")

    # ---- prefill
    def _prefill(self, new: list[RowState]) -> _Issued:
        """Prefill the admitted rows' contexts (prompt, and the tokens a preempted row produced) past what
        they share or found cached, and draw each one's next token."""
        for s in new:
            if s.tokens:   # readmitted: its old table row goes
                self.tables[s.row].zero_()
            self.tables[s.row, :len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.long)
        computed = [s for s in new if s.leader is None]
        tokens, positions, cu = [], [], [0]
        for s in computed:
            tokens += (s.prompt + s.tokens)[s.cached:]
            positions += range(s.cached, s.context)
            cu.append(len(tokens))
        self.e.prefill_tokens += len(tokens)
        n_real = len(tokens)
        # CPU: token and row counts padded to multiples of 16, where the BLAS runs one kernel whatever the
        # count, so that a row's numbers do not depend on which rows share its batch
        n = -(-n_real // 16) * 16 if self.cpu else n_real
        tokens += [0] * (n - n_real)
        positions += [0] * (n - n_real)
        pos = torch.tensor(positions, dtype=torch.long)
        rows = torch.tensor([s.row for s in computed], dtype=torch.long)
        owner = torch.repeat_interleave(torch.arange(len(computed)), torch.tensor([s.context - s.cached
                                                                                   for s in computed]))
        owner_rows = torch.cat([rows[owner], torch.full((n - n_real,), len(self.seqs), dtype=torch.long)])
        blk = self.tables[owner_rows, pos // self.bs]
        last = torch.tensor(cu[1:], dtype=torch.long) - 1
        r_pad = -(-len(computed) // 16) * 16 if self.cpu else len(computed)
        last = torch.cat([last, last[:1].expand(r_pad - len(computed))])
        index = {id(s): i for i, s in enumerate(computed)}
        pick = [index[id(s.leader if s.leader is not None else s)] for s in new]
        # one transfer for the integer inputs: tokens, positions, write blocks, offsets | rows, lengths |
        # logits rows | picks | (CUDA) the admitted rows and their table rows
        parts = [torch.tensor(tokens, dtype=torch.long), pos, blk, pos % self.bs, rows,
                 torch.tensor([s.context for s in computed], dtype=torch.long), last,
                 torch.tensor(pick, dtype=torch.long)]
        # a group's followers copy their leader's partial last block once the prefill has written it
        copies = [(s.blocks[s.context // self.bs], s.leader.blocks[s.context // self.bs]) for s in new
                  if s.leader is not None and s.context % self.bs]
        sizes = [n, n, n, n, len(computed), len(computed), r_pad, len(new), len(cu), 2 * len(copies)]
        parts += [torch.tensor(cu, dtype=torch.long),
                  torch.tensor([d for d, _ in copies] + [s for _, s in copies], dtype=torch.long)]
        fresh = all(s.cached == 0 for s in computed)
        if not self.cpu:
            new_rows = torch.tensor([s.row for s in new], dtype=torch.long)
            parts += [new_rows, self.tables[new_rows].flatten()]
            sizes += [len(new), len(new) * self.width]
            if not fresh:   # flash attention reads each row's whole context, gathered from the pools
                ctx_blocks, ctx_offsets, cu_k = context_positions(computed, self.tables, self.bs)
                parts += [cu_k, ctx_blocks, ctx_offsets]
                sizes += [len(cu_k), len(ctx_blocks), len(ctx_blocks)]
        if self.e.timeline is not None:
            self.e.timeline.begin("prefill", len(new), n_real, n)
        tok_d, pos_d, blk_d, off_d, rows_d, len_d, last_d, pick_d, cu_d, copy_d, *cuda_d = to_device(
            torch.cat(parts), self.device).split(sizes)
        flash = None
        if cuda_d:   # CUDA only: the CPU pads the tokens, and keeps one attention path for exactness
            self.tables_dev.index_copy_(0, cuda_d[0], cuda_d[1].view(len(new), self.width))
            cu_q = cu_d.int()
            max_q = max(s.context - s.cached for s in computed)
            max_k = max(s.context for s in computed)
            flash = (FlashPrefill(cu_q, max_q, cu_q, max_k) if fresh
                     else FlashPrefill(cu_q, max_q, cuda_d[2].int(), max_k, cuda_d[3], cuda_d[4]))
        batch = PagedBatch(positions=pos_d, write_blocks=blk_d, write_offsets=off_d,
                           block_tables=self.tables_dev[rows_d], lengths=len_d, cu_seqlens=cu_d, flash=flash,
                           casts=self.casts)
        logits = self.e.model.forward_paged(tok_d, batch, self.e.cache, last_d)
        if copies:
            dst, src = copy_d.view(2, -1)
            cache = self.e.cache
            cache.k[:, dst] = cache.k[:, src]
            cache.v[:, dst] = cache.v[:, src]
        for s in new:
            s.leader = None
        meta = to_device(torch.tensor([[s.row, s.issued] for s in new], dtype=torch.long), self.device)
        return self._sample(new, logits[pick_d], meta)

    # ---- decode
    def _decode(self, rows: list[RowState], changed: list[tuple[int, int, int]]) -> _Issued:
        """Queue one decode step of `rows`; `changed` are the block-table entries (row, index, block) their
        new blocks filled in."""
        B = len(rows)
        bucket = batch_bucket(B, self.e.settings.max_num_seqs, self.cpu)
        # per row: its id, the tokens queued so far (the sampler's counter), the fed token's position (and its pack);
        # then the new table entries, in the same transfer
        packs: list[tuple[int, ...]] = [()] * bucket
        if self.share:
            # the order holds while the batch keeps its rows and no row was preempted: a row's blocks change only
            # when a preemption takes them and a readmission gives it others
            ident = (self.sched.preemptions, *map(id, rows))
            if ident != self.packed[0]:
                self.packed = (ident, *decode_packs(rows, self.bs))
            _, rows, packs = self.packed
            packs = packs + [(i, 1, 0) for i in range(B, bucket)]   # padding rows: packs of their own
        elif self.longest_first:
            # the decode attention's blocks start in row order: with the longest contexts first, the short rows'
            # blocks fill in behind them, and a step does not end waiting on a long row whose blocks started last
            rows = sorted(rows, key=lambda s: len(s.prompt) + s.issued, reverse=True)
        blank = [0] * len(packs[0])
        meta = torch.tensor([[s.row, s.issued, len(s.prompt) + s.issued - 1, *p] for s, p in zip(rows, packs)]
                            + [[len(self.seqs), 0, 0, *p] for p in packs[B:]]
                            + [[*c, *blank] for c in changed], dtype=torch.long)
        if self.e.timeline is not None:
            self.e.timeline.begin("decode", B, sum(len(s.prompt) + s.issued for s in rows), bucket)
        meta = to_device(meta, self.device)
        if changed:   # on CUDA the host's table keeps its admission rows: only a prefill reads it, for new rows
            entries = meta[bucket:]
            self.tables_dev[entries[:, 0], entries[:, 1]] = entries[:, 2]
        meta = meta[:bucket]
        ids = meta[:, 0]
        inputs = torch.cat([self.last_dev[ids, None], meta[:, 2:]], 1)
        tables = self.tables_dev[ids]
        key = (bucket, self.width, self.share)
        graphed = (self.e.cuda_graph and not self.cpu and ops_cuda.cuda_backend() == "kernels")
        if graphed and key in self.e.graphs:
            logits = self.e.graphs[key](inputs, tables)
        elif graphed and key in self.e.warm:
            if self.e.graph_pool is None:
                self.e.graph_pool = torch.cuda.graph_pool_handle()
            t = time.perf_counter()
            with record_function("fw.rollout.capture"):
                graph = DecodeGraph(self.e.model, self.e.cache, inputs, tables, self.e.graph_pool, self.casts)
            if self.e.timeline is not None:
                self.e.timeline.captured += time.perf_counter() - t
                self.e.timeline.captures += 1
            self.e.graphs[key] = graph
            logits = graph(inputs, tables)
        else:
            # the first step of a bucket runs eagerly, with graphs on the stream that captures: it does the lazy
            # set-up (cuBLAS handles and workspace, the decode-attention counters, autocast's casts) that a
            # capture must not record
            step = first_decode_step if graphed else decode_step
            logits = step(self.e.model, self.e.cache, inputs, tables, self.casts)
            self.e.warm.add(key)
        return self._sample(rows, logits[:B], meta[:B])

    # ---- sampling and stopping
    def _sample(self, rows: list[RowState], logits: Tensor, meta: Tensor) -> _Issued:
        """Draw the next token of `rows` (meta [B, >=2] on the device: row id, tokens queued) and queue its
        copy to the host; the drawn tokens are the rows' next fed tokens."""
        timeline = self.e.timeline
        if timeline is not None:
            timeline.forward_done()
        counters = meta[:, :2] if self.keys_dev is None else torch.stack([self.keys_dev[meta[:, 0]], meta[:, 1]], 1)
        tokens, logprobs = draw(logits, self.params, self.key, counters)
        self.last_dev.index_copy_(0, meta[:, 0], tokens)
        for s in rows:
            s.issued += 1
        out = torch.stack([tokens.double(), logprobs.double()])
        if self.cpu:
            record = _Issued(rows, out, None)
        else:
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            record = _Issued(rows, host, ready)
        if timeline is not None:
            timeline.end()
        return record

    def _receive(self, record: _Issued) -> None:
        """Append a queued step's tokens to their rows and stop the rows that are done."""
        if record.ready is not None:
            t = time.perf_counter()
            record.ready.synchronize()
            if self.e.timeline is not None:
                self.e.timeline.waited += time.perf_counter() - t
        out = record.out.tolist()
        stop = self.params.stop
        for s, token, logprob in zip(record.rows, out[0], out[1]):
            if s.reason is not None:   # ended at the step before: this token lies past its end
                continue
            s.tokens.append(int(token))
            s.logprobs.append(logprob)
            if int(token) in self.eos:
                self.sched.finish(s, "eos")
            elif stop and any(x in self.tok.decode(s.tokens[-self.window:]) for x in stop):
                self.sched.finish(s, "stop")
            elif len(s.tokens) >= s.limit:
                self.sched.finish(s, "length")


# the array typecodes whose C values are the tensor dtype's, so that the buffer becomes the tensor as it is
_TYPECODES = {torch.long: "q", torch.float32: "f", torch.float64: "d"}


def padded_rows(rows: list[list], pad: float, dtype: torch.dtype) -> Tensor:
    """Python rows of ints (int64 ``dtype``) or floats (each rounded once from its float64 to ``dtype``) laid
    left-aligned into one [len(rows), longest] tensor, ``pad`` after each row's end. The rows and their pads go
    into one C array, which the tensor then shares: no torch kernel runs on the CPU, so none waits on a pool of
    threads that other work on the host keeps busy (the index_copy_ this replaces did, inside training runs)."""
    held = dtype if dtype in _TYPECODES else torch.float64   # the array's dtype; other dtypes round from it
    width = max(map(len, rows), default=0)
    flat = array.array(_TYPECODES[held])
    fill = array.array(_TYPECODES[held], [pad]) * width
    for r in rows:
        flat.fromlist(r)
        flat.extend(fill[:width - len(r)])
    if not flat:
        return torch.full((len(rows), width), pad, dtype=dtype)
    return torch.frombuffer(flat, dtype=held).view(len(rows), width).to(dtype)


def _result(seqs: list[RowState], prompts: list[list[int]], pad_id: int, tokenizer: Any, stop: tuple[str, ...],
            device: torch.device, policy_version: int) -> Rollout:
    lens = [len(s.tokens) for s in seqs]
    reasons = [s.reason for s in seqs]
    completion_ids = [s.tokens for s in seqs]
    texts = []
    if tokenizer is not None:
        for s in seqs:
            text = tokenizer.decode(s.tokens[:-1] if s.reason == "eos" else s.tokens)
            texts.append(text[:_find_stop(text, stop)] if s.reason == "stop" else text)
    seq = padded_rows([s.prompt + s.tokens for s in seqs], pad_id, torch.long)
    logprobs = padded_rows([s.logprobs for s in seqs], 0.0, torch.float32)
    n_tokens = torch.tensor(lens)
    return Rollout(
        prompt_ids=[list(map(int, p)) for p in prompts], completion_ids=completion_ids,
        tokens=seq.to(device), prompt_lens=torch.tensor([len(p) for p in prompts], device=device),
        completion_lens=n_tokens.to(device), logprobs=logprobs.to(device),
        finish_reasons=reasons, texts=texts, policy_version=int(policy_version))


def generate(model: Any, prompts: list[list[int]], params: SamplingParams, *, eos_ids: Sequence[int] = (),
             tokenizer: Any = None, seed: int = 0, policy_version: int = 0, cuda_graph: bool = True,
             cache: CacheSettings | None = None, row_keys: Sequence[int] | None = None) -> Rollout:
    """Sample completions of ``prompts`` (token id lists) as ``params`` says, on a fresh engine.

    Same (model, prompts, params, seed) give the same tokens, whatever the KV budget (``cache``: the `rollout`
    section's kv_cache_gib, max_num_seqs, block_size, admit_batch and kv_cache_dtype; the schema's defaults when
    None). Of these only kv_cache_dtype changes the tokens: float8_e4m3 rounds the keys and values to e4m3.
    ``tokenizer`` (for ``texts``, stop strings and the pad id; pad id 0 without one) is optional. The model
    runs in eval mode and gets its previous mode back. ``cuda_graph=False`` runs every CUDA decode step
    eagerly (same tokens). The KV pool and the graphs go back before this returns. ``row_keys`` (ints in
    [0, 2**63), one a prompt) key each row's sampling noise instead of its index: rows of equal prompt and key draw
    the same tokens in any call of the same seed, wherever the model's outputs for a row do not depend on the
    other rows of its steps (fp32 on CPU; on a GPU the kernels of other batch sizes round otherwise).
    """
    engine = RolloutEngine(model, cache, cuda_graph=cuda_graph)
    try:
        return engine.generate(prompts, params, eos_ids=eos_ids, tokenizer=tokenizer, seed=seed,
                               policy_version=policy_version, row_keys=row_keys)
    finally:
        engine.release()
