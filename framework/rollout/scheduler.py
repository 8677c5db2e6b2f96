"""Continuous batching: which rows run, which wait, and the blocks each one holds.

Lazy allocation: a row is admitted in the order of the waiting queue (the longest limit first, rows of equal
limits in their given order), while the batch has fewer than `max_num_seqs` rows and the pool has the blocks of
its context (prompt, plus the tokens it produced before a preemption) and of the position its first sampled token
is written at, with blocks to spare for the running rows' next writes, so that an admission does not at once
preempt a running row: `watermark`, 5% of the pool (at least one block), or what the running rows and the row
itself can still take at most (`outstanding` and its own rest) when that is less. A pool that holds every row's
prompt and limit thus admits as many rows at once as reserving them would. While `admit_batch` rows or more run
(rollout.admit_batch), waiting rows join only once that many of them fit at once: each prefill stalls the running
rows while the host launches it, eagerly and for about as long at 100 tokens as at 5,000, so fewer and larger
prefills cost less (`python -m benchmarks.rollout_schedule --admit-batches 1 8` counts them). Each later block is
allocated by `grow` when the host queues the decode step whose KV write crosses into it. A finished row gives its
blocks back at once, and the waiting rows they make room for join the batch at the next step.

Preemption by recomputation: when a running row needs a block and none is free, the most recently admitted
running row is preempted: its blocks go back (one reference each: blocks shared with its group and cached
prefix blocks stay valid for the others; its own full blocks are hashed, so that its readmission finds them
in the prefix cache while nobody has taken them) and it goes to the front of the waiting queue with the
tokens and logprobs it has produced. Readmitted, it is prefilled over its prompt and those tokens and goes
on. A preempted row may still have tokens on their way to the host (the host runs a step behind the device:
one, or two when the row was admitted at the step before): they were queued on the device before its
blocks went back, so they are computed from its intact context, and they are kept. The row is received as
any other (`finish` takes it out of the waiting queue when such a token ends it) and is not readmitted
while a token of it is in flight.

No deadlock: one row's every block fits the pool (checked up front), a batch of fewer than `admit_batch` rows
admits rows as soon as they fit, an empty batch admits its first waiting row whatever the watermark (or at the
next step, once its tokens in flight are in), and the oldest running row always gets its next block: while none is
free, rows admitted after it are preempted (the newest first), and once it runs alone every block it does not hold
is free. It never preempts itself, so it finishes, and so does every row after it.

Prompt sharing: rows admitted together with the same context form a group whose first row (the leader) is
prefilled; the others reference the leader's full blocks, get a copy of its last, partial block and its
last-token logits, and compute nothing. Across groups and steps, full blocks are found by their prefix hash
(framework/rollout/block_manager.py), so only the rest of such a context is prefilled.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from framework.errors import FwError
from framework.rollout.block_manager import BlockManager, block_hashes

# Of the pool kept free at admission while rows run, at least 1 block. A preempted row is recomputed by an eager
# prefill, which leaves the GPU idle while the host launches it: a wider margin than vLLM's 1% preempts and
# prefills less often for about as many rows a step (`python -m benchmarks.rollout_schedule` counts both).
WATERMARK_FRACTION = 0.05


@dataclass(eq=False)
class RowState:
    """One row of a `generate` call: its prompt, its limit, its blocks and what it has produced so far."""

    row: int
    prompt: list[int]
    limit: int
    blocks: list[int] = field(default_factory=list)   # empty exactly when the row is not running
    room: int = 0                   # decode steps its blocks take: it may issue tokens up to this count
    cached: int = 0                 # context tokens whose keys/values it did not compute itself
    hashes: list[bytes] = field(default_factory=list)   # prefix hashes of its full blocks computed so far
    leader: RowState | None = None  # same context, prefilled in the same step: logits and tail block come from it
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: str | None = None       # finish reason once finished
    issued: int = 0                 # tokens sampled on the device, whether or not the host has them yet

    @property
    def context(self) -> int:
        """Positions whose keys/values are in the cache once the last sampled token is fed."""
        return len(self.prompt) + len(self.tokens)


def blocks_for(prompt_len: int, limit: int, block_size: int) -> int:
    """Blocks a row may ever use: every prompt token and every sampled token but the last is written."""
    return -(-(prompt_len + limit - 1) // block_size)


class RowTooLong(FwError):
    """A row that needs more KV blocks than the whole pool holds. `limit_key` is the setting its new-token limit
    came from (`for_key` names another, e.g. an evaluation's own limit). Where the prompt alone does not fit, no
    limit helps, and the message asks for a larger budget only."""

    def __init__(self, prompt_len: int, limit: int, need: int, block_size: int, holds: int,
                 limit_key: str = "rollout.max_new_tokens") -> None:
        self.counts = (prompt_len, limit, need, block_size, holds)
        head = (f"rollout: one row of {prompt_len} prompt + {limit} new tokens needs {need} KV blocks of {block_size} "
                f"positions, the cache holds {holds}")
        if blocks_for(prompt_len, 1, block_size) > holds:
            super().__init__(f"{head}, and not even its prompt fits, whatever {limit_key}: raise rollout.kv_cache_gib")
        else:
            super().__init__(f"{head}: raise rollout.kv_cache_gib or lower {limit_key}")

    def for_key(self, limit_key: str) -> RowTooLong:
        return RowTooLong(*self.counts, limit_key=limit_key)


def check_rows_fit(rows: Sequence[RowState], block_size: int, num_blocks: int) -> None:
    """RowTooLong when the row of `rows` that needs the most blocks does not fit a pool of `num_blocks` (the
    scratch block included): every row must fit alone, or none could ever finish. A row whose prompt alone does
    not fit is named first: a lower limit of the row that needs the most would not make the call fit."""
    longest = max(rows, key=lambda s: len(s.prompt))
    if blocks_for(len(longest.prompt), 1, block_size) > num_blocks - 1:
        worst = longest
    else:
        worst = max(rows, key=lambda s: blocks_for(len(s.prompt), s.limit, block_size))
    need = blocks_for(len(worst.prompt), worst.limit, block_size)
    if need > num_blocks - 1:
        raise RowTooLong(len(worst.prompt), worst.limit, need, block_size, num_blocks - 1)


def admission_blocks(seq: RowState, block_size: int) -> int:
    """Blocks a row takes when admitted: its context and the position its first sampled token is written at,
    unless that token is its last."""
    written = min(seq.context + 1, len(seq.prompt) + seq.limit - 1)
    return -(-written // block_size)


class Scheduler:
    """Waiting and running rows over one `BlockManager`."""

    def __init__(self, seqs: list[RowState], blocks: BlockManager, max_num_seqs: int, admit_batch: int = 1) -> None:
        self.blocks, self.max_num_seqs, self.admit_batch = blocks, max_num_seqs, admit_batch
        # the longest limit first (rows of equal limits in their order): the rows that run last decide how many
        # steps the call takes, with few rows each; started first, long rows overlap the short ones
        self.waiting: deque[RowState] = deque(sorted(seqs, key=lambda s: -s.limit))
        self.running: list[RowState] = []   # in admission order: the last one is preempted first
        self.preemptions = 0
        self.outstanding = 0   # blocks the running rows may still allocate, up to their limits
        self.watermark = max(1, int(WATERMARK_FRACTION * (blocks.num_blocks - 1)))
        check_rows_fit(seqs, blocks.block_size, blocks.num_blocks)

    def admit(self) -> list[RowState]:
        """The waiting rows that join the batch now, in order (their first blocks allocated). While `admit_batch`
        rows or more run, none joins until the next `admit_batch` waiting rows (all of them, when fewer wait) can
        join together; then as many as fit join, so that one prefill takes them."""
        if len(self.running) >= self.admit_batch and not self._fit(min(self.admit_batch, len(self.waiting))):
            return []
        bm, bs = self.blocks, self.blocks.block_size
        new: list[RowState] = []
        leaders: dict[tuple[int, ...], RowState] = {}
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.issued > len(seq.tokens):   # preempted with tokens in flight: readmitted once they are in
                break
            context = tuple(seq.prompt + seq.tokens)
            leader = leaders.get(context)
            total, need, reused = self._claim(seq, leader)
            if bm.num_free < need + self._spare(seq, total, self.outstanding):
                break
            seq.blocks = [bm.take(b) for b in reused] + [bm.allocate() for _ in range(total - len(reused))]
            seq.cached = seq.context if leader is not None else len(reused) * bs
            if leader is not None:
                seq.leader = leader
            else:
                for i in range(len(reused), len(seq.hashes)):
                    bm.register(seq.blocks[i], seq.hashes[i])
                leaders[context] = seq
            seq.room = len(seq.blocks) * bs - len(seq.prompt)
            self.outstanding += blocks_for(len(seq.prompt), seq.limit, bs) - len(seq.blocks)
            self.waiting.popleft()
            self.running.append(seq)
            new.append(seq)
        return new

    def _claim(self, seq: RowState, leader: RowState | None) -> tuple[int, int, list[int]]:
        """(total, need, reused) of admitting `seq` now: the blocks it takes, how many of them come off the free
        list, and the blocks it reuses: its group leader's full blocks (same context, admitted in the same step),
        or else the cached blocks of its prefix, keeping at least one context token to compute the logits from."""
        bm, bs = self.blocks, self.blocks.block_size
        total = admission_blocks(seq, bs)
        if leader is not None:
            reused = leader.blocks[:seq.context // bs]
            return total, total - len(reused), reused
        seq.hashes = block_hashes(seq.prompt + seq.tokens, bs, seq.hashes)
        hits = bm.cached_prefix(seq.hashes[:(seq.context - 1) // bs])
        return total, bm.blocks_needed(hits, total), hits

    def _spare(self, seq: RowState, total: int, outstanding: int) -> int:
        """Free blocks to keep after admitting `seq` with `total` blocks: the watermark, or what the running rows
        (`outstanding`) and `seq` itself may still take, when that is less."""
        return min(self.watermark, outstanding + blocks_for(len(seq.prompt), seq.limit, self.blocks.block_size)
                   - total)

    def _fit(self, count: int) -> bool:
        """Whether the first `count` waiting rows can all be admitted now: `admit`'s arithmetic, nothing allocated.
        As in `admit`, a row reuses the cached blocks of its prefix and the full blocks of the rows walked before it.
        Not simulated: a block an earlier row allocates may evict a free cached block of a later row's prefix, so the
        answer may be yes where `admit` then takes fewer rows (it checks each one itself)."""
        if len(self.running) + count > self.max_num_seqs:
            return False
        bm, bs = self.blocks, self.blocks.block_size
        free, outstanding = bm.num_free, self.outstanding
        leaders: set[tuple[int, ...]] = set()
        registered: set[bytes] = set()   # hashes of the full blocks the rows walked so far would hold
        held: set[int] = set()         # the cached blocks among them
        for seq in itertools.islice(self.waiting, count):
            if seq.issued > len(seq.tokens):
                return False
            context = tuple(seq.prompt + seq.tokens)
            total = admission_blocks(seq, bs)
            if context in leaders:   # its group leader's full blocks
                need = total - seq.context // bs
            else:
                seq.hashes = block_hashes(context, bs, seq.hashes)
                need = total
                for h in seq.hashes[:(seq.context - 1) // bs]:   # the cached run, as `cached_prefix` finds it
                    b = bm.cached.get(h)
                    if (b is None and h in registered) or b in held:   # an earlier row's block: shared
                        need -= 1
                        continue
                    if b is None:
                        break
                    if bm.refs[b]:   # a running row's block: shared; a free cached one comes off the free list
                        need -= 1
                    held.add(b)
                registered.update(seq.hashes)
                leaders.add(context)
            if free < need + self._spare(seq, total, outstanding):
                return False
            free -= need
            outstanding += blocks_for(len(seq.prompt), seq.limit, bs) - total
        return True

    def grow(self, rows: list[RowState]) -> tuple[list[RowState], list[tuple[int, int, int]]]:
        """Before a decode step of `rows` (running, in admission order): each row whose KV write crosses into a
        new block gets it, preempting the newest running rows while none is free. Returns the rows that still
        decode and the block-table entries that changed, (row, index, block)."""
        short = [s for s in rows if s.issued > s.room]
        if not short:
            return rows, []
        bm, bs = self.blocks, self.blocks.block_size
        changed = []
        preempted = False
        for s in short:
            while not bm.free and s.blocks:
                self.preempt(self.running[-1])
                preempted = True
            if s.blocks:
                s.blocks.append(bm.allocate())
                s.room += bs
                changed.append((s.row, len(s.blocks) - 1, s.blocks[-1]))
                self.outstanding -= 1
        if preempted:
            rows = [s for s in rows if s.blocks]
        return rows, changed

    def preempt(self, seq: RowState) -> None:
        """`seq` (running) gives its blocks back and waits at the front of the queue to be recomputed."""
        bm, bs = self.blocks, self.blocks.block_size
        # the full blocks whose keys/values the device has (or has been asked to) write: the fed tokens'
        written = seq.prompt + seq.tokens[:seq.issued - 1]
        seq.hashes = block_hashes(written, bs, seq.hashes)
        for b, h in zip(seq.blocks, seq.hashes):
            bm.register(b, h)
        self._leave(seq)
        seq.room, seq.leader = 0, None
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: RowState, reason: str) -> None:
        """`seq` is done: its blocks go back now (a preempted one leaves the waiting queue)."""
        seq.reason = reason
        if seq.blocks:
            self._leave(seq)
        else:
            self.waiting.remove(seq)
        seq.leader = None

    def _leave(self, seq: RowState) -> None:
        """`seq` leaves the running rows and gives its blocks back."""
        self.running.remove(seq)
        self.outstanding -= blocks_for(len(seq.prompt), seq.limit, self.blocks.block_size) - len(seq.blocks)
        self.blocks.release(seq.blocks)
        seq.blocks = []

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running
