"""Continuous batching: which rows run, which wait, and the blocks each one holds.

Rows are admitted first come, first served, while the batch has fewer than `max_num_seqs` rows and the pool
has the blocks a row may ever need (its prompt plus its token limit), so a running row never waits for a
block and never has to be evicted. A finished row gives its blocks back at once, and the next waiting row
joins the batch at the next step.

Prompt sharing: rows admitted together with the same prompt form a group whose first row (the leader) is
prefilled; the others reference the leader's full prompt blocks, get a copy of its last, partial block and
its last-token logits, and compute nothing. Across groups and steps, full prompt blocks are found by their
prefix hash (framework/rollout/block_manager.py), so only the rest of such a prompt is prefilled.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from framework.errors import FwError
from framework.rollout.block_manager import BlockManager, block_hashes


@dataclass
class RowState:
    """One row of a `generate` call: its prompt, its limit, its blocks and what it has produced so far."""

    row: int
    prompt: list[int]
    limit: int
    blocks: list[int] = field(default_factory=list)
    cached: int = 0                 # prompt tokens whose keys/values it did not compute itself
    leader: RowState | None = None  # same prompt, prefilled in the same step: logits and tail block come from it
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


class Scheduler:
    """Waiting and running rows over one `BlockManager`."""

    def __init__(self, seqs: list[RowState], blocks: BlockManager, max_num_seqs: int) -> None:
        self.blocks, self.max_num_seqs = blocks, max_num_seqs
        self.waiting: deque[RowState] = deque(seqs)
        self.running: list[RowState] = []
        bs = blocks.block_size
        worst = max(seqs, key=lambda s: blocks_for(len(s.prompt), s.limit, bs))
        need = blocks_for(len(worst.prompt), worst.limit, bs)
        if need > blocks.num_blocks - 1:
            raise FwError(f"rollout: one row of {len(worst.prompt)} prompt + {worst.limit} new tokens needs {need} "
                          f"KV blocks of {bs} positions, the cache holds {blocks.num_blocks - 1}: raise "
                          "rollout.kv_cache_gib or lower rollout.max_new_tokens")

    def admit(self) -> list[RowState]:
        """The waiting rows that join the batch now, in order (their blocks allocated)."""
        bm, bs = self.blocks, self.blocks.block_size
        new: list[RowState] = []
        leaders: dict[tuple[int, ...], RowState] = {}
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = len(seq.prompt)
            total = blocks_for(n, seq.limit, bs)
            leader = leaders.get(tuple(seq.prompt))
            if leader is not None:   # the leader's full prompt blocks, own blocks for the rest
                shared = leader.blocks[:n // bs]
                if bm.num_free < total - len(shared):
                    break
                seq.blocks = [bm.take(b) for b in shared] + [bm.allocate() for _ in range(total - len(shared))]
                seq.cached, seq.leader = n, leader
            else:   # cached prefix blocks, keeping at least one prompt token to compute the logits from
                hashes = block_hashes(seq.prompt, bs)
                hits = bm.cached_prefix(hashes[:(n - 1) // bs])
                if bm.num_free < bm.blocks_needed(hits, total):
                    break
                seq.blocks = [bm.take(b) for b in hits] + [bm.allocate() for _ in range(total - len(hits))]
                seq.cached = len(hits) * bs
                for i in range(len(hits), len(hashes)):
                    bm.register(seq.blocks[i], hashes[i])
                leaders[tuple(seq.prompt)] = seq
            self.waiting.popleft()
            self.running.append(seq)
            new.append(seq)
        return new

    def finish(self, seq: RowState, reason: str) -> None:
        """`seq` is done: its blocks go back now."""
        seq.reason = reason
        self.running.remove(seq)
        self.blocks.release(seq.blocks)
        seq.blocks = []
        seq.leader = None

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running
