"""ops_cuda.shared_prompt_attention: completions attend to their group's prompt (stored once) and causally to
themselves. Checked against each whole sequence's attention computed naively in float64, finite differences, opcheck,
and on CUDA (two flash calls merged by logsumexp, two flash backwards) against the float64 reference."""
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


def test_matches_each_sequence_alone_and_opcheck():
    (q, k, v), n, cu, sizes = layout(PROMPTS, GROUPS)
    out = ops_cuda.shared_prompt_attention(q, k, v, n, *cu, *sizes, 0.3)
    torch.testing.assert_close(out, naive(q, k, v, PROMPTS, GROUPS, 0.3), atol=1e-12, rtol=0)
    torch.library.opcheck(torch.ops.fw.shared_prompt_attention.default, (q, k, v, n, *cu, *sizes, 0.3))
    out, lse = torch.ops.fw.shared_prompt_attention(q, k, v, n, *cu, *sizes, 0.3)
    torch.library.opcheck(torch.ops.fw.shared_prompt_attention_backward.default,
                          (torch.randn_like(out), q, k, v, out, lse, n, *cu, *sizes, 0.3))


def test_gradients_match_numerical_ones():
    """A prompt key's gradients sum over its prompt's tokens and every completion of its group."""
    (q, k, v), n, cu, sizes = layout(PROMPTS, GROUPS, seed=1)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *x: ops_cuda.shared_prompt_attention(*x, n, *cu, *sizes, 0.3), inputs)
    torch.library.opcheck(torch.ops.fw.shared_prompt_attention.default, (*inputs, n, *cu, *sizes, 0.3))


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
