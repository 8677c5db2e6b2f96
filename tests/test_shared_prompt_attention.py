"""ops_cuda.shared_prompt_attention: completions attend to their group's prompt (stored once) and causally to
themselves. Checked against each whole sequence's attention computed naively in float64, finite differences, opcheck,
and on CUDA (two flash calls merged by logsumexp, two flash backwards) against the float64 reference."""
import importlib
import itertools

import pytest
import torch

import ops_cuda
from ops_cuda.shared_prompt_attention import shared_prompt_attention_reference


def layout(prompts, groups, hq=4, hk=2, d=8, dtype=torch.float64, device="cpu", seed=0):
    """q, k, v of one packed row (the prompts, then the completions group after group), the prompts' token count,
    the int32 cu tensors and the max_* sizes of groups with prompt lengths `prompts` and completion lengths
    `groups` (a list per group)."""
    g = torch.Generator().manual_seed(seed)
    flat = [c for s in groups for c in s]
    seqs = list(prompts) + [c for c in flat if c]
    cu = [torch.tensor([0, *itertools.accumulate(x)], dtype=torch.int32) for x in (prompts, map(sum, groups), seqs)]
    t = sum(prompts) + sum(flat)
    qkv = [torch.randn(t, h, d, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) for h in (hq, hk, hk)]
    return qkv, sum(prompts), cu, (max(prompts), max(map(sum, groups)), max(seqs))


def naive(q, k, v, prompts, groups, scale):
    """float64: each sequence laid out whole (prompt, then completion), softmax over its keys up to each token."""
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)

    def attend(rows, keys, first):   # rows: the query tokens; keys: the sequence's; rows[j] is key first + j
        kk, vv = (x[keys].double().repeat_interleave(rep, 1) for x in (k, v))
        for j, r in enumerate(rows):
            s = torch.einsum("hd,khd->hk", q[r].double(), kk[:first + j + 1]) * scale
            out[r] = torch.einsum("hk,khd->hd", s.softmax(-1), vv[:first + j + 1])

    t, p0 = sum(prompts), 0
    for plen, seqs in zip(prompts, groups, strict=True):
        prompt = list(range(p0, p0 + plen))
        attend(prompt, prompt, 0)
        for c in seqs:
            attend(list(range(t, t + c)), prompt + list(range(t, t + c)), plen)
            t += c
        p0 += plen
    return out


# an empty completion, a group without completion tokens, a one-token completion
PROMPTS, GROUPS = [4, 2, 5, 3], [[3, 0, 2], [], [1, 4], [2]]


EDGES = {"ragged": (PROMPTS, GROUPS), "an empty prompt": ([0, 3], [[2, 1], [4]]),
         "no prompt token": ([0, 0], [[3], [2]]), "no completion token": ([4, 2], [[], [0, 0]])}


@pytest.mark.parametrize("case", EDGES)
def test_matches_each_sequence_alone_and_opcheck(case):
    prompts, groups = EDGES[case]
    (q, k, v), n, cu, sizes = layout(prompts, groups)
    out = ops_cuda.shared_prompt_attention(q, k, v, n, *cu, *sizes, 0.3)
    torch.testing.assert_close(out, naive(q, k, v, prompts, groups, 0.3), atol=1e-12, rtol=0)
    torch.library.opcheck(torch.ops.fw.shared_prompt_attention.default, (q, k, v, n, *cu, *sizes, 0.3))
    out, lse = torch.ops.fw.shared_prompt_attention(q, k, v, n, *cu, *sizes, 0.3)
    torch.library.opcheck(torch.ops.fw.shared_prompt_attention_backward.default,
                          (torch.randn_like(out), q, k, v, out, lse, n, *cu, *sizes, 0.3))


def test_gradients_match_numerical_ones():
    """A prompt key's gradients sum over its prompt's tokens and every completion of its group."""
    # gradcheck's cost grows with inputs x outputs: two query heads on one key head (still grouped) of width 4
    # check the same sums as the wider default layout
    (q, k, v), n, cu, sizes = layout(PROMPTS, GROUPS, hq=2, hk=1, d=4, seed=1)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *x: ops_cuda.shared_prompt_attention(*x, n, *cu, *sizes, 0.3), inputs)
    torch.library.opcheck(torch.ops.fw.shared_prompt_attention.default, (*inputs, n, *cu, *sizes, 0.3))


def _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, scale):
    """float64 stand-in for flash's varlen forward: the causal mask aligned bottom right; a query without keys gets
    out 0 and logsumexp +inf, as flash gives."""
    rep, out = q.shape[1] // k.shape[1], torch.zeros_like(q)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    for (qs, qe), (ks, ke) in zip(itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()), strict=True):
        assert qe - qs <= max_q and ke - ks <= max_k and max_q >= 2   # never flash's one-query path
        if ke == ks:
            lse[:, qs:qe] = float("inf")
            continue
        s = torch.einsum("qhd,khd->hqk", q[qs:qe], k[ks:ke].repeat_interleave(rep, 1)) * scale
        if causal:
            n, L = qe - qs, ke - ks
            s = s.masked_fill(torch.arange(L)[None, :] > (L - n + torch.arange(n))[:, None], float("-inf"))
        lse[:, qs:qe] = s.logsumexp(-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[ks:ke].repeat_interleave(rep, 1))
    return out, lse, None, None, None


def _flash_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, scale):
    """float64 stand-in for flash's varlen backward from the given out and logsumexp."""
    # flash's formula from the given (merged) out and lse: dS = P (dP - rowsum(dO * O)), P = exp(S - lse)
    rep, hk, d = q.shape[1] // k.shape[1], k.shape[1], k.shape[2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (qs, qe), (ks, ke) in zip(itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()), strict=True):
        if qe == qs or ke == ks:
            continue
        kk, vv = (x[ks:ke].repeat_interleave(rep, 1) for x in (k, v))
        s = torch.einsum("qhd,khd->hqk", q[qs:qe], kk) * scale
        if causal:
            n, L = qe - qs, ke - ks
            s = s.masked_fill(torch.arange(L)[None, :] > (L - n + torch.arange(n))[:, None], float("-inf"))
        p = (s - lse[:, qs:qe, None]).exp()
        do = grad_out[qs:qe]
        ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - (do * out[qs:qe]).sum(-1).T[..., None])
        dq[qs:qe] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        dk[ks:ke] = (torch.einsum("hqk,qhd->khd", ds, q[qs:qe]) * scale).reshape(ke - ks, hk, rep, d).sum(2)
        dv[ks:ke] = torch.einsum("hqk,qhd->khd", p, do).reshape(ke - ks, hk, rep, d).sum(2)
    return dq, dk, dv


@pytest.mark.parametrize("case", EDGES)
def test_the_cuda_paths_merge_and_split_on_a_float64_flash(case, monkeypatch):
    """The CUDA forward's merge of its two flash calls and its backward's split into two flash backwards, run with
    a float64 stand-in for flash: they give the reference's output, logsumexp and gradients."""
    # the module, which ops_cuda's function of the same name hides as an attribute
    spa = importlib.import_module("ops_cuda.shared_prompt_attention")
    prompts, groups = EDGES[case]
    (q, k, v), n, cu, sizes = layout(prompts, groups, seed=2)
    monkeypatch.setattr(spa, "flash_serves", lambda q: True)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", _flash_forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", _flash_backward)
    out, lse = spa._shared_prompt_attention_cuda(q, k, v, n, *cu, *sizes, 0.3)
    want_out, want_lse = shared_prompt_attention_reference(q, k, v, n, *cu, *sizes, 0.3)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    grad = torch.randn_like(out)
    got = spa._shared_prompt_attention_backward_cuda(grad, q, k, v, out, lse, n, *cu, *sizes, 0.3)
    want = spa.shared_prompt_attention_backward_reference(grad, q, k, v, want_out, want_lse, n, *cu, *sizes, 0.3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def _tokens(x):
    """cuDNN's [B, H, S, D] view as [B * S, H, D] tokens."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _cu(rows, n):
    return torch.arange(rows + 1, dtype=torch.int32) * n


def _cudnn_forward(calls):
    def forward(q, k, v, bias, want_lse, dropout, causal, debug, scale):
        """float64 stand-in for cuDNN's attention over equal rows q [B, H, S, D], k, v [B, Hk, Sk, D] (the causal
        mask aligned top left), returning its layouts: out over [B, S, H, D] memory, lse [B, H, S, 1]."""
        B, S, Sk = q.shape[0], q.shape[2], k.shape[2]
        assert bias is None and want_lse and dropout == 0.0 and not debug and (S == Sk or not causal)
        calls.append(("forward", B, causal))
        out, lse, *_ = _flash_forward(_tokens(q), _tokens(k), _tokens(v), _cu(B, S), _cu(B, Sk), S, Sk, 0.0, causal,
                                      False, scale)
        return (out.view(B, S, *out.shape[1:]).transpose(1, 2), lse.view(-1, B, S).transpose(0, 1).unsqueeze(-1),
                None, None, S, Sk, None, None, None)
    return forward


def _cudnn_backward(calls):
    def backward(grad_out, q, k, v, out, lse, seed, offset, bias, cu_q, cu_k, max_q, max_k, dropout, causal, scale):
        """float64 stand-in for cuDNN's backward from the given out and lse [B, H, S, 1]."""
        B, H, S, Sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        assert bias is None and cu_q is None and cu_k is None and (max_q, max_k) == (S, Sk)
        assert lse.shape == (B, H, S, 1) and lse.is_contiguous()
        calls.append(("backward", B, causal))
        grads = _flash_backward(_tokens(grad_out), _tokens(q), _tokens(k), _tokens(v), _tokens(out),
                                lse[..., 0].transpose(0, 1).reshape(H, -1), _cu(B, S), _cu(B, Sk), S, Sk, 0.0, causal,
                                None, None, scale)
        return tuple(g.view(B, -1, *g.shape[1:]).transpose(1, 2) for g in grads)
    return backward


# equal completions: the completions' part runs as equal rows (cuDNN), and the part over the prompts where every
# prompt and every group's tokens have one length; (rows, causal) of each cuDNN forward, in order
DENSE = {"equal rows": (([3, 3, 3], [[4, 4], [4, 4], [4, 4]]), [(6, True), (3, False)]),
         "ragged prompts": (([2, 4, 1], [[5, 5], [5], [5, 5, 5]]), [(6, True)]),
         "no prompt token": (([0, 0], [[3, 3], [3]]), [(3, True)]),
         "an empty completion": (([2, 2], [[3, 0], [3, 3]]), [(3, True)]),
         "a prompt longer than the completions": (([6, 2], [[3, 3], [3]]), [])}


@pytest.mark.parametrize("case", DENSE)
def test_the_cuda_equal_rows_path_on_float64_stand_ins(case, monkeypatch):
    """Equal completions go to cuDNN's attention as equal rows (views of the packed row, its logsumexp layout), the
    rest to flash: on float64 stand-ins for both, the output, logsumexp and gradients are the reference's."""
    spa = importlib.import_module("ops_cuda.shared_prompt_attention")
    (prompts, groups), want_calls = DENSE[case]
    (q, k, v), n, cu, sizes = layout(prompts, groups, seed=3)
    calls = []
    monkeypatch.setattr(spa, "flash_serves", lambda q: True)
    monkeypatch.setattr(spa, "_cudnn_serves", lambda q: True)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", _flash_forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", _flash_backward)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", _cudnn_forward(calls))
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", _cudnn_backward(calls))
    out, lse = spa._shared_prompt_attention_cuda(q, k, v, n, *cu, *sizes, 0.3)
    want_out, want_lse = shared_prompt_attention_reference(q, k, v, n, *cu, *sizes, 0.3)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    assert calls == [("forward", *c) for c in want_calls]
    calls.clear()
    grad = torch.randn_like(out)
    got = spa._shared_prompt_attention_backward_cuda(grad, q, k, v, out, lse, n, *cu, *sizes, 0.3)
    want = spa.shared_prompt_attention_backward_reference(grad, q, k, v, want_out, want_lse, n, *cu, *sizes, 0.3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert calls == [("backward", *c) for c in want_calls]


def test_dense_rows_reads_equal_rows_from_the_sizes():
    from ops_cuda.shared_prompt_attention import dense_rows

    # (tokens, prompt tokens, groups, sequences, max prompt, max group, max sequence)
    assert dense_rows(9 + 24, 9, 3, 3 + 6, 3, 8, 4) == (4, True)      # 3 prompts of 3, 3 groups of 2 rows of 4
    assert dense_rows(9 + 24, 9, 3, 3 + 6, 3, 12, 4) == (4, False)    # groups of 1, 2 and 3 rows
    assert dense_rows(7 + 24, 7, 3, 3 + 6, 4, 8, 4) == (4, False)     # prompts of 2, 4 and 1
    assert dense_rows(8 + 9, 8, 2, 2 + 3, 6, 6, 6) == (0, False)      # a prompt longer than the completions
    assert dense_rows(6 + 23, 6, 2, 2 + 6, 3, 12, 4) == (0, False)    # completions of 4 but one of 3
    assert dense_rows(9, 0, 2, 2 + 3, 0, 6, 3) == (3, False)          # no prompt token
    assert dense_rows(6, 6, 2, 2, 3, 0, 3) == (0, False)              # no completion


def test_bad_arguments_name_the_argument():
    (q, k, v), n, (cu_p, cu_g, cu_s), sizes = layout(PROMPTS, GROUPS)
    with pytest.raises(ValueError, match="`cu_groups` must be int32"):
        ops_cuda.shared_prompt_attention(q, k, v, n, cu_p, cu_g.long(), cu_s, *sizes, 0.3)
    with pytest.raises(ValueError, match="same groups"):
        ops_cuda.shared_prompt_attention(q, k, v, n, cu_p[:-1], cu_g, cu_s, *sizes, 0.3)
    with pytest.raises(ValueError, match="shapes disagree"):
        ops_cuda.shared_prompt_attention(q, k[:-1], v[:-1], n, cu_p, cu_g, cu_s, *sizes, 0.3)
    with pytest.raises(ValueError, match=r"`k` must be \[T, Hk, D\]"):
        ops_cuda.shared_prompt_attention(q, k[0], v, n, cu_p, cu_g, cu_s, *sizes, 0.3)
    with pytest.raises(ValueError, match="prompt_tokens 99 must lie in"):
        ops_cuda.shared_prompt_attention(q, k, v, 99, cu_p, cu_g, cu_s, *sizes, 0.3)


def ragged_groups(n_groups: int, size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(60, 180, (n_groups,), generator=g).tolist()
    groups = [torch.randint(1, 257, (size,), generator=g).tolist() for _ in range(n_groups)]
    groups[1][3] = 0            # an empty completion
    groups[2] = [0] * size      # a group whose completions are all empty
    return prompts, groups


CUDA_CASES = {"groups of 8, U[1, 256]": ragged_groups(6, 8, 0),
              # every group one token: flash's one-query path would serve it, which the op must avoid
              "one token a group": ([116, 3, 40], [[1], [0, 1], [1, 0]])}


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_cuda_forward_and_backward_against_float64(case, dtype, tol):
    from ops_cuda.varlen_attention import flash_serves

    prompts, groups = CUDA_CASES[case]
    tensors, n, cu, sizes = layout(prompts, groups, hq=16, hk=8, d=128, dtype=dtype, device="cuda")
    assert flash_serves(tensors[0])
    inputs = [t.requires_grad_() for t in tensors]
    scale = 128 ** -0.5
    out = ops_cuda.shared_prompt_attention(*inputs, n, *(c.cuda() for c in cu), *sizes, scale)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad)
    x64 = [t.detach().double().cpu().requires_grad_() for t in inputs]
    out64 = ops_cuda.shared_prompt_attention(*x64, n, *cu, *sizes, scale)
    want = torch.autograd.grad(out64, x64, grad.double().cpu())
    err = (out.double().cpu() - out64.detach()).norm() / out64.norm()
    assert err < tol, err
    # the merged logsumexp is what the backward reads
    _, lse = torch.ops.fw.shared_prompt_attention(*(t.detach() for t in inputs), n, *(c.cuda() for c in cu), *sizes,
                                                  scale)
    lse64 = shared_prompt_attention_reference(*(t.detach() for t in x64), n, *cu, *sizes, scale)[1]
    assert (lse.double().cpu() - lse64).abs().max() < 1e-3
    for name, a, b in zip(("q", "k", "v"), got, want, strict=True):
        err = (a.double().cpu() - b).norm() / b.norm()
        assert err < 2 * tol, (name, err)


DENSE_CUDA = {"4 groups of 8 x 64 after prompts of 40": (([40] * 4, [[64] * 8] * 4), [(32, True), (4, False)]),
              "ragged prompts": (([20, 7, 33], [[40] * 4] * 3), [(12, True)]),
              "prompts longer than the completions": (([64, 64], [[16] * 4] * 2), [])}


@pytest.mark.gpu
@pytest.mark.parametrize("case", DENSE_CUDA)
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_cuda_equal_rows_through_cudnn_against_float64(case, dtype, tol, monkeypatch):
    """Equal completions run through cuDNN's attention (counted by a wrapper around the real calls) where it serves:
    outputs, logsumexps and gradients against the float64 reference, as the flash path's are."""
    spa = importlib.import_module("ops_cuda.shared_prompt_attention")
    (prompts, groups), want_calls = DENSE_CUDA[case]
    calls = []
    for name in ("_cudnn_forward", "_cudnn_backward"):
        real = getattr(spa, name)
        monkeypatch.setattr(spa, name, lambda *a, real=real, name=name: calls.append((name, a[-3], a[-2])) or real(*a))
    tensors, n, cu, sizes = layout(prompts, groups, hq=16, hk=8, d=128, dtype=dtype, device="cuda")
    if not spa._cudnn_serves(tensors[0]):
        pytest.skip("cuDNN's attention does not serve here (before Hopper, or FW_CUDNN_ATTENTION=0)")
    inputs = [t.requires_grad_() for t in tensors]
    scale = 128 ** -0.5
    out, lse = torch.ops.fw.shared_prompt_attention(*inputs, n, *(c.cuda() for c in cu), *sizes, scale)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad)
    assert calls == [(f, *c) for f in ("_cudnn_forward", "_cudnn_backward") for c in want_calls]
    x64 = [t.detach().double().cpu().requires_grad_() for t in inputs]
    out64, lse64 = shared_prompt_attention_reference(*x64, n, *cu, *sizes, scale)
    want = torch.autograd.grad(ops_cuda.shared_prompt_attention(*x64, n, *cu, *sizes, scale), x64, grad.double().cpu())
    assert (out.double().cpu() - out64).norm() / out64.norm() < tol
    assert (lse.double().cpu() - lse64).abs().max() < 1e-3
    for name, a, b in zip(("q", "k", "v"), got, want, strict=True):
        err = (a.double().cpu() - b).norm() / b.norm()
        assert err < 2 * tol, (name, err)
