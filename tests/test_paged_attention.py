"""The paged attention operators against a float64 reference written from scratch (one query position at a
time over the row's tokens in order), opcheck, and on the GPU the decode kernel against the same reference."""
import math

import pytest
import torch

import ops_cuda


def paged_problem(lengths, Hq=4, Hk=2, D=8, bs=4, dtype=torch.float32, device="cpu", seed=0):
    """Random keys/values of rows of `lengths` tokens scattered over shuffled blocks of a pool."""
    g = torch.Generator().manual_seed(seed)
    per_row = [math.ceil(n / bs) for n in lengths]
    n_blocks = 1 + sum(per_row) + 2
    k_pool = torch.randn(n_blocks, Hk, bs, D, generator=g).to(device, dtype)
    v_pool = torch.randn(n_blocks, Hk, bs, D, generator=g).to(device, dtype)
    order = (torch.randperm(n_blocks - 1, generator=g) + 1).tolist()
    width = max(per_row)
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    for r, m in enumerate(per_row):
        tables[r, :m] = torch.tensor([order.pop() for _ in range(m)])
    return k_pool, v_pool, tables.to(device)


def naive(q, k_pool, v_pool, table, length, first_pos, scale):
    """float64: query i (position first_pos + i) over the row's positions 0..first_pos + i, one at a time."""
    bs = k_pool.shape[2]
    keys = [k_pool[table[p // bs], :, p % bs].double() for p in range(length)]
    vals = [v_pool[table[p // bs], :, p % bs].double() for p in range(length)]
    rep = q.shape[1] // k_pool.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        for h in range(q.shape[1]):
            ctx = range(first_pos + i + 1)
            s = torch.tensor([float(q[i, h].double() @ keys[p][h // rep]) * scale for p in ctx], dtype=torch.float64)
            w = torch.softmax(s, 0)
            out[i, h] = sum(w[j] * vals[p][h // rep] for j, p in enumerate(ctx))
    return out


def test_paged_decode_matches_naive():
    lengths = [5, 1, 9, 0, 12]
    k_pool, v_pool, tables = paged_problem(lengths)
    q = torch.randn(len(lengths), 4, 8, generator=torch.Generator().manual_seed(1))
    out = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor(lengths), 0.3)
    for b, n in enumerate(lengths):
        want = naive(q[b:b + 1], k_pool, v_pool, tables[b], n, n - 1, 0.3)[0] if n else torch.zeros(4, 8)
        torch.testing.assert_close(out[b].double(), want.double(), atol=1e-5, rtol=0)


def test_paged_prefill_matches_naive_with_cached_prefixes():
    lengths = [7, 3, 10]            # context lengths after the writes
    new = [7, 1, 4]                 # row 0 computes everything, rows 1 and 2 have cached prefixes
    k_pool, v_pool, tables = paged_problem(lengths)
    cu = torch.tensor([0, 7, 8, 12])
    q = torch.randn(12 + 4, 4, 8, generator=torch.Generator().manual_seed(2))   # 4 padding tokens at the end
    out = ops_cuda.paged_prefill_attention(q, k_pool, v_pool, tables, cu, torch.tensor(lengths), 0.4)
    for r, (n, t) in enumerate(zip(lengths, new)):
        lo = int(cu[r])
        want = naive(q[lo:lo + t], k_pool, v_pool, tables[r], n, n - t, 0.4)
        torch.testing.assert_close(out[lo:lo + t].double(), want, atol=1e-5, rtol=0)
    assert (out[12:] == 0).all()


def test_opcheck_and_argument_checks():
    k_pool, v_pool, tables = paged_problem([5, 3])
    lengths = torch.tensor([5, 3])
    torch.library.opcheck(torch.ops.fw.paged_decode_attention.default,
                          (torch.randn(2, 4, 8), k_pool, v_pool, tables, lengths, 0.5))
    torch.library.opcheck(torch.ops.fw.paged_prefill_attention.default,
                          (torch.randn(8, 4, 8), k_pool, v_pool, tables, torch.tensor([0, 5, 8]), lengths, 0.5))
    torch.library.opcheck(torch.ops.fw.sample.default,
                          (torch.randn(3, 50), 1.0, 5, 0.9, 0.0, 7, torch.tensor([[4, 0], [9, 2], [1, 1]])))
    with pytest.raises(ValueError, match="shapes disagree"):
        ops_cuda.paged_decode_attention(torch.randn(2, 3, 8), k_pool, v_pool, tables, lengths, 0.5)
    with pytest.raises(ValueError, match="int64"):
        ops_cuda.paged_decode_attention(torch.randn(2, 4, 8), k_pool, v_pool, tables.int(), lengths, 0.5)


def test_sample_counters_key_each_rows_noise():
    """With counters, a row's draw depends on its (id, step) pair, not on its slot: rows permuted, draws
    permuted; without counters row b uses (b, 0)."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 2
    counters = torch.tensor([[i * 7, i % 3] for i in range(6)])
    tokens, lp = ops_cuda.sample(logits, 1.0, 0, 1.0, 0.0, 11, counters)
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    t2, lp2 = ops_cuda.sample(logits[perm], 1.0, 0, 1.0, 0.0, 11, counters[perm])
    assert torch.equal(t2, tokens[perm]) and torch.equal(lp2, lp[perm])
    plain = ops_cuda.sample(logits, 1.0, 0, 1.0, 0.0, 11)[0]
    default = ops_cuda.sample(logits, 1.0, 0, 1.0, 0.0, 11, torch.stack([torch.arange(6), torch.zeros(6).long()], 1))
    assert torch.equal(plain, default[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("Hq, Hk, D, bs", [(4, 2, 64, 16), (16, 8, 128, 16), (8, 8, 128, 32), (14, 2, 64, 8)])
def test_paged_decode_kernel_against_float64(dtype, tol, Hq, Hk, D, bs):
    lengths = [1, 37, 300, 0, 1024, 17]
    k_pool, v_pool, tables = paged_problem(lengths, Hq, Hk, D, bs, dtype, "cuda")
    kernel_against_float64(lengths, Hq, dtype, tol, k_pool, v_pool, tables)


def kernel_against_float64(lengths, Hq, dtype, tol, k_pool, v_pool, tables):
    """The CUDA kernel's output for a random q of `dtype` against the float64 reference over the pools' values; the
    row of length 0 (index 3) gives zeros."""
    from ops_cuda.paged_attention import paged_decode_attention_reference

    D = k_pool.shape[3]
    q = torch.randn(len(lengths), Hq, D, device="cuda", dtype=dtype)
    lens = torch.tensor(lengths, device="cuda")
    out = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, D ** -0.5)
    assert out.dtype == dtype
    want = paged_decode_attention_reference(q.double(), k_pool.double(), v_pool.double(), tables, lens, D ** -0.5)
    assert (out.double() - want).norm() / want.norm() < tol
    assert (out[3] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("pool", ["bf16", "fp8"])
def test_paged_decode_kernel_in_a_cuda_graph(pool):
    """A replay writes the eager result (the output is NaN before it), on bf16 pools and on float8 ones."""
    if pool == "fp8":
        k_pool, v_pool, tables = fp8_problem([40, 90], 16, 8, 128, 16, "cuda")
    else:
        k_pool, v_pool, tables = paged_problem([40, 90], 16, 8, 128, 16, torch.bfloat16, "cuda")
    q = torch.randn(2, 16, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([40, 90], device="cuda")
    eager = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.1)
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, eager)


def fp8_problem(lengths, Hq=4, Hk=2, D=8, bs=4, device="cpu", seed=0):
    """paged_problem's pools rounded to float8_e4m3fn (values within its range: no saturation)."""
    k_pool, v_pool, tables = paged_problem(lengths, Hq, Hk, D, bs, torch.float32, device, seed)
    return k_pool.to(torch.float8_e4m3fn), v_pool.to(torch.float8_e4m3fn), tables


def test_fp8_pools_are_read_as_their_exact_values():
    """float8_e4m3fn pools: the same result as the float32 pools of their exact values, and the float64 naive
    reference over those values; pools of a third dtype are refused."""
    lengths = [5, 1, 9, 0, 12]
    k8, v8, tables = fp8_problem(lengths)
    q = torch.randn(len(lengths), 4, 8, generator=torch.Generator().manual_seed(1))
    lens = torch.tensor(lengths)
    out = ops_cuda.paged_decode_attention(q, k8, v8, tables, lens, 0.3)
    assert torch.equal(out, ops_cuda.paged_decode_attention(q, k8.float(), v8.float(), tables, lens, 0.3))
    for b, n in enumerate(lengths):
        want = naive(q[b:b + 1], k8.float(), v8.float(), tables[b], n, n - 1, 0.3)[0] if n else torch.zeros(4, 8)
        torch.testing.assert_close(out[b].double(), want.double(), atol=1e-5, rtol=0)
    cu = torch.tensor([0, 5, 6, 15, 15, 27])
    qp = torch.randn(27, 4, 8, generator=torch.Generator().manual_seed(2))
    prefill = ops_cuda.paged_prefill_attention(qp, k8, v8, tables, cu, lens, 0.3)
    assert torch.equal(prefill, ops_cuda.paged_prefill_attention(qp, k8.float(), v8.float(), tables, cu, lens, 0.3))
    # opcheck's schema test compares inputs with allclose, which torch does not implement for float8
    torch.library.opcheck(torch.ops.fw.paged_decode_attention.default, (q, k8, v8, tables, lens, 0.5),
                          test_utils=("test_faketensor", "test_autograd_registration"))
    with pytest.raises(ValueError, match="must be float8_e4m3fn or q's dtype"):
        ops_cuda.paged_decode_attention(q, k8.half(), v8.half(), tables, lens, 0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("Hq, Hk, D, bs", [(4, 2, 64, 16), (16, 8, 128, 16), (32, 8, 128, 64), (14, 2, 64, 8),
                                          (12, 4, 128, 4)])
@pytest.mark.parametrize("rows", [6, 48])
def test_paged_decode_kernel_reads_fp8_pools_against_float64(dtype, tol, Hq, Hk, D, bs, rows):
    """The tensor-core kernel on float8_e4m3fn pools (converted to float16 in registers, in a permuted head
    dimension) against float64 over the pools' exact values; 6 rows split their contexts over blocks, 48 do not.
    Blocks of 16 positions or more hold whole tiles, smaller ones do not."""
    lengths = ([1, 37, 300, 0, 1024, 17] * 8)[:rows]
    k8, v8, tables = fp8_problem(lengths, Hq, Hk, D, bs, "cuda", seed=rows)
    kernel_against_float64(lengths, Hq, dtype, tol, k8, v8, tables)


@pytest.mark.gpu
def test_paged_decode_kernel_refuses_fp8_pools_it_cannot_read():
    k8, v8, tables = fp8_problem([40, 90], 16, 8, 128, 16, "cuda")
    q = torch.randn(2, 16, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([40, 90], device="cuda")
    with pytest.raises(RuntimeError, match="float8_e4m3fn pools take a bfloat16 or float16 q"):
        ops_cuda.paged_decode_attention(q.float(), k8, v8, tables, lens, 0.1)
    k1, v1, t1 = fp8_problem([40, 90], 8, 8, 128, 16, "cuda")   # one query head a kv head
    with pytest.raises(RuntimeError, match="2 or more query heads a kv head"):
        ops_cuda.paged_decode_attention(q[:, :8], k1, v1, t1, lens, 0.1)


def packed_problem(groups, prompt, Hq, Hk, D, bs, device="cpu", seed=0):
    """Rows in packs: the rows of group i (groups[i] of them, consecutive) share the blocks of their prompt's full
    blocks (prompt // bs of them, the same block ids) and own the rest, each row with its own number of positions
    past the prompt (1 to 300); a last row of length 0 is a pack of its own. Returns float32 pools (values fixed
    by the seed), tables, lengths, and packs [B, 3] (first row, rows, shared positions)."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(groups) + 1
    suffix = torch.randint(1, 301, (rows,), generator=g).tolist()
    lengths = [prompt + n for n in suffix[:-1]] + [0]
    n_shared = prompt // bs
    need = len(groups) * n_shared + sum(math.ceil(n / bs) - n_shared for n in lengths[:-1]) + 1
    order = (torch.randperm(need, generator=g) + 1).tolist()
    width = max(math.ceil(n / bs) for n in lengths)
    tables = torch.zeros(rows, width, dtype=torch.long)
    packs = []
    b = 0
    for size in groups:
        head = [order.pop() for _ in range(n_shared)]
        for _ in range(size):
            tables[b, :n_shared] = torch.tensor(head, dtype=torch.long)
            own = math.ceil(lengths[b] / bs) - n_shared
            tables[b, n_shared:n_shared + own] = torch.tensor([order.pop() for _ in range(own)], dtype=torch.long)
            b += 1
        first = b - size
        packs += [(first, size, n_shared * bs)] * size
    packs.append((b, 1, 0))
    k_pool = torch.randn(need + 1, Hk, bs, D, generator=g)
    v_pool = torch.randn(need + 1, Hk, bs, D, generator=g)
    dev = torch.device(device)
    return (k_pool.to(dev), v_pool.to(dev), tables.to(dev), torch.tensor(lengths, device=dev),
            torch.tensor(packs, dtype=torch.long, device=dev))


def test_packs_leave_the_cpu_result_unchanged_and_are_checked():
    """On CPU packs only say where rows share positions: the result is bitwise the one without them; opcheck with
    packs; packs of the wrong shape or dtype are refused with the argument's name."""
    k_pool, v_pool, tables, lens, packs = packed_problem([3, 2], 10, 4, 2, 8, 4, seed=5)
    q = torch.randn(len(lens), 4, 8, generator=torch.Generator().manual_seed(6))
    plain = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.3)
    assert torch.equal(ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.3, packs), plain)
    torch.library.opcheck(torch.ops.fw.paged_decode_attention.default, (q, k_pool, v_pool, tables, lens, 0.5, packs))
    with pytest.raises(ValueError, match=r"packs \(6, 2\) for 6 rows: expected \[B, 3\]"):
        ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.3, packs[:, :2])
    with pytest.raises(ValueError, match="`packs` must be int64"):
        ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.3, packs.int())


@pytest.mark.gpu
@pytest.mark.parametrize("pool", ["bf16", "fp8"])
@pytest.mark.parametrize("Hq, Hk, D, bs", [(16, 8, 128, 16), (32, 8, 128, 32), (8, 8, 64, 4), (64, 4, 128, 16),
                                          (12, 4, 64, 16)])
@pytest.mark.parametrize("groups", [[8, 11, 3, 1], [3]])
def test_paged_decode_kernel_with_packs_against_float64(pool, Hq, Hk, D, bs, groups, monkeypatch):
    """Packs (a group's rows reading their shared prompt blocks once, as the rows of one tensor-core tile): the CUDA
    kernel against float64 over each row's own table, for 1 to 16 query heads a kv head (a tile holds 16 / R rows,
    so a pack of 11 takes several tiles), a 116-token prompt whose shared part is not a multiple of 16 positions at
    4-position blocks, split as the plan says and unsplit (FW_DECODE_SPLITS=1), each row also as a pack of its own;
    the same again in a second call (the arrival counters reset) and in a CUDA graph's replay. FW_DECODE_PACKS=2 reads
    the packs at these sizes, where by default they are left unread (too few pack blocks for the SMs, or a float8
    pool): then the result is bitwise the one without packs."""
    from ops_cuda.paged_attention import paged_decode_attention_reference

    if pool == "fp8" and Hq == Hk:
        pytest.skip("float8 pools take 2 or more query heads a kv head")
    k_pool, v_pool, tables, lens, packs = packed_problem(groups, 116, Hq, Hk, D, bs, "cuda", seed=len(groups) + D)
    dtype = torch.float8_e4m3fn if pool == "fp8" else torch.bfloat16
    k_pool, v_pool = k_pool.to(dtype), v_pool.to(dtype)
    q = torch.randn(len(lens), Hq, D, device="cuda", dtype=torch.bfloat16)
    scale = D ** -0.5
    want = paged_decode_attention_reference(q.double(), k_pool.double(), v_pool.double(), tables, lens, scale)

    def close(out):
        for b in range(len(lens) - 1):
            err = (out[b].double() - want[b]).norm() / want[b].norm()
            assert err < 2e-2, (b, float(err))
        assert (out[-1] == 0).all()

    plain = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale)
    assert torch.equal(ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale, packs), plain)
    monkeypatch.setenv("FW_DECODE_PACKS", "2")
    out = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale, packs)
    close(out)
    assert torch.equal(ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale, packs), out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale, packs)
    replayed.fill_(float("nan"))
    graph.replay()
    assert torch.equal(replayed, out)
    alone = packs.clone()
    alone[:, 0], alone[:, 1] = torch.arange(len(lens), device="cuda"), 1
    monkeypatch.setenv("FW_DECODE_SPLITS", "1")
    close(ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale, packs))
    close(ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale, alone))


@pytest.mark.parametrize("D, bs", [(8, 4), (16, 16), (128, 16)])
def test_cpu_rows_are_bitwise_independent_of_their_batch(D, bs, monkeypatch):
    """fp32 on CPU: a row's decode and prefill outputs are bitwise the same alone, next to rows of longer
    contexts (the batch's longest context padded to several lengths), at any slot of the batch, and when
    the batch is split into chunks of one row."""
    lengths = [5, 1, 37, 16, 70, 3]
    k_pool, v_pool, tables = paged_problem(lengths, Hq=4, Hk=2, D=D, bs=bs)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(len(lengths), 4, D, generator=g)
    batched = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor(lengths), 0.3)
    perm = [4, 2, 0, 5, 3, 1]
    permuted = ops_cuda.paged_decode_attention(q[perm], k_pool, v_pool, tables[perm], torch.tensor(lengths)[perm],
                                               0.3)
    for b, n in enumerate(lengths):
        width = -(-n // bs)
        alone = ops_cuda.paged_decode_attention(q[b:b + 1], k_pool, v_pool, tables[b:b + 1, :width],
                                                torch.tensor([n]), 0.3)
        assert torch.equal(batched[b], alone[0]) and torch.equal(permuted[perm.index(b)], alone[0]), b
        want = naive(q[b:b + 1], k_pool, v_pool, tables[b], n, n - 1, 0.3)[0]
        torch.testing.assert_close(alone[0].double(), want, atol=1e-5, rtol=0)
    from ops_cuda import paged_attention
    with monkeypatch.context() as m:   # every row a chunk of its own
        m.setattr(paged_attention, "_GROUP_ELEMENTS", 1)
        chunked = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor(lengths), 0.3)
    assert torch.equal(chunked, batched)
    # prefill: row 0's last 4 queries alone, then after the 37- and 70-token rows' queries
    qp = torch.randn(4 + 9 + 20, 4, D, generator=g)
    alone = ops_cuda.paged_prefill_attention(qp[:4], k_pool, v_pool, tables[:1, :-(-5 // bs)],
                                             torch.tensor([0, 4]), torch.tensor([5]), 0.4)
    mixed = torch.cat([qp[4:13], qp[13:], qp[:4]])
    out = ops_cuda.paged_prefill_attention(mixed, k_pool, v_pool, tables[[2, 4, 0]], torch.tensor([0, 9, 29, 33]),
                                           torch.tensor([37, 70, 5]), 0.4)
    assert torch.equal(out[29:], alone)
    torch.testing.assert_close(alone.double(), naive(qp[:4], k_pool, v_pool, tables[0], 5, 1, 0.4), atol=1e-5, rtol=0)


@pytest.mark.parametrize("Hq, Hk, D, bs", [(4, 2, 64, 16), (3, 1, 16, 8), (16, 8, 128, 128)])
def test_cpu_prefill_queries_are_bitwise_their_decode_steps(Hq, Hk, D, bs, monkeypatch):
    """fp32 on CPU: each query of a 300-token prefill (one call, or its queries cut into groups of a few by a small
    _GROUP_ELEMENTS) is bitwise what a decode step of that position alone gives, or next to other rows: a row the
    engine preempts and prefills again computes the keys and values its decode steps did. One kv head (Hk 1) runs
    the product alone that the BLAS may treat otherwise."""
    from ops_cuda import paged_attention

    n = 300
    k_pool, v_pool, tables = paged_problem([n, 40], Hq=Hq, Hk=Hk, D=D, bs=bs, seed=3)
    q = torch.randn(n, Hq, D, generator=torch.Generator().manual_seed(8))
    row = tables[:1]
    whole = ops_cuda.paged_prefill_attention(q, k_pool, v_pool, row, torch.tensor([0, n]), torch.tensor([n]), 0.2)
    with monkeypatch.context() as m:
        m.setattr(paged_attention, "_GROUP_ELEMENTS", 40 * Hq * n)
        grouped = ops_cuda.paged_prefill_attention(q, k_pool, v_pool, row, torch.tensor([0, n]), torch.tensor([n]),
                                                   0.2)
    assert torch.equal(grouped, whole)
    for p in (0, 1, 63, 64, 65, 177, n - 1):
        alone = ops_cuda.paged_decode_attention(q[p:p + 1], k_pool, v_pool, row, torch.tensor([p + 1]), 0.2)
        beside = ops_cuda.paged_decode_attention(torch.cat([q[p:p + 1], q[:1]]), k_pool, v_pool, tables,
                                                 torch.tensor([p + 1, 40]), 0.2)
        assert torch.equal(alone[0], whole[p]) and torch.equal(beside[0], whole[p]), p
    want = naive(q[n - 40:], k_pool, v_pool, tables[0], n, n - 40, 0.2)
    torch.testing.assert_close(whole[n - 40:].double(), want, atol=1e-5, rtol=0)


def test_cpu_attention_ignores_the_default_dtype():
    """Under a bf16 default dtype (Lightning's bf16-true sets it while a module runs), float32 queries and pools give
    bitwise what they give under the float32 default: every buffer the CPU attention makes has its own dtype."""
    k_pool, v_pool, tables = paged_problem([70, 5], Hq=4, Hk=2, D=16, bs=16, seed=4)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(9))
    lengths = torch.tensor([70, 5])
    want = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lengths, 0.25)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lengths, 0.25)
    finally:
        torch.set_default_dtype(default)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_cpu_rows_read_nothing_past_their_length():
    """CPU: a row's decode and prefill outputs are bitwise the same whatever the positions past its length hold (what
    an earlier row of its blocks wrote, NaN or inf where that row diverged; the scratch block its table's later
    entries name): a freed block's old contents must not reach the row that takes it."""
    lengths = [5, 1, 7, 3]
    k_pool, v_pool, tables = paged_problem(lengths, bs=4)
    k_bad, v_bad = k_pool.clone(), v_pool.clone()
    for r, n in enumerate(lengths):
        for p in range(n, tables.shape[1] * 4):
            b, o = int(tables[r, p // 4]), p % 4
            k_bad[b, :, o] = float("nan") if p % 2 else float("inf")
            v_bad[b, :, o] = float("inf") if p % 2 else float("nan")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(len(lengths), 4, 8, generator=g)
    lens = torch.tensor(lengths)
    clean = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.3)
    assert torch.equal(ops_cuda.paged_decode_attention(q, k_bad, v_bad, tables, lens, 0.3), clean)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(clean[b].double(), naive(q[b:b + 1], k_pool, v_pool, tables[b], n, n - 1, 0.3)[0],
                                   atol=1e-5, rtol=0)
    qp = torch.randn(2 + 1 + 3, 4, 8, generator=g)   # the last 2, 1 and 3 positions of rows 0, 1 and 3
    cu, lens = torch.tensor([0, 2, 3, 6]), torch.tensor([5, 1, 3])
    rows = tables[[0, 1, 3]]
    clean = ops_cuda.paged_prefill_attention(qp, k_pool, v_pool, rows, cu, lens, 0.4)
    assert torch.equal(ops_cuda.paged_prefill_attention(qp, k_bad, v_bad, rows, cu, lens, 0.4), clean)
    assert clean.isfinite().all()


def test_cpu_a_nan_in_a_rows_own_context_stays_nan():
    """CPU: a NaN key inside row 1's own positions makes that row's output NaN (as the float64 reference gives it),
    not zeros that would hide a diverged row; the other rows and a row of length 0 are unchanged."""
    lengths = [5, 6, 0, 3]
    k_pool, v_pool, tables = paged_problem(lengths, bs=4)
    q = torch.randn(len(lengths), 4, 8, generator=torch.Generator().manual_seed(7))
    lens = torch.tensor(lengths)
    clean = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.3)
    k_pool[int(tables[1, 1]), 0, 0] = float("nan")   # row 1's position 4, kv head 0
    got = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.3)
    assert naive(q[1:2], k_pool, v_pool, tables[1], 6, 5, 0.3)[0, :2].isnan().all()
    assert got[1, :2].isnan().all() and got[1, 2:].isfinite().all()   # kv head 0 serves q heads 0 and 1
    assert torch.equal(got[[0, 2, 3]], clean[[0, 2, 3]]) and torch.equal(got[2], torch.zeros_like(got[2]))


def suffix_naive(q, k, v, cu_q, cu_k, scale):
    """float64: query j of sequence i's n queries sits at key position L - n + j and sees keys 0..L - n + j."""
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        qs, ks = int(cu_q[i]), int(cu_k[i])
        n, L = int(cu_q[i + 1]) - qs, int(cu_k[i + 1]) - ks
        for j in range(n):
            for h in range(q.shape[1]):
                seen = range(L - n + j + 1)
                s = torch.tensor([float(q[qs + j, h].double() @ k[ks + p, h // rep].double()) * scale for p in seen],
                                 dtype=torch.float64)
                w = torch.softmax(s, 0)
                out[qs + j, h] = sum(w[p] * v[ks + p, h // rep].double() for p in seen)
    return out


def test_varlen_suffix_attention_matches_naive_and_opcheck():
    g = torch.Generator().manual_seed(5)
    cu_q, cu_k = torch.tensor([0, 3, 4, 9, 9], dtype=torch.int32), torch.tensor([0, 3, 11, 16, 18], dtype=torch.int32)
    q, k, v = torch.randn(9, 4, 8, generator=g), torch.randn(18, 2, 8, generator=g), torch.randn(18, 2, 8, generator=g)
    out = ops_cuda.varlen_suffix_attention(q, k, v, cu_q, cu_k, 5, 8, 0.35)
    torch.testing.assert_close(out.double(), suffix_naive(q, k, v, cu_q, cu_k, 0.35), atol=1e-5, rtol=0)
    # with every key a query it is causal varlen attention
    same = ops_cuda.varlen_suffix_attention(k.repeat_interleave(2, 1), k, v, cu_k, cu_k, 8, 8, 0.35)
    torch.testing.assert_close(same, ops_cuda.varlen_attention(k.repeat_interleave(2, 1), k, v, cu_k, 8, 0.35))
    torch.library.opcheck(torch.ops.fw.varlen_suffix_attention.default, (q, k, v, cu_q, cu_k, 5, 8, 0.35))
    with pytest.raises(ValueError, match="int32"):
        ops_cuda.varlen_suffix_attention(q, k, v, cu_q.long(), cu_k, 5, 8, 0.35)
    with pytest.raises(ValueError, match="same sequences"):
        ops_cuda.varlen_suffix_attention(q, k, v, cu_q[:-1], cu_k, 5, 8, 0.35)
    with pytest.raises(ValueError, match="shapes disagree"):
        ops_cuda.varlen_suffix_attention(q, k, v[:, :1], cu_q, cu_k, 5, 8, 0.35)


def test_varlen_suffix_attention_gradients_match_numerical_ones():
    """Completions over a prompt they share: each completion's keys are the prompt's, gathered from one tensor,
    then its own. Float64 gradients against finite differences (gradcheck), and autograd's registration
    (opcheck)."""
    g = torch.Generator().manual_seed(6)
    prompt, comps = 4, [3, 1, 5]
    n = prompt + sum(comps)
    q, k, v = (torch.randn(n, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    index, cu_k, start = [], [0], prompt
    for c in comps:
        index += list(range(prompt)) + list(range(start, start + c))
        cu_k.append(cu_k[-1] + prompt + c)
        start += c
    index = torch.tensor(index)
    cu_q = torch.tensor([0, *torch.tensor(comps).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor(cu_k, dtype=torch.int32)

    def completions(q, k, v):
        return ops_cuda.varlen_suffix_attention(q[prompt:], k[index], v[index], cu_q, cu_k, 5, 9, 0.35)

    assert torch.autograd.gradcheck(completions, (q, k, v))
    # each completion alone, prompt and all, gives the same rows
    alone = []
    for i, c in enumerate(comps):
        rows = torch.cat([torch.arange(prompt), torch.arange(prompt + sum(comps[:i]), prompt + sum(comps[:i + 1]))])
        cu = torch.tensor([0, prompt + c], dtype=torch.int32)
        alone.append(ops_cuda.varlen_attention(q[rows], k[rows], v[rows], cu, prompt + c, 0.35)[prompt:])
    torch.testing.assert_close(completions(q, k, v), torch.cat(alone), atol=1e-12, rtol=0)
    torch.library.opcheck(torch.ops.fw.varlen_suffix_attention.default,
                          (q[prompt:].detach().requires_grad_(), k[index].detach().requires_grad_(),
                           v[index].detach().requires_grad_(), cu_q, cu_k, 5, 9, 0.35))
    out, lse = torch.ops.fw.varlen_suffix_attention(q[prompt:].detach(), k[index].detach(), v[index].detach(), cu_q,
                                                    cu_k, 5, 9, 0.35)
    torch.library.opcheck(torch.ops.fw.varlen_suffix_attention_backward.default,
                          (torch.randn_like(out), q[prompt:].detach(), k[index].detach(), v[index].detach(), out, lse,
                           cu_q, cu_k, 5, 9, 0.35))


def flash_prefill_run(model, device, dtype, contexts, cached, bs=4):
    """Rows of `contexts` random tokens in shuffled blocks of a paged cache. run(flash) writes each row's first
    `cached` tokens by the reference path, then prefills the rest and returns the last tokens' logits, with
    flash None (the reference path), "gather" (FlashPrefill as the engine builds it for cached prefixes) or
    "fresh" (the new tokens are the whole contexts)."""
    from framework.models.qwen3 import FlashPrefill, PagedBatch
    from framework.rollout.engine import context_positions
    from framework.rollout.scheduler import RowState

    g = torch.Generator().manual_seed(9)
    per_row = [-(-n // bs) for n in contexts]
    cache = model.new_paged_kv_cache(1 + sum(per_row), bs, device=device, dtype=dtype)
    order = (torch.randperm(sum(per_row), generator=g) + 1).tolist()
    tables = torch.zeros(len(contexts), max(per_row), dtype=torch.long)
    for r, m in enumerate(per_row):
        tables[r, :m] = torch.tensor([order.pop() for _ in range(m)])
    ids = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in contexts]
    rows = [RowState(row=r, prompt=ids[r].tolist(), limit=1) for r in range(len(contexts))]
    for s, c in zip(rows, cached):
        s.cached = c

    def forward(rows_, spans, flash):
        pos = torch.cat([torch.arange(a, b) for a, b in spans])
        owner = torch.repeat_interleave(torch.tensor(rows_), torch.tensor([b - a for a, b in spans]))
        cu = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0)
        f = None
        if flash is not None:
            cu_q = cu.int().to(device)
            max_q, max_k = max(b - a for a, b in spans), max(b for _, b in spans)
            if flash == "fresh":
                f = FlashPrefill(cu_q, max_q, cu_q, max_k)
            else:
                blocks, offsets, cu_k = context_positions([rows[r] for r in rows_], tables, bs)
                f = FlashPrefill(cu_q, max_q, cu_k.int().to(device), max_k, blocks.to(device), offsets.to(device))
        batch = PagedBatch(positions=pos.to(device), write_blocks=tables[owner, pos // bs].to(device),
                           write_offsets=(pos % bs).to(device), block_tables=tables[rows_].to(device),
                           lengths=torch.tensor([b for _, b in spans], device=device), cu_seqlens=cu.to(device),
                           flash=f)
        tokens = torch.cat([ids[r][a:b] for r, (a, b) in zip(rows_, spans)])
        return model.forward_paged(tokens.to(device), batch, cache, (cu[1:] - 1).to(device))

    @torch.no_grad()
    def run(flash):
        prefixed = [r for r, c in enumerate(cached) if c]
        if prefixed:
            forward(prefixed, [(0, cached[r]) for r in prefixed], None)
        return forward(list(range(len(contexts))), list(zip(cached, contexts)), flash)
    return run


def test_flash_prefill_paths_match_the_reference_in_float64(tok):
    """The model's CUDA prefill paths (here on their CPU references): the contexts gathered from the pools after
    a cached prefix, and fresh rows' own keys/values, give the reference path's logits."""
    from conftest import peaked_tiny_model

    model = peaked_tiny_model(tok).double()
    run = flash_prefill_run(model, "cpu", torch.float64, contexts=[9, 14, 5, 21], cached=[4, 0, 4, 13])
    want = run(None)
    torch.testing.assert_close(run("gather"), want, atol=1e-10, rtol=0)
    fresh = flash_prefill_run(model, "cpu", torch.float64, contexts=[9, 14, 5], cached=[0, 0, 0])
    torch.testing.assert_close(fresh("fresh"), fresh(None), atol=1e-10, rtol=0)


def test_context_positions_walk_each_rows_table():
    from framework.rollout.engine import context_positions
    from framework.rollout.scheduler import RowState

    tables = torch.tensor([[0, 0, 0], [7, 3, 0], [5, 9, 2]])
    rows = [RowState(row=2, prompt=[1] * 9, limit=1), RowState(row=1, prompt=[1] * 5, limit=1)]
    blocks, offsets, cu = context_positions(rows, tables, 4)
    assert cu.tolist() == [0, 9, 14]
    assert blocks.tolist() == [5] * 4 + [9] * 4 + [2] + [7] * 4 + [3]
    assert offsets.tolist() == [0, 1, 2, 3] * 2 + [0] + [0, 1, 2, 3, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_varlen_suffix_attention_on_cuda_against_float64(dtype, tol):
    from ops_cuda.varlen_attention import flash_serves

    lens_k, lens_q = [1, 300, 37, 1024, 64, 5], [1, 17, 37, 300, 1, 5]
    cu_k = torch.tensor([0] + lens_k).cumsum(0).int()
    cu_q = torch.tensor([0] + lens_q).cumsum(0).int()
    q = torch.randn(int(cu_q[-1]), 16, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(int(cu_k[-1]), 8, 128, device="cuda", dtype=dtype) for _ in range(2))
    assert flash_serves(q)
    out = ops_cuda.varlen_suffix_attention(q, k, v, cu_q.cuda(), cu_k.cuda(), max(lens_q), max(lens_k), 128 ** -0.5)
    from ops_cuda.varlen_attention import varlen_suffix_attention_reference
    want = varlen_suffix_attention_reference(q.double().cpu(), k.double().cpu(), v.double().cpu(), cu_q, cu_k,
                                             max(lens_q), max(lens_k), 128 ** -0.5)[0]
    err = (out.double().cpu() - want).norm() / want.norm()
    assert err < tol, err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_varlen_suffix_attention_backward_on_cuda_against_float64(dtype, tol):
    """The flash backward over uneven query and key spans (completions after their prompt) against autograd
    through the float64 reference, whose gradients test_varlen_suffix_attention_gradients_match_numerical_ones
    holds to finite differences."""
    from ops_cuda.varlen_attention import flash_serves

    lens_k, lens_q = [117, 372, 300, 1, 2048], [1, 256, 184, 1, 1000]
    cu_k = torch.tensor([0] + lens_k).cumsum(0).int()
    cu_q = torch.tensor([0] + lens_q).cumsum(0).int()
    q = torch.randn(int(cu_q[-1]), 32, 128, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(int(cu_k[-1]), 8, 128, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    assert flash_serves(q)
    out = ops_cuda.varlen_suffix_attention(q, k, v, cu_q.cuda(), cu_k.cuda(), max(lens_q), max(lens_k), 128 ** -0.5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    x64 = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    out64 = ops_cuda.varlen_suffix_attention(*x64, cu_q, cu_k, max(lens_q), max(lens_k), 128 ** -0.5)
    want = torch.autograd.grad(out64, x64, grad.double().cpu())
    for a, b in zip(got, want, strict=True):
        err = (a.double().cpu() - b).norm() / b.norm()
        assert err < 2 * tol, err


@pytest.mark.gpu
def test_flash_prefill_paths_on_cuda_match_the_reference(tok):
    from conftest import peaked_tiny_model

    model = peaked_tiny_model(tok).cuda()
    with torch.autocast("cuda", torch.bfloat16):
        run = flash_prefill_run(model, "cuda", torch.bfloat16, contexts=[90, 140, 50, 210], cached=[40, 0, 48, 130],
                                bs=16)
        want, got = run(None).float(), run("gather").float()
        fresh = flash_prefill_run(model, "cuda", torch.bfloat16, contexts=[90, 140, 50], cached=[0, 0, 0], bs=16)
        want_fresh, got_fresh = fresh(None).float(), fresh("fresh").float()
    for a, b in ((got, want), (got_fresh, want_fresh)):
        assert ((a - b).norm() / b.norm()) < 2e-2
