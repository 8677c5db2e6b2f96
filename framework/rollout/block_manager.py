"""The paged KV cache's bookkeeping: which blocks of the pool are free, who references each one, and the
hashed prefix cache of full prompt blocks.

Block 0 is never handed out: padding tokens of a batch write their keys/values there. A full block of prompt
tokens is hashed with the hash of the blocks before it (the hash names the whole prefix up to its end), so a
later prompt that starts with the same tokens reuses the block instead of computing it again. The hash is a
128-bit BLAKE2b digest, not Python's 64-bit `hash`, whose values for tuples of ints can be made to collide: a
collision would hand one prompt another's keys and values without a sign. A block whose last reference goes is
free again at once but keeps its hash until it is handed out for other content, so a shared system prompt stays
cached while the pool has room.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from framework.errors import FwError

SCRATCH_BLOCK = 0


def block_hashes(tokens: Sequence[int], block_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """The chained hashes of the full blocks of `tokens`: entry i names tokens[:(i + 1) * block_size] (the digest
    of the hash before it and the block's tokens as int64). `known`: hashes computed before for a prefix of
    `tokens` (a row's context only grows), not computed again."""
    out = list(known[:len(tokens) // block_size])
    h = out[-1] if out else b""
    for i in range(len(out), len(tokens) // block_size):
        h = hashlib.blake2b(h + array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes(),
                            digest_size=16).digest()
        out.append(h)
    return out


class BlockManager:
    """Free list, reference counts and the prefix cache of a pool of `num_blocks` blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:   # block 0 is scratch; a pool of it alone holds no row, which the Scheduler refuses
            raise FwError(f"rollout: the KV cache needs at least 1 block, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[bytes, int] = {}     # prefix hash -> block holding it
        self.hash_of: dict[int, bytes] = {}    # block -> its prefix hash

    @property
    def num_free(self) -> int:
        return len(self.free)

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest cached run of `hashes` (from the first one)."""
        blocks = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def blocks_needed(self, hits: Sequence[int], total: int) -> int:
        """Free blocks a row of `total` blocks takes when `hits` are its cached prefix blocks."""
        return total - len(hits) + sum(1 for b in hits if self.refs[b] == 0)

    def take(self, block: int) -> int:
        """One more reference to `block` (a cached one, maybe free)."""
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1
        return block

    def allocate(self) -> int:
        """A free block for new content (its old hash, if any, is forgotten)."""
        if not self.free:
            raise FwError("rollout: the KV cache has no free block (the scheduler's accounting is wrong)")
        block, _ = self.free.popitem(last=False)
        old = self.hash_of.pop(block, None)
        if old is not None and self.cached.get(old) == block:
            del self.cached[old]
        self.refs[block] = 1
        return block

    def register(self, block: int, h: bytes) -> None:
        """`block` holds the full prefix block named `h`: later prompts may reuse it."""
        if h in self.cached or block in self.hash_of:
            return
        self.cached[h] = block
        self.hash_of[block] = h

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody references is free (and keeps its hash)."""
        for b in reversed(blocks):   # a row's last blocks are freed first and so handed out first
            self.refs[b] -= 1
            if self.refs[b] < 0:
                raise FwError(f"rollout: block {b} released more often than taken")
            if self.refs[b] == 0:
                self.free[b] = None
