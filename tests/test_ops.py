"""CPU tests of the fw operators: opcheck, gradcheck in float64, agreement with independent references
(transformers' Qwen3 modules, plain per-document attention, cross-entropy, hand-computed sampling sets,
Random123 Philox known answers), sampler statistics, torch.compile(fullgraph=True), the build lock."""
from __future__ import annotations

import importlib
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import ops_cuda
from ops_cuda import extension as fw_build
from ops_cuda.sample import gumbel_noise, inverse_cdf, philox4x32, row_uniform53, sample_reference, sampling_mask

D64 = torch.float64


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    assert not a.isnan().any()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def logprob_entropy64(z, t):
    """Independent float64 reference: (logprob of targets t, 0 where t < 0; entropy) of softmax(z)."""
    logp = z.log_softmax(-1)
    return torch.where(t < 0, 0.0, logp.gather(1, t.clamp(min=0)[:, None]).squeeze(1)), -(logp.exp() * logp).sum(-1)


# ------------------------------------------------------------------ opcheck (schema, fake, autograd, AOT)
def op_args():
    q = torch.randn(2, 5, 4, 8, requires_grad=True)
    k = torch.randn(2, 5, 2, 8, requires_grad=True)
    v = torch.randn(2, 5, 2, 8, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    h, w = torch.randn(6, 16, requires_grad=True), torch.randn(30, 16, requires_grad=True)
    t = torch.tensor([1, 2, -100, 4, 29, 0])
    _, ent, lse, empty, _ = torch.ops.fw.linear_logprob(h.detach(), w.detach(), t, 0.8)
    # bf16 operands keeping their logits, in chunks of 8 columns (the last one 6 wide)
    hb, wb = h.detach().bfloat16().requires_grad_(True), w.detach().bfloat16().requires_grad_(True)
    _, ent_b, lse_b, saved, offsets = torch.ops.fw.linear_logprob(hb.detach(), wb.detach(), t, 0.8, 8)
    # varlen: sequences of 3, 2, 0 and 5 tokens (an empty one too), GQA 4:2
    qv = torch.randn(10, 4, 8, requires_grad=True)
    kv, vv = torch.randn(10, 2, 8, requires_grad=True), torch.randn(10, 2, 8, requires_grad=True)
    cu = torch.tensor([0, 3, 5, 5, 10], dtype=torch.int32)
    out_v, lse_v = torch.ops.fw.varlen_attention(qv.detach(), kv.detach(), vv.detach(), cu, 5, 0.3)
    return {
        "rms_norm": [(torch.randn(3, 7, 16, requires_grad=True), torch.randn(16, requires_grad=True), 1e-6)],
        "rms_norm_backward": [(torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), 1e-5)],
        "rope": [(q, k, pos, 1e4, False), (q, k, pos, 1e6, True)],
        "swiglu": [(torch.randn(3, 2, 12, requires_grad=True),)],
        "swiglu_backward": [(torch.randn(3, 6), torch.randn(3, 12))],
        "attention": [(q, k, v, None, 0.3), (q, k, v, pos, 0.3)],
        "varlen_attention": [(qv, kv, vv, cu, 5, 0.3), (qv.detach().bfloat16(), kv.detach().bfloat16(),
                                                        vv.detach().bfloat16(), cu, 5, 0.3)],
        "varlen_attention_backward": [(torch.randn(10, 4, 8), qv.detach(), kv.detach(), vv.detach(), out_v, lse_v,
                                       cu, 5, 0.3)],
        "decode_attention": [(torch.randn(2, 4, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8),
                              torch.tensor([3, 7]), 0.35)],
        "linear_logprob": [(h, w, t, 0.8), (hb, wb, t, 0.8, 8)],
        "linear_logprob_backward": [(torch.randn(6), torch.randn(6), h.detach(), w.detach(), t, lse, ent, empty, empty,
                                     0.8),
                                    (torch.randn(6), torch.randn(6), hb.detach(), wb.detach(), t, lse_b, ent_b, saved,
                                     offsets, 0.8, 8),
                                    (torch.randn(6), torch.randn(6), h.detach(), w.detach(), t, lse, ent, empty, empty,
                                     0.8, 0, False)],
        "sample": [(torch.randn(3, 50), 0.8, 5, 0.9, 0.05, 123), (torch.randn(3, 50), 0.0, 0, 1.0, 0.0, 1)],
        "add_rms_norm": [(torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), 1e-6),
                         (torch.randn(2, 3, 16).bfloat16(), torch.randn(2, 3, 16), torch.randn(16), 1e-5),
                         (torch.randn(3, 16).bfloat16(), torch.randn(3, 16), torch.randn(16), 1e-5, torch.bfloat16)],
        "add_rms_norm_backward": [(torch.randn(3, 16), torch.randn(3, 16).bfloat16(), torch.randn(3, 16),
                                   torch.randn(16), 1e-6, torch.bfloat16),
                                  (torch.randn(3, 16), torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), 1e-6,
                                   torch.float32)],
        "qk_norm_rope": [(torch.randn(5, (4 + 2 * 2) * 8, requires_grad=True), torch.tensor([0, 3, 9, 1, 40]),
                          torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True), 1e-6, 1e4, 2),
                         (torch.randn(3, (2 + 2 * 1) * 8).bfloat16(), torch.tensor([0, 1, 2]), torch.randn(8),
                          torch.randn(8), 1e-6, 1e6, 1),
                         (torch.randn(1, (4 + 2 * 2) * 8), torch.tensor([3]), torch.randn(8), torch.randn(8), 1e-6,
                          1e4, 2)],   # one token: v's rows are contiguous in qkv, and still a copy
        "qk_norm_rope_backward": [(torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8),
                                   torch.randn(5, (4 + 2 * 2) * 8), torch.tensor([0, 3, 9, 1, 40]), torch.randn(8),
                                   torch.randn(8), 1e-6, 1e4)],
        "qk_norm_rope_write": [(torch.randn(5, (4 + 2 * 2) * 8), torch.tensor([0, 3, 9, 1, 40]), torch.randn(8),
                                torch.randn(8), 1e-6, 1e4, torch.zeros(6, 2, 4, 8), torch.zeros(6, 2, 4, 8),
                                torch.tensor([1, 1, 2, 5, 0]), torch.tensor([0, 3, 1, 2, 0]))],
    }


@pytest.mark.parametrize("name", list(op_args()))
def test_opcheck(name):
    for args in op_args()[name]:
        torch.library.opcheck(getattr(torch.ops.fw, name).default, args)


# ------------------------------------------------------------------ gradcheck in float64
def test_gradcheck():
    x, w = torch.randn(3, 5, 8, dtype=D64, requires_grad=True), torch.randn(8, dtype=D64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ops_cuda.rms_norm(a, b, 1e-6), (x, w))
    q = torch.randn(2, 4, 4, 6, dtype=D64, requires_grad=True)
    k = torch.randn(2, 4, 2, 6, dtype=D64, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 3], [5, 9, 100, 40000]])
    assert torch.autograd.gradcheck(lambda a, b: ops_cuda.rope(a, b, pos, 1e6), (q, k))
    assert torch.autograd.gradgradcheck(lambda a, b: ops_cuda.rope(a, b, pos, 1e6), (q, k))
    gu = torch.randn(3, 2, 10, dtype=D64, requires_grad=True)
    assert torch.autograd.gradcheck(ops_cuda.swiglu, (gu,))
    h, wl = torch.randn(7, 5, dtype=D64, requires_grad=True), torch.randn(11, 5, dtype=D64, requires_grad=True)
    t = torch.tensor([1, 2, -100, 4, 5, 10, 0])
    assert torch.autograd.gradcheck(lambda a, b: ops_cuda.linear_logprob(a, b, t, 0.7, True), (h, wl))
    v = torch.randn(2, 4, 2, 6, dtype=D64, requires_grad=True)
    pk = torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])
    assert torch.autograd.gradcheck(lambda a, b, c: ops_cuda.attention(a, b, c, pk, 0.4), (q, k, v))
    qv = torch.randn(9, 6, 4, dtype=D64, requires_grad=True)   # GQA 6:2, sequences of 4, 0, 1 and 4 tokens
    kv, vv = torch.randn(9, 2, 4, dtype=D64, requires_grad=True), torch.randn(9, 2, 4, dtype=D64, requires_grad=True)
    cu = torch.tensor([0, 4, 4, 5, 9], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a, b, c: ops_cuda.varlen_attention(a, b, c, cu, 4, 0.6), (qv, kv, vv))
    qkv = torch.randn(5, (4 + 2 * 2) * 6, dtype=D64, requires_grad=True)
    qw, kw = torch.randn(6, dtype=D64, requires_grad=True), torch.randn(6, dtype=D64, requires_grad=True)
    p5 = torch.tensor([0, 1, 7, 2, 40000])
    assert torch.autograd.gradcheck(lambda a, b, c: ops_cuda.qk_norm_rope(a, p5, b, c, 1e-6, 1e6, 2), (qkv, qw, kw))


# ------------------------------------------------------------------ agreement with independent references
@pytest.mark.parametrize("shape", [(1, 1), (3, 1024), (2, 7, 16, 128), (5, 13)])
def test_rms_norm_matches_transformers(shape):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    hf = Qwen3RMSNorm(shape[-1], eps=1e-6).double()
    with torch.no_grad():
        hf.weight.copy_(torch.randn(shape[-1]))
    x = torch.randn(shape, dtype=D64)
    assert rel(ops_cuda.rms_norm(x, hf.weight, 1e-6), hf(x)) < 1e-6  # HF computes in fp32 even for float64
    x32 = x.float()
    assert rel(ops_cuda.rms_norm(x32, hf.weight.float(), 1e-6), hf(x)) < 1e-6
    xb = x.bfloat16()
    out = ops_cuda.rms_norm(xb, hf.weight.float(), 1e-6)
    assert out.dtype == torch.bfloat16 and rel(out, hf(xb.double())) < 8e-3


@pytest.mark.parametrize("B,T,Hq,Hk,D,theta", [(1, 1, 1, 1, 2, 1e4), (2, 9, 16, 8, 128, 1e6), (1, 5, 3, 1, 6, 500.0)])
def test_rope_matches_transformers(B, T, Hq, Hk, D, theta):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    cfg = Qwen3Config(head_dim=D, rope_theta=theta, hidden_size=D * Hq, num_attention_heads=Hq,
                      num_key_value_heads=Hk, max_position_embeddings=50000)
    rot = Qwen3RotaryEmbedding(cfg)
    q, k = torch.randn(B, T, Hq, D), torch.randn(B, T, Hk, D)
    pos = torch.randint(0, 4096, (B, T))
    cos, sin = rot(q, pos)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    q_fw, k_fw = ops_cuda.rope(q, k, pos, theta)
    assert rel(q_fw, q_hf.transpose(1, 2)) < 1e-6 and rel(k_fw, k_hf.transpose(1, 2)) < 1e-6


def test_add_rms_norm_matches_the_formula_and_the_separate_ops():
    x, r, w = torch.randn(4, 3, 24, dtype=D64), torch.randn(4, 3, 24, dtype=D64), torch.randn(24, dtype=D64)
    h, y = ops_cuda.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, r + x)
    assert rel(y, (r + x) / ((r + x).square().mean(-1, keepdim=True) + 1e-6).sqrt() * w) < 1e-14
    # what the rollout's forward computed before the fusion: bit for bit, a bf16 x under a float32 residual too
    xb, r32 = x.bfloat16(), r.float()
    h, y = ops_cuda.add_rms_norm(xb, r32, w.float(), 1e-6)
    assert h.dtype == y.dtype == torch.float32
    assert torch.equal(h, r32 + xb) and torch.equal(y, ops_cuda.rms_norm(r32 + xb, w.float(), 1e-6))
    with pytest.raises(ValueError, match="must promote to residual's dtype"):
        ops_cuda.add_rms_norm(r32, xb, w.float(), 1e-6)
    # the norm in x's dtype: one rounding of the float32 norm, as autocast's cast of it before a matmul
    h, yb = ops_cuda.add_rms_norm(xb, r32, w.float(), 1e-6, torch.bfloat16)
    assert h.dtype == torch.float32 and yb.dtype == torch.bfloat16 and torch.equal(yb, y.bfloat16())
    with pytest.raises(ValueError, match="out_dtype must be x's"):
        ops_cuda.add_rms_norm(xb, r32, w.float(), 1e-6, torch.float16)


def test_add_rms_norm_gradients_are_those_of_the_separate_add_and_norm():
    """gradcheck in float64, and the gradients of both outputs against autograd through `r + x` and the norm's
    formula."""
    x, r = torch.randn(4, 3, 24, dtype=D64, requires_grad=True), torch.randn(4, 3, 24, dtype=D64, requires_grad=True)
    w = torch.randn(24, dtype=D64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: ops_cuda.add_rms_norm(a, b, c, 1e-6), (x, r, w))
    gh, gy = torch.randn(4, 3, 24, dtype=D64), torch.randn(4, 3, 24, dtype=D64)
    h, y = ops_cuda.add_rms_norm(x, r, w, 1e-6)
    got = torch.autograd.grad((h * gh).sum() + (y * gy).sum(), (x, r, w))
    s = r + x
    y_ref = s / (s.square().mean(-1, keepdim=True) + 1e-6).sqrt() * w
    want = torch.autograd.grad((s * gh).sum() + (y_ref * gy).sum(), (x, r, w))
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) < 1e-13
    # only the sum used: the norm's weight gets a zero gradient, x and r the sum's
    h, _ = ops_cuda.add_rms_norm(x, r, w, 1e-6)
    gx, gr, gw = torch.autograd.grad((h * gh).sum(), (x, r, w), allow_unused=True)
    assert torch.equal(gx, gh) and torch.equal(gr, gh) and not gw.any()


def hf_qk_norm_rope(Hq: int, Hk: int, D: int, theta: float, q_weight, k_weight):
    """transformers' q_norm and k_norm in float64 with the given weights, and its rotary embedding."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

    cfg = Qwen3Config(head_dim=D, rope_theta=theta, hidden_size=D * Hq, num_attention_heads=Hq,
                      num_key_value_heads=Hk, max_position_embeddings=4096)
    norm_q, norm_k = Qwen3RMSNorm(D, 1e-6).double(), Qwen3RMSNorm(D, 1e-6).double()
    with torch.no_grad():
        norm_q.weight.copy_(q_weight)
        norm_k.weight.copy_(k_weight)
    return norm_q, norm_k, Qwen3RotaryEmbedding(cfg)


@pytest.mark.parametrize("dtype", [D64, torch.float32])
def test_qk_norm_rope_write_matches_the_separate_ops(dtype):
    """Against transformers' QK-norm and rotary embedding, and bit for bit the separate fw ops the rollout's
    forward ran before the fusion, with only the addressed pool entries written."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    N, Hq, Hk, D, theta = 7, 4, 2, 16, 1e6
    qkv = torch.randn(N, (Hq + 2 * Hk) * D, dtype=dtype)
    pos = torch.tensor([0, 5, 17, 3, 100, 2, 64])
    qw, kw = torch.randn(D, dtype=dtype), torch.randn(D, dtype=dtype)
    blocks, offsets = torch.tensor([3, 3, 1, 4, 2, 1, 0]), torch.tensor([0, 1, 7, 2, 3, 0, 5])
    k_pool, v_pool = torch.full((5, Hk, 8, D), 7.0, dtype=dtype), torch.full((5, Hk, 8, D), 7.0, dtype=dtype)
    q = ops_cuda.qk_norm_rope_write(qkv, pos, qw, kw, 1e-6, theta, k_pool, v_pool, blocks, offsets)
    q_in, k_in, v_in = qkv.view(N, Hq + 2 * Hk, D).split([Hq, Hk, Hk], 1)
    # transformers, in float64
    norm_q, norm_k, rotary = hf_qk_norm_rope(Hq, Hk, D, theta, qw, kw)
    cos, sin = rotary(q_in.double(), pos[None])
    q_hf, k_hf = apply_rotary_pos_emb(norm_q(q_in.double())[None].transpose(1, 2),
                                      norm_k(k_in.double())[None].transpose(1, 2), cos, sin)
    assert rel(q, q_hf.transpose(1, 2)[0]) < 1e-6
    assert rel(k_pool[blocks, :, offsets], k_hf.transpose(1, 2)[0]) < 1e-6
    assert torch.equal(v_pool[blocks, :, offsets], v_in)
    written = torch.zeros(5, 8, dtype=torch.bool)
    written[blocks, offsets] = True
    assert (k_pool.transpose(1, 2)[~written] == 7.0).all() and (v_pool.transpose(1, 2)[~written] == 7.0).all()
    # the separate ops
    q_sep, k_sep = ops_cuda.rope(ops_cuda.rms_norm(q_in, qw, 1e-6)[None], ops_cuda.rms_norm(k_in, kw, 1e-6)[None],
                                 pos[None], theta)
    assert torch.equal(q, q_sep[0]) and torch.equal(k_pool[blocks, :, offsets], k_sep[0])


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (finite) clamped to +-448 and rounded to the nearest float8_e4m3fn value, ties to the even code, in float64:
    from the table of e4m3's values, without torch's cast."""
    codes = torch.arange(127, dtype=torch.uint8)   # the non-negative values; code 127 is NaN
    table = codes.view(torch.float8_e4m3fn).double()
    a = x.double().abs().clamp(max=448.0)[..., None]
    dist = (a - table).abs()
    nearest = dist == dist.min(-1, keepdim=True).values
    even = nearest & (codes % 2 == 0)   # a tie is between neighbouring codes: one of them is even
    pick = torch.where(nearest.sum(-1) > 1, even.int().argmax(-1), nearest.int().argmax(-1))
    return table[pick] * x.double().sign()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qk_norm_rope_write_rounds_into_fp8_pools(dtype):
    """float8_e4m3fn pools: each k and v is the separate ops' value in qkv's dtype, rounded to nearest e4m3 and
    saturated at +-448 (torch's clamp-and-cast bit for bit, and the nearest value of e4m3's table), NaN stays NaN;
    q is the separate ops' in qkv's dtype; only the addressed entries are written."""
    fp8 = torch.float8_e4m3fn
    N, Hq, Hk, D, theta = 7, 4, 2, 16, 1e6
    qkv = torch.randn(N, (Hq + 2 * Hk) * D).to(dtype)
    qkv[2] *= 1000   # this token's v beyond 448
    qkv[4, -1] = float("nan")   # the last element of the last v head
    pos = torch.tensor([0, 5, 17, 3, 100, 2, 64])
    kw = 100 * torch.randn(D)
    kw[0] = 1e4   # every head's k beyond 448 at pair 0, others below
    qw, kw = torch.randn(D).to(dtype), kw.to(dtype)
    blocks, offsets = torch.tensor([3, 3, 1, 4, 2, 1, 0]), torch.tensor([0, 1, 7, 2, 3, 0, 5])
    fill = torch.full((5, Hk, 8, D), 7.0).to(fp8)
    k_pool, v_pool = fill.clone(), fill.clone()
    q = ops_cuda.qk_norm_rope_write(qkv, pos, qw, kw, 1e-6, theta, k_pool, v_pool, blocks, offsets)
    q_in, k_in, v_in = qkv.view(N, Hq + 2 * Hk, D).split([Hq, Hk, Hk], 1)
    q_sep, k_sep = ops_cuda.rope(ops_cuda.rms_norm(q_in, qw, 1e-6)[None], ops_cuda.rms_norm(k_in, kw, 1e-6)[None],
                                 pos[None], theta)
    assert q.dtype == dtype and torch.equal(q, q_sep[0])
    for pool, x in ((k_pool, k_sep[0]), (v_pool, v_in)):
        got = pool[blocks, :, offsets]
        assert (x.abs() > 448).any() and (x.abs() < 448).any()   # saturated and rounded values both
        assert torch.equal(got.view(torch.uint8), x.clamp(-448, 448).to(fp8).view(torch.uint8))
        finite = ~x.isnan()
        assert torch.equal(got.double()[finite], nearest_e4m3(x[finite]))
    assert v_pool[blocks[4], -1, offsets[4], -1].isnan() and (~v_pool.isnan()).sum() == v_pool.numel() - 1
    written = torch.zeros(5, 8, dtype=torch.bool)
    written[blocks, offsets] = True
    for pool in (k_pool, v_pool):
        assert (pool.transpose(1, 2)[~written].view(torch.uint8) == fill.view(torch.uint8)[0, 0, 0, 0]).all()


def test_qk_norm_rope_write_fp8_pools_opcheck():
    """opcheck with float8_e4m3fn pools, but for test_schema: its mutation check compares the pools with a kernel
    torch has no float8 version of."""
    for dtype in (torch.float32, torch.bfloat16):
        args = (torch.randn(5, (4 + 2 * 2) * 8).to(dtype), torch.tensor([0, 3, 9, 1, 40]), torch.randn(8),
                torch.randn(8), 1e-6, 1e4, torch.zeros(6, 2, 4, 8, dtype=torch.float8_e4m3fn),
                torch.zeros(6, 2, 4, 8, dtype=torch.float8_e4m3fn), torch.tensor([1, 1, 2, 5, 0]),
                torch.tensor([0, 3, 1, 2, 0]))
        torch.library.opcheck(torch.ops.fw.qk_norm_rope_write.default, args,
                              test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_qk_norm_rope_write_refuses_pools_of_a_third_dtype():
    """Pools must be qkv's dtype or float8_e4m3fn, both the same; the message names both options."""
    qkv, pos, w = torch.randn(3, (2 + 2 * 1) * 8), torch.tensor([0, 1, 2]), torch.randn(8)
    idx = torch.tensor([0, 1, 2])
    msg = r"must both be qkv's dtype \(torch.float32\) or torch.float8_e4m3fn"
    for k_dtype, v_dtype in ((torch.float16, torch.float16), (torch.float8_e4m3fn, torch.float32),
                             (torch.float32, torch.float8_e4m3fn)):
        k_pool, v_pool = torch.zeros(3, 1, 4, 8, dtype=k_dtype), torch.zeros(3, 1, 4, 8, dtype=v_dtype)
        with pytest.raises(ValueError, match=msg):
            ops_cuda.qk_norm_rope_write(qkv, pos, w, w, 1e-6, 1e4, k_pool, v_pool, idx, idx)


def test_qk_norm_rope_matches_transformers_forward_and_backward():
    """The training op against transformers' QK-norm and rotary embedding in float64: q, k, v and the gradients
    of qkv and both norm weights (autograd through transformers' modules); a gradient left out counts as zero."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    N, Hq, Hk, D, theta = 9, 4, 2, 16, 1e6
    qkv = torch.randn(N, (Hq + 2 * Hk) * D, dtype=D64, requires_grad=True)
    pos = torch.tensor([0, 1, 2, 0, 1, 9, 300, 4095, 17])
    qw = torch.randn(D, dtype=D64, requires_grad=True)
    kw = torch.randn(D, dtype=D64, requires_grad=True)
    q, k, v = ops_cuda.qk_norm_rope(qkv, pos, qw, kw, 1e-6, theta, Hk)
    assert q.shape == (N, Hq, D) and k.shape == v.shape == (N, Hk, D)
    norm_q, norm_k, rotary = hf_qk_norm_rope(Hq, Hk, D, theta, qw, kw)
    x = qkv.detach().clone().requires_grad_(True)
    q_in, k_in, v_in = x.view(N, Hq + 2 * Hk, D).split([Hq, Hk, Hk], 1)
    cos, sin = rotary(x, pos[None])
    q_hf, k_hf = apply_rotary_pos_emb(norm_q(q_in)[None].transpose(1, 2), norm_k(k_in)[None].transpose(1, 2), cos, sin)
    q_hf, k_hf = q_hf.transpose(1, 2)[0], k_hf.transpose(1, 2)[0]
    assert rel(q, q_hf) < 1e-6 and rel(k, k_hf) < 1e-6 and torch.equal(v, v_in)
    # transformers computes the angles in float32, as fw does: the gradients are compared with its forward's
    gq, gk, gv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    got = torch.autograd.grad((q * gq).sum() + (k * gk).sum() + (v * gv).sum(), (qkv, qw, kw))
    want = torch.autograd.grad((q_hf * gq).sum() + (k_hf * gk).sum() + (v_in * gv).sum(),
                               (x, norm_q.weight, norm_k.weight))
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) < 1e-6
    # v unused: its part of d(qkv) is zero
    q, k, _ = ops_cuda.qk_norm_rope(qkv, pos, qw, kw, 1e-6, theta, Hk)
    (g,) = torch.autograd.grad((q * gq).sum() + (k * gk).sum(), (qkv,))
    assert not g[:, (Hq + Hk) * D:].any() and g[:, :(Hq + Hk) * D].abs().min() > 0


def test_qk_norm_rope_arguments():
    """Bad shapes get one clear error; norm weights in neither float32 nor qkv's dtype (bf16 weights under fp16
    activations) are used as float32, and their gradients come back in their own dtype."""
    N, Hq, Hk, D = 6, 4, 2, 32
    pos = torch.tensor([3, 0, 1, 2, 50, 7])
    qkv = torch.randn(N, (Hq + 2 * Hk) * D, dtype=torch.float16, requires_grad=True)
    qw = torch.randn(D).bfloat16().requires_grad_(True)
    kw = torch.randn(D).bfloat16().requires_grad_(True)
    with pytest.raises(ValueError, match="shapes disagree"):
        ops_cuda.qk_norm_rope(qkv[:, :-1], pos, qw, kw, 1e-6, 1e6, Hk)
    with pytest.raises(ValueError, match="`positions` has 5 entries for 6 tokens"):
        ops_cuda.qk_norm_rope(qkv, pos[:5], qw, kw, 1e-6, 1e6, Hk)
    q, k, _ = ops_cuda.qk_norm_rope(qkv, pos, qw, kw, 1e-6, 1e6, Hk)
    q32, k32, _ = ops_cuda.qk_norm_rope(qkv, pos, qw.float(), kw.float(), 1e-6, 1e6, Hk)
    assert q.dtype == torch.float16 and torch.equal(q, q32) and torch.equal(k, k32)
    gq, gk = torch.autograd.grad((q.float().sum() + k.float().square().sum()), (qw, kw))
    assert gq.dtype == gk.dtype == torch.bfloat16 and gq.abs().sum() > 0


def test_swiglu_matches_formula():
    gu = torch.randn(4, 3, 2 * 37, dtype=D64)
    g, u = gu[..., :37], gu[..., 37:]
    assert rel(ops_cuda.swiglu(gu), g / (1 + torch.exp(-g)) * u) < 1e-14


def naive_attention(q, k, v, positions, scale):
    """Per-document causal softmax attention in float64, one query at a time."""
    B, T, Hq, D = q.shape
    rep = Hq // k.shape[2]
    out = torch.zeros(B, T, Hq, D, dtype=D64)
    for b in range(B):
        start = 0
        for t in range(T):
            if positions is not None and t > 0 and positions[b, t] != positions[b, t - 1] + 1:
                start = t
            for h in range(Hq):
                kk, vv = k[b, start:t + 1, h // rep].double(), v[b, start:t + 1, h // rep].double()
                p = torch.softmax(kk @ q[b, t, h].double() * scale, 0)
                out[b, t, h] = p @ vv
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_attention_matches_naive(packed):
    B, T, Hq, Hk, D = 2, 11, 4, 2, 8
    q, k, v = torch.randn(B, T, Hq, D), torch.randn(B, T, Hk, D), torch.randn(B, T, Hk, D)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 0, 1, 2], list(range(T))]) if packed else None
    out = ops_cuda.attention(q, k, v, pos, 0.3)
    assert out.shape == (B, T, Hq, D) and rel(out, naive_attention(q, k, v, pos, 0.3)) < 1e-5


def test_varlen_attention_matches_naive():
    """Packed rows flattened to [N, H, D]: the per-document float64 attention, in float32 and bfloat16."""
    B, T, Hq, Hk, D = 2, 11, 4, 2, 8
    q, k, v = torch.randn(B, T, Hq, D), torch.randn(B, T, Hk, D), torch.randn(B, T, Hk, D)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 7, 8, 9], list(range(T))])
    expected = naive_attention(q, k, v, pos, 0.3).reshape(B * T, Hq, D)
    cu, longest = ops_cuda.packed_sequences(pos)
    assert cu.tolist() == [0, 4, 7, 8, 11, 22] and longest == 11
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
        flat = [t.reshape(B * T, -1, D).to(dtype) for t in (q, k, v)]
        out = ops_cuda.varlen_attention(*flat, cu, longest, 0.3)
        assert out.shape == (B * T, Hq, D) and out.dtype == dtype and rel(out, expected) < tol


def test_varlen_attention_backward_matches_float64_autograd():
    """The backward op against autograd through the float64 per-document attention of test_attention."""
    torch.manual_seed(3)
    B, T, Hq, Hk, D = 1, 13, 6, 3, 8
    q, k, v = (torch.randn(B, T, h, D, dtype=D64, requires_grad=True) for h in (Hq, Hk, Hk))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3, 4, 5]])
    grad = torch.randn(B, T, Hq, D, dtype=D64)
    ref = torch.autograd.grad(naive_attention(q, k, v, pos, 0.5), (q, k, v), grad)
    flat = [t.detach().float().reshape(T, -1, D).requires_grad_(True) for t in (q, k, v)]
    cu, longest = ops_cuda.packed_sequences(pos)
    got = torch.autograd.grad(ops_cuda.varlen_attention(*flat, cu, longest, 0.5), flat, grad.float().reshape(T, Hq, D))
    for g, r in zip(got, ref, strict=True):
        assert rel(g, r.reshape(g.shape)) < 1e-5


def test_packed_sequences_rule():
    """Every row starts a sequence (even when its positions continue the previous row's), and so does any
    position that is not previous+1; a row of one sequence has no other bound."""
    pos = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0], [3, 4, 5, 6]])
    cu, longest = ops_cuda.packed_sequences(pos)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 4, 6, 7, 8, 12] and longest == 4


def test_decode_attention_matches_naive():
    B, Hq, Hk, S, D = 3, 8, 2, 9, 16
    q, kc, vc = torch.randn(B, Hq, D), torch.randn(B, Hk, S, D), torch.randn(B, Hk, S, D)
    lengths = torch.tensor([9, 1, 0])
    out = ops_cuda.decode_attention(q, kc, vc, lengths, 0.25)
    for b in range(B):
        for h in range(Hq):
            n = int(lengths[b])
            if n == 0:
                assert out[b, h].abs().max() == 0
                continue
            p = torch.softmax(kc[b, h // 4, :n].double() @ q[b, h].double() * 0.25, 0)
            assert rel(out[b, h], p @ vc[b, h // 4, :n].double()) < 1e-5


@pytest.mark.parametrize("tile_bytes", [None, 4 * 50 * 3])  # default, and 3 rows per chunk (many chunks)
def test_linear_logprob_matches_cross_entropy(monkeypatch, tile_bytes):
    if tile_bytes:
        # the module, not the function of the same name that ops_cuda re-exports
        monkeypatch.setattr(importlib.import_module("ops_cuda.linear_logprob"), "LOGITS_TILE_BYTES", tile_bytes)
    N, d, V, temp = 10, 12, 50, 0.6
    h = torch.randn(N, d, dtype=D64, requires_grad=True)
    w = torch.randn(V, d, dtype=D64, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[3] = -100
    lp, ent = ops_cuda.linear_logprob(h, w, t, temp, return_entropy=True)
    logits = h @ w.T / temp
    ce = F.cross_entropy(logits, t, reduction="none", ignore_index=-100)
    assert rel(lp, -ce) < 1e-12 and lp[3] == 0
    assert rel(ent, torch.distributions.Categorical(logits=logits).entropy()) < 1e-12
    g1, g2 = torch.randn(N, dtype=D64), torch.randn(N, dtype=D64)
    grads = torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), (h, w))
    ent_ref = torch.distributions.Categorical(logits=logits).entropy()
    grads_ref = torch.autograd.grad((-ce * g1).sum() + (ent_ref * g2).sum(), (h, w))
    assert all(rel(a, b) < 1e-10 for a, b in zip(grads, grads_ref))
    lp32, ent32 = ops_cuda.linear_logprob(h.float(), w.bfloat16(), t, temp)
    assert lp32.dtype == torch.float32 and ent32 is None


def test_linear_logprob_under_autocast_runs_in_bf16():
    h = torch.randn(9, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    t = torch.randint(0, 40, (9,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = ops_cuda.linear_logprob(h, w, t)
    expected = F.log_softmax(h.bfloat16().double() @ w.bfloat16().double().T, -1).gather(1, t[:, None])[:, 0]
    assert lp.dtype == torch.float32 and rel(lp, expected) < 1e-6  # the bf16-rounded operands, fp32 maths
    gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32


def _logprob_grads(h, w, t, temp, save_logits):
    h, w = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
    lp, ent = ops_cuda.linear_logprob(h, w, t, temp, return_entropy=True, save_logits=save_logits)
    g1, g2 = torch.linspace(-1, 1, len(t)), torch.linspace(0.5, -0.3, len(t))
    return (lp, ent), torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), (h, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_logprob_saved_logits(dtype):
    """bf16/fp16 operands with save_logits: the forward keeps z minus each chunk's max in float16 and the chunk
    maxima; the outputs equal the recomputing path's, and the gradients from the kept logits match float64
    autograd of the same (rounded) operands within fp16's rounding of the shifted logits."""
    N, d, V, temp = 11, 16, 50, 0.7
    h, w = torch.randn(N, d).to(dtype), (torch.randn(V, d) / 2).to(dtype)
    t = torch.randint(0, V, (N,))
    t[[2, 7]] = -100
    lp, ent, lse, saved, off = torch.ops.fw.linear_logprob(h, w, t, temp, 8)  # 7 chunks, the last one 2 wide
    z = h.double() @ w.double().T / temp
    assert saved.shape == (N, V) and saved.dtype == torch.float16 and off.shape == (N, 7)
    expect_off = torch.stack([z[:, c:c + 8].amax(-1) for c in range(0, V, 8)], 1)
    assert rel(off, expect_off) < 1e-6
    shifted = z - expect_off.repeat_interleave(8, 1)[:, :V]
    assert (saved.double() - shifted).abs().max() <= 2.0 ** -11 * shifted.abs().max() + 1e-6
    assert (saved <= 0).all() and (saved == 0).sum() >= N * 7  # every chunk's max is stored as exactly 0
    plain = torch.ops.fw.linear_logprob(h, w, t, temp)
    assert plain[3].numel() == 0 and all(torch.equal(a, b) for a, b in zip((lp, ent, lse), plain[:3]))

    (lp_s, ent_s), grads_s = _logprob_grads(h, w, t, temp, save_logits=True)
    (lp_r, _), grads_r = _logprob_grads(h, w, t, temp, save_logits=False)
    assert torch.equal(lp_s, lp_r)
    h64, w64 = h.double().requires_grad_(True), w.double().requires_grad_(True)
    lp64, ent64 = logprob_entropy64(h64 @ w64.T / temp, t)
    g1, g2 = torch.linspace(-1, 1, N, dtype=D64), torch.linspace(0.5, -0.3, N, dtype=D64)
    grads64 = torch.autograd.grad((lp64 * g1).sum() + (ent64 * g2).sum(), (h64, w64))
    assert rel(lp_s, lp64) < 1e-6 and rel(ent_s, ent64) < 1e-6
    bound = {torch.bfloat16: 8e-3, torch.float16: 1.5e-3}[dtype]  # the gradients' own rounding to dtype
    for gs, gr, g64 in zip(grads_s, grads_r, grads64):
        # the kept logits' fp16 rounding (2^-11 relative) adds little to the gradients' rounding to dtype
        assert rel(gr, g64) < bound and rel(gs, g64) < 1.25 * rel(gr, g64) + 1e-5


def _kept_for_backward(fn) -> list[tuple[torch.dtype, tuple]]:
    """(dtype, shape) of every tensor autograd saves while `fn` runs."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_linear_logprob_saved_logits_only_when_useful():
    """The wrapper keeps an fp16 [N, V] for the backward only with save_logits, 16-bit operands (also under
    autocast) and a backward to come: not under no_grad, without requires_grad, or for fp32 / fp64 operands."""
    h, w, t = torch.randn(4, 8), torch.randn(20, 8), torch.tensor([1, 2, 3, 4])

    def kept(a, b, save=True, grad=True):
        with torch.set_grad_enabled(grad):
            return (torch.float16, (4, 20)) in _kept_for_backward(
                lambda: ops_cuda.linear_logprob(a, b, t, save_logits=save))

    hb, wb = h.bfloat16().requires_grad_(True), w.bfloat16().requires_grad_(True)
    assert kept(hb, wb)
    assert kept(h.half(), w.half().requires_grad_(True))  # the weight alone needs a gradient
    assert not kept(hb, wb, save=False) and not kept(hb, wb, grad=False)
    assert not kept(h.bfloat16(), w.bfloat16())
    assert not kept(h.requires_grad_(True), w) and not kept(h.double(), w.double().requires_grad_(True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kept(h, w.requires_grad_(True))
    assert torch.ops.fw.linear_logprob(h, w, t, 1.0, 8)[3].numel() == 0
    assert torch.ops.fw.linear_logprob(h.bfloat16(), w.bfloat16(), t, 1.0, 0)[3].numel() == 0


def test_linear_logprob_backward_reads_the_kept_logits():
    """Given kept logits of other hidden states h2, the backward's dz comes from them, not from recomputing
    hidden @ W.T: grad_hidden = dz(h2) W / T and grad_weight = dz(h2)^T h / T, checked in float64."""
    N, d, V, temp = 6, 8, 30, 0.8
    h, h2, w = torch.randn(N, d).bfloat16(), torch.randn(N, d).bfloat16(), torch.randn(V, d).bfloat16()
    t = torch.tensor([1, 2, -100, 4, 29, 0])
    _, ent2, lse2, saved2, off2 = torch.ops.fw.linear_logprob(h2, w, t, temp, 8)
    g1, g2 = torch.linspace(-1, 1, N), torch.linspace(0.5, -0.5, N)
    gh, gw = torch.ops.fw.linear_logprob_backward(g1, g2, h, w, t, lse2, ent2, saved2, off2, temp, 8)
    z2 = (h2.double() @ w.double().T / temp).requires_grad_(True)
    lp, ent = logprob_entropy64(z2, t)
    (dz,) = torch.autograd.grad((lp * g1.double()).sum() + (ent * g2.double()).sum(), z2)
    assert rel(gh, dz @ w.double() / temp) < 8e-3 and rel(gw, dz.T @ h.double() / temp) < 8e-3
    recomputed = torch.ops.fw.linear_logprob_backward(g1, g2, h, w, t, lse2, ent2, torch.empty(0), torch.empty(0),
                                                      temp)
    assert rel(recomputed[0], gh) > 0.1  # the recomputing path would have used h's logits


def test_linear_logprob_frozen_weight_gets_no_gradient():
    """A frozen weight (LoRA's lm_head): grad_hidden is the float64 one, the weight gets no .grad, and the
    backward op returns an empty grad_weight instead of a [V, d] one."""
    N, d, V, temp = 5, 8, 30, 0.7
    h = torch.randn(N, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, d, dtype=torch.float64)
    t = torch.tensor([1, 2, -100, 4, 29])
    lp, ent = ops_cuda.linear_logprob(h, w, t, temp, return_entropy=True)
    (lp.sum() + 0.3 * ent.sum()).backward()
    z = (h.detach() @ w.T / temp).requires_grad_(True)
    lp64, ent64 = logprob_entropy64(z, t)
    (dz,) = torch.autograd.grad(lp64.sum() + 0.3 * ent64.sum(), z)
    assert w.grad is None and rel(h.grad, dz @ w / temp) < 1e-10
    _, ent2, lse2, empty, _ = torch.ops.fw.linear_logprob(h.detach(), w, t, temp)
    _, gw = torch.ops.fw.linear_logprob_backward(torch.ones(N), torch.ones(N), h.detach(), w, t, lse2, ent2,
                                                 empty, empty, temp, 0, False)
    assert gw.numel() == 0


def test_linear_logprob_saved_logits_beyond_fp16_range():
    """At a tiny temperature the shifted logits leave fp16's range: stored as -65504, their probability and
    entropy term are 0, and the gradients stay finite and match float64."""
    h = torch.tensor([[1.0, -2.0], [0.5, 3.0]]).bfloat16()
    w = torch.tensor([[100.0, 0.0], [-100.0, 0.0], [0.0, 100.0], [1.0, 1.0]]).bfloat16()
    t = torch.tensor([0, 2])
    temp = 1e-3
    saved = torch.ops.fw.linear_logprob(h, w, t, temp, 8)[3]
    assert saved.min() == -65504
    outs, (gh, gw) = _logprob_grads(h, w, t, temp, save_logits=True)
    outs_r, (gh_r, gw_r) = _logprob_grads(h, w, t, temp, save_logits=False)
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_r))
    assert gh.isfinite().all() and gw.isfinite().all()
    assert torch.allclose(gh.float(), gh_r.float(), rtol=1e-2, atol=1e-2)
    assert torch.allclose(gw.float(), gw_r.float(), rtol=1e-2, atol=1e-2)


def test_linear_logprob_saved_logits_compile_fullgraph():
    h = torch.randn(9, 16).bfloat16().requires_grad_(True)
    w = torch.randn(40, 16).bfloat16().requires_grad_(True)
    t = torch.randint(0, 40, (9,))

    def f(a, b):
        lp, ent = ops_cuda.linear_logprob(a, b, t, 0.9, return_entropy=True, save_logits=True)
        return lp.sum() + 0.5 * ent.sum()

    ge = torch.autograd.grad(f(h, w), (h, w))
    gc = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(h, w), (h, w))
    assert all(torch.equal(a, b) for a, b in zip(gc, ge))


# ------------------------------------------------------------------ sampler
def test_philox_known_answers():
    """Random123 philox4x32-10 known-answer vectors."""
    def run(ctr, key):
        c = [torch.tensor([x], dtype=torch.int64) for x in ctr]
        return [int(x) for x in philox4x32(*c, *key)]

    assert run((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert run((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF)) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert run((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_gumbel_noise_stream_layout():
    """Column c of row r uses word c % 4 of Philox(counter (c // 4, r, 0, 0), key = the 64-bit seed)."""
    seed = (7 << 32) | 123
    g = gumbel_noise(3, 10, seed)
    for r, c in [(0, 0), (1, 5), (2, 9), (2, 3)]:
        def one(v):
            return torch.tensor([v], dtype=torch.int64)

        word = int(philox4x32(one(c // 4), one(r), one(0), one(0), 123, 7)[c % 4])
        u = ((word >> 9) + 0.5) * 2.0**-23
        assert abs(float(g[r, c]) - (-math.log(-math.log(u)))) < 1e-5


def test_row_uniform53_stream_layout():
    """Row b's uniform: ((w0 << 21) | (w1 >> 11) + 0.5) * 2^-53 from the first two words of Philox(counter (c1, c2,
    1, 0), key = the 64-bit seed), (c1, c2) its counters."""
    seed = (9 << 32) | 77
    counters = torch.tensor([[0, 0], [5, 3], [2**32 + 4, 1]])
    u = row_uniform53(seed, counters)
    for b, (c1, c2) in enumerate([(0, 0), (5, 3), (4, 1)]):
        w = [int(x) for x in philox4x32(*(torch.tensor([v]) for v in (c1, c2, 1, 0)), 77, 9)]
        bits = ((w[0] << 21) | (w[1] >> 11)) & ((1 << 53) - 1)
        assert float(u[b]) == (bits + 0.5) * 2.0**-53


@pytest.mark.parametrize("with_counters", [False, True])
def test_plain_sampling_is_the_inverse_cdf_at_the_rows_uniform(with_counters):
    """Without top-k / top-p / min-p the reference draws the first column whose running mass, summed here in
    Python, exceeds u x the row's mass, u the row's uniform ((b, 0) without counters)."""
    B, V, T, seed = 6, 1000, 0.8, 31
    logits = 2 * torch.randn(B, V, dtype=D64)
    counters = torch.randint(0, 2**40, (B, 2)) if with_counters else None
    tok, lp = sample_reference(logits, T, 0, 1.0, 0.0, seed, counters)
    rows = torch.stack([torch.arange(B), torch.zeros(B, dtype=torch.long)], 1)   # (b, 0): row b's stream
    u = row_uniform53(seed, counters if with_counters else rows)
    for b in range(B):
        z = [float(v) / T for v in logits[b]]
        m = max(z)
        mass = [math.exp(v - m) for v in z]
        target, run = float(u[b]) * math.fsum(mass), 0.0
        want = next(j for j, e in enumerate(mass) if (run := run + e) > target)
        assert int(tok[b]) == want
        assert abs(float(lp[b]) - (z[want] - m - math.log(math.fsum(mass)))) < 1e-6


def test_inverse_cdf_draws_only_columns_with_mass():
    """inverse_cdf over hand-made rows of 300 columns (3 chunks, the last padded): the first column whose running
    mass passes u x the total; at u = 1 (the total itself) the last column with mass, never a zero column after it
    or a padding column."""
    p = torch.zeros(6, 300)
    p[:3, [1, 3, 4]] = torch.tensor([0.25, 0.5, 0.25])   # running mass 0.25, 0.75, 1 at columns 1, 3, 4
    p[3, 200] = 1.0
    p[4, [127, 128]] = torch.tensor([0.5, 0.5])           # the two sides of a chunk boundary
    p[5, [127, 128]] = torch.tensor([0.5, 0.5])
    u = torch.tensor([0.3, 0.1, 1.0, 1.0, 0.6, 0.4], dtype=torch.float64)
    assert inverse_cdf(p, u).tolist() == [3, 1, 4, 200, 128, 127]


def test_plain_sample_nan_logits_hand_computed():
    """Plain sampling's reference with NaN logits (plain_mass): a NaN carries no mass, as -inf does. A row of 300
    columns (three chunks of inverse_cdf) holds masses 1 : 3 : 4 at columns 1, 4 and 200 and NaN in every chunk, so
    its uniform u draws column 1 below 1/8, column 4 below 1/2 and column 200 above, for each row's own counters in
    any batch slot, and the same as with -inf for the NaN; its logprob is NaN, as the full softmax's is. Rows without
    mass draw column 0: all NaN, NaN among -inf, all -inf, a +inf among finite logits (exp(inf - inf) is NaN)."""
    nan, inf, V, B = float("nan"), float("inf"), 300, 48
    row = torch.full((V,), -inf, dtype=D64)
    row[[1, 4, 200]] = torch.tensor([0.0, math.log(3.0), math.log(4.0)], dtype=D64)
    row[[0, 2, 130, 299]] = nan
    counters = torch.stack([torch.arange(B) * 5 + 1, torch.full((B,), 3)], 1)
    for seed in (0, 9):
        u = row_uniform53(seed, counters)
        expected = torch.where(u < 1 / 8, 1, torch.where(u < 1 / 2, 4, 200))
        tok, lp = ops_cuda.sample(row.expand(B, V), 1.0, 0, 1.0, 0.0, seed, counters)
        assert torch.equal(tok, expected) and set(tok.tolist()) == {1, 4, 200}
        assert lp.isnan().all()
        perm = torch.randperm(B)
        assert torch.equal(ops_cuda.sample(row.expand(B, V), 1.0, 0, 1.0, 0.0, seed, counters[perm])[0], tok[perm])
        no_nan = torch.where(row.isnan(), -inf, row)
        assert torch.equal(ops_cuda.sample(no_nan.expand(B, V), 1.0, 0, 1.0, 0.0, seed, counters)[0], tok)
    massless = torch.full((4, V), -inf, dtype=D64)
    massless[0] = nan
    massless[1, 150] = nan
    massless[3] = torch.linspace(-1.0, 1.0, V, dtype=D64)
    massless[3, 77] = inf
    for seed in range(4):
        tok, lp = sample_reference(massless, 0.7, 0, 1.0, 0.0, seed)
        assert tok.tolist() == [0, 0, 0, 0]
        assert lp[:3].isnan().all() and lp[3] == -inf   # the +inf row: finite column 0 against logsumexp inf


def test_sampling_sets_hand_computed():
    z = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]], dtype=D64)
    def keep(k, p, m):
        return sampling_mask(z, k, p, m)[0].tolist()

    assert keep(0, 0.7, 0.0) == [True, True, False, False]      # 0.5 < 0.7 <= 0.8
    assert keep(0, 0.5, 0.0) == [True, False, False, False]
    assert keep(0, 0.81, 0.0) == [True, True, True, False]
    assert keep(0, 1.0, 0.4) == [True, True, False, False]      # p >= 0.4 * 0.5
    assert keep(3, 1.0, 0.0) == [True, True, True, False]
    assert keep(3, 0.5 / 0.95 + 0.01, 0.0) == [True, True, False, False]  # top-p over the renormalised top-3
    assert keep(1, 1.0, 0.0) == [True, False, False, False]


CONFIGS = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (0.9, 8, 0.9, 0.02)]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", CONFIGS)
def test_sample_distribution(temperature, top_k, top_p, min_p):
    V, n = 20, 20_000
    row = torch.randn(V) * 1.5
    tok, lp = ops_cuda.sample(row.expand(n, V), temperature, top_k, top_p, min_p, seed=11)
    z = (row.double() / temperature)[None]
    keep = sampling_mask(z, top_k, top_p, min_p)[0]
    p = torch.where(keep, z[0].softmax(-1), 0.0)
    p = p / p.sum()
    freq = torch.bincount(tok, minlength=V).double() / n
    assert float((freq - p).abs().sum()) / 2 < 0.02  # total variation (noise about 0.01 at this n)
    assert freq[~keep].sum() == 0
    assert rel(lp, z[0].log_softmax(-1)[tok]) < 1e-6  # full-softmax logprob, not the filtered one


def test_sample_greedy_and_seed():
    logits = torch.randn(6, 40)
    tok, lp = ops_cuda.sample(logits, 0.0, 3, 0.5, 0.1, 0)
    assert torch.equal(tok, logits.argmax(-1)) and rel(lp, logits.log_softmax(-1).gather(1, tok[:, None])[:, 0]) < 1e-6
    assert torch.equal(ops_cuda.sample(logits, 1.0, 1, 1.0, 0.0, 5)[0], logits.argmax(-1))  # top_k=1 is greedy
    a = ops_cuda.sample(logits[:1].expand(500, 40), 1.0, 0, 1.0, 0.0, 5)[0]
    assert torch.equal(a, ops_cuda.sample(logits[:1].expand(500, 40), 1.0, 0, 1.0, 0.0, 5)[0])
    assert not torch.equal(a, ops_cuda.sample(logits[:1].expand(500, 40), 1.0, 0, 1.0, 0.0, 6)[0])


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match="weight"):
        ops_cuda.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="positions"):
        ops_cuda.rope(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 1, 4), torch.zeros(1, 3, dtype=torch.long), 1e4)
    with pytest.raises(ValueError, match="int64"):
        ops_cuda.rope(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 1, 4), torch.zeros(1, 2), 1e4)
    with pytest.raises(ValueError, match="2\\*I"):
        ops_cuda.swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match="Hq a multiple of Hk"):
        ops_cuda.attention(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), None, 1.0)
    with pytest.raises(ValueError, match="Hq a multiple of Hk"):
        ops_cuda.varlen_attention(torch.randn(5, 3, 4), torch.randn(5, 2, 4), torch.randn(5, 2, 4),
                                  torch.tensor([0, 5], dtype=torch.int32), 5, 1.0)
    with pytest.raises(ValueError, match="int32"):
        ops_cuda.varlen_attention(torch.randn(5, 2, 4), torch.randn(5, 2, 4), torch.randn(5, 2, 4),
                                  torch.tensor([0, 5]), 5, 1.0)
    with pytest.raises(ValueError, match="lengths"):
        ops_cuda.decode_attention(torch.randn(2, 2, 4), torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4),
                                  torch.tensor([1]), 1.0)
    with pytest.raises(ValueError, match="targets"):
        ops_cuda.linear_logprob(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        ops_cuda.linear_logprob(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), 0.0)
    with pytest.raises(IndexError, match="vocabulary"):
        ops_cuda.linear_logprob(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match="at least one token"):
        ops_cuda.linear_logprob(torch.randn(3, 4), torch.randn(0, 4), torch.zeros(3, dtype=torch.long))


# ------------------------------------------------------------------ torch.compile
def test_compile_fullgraph_every_op():
    def f(x, w, gu, q, k, v, pos, h, lm, t, qd, kc, vc, lens, logits):
        y = ops_cuda.rms_norm(x, w, 1e-6)
        a = ops_cuda.swiglu(gu)
        qr, kr = ops_cuda.rope(q, k, pos, 1e6)
        o = ops_cuda.attention(qr, kr, v, pos, 0.3) + ops_cuda.attention(qr, kr, v, None, 0.3)
        cu, longest = ops_cuda.packed_sequences(pos)   # data-dependent sequence count and length
        o = o + ops_cuda.varlen_attention(qr.flatten(0, 1), kr.flatten(0, 1), v.flatten(0, 1), cu, longest,
                                          0.3).view(o.shape)
        lp, ent = ops_cuda.linear_logprob(h, lm, t, 0.9, return_entropy=True)
        dec = ops_cuda.decode_attention(qd, kc, vc, lens, 0.3)
        tok, slp = ops_cuda.sample(logits, 0.8, 5, 0.9, 0.0, 7)
        return y.sum() + a.sum() + o.sum() + lp.sum() + ent.sum() + dec.sum() + slp.sum(), tok

    args = [torch.randn(3, 16), torch.randn(16), torch.randn(3, 20), torch.randn(2, 6, 4, 8), torch.randn(2, 6, 2, 8),
            torch.randn(2, 6, 2, 8), torch.tensor([[0, 1, 2, 0, 1, 2], [3, 4, 5, 6, 7, 8]]), torch.randn(5, 8),
            torch.randn(30, 8), torch.tensor([1, 2, 3, -100, 29]), torch.randn(2, 4, 8), torch.randn(2, 2, 5, 8),
            torch.randn(2, 2, 5, 8), torch.tensor([2, 5]), torch.randn(3, 30)]
    trained = [0, 1, 2, 3, 4, 5, 7, 8]
    for i in trained:
        args[i].requires_grad_(True)
    torch._dynamo.reset()
    eager, tok_e = f(*args)
    g_e = torch.autograd.grad(eager, [args[i] for i in trained])
    compiled, tok_c = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    g_c = torch.autograd.grad(compiled, [args[i] for i in trained])
    assert torch.equal(tok_c, tok_e) and rel(compiled, eager) < 1e-6
    assert all(rel(a, b) < 1e-6 for a, b in zip(g_c, g_e))


# ------------------------------------------------------------------ autocast: the region's dtype
def autocast_cases(device: str = "cpu") -> dict:
    """op -> (fn, inputs): float32 inputs on `device` (small on the CPU; on CUDA the shapes flash and the Hopper
    logprob kernel take) and fn(*inputs), the op's differentiable outputs; its cu tensors and targets follow the
    inputs' device, so that fn also runs on the inputs' float64 copies on the CPU."""
    from test_shared_prompt_attention import GROUPS, PROMPTS, layout

    g = torch.Generator().manual_seed(0)
    big = device != "cpu"
    hq, hk, d = (16, 8, 128) if big else (4, 2, 8)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    def cu_of(lens):
        return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).int()

    lens = [1, 300, 0, 77, 512] if big else [3, 2, 0, 5]
    cu, n = cu_of(lens), sum(lens)
    lens_q, lens_k = ([1, 17, 300, 1], [1, 300, 300, 64]) if big else ([3, 1, 5, 0], [3, 8, 5, 2])
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)
    prompts, groups = ([37, 100, 5], [[20, 0, 64], [1, 130], [9]]) if big else (PROMPTS, GROUPS)
    (q_s, k_s, v_s), p, cus, sizes = layout(prompts, groups, hq=hq, hk=hk, d=d, dtype=torch.float32, device=device)
    N, dh, V = (300, 128, 9000) if big else (11, 16, 50)
    t = torch.randint(0, V, (N,), generator=g)
    t[::4] = -100

    def varlen(q, k, v):
        return (ops_cuda.varlen_attention(q, k, v, cu.to(q.device), max(lens), 0.3),)

    def suffix(q, k, v):
        return (ops_cuda.varlen_suffix_attention(q, k, v, cu_q.to(q.device), cu_k.to(q.device), max(lens_q),
                                                 max(lens_k), 0.3),)

    def shared(q, k, v):
        return (ops_cuda.shared_prompt_attention(q, k, v, p, *(c.to(q.device) for c in cus), *sizes, 0.3),)

    def logprob(h, w):   # the recipes' call: logits kept for the backward when the operands are 16-bit
        return ops_cuda.linear_logprob(h, w, t.to(h.device), 0.8, return_entropy=True, save_logits=True)

    return {"varlen_attention": (varlen, [randn(n, hq, d), randn(n, hk, d), randn(n, hk, d)]),
            "varlen_suffix_attention": (suffix, [randn(sum(lens_q), hq, d), randn(sum(lens_k), hk, d),
                                                 randn(sum(lens_k), hk, d)]),
            "shared_prompt_attention": (shared, [q_s, k_s, v_s]),
            "linear_logprob": (logprob, [randn(N, dh), randn(V, dh, scale=dh ** -0.5)])}


def run_under_autocast(fn, inputs, device: str, dtype: torch.dtype):
    """fn on leaf copies of inputs under torch.autocast(device, dtype), then its backward (outside the region) for
    fixed random weights of the outputs: (outputs, grads, the dtype aten's attention and matmul give in the region,
    the (dtype, shape) of every tensor saved for the backward)."""
    x = [t.detach().requires_grad_(True) for t in inputs]
    a = torch.randn(1, 2, 3, 8, device=device)
    kept = []
    with torch.autocast(device, dtype=dtype):
        like = {"attention": F.scaled_dot_product_attention(a, a, a).dtype, "matmul": (a @ a.mT).dtype}
        with torch.autograd.graph.saved_tensors_hooks(lambda s: kept.append((s.dtype, tuple(s.shape))) or s,
                                                      lambda s: s):
            outs = fn(*x)
    return outs, autocast_grads(outs, x), like, kept


def autocast_grads(outs, inputs) -> tuple:
    """Gradients of sum_i <outs[i], weights_i> w.r.t. inputs, the weights random (seeded by the output shapes)."""
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=g, dtype=D64) for o in outs]
    loss = sum((o.double() * w.to(o.device)).sum() for o, w in zip(outs, weights, strict=True))
    return torch.autograd.grad(loss, inputs)


AUTOCAST_OPS = ["varlen_attention", "varlen_suffix_attention", "shared_prompt_attention", "linear_logprob"]


def check_region_dtype(op: str, fn, inputs, device: str, dtype: torch.dtype, tol: float):
    """`fn` under autocast(device, dtype) against float64 on the CPU: aten's attention and matmul give `dtype` there;
    attention outputs come in it; linear_logprob's logprobs and entropies stay float32, from operands rounded to
    it (its saved GEMM operands); outputs within `tol` and float32 gradients within 2 tol. Returns (float64 inputs,
    their outputs)."""
    outs, grads, like, kept = run_under_autocast(fn, inputs, device, dtype)
    assert like == {"attention": dtype, "matmul": dtype}
    x64 = [t.detach().double().cpu().requires_grad_(True) for t in inputs]
    outs64 = fn(*x64)
    grads64 = autocast_grads(outs64, x64)
    if op == "linear_logprob":
        h, w = inputs
        assert (dtype, tuple(h.shape)) in kept and (dtype, tuple(w.shape)) in kept   # the GEMM's operands
        assert all(o.dtype == torch.float32 for o in outs)
        rounded = fn(*(t.detach().to(dtype).double().cpu() for t in inputs))   # float64 on the rounded operands
        assert all(rel(o.cpu(), r) < 1e-5 for o, r in zip(outs, rounded, strict=True))
    else:
        assert outs[0].dtype == like["attention"]
    assert all(rel(o.cpu(), o64) < tol for o, o64 in zip(outs, outs64, strict=True))
    for gr, g64, x in zip(grads, grads64, inputs, strict=True):
        assert gr.dtype == x.dtype and rel(gr.cpu(), g64) < 2 * tol
    return x64, outs64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("op", AUTOCAST_OPS)
def test_autocast_runs_the_op_in_the_region_dtype(op, dtype):
    """float32 inputs under CPU autocast: the op runs in the region's dtype (float16 under fp16 autocast, not
    bfloat16), as aten's attention and matmul do there (`check_region_dtype`); float64 inputs are left alone."""
    fn, inputs = autocast_cases()[op]
    tol = {torch.float16: 1.5e-3, torch.bfloat16: 8e-3}[dtype]   # rounding to dtype (2^-11 or 2^-8 a value)
    x64, outs64 = check_region_dtype(op, fn, inputs, "cpu", dtype, tol)
    with torch.autocast("cpu", dtype=dtype):
        same = fn(*x64)
    assert all(o.dtype == D64 and torch.equal(o, o64) for o, o64 in zip(same, outs64, strict=True))
    # nested regions: the innermost one's dtype holds, and a disabled one leaves float32 alone
    x = [t.detach() for t in inputs]
    with torch.no_grad():
        with torch.autocast("cpu", dtype=dtype):
            alone = fn(*x)
        plain = fn(*x)
        other = torch.bfloat16 if dtype == torch.float16 else torch.float16
        with torch.autocast("cpu", dtype=other):
            with torch.autocast("cpu", dtype=dtype):
                inner = fn(*x)
            with torch.autocast("cpu", enabled=False):
                off = fn(*x)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(inner, alone, strict=True))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(off, plain, strict=True))


def test_autocast_rule_compiles_fullgraph():
    """Under fp16 autocast the four ops compile without a graph break and give eager's outputs and gradients."""
    cases = autocast_cases()

    def f(*xs):
        outs, i = [], 0
        for op in AUTOCAST_OPS:
            fn, inputs = cases[op]
            outs += fn(*xs[i:i + len(inputs)])
            i += len(inputs)
        return outs

    x = [t.requires_grad_(True) for op in AUTOCAST_OPS for t in cases[op][1]]
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.float16):
        eager = f(*x)
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*x)
    assert [o.dtype for o in compiled] == [o.dtype for o in eager] == [torch.float16] * 3 + [torch.float32] * 2
    assert all(rel(c, e) < 1e-6 for c, e in zip(compiled, eager, strict=True))
    assert all(rel(c, e) < 1e-6 for c, e in zip(autocast_grads(compiled, x), autocast_grads(eager, x), strict=True))


# ------------------------------------------------------------------ build lock and doctor
def test_lock_status_detects_stale_locks(tmp_path):
    assert fw_build.lock_status(tmp_path)[0] == "none"
    (tmp_path / "lock").touch()
    # a lock whose owner is a process that was killed mid-build
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    import json
    import socket

    (tmp_path / "owner").write_text(json.dumps({"host": socket.gethostname(), "pid": proc.pid}))
    assert fw_build.lock_status(tmp_path)[0] == "held"
    proc.kill()
    proc.wait()
    state, detail = fw_build.lock_status(tmp_path)
    assert state == "stale" and str(proc.pid) in detail and "delete" in detail
    # no owner record: stale only once older than any real build
    (tmp_path / "owner").unlink()
    assert fw_build.lock_status(tmp_path)[0] == "held"
    old = time.time() - fw_build.STALE_LOCK_AGE_S - 5
    os.utime(tmp_path / "lock", (old, old))
    assert fw_build.lock_status(tmp_path)[0] == "stale"


def test_doctor_and_build_on_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("FW_OPS_CACHE", str(tmp_path))
    assert fw_build.cache_dir().parent == tmp_path
    text = ops_cuda.doctor()
    for key in ("torch:", "GPU", "cache:", "extension built:", "build lock:"):
        assert key in text
    if torch.version.cuda is None:
        with pytest.raises(RuntimeError, match="CPU-only"):
            ops_cuda.build()


def test_build_key_follows_the_files_bytes_not_their_times(tmp_path):
    """The key of a build: the same for a copy of the same files with other times (another checkout), different
    when a header's bytes, a file's name or a flag change."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
    for name in ("op.cu", "common.cuh"):
        (a / name).write_text(f"// {name}\n")
    key = fw_build.build_key([a / "common.cuh", a / "op.cu"], ["-O3"], root=a)
    for name in ("op.cu", "common.cuh"):
        (b / name).write_text((a / name).read_text())
        os.utime(b / name, (1e9, 1e9))
    assert fw_build.build_key([b / "common.cuh", b / "op.cu"], ["-O3"], root=b) == key
    assert fw_build.build_key([b / "common.cuh", b / "op.cu"], ["-O2"], root=b) != key
    (b / "common.cuh").write_text("// common.cuh \n")
    assert fw_build.build_key([b / "common.cuh", b / "op.cu"], ["-O3"], root=b) != key
    (b / "other.cuh").write_text((a / "common.cuh").read_text())
    assert fw_build.build_key([b / "other.cuh", b / "op.cu"], ["-O3"], root=b) != key
    assert {p.suffix for p in fw_build.build_inputs()} == {".cu", ".cpp", ".cuh", ".h"}
    assert fw_build.build_dir(key).parent == fw_build.cache_dir()


def test_kernel_launches_are_checked_by_their_own_error():
    """A failed CUDA runtime call leaves its error in the thread's last-error state until cudaGetLastError reads it,
    so a launch checked through that state (<<<>>> then cudaGetLastError) reports an error that an earlier call
    left unread as its own. The sources launch through calls that return the launch's error, and only cleared()
    (common.cuh) reads the state."""
    for path in fw_build.build_inputs():
        code = re.sub(r"//[^\n]*", "", path.read_text())  # comments may name them
        assert "<<<" not in code, f"{path.name} launches a kernel with <<<>>>"
        reads = len(re.findall(r"cudaGetLastError|cudaPeekAtLastError|KERNEL_LAUNCH_CHECK", code))
        assert reads == (path.name == "common.cuh"), f"{path.name} reads CUDA's last error"


def test_prune_builds_keeps_the_newest_and_the_locked(tmp_path):
    """Builds of other keys beyond the newest few go; a build that holds its lock stays, as does the current one."""
    builds = []
    for i in range(5):
        b = tmp_path / f"key{i}"
        b.mkdir()
        (b / "built").write_text(f"key{i}\n")
        os.utime(b / "built", (1e9 + i, 1e9 + i))
        builds.append(b)
    (tmp_path / "unfinished").mkdir()   # a build without its mark: in progress or killed, not this function's
    (builds[0] / "lock").touch()        # held: a build in progress (no owner record, fresh)
    gone = fw_build.prune_builds(builds[1], keep=3)
    assert sorted(gone) == [builds[2]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key0", "key1", "key3", "key4", "unfinished"]


@pytest.mark.slow
def test_a_library_marked_for_the_same_key_loads_without_a_compile(tmp_path):
    """load_or_compile on a real (CPU) torch extension, as `build` runs it (one directory per key): the first call
    compiles and marks; a fresh process whose copy of the source has new times loads the library as it is; changed
    bytes build into another directory. The compile runs in the child process, which says whether it ran."""
    import shutil

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    code = ("import sys, torch\nfrom pathlib import Path\nfrom torch.utils import cpp_extension\n"
            "from ops_cuda.extension import build_key, load_or_compile\n"
            "src, cache = Path(sys.argv[1]), Path(sys.argv[2])\nkey = build_key([src], [], root=src.parent)\n"
            "build = cache / key[:16]\nbuild.mkdir(parents=True, exist_ok=True)\nran = []\n"
            "def compile_library():\n    ran.append(1)\n"
            "    return cpp_extension.load(name='fwtest_cached', sources=[str(src)], build_directory=str(build),\n"
            "                              is_python_module=False)\n"
            "load_or_compile(build, 'fwtest_cached', key, compile_library)\n"
            "print(bool(ran), int(torch.ops.fwtest_cached.twice(torch.ones(3)).sum()))\n")

    def run(src):
        r = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "cache")], check=False,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.split()

    op = ("#include <torch/library.h>\n#include <ATen/ATen.h>\n"
          "at::Tensor twice(const at::Tensor& x) { return x * %d; }\n"
          "TORCH_LIBRARY(fwtest_cached, m) { m.def(\"twice(Tensor x) -> Tensor\"); }\n"
          "TORCH_LIBRARY_IMPL(fwtest_cached, CPU, m) { m.impl(\"twice\", &twice); }\n")
    first, copy = tmp_path / "one" / "op.cpp", tmp_path / "two" / "op.cpp"
    for f in (first, copy):
        f.parent.mkdir()
        f.write_text(op % 2)
    os.utime(first, (1e9, 1e9))   # the copy is newer: ninja would compile it again
    assert run(first) == ["True", "6"]
    assert run(copy) == ["False", "6"]
    copy.write_text(op % 3)
    assert run(copy) == ["True", "9"]
    assert len(list((tmp_path / "cache").iterdir())) == 2


@pytest.mark.slow
def test_extension_links_the_running_libstdcxx(tmp_path):
    """A torch extension linked with a static libstdc++ (the default of some compilers) carries its own
    iostreams, and a TORCH_CHECK message formatted there comes out broken (here) or crashes the process (on
    other machines). Linked first against the libstdc++ torch runs with, as ops_cuda's build does, it is intact."""
    import shutil

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "check.cpp").write_text(
        "#include <ATen/ATen.h>\n#include <torch/library.h>\n"
        "at::Tensor check(const at::Tensor& x) {\n"
        "  TORCH_CHECK(x.size(0) == 3, \"fwtest::check: want 3 rows, got \", x.size(0), \" rows\");\n"
        "  return x;\n}\n"
        "TORCH_LIBRARY(fwtest, m) { m.def(\"check(Tensor x) -> Tensor\"); }\n"
        "TORCH_LIBRARY_IMPL(fwtest, CPU, m) { m.impl(\"check\", &check); }\n")
    code = ("import sys, torch\nfrom torch.utils import cpp_extension\n"
            "from ops_cuda.extension import running_libstdcxx\n"
            "flags = (running_libstdcxx() if sys.argv[1] == 'fixed' else []) + ['-static-libstdc++']\n"
            "cpp_extension.load(name='fwtest_' + sys.argv[1], sources=[sys.argv[2]], extra_ldflags=flags,\n"
            "                   is_python_module=False, build_directory=sys.argv[3])\n"
            "try:\n    torch.ops.fwtest.check(torch.ones(2))\nexcept RuntimeError as e:\n"
            "    print(str(e).splitlines()[0])\n")
    out = {}
    for variant in ("static", "fixed"):
        build = tmp_path / variant
        build.mkdir()
        r = subprocess.run([sys.executable, "-c", code, variant, str(tmp_path / "check.cpp"), str(build)],
                           check=False, capture_output=True, text=True, timeout=600)
        out[variant] = (r.returncode, r.stdout.strip())
    assert out["fixed"] == (0, "fwtest::check: want 3 rows, got 2 rows"), out
    assert out["static"] != out["fixed"], "the static-libstdc++ build no longer breaks: this test shows nothing"
