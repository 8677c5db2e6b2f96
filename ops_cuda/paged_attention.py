"""paged_decode_attention and paged_prefill_attention: attention over a paged KV cache (fixed-size blocks of
one pool, a block table per row). Schemas, argument checks, torch references, fakes (inference only: no
autograd). CUDA kernel of the decode op: csrc/decode_attention.cu (the decode kernels with a block-table
indirection); the prefill op runs its reference on CUDA too (a gather per row, then SDPA, with host syncs), so the
rollout engine's CUDA prefill gathers the contexts once and calls varlen_suffix_attention instead.

Pool layout: k_pool, v_pool [num_blocks, Hk, block_size, D]; position p of row b lives in block
block_tables[b, p // block_size] at offset p % block_size. The pools hold q's dtype or float8_e4m3fn, whose values
the attention reads exactly (the CUDA decode kernel as float16, which represents every e4m3 value). A row's result
does not depend on which other rows share its batch: on CPU the queries of a row read its context together, with
reductions whose order does not depend on the other queries (`_batched_attention`); elsewhere the references run one
row at a time.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from ops_cuda.library import acc_dtype, define, fail, heads_fit, need_device, need_dim, need_long


def gather_context(pool: Tensor, table: Tensor, length: int) -> Tensor:
    """The first `length` positions of one row, [Hk, length, D], from its block table row [M]."""
    bs = pool.shape[2]
    blocks = table[:(length + bs - 1) // bs]
    ctx = pool.index_select(0, blocks)                       # [n, Hk, bs, D]
    return ctx.transpose(0, 1).reshape(pool.shape[1], -1, pool.shape[3])[:, :length]


def _row_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q [Tq, Hq, D] are the last Tq positions of a context k, v [Hk, Tk, D]; causal. Returns [Tq, Hq, D]."""
    Tq, Hq, D = q.shape
    Hk, Tk = k.shape[0], k.shape[1]
    acc = acc_dtype(q.dtype)
    qf = q.to(acc).permute(1, 0, 2).reshape(Hk, Hq // Hk * Tq, D)
    s = torch.bmm(qf, k.to(acc).transpose(1, 2)).reshape(Hk, Hq // Hk, Tq, Tk) * scale
    pos_q = torch.arange(Tk - Tq, Tk, device=q.device)
    allowed = torch.arange(Tk, device=q.device)[None, :] <= pos_q[:, None]
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.bmm(p.reshape(Hk, -1, Tk), v.to(acc)).reshape(Hk, Hq // Hk, Tq, D)
    return out.reshape(Hq, Tq, D).permute(1, 0, 2).to(q.dtype)


_CHUNK_ELEMENTS = 1 << 20   # CPU float64: the most elements of one [rows, Hq, T, D] product (in cache)
_ROWS_ELEMENTS = 1 << 22    # CPU float64: the most attention weights ([queries, Hq, T]) one chunk of queries holds
_GROUP_ELEMENTS = 1 << 20   # CPU float32: the most weights, keys or values of one chunk of groups (in cache)
_ROW_MULTIPLE = 8           # CPU float32: a group's query rows (its queries x Hq/Hk) padded to a multiple of this
_TILE = 64                  # CPU float32: positions one product of weights and values sums over


def _batched_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, lengths: Tensor,
                       scale: float) -> Tensor:
    """CPU: query i [Hq, D] of q [N, Hq, D] attends to positions 0..lengths[i]-1 of the row whose block table
    is tables[i]; length 0 gives zeros. A query's result is bitwise the same whatever the other queries of the
    call: float32 through BLAS (`_grouped_attention`), float64 by sums in position order (`_walked_attention`)."""
    if acc_dtype(q.dtype) == torch.float64:
        return _walked_attention(q, k_pool, v_pool, tables, lengths, scale)
    # the op has no backward; its products stay in float32 under a caller's autocast
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        return _grouped_attention(q, k_pool, v_pool, tables, lengths, scale)


def _grouped_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, lengths: Tensor,
                       scale: float) -> Tensor:
    """`_batched_attention` in float32. Consecutive queries of one block table (a prefill's row) are a group, which
    reads its context once. Every product covers one tile of `_TILE` positions: a tile's scores are its keys by the
    group's queries (reducing over D), its output its weights by its values and by ones (reducing over `_TILE`),
    and a query's outputs and weights' sums add up tile after tile. A query's numbers then depend only on its own
    inputs: the products have the same sizes for every query, their rows are padded to a multiple of
    `_ROW_MULTIPLE` and a call holds two products or more, where the BLAS (MKL, on the AMD and Intel CPUs the tests
    ran on) runs one kernel whatever the count, as the engine's padding of a CPU batch's tokens for the projections
    assumes; the positions past a query's length weigh exact zeros, and past its row's context the keys and values
    are zeros, so that what a freed block held (NaN or inf) adds nothing. tests/test_paged_attention.py checks this
    bitwise against the same query alone and against its decode step. A NaN or inf inside a row's own context also
    reaches the row's queries of earlier positions in the same call (-inf plus NaN or inf, 0 times NaN); from that
    position on the row's outputs are NaN either way."""
    N, Hq, D = q.shape
    Hk = k_pool.shape[1]
    G = Hq // Hk
    out = torch.zeros(N, Hq, D, dtype=torch.float32)
    if N == 0:
        return out.to(q.dtype)
    # groups: runs of consecutive queries on one table, cut so that one's weights stay within _GROUP_ELEMENTS
    new_table = torch.ones(N, dtype=torch.bool)
    new_table[1:] = (tables[1:] != tables[:-1]).any(1)
    starts = new_table.nonzero().flatten().tolist() + [N]
    lens = lengths.tolist()
    groups: dict[int, list[tuple[int, int, int]]] = {}   # padded rows -> (first query, queries, context)
    for a, b in itertools.pairwise(starts):
        while a < b:
            n = b - a
            while n > 1 and n * Hq * max(lens[a:a + n]) > _GROUP_ELEMENTS:
                n = -(-n // 2)
            context = max(lens[a:a + n])
            if context > 0:
                groups.setdefault(-(-n * G // _ROW_MULTIPLE) * _ROW_MULTIPLE, []).append((a, n, context))
            a += n
    scratch = [torch.empty(0)]
    for rows, members in groups.items():
        i = 0
        while i < len(members):
            # a chunk of groups of these padded rows, within _GROUP_ELEMENTS weights, keys and values each
            j, longest = i + 1, members[i][2]
            while j < len(members) and (j + 1 - i) * max(rows, D) * Hk * max(longest, members[j][2]) <= _GROUP_ELEMENTS:
                longest = max(longest, members[j][2])
                j += 1
            _attend_groups(q, k_pool, v_pool, tables, lengths, scale, members[i:j], rows, out, scratch)
            i = j
    return out.to(q.dtype)


def _gather_by_head(pool: Tensor, blocks: Tensor, T: int) -> Tensor:
    """float32 [Hk, R, T, D]: the positions of the blocks [R, T // block_size] of `pool`, one head at a time (an
    index along the pool's first dimension copies whole blocks)."""
    Hk, bs, D = pool.shape[1], pool.shape[2], pool.shape[3]
    out = torch.empty(Hk, blocks.shape[0], T, D, dtype=pool.dtype)
    flat = blocks.flatten()
    for h in range(Hk):
        torch.index_select(pool[:, h], 0, flat, out=out[h].view(-1, bs, D))
    return out.to(torch.float32)


def _attend_groups(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, lengths: Tensor, scale: float,
                   members: list[tuple[int, int, int]], rows: int, out: Tensor, scratch: list[Tensor]) -> None:
    """`_grouped_attention`'s work for `members` (first query, queries, context), `rows` padded query rows each,
    written into `out`. Every product is one tile of `_TILE` positions: tensors are [Hk, group, tile, ...], one batch
    dimension for the products. `scratch` holds the scores' buffer from one chunk to the next."""
    Hq, D = q.shape[1], q.shape[2]
    Hk, bs = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hk
    R = len(members)
    span = max(_TILE, bs)   # a multiple of both
    T = -(-max(c for _, _, c in members) // span) * span
    nT, n_blocks = T // _TILE, T // bs
    blocks = tables[torch.tensor([a for a, _, _ in members]), :min(n_blocks, tables.shape[1])]
    if blocks.shape[1] < n_blocks:   # a table narrower than the tiles: positions past it are masked
        blocks = torch.cat([blocks, blocks.new_zeros(R, n_blocks - blocks.shape[1])], 1)
    past = torch.arange(T)[None, :] >= torch.tensor([c for _, _, c in members])[:, None]     # [R, T]
    k, v = _gather_by_head(k_pool, blocks, T), _gather_by_head(v_pool, blocks, T)   # [Hk, R, T, D]
    # past a row's context its blocks hold what earlier rows wrote (NaN or inf where one diverged): zeros instead,
    # so that the keys' scores there are finite before the mask's -inf is added and the values add nothing
    k[:, past] = 0.0
    v[:, past] = 0.0
    counts = torch.tensor([n for _, n, _ in members])
    owner = torch.repeat_interleave(torch.arange(R), counts * G)                     # each query row's group
    slot = torch.arange(len(owner)) - torch.repeat_interleave(torch.cumsum(counts * G, 0) - counts * G, counts * G)
    queries = torch.cat([torch.arange(a, a + n) for a, n, _ in members])
    qg = torch.zeros(Hk, R, rows, D, dtype=torch.float32)   # a group's queries, query-major, under each kv head
    qg[:, owner, slot] = q[queries].to(torch.float32).view(-1, Hk, G, D).transpose(0, 1).reshape(Hk, -1, D)
    limit = torch.zeros(R, rows, dtype=torch.long)          # each query row's length; 0 for the padding rows
    limit[owner, slot] = lengths[queries].repeat_interleave(G)
    B = Hk * R
    if B == 1:   # one product alone may take another BLAS kernel than the same product in a batch
        qg, k, v, B = torch.cat([qg, qg]), torch.cat([k, k]), torch.cat([v, v]), 2
    k, v = k.view(B * nT, _TILE, D), v.view(B * nT, _TILE, D)
    qt = qg.view(B, 1, rows, D).expand(B, nT, rows, D).reshape(B * nT, rows, D)
    if scratch[0].numel() < B * nT * rows * _TILE:
        # reused: a fresh buffer a chunk costs its page faults
        scratch[0] = torch.empty(B * nT * rows * _TILE, dtype=torch.float32)
    s = scratch[0][:B * nT * rows * _TILE].view(B * nT, rows, _TILE)
    torch.bmm(qt, k.transpose(1, 2), out=s).mul_(scale)                              # [B * nT, rows, _TILE]
    # the mask: -inf at the positions a query row does not see, read as rows of a tail of zeros then -infs
    tail = torch.full((2 * _TILE,), float("-inf"), dtype=torch.float32)
    tail[:_TILE] = 0.0
    tail = tail.unfold(0, _TILE, 1)
    seen = (limit[:, None, :] - torch.arange(0, T, _TILE)[None, :, None]).clamp_(0, _TILE)   # [R, nT, rows]
    s.view(-1, R * nT * rows, _TILE).add_(tail.index_select(0, (_TILE - seen).flatten()))
    s4 = s.view(B, nT, rows, _TILE)
    m = s4.amax((1, 3), keepdim=True)                                                 # [B, 1, rows, 1]
    m.masked_fill_(m == float("-inf"), 0.0)                                           # queries of length 0
    e = s4.sub_(m).exp_()                                                             # exact zeros where masked
    # a tile's weights by its values and by ones (its weights' sum) in one BLAS product, summed over the tiles in
    # order: the tiles past a query's length add exact zeros
    tiles = torch.bmm(e.view(B * nT, rows, _TILE), torch.cat([v, v.new_ones(B * nT, _TILE, 1)], 2))
    tiles = tiles.view(B, nT, rows, D + 1)
    acc = tiles[:, 0].clone()
    for t in range(1, nT):
        acc += tiles[:, t]
    total, den = acc[..., :D], acc[..., D:]                                           # [B, rows, D], [B, rows, 1]
    o = (total / den).view(-1, R, rows, D)[:Hk]
    o = torch.where(limit[None, :, :, None] > 0, o, 0.0)
    out[queries] = o[:, owner, slot].view(Hk, -1, G, D).transpose(0, 1).reshape(-1, Hq, D)


def _walked_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, lengths: Tensor,
                      scale: float) -> Tensor:
    """`_batched_attention` in float64: each chunk of queries gathers its contexts up to its longest and masks
    them; every reduction over positions is one sequential sum per output in position order (cumsum's, or the
    walk over positions), so the masked positions add exact zeros and a query's result is bitwise the same whatever
    the longest context and the other queries are. The dot products reduce over D, the same size for every query."""
    N, Hq, D = q.shape
    Hk, bs = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hk
    acc = acc_dtype(q.dtype)
    out = torch.zeros(N, Hq, D, dtype=acc)
    longest = int(lengths.max()) if N else 0
    if longest == 0:
        return out.to(q.dtype)
    step = max(1, _ROWS_ELEMENTS // (Hq * -(-longest // bs) * bs))
    for lo in range(0, N, step):
        hi = min(N, lo + step)
        n = hi - lo
        # a chunk's own longest context: a prefill's early queries do not pay for its late ones' positions
        n_blocks = -(-int(lengths[lo:hi].max()) // bs)
        if n_blocks == 0:
            continue
        T = n_blocks * bs
        blocks = tables[lo:hi, :n_blocks]
        past = torch.arange(T)[None, :] >= lengths[lo:hi, None]               # [n, T]
        s = torch.empty(n, Hk, G, T, dtype=acc)
        sub = max(1, _CHUNK_ELEMENTS // (Hq * T * D))   # products small enough to stay in cache
        for a in range(0, n, sub):
            b = min(n, a + sub)
            k = k_pool[blocks[a:b]].to(acc)                                    # [m, n_blocks, Hk, bs, D]
            qi = q[lo + a:lo + b].to(acc).reshape(b - a, 1, Hk, G, 1, D)
            prod = (qi * k[:, :, :, None]).sum(-1)                             # [m, n_blocks, Hk, G, bs]
            s[a:b] = prod.permute(0, 2, 3, 1, 4).reshape(b - a, Hk, G, T) * scale   # positions in order
        s.masked_fill_(past[:, None, None, :], float("-inf"))
        m = s.amax(-1, keepdim=True)
        m.masked_fill_(m == float("-inf"), 0.0)                                # rows of length 0
        e = (s - m).exp_()                                                     # exact zeros where masked
        den = e.cumsum(-1)[..., -1:]                                           # [n, Hk, G, 1]
        weights = e.permute(3, 0, 1, 2).unsqueeze(-1).contiguous()             # [T, n, Hk, G, 1]
        total = torch.zeros(n, Hk, G, D, dtype=acc)
        for j in range(n_blocks):
            v = v_pool[blocks[:, j]].to(acc)                                   # [n, Hk, bs, D]
            # the positions past a row's length hold what earlier rows of their blocks wrote, or the padding rows':
            # zeroed, so that a NaN or inf there (a diverged row) adds exact zeros too
            v.masked_fill_(past[:, j * bs:(j + 1) * bs].view(n, 1, bs, 1), 0.0)
            v = v.unsqueeze(2)                                                 # [n, Hk, 1, bs, D]
            for t in range(bs):
                total.add_(weights[j * bs + t] * v[:, :, :, t])
        # rows of length 0 give zeros; a NaN in a row's own context stays NaN, so that a diverged row shows
        o = torch.where(lengths[lo:hi, None, None, None] > 0, total / den, 0.0)
        out[lo:hi] = o.reshape(n, Hq, D)
    return out.to(q.dtype)


def paged_decode_attention_reference(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor,
                                     lengths: Tensor, scale: float, packs: Tensor | None = None) -> Tensor:
    """q [B, Hq, D] attends to positions 0..lengths[b]-1 of row b; a row of length 0 gives zeros. `packs` says only
    where rows share positions, which the result does not depend on: the reference reads every row's own."""
    if q.device.type == "cpu":
        return _batched_attention(q, k_pool, v_pool, block_tables, lengths, scale)
    out = torch.zeros_like(q)
    for b, n in enumerate(lengths.tolist()):
        if n > 0:
            k = gather_context(k_pool, block_tables[b], n)
            v = gather_context(v_pool, block_tables[b], n)
            out[b] = _row_attention(q[b:b + 1], k, v, scale)[0]
    return out


def paged_prefill_attention_reference(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor,
                                      cu_seqlens: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """Packed queries q [N, Hq, D]: tokens cu_seqlens[r]..cu_seqlens[r+1]-1 are the last positions of row r,
    whose context (already in the pool) is lengths[r] long; causal. Tokens past cu_seqlens[-1] give zeros."""
    if q.device.type == "cpu":
        # each query token is a decode query over its row's context up to its own position
        counts = cu_seqlens[1:] - cu_seqlens[:-1]
        n_real = int(cu_seqlens[-1])
        owner = torch.repeat_interleave(torch.arange(len(counts)), counts)
        last = cu_seqlens[1:][owner] - 1                       # index of the row's last query token
        upto = lengths[owner] - (last - torch.arange(n_real))  # query i sees positions 0..upto-1
        pad = q.shape[0] - n_real
        tables = torch.cat([block_tables[owner], block_tables.new_zeros(pad, block_tables.shape[1])])
        return _batched_attention(q, k_pool, v_pool, tables, torch.cat([upto, upto.new_zeros(pad)]), scale)
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for r, n in enumerate(lengths.tolist()):
        lo, hi = bounds[r], bounds[r + 1]
        if hi > lo:
            k = gather_context(k_pool, block_tables[r], n)
            v = gather_context(v_pool, block_tables[r], n)
            if q.device.type == "cuda":   # flash / memory-efficient SDPA, bottom-right aligned causal mask
                out[lo:hi] = _row_sdpa(q[lo:hi], k.to(q.dtype), v.to(q.dtype), scale)
            else:
                out[lo:hi] = _row_attention(q[lo:hi], k, v, scale)
    return out


def _row_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    Tq, Tk = q.shape[0], k.shape[1]
    qt = q.transpose(0, 1)[None]
    if Tq == Tk:
        o = F.scaled_dot_product_attention(qt, k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = torch.arange(Tk, device=q.device)[None, :] <= torch.arange(Tk - Tq, Tk, device=q.device)[:, None]
        rep = q.shape[1] // k.shape[0]
        o = F.scaled_dot_product_attention(qt, k.repeat_interleave(rep, 0)[None], v.repeat_interleave(rep, 0)[None],
                                           attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


define("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor lengths, "
       "float scale, Tensor? packs=None) -> Tensor", paged_decode_attention_reference,
       fake=lambda q, k_pool, v_pool, block_tables, lengths, scale, packs=None: q.new_empty(q.shape))
define("paged_prefill_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor cu_seqlens, "
       "Tensor lengths, float scale) -> Tensor", paged_prefill_attention_reference,
       fake=lambda q, k_pool, v_pool, block_tables, cu_seqlens, lengths, scale: q.new_empty(q.shape),
       cuda=paged_prefill_attention_reference)


def _check_pools(op: str, q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, lengths: Tensor) -> None:
    need_dim(op, "q", q, 3, "[N, Hq, D]")
    need_dim(op, "k_pool", k_pool, 4, "[num_blocks, Hk, block_size, D]")
    need_dim(op, "v_pool", v_pool, 4, "[num_blocks, Hk, block_size, D]")
    need_dim(op, "block_tables", block_tables, 2, "[B, max_blocks]")
    need_dim(op, "lengths", lengths, 1, "[B]")
    need_long(op, "block_tables", block_tables)
    need_long(op, "lengths", lengths)
    if v_pool.dtype != k_pool.dtype or k_pool.dtype not in (q.dtype, torch.float8_e4m3fn):
        fail(op, f"k_pool and v_pool must be float8_e4m3fn or q's dtype ({q.dtype}), got {k_pool.dtype} and "
                 f"{v_pool.dtype}")
    if (k_pool.shape != v_pool.shape or k_pool.shape[3] != q.shape[2] or not heads_fit(q.shape[1], k_pool.shape[1])
            or block_tables.shape[0] != lengths.shape[0]):
        fail(op, f"shapes disagree: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}, "
                 f"block_tables {tuple(block_tables.shape)}, lengths {tuple(lengths.shape)}")
    need_device(op, "q", q, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables, lengths=lengths)


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, lengths: Tensor,
                           scale: float, packs: Tensor | None = None) -> Tensor:
    """q [B, Hq, D] (one query a row) attends to the first lengths[b] positions of row b in the pools
    [num_blocks, Hk, block_size, D] through block_tables [B, M] (int64); length 0 gives zeros.

    packs [B, 3] int64 (optional), row b's (first row of its pack, rows of the pack, shared positions): a pack's rows
    are consecutive and their first `shared` positions, the same number for all of them, are the same blocks of the
    pools. The CUDA kernel then reads those positions once for several rows (the CPU reads each row's own); any
    row may be a pack of its own. The kernel trusts them (checking them would read them back from the device): packs
    that break these rules give wrong results on CUDA, or make it read rows past the batch."""
    _check_pools("paged_decode_attention", q, k_pool, v_pool, block_tables, lengths)
    if q.shape[0] != lengths.shape[0]:
        fail("paged_decode_attention", f"q has {q.shape[0]} rows, lengths {lengths.shape[0]}")
    if packs is not None:
        need_dim("paged_decode_attention", "packs", packs, 2, "[B, 3]")
        need_long("paged_decode_attention", "packs", packs)
        if packs.shape != (q.shape[0], 3):
            fail("paged_decode_attention", f"packs {tuple(packs.shape)} for {q.shape[0]} rows: expected [B, 3]")
        need_device("paged_decode_attention", "q", q, packs=packs)
    return torch.ops.fw.paged_decode_attention(q, k_pool, v_pool, block_tables, lengths, float(scale), packs)


def paged_prefill_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, cu_seqlens: Tensor,
                            lengths: Tensor, scale: float) -> Tensor:
    """Ragged prefill: packed q [N, Hq, D], row r's queries at cu_seqlens[r]..cu_seqlens[r+1]-1 being the last
    positions of its context of lengths[r] tokens in the pools (written before the call); causal."""
    _check_pools("paged_prefill_attention", q, k_pool, v_pool, block_tables, lengths)
    need_dim("paged_prefill_attention", "cu_seqlens", cu_seqlens, 1, "[R + 1]")
    need_long("paged_prefill_attention", "cu_seqlens", cu_seqlens)
    if cu_seqlens.shape[0] != lengths.shape[0] + 1:
        fail("paged_prefill_attention", f"cu_seqlens {tuple(cu_seqlens.shape)} for {lengths.shape[0]} rows")
    need_device("paged_prefill_attention", "q", q, cu_seqlens=cu_seqlens)
    return torch.ops.fw.paged_prefill_attention(q, k_pool, v_pool, block_tables, cu_seqlens, lengths, float(scale))
