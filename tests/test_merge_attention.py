"""ops_cuda.merge_attention_states: two parts of one attention, each over its own keys, merged in place by their
logsumexps, equal the attention over both parts' keys at once (computed in float64 from the keys themselves); a part
without keys adds nothing; views merge in place; opcheck; the CUDA kernel against the float64 reference."""
import pytest
import torch

import ops_cuda
from ops_cuda.merge_attention import merge_attention_states_reference


def attend(q, k, v, scale):
    """float64 attention of q [N, H, D] over keys k, v [N, K, H, D] (a query's own keys): out [N, H, D], lse [H, N];
    with no key, out 0 and lse `+inf` (flash's mark)."""
    s = torch.einsum("nhd,nkhd->nhk", q.double(), k.double()) * scale
    if k.shape[1] == 0:
        return torch.zeros(q.shape, dtype=torch.float64), torch.full(q.shape[1::-1], float("inf"), dtype=torch.float64)
    out = torch.einsum("nhk,nkhd->nhd", s.softmax(-1), v.double())
    return out, s.logsumexp(-1).T.contiguous()


def parts(n=12, h=3, d=16, k1=5, k2=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(n, k1 + k2, h, d, generator=g, dtype=torch.float64)
    v = torch.randn(n, k1 + k2, h, d, generator=g, dtype=torch.float64)
    scale = d ** -0.5
    whole = attend(q, k, v, scale)
    return attend(q, k[:, :k1], v[:, :k1], scale), attend(q, k[:, k1:], v[:, k1:], scale), whole


def test_two_parts_merge_into_the_attention_over_all_keys():
    (o1, l1), (o2, l2), (want, want_lse) = parts()
    ops_cuda.merge_attention_states(o1, l1, o2, l2)
    torch.testing.assert_close(o1, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(l1, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mark", [float("inf"), float("-inf")])
def test_a_part_without_keys_adds_nothing(mark):
    (o1, l1), (o2, l2), _ = parts(k1=4, k2=0)
    l2.fill_(mark)
    o2.fill_(float("nan"))   # whatever a keyless part's rows hold
    before, before_lse = o1.clone(), l1.clone()
    ops_cuda.merge_attention_states(o1, l1, o2, l2)
    assert torch.equal(o1, before) and torch.equal(l1, before_lse)
    # the other way round: the second part is the whole
    (o1, l1), (o2, l2), _ = parts(k1=4, k2=6, seed=1)
    l1.fill_(mark)
    o1.fill_(float("nan"))
    ops_cuda.merge_attention_states(o1, l1, o2, l2)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    # neither: zeros and -inf
    l1.fill_(mark)
    l2.fill_(mark)
    ops_cuda.merge_attention_states(o1, l1, o2, l2)
    assert torch.equal(o1, torch.zeros_like(o1)) and bool((l1 == float("-inf")).all())


NAN = float("nan")
INF = float("inf")
# (lse, other_lse) -> (out is NaN / unchanged / other, lse): a NaN logsumexp is a part with keys, and the NaN stays
NAN_CASES = {(NAN, 1.0): ("nan", NAN), (1.0, NAN): ("nan", NAN), (NAN, INF): ("unchanged", NAN),
             (INF, NAN): ("other", NAN)}


@pytest.mark.parametrize("pair", NAN_CASES)
def test_a_nan_logsumexp_reaches_the_result(pair):
    out, other = torch.full((1, 1, 4), 2.0, dtype=torch.float64), torch.full((1, 1, 4), 3.0, dtype=torch.float64)
    lse, other_lse = torch.tensor([[pair[0]]], dtype=torch.float64), torch.tensor([[pair[1]]], dtype=torch.float64)
    ops_cuda.merge_attention_states(out, lse, other, other_lse)
    rows, _ = NAN_CASES[pair]
    want = {"nan": torch.full_like(out, NAN), "unchanged": torch.full_like(out, 2.0), "other": other}[rows]
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())
    assert bool(lse.isnan().all())


def test_views_of_a_larger_output_merge_in_place_and_leave_the_rest():
    (o1, l1), (o2, l2), (want, want_lse) = parts(n=10)
    out = torch.randn(14, *o1.shape[1:], dtype=torch.float64)
    lse = torch.randn(o1.shape[1], 14, dtype=torch.float64)
    out[4:], lse[:, 4:] = o1, l1
    head, head_lse = out[:4].clone(), lse[:, :4].clone()
    ops_cuda.merge_attention_states(out[4:], lse[:, 4:], o2, l2)
    torch.testing.assert_close(out[4:], want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[:, 4:], want_lse, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[:4], head) and torch.equal(lse[:, :4], head_lse)


def test_opcheck():
    (o1, l1), (o2, l2), _ = parts()
    torch.library.opcheck(torch.ops.fw.merge_attention_states.default, (o1.float(), l1.float(), o2.float(),
                                                                       l2.float()))


def test_bad_arguments_name_the_argument():
    (o1, l1), (o2, l2), _ = parts()
    with pytest.raises(ValueError, match="merge_attention_states: `lse` must be \\[H, N\\]"):
        ops_cuda.merge_attention_states(o1, l1[0], o2, l2)
    with pytest.raises(ValueError, match="shapes disagree"):
        ops_cuda.merge_attention_states(o1, l1, o2[1:], l2)
    with pytest.raises(ValueError, match="dtypes disagree"):
        ops_cuda.merge_attention_states(o1, l1, o2.float(), l2)
    with pytest.raises(ValueError, match="`lse` must be a floating-point tensor"):
        ops_cuda.merge_attention_states(o1, l1.long(), o2, l2.long())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("d, view", [(128, False), (64, True), (256, False), (40, False), (40, True), (264, False),
                                     (1, False)])
def test_cuda_against_float64(dtype, tol, d, view):
    """The kernel's vector path (idle lanes at d 40, two passes at d 264) and scalar path (a view of odd row stride,
    d 1), an lse slice of a wider tensor or a transposed one, rows with either part keyless (their rows holding NaN),
    and NaN logsumexps."""
    (o1, l1), (o2, l2), _ = parts(n=300, h=16, d=d, k1=9, k2=13)
    l1[3, :7] = INF
    o1[:7, 3] = NAN
    l2[5, 20:30] = INF
    o2[20:30, 5] = NAN
    l2[0, 40:44] = -INF
    l1[0, 42:48] = -INF
    l1[7, 50], l2[7, 51], l1[8, 52], l2[8, 52], l1[9, 53], l2[9, 53] = NAN, NAN, NAN, INF, INF, NAN
    want, want_lse = o1.clone(), l1.clone()
    merge_attention_states_reference(want, want_lse, o2, l2)
    if view:   # rows of odd stride: the kernel's element-wise path
        out = torch.zeros(300, 16, d + 1, dtype=dtype, device="cuda")[..., 1:]
        out.copy_(o1.to(dtype))
        lse_big = torch.zeros(16, 310, device="cuda")
        lse = lse_big[:, 10:]
    else:
        out = o1.to(device="cuda", dtype=dtype)
        lse_big = torch.zeros(300, 16, device="cuda")
        lse = lse_big.T   # strides (1, H)
    lse.copy_(l1.float())
    ops_cuda.merge_attention_states(out, lse, o2.to(device="cuda", dtype=dtype), l2.float().cuda())
    got, got_lse = out.double().cpu(), lse.double().cpu()
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert ((got[ok] - want[ok]).abs() <= tol * (1 + want[ok].abs())).all()
    assert torch.equal(got_lse.isnan(), want_lse.isnan()) and torch.equal(got_lse.isinf(), want_lse.isinf())
    finite = want_lse.isfinite()
    assert (got_lse[finite] - want_lse[finite]).abs().max() < 1e-5
    if view:
        assert bool((lse_big[:, :10] == 0).all())
    torch.library.opcheck(torch.ops.fw.merge_attention_states.default,
                          (out.clone(), lse.clone(), o2.to(device="cuda", dtype=dtype), l2.float().cuda()))


@pytest.mark.gpu
def test_cuda_refuses_overlapping_arguments_and_a_cpu_one():
    (o1, l1), (o2, l2), _ = parts()
    out, lse, other, other_lse = (t.float().cuda() for t in (o1, l1, o2, l2))
    with pytest.raises(RuntimeError, match="unsupported operation"):   # ATen's overlap check
        torch.ops.fw.merge_attention_states(out[:1].expand(out.shape), lse, other, other_lse)
    with pytest.raises(RuntimeError, match="unsupported operation"):
        torch.ops.fw.merge_attention_states(out[1:], lse[:, 1:], out[:-1], other_lse[:, 1:])
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        torch.ops.fw.merge_attention_states(out, lse, other, other_lse.cpu())
