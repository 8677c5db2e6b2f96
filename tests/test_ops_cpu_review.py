"""CPU review of the fw operators' Python layer: edge shapes the references must take as the CUDA kernels do, and
argument checks that name the op and the argument instead of failing deep inside (or not at all)."""
from __future__ import annotations

import pytest
import torch

import ops_cuda
from framework.rollout.sampling import SamplingParams, draw


# ------------------------------------------------------------------ sample: an empty batch
@pytest.mark.parametrize("top_k", [0, 5], ids=["plain", "top_k"])
@pytest.mark.parametrize("with_counters", [False, True], ids=["rows", "counters"])
def test_sample_takes_an_empty_batch(top_k, with_counters):
    """No rows in, no tokens out, on the plain path (inverse CDF) as on the filtered one (Gumbel-max), as the CUDA
    kernel returns them for B = 0."""
    counters = torch.zeros(0, 2, dtype=torch.long) if with_counters else None
    tokens, logprob = ops_cuda.sample(torch.randn(0, 300), 0.7, top_k, 1.0, 0.0, 3, counters)
    assert tokens.shape == (0,) and tokens.dtype == torch.int64
    assert logprob.shape == (0,) and logprob.dtype == torch.float32


def test_cpu_rollout_draw_takes_an_empty_batch():
    """The CPU rollout's draw (the same inverse CDF) on no rows."""
    params = SamplingParams(max_new_tokens=4, temperature=0.7)
    tokens, logprob = draw(torch.randn(0, 300), params, 3, torch.zeros(0, 2, dtype=torch.long))
    assert tokens.shape == (0,) and logprob.shape == (0,)


# ------------------------------------------------------------------ attention: positions of another shape
@pytest.mark.parametrize("shape", [(1, 4), (2, 3), (1, 3)], ids=["longer", "more-rows", "fewer-rows"])
def test_attention_refuses_positions_of_another_shape(shape):
    """positions must be q's [B, T]: a longer row failed inside scaled_dot_product_attention's mask, more rows
    than q's in its output check, and one row for two queries' rows was broadcast over them without a word."""
    B = 2 if shape == (1, 3) else 1
    q, k = torch.randn(B, 3, 4, 8), torch.randn(B, 3, 2, 8)
    positions = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^ops_cuda\.attention: `positions` must be \[B, T\] = \(\d, 3\) \(q's first "
                                         rf"two sizes\), got \({shape[0]}, {shape[1]}\)$"):
        ops_cuda.attention(q, k, k, positions, 0.3)


# ------------------------------------------------------------------ adamw_step: tensors that do not fit their parameter
def _adamw_lists(bad: str) -> tuple[list, ...]:
    """Two tensors: a plain one that fits, then an 8-bit one (512 elements, two blocks) spoiled as `bad` says."""
    empty = torch.empty(0)
    p0, g0 = torch.randn(4), torch.randn(4)
    n = 512
    p1, g1 = torch.randn(n), torch.randn(n)
    m1, v1 = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ms1, vs1 = torch.ones(2), torch.ones(2)
    qmap = torch.linspace(-1, 1, 256)
    if bad == "gradient":
        g1 = torch.randn(1)   # broadcast over the parameter by the reference
    elif bad == "exp_avg":
        m1 = m1.view(n, 1)
    elif bad == "scales":
        ms1 = torch.ones(1)
    elif bad == "codes":
        m1 = torch.zeros(n)
    elif bad == "qmap":
        qmap = torch.linspace(-1, 1, 16)
    return [p0, p1], [g0, g1], [torch.zeros(4), m1], [empty, ms1], [torch.zeros(4), v1], [empty, vs1], qmap, qmap.abs()


@pytest.mark.parametrize("bad,message", [
    ("gradient", r"tensor 1: the gradient is \(1,\), its parameter \(512,\): they must have one shape"),
    ("exp_avg", r"tensor 1: the exp_avg is \(512, 1\), its parameter \(512,\): they must have one shape"),
    ("scales", r"tensor 1: 8-bit moments need uint8 codes .* one scale per block of 256 \(got 1 and 2\)"),
    ("codes", r"tensor 1: 8-bit moments need uint8 codes \(got torch.float32 and torch.uint8\)"),
    ("qmap", r"the quantization maps must hold 256 values each, got 16 and 16"),
], ids=["gradient", "exp_avg", "scales", "codes", "qmap"])
def test_adamw_step_refuses_tensors_that_do_not_fit_their_parameter(bad, message):
    """The CUDA host code refuses these; the reference broadcast a one-element gradient over the parameter without a
    word, or failed part-way (the first parameter already stepped) with an error naming neither op nor tensor. Now
    every tensor is checked before any is touched."""
    lists = _adamw_lists(bad)
    before = lists[0][0].clone()
    with pytest.raises(ValueError, match=rf"^ops_cuda\.adamw_step: {message}"):
        ops_cuda.adamw_step(*lists, lr=0.1, betas=(0.9, 0.99), weight_decay=0.0, eps=1e-8, step=1)
    assert torch.equal(lists[0][0], before)


# ------------------------------------------------------------------ no key/value heads, no head size
def _no_heads_cases():
    long = torch.long
    q3, none3 = torch.randn(4, 2, 8), torch.randn(4, 0, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    no_pool, tables, lengths = torch.randn(2, 0, 4, 8), torch.tensor([[0, 1]]), torch.tensor([3])
    pos = torch.arange(4)
    yield "attention", lambda: ops_cuda.attention(torch.randn(1, 4, 2, 8), none3[None], none3[None], None, 0.3)
    yield "varlen_attention", lambda: ops_cuda.varlen_attention(q3, none3, none3, cu, 4, 0.3)
    yield "varlen_suffix_attention", lambda: ops_cuda.varlen_suffix_attention(q3, none3, none3, cu, cu, 4, 4, 0.3)
    yield "shared_prompt_attention", lambda: ops_cuda.shared_prompt_attention(
        q3, none3, none3, 4, torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32), cu,
        4, 0, 4, 0.3)
    yield "decode_attention", lambda: ops_cuda.decode_attention(
        torch.randn(1, 2, 8), torch.randn(1, 0, 5, 8), torch.randn(1, 0, 5, 8), lengths, 0.3)
    yield "paged_decode_attention", lambda: ops_cuda.paged_decode_attention(
        torch.randn(1, 2, 8), no_pool, no_pool, tables, lengths, 0.3)
    yield "paged_prefill_attention", lambda: ops_cuda.paged_prefill_attention(
        torch.randn(3, 2, 8), no_pool, no_pool, tables, torch.tensor([0, 3]), lengths, 0.3)
    yield "qk_norm_rope", lambda: ops_cuda.qk_norm_rope(torch.randn(4, 32), pos, torch.randn(8), torch.randn(8),
                                                        1e-6, 1e4, 0)
    yield "qk_norm_rope", lambda: ops_cuda.qk_norm_rope(torch.randn(4, 32), pos, torch.randn(8), torch.randn(8),
                                                        1e-6, 1e4, -1)
    yield "qk_norm_rope", lambda: ops_cuda.qk_norm_rope(torch.randn(4, 32), pos, torch.randn(0), torch.randn(0),
                                                        1e-6, 1e4, 1)
    yield "qk_norm_rope_write", lambda: ops_cuda.qk_norm_rope_write(
        torch.randn(4, 32), pos, torch.randn(8), torch.randn(8), 1e-6, 1e4, no_pool, no_pool,
        torch.zeros(4, dtype=long), torch.arange(4))
    yield "qk_norm_rope_write", lambda: ops_cuda.qk_norm_rope_write(
        torch.randn(4, 32), pos, torch.randn(0), torch.randn(0), 1e-6, 1e4, torch.randn(2, 1, 4, 0),
        torch.randn(2, 1, 4, 0), torch.zeros(4, dtype=long), torch.arange(4))


@pytest.mark.parametrize("op,call", list(_no_heads_cases()),
                         ids=[f"{op}-{i}" for i, (op, _) in enumerate(_no_heads_cases())])
def test_no_key_value_heads_or_head_size_is_a_shape_error(op, call):
    """Zero key/value heads (or a zero head size, or a kv head count below 1) is refused as the shapes' error of the
    op; the checks took the query heads modulo 0 (ZeroDivisionError: integer modulo by zero), or let a negative
    count reach torch.split, or ran with no kv heads at all."""
    with pytest.raises(ValueError, match=rf"^ops_cuda\.{op}: shapes disagree: "):
        call()
