"""GPU tests of the fw CUDA kernels: each op against a float64 reference on fresh random inputs,
awkward shapes, freed memory poisoned with NaN before each call (an unwritten output shows as NaN),
thresholds in TOL below; opcheck and torch.compile(fullgraph) on CUDA."""
from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from test_ops import AUTOCAST_OPS, autocast_cases, check_region_dtype

import ops_cuda
from ops_cuda import library
from ops_cuda.decode_attention import decode_attention_reference
from ops_cuda.linear_logprob import linear_logprob_reference
from ops_cuda.qk_norm_rope import KERNEL_HEAD_DIMS
from ops_cuda.rms_norm import rms_norm_reference
from ops_cuda.rope import rope_cos_sin, rope_rotate
from ops_cuda.sample import is_plain, row_counters, row_uniform53, sample_reference, sampling_mask
from ops_cuda.swiglu import swiglu_reference
from ops_cuda.varlen_attention import flash_serves

pytestmark = pytest.mark.gpu
DEV = "cuda"
# relative error bounds by output dtype: fp32 arithmetic, bf16/fp16 output rounding (2^-8 / 2^-11 per element)
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1.5e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    backend = library.activate_cuda()
    assert backend == "kernels", f"the CUDA extension did not load: {library.cuda_state['error']}"


def poison() -> None:
    """Fill freed cache blocks with NaN bytes so that outputs allocated next start as NaN."""
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device=DEV) for n in (1 << 12, 1 << 16, 1 << 20, 1 << 24)]
    del blocks


def rel(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output (an element was not written)"
    o, e = out.double(), expected.double()
    return float((o - e).norm() / e.norm().clamp_min(1e-30))


def child_json(code: str, **env: str):
    """Run `code` in a child Python process with `env` added (launch overrides are read once per process) and
    return the JSON it prints last."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, **env}, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def f64(*ts):
    return [t.detach().double().requires_grad_(t.requires_grad) for t in ts]


def logprob_entropy64(z, t):
    """Independent float64 reference: (logprob of targets t, 0 where t < 0; entropy) of softmax(z)."""
    logp = z.log_softmax(-1)
    return torch.where(t < 0, 0.0, logp.gather(1, t.clamp(min=0)[:, None]).squeeze(1)), -(logp.exp() * logp).sum(-1)


def test_doctor_reports_built_extension():
    text = ops_cuda.doctor()
    assert "extension loaded: yes" in text and "CUDA ops served by: the CUDA kernels" in text


def test_a_fresh_process_loads_the_built_extension_without_compiling():
    """The library this session built is marked as the build of its sources' key: another process loads it as it
    is, with no compile (its _compile fails if called) and no toolkit check."""
    ops_cuda.build()
    code = ("import ops_cuda.extension as e\n"
            "def refuse(*_): raise AssertionError('compiled again')\n"
            "e._compile = e.nvcc_problem = refuse\n"
            "import ops_cuda, torch\nprint(ops_cuda.build())\n"
            "x = torch.randn(4, 64, device='cuda')\n"
            "print(ops_cuda.cuda_backend(), float((ops_cuda.rms_norm(x, torch.ones(64, device='cuda'), 1e-6)"
            " - x * x.square().mean(-1, keepdim=True).add(1e-6).rsqrt()).abs().max()) < 1e-5)\n")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["kernels", "True"], r.stdout


# ------------------------------------------------------------------ rms_norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1024), (7, 1000), (3, 5, 16, 128), (2048, 1024), (4, 13), (3, 2048),
                                   (5, 4096), (9, 64),
                                   # more rows than one wave of blocks (the persistent kernels' grid-stride loop
                                   # and prefetch: the backward, and the fp32 forward), a 5120-wide row (4
                                   # vectors a thread) and a row too long for registers
                                   (20000, 1024), (4096, 16, 128), (300, 5120), (3, 12288),
                                   # in 16-bit dtypes, the forward rows kernel with idle lanes: 1 and 3 vectors
                                   # on 4 lanes, 96 and 65 on 32 x 4, 48 on 32 x 2
                                   (5, 8), (33, 24), (17, 768), (11, 520), (7, 384),
                                   # the backward rows kernel's 16 x 2 (16-bit) and 32 x 2 (fp32) groups
                                   (5, 256)])
@pytest.mark.parametrize("wdtype", ["same", "fp32"])
def test_rms_norm(dtype, shape, wdtype):
    x = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEV)).to(dtype if wdtype == "same" else torch.float32)
    w.requires_grad_(True)
    g = torch.randn(shape, device=DEV, dtype=dtype)
    poison()
    y = ops_cuda.rms_norm(x, w, 1e-6)
    poison()
    gx, gw = torch.autograd.grad(y, (x, w), g)
    x64, w64 = f64(x, w)
    y64 = rms_norm_reference(x64, w64, 1e-6)
    gx64, gw64 = torch.autograd.grad(y64, (x64, w64), g.double())
    assert y.dtype == dtype and gx.dtype == dtype and gw.dtype == w.dtype
    assert rel(y, y64) < TOL[dtype]
    assert rel(gx, gx64) < TOL[dtype] * 2
    assert rel(gw, gw64) < TOL[w.dtype] * 2


@pytest.mark.parametrize("shape", [(20000, 1024), (4096, 16, 128), (33, 24)])
def test_rms_norm_grad_weight_is_deterministic(shape):
    # rows of at most 32 x 4 vectors take the backward rows kernel, whose grad_weight partials are summed in a
    # fixed order (no atomics): runs must agree bit for bit. The weight is fp32 so that grad_weight keeps every
    # bit of the sums (a bf16 one would round most differences away).
    x = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(shape[-1], device=DEV)
    g = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    runs = [torch.ops.fw.rms_norm_backward(g, x, w, 1e-6) for _ in range(3)]
    for gx, gw in runs[1:]:
        assert torch.equal(gx, runs[0][0]) and torch.equal(gw, runs[0][1])


# (x dtype, weight dtype, shape[, eps]) for the forward rows kernel, in each of its dtypes, for the test below
ROWS_KERNEL_CASES = [("bfloat16", "bfloat16", (16384, 1024)), ("bfloat16", "float32", (17, 768)),
                     ("float16", "float16", (4096, 16, 128)), ("bfloat16", "bfloat16", (33, 24)),
                     ("float32", "float32", (9, 64)), ("float16", "float32", (5, 8)),
                     # QK-norm rows: 2 short of filling the blocks, and eps 0 (both off the LEAN instances)
                     ("bfloat16", "bfloat16", (4094, 128)), ("bfloat16", "float32", (4096, 128), 0.0),
                     ("float32", "float32", (4096, 128))]


@pytest.mark.parametrize("env", [
    # the forward rows kernel loads x evict-first when the output fits in L2 and plainly otherwise
    "FW_RMS_LOAD_ONCE",
    # its LEAN instances (32-bit offsets, no end-of-rows tests, flush-to-zero rsqrt) take rows that fill its blocks
    # exactly, with eps >= FLT_MIN; the others take the rest
    "FW_RMS_ROWS_LEAN"])
def test_rms_norm_forward_launch_variants_change_no_value(env):
    # `env` (read once per process) forces either variant. Both, in child processes on the same inputs: against
    # float64, and bit-equal to each other (a cache policy or an index width must not change a value).
    code = (
        "import hashlib, json, torch\nfrom ops_cuda import library\nfrom ops_cuda.rms_norm import rms_norm_reference\n"
        "assert library.activate_cuda() == 'kernels'\ntorch.manual_seed(0)\nout = []\n"
        f"for dt, wdt, shape, *eps in {ROWS_KERNEL_CASES!r}:\n"
        "    eps = eps[0] if eps else 1e-6\n"
        "    x = torch.randn(shape, device='cuda', dtype=getattr(torch, dt))\n"
        "    w = (1 + 0.1 * torch.randn(shape[-1], device='cuda')).to(getattr(torch, wdt))\n"
        "    y = torch.ops.fw.rms_norm(x, w, eps)\n"
        "    y64 = rms_norm_reference(x.double(), w.double(), eps)\n"
        "    rel = float('nan') if y.isnan().any() else float((y.double() - y64).norm() / y64.norm())\n"
        "    digest = hashlib.sha256(y.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()\n"
        "    out.append([dt, list(shape), rel, digest])\n"
        "print(json.dumps(out))\n")
    runs = {on: child_json(code, **{env: on}) for on in ("0", "1")}
    for (dt, shape, rel0, digest0), (_, _, rel1, digest1) in zip(runs["0"], runs["1"], strict=True):
        assert rel0 < TOL[getattr(torch, dt)] and rel1 < TOL[getattr(torch, dt)], (dt, shape, rel0, rel1)
        assert digest0 == digest1, (dt, shape)


@pytest.mark.parametrize("vecs_a_thread", ["1", "4"])
def test_rms_norm_backward_other_group_shapes(vecs_a_thread):
    # FW_RMS_BWD_ROWS (read once per process) sets the vectors a thread of the backward rows kernel aims at:
    # 1 gives 128-lane groups at hidden 1024 and 4 gives 4 vectors a thread, which the default (2) never runs.
    # In a child process, against float64.
    code = (
        "import json\nfrom ops_cuda import library\nfrom ops_cuda.rms_norm import rms_norm_backward_reference\n"
        "library.activate_cuda()\n"
        "out = []\n"
        "for dt, wdt, shape in [('bfloat16', 'bfloat16', (20000, 1024)), ('bfloat16', 'float32', (17, 768)),\n"
        "                       ('float16', 'float16', (5, 256)), ('bfloat16', 'bfloat16', (3, 5, 16, 128)),\n"
        "                       ('bfloat16', 'bfloat16', (33, 24)), ('float32', 'float32', (7, 384)),\n"
        "                       ('float32', 'float32', (9, 64))]:\n"
        "    x = torch.randn(shape, device='cuda', dtype=getattr(torch, dt))\n"
        "    g = torch.randn_like(x)\n"
        "    w = (1 + 0.1 * torch.randn(shape[-1], device='cuda')).to(getattr(torch, wdt))\n"
        "    gx, gw = torch.ops.fw.rms_norm_backward(g, x, w, 1e-6)\n"
        "    gx64, gw64 = rms_norm_backward_reference(g.double(), x.double(), w.double(), 1e-6)\n"
        "    rel = lambda a, b: float('nan') if a.isnan().any() else float((a.double() - b).norm() / b.norm())\n"
        "    out.append([dt, wdt, list(shape), rel(gx, gx64), rel(gw, gw64)])\n"
        "print(json.dumps(out))\n")
    for dt, wdt, shape, rel_gx, rel_gw in child_json("import torch\n" + code, FW_RMS_BWD_ROWS=vecs_a_thread):
        assert rel_gx < TOL[getattr(torch, dt)] * 2, (dt, wdt, shape, rel_gx)
        assert rel_gw < TOL[getattr(torch, wdt)] * 2, (dt, wdt, shape, rel_gw)


# ------------------------------------------------------------------ rope
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,Hq,Hk,D", [(1, 1, 1, 1, 64), (2, 37, 16, 8, 128), (1, 5, 3, 1, 6), (3, 64, 4, 2, 32)])
def test_rope(dtype, B, T, Hq, Hk, D):
    # q, k as views of a fused projection (strided, as the model produces them)
    qkv = torch.randn(B, T, (Hq + 2 * Hk) * D, device=DEV, dtype=dtype)
    q = qkv[..., : Hq * D].view(B, T, Hq, D)
    k = qkv[..., Hq * D: (Hq + Hk) * D].view(B, T, Hk, D)
    pos = torch.randint(0, 40960, (B, T), device=DEV)
    poison()
    qo, ko = ops_cuda.rope(q, k, pos, 1e6)
    cos, sin = rope_cos_sin(pos, D, 1e6)  # fp32 angles (the op's definition), rotation in float64
    q64, k64 = rope_rotate(q.double(), cos.double(), sin.double()), rope_rotate(k.double(), cos.double(), sin.double())
    assert rel(qo, q64) < TOL[dtype] and rel(ko, k64) < TOL[dtype]
    # backward = inverse rotation: grads through the op
    qq, kk = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    gq, gk = torch.randn_like(qq), torch.randn_like(kk)
    poison()
    dq, dk = torch.autograd.grad(ops_cuda.rope(qq, kk, pos, 1e6), (qq, kk), (gq, gk))
    dq64 = rope_rotate(gq.double(), cos.double(), -sin.double())
    dk64 = rope_rotate(gk.double(), cos.double(), -sin.double())
    assert rel(dq, dq64) < TOL[dtype] and rel(dk, dk64) < TOL[dtype]


# rope and qk_norm_rope with a theta the process has not met before, first inside a CUDA-graph capture (the
# inverse frequencies are built on a theta's first call), replayed on new inputs: against float64 rotations of
# float32 angles, and bit for bit the eager op's outputs. In a child process: no theta was met there before, and a
# failing capture ends that process only.
ROPE_CAPTURE_CODE = (
    "import json, torch, ops_cuda\nfrom ops_cuda import library\n"
    "from ops_cuda.rope import rope_cos_sin, rope_rotate\n"
    "assert library.activate_cuda() == 'kernels'\n"
    "rel = lambda a, b: float((a.double() - b).norm() / b.norm())\n"
    "out = []\n"
    "for dtype, theta_rope, theta_qk in ((torch.bfloat16, 271828.0, 314159.0), (torch.float32, 161803.0, 141421.0)):\n"
    "    B, T, Hq, Hk, D, N = 2, 9, 4, 2, 64, 21\n"
    "    q = torch.empty(B, T, Hq, D, device='cuda', dtype=dtype)\n"
    "    k = torch.empty(B, T, Hk, D, device='cuda', dtype=dtype)\n"
    "    pos = torch.zeros(B, T, device='cuda', dtype=torch.long)\n"
    "    qkv = torch.empty(N, (8 + 2 * 2) * 128, device='cuda', dtype=dtype)\n"
    "    pos1 = torch.zeros(N, device='cuda', dtype=torch.long)\n"
    "    qw = (1 + 0.3 * torch.randn(128, device='cuda')).to(dtype)\n"
    "    kw = (1 + 0.3 * torch.randn(128, device='cuda')).to(dtype)\n"
    "    ops_cuda.rope(q, k, pos, 1e4)   # the kernels loaded, with another theta\n"
    "    ops_cuda.qk_norm_rope(qkv, pos1, qw, kw, 1e-6, 1e4, 2)\n"
    "    torch.cuda.synchronize()\n"
    "    g = torch.cuda.CUDAGraph()\n"
    "    with torch.cuda.graph(g):\n"
    "        qo, ko = ops_cuda.rope(q, k, pos, theta_rope)\n"
    "        q2, k2, v2 = ops_cuda.qk_norm_rope(qkv, pos1, qw, kw, 1e-6, theta_qk, 2)\n"
    "    for _ in range(2):\n"
    "        for x in (q, k, qkv):\n"
    "            x.copy_(torch.randn(x.shape, device='cuda'))\n"
    "        pos.copy_(torch.randint(0, 40960, pos.shape, device='cuda'))\n"
    "        pos1.copy_(torch.randint(0, 40960, pos1.shape, device='cuda'))\n"
    "        g.replay()\n"
    "        torch.cuda.synchronize()\n"
    "        cos, sin = rope_cos_sin(pos, D, theta_rope)\n"
    "        q64 = rope_rotate(q.double(), cos.double(), sin.double())\n"
    "        k64 = rope_rotate(k.double(), cos.double(), sin.double())\n"
    "        x = qkv.double().view(N, 12, 128)\n"
    "        norm = lambda t, w: t * (t.square().mean(-1, keepdim=True) + 1e-6).rsqrt() * w.double()\n"
    "        cos, sin = rope_cos_sin(pos1[None], 128, theta_qk)\n"
    "        q264 = rope_rotate(norm(x[:, :8], qw)[None], cos.double(), sin.double())[0]\n"
    "        k264 = rope_rotate(norm(x[:, 8:10], kw)[None], cos.double(), sin.double())[0]\n"
    "        eager = (*ops_cuda.rope(q, k, pos, theta_rope),\n"
    "                 *ops_cuda.qk_norm_rope(qkv, pos1, qw, kw, 1e-6, theta_qk, 2))\n"
    "        same = all(torch.equal(a, b) for a, b in zip((qo, ko, q2, k2, v2), eager))\n"
    "        out.append([str(dtype), rel(qo, q64), rel(ko, k64), rel(q2, q264), rel(k2, k264), same])\n"
    "print(json.dumps(out))\n")


def test_rope_inv_freq_first_built_inside_a_cuda_graph_capture():
    for dtype, *errors, same in child_json(ROPE_CAPTURE_CODE):
        tol = TOL[getattr(torch, dtype.split(".")[1])] * 2
        assert all(e < tol for e in errors) and same, (dtype, errors, same)


# ------------------------------------------------------------------ swiglu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (5, 6144), (3, 7, 26), (16384, 6144),
                                   (70000, 16)])  # more rows than a grid's y dimension: the looping kernel
def test_swiglu(dtype, shape):
    gu = (2 * torch.randn(shape, device=DEV, dtype=dtype)).requires_grad_(True)
    g = torch.randn(*shape[:-1], shape[-1] // 2, device=DEV, dtype=dtype)
    poison()
    y = ops_cuda.swiglu(gu)
    poison()
    (dgu,) = torch.autograd.grad(y, gu, g)
    (gu64,) = f64(gu)
    y64 = swiglu_reference(gu64)
    (dgu64,) = torch.autograd.grad(y64, gu64, g.double())
    assert rel(y, y64) < TOL[dtype] and rel(dgu, dgu64) < TOL[dtype] * 2


# ------------------------------------------------------------------ add_rms_norm, qk_norm_rope_write (inference)
@pytest.mark.parametrize("xdtype,rdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
@pytest.mark.parametrize("wdtype", ["same", "fp32"])
@pytest.mark.parametrize("shape", [(1, 1024), (256, 1024), (7, 1000), (3, 5, 2560), (2, 4096), (3, 16)])
@pytest.mark.parametrize("ydtype", ["residual", "x"])
def test_add_rms_norm(xdtype, rdtype, wdtype, shape, ydtype):
    x = torch.randn(shape, device=DEV, dtype=xdtype)
    r = (3 * torch.randn(shape, device=DEV)).to(rdtype)
    w = torch.randn(shape[-1], device=DEV, dtype=xdtype if wdtype == "same" else torch.float32)
    out = xdtype if ydtype == "x" else rdtype
    poison()
    h, y = ops_cuda.add_rms_norm(x, r, w, 1e-6, out)
    assert h.dtype == rdtype and y.dtype == out
    assert torch.equal(h, r + x)   # the add rounds as torch's does
    h64 = h.double()   # the norm reads the rounded sum, as rms_norm would
    y64 = h64 * (h64.square().mean(-1, keepdim=True) + 1e-6).rsqrt() * w.double()
    assert rel(y, y64) < TOL[out]


@pytest.mark.parametrize("xdtype,rdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("wdtype", ["same", "fp32"])
@pytest.mark.parametrize("shape", [(1, 1024), (16384, 1024), (7, 1000), (3, 5, 2560), (2, 4096), (3, 16)])
def test_add_rms_norm_backward(xdtype, rdtype, wdtype, shape):
    """The gradients of h and of the norm (in x's dtype, as under autocast) against float64 autograd through the
    add and the norm's formula, from the float32 sum the forward rounded."""
    x = torch.randn(shape, device=DEV, dtype=xdtype, requires_grad=True)
    r = (3 * torch.randn(shape, device=DEV)).to(rdtype).requires_grad_(True)
    w = torch.randn(shape[-1], device=DEV, dtype=xdtype if wdtype == "same" else torch.float32, requires_grad=True)
    gh = torch.randn(shape, device=DEV).to(rdtype)
    gy = torch.randn(shape, device=DEV).to(xdtype)
    h, y = ops_cuda.add_rms_norm(x, r, w, 1e-6, xdtype)
    poison()
    gx, gr, gw = torch.autograd.grad([h, y], [x, r, w], [gh, gy])
    assert gx.dtype == xdtype and gr.dtype == rdtype and gw.dtype == w.dtype
    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    y64 = h64 * (h64.square().mean(-1, keepdim=True) + 1e-6).rsqrt() * w64
    gh64, gw64 = torch.autograd.grad(y64, [h64, w64], gy.double())
    want = gh64 + gh.double()
    assert rel(gr, want) < TOL[rdtype] and rel(gx, want) < TOL[xdtype]
    assert rel(gw, gw64) < TOL[w.dtype] * 4   # a sum over every row
    again = torch.autograd.grad(ops_cuda.add_rms_norm(x, r, w, 1e-6, xdtype), [x, r, w], [gh, gy])
    assert all(torch.equal(a, b) for a, b in zip(again, (gx, gr, gw)))   # the same bits every run


@pytest.mark.parametrize("xdtype,rdtype,wdtype,D", [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, 5120),   # Qwen3-14B's and -32B's hidden size
    (torch.bfloat16, torch.float32, torch.float32, 5120),
    (torch.float32, torch.float32, torch.float32, 8200),
    (torch.float16, torch.float32, torch.bfloat16, 1024),     # bf16 weights under 16-mixed's fp16 activations
    (torch.bfloat16, torch.bfloat16, torch.float16, 2560),
    (torch.float32, torch.float32, torch.bfloat16, 4096),
    (torch.float16, torch.float16, torch.bfloat16, 5120),
])
def test_add_rms_norm_longer_rows_and_other_weight_dtypes(xdtype, rdtype, wdtype, D):
    """Rows longer than the kernel's 4096 elements and weights in neither x's dtype nor float32, which the kernel
    refuses (it raised), against float64 autograd through the add and the norm's formula, forward and backward."""
    shape = (3, 5, D)
    x = torch.randn(shape, device=DEV, dtype=xdtype, requires_grad=True)
    r = (3 * torch.randn(shape, device=DEV)).to(rdtype).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(D, device=DEV)).to(wdtype).requires_grad_(True)
    gh = torch.randn(shape, device=DEV).to(rdtype)
    gy = torch.randn(shape, device=DEV).to(xdtype)
    h, y = ops_cuda.add_rms_norm(x, r, w, 1e-6, xdtype)
    assert h.dtype == rdtype and y.dtype == xdtype
    assert torch.equal(h, r.detach() + x.detach())   # the add rounds as torch's does
    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    y64 = h64 * (h64.square().mean(-1, keepdim=True) + 1e-6).rsqrt() * w64
    assert rel(y.detach(), y64.detach()) < TOL[xdtype]
    gx, gr, gw = torch.autograd.grad([h, y], [x, r, w], [gh, gy])
    assert gx.dtype == xdtype and gr.dtype == rdtype and gw.dtype == wdtype
    gh64, gw64 = torch.autograd.grad(y64, [h64, w64], gy.double())
    want = gh64 + gh.double()
    assert rel(gr, want) < TOL[rdtype] and rel(gx, want) < TOL[xdtype]
    assert rel(gw, gw64) < TOL[wdtype] * 4   # a sum over every row


@pytest.mark.parametrize("dtype,wdtype", [(d, w) for d in DTYPES for w in ("same", "fp32")]
                         + [(torch.float16, "bf16")])
@pytest.mark.parametrize("N,Hq,Hk,D,offset", [(1, 16, 8, 128, None), (16384, 16, 8, 128, None),
                                              (37, 32, 8, 128, 256), (5, 8, 4, 64, None), (9, 4, 2, 256, 512),
                                              (3001, 16, 8, 128, 256), (0, 16, 8, 128, None), (33, 16, 8, 128, 1),
                                              (7, 4, 2, 32, 3)])
def test_qk_norm_rope_forward_and_backward(dtype, wdtype, N, Hq, Hk, D, offset):
    """The training op against float64 autograd through the norm's formula and the rotation (float32 angles, as
    transformers computes them), from qkv rows that may be strided (a slice of a wider buffer at `offset`: an odd
    offset is copied to aligned rows first); v's gradient is the one given, bit for bit; a rerun gives the same
    bits. Head size 32 has no kernel: rms_norm and rope on views serve it, and the gradient between the two is
    rounded to qkv's dtype, so its weight gradients are as exact as that dtype allows, not as float32 weights'.
    "bf16" weights under float16 qkv are neither float32 nor qkv's dtype: they are used as float32."""
    W = (Hq + 2 * Hk) * D
    wide = torch.randn(N, W + (3 * D if offset is not None else 0), device=DEV, dtype=dtype)
    qkv = (wide[:, offset:offset + W] if offset is not None else wide).requires_grad_(True)
    pos = torch.randint(0, 40960, (N,), device=DEV)
    wd = {"same": dtype, "fp32": torch.float32, "bf16": torch.bfloat16}[wdtype]
    qw = (1 + 0.3 * torch.randn(D, device=DEV)).to(wd).requires_grad_(True)
    kw = (1 + 0.3 * torch.randn(D, device=DEV)).to(wd).requires_grad_(True)
    poison()
    q, k, v = ops_cuda.qk_norm_rope(qkv, pos, qw, kw, 1e-6, 1e6, Hk)
    gq, gk, gv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    poison()
    got = torch.autograd.grad((q, k, v), (qkv, qw, kw), (gq, gk, gv))
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == wd
    x = qkv.detach().double().requires_grad_(True)
    qw64, kw64 = qw.detach().double().requires_grad_(True), kw.detach().double().requires_grad_(True)
    q_in, k_in, v_in = x.view(N, Hq + 2 * Hk, D).split([Hq, Hk, Hk], 1)

    def norm(t, w):
        return t * (t.square().mean(-1, keepdim=True) + 1e-6).rsqrt() * w

    cos, sin = rope_cos_sin(pos[None], D, 1e6)
    q64 = rope_rotate(norm(q_in, qw64)[None], cos.double(), sin.double())[0]
    k64 = rope_rotate(norm(k_in, kw64)[None], cos.double(), sin.double())[0]
    assert torch.equal(v, qkv.detach().view(N, Hq + 2 * Hk, D)[:, Hq + Hk:])
    want = torch.autograd.grad((q64, k64, v_in), (x, qw64, kw64), (gq.double(), gk.double(), gv.double()))
    if N == 0:
        assert q.shape == (0, Hq, D) and got[0].shape == (0, W) and not got[1].any() and not got[2].any()
        return
    assert rel(q, q64) < TOL[dtype] * 2 and rel(k, k64) < TOL[dtype] * 2
    assert torch.equal(got[0][:, (Hq + Hk) * D:], gv.reshape(N, -1))
    assert rel(got[0][:, :(Hq + Hk) * D], want[0][:, :(Hq + Hk) * D]) < TOL[dtype] * 2
    wtol = 4 * (TOL[wd] if D in KERNEL_HEAD_DIMS else max(TOL[wd], TOL[dtype]))   # sums over every token
    assert rel(got[1], want[1]) < wtol and rel(got[2], want[2]) < wtol
    again = torch.autograd.grad(ops_cuda.qk_norm_rope(qkv, pos, qw, kw, 1e-6, 1e6, Hk), (qkv, qw, kw), (gq, gk, gv))
    assert all(torch.equal(a, b) for a, b in zip(again, got))   # the same bits every run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", ["same", "fp32"])
@pytest.mark.parametrize("N,Hq,Hk,D", [(1, 16, 8, 128), (256, 16, 8, 128), (37, 32, 8, 128), (5, 8, 4, 64),
                                       (9, 4, 2, 256), (3000, 16, 8, 128)])
def test_qk_norm_rope_write(dtype, wdtype, N, Hq, Hk, D):
    nb, bs = N // 4 + 3, 16
    qkv = torch.randn(N, (Hq + 2 * Hk) * D, device=DEV, dtype=dtype)
    pos = torch.randint(0, 40960, (N,), device=DEV)
    wd = dtype if wdtype == "same" else torch.float32
    qw, kw = (1 + 0.3 * torch.randn(D, device=DEV)).to(wd), (1 + 0.3 * torch.randn(D, device=DEV)).to(wd)
    slots = torch.randperm(nb * bs, device=DEV)[:N]   # distinct (block, offset) per token
    blocks, offsets = slots // bs, slots % bs
    k_pool = torch.full((nb, Hk, bs, D), float("nan"), device=DEV, dtype=dtype)
    v_pool = torch.full_like(k_pool, float("nan"))
    poison()
    q = ops_cuda.qk_norm_rope_write(qkv, pos, qw, kw, 1e-6, 1e6, k_pool, v_pool, blocks, offsets)
    q_in, k_in, _ = qkv.double().view(N, Hq + 2 * Hk, D).split([Hq, Hk, Hk], 1)

    def norm(t, w):   # the norm's output rounded to the dtype, as the separate rms_norm op returns it
        return (t * (t.square().mean(-1, keepdim=True) + 1e-6).rsqrt() * w.double()).to(dtype).double()

    cos, sin = rope_cos_sin(pos[None], D, 1e6)
    q64 = rope_rotate(norm(q_in, qw)[None], cos.double(), sin.double())[0]
    k64 = rope_rotate(norm(k_in, kw)[None], cos.double(), sin.double())[0]
    assert rel(q, q64) < TOL[dtype] * 2
    assert rel(k_pool[blocks, :, offsets], k64) < TOL[dtype] * 2
    assert torch.equal(v_pool[blocks, :, offsets], qkv.view(N, Hq + 2 * Hk, D)[:, Hq + Hk:])
    untouched = torch.ones(nb * bs, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert k_pool.transpose(1, 2).reshape(nb * bs, Hk, D)[untouched].isnan().all()
    assert v_pool.transpose(1, 2).reshape(nb * bs, Hk, D)[untouched].isnan().all()


def e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many values of e4m3's ordered value line lie between float8_e4m3fn tensors a and b, elementwise (+0 and
    -0 count as one value)."""
    def ordinal(t):
        c = t.view(torch.uint8).long()
        return torch.where(c >= 128, 128 - c, c)

    return (ordinal(a) - ordinal(b)).abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", ["same", "fp32"])
@pytest.mark.parametrize("N,Hq,Hk,D", [(5, 8, 4, 64), (300, 16, 8, 128), (9, 4, 2, 256)])
def test_qk_norm_rope_write_fp8_pools(dtype, wdtype, N, Hq, Hk, D):
    """float8_e4m3fn pools against the CPU reference on the same inputs, with values on both sides of 448 (rows
    scaled up; k weights spread over decades, one large enough to saturate every head): v bit for bit, k within
    one e4m3 step, q as the non-float8 test compares it; the entries not addressed stay as they were (NaN)."""
    fp8 = torch.float8_e4m3fn
    nb, bs = N // 4 + 3, 16
    qkv = torch.randn(N, (Hq + 2 * Hk) * D, device=DEV, dtype=dtype)
    qkv[::3] *= 500   # v beyond 448 (the norm makes q and k scale-free)
    pos = torch.randint(0, 40960, (N,), device=DEV)
    wd = dtype if wdtype == "same" else torch.float32
    spread = torch.logspace(-2, 2.5, D, device=DEV)[torch.randperm(D, device=DEV)]
    kw = torch.randn(D, device=DEV) * spread
    kw[0] = 1e4
    qw, kw = (1 + 0.3 * torch.randn(D, device=DEV)).to(wd), kw.to(wd)
    slots = torch.randperm(nb * bs, device=DEV)[:N]   # distinct (block, offset) per token
    blocks, offsets = slots // bs, slots % bs
    k_pool = torch.full((nb, Hk, bs, D), 0x7F, device=DEV, dtype=torch.uint8).view(fp8)   # NaN
    v_pool = k_pool.clone()
    k_ref, v_ref = k_pool.cpu(), v_pool.cpu()
    poison()
    q = ops_cuda.qk_norm_rope_write(qkv, pos, qw, kw, 1e-6, 1e6, k_pool, v_pool, blocks, offsets)
    q_ref = ops_cuda.qk_norm_rope_write(qkv.cpu(), pos.cpu(), qw.cpu(), kw.cpu(), 1e-6, 1e6, k_ref, v_ref,
                                        blocks.cpu(), offsets.cpu())
    assert q.dtype == dtype and rel(q, q_ref.to(DEV)) < TOL[dtype] * 2
    v_in = qkv.view(N, Hq + 2 * Hk, D)[:, Hq + Hk:]
    assert (v_in.abs() > 448).any() and (v_in.abs() < 448).any()
    assert torch.equal(v_pool.view(torch.uint8).cpu(), v_ref.view(torch.uint8))
    # k: the kernel's norm and rotation (rsqrtf, sincosf) may differ from the reference's in T's last bit, and two
    # neighbouring T values can round to neighbouring e4m3 values when they straddle a rounding midpoint; that is
    # at most one step, on few elements (a tie-break or a bug in the conversion moves many, or by more)
    got, want = k_pool.cpu()[blocks.cpu(), :, offsets.cpu()], k_ref[blocks.cpu(), :, offsets.cpu()]
    assert (want.float().abs() == 448).any() and (want.float().abs() < 448).any()
    steps = e4m3_steps(got, want)
    assert steps.max() <= 1 and steps.float().mean() <= 0.01
    untouched = torch.ones(nb * bs, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    for pool in (k_pool, v_pool):
        assert (pool.view(torch.uint8).transpose(1, 2).reshape(nb * bs, Hk, D)[untouched] == 0x7F).all()
        written = pool.view(torch.uint8)[blocks, :, offsets]
        assert not (written == 0x7F).any() and not (written == 0xFF).any()   # every addressed entry written


def test_opcheck_cuda_qk_norm_rope_write_fp8_pools():
    """opcheck with float8_e4m3fn pools (a case of its own: _op_args holds one per op), but for test_schema: its
    mutation check compares the pools with a kernel torch has no float8 version of."""
    fp8 = torch.float8_e4m3fn
    args = (torch.randn(5, 8 * 64, device=DEV).bfloat16(), torch.arange(5, device=DEV), torch.randn(64, device=DEV),
            torch.randn(64, device=DEV), 1e-6, 1e4, torch.zeros(4, 2, 16, 64, device=DEV, dtype=fp8),
            torch.zeros(4, 2, 16, 64, device=DEV, dtype=fp8), torch.tensor([1, 1, 2, 3, 0], device=DEV),
            torch.tensor([0, 5, 1, 15, 0], device=DEV))
    torch.library.opcheck(torch.ops.fw.qk_norm_rope_write.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


# ------------------------------------------------------------------ linear + logprob
@pytest.mark.parametrize("dtype,save", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True),
                                        (torch.float16, True)])
@pytest.mark.parametrize("N,d,V,temperature", [(1, 64, 1000, 1.0), (37, 128, 5003, 0.7), (1000, 128, 151936, 1.3),
                                               (5000, 64, 20001, 1.0),  # several row and vocabulary tiles
                                               (7, 64, 4100, 1.0)])  # V % 8 == 4: 4-wide forward, 1-wide dz
def test_linear_logprob(dtype, save, N, d, V, temperature):
    """save: the backward reads the forward's fp16 logits instead of recomputing them (16-bit operands)."""
    h = torch.randn(N, d, device=DEV, dtype=dtype).requires_grad_(True)
    w = (torch.randn(V, d, device=DEV) / d**0.5).to(dtype).requires_grad_(True)
    t = torch.randint(0, V, (N,), device=DEV)
    t[::5] = -100  # ignored rows
    glp, gent = torch.randn(N, device=DEV), torch.randn(N, device=DEV)
    poison()
    lp, ent = ops_cuda.linear_logprob(h, w, t, temperature, return_entropy=True, save_logits=save)
    poison()
    dh, dw = torch.autograd.grad((lp * glp).sum() + (ent * gent).sum(), (h, w))
    h64, w64 = f64(h, w)
    lp64, ent64, *_ = linear_logprob_reference(h64, w64, t, temperature)
    lp_full, ent_full = logprob_entropy64((h64 @ w64.T) / temperature, t)  # unchunked, for the grads too
    dh64, dw64 = torch.autograd.grad((lp_full * glp.double()).sum() + (ent_full * gent.double()).sum(), (h64, w64))
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert rel(lp, lp_full) < 1e-5 and rel(ent, ent_full) < 1e-5
    with torch.no_grad():  # keeping the logits leaves the forward's outputs as they are, bit for bit
        lp_plain, ent_plain, *_ = torch.ops.fw.linear_logprob(h, w, t, temperature)
    assert torch.equal(lp, lp_plain) and torch.equal(ent, ent_plain)
    assert rel(lp64, lp_full) < 1e-10 and rel(ent64, ent_full) < 1e-10  # chunked reference == plain one
    assert rel(dh, dh64) < TOL[dtype] * 2 and rel(dw, dw64) < TOL[dtype] * 2


def launched_kernels(fn, part: str) -> set[str]:
    """The names of the CUDA kernels that fn launches whose name contains part (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if part in e.name}


SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not SM90, reason="the Hopper kernel (linear_logprob_sm90.cuh) runs on compute capability 9.0")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,d,V", [(1, 8, 1), (129, 72, 257), (300, 1024, 151936), (5, 64, 255), (260, 136, 9000)])
def test_linear_logprob_sm90(monkeypatch, dtype, N, d, V):
    """The Hopper kernel, which does the row work on the GEMM's accumulators (recomputed logits, 16-bit operands):
    float64 outputs and gradients at partial row blocks (128 rows) and column blocks (256), a reduction length
    that is not a multiple of its 64-wide slices, ignored targets, targets in the last block; it is the kernel
    that runs (profiler), and FW_LOGPROB_SM90=0 gives the cuBLAS tiles the same values."""
    temp = 0.7
    h = torch.randn(N, d, device=DEV, dtype=dtype).requires_grad_(True)
    w = (torch.randn(V, d, device=DEV) / d**0.5 * 3).to(dtype).requires_grad_(True)
    t = torch.randint(0, V, (N,), device=DEV)
    t[::3] = -100
    t[1::7] = V - 1
    glp, gent = torch.randn(N, device=DEV), torch.randn(N, device=DEV)

    def run():
        poison()
        lp, ent = ops_cuda.linear_logprob(h, w, t, temp, return_entropy=True)
        poison()
        return (lp, ent, *torch.autograd.grad((lp * glp).sum() + (ent * gent).sum(), (h, w)))

    names = launched_kernels(run, "logprob")
    assert any("linear_logprob_sm90_kernel" in n for n in names) and not any("tile_bwd" in n for n in names), names
    lp, ent, dh, dw = run()
    h64, w64 = f64(h, w)
    lp64, ent64 = logprob_entropy64((h64 @ w64.T) / temp, t)
    dh64, dw64 = torch.autograd.grad((lp64 * glp.double()).sum() + (ent64 * gent.double()).sum(), (h64, w64))
    # relative to the reference's norm, floored (V = 1: entropy and gradients 0, which fp32 gives as ~1e-8)
    def err(out, expected, floor):
        return float((out.double() - expected.double()).norm() / expected.double().norm().clamp_min(floor))

    assert err(lp, lp64, 1) < 1e-5 and err(ent, ent64, 1) < 1e-5
    assert err(dh, dh64, 1e-3) < TOL[dtype] * 2 and err(dw, dw64, 1e-3) < TOL[dtype] * 2
    monkeypatch.setenv("FW_LOGPROB_SM90", "0")  # read on every call
    assert not any("sm90" in n for n in launched_kernels(run, "logprob"))
    lp_c, ent_c, dh_c, dw_c = run()
    assert err(lp, lp_c, 1) < 1e-5 and err(ent, ent_c, 1) < 1e-5
    assert err(dh, dh_c, 1e-3) < TOL[dtype] * 2 and err(dw, dw_c, 1e-3) < TOL[dtype] * 2


@pytest.mark.skipif(not SM90, reason="the Hopper kernel (linear_logprob_sm90.cuh) runs on compute capability 9.0")
def test_linear_logprob_sm90_nan_and_minus_inf():
    """On the Hopper kernel: a NaN row makes that row's outputs NaN and no other; a 256-column chunk of -inf
    logits adds nothing (outputs equal float64 over the finite columns; kept: -65504, offset 0) and gets a
    grad_weight of exactly 0, with kept and with recomputed logits; keeping changes no output bit."""
    N, d, V = 4, 64, 5000
    h = (torch.rand(N, d, device=DEV) + 0.1).bfloat16()
    w = torch.randn(V, d, device=DEV) / 8
    w[512:768] = 0.0
    w[512:768, 0] = float("-inf")                   # logits of columns 512..767: -inf
    w = w.bfloat16()
    t = torch.tensor([5, 3000, 4999, 100], device=DEV)
    finite = torch.cat([torch.arange(0, 512), torch.arange(768, V)]).to(DEV)
    z = h.double() @ w[finite].double().T
    lp64, ent64 = logprob_entropy64(z, torch.where(t < 512, t, t - 256))  # the targets among the finite columns
    outs = []
    for C in (0, ops_cuda.SAVED_LOGITS_CHUNK):
        poison()
        lp, ent, lse, saved, off = torch.ops.fw.linear_logprob(h, w, t, 1.0, C)
        assert saved.numel() == (N * V if C else 0)
        if C:
            assert (saved[:, 512:768] == -65504).all() and (off[:, 2] == 0).all()
        for out, expect in ((lp, lp64), (ent, ent64), (lse, z.logsumexp(-1))):
            torch.testing.assert_close(out.double(), expect, rtol=1e-4, atol=1e-4)
        poison()
        _, gw = torch.ops.fw.linear_logprob_backward(torch.ones(N, device=DEV), torch.ones(N, device=DEV), h, w, t,
                                                     lse, ent, saved, off, 1.0, C)
        assert gw.isfinite().all() and (gw[512:768] == 0).all()
        outs.append((lp, ent, lse))
    assert all(torch.equal(x, y) for x, y in zip(*outs))
    h_nan = h.clone()
    h_nan[1] = float("nan")
    poison()
    lp, ent, lse, *_ = torch.ops.fw.linear_logprob(h_nan, w, t, 1.0)
    assert lp[1].isnan() and ent[1].isnan() and lse[1].isnan()
    assert not lp[[0, 2, 3]].isnan().any() and not ent[[0, 2, 3]].isnan().any()


def test_linear_logprob_autocast_uses_bf16_gemm():
    h = torch.randn(64, 128, device=DEV, requires_grad=True)
    w = torch.randn(3001, 128, device=DEV, requires_grad=True)
    t = torch.randint(0, 3001, (64,), device=DEV)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, _ = ops_cuda.linear_logprob(h, w, t)
    lp_bf16, _ = ops_cuda.linear_logprob(h.bfloat16(), w.bfloat16(), t)
    assert torch.allclose(lp, lp_bf16, rtol=0, atol=1e-5)
    gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32 and gh.isfinite().all()
    # the recipes' path: fp32 master weights under autocast, logits kept (an fp16 [N, V] saved for the backward)
    kept = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda x: kept.append((x.dtype, tuple(x.shape))) or x, lambda x: x)
    with hooks, torch.autocast("cuda", dtype=torch.bfloat16):
        lp_k, _ = ops_cuda.linear_logprob(h, w, t, save_logits=True)
    assert (torch.float16, (64, 3001)) in kept and torch.equal(lp_k, lp)
    gh_k, gw_k = torch.autograd.grad(lp_k.sum(), (h, w))
    assert rel(gh_k, gh) < 1e-2 and rel(gw_k, gw) < 1e-2


def test_linear_logprob_bad_target_is_nan():
    h = torch.randn(3, 64, device=DEV)
    w = torch.randn(100, 64, device=DEV)
    lp, _ = ops_cuda.linear_logprob(h, w, torch.tensor([1, 100, 2], device=DEV))
    assert lp[1].isnan() and not lp[0].isnan() and not lp[2].isnan()


def test_linear_logprob_nan_propagates():
    """A NaN logit makes its row's outputs NaN, even when a whole vocabulary tile of the row is NaN (the
    online max must not skip it), as in the float64 reference; the other rows are unaffected."""
    N, d, V = 4, 64, 20_000   # 3 vocabulary tiles of 8192 columns
    h, w = torch.randn(N, d, device=DEV), torch.randn(V, d, device=DEV) / 8
    h[1] = float("nan")                            # every logit of row 1
    t = torch.tensor([5, 9000, 17_000, 3], device=DEV)
    lp_ref, ent_ref, lse_ref, *_ = linear_logprob_reference(h.double().cpu(), w.double().cpu(), t.cpu(), 1.0)
    for hh, ww, tol in ((h, w, 1e-5), (h.bfloat16(), w.bfloat16(), 5e-2)):  # bf16: also keeping the logits
        lp, ent, lse, saved, _ = torch.ops.fw.linear_logprob(hh, ww, t, 1.0, ops_cuda.SAVED_LOGITS_CHUNK)
        assert saved.numel() == (N * V if hh.dtype == torch.bfloat16 else 0)
        for out, expect in ((lp, lp_ref), (ent, ent_ref), (lse, lse_ref)):
            assert out[1].isnan() and expect[1].isnan()
            torch.testing.assert_close(out[[0, 2, 3]].double().cpu(), expect[[0, 2, 3]], rtol=tol, atol=tol)
        if saved.numel():
            assert saved[1].isnan().all() and not saved[[0, 2, 3]].isnan().any()
    w[9000] = float("nan")                         # one column of every row
    assert torch.ops.fw.linear_logprob(h, w, t, 1.0)[2].isnan().all()
    assert torch.ops.fw.linear_logprob(h.bfloat16(), w.bfloat16(), t, 1.0, ops_cuda.SAVED_LOGITS_CHUNK)[2].isnan().all()


def test_linear_logprob_chunk_of_minus_inf():
    """1,024 columns (four 256-column chunks) whose logits are all -inf (a -inf weight column, positive hidden)
    add nothing: the outputs equal float64 over the finite columns, with and without kept logits (saved -65504,
    offsets 0)."""
    N, d, V = 3, 64, 5000
    h = torch.rand(N, d, device=DEV) + 0.1
    w = torch.randn(V, d, device=DEV) / 8
    w[1024:2048] = 0.0
    w[1024:2048, 0] = float("-inf")                # logits of columns 1024..2047: -inf
    t = torch.tensor([5, 3000, 4999], device=DEV)
    finite = torch.cat([torch.arange(0, 1024), torch.arange(2048, V)]).to(DEV)
    z = h.double() @ w[finite].double().T
    lp64, ent64 = logprob_entropy64(z, torch.tensor([5, 3000 - 1024, 4999 - 1024], device=DEV))
    for hh, ww, tol in ((h, w, 1e-5), (h.bfloat16(), w.bfloat16(), 3e-2)):
        lp, ent, lse, saved, off = torch.ops.fw.linear_logprob(hh, ww, t, 1.0, ops_cuda.SAVED_LOGITS_CHUNK)
        torch.testing.assert_close(lp.double(), lp64, rtol=tol, atol=tol)
        torch.testing.assert_close(ent.double(), ent64, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.double(), z.logsumexp(-1), rtol=tol, atol=tol)
        if saved.numel():
            assert (saved[:, 1024:2048] == -65504).all() and (off[:, 4:8] == 0).all()
            gh, gw = torch.ops.fw.linear_logprob_backward(torch.ones(N, device=DEV), torch.ones(N, device=DEV), hh, ww,
                                                          t, lse, ent, saved, off, 1.0, ops_cuda.SAVED_LOGITS_CHUNK)
            # grad_weight of the -inf columns is exactly 0 (p = 0 there); grad_hidden meets their -inf weights
            assert gw.isfinite().all() and (gw[1024:2048] == 0).all() and gh.shape == hh.shape


@pytest.mark.parametrize("save", [False, True])
def test_linear_logprob_frozen_weight(save):
    """weight_grad=False (a frozen lm_head): the CUDA backward's grad_hidden equals the float64 one and
    grad_weight is empty; through autograd the weight gets no .grad."""
    N, d, V, temp = 48, 64, 9000, 0.9
    h = torch.randn(N, d, device=DEV).bfloat16().requires_grad_(True)
    w = (torch.randn(V, d, device=DEV) / 8).bfloat16()
    t = torch.randint(0, V, (N,), device=DEV)
    lp, ent = ops_cuda.linear_logprob(h, w, t, temp, return_entropy=True, save_logits=save)
    g1, g2 = torch.randn(N, device=DEV), torch.randn(N, device=DEV)
    poison()
    ((lp * g1).sum() + (ent * g2).sum()).backward()
    z = (h.detach().double() @ w.double().T / temp).requires_grad_(True)
    lp64, ent64 = logprob_entropy64(z, t)
    (dz,) = torch.autograd.grad((lp64 * g1.double()).sum() + (ent64 * g2.double()).sum(), z)
    assert w.grad is None and rel(h.grad, dz @ w.double() / temp) < TOL[torch.bfloat16] * 2
    _, ent2, lse2, sv, off = torch.ops.fw.linear_logprob(h.detach(), w, t, temp, 0)
    gh, gw = torch.ops.fw.linear_logprob_backward(g1, g2, h.detach(), w, t, lse2, ent2, sv, off, temp, 0, False)
    assert gw.numel() == 0 and rel(gh, dz @ w.double() / temp) < TOL[torch.bfloat16] * 2


def test_linear_logprob_backward_reads_the_kept_logits():
    """Given kept logits of other hidden states h2, the CUDA backward's dz comes from them, not from
    recomputing hidden @ W.T: grad_hidden = dz(h2) W / T, grad_weight = dz(h2)^T h / T (float64 reference)."""
    N, d, V, temp, C = 40, 64, 9000, 0.8, ops_cuda.SAVED_LOGITS_CHUNK
    h, h2 = (torch.randn(N, d, device=DEV).bfloat16() for _ in range(2))
    w = (torch.randn(V, d, device=DEV) / 8).bfloat16()
    t = torch.randint(0, V, (N,), device=DEV)
    _, ent2, lse2, saved2, off2 = torch.ops.fw.linear_logprob(h2, w, t, temp, C)
    g1, g2 = torch.randn(N, device=DEV), torch.randn(N, device=DEV)
    poison()
    gh, gw = torch.ops.fw.linear_logprob_backward(g1, g2, h, w, t, lse2, ent2, saved2, off2, temp, C)
    z2 = (h2.double() @ w.double().T / temp).requires_grad_(True)
    lp, ent = logprob_entropy64(z2, t)
    (dz,) = torch.autograd.grad((lp * g1.double()).sum() + (ent * g2.double()).sum(), z2)
    assert rel(gh, dz @ w.double() / temp) < TOL[torch.bfloat16] * 2
    assert rel(gw, dz.T @ h.double() / temp) < TOL[torch.bfloat16] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,V", [(3, 20001), (300, 151936), (5, 4099), (1, 7), (2, 1024)])
def test_linear_logprob_saved_logits_match_float64(dtype, N, V):
    """The kept logits: offsets[:, c] = the max of chunk c (256 columns) of the fp32 logits, saved = the logits
    minus their chunk's max in fp16; aligned and unaligned vocabularies, partial last chunks, one column, and
    several vocabulary tiles (8,192 columns each)."""
    d, C = 64, ops_cuda.SAVED_LOGITS_CHUNK
    h = torch.randn(N, d, device=DEV, dtype=dtype)
    w = (torch.randn(V, d, device=DEV) / 4).to(dtype)
    t = torch.randint(0, V, (N,), device=DEV)
    poison()
    _, _, _, saved, off = torch.ops.fw.linear_logprob(h, w, t, 0.8, C)
    z = h.double() @ w.double().T / 0.8
    chunks = -(-V // C)
    expect_off = torch.stack([z[:, c * C:(c + 1) * C].amax(-1) for c in range(chunks)], 1)
    assert off.shape == (N, chunks) and rel(off, expect_off) < 1e-6
    shifted = z - expect_off.repeat_interleave(C, 1)[:, :V]
    err = (saved.double() - shifted).abs()
    assert saved.shape == (N, V) and not saved.isnan().any()
    assert (err <= 2.0 ** -11 * shifted.abs() + 1e-5 * (1 + z.abs())).all()  # fp16 rounding of fp32 logits
    assert (saved.amax(-1) == 0).all()


@pytest.mark.parametrize("tile", ["3,2048", "4096,256"])
def test_linear_logprob_other_tiles(tile):
    # FW_LOGPROB_TILE (read once per process): 3-row tiles (several row tiles, each with its own partials and
    # merge) and 256-column tiles (one chunk a tile); kept and recomputed logits, in a child process, against
    # float64 (on Hopper the tiles are the backward's). A tile width that is not a multiple of 256 is refused
    # with the variable's name.
    code = (
        "import json, torch, ops_cuda\n"
        "N, d, V = 10, 64, 5003\n"
        "h = torch.randn(N, d, device='cuda').bfloat16().requires_grad_(True)\n"
        "w = (torch.randn(V, d, device='cuda') / 4).bfloat16().requires_grad_(True)\n"
        "t = torch.randint(0, V, (N,), device='cuda')\n"
        "t[4] = -100\n"
        "h64, w64 = h.double().detach().requires_grad_(True), w.double().detach().requires_grad_(True)\n"
        "logp = (h64 @ w64.T / 0.9).log_softmax(-1)\n"
        "lp64 = torch.where(t < 0, 0.0, logp.gather(1, t.clamp(min=0)[:, None]).squeeze(1))\n"
        "ent64 = -(logp.exp() * logp).sum(-1)\n"
        "g64 = torch.autograd.grad(lp64.sum() + 0.3 * ent64.sum(), (h64, w64))\n"
        "rel = lambda a, b: float('nan') if a.isnan().any() else float((a.double() - b).norm() / b.norm())\n"
        "out = []\n"
        "for save in (False, True):\n"
        "    lp, ent = ops_cuda.linear_logprob(h, w, t, 0.9, return_entropy=True, save_logits=save)\n"
        "    gh, gw = torch.autograd.grad(lp.sum() + 0.3 * ent.sum(), (h, w))\n"
        "    out.append([save, rel(lp, lp64), rel(ent, ent64), rel(gh, g64[0]), rel(gw, g64[1])])\n"
        "print(json.dumps(out))\n")
    for save, rel_lp, rel_ent, rel_gh, rel_gw in child_json(code, FW_LOGPROB_TILE=tile):
        assert rel_lp < 1e-5 and rel_ent < 1e-5, (save, rel_lp, rel_ent)
        assert rel_gh < TOL[torch.bfloat16] * 2 and rel_gw < TOL[torch.bfloat16] * 2, (save, rel_gh, rel_gw)
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "FW_LOGPROB_TILE": "4096,1000"}, check=False)
    assert bad.returncode != 0 and "FW_LOGPROB_TILE must be rows,cols with cols a multiple of 256" in bad.stderr


# The GEMM choice (ops_cuda/csrc/gemm.cpp, FW_GEMM read once a process): the default times the heuristic's
# first algorithms and keeps the fastest of those giving the first's bits on the operands it tunes with;
# "heuristic" keeps the first, "ex" takes cublasGemmEx. At Qwen3's d = 1,024 with two row tiles and a short
# vocabulary tile, fwd and bwd, kept and recomputed logits: a first backward with zero gradients (which cannot
# tell algorithms apart), then one on operands A (where the default tunes), then the values on operands B:
# every mode against float64, and the default bit-equal to "heuristic" on B.
GEMM_CHOICE_CODE = (
    "import hashlib, json, torch, ops_cuda\nfrom ops_cuda import library\n"
    "assert library.activate_cuda() == 'kernels'\n"
    "N, d, V = 4096 + 37, 1024, 8192 + 4100\n"
    "def operands(seed):\n"
    "    g = torch.Generator(device='cuda').manual_seed(seed)\n"
    "    h = torch.randn(N, d, device='cuda', generator=g).bfloat16().requires_grad_(True)\n"
    "    w = (torch.randn(V, d, device='cuda', generator=g) / 8).bfloat16().requires_grad_(True)\n"
    "    return h, w, torch.randint(0, V, (N,), device='cuda', generator=g)\n"
    "def run(h, w, t, save, scale=1.0):\n"
    "    lp, ent = ops_cuda.linear_logprob(h, w, t, 0.8, return_entropy=True, save_logits=save)\n"
    "    return lp, ent, *torch.autograd.grad(scale * (lp.sum() + 0.3 * ent.sum()), (h, w))\n"
    "for save in (False, True):\n"
    "    run(*operands(1), save, scale=0.0)\n"
    "    run(*operands(2), save)\n"
    "h, w, t = operands(3)\n"
    "h64, w64 = h.double().detach().requires_grad_(True), w.double().detach().requires_grad_(True)\n"
    "logp = (h64 @ w64.T / 0.8).log_softmax(-1)\n"
    "lp64 = logp.gather(1, t[:, None]).squeeze(1)\n"
    "ent64 = -(logp.exp() * logp).sum(-1)\n"
    "g64 = torch.autograd.grad(lp64.sum() + 0.3 * ent64.sum(), (h64, w64))\n"
    "del logp\n"
    "rel = lambda a, b: float('nan') if a.isnan().any() else float((a.double() - b).norm() / b.norm())\n"
    "digest = lambda *ts: hashlib.sha256(b''.join(x.contiguous().view(torch.uint8).cpu().numpy().tobytes()\n"
    "                                             for x in ts)).hexdigest()\n"
    "out = []\n"
    "for save in (False, True):\n"
    "    lp, ent, gh, gw = run(h, w, t, save)\n"
    "    out.append([save, rel(lp, lp64), rel(ent, ent64), rel(gh, g64[0]), rel(gw, g64[1]),\n"
    "                digest(lp, ent, gh, gw)])\n"
    "print(json.dumps(out))\n")


def test_linear_logprob_gemm_choice_changes_no_value():
    runs = {}
    for mode in ("tuned", "heuristic", "ex"):
        r = subprocess.run([sys.executable, "-c", GEMM_CHOICE_CODE], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "FW_GEMM": mode, "FW_GEMM_LOG": "1"}, check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[mode] = json.loads(r.stdout.splitlines()[-1])
        log = [ln for ln in r.stderr.splitlines() if ln.startswith("fw gemm")]
        timed = [ln for ln in log if " same bits " in ln]
        if mode == "tuned":
            # several shapes had more than one candidate; the zero-gradient backward did not decide any; every
            # choice is a candidate that gave the first's bits
            assert len(timed) > 4 and any("inconclusive" in ln for ln in log), "\n".join(log)
            chose = [ln.split(": chose candidate ") for ln in log if ": chose candidate " in ln]
            assert chose
            for shape, i in chose:
                assert any(ln.startswith(f"{shape}: candidate {i} (") for ln in timed), (shape, i)
        elif mode == "heuristic":
            assert not timed and any("the heuristic's first of" in ln for ln in log), "\n".join(log)
        else:
            assert log == ["fw gemm: FW_GEMM=ex, every GEMM through cublasGemmEx"], "\n".join(log)
        for save, rel_lp, rel_ent, rel_gh, rel_gw, _ in runs[mode]:
            assert rel_lp < 1e-5 and rel_ent < 1e-5, (mode, save, rel_lp, rel_ent)
            assert rel_gh < TOL[torch.bfloat16] * 2 and rel_gw < TOL[torch.bfloat16] * 2, (mode, save, rel_gh, rel_gw)
    for tuned, heuristic in zip(runs["tuned"], runs["heuristic"], strict=True):
        assert tuned[-1] == heuristic[-1], tuned[0]
    tiny = ("import torch, ops_cuda\nh = torch.randn(2, 8, device='cuda')\n"
            "ops_cuda.linear_logprob(h, torch.randn(5, 8, device='cuda'), torch.tensor([1, 2], device='cuda'))\n")
    bad = subprocess.run([sys.executable, "-c", tiny], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "FW_GEMM": "fastest"}, check=False)
    assert bad.returncode != 0 and "FW_GEMM must be tuned, heuristic or ex, got 'fastest'" in bad.stderr


# SFT's loss-token count N changes at every step; the GEMMs whose n or k is N belong to one family of shapes
# (each dimension rounded up to three significant bits) and are tuned once: N = 7000 tunes, 7013 and 7100 (the
# same family, 6144 < N <= 7168) run untimed the family's choice (or the heuristic's first, where that is another
# algorithm than on the tuned shape), with values still right against float64.
GEMM_FAMILY_CODE = (
    "import sys, torch, ops_cuda\nfrom ops_cuda import library\n"
    "assert library.activate_cuda() == 'kernels'\n"
    "d, V = 1024, 8192 + 4100\n"
    "g = torch.Generator(device='cuda').manual_seed(0)\n"
    "w = (torch.randn(V, d, device='cuda', generator=g) / 8).bfloat16().requires_grad_(True)\n"
    "for N in (7000, 7013, 7100):\n"
    "    print(f'fw gemm test: N {N}', file=sys.stderr, flush=True)\n"
    "    h = torch.randn(N, d, device='cuda', generator=g).bfloat16().requires_grad_(True)\n"
    "    t = torch.randint(0, V, (N,), device='cuda', generator=g)\n"
    "    for save in (False, True):\n"
    "        lp = ops_cuda.linear_logprob(h, w, t, save_logits=save)[0]\n"
    "        gh, gw = torch.autograd.grad(lp.sum(), (h, w))\n"
    "        torch.cuda.synchronize()\n"
    "h64, w64 = h.double().detach().requires_grad_(True), w.double().detach().requires_grad_(True)\n"
    "lp64 = (h64 @ w64.T).log_softmax(-1).gather(1, t[:, None]).squeeze(1)\n"
    "g64 = torch.autograd.grad(lp64.sum(), (h64, w64))\n"
    "rel = lambda a, b: float((a.double() - b).norm() / b.norm())\n"
    "print(rel(lp, lp64), rel(gh, g64[0]), rel(gw, g64[1]))\n")


def test_linear_logprob_gemm_tunes_a_family_of_shapes_once():
    r = subprocess.run([sys.executable, "-c", GEMM_FAMILY_CODE], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "FW_GEMM": "tuned", "FW_GEMM_LOG": "1"}, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    runs, current = {}, None
    for ln in r.stderr.splitlines():
        if ln.startswith("fw gemm test: N "):
            current = runs.setdefault(int(ln.split()[-1]), [])
        elif ln.startswith("fw gemm") and current is not None:
            current.append(ln)
    timed = {n: [ln for ln in log if " same bits " in ln or "chose candidate" in ln] for n, log in runs.items()}
    family = {n: [ln for ln in log if "its family's choice" in ln or "(not its family's)" in ln]
              for n, log in runs.items()}
    assert timed[7000] and not family[7000], "\n".join(runs[7000])
    for n in (7013, 7100):   # the shapes with N in them follow their family; none is timed
        assert family[n] and not timed[n], "\n".join(runs[n])
    assert any("its family's choice" in ln for n in (7013, 7100) for ln in family[n]), "\n".join(runs[7100])
    rel_lp, rel_gh, rel_gw = map(float, r.stdout.split())
    assert rel_lp < 1e-5 and rel_gh < TOL[torch.bfloat16] * 2 and rel_gw < TOL[torch.bfloat16] * 2, r.stdout


# The GEMM choices are kept for at most FW_GEMM_CACHE shapes (and as many families), least recently used out
# first. Forwards through the cuBLAS tiles (one GEMM a call: N <= the row tile, V <= the column tile) of a hot N
# between 12 others, each in a family of its own; FW_GEMM_LOG prints a line for each shape the maps do not hold.
GEMM_CACHE_CODE = (
    "import json, sys, torch, ops_cuda\nfrom ops_cuda import library\n"
    "assert library.activate_cuda() == 'kernels'\n"
    "d, V, hot = 256, 1000, 300\n"
    "others = [40, 56, 80, 112, 160, 224, 384, 512, 768, 1024, 1536, 2048]\n"
    "g = torch.Generator(device='cuda').manual_seed(0)\n"
    "w = (torch.randn(V, d, device='cuda', generator=g) / 8).bfloat16()\n"
    "worst = 0.0\n"
    "def call(name, N):\n"
    "    global worst\n"
    "    print(f'fw gemm test: {name} {N}', file=sys.stderr, flush=True)\n"
    "    h = torch.randn(N, d, device='cuda', generator=g).bfloat16()\n"
    "    t = torch.randint(0, V, (N,), device='cuda', generator=g)\n"
    "    lp = ops_cuda.linear_logprob(h, w, t)[0]\n"
    "    lp64 = (h.double() @ w.double().T).log_softmax(-1).gather(1, t[:, None]).squeeze(1)\n"
    "    worst = max(worst, float((lp.double() - lp64).norm() / lp64.norm()))\n"
    "    torch.cuda.synchronize()\n"
    "call('hot', hot)\n"
    "for N in others:\n"
    "    call('other', N)\n"
    "    call('hot', hot)\n"
    "call('again', others[0])\n"
    "print(json.dumps(worst))\n")


def gemm_cache_run(**env: str) -> tuple[list[tuple[str, list[str]]], float]:
    """GEMM_CACHE_CODE's calls, each with the gemm log lines it printed, and its worst error against float64."""
    r = subprocess.run([sys.executable, "-c", GEMM_CACHE_CODE], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "FW_GEMM": "tuned", "FW_GEMM_LOG": "1", "FW_LOGPROB_SM90": "0", **env},
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    calls: list[tuple[str, list[str]]] = []
    for ln in r.stderr.splitlines():
        if ln.startswith("fw gemm test: "):
            calls.append((ln.split()[3], []))
        elif ln.startswith("fw gemm") and calls:
            calls[-1][1].append(ln)
    return calls, json.loads(r.stdout.splitlines()[-1])


def test_linear_logprob_gemm_choices_are_a_bounded_cache():
    for cache, evicted in (("4", True), ("", False)):
        calls, worst = gemm_cache_run(FW_GEMM_CACHE=cache)
        assert len(calls) == 26 and worst < 1e-5, (cache, worst)
        assert calls[0][1] and all(log for name, log in calls if name == "other"), calls
        # the hot shape stays chosen: no line (no tuning, no new choice) after its first call
        assert not [log for name, log in calls[1:] if name == "hot" and log], calls
        # the first other shape is chosen again once 12 shapes came after it, only in a cache of 4
        assert bool(calls[-1][1]) == evicted, (cache, calls[-1])
    tiny = ("import torch, ops_cuda\nh = torch.randn(2, 8, device='cuda')\n"
            "ops_cuda.linear_logprob(h, torch.randn(5, 8, device='cuda'), torch.tensor([1, 2], device='cuda'))\n")
    for bad_value in ("0", "lots"):
        bad = subprocess.run([sys.executable, "-c", tiny], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "FW_GEMM_CACHE": bad_value}, check=False)
        assert bad.returncode != 0 and f"FW_GEMM_CACHE must be a whole number of entries >= 1, got '{bad_value}'" \
            in bad.stderr, bad.stderr[-2000:]


@pytest.mark.parametrize("save", [False, True])
def test_linear_logprob_on_a_user_stream_and_in_a_cuda_graph(save):
    """On a stream of the caller's that is still busy writing the inputs, the op waits for them and its outputs
    equal those of the default stream, bit for bit; captured in a CUDA graph (GEMM algorithms chosen before the
    capture) and replayed on new inputs, it equals the eager op. Three vocabulary tiles and two row tiles."""
    N, d, V = 4096 + 100, 128, 3 * 8192 + 5
    h = torch.empty(N, d, device=DEV, dtype=torch.bfloat16)
    w = torch.empty(V, d, device=DEV, dtype=torch.bfloat16)
    t = torch.empty(N, device=DEV, dtype=torch.long)
    gl, ge = torch.empty(N, device=DEV), torch.empty(N, device=DEV)
    C = ops_cuda.SAVED_LOGITS_CHUNK if save else 0

    def fill(seed):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        h.copy_(torch.randn(N, d, device=DEV, generator=gen))
        w.copy_(torch.randn(V, d, device=DEV, generator=gen) / 8)
        t.random_(0, V, generator=gen)
        gl.normal_(generator=gen)
        ge.normal_(generator=gen)

    def both():
        lp, ent, lse, sv, off = torch.ops.fw.linear_logprob(h, w, t, 0.9, C)
        gh, gw = torch.ops.fw.linear_logprob_backward(gl, ge, h, w, t, lse, ent, sv, off, 0.9, C)
        return lp, ent, gh, gw

    fill(0)
    eager = [x.clone() for x in both()]  # also tunes the GEMMs outside the capture
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(user):
        for x in (h, t, gl, ge):
            x.zero_()
        torch.cuda._sleep(50_000_000)  # the user stream is still busy when the op is queued
        fill(0)  # every input is rewritten behind the sleep: an op on another stream would read zeros
        poison()
        on_user = both()
    torch.cuda.current_stream().wait_stream(user)
    for x, y in zip(on_user, eager, strict=True):
        assert torch.equal(x, y)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed = both()
    for seed in (1, 2):
        fill(seed)
        g.replay()
        expect = both()
        torch.cuda.synchronize()
        for x, y in zip(graphed, expect, strict=True):
            assert torch.equal(x, y)


def test_linear_logprob_save_chunk_checked():
    h, w = torch.randn(2, 64, device=DEV, dtype=torch.bfloat16), torch.randn(10, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=f"save_chunk must be {ops_cuda.SAVED_LOGITS_CHUNK}"):
        torch.ops.fw.linear_logprob(h, w, torch.tensor([1, 2], device=DEV), 1.0, 8192)


def test_opcheck_cuda_linear_logprob_saved():
    h = torch.randn(6, 32, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(9000, 32, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(torch.ops.fw.linear_logprob.default, (h, w, torch.randint(0, 9000, (6,), device=DEV), 0.9,
                                                                ops_cuda.SAVED_LOGITS_CHUNK))


# ------------------------------------------------------------------ decode attention
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hk,S,D,lens", [
    (1, 16, 8, 1, 128, [1]),
    (3, 16, 8, 1000, 128, [0, 17, 1000]),
    (5, 8, 8, 333, 64, [333, 1, 2, 100, 64]),
    (2, 32, 4, 4099, 128, [4099, 4000]),
    (4, 16, 8, 50, 256, [50, 49, 3, 25]),
    (256, 16, 8, 300, 128, None),
    # the benchmark shapes (16 splits combined in-kernel at B=1, one at B=64)
    (1, 16, 8, 1024, 128, [1024]),
    (64, 16, 8, 1024, 128, None),
    # every GQA ratio and head_dim (multiple of 8 up to 256): generic instances, head groups when R > 8
    (3, 12, 4, 777, 80, [0, 1, 777]),
    (2, 20, 4, 513, 96, [513, 200]),
    (2, 6, 1, 1025, 160, [1, 1025]),
    (3, 7, 1, 129, 64, [129, 0, 64]),
    (2, 24, 2, 2000, 128, [2000, 1999]),
    (2, 32, 2, 300, 256, [300, 7]),
    (4, 16, 16, 65, 8, [65, 64, 63, 1]),
    (2, 9, 3, 97, 200, [97, 33]),
    (1, 40, 8, 4096, 128, [4096]),
    (1, 64, 8, 3000, 128, [2999]),
    (2, 3, 1, 70, 248, [70, 69]),
    # the tensor-core kernel (16-bit, head_dim 64 / 128) at more heads a kv head: 4, 16 and 32 (two groups of 16)
    (4, 32, 8, 1000, 128, [1000, 0, 17, 999]),
    (3, 48, 3, 130, 128, [130, 129, 1]),
    (2, 32, 1, 300, 64, [300, 1]),
    (256, 32, 8, 200, 128, None),
])
def test_decode_attention(dtype, B, Hq, Hk, S, D, lens):
    q = torch.randn(B, Hq, D, device=DEV, dtype=dtype)
    # caches as one layer of a [L, B, Hk, S, D] cache
    kc = torch.randn(2, B, Hk, S, D, device=DEV, dtype=dtype)[1]
    vc = torch.randn(2, B, Hk, S, D, device=DEV, dtype=dtype)[1]
    lengths = torch.tensor(lens, device=DEV) if lens else torch.randint(1, S + 1, (B,), device=DEV)
    scale = D ** -0.5
    poison()
    out = ops_cuda.decode_attention(q, kc, vc, lengths, scale)
    out64 = decode_attention_reference(q.double(), kc.double(), vc.double(), lengths, scale)
    assert out.dtype == dtype
    assert rel(out, out64) < TOL[dtype]
    if lens and 0 in lens:
        assert out[lens.index(0)].abs().max() == 0


def test_decode_attention_layouts_and_repeats():
    """Strided caches ([B, S, Hk, D] storage seen as [B, Hk, S, D]), misaligned q / caches (copied), lengths
    past S; calls of different shapes in turn, so the in-kernel split counters must be left at zero."""
    for _ in range(2):
        for B, Hq, Hk, S, D, dtype in [(3, 10, 2, 600, 72, torch.bfloat16), (1, 16, 8, 1024, 128, torch.float16),
                                       (5, 8, 4, 257, 64, torch.float32), (2, 32, 4, 300, 128, torch.bfloat16)]:
            q = torch.randn(B * Hq * D + 1, device=DEV, dtype=dtype)[1:].view(B, Hq, D)
            kc = torch.randn(B, S, Hk, D, device=DEV, dtype=dtype).transpose(1, 2)
            vc = torch.randn(B, S, Hk, D, device=DEV, dtype=dtype).transpose(1, 2)
            lengths = torch.randint(0, S + 50, (B,), device=DEV)
            poison()
            out = ops_cuda.decode_attention(q, kc, vc, lengths, 0.3)
            assert rel(out, decode_attention_reference(q.double(), kc.double(), vc.double(), lengths, 0.3)) < TOL[dtype]
            flat = torch.randn(B * Hk * S * D + 1, device=DEV, dtype=dtype)
            kc2, vc2 = flat[1:].view(B, Hk, S, D), flat[:-1].view(B, Hk, S, D)  # odd element offset
            out = ops_cuda.decode_attention(q, kc2, vc2, lengths, 0.3)
            expected = decode_attention_reference(q.double(), kc2.double(), vc2.double(), lengths, 0.3)
            assert rel(out, expected) < TOL[dtype]


def test_decode_attention_no_rows_or_no_heads():
    """B=0 or Hq=0 give an empty [B, Hq, D] output. In a child process: with no query heads the split count's
    block count was 0, and the host divided by it (SIGFPE)."""
    r = _child(
        "from ops_cuda import library\nlibrary.activate_cuda()\n"
        "for B, Hq in ((0, 4), (2, 0)):\n"
        "    q = torch.randn(B, Hq, 64, device='cuda', dtype=torch.bfloat16)\n"
        "    kc = torch.randn(B, 2, 10, 64, device='cuda', dtype=torch.bfloat16)\n"
        "    out = torch.ops.fw.decode_attention(q, kc, kc, torch.full((B,), 10, device='cuda'), 0.1)\n"
        "    print(tuple(out.shape))\n")
    assert r.returncode == 0, f"rc {r.returncode}: {r.stdout!r} {r.stderr[-2000:]}"
    assert r.stdout.split() == ["(0,", "4,", "64)", "(2,", "0,", "64)"], r.stdout


@pytest.mark.parametrize("dtype,Hq,Hk,D,mode,mma", [  # mma: the tensor-core kernel runs, at one split and several
    (torch.bfloat16, 32, 8, 128, "", True), (torch.float16, 24, 8, 64, "", True),
    (torch.bfloat16, 64, 8, 128, "", True),
    (torch.bfloat16, 16, 8, 128, "", True), (torch.float16, 16, 8, 64, "", True),
    (torch.bfloat16, 8, 8, 128, "", False),   # 1 head a kv head: the ring kernel ...
    (torch.bfloat16, 8, 8, 128, "2", True),   # ... unless FW_DECODE_MMA=2
    (torch.float16, 8, 8, 64, "2", True),
    (torch.float32, 32, 8, 128, "2", False),  # fp32 caches
    (torch.bfloat16, 32, 8, 96, "2", False),  # head_dim not 64 / 128
])
def test_decode_attention_kernel_choice(monkeypatch, dtype, Hq, Hk, D, mode, mma):
    """The tensor-core kernel runs where it should (profiler), and with FW_DECODE_MMA=0 the ring kernel gives the
    same outputs within rounding; both against float64, at one split (B=64) and several (B=2)."""
    for B, S in ((64, 700), (2, 3000)):
        monkeypatch.setenv("FW_DECODE_MMA", mode)  # read on every call; "" is the default
        q = torch.randn(B, Hq, D, device=DEV, dtype=dtype)
        kc = torch.randn(B, Hk, S, D, device=DEV, dtype=dtype)
        vc = torch.randn(B, Hk, S, D, device=DEV, dtype=dtype)
        lengths = torch.randint(1, S + 1, (B,), device=DEV)
        expected = decode_attention_reference(q.double(), kc.double(), vc.double(), lengths, 0.15)

        def run(args=(q, kc, vc, lengths, 0.15)):
            poison()
            return ops_cuda.decode_attention(*args)

        names = launched_kernels(run, "decode")
        assert any("decode_mma_kernel" in n for n in names) == mma, (B, names)
        out = run()
        assert rel(out, expected) < TOL[dtype]
        monkeypatch.setenv("FW_DECODE_MMA", "0")  # read on every call
        assert not any("mma" in n for n in launched_kernels(run, "decode"))
        assert rel(run(), expected) < TOL[dtype]


# the persistent tensor-core kernel (decode_mma_kernel_persistent, the default where the tensor-core kernel runs)
def _persist_lengths(kind: str, gen: torch.Generator) -> torch.Tensor:
    """many short rows (some empty), a few long ones, or a mix; row lengths as the kernel's chunking sees them"""
    if kind == "short":
        n = torch.randint(1, 301, (256,), generator=gen)
        n[torch.randperm(256, generator=gen)[:9]] = 0
        n[:2] = torch.tensor([300, 1])
    elif kind == "long":
        n = torch.tensor([4096, 1, 2500])
    else:
        n = torch.randint(1, 2049, (64,), generator=gen)
        n[:3] = torch.tensor([2048, 16, 17])
    return n


def _paged(kc: torch.Tensor, vc: torch.Tensor, bs: int, gen: torch.Generator, spare: int = 1):
    """[B, Hk, S, D] caches as pools of `bs`-position blocks in shuffled order, block 0 unused, and a block table
    of a power-of-two width at least `spare` times what S needs (the engine's tables are wider than the lengths)"""
    B, Hk, S, D = kc.shape
    per_row = -(-S // bs)
    width = 1 << max(0, (per_row * spare - 1).bit_length())
    order = (torch.randperm(B * per_row, generator=gen) + 1).view(B, per_row)
    tables = torch.zeros(B, width, dtype=torch.long)
    tables[:, :per_row] = order
    pad = per_row * bs - S

    def pool(c):
        c = torch.nn.functional.pad(c, (0, 0, 0, pad)).view(B, Hk, per_row, bs, D).transpose(1, 2)
        out = torch.randn(B * per_row + 1, Hk, bs, D, device=c.device, dtype=c.dtype)
        out[order.view(-1).to(c.device)] = c.reshape(B * per_row, Hk, bs, D)
        return out

    return pool(kc), pool(vc), tables.to(kc.device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Hq,Hk", [(16, 8), (32, 8), (32, 2), (48, 2)])   # R = 2, 4, 16, 24 (head groups 16 + 8)
@pytest.mark.parametrize("kind", ["short", "long", "mixed"])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_persistent(monkeypatch, dtype, D, Hq, Hk, kind, paged):
    """The persistent kernel against float64: many short rows (B=256, some of length 0, which give exact zeros),
    a few long rows (B=3, up to 4096) and a mix (B=64, up to 2048), contiguous and paged caches (shuffled
    16-position blocks, a table twice as wide as needed)."""
    monkeypatch.setenv("FW_DECODE_PERSIST", "2")
    gen = torch.Generator().manual_seed(D + Hq + Hk)
    lengths = _persist_lengths(kind, gen)
    B, S = len(lengths), int(lengths.max())
    q = torch.randn(B, Hq, D, device=DEV, dtype=dtype)
    kc = torch.randn(B, Hk, S, D, device=DEV, dtype=dtype)
    vc = torch.randn(B, Hk, S, D, device=DEV, dtype=dtype)
    lengths = lengths.to(DEV)
    scale = D ** -0.5
    expected = decode_attention_reference(q.double(), kc.double(), vc.double(), lengths, scale)
    if paged:
        k_pool, v_pool, tables = _paged(kc, vc, 16, gen, spare=2)

        def run():
            return ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lengths, scale)
    else:
        def run():
            return ops_cuda.decode_attention(q, kc, vc, lengths, scale)
    poison()
    names = launched_kernels(run, "decode")
    assert any("decode_mma_kernel_persistent" in n for n in names), names
    poison()
    out = run()
    assert rel(out, expected) < TOL[dtype]
    empty = (lengths == 0).nonzero().flatten().tolist()
    assert all(out[b].abs().max() == 0 for b in empty)


@pytest.mark.parametrize("bs", [8, 32, 64])
def test_decode_persistent_block_sizes(monkeypatch, bs):
    """Blocks of under 16 positions (a tile reads several table entries) and of more (tiles share an entry)."""
    monkeypatch.setenv("FW_DECODE_PERSIST", "2")
    gen = torch.Generator().manual_seed(bs)
    lengths = torch.tensor([0, 1, 15, 16, 17, 100, 1000, 999, 513, 64])
    B, S, Hq, Hk, D = len(lengths), 1000, 32, 8, 128
    q = torch.randn(B, Hq, D, device=DEV, dtype=torch.bfloat16)
    kc = torch.randn(B, Hk, S, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn(B, Hk, S, D, device=DEV, dtype=torch.bfloat16)
    lengths = lengths.to(DEV)
    k_pool, v_pool, tables = _paged(kc, vc, bs, gen)
    poison()
    out = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lengths, 0.1)
    assert rel(out, decode_attention_reference(q.double(), kc.double(), vc.double(), lengths, 0.1)) < TOL[q.dtype]
    assert out[0].abs().max() == 0


@pytest.mark.parametrize("Hq,Hk,D", [(16, 8, 128), (64, 4, 64)])
def test_decode_persistent_graph_replays(monkeypatch, Hq, Hk, D):
    """Captured once in a CUDA graph and replayed with new lengths (and q) copied into the captured tensors: every
    replay matches float64, so the kernel leaves its item, warps-done and arrival counters at zero. The lengths
    change how the rows are chunked (one chunk a row, many, rows of length 0), and eager calls of other shapes run
    between the replays on the shared counters."""
    monkeypatch.setenv("FW_DECODE_PERSIST", "2")
    gen = torch.Generator().manual_seed(7)
    B, S, dtype = 48, 1024, torch.bfloat16
    q = torch.randn(B, Hq, D, device=DEV, dtype=dtype)
    kc = torch.randn(B, Hk, S, D, device=DEV, dtype=dtype)
    vc = torch.randn(B, Hk, S, D, device=DEV, dtype=dtype)
    k_pool, v_pool, tables = _paged(kc, vc, 16, gen, spare=2)
    lengths = torch.full((B,), S, device=DEV)
    out = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lengths, 0.2)   # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lengths, 0.2)
    cases = [torch.full((B,), S), torch.randint(1, S + 1, (B,), generator=gen),
             torch.randint(0, 40, (B,), generator=gen), torch.tensor([S] + [1] * (B - 1)),
             torch.zeros(B, dtype=torch.long), torch.randint(1, S + 1, (B,), generator=gen), torch.full((B,), 17)]
    for i, n in enumerate(cases * 2):
        lengths.copy_(n)
        q.copy_(torch.randn(B, Hq, D, generator=gen).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        expected = decode_attention_reference(q.double(), kc.double(), vc.double(), lengths, 0.2)
        assert rel(out, expected) < TOL[dtype], (i, n[:8])
        if i % 3 == 0:   # an eager call of another shape between replays
            m = torch.randint(1, 300, (5,), generator=gen).to(DEV)
            q2 = torch.randn(5, Hq, D, device=DEV, dtype=dtype)
            k2, v2 = (torch.randn(5, Hk, 300, D, device=DEV, dtype=dtype) for _ in range(2))
            got = ops_cuda.decode_attention(q2, k2, v2, m, 0.2)
            assert rel(got, decode_attention_reference(q2.double(), k2.double(), v2.double(), m, 0.2)) < TOL[dtype]


@pytest.mark.parametrize("dtype,Hq,Hk,D", [(torch.bfloat16, 16, 8, 128), (torch.float16, 32, 8, 64),
                                           (torch.bfloat16, 48, 2, 128)])
def test_decode_persist_env_agrees(monkeypatch, dtype, Hq, Hk, D):
    """FW_DECODE_PERSIST=0 runs decode_mma_kernel, 2 the persistent kernel (profiler): their outputs agree within
    rounding and match float64, at many rows and at few (the other kernel's splits); the persistent kernel's
    chunk and items overrides (FW_DECODE_CHUNK, FW_DECODE_ITEMS) change no more than rounding either."""
    gen = torch.Generator().manual_seed(3)
    for B, S in ((256, 300), (2, 3000)):
        q = torch.randn(B, Hq, D, device=DEV, dtype=dtype)
        kc = torch.randn(B, Hk, S, D, device=DEV, dtype=dtype)
        vc = torch.randn(B, Hk, S, D, device=DEV, dtype=dtype)
        lengths = torch.randint(0, S + 1, (B,), generator=gen).to(DEV)
        expected = decode_attention_reference(q.double(), kc.double(), vc.double(), lengths, 0.15)

        def run(args=(q, kc, vc, lengths, 0.15)):
            poison()
            return ops_cuda.decode_attention(*args)

        outs = {}
        for persist in ("0", "2"):
            monkeypatch.setenv("FW_DECODE_PERSIST", persist)
            names = launched_kernels(run, "decode")
            assert any("decode_mma_kernel_persistent" in n for n in names) == (persist == "2"), names
            assert any("decode_mma_kernel<" in n for n in names) == (persist == "0"), names
            outs[persist] = run()
            assert rel(outs[persist], expected) < TOL[dtype], (B, persist)
        assert rel(outs["2"], outs["0"].double()) < TOL[dtype], B
        for name, value in (("FW_DECODE_CHUNK", "2"), ("FW_DECODE_CHUNK", "3"), ("FW_DECODE_CHUNK", "1000"),
                            ("FW_DECODE_ITEMS", "1"), ("FW_DECODE_ITEMS", "64")):
            monkeypatch.setenv(name, value)
            assert rel(run(), expected) < TOL[dtype], (B, name, value)
            monkeypatch.delenv(name)


@pytest.mark.parametrize("mode", [None, "0", "1"])
def test_decode_persistent_serves_paged_caches_of_many_rows_under_mode_1(monkeypatch, mode):
    """The persistent kernel runs only when asked: unset or FW_DECODE_PERSIST=0 never; 1 on a paged cache with a
    (row, kv head) per SM or more, and decode_mma_kernel on contiguous caches and on few rows. Every choice matches
    float64."""
    if mode is None:
        monkeypatch.delenv("FW_DECODE_PERSIST", raising=False)
    else:
        monkeypatch.setenv("FW_DECODE_PERSIST", mode)
    gen = torch.Generator().manual_seed(4)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for B, paged, rule in ((-(-sms // 8), True, True), (256, False, False), (2, True, False)):
        lengths = torch.randint(1, 300, (B,), generator=gen).to(DEV)
        q = torch.randn(B, 16, 128, device=DEV, dtype=torch.bfloat16)
        kc, vc = (torch.randn(B, 8, 300, 128, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        if paged:
            run = functools.partial(ops_cuda.paged_decode_attention, q, *_paged(kc, vc, 16, gen, spare=2), lengths, 0.1)
        else:
            run = functools.partial(ops_cuda.decode_attention, q, kc, vc, lengths, 0.1)
        names = launched_kernels(run, "decode")
        persistent = rule and mode == "1"
        assert any("decode_mma_kernel_persistent" in n for n in names) == persistent, (mode, B, paged, names)
        assert any("decode_mma_kernel<" in n for n in names) != persistent, (mode, B, paged, names)
        expected = decode_attention_reference(q.double(), kc.double(), vc.double(), lengths, 0.1)
        assert rel(run(), expected) < TOL[torch.bfloat16], (mode, B, paged)


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "faulthandler", "-u", "-c", "import torch\n" + code], check=False,
                          capture_output=True, text=True, timeout=600)


RAISE = ("    try:\n        call()\n        print('no error')\n"
         "    except RuntimeError as e:\n        print('RuntimeError:', str(e).splitlines()[0])\n")


def test_bad_arguments_raise_in_a_live_process():
    """The kernels' argument checks (C++ TORCH_CHECK) reach Python as RuntimeError with their message. In child
    processes, so that an abort fails this test alone; torch's own C++ errors are tried first, since on some
    machines any C++ exception crashes the process while libgcc walks the stack."""
    for what, code in (("a CPU error", "for call in (lambda: torch.ones(2).view(3),):\n" + RAISE),
                       ("a CUDA error", "for call in (lambda: torch.ones(2, device='cuda').view(3),):\n" + RAISE)):
        r = _child(code)
        if r.returncode != 0 or "RuntimeError" not in r.stdout:
            pytest.skip(f"torch itself dies on {what} here (rc {r.returncode}): {r.stderr[-500:]}")
    r = _child(
        "from ops_cuda import library\nlibrary.activate_cuda()\n"
        "q = torch.randn(1, 2, 12, device='cuda')\nkc = torch.randn(1, 1, 5, 12, device='cuda')\n"
        "for call in (lambda: torch.ops.fw.decode_attention(q, kc, kc, torch.tensor([5], device='cuda'), 0.1),\n"
        "             lambda: torch.ops.fw.rms_norm(q, torch.ones(5, device='cuda'), 1e-6)):\n" + RAISE)
    assert r.returncode == 0, f"the process died (rc {r.returncode}); it printed {r.stdout!r}; {r.stderr[-3000:]}"
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and "head_dim that is a multiple of 8" in lines[0], r.stdout
    assert "weight has 5 elements, expected 12" in lines[1], r.stdout


# ------------------------------------------------------------------ sampler
CONFIGS = [(1.0, 0, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (0.8, 40, 0.95, 0.02)]


def _check_inverse_cdf(logits, temperature, seed, tok, counters=None, tol=1e-5):
    """Plain sampling's draw against the float64 inverse CDF at the rows' uniforms: the softmax mass before each
    drawn token is at most u and through it at least u, within `tol` (the kernels sum in float32 where the float64
    cumulative sums here do not, so a target within rounding of a column's edge may take the next column)."""
    z = logits.double() / temperature
    p = z.softmax(-1)
    cdf = p.cumsum(-1)
    u = row_uniform53(seed, row_counters(len(z), counters, z.device))
    through = cdf.gather(1, tok[:, None]).squeeze(1)
    before = through - p.gather(1, tok[:, None]).squeeze(1)
    assert (before <= u + tol).all() and (through >= u - tol).all(), (before, through, u)
    assert (p.gather(1, tok[:, None]) > 0).all(), "a column without mass was drawn"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", CONFIGS)
def test_sample_matches_reference_stream(dtype, temperature, top_k, top_p, min_p):
    B, V = 8, 151936
    logits = (3 * torch.randn(B, V, device=DEV)).to(dtype)
    poison()
    tok, lp = ops_cuda.sample(logits, temperature, top_k, top_p, min_p, 1234)
    tok_ref, lp_ref = sample_reference(logits.double(), temperature, top_k, top_p, min_p, 1234)
    z = logits.double() / temperature
    keep = sampling_mask(z, top_k, top_p, min_p)
    assert keep.gather(1, tok[:, None]).all(), "a drawn token is outside the top-k / top-p / min-p set"
    if is_plain(V, top_k, top_p, min_p):   # the inverse CDF: a target at a column's edge may round across it
        _check_inverse_cdf(logits, temperature, 1234, tok)
        assert (tok == tok_ref).float().mean() >= 0.5
    else:   # same Philox stream; float64 vs fp32 noise may flip a near-tie
        assert (tok == tok_ref).float().mean() >= 0.85
    full = z.log_softmax(-1).gather(1, tok[:, None]).squeeze(1)
    assert rel(lp, full) < 1e-5, "logprob must be under the full temperature-scaled softmax"
    assert torch.equal(ops_cuda.sample(logits, temperature, top_k, top_p, min_p, 1234)[0], tok)  # deterministic
    del lp_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_sample_rows_keyed_by_counters(dtype):
    """Plain sampling with counters: each row's draw is the inverse CDF at its (counters) uniform, and rows moved
    to other slots with their counters draw the same tokens."""
    B, V = 64, 151936
    logits = (3 * torch.randn(B, V, device=DEV)).to(dtype)
    counters = torch.randint(0, 2**40, (B, 2), device=DEV)
    poison()
    tok, lp = ops_cuda.sample(logits, 0.9, 0, 1.0, 0.0, 77, counters)
    _check_inverse_cdf(logits, 0.9, 77, tok, counters)
    perm = torch.randperm(B, device=DEV)
    tok_p, lp_p = ops_cuda.sample(logits[perm], 0.9, 0, 1.0, 0.0, 77, counters[perm])
    assert torch.equal(tok_p, tok[perm]) and torch.equal(lp_p, lp[perm])
    assert (tok == sample_reference(logits.double(), 0.9, 0, 1.0, 0.0, 77, counters)[0]).float().mean() >= 0.8


def test_plain_sample_distribution_across_parts():
    """A row of 12,000 columns is drawn from in 3 parts: the drawn tokens' frequencies, in 60 cells of 200
    columns, against the softmax's mass in them."""
    V, n = 12_000, 400_000
    row = torch.randn(V, device=DEV)
    tok, _ = ops_cuda.sample(row.expand(n, V), 1.0, 0, 1.0, 0.0, 3)
    p = row.double().softmax(-1).view(60, 200).sum(-1)
    freq = torch.bincount(tok // 200, minlength=60).double() / n
    assert float((freq - p).abs().sum()) / 2 < 0.015  # total variation; sampling noise is about 0.005 here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_plain_sample_nan_and_inf_rows_match_reference(dtype, temperature):
    """Plain sampling (rows of 4 parts) against sample_reference, whose plain_mass gives a NaN logit no mass, as
    -inf: rows with a few NaN columns (one at the row's max), a part all NaN, all NaN but one column, all NaN, NaN
    among -inf, all -inf, a +inf among finite logits, a +inf and a NaN, between rows without either. The same
    tokens; logprobs NaN on the same rows (every row with a NaN, and the row all -inf), -inf on the +inf row, close
    elsewhere. Peaked logits, so that float32 sums do not move a target across a column's edge."""
    nan, inf = float("nan"), float("inf")
    B, V = 24, 3 * 4096 + 1000
    gen = torch.Generator(device=DEV).manual_seed(11)
    logits = 8 * torch.randn(B, V, device=DEV, generator=gen)
    for r in range(4):
        logits[r, torch.randint(0, V, (5 + r,), device=DEV, generator=gen)] = nan
    logits[3, logits[3].nan_to_num(-inf).argmax()] = nan
    logits[4, 4096:8192] = nan
    logits[5] = nan
    logits[5, 9000] = 0.0
    logits[6] = nan
    logits[7] = -inf
    logits[7, [5, 6000, V - 1]] = nan
    logits[8] = -inf
    logits[9, 7777] = inf
    logits[10, [3, 12000]] = torch.tensor([inf, nan], device=DEV)
    logits = logits.to(dtype)
    nan_rows = logits.isnan().any(-1)
    assert nan_rows.sum() == 9
    nan_lp = nan_rows.clone()
    nan_lp[8] = True   # all -inf: -inf against a logsumexp of -inf
    for seed in (0, 1, 77, 2**40 + 5):
        counters = torch.randint(0, 2**40, (B, 2), device=DEV, generator=gen)
        poison()
        tok, lp = ops_cuda.sample(logits, temperature, 0, 1.0, 0.0, seed, counters)
        tok_ref, lp_ref = sample_reference(logits, temperature, 0, 1.0, 0.0, seed, counters)
        assert torch.equal(tok, tok_ref), (seed, tok.tolist(), tok_ref.tolist())
        assert tok[5] == 9000 and (tok[6:11] == 0).all()
        assert torch.equal(lp.isnan(), nan_lp) and torch.equal(lp_ref.isnan(), nan_lp)
        assert lp[9] == -inf
        torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", CONFIGS)
def test_sample_distribution(temperature, top_k, top_p, min_p):
    V, n = 60, 200_000
    row = 1.5 * torch.randn(V, device=DEV)
    tok, _ = ops_cuda.sample(row.expand(n, V), temperature, top_k, top_p, min_p, 7)
    z = (row / temperature).double()[None]
    keep = sampling_mask(z, top_k, top_p, min_p)[0]
    p = torch.where(keep, z[0].softmax(-1), 0.0)
    p = p / p.sum()
    freq = torch.bincount(tok, minlength=V).double() / n
    assert float((freq - p).abs().sum()) / 2 < 0.015  # total variation; sampling noise is about 0.005 here
    assert freq[~keep].sum() == 0


def _check_sample(logits, temperature, top_k, top_p, min_p, seed=1234):
    """The drawn tokens lie in the float64 reference mask, match the reference draw on >= 85% of rows (plain
    sampling: its inverse CDF, within rounding), carry the full-softmax logprob and are deterministic."""
    poison()
    tok, lp = ops_cuda.sample(logits, temperature, top_k, top_p, min_p, seed)
    tok_ref, _ = sample_reference(logits.double(), temperature, top_k, top_p, min_p, seed)
    z = logits.double() / temperature
    keep = sampling_mask(z, top_k, top_p, min_p)
    assert keep.gather(1, tok[:, None]).all(), "a drawn token is outside the top-k / top-p / min-p set"
    if is_plain(logits.shape[1], top_k, top_p, min_p):
        _check_inverse_cdf(logits, temperature, seed, tok)
    else:
        assert (tok == tok_ref).float().mean() >= 0.85
    full = z.log_softmax(-1).gather(1, tok[:, None]).squeeze(1)
    assert rel(lp, full) < 1e-5, "logprob must be under the full temperature-scaled softmax"
    assert torch.equal(ops_cuda.sample(logits, temperature, top_k, top_p, min_p, seed)[0], tok)
    return tok, keep


# top-k <= 4096 runs on the keys gathered into shared memory (candidate path); more keys in the k-th key's
# quarter-octave bin, or a larger k, take the full-row path
CANDIDATES = [  # dtype, B, V, temperature, top_k, top_p, min_p
    (torch.float32, 1, 151936, 1.0, 50, 0.9, 0.0),  # the benchmark row, B=1
    (torch.bfloat16, 3, 151935, 0.7, 1, 1.0, 0.0),  # top_k=1, V not a multiple of 4
    (torch.float16, 5, 1001, 1.0, 20, 1e-6, 0.0),  # top_p tiny: only the max is kept
    (torch.float32, 64, 151936, 1.0, 1000, 0.95, 0.0),  # ~1500 candidates: a 2048-wide sort
    (torch.bfloat16, 16, 151936, 0.8, 40, 0.95, 0.02),  # top-k + top-p + min-p
    (torch.float32, 9, 32003, 1.3, 4096, 0.95, 0.0),  # k = the buffer size: ~4,400 in its bin, full-row path
    (torch.float32, 7, 50001, 1.0, 5000, 0.9, 0.0),  # k above the buffer: full-row path
]


@pytest.mark.parametrize("dtype,B,V,temperature,top_k,top_p,min_p", CANDIDATES)
def test_sample_top_k_candidates(dtype, B, V, temperature, top_k, top_p, min_p):
    logits = (3 * torch.randn(B, V, device=DEV)).to(dtype)
    tok, _ = _check_sample(logits, temperature, top_k, top_p, min_p)
    if top_k == 1 or top_p < 1e-3:  # only the maximum (or one of its exact ties) may be drawn
        x = logits.float()
        assert torch.equal(x.gather(1, tok[:, None]).squeeze(1), x.max(-1).values)


@pytest.mark.parametrize("V,top_k,top_p", [(1001, 50, 1.0), (1001, 50, 0.5), (100_003, 50, 0.9),
                                           (100_003, 3000, 1.0)])
def test_sample_top_k_ties(V, top_k, top_p):
    """Integer logits: thousands of exact ties at the k-th value, all kept. V=1001: ~170 ties, gathered;
    V=100,003: ~17,000 keys share the top value, more than the buffer: the full-row fallback."""
    logits = torch.randint(0, 6, (12, V), device=DEV).float()
    _, keep = _check_sample(logits, 1.0, top_k, top_p, 0.0)
    if top_p == 1.0:
        assert (keep.sum(-1) > top_k).all()  # the ties were kept


def test_full_row_top_p_is_the_same_every_run():
    """Top-p without top-k (the full-row path) with top_p at a token's exact cumulative mass: the masses per digit
    are added in whatever order the threads' atomics land, so float adds could put the edge token in or out from
    run to run; the draws of 20 calls are one. Every row holds the same values, placed at its own columns."""
    B, V, n = 16, 151936, 4096
    values = torch.full((V,), -10.0, dtype=torch.float64)
    values[:n] = -1e-4 * torch.arange(n, dtype=torch.float64)   # distinct keys, masses near 1
    mass = values.exp()
    top_p = float(mass[:3000].sum() / mass.sum())   # the edge at the 3000th largest token
    g = torch.Generator().manual_seed(5)
    logits = torch.stack([values[torch.randperm(V, generator=g)] for _ in range(B)]).float().to(DEV)
    first, _ = ops_cuda.sample(logits, 1.0, 0, top_p, 0.0, 99)
    for _ in range(19):
        assert torch.equal(ops_cuda.sample(logits, 1.0, 0, top_p, 0.0, 99)[0], first)
    drawn = logits.gather(1, first[:, None]).squeeze(1).double()
    assert (drawn >= values[3001].item() - 1e-7).all(), "a token past the top-p edge was drawn"


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_unaligned_rows(dtype):
    """Rows starting off a 16-byte boundary take the scalar loads."""
    logits = (3 * torch.randn(6, 50_001, device=DEV)).to(dtype)[:, 1:]
    assert logits.stride(1) == 1
    for cfg in ((1.0, 50, 0.9, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.0)):
        _check_sample(logits, *cfg)


def test_sample_greedy():
    logits = torch.randn(33, 1001, device=DEV)
    tok, lp = ops_cuda.sample(logits, 0.0, 5, 0.5, 0.1, 0)
    assert torch.equal(tok, logits.argmax(-1))
    assert rel(lp, logits.double().log_softmax(-1).gather(1, tok[:, None]).squeeze(1)) < 1e-6


# ------------------------------------------------------------------ programmatic dependent launch
def _chain(x, w, w_long, pos):
    """fw ops each reading the previous one's output at once: rms_norm over rows of 4,096 (the persistent kernels,
    whose groups of 256 threads own their grad_weight columns: no atomics), then rms_norm per head, rope, and swiglu
    over pairs of heads (which halves the heads), until one head is left."""
    B, T, H, D = x.shape
    y = ops_cuda.rms_norm(x.view(B, T, H * D // 4096, 4096), w_long, 1e-6).view(B, T, H, D)
    while True:
        y = ops_cuda.rms_norm(y, w, 1e-6)
        q, k = ops_cuda.rope(y, y, pos, 1e6)
        if q.shape[2] == 1:
            return q, k
        y = ops_cuda.swiglu(q.reshape(*q.shape[:2], q.shape[2] // 2, 2 * q.shape[3]))


@pytest.mark.parametrize("graph", [False, True])
def test_pdl_chain_matches_stream_order(monkeypatch, graph):
    """On Hopper the rms_norm, rope and swiglu kernels launch with programmatic dependent launch: a kernel's
    blocks become resident before the previous grid has ended (its last wave lets them) and wait
    (griddepcontrol.wait) before touching memory. A chain of those ops, forward and backward, eagerly and
    replayed from a CUDA graph (as the benchmark times them), gives the same bits with PDL as with plain stream
    order (FW_PDL=0, read on every launch). A kernel that touched memory before its wait would read its input
    before the previous kernel had written it."""
    B, T, H, D = 1, 4096, 64, 128
    x = torch.randn(B, T, H, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w, w_long = ((1 + 0.1 * torch.randn(n, device=DEV, dtype=torch.bfloat16)).requires_grad_(True) for n in (D, 4096))
    pos = torch.randint(0, 40960, (B, T), device=DEV)
    gq, gk = torch.randn(2, B, T, 1, D, device=DEV, dtype=torch.bfloat16)

    def step():
        q, k = _chain(x, w, w_long, pos)
        return (q, k, *torch.autograd.grad((q, k), (x, w, w_long), (gq, gk)))

    def run(pdl: str) -> list[list[torch.Tensor]]:
        monkeypatch.setenv("FW_PDL", pdl)
        if not graph:
            outs = []
            for _ in range(3):
                poison()
                outs.append([t.clone() for t in step()])
            return outs
        step()  # warm-up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            captured = step()
        outs = []
        for _ in range(3):
            g.replay()
            outs.append([t.clone() for t in captured])
        torch.cuda.synchronize()
        return outs

    serial = run("0")[0]
    assert not any(t.isnan().any() for t in serial)  # every element written
    for outs in run("1"):
        for a, b in zip(outs, serial):
            assert torch.equal(a, b)


# ------------------------------------------------------------------ opcheck and compile on CUDA
def _op_args():
    h = torch.randn(6, 32, device=DEV, requires_grad=True)
    w = torch.randn(50, 32, device=DEV, requires_grad=True)
    q = torch.randn(2, 5, 4, 64, device=DEV, requires_grad=True)
    k = torch.randn(2, 5, 2, 64, device=DEV, requires_grad=True)
    pos = torch.arange(5, device=DEV).expand(2, 5).contiguous()
    return {
        "rms_norm": (torch.randn(3, 64, device=DEV, requires_grad=True),
                     torch.randn(64, device=DEV, requires_grad=True), 1e-6),
        "rms_norm_backward": (torch.randn(3, 64, device=DEV), torch.randn(3, 64, device=DEV),
                              torch.randn(64, device=DEV), 1e-6),
        "rope": (q, k, pos, 1e4, False),
        "swiglu": (torch.randn(3, 32, device=DEV, requires_grad=True),),
        "swiglu_backward": (torch.randn(3, 16, device=DEV), torch.randn(3, 32, device=DEV)),
        "attention": (q, k, k.detach().clone().requires_grad_(True), None, 0.125),
        "decode_attention": (torch.randn(2, 4, 64, device=DEV), torch.randn(2, 2, 9, 64, device=DEV),
                             torch.randn(2, 2, 9, 64, device=DEV), torch.tensor([3, 9], device=DEV), 0.125),
        "linear_logprob": (h, w, torch.randint(0, 50, (6,), device=DEV), 0.9),
        "sample": (torch.randn(3, 50, device=DEV), 0.8, 5, 0.9, 0.05, 3),
        "add_rms_norm": (torch.randn(3, 64, device=DEV).bfloat16(), torch.randn(3, 64, device=DEV),
                         torch.randn(64, device=DEV), 1e-6),
        "add_rms_norm_backward": (torch.randn(3, 64, device=DEV), torch.randn(3, 64, device=DEV).bfloat16(),
                                  torch.randn(3, 64, device=DEV), torch.randn(64, device=DEV), 1e-6, torch.bfloat16),
        "qk_norm_rope": (torch.randn(5, 8 * 64, device=DEV).bfloat16().requires_grad_(True), pos[0],
                         torch.randn(64, device=DEV, requires_grad=True),
                         torch.randn(64, device=DEV, requires_grad=True), 1e-6, 1e4, 2),
        "qk_norm_rope_backward": (torch.randn(5, 4, 64, device=DEV), torch.randn(5, 2, 64, device=DEV),
                                  torch.randn(5, 2, 64, device=DEV), torch.randn(5, 8 * 64, device=DEV), pos[0],
                                  torch.randn(64, device=DEV), torch.randn(64, device=DEV), 1e-6, 1e4),
        "qk_norm_rope_write": (torch.randn(5, 8 * 64, device=DEV), pos[0], torch.randn(64, device=DEV),
                               torch.randn(64, device=DEV), 1e-6, 1e4, torch.zeros(4, 2, 16, 64, device=DEV),
                               torch.zeros(4, 2, 16, 64, device=DEV), torch.tensor([1, 1, 2, 3, 0], device=DEV),
                               torch.tensor([0, 5, 1, 15, 0], device=DEV)),
    }


@pytest.mark.parametrize("name", ["rms_norm", "rms_norm_backward", "rope", "swiglu", "swiglu_backward", "attention",
                          "decode_attention", "linear_logprob", "sample", "add_rms_norm", "add_rms_norm_backward",
                          "qk_norm_rope", "qk_norm_rope_backward", "qk_norm_rope_write"])
def test_opcheck_cuda(name):
    torch.library.opcheck(getattr(torch.ops.fw, name).default, _op_args()[name])


def test_compile_fullgraph_cuda():
    def f(x, w, gu, q, k, pos, h, lm, t):
        y = ops_cuda.rms_norm(x, w, 1e-6)
        a = ops_cuda.swiglu(gu)
        qr, kr = ops_cuda.rope(q, k, pos, 1e6)
        o = ops_cuda.attention(qr, kr, kr, pos, 0.125)
        lp, ent = ops_cuda.linear_logprob(h, lm, t, 1.0, return_entropy=True)
        return y.sum() + a.sum() + o.sum() + lp.sum() + ent.sum()

    args = [torch.randn(4, 64, device=DEV), torch.randn(64, device=DEV), torch.randn(4, 32, device=DEV),
            torch.randn(2, 6, 4, 64, device=DEV), torch.randn(2, 6, 2, 64, device=DEV),
            torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]], device=DEV),
            torch.randn(5, 64, device=DEV), torch.randn(40, 64, device=DEV), torch.randint(0, 40, (5,), device=DEV)]
    for i in (0, 1, 2, 3, 4, 6, 7):
        args[i].requires_grad_(True)
    eager = f(*args)
    ge = torch.autograd.grad(eager, [args[i] for i in (0, 1, 2, 3, 4, 6, 7)])
    compiled = torch.compile(f, fullgraph=True)(*args)
    gc = torch.autograd.grad(compiled, [args[i] for i in (0, 1, 2, 3, 4, 6, 7)])
    assert rel(compiled, eager) < 1e-5
    for a, b in zip(gc, ge):
        assert rel(a, b) < 1e-4


@pytest.mark.parametrize("top_k,top_p", [(20, 0.9), (0, 1.0)])
def test_sample_under_cuda_graph(top_k, top_p):
    logits = torch.randn(4, 100_000, device=DEV)
    tok, lp = ops_cuda.sample(logits, 1.0, top_k, top_p, 0.0, 5)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tok_g, lp_g = ops_cuda.sample(logits, 1.0, top_k, top_p, 0.0, 5)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(tok_g, tok) and torch.allclose(lp_g, lp)


def test_decode_attention_under_cuda_graph():
    """Captured once, replayed over new cache contents and lengths (as a graph-captured decode step is)."""
    B, Hq, Hk, S, D = 8, 16, 8, 700, 128
    q = torch.randn(B, Hq, D, device=DEV, dtype=torch.bfloat16)
    kc = torch.randn(B, Hk, S, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn(B, Hk, S, D, device=DEV, dtype=torch.bfloat16)
    lengths = torch.randint(1, S + 1, (B,), device=DEV)
    ops_cuda.decode_attention(q, kc, vc, lengths, 0.1)  # warm up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops_cuda.decode_attention(q, kc, vc, lengths, 0.1)
    for _ in range(2):
        q.normal_()
        kc.normal_()
        vc.normal_()
        lengths.random_(1, S + 1)
        g.replay()
        torch.cuda.synchronize()
        expected = decode_attention_reference(q.double(), kc.double(), vc.double(), lengths, 0.1)
        assert rel(out, expected) < TOL[torch.bfloat16]


@pytest.mark.parametrize("B,Hq,Hk,S,D", [(1, 16, 8, 1024, 128), (3, 20, 4, 513, 96), (64, 16, 8, 1024, 128),
                                         (1, 64, 8, 1024, 128), (16, 32, 8, 1024, 128)])
def test_decode_attention_under_cuda_graph_shapes(B, Hq, Hk, S, D):
    """Split (B=1, 3) and unsplit shapes captured once and replayed many times with new lengths (0 included):
    the split counters reset themselves on every replay."""
    q = torch.randn(B, Hq, D, device=DEV, dtype=torch.bfloat16)
    kc = torch.randn(B, Hk, S, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn(B, Hk, S, D, device=DEV, dtype=torch.bfloat16)
    lengths = torch.full((B,), S, device=DEV)
    ops_cuda.decode_attention(q, kc, vc, lengths, 0.1)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops_cuda.decode_attention(q, kc, vc, lengths, 0.1)
    for i in range(5):
        q.normal_()
        lengths.random_(0, S + 1)
        if i == 0:
            lengths[0] = 0
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        expected = decode_attention_reference(q.double(), kc.double(), vc.double(), lengths, 0.1)
        assert rel(out, expected) < TOL[torch.bfloat16]
        if i == 0:
            assert out[0].abs().max() == 0


# ------------------------------------------------------------------ varlen attention (PyTorch's varlen flash)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hq,Hk,D,lens", [
    (16, 8, 128, [2048] * 4),                          # the SFT shape of Qwen3-0.6B, one sequence a row
    (16, 8, 128, [1, 300, 0, 17, 2049, 128, 129]),     # ragged, an empty sequence, lengths across tile edges
    (32, 4, 64, [116 + n for n in (16, 256, 77, 200)]),  # RL: prompt + completion
    (8, 8, 256, [5, 70]),
    (6, 1, 80, [33, 1, 64]),
])
def test_varlen_attention(dtype, Hq, Hk, D, lens):
    """Forward and backward of the flash kernels against the float64 reference (whose backward tests/test_ops.py
    holds to autograd through per-document attention)."""
    n = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(n, Hq, D, device=DEV, dtype=dtype, requires_grad=True)
    # k and v as views of a fused projection (rows strided), as the model passes them
    kv = torch.randn(n, 2 * Hk * D, device=DEV, dtype=dtype)
    k = kv[:, :Hk * D].view(n, Hk, D).requires_grad_(True)
    v = kv[:, Hk * D:].view(n, Hk, D).requires_grad_(True)
    assert flash_serves(q)
    poison()
    out, lse = torch.ops.fw.varlen_attention(q, k, v, cu, max(lens), D ** -0.5)
    assert lse.shape == (Hq, n) and lse.dtype == torch.float32
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    out64 = ops_cuda.varlen_attention(q64, k64, v64, cu.cpu(), max(lens), D ** -0.5)
    ref = torch.autograd.grad(out64, (q64, k64, v64), grad.double().cpu())
    assert rel(out.cpu(), out64) < TOL[dtype]
    _, lse64 = torch.ops.fw.varlen_attention(q64.detach(), k64.detach(), v64.detach(), cu.cpu(), max(lens), D ** -0.5)
    assert rel(lse.cpu(), lse64) < 1e-3
    for g, r in zip(got, ref, strict=True):
        assert g.shape == r.shape and rel(g.cpu(), r) < 2 * TOL[dtype]


def test_varlen_attention_float32_uses_the_reference():
    lens = [7, 20]
    cu = torch.tensor([0, 7, 27], dtype=torch.int32, device=DEV)
    q, k, v = (torch.randn(27, h, 64, device=DEV, requires_grad=True) for h in (4, 2, 2))
    out = ops_cuda.varlen_attention(q, k, v, cu, max(lens), 0.125)
    out.sum().backward()
    out64 = ops_cuda.varlen_attention(*(t.detach().double().cpu() for t in (q, k, v)), cu.cpu(), 20, 0.125)
    assert rel(out.cpu(), out64) < 1e-5 and all(t.grad is not None for t in (q, k, v))


def test_opcheck_cuda_varlen_attention():
    cu = torch.tensor([0, 5, 5, 40, 41], dtype=torch.int32, device=DEV)
    q = torch.randn(41, 16, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(41, 8, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    torch.library.opcheck(torch.ops.fw.varlen_attention.default, (q, k, v, cu, 35, 0.088))
    out, lse = torch.ops.fw.varlen_attention(q.detach(), k.detach(), v.detach(), cu, 35, 0.088)
    torch.library.opcheck(torch.ops.fw.varlen_attention_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, cu, 35, 0.088))


def test_packed_model_on_cuda_matches_each_sequence_alone():
    """The tiny model in bf16 on packed rows (varlen flash) against each sequence alone (causal flash)."""
    from framework.models import PRESETS, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.from_hf({**PRESETS["tiny"], "vocab_size": 97})).cuda().bfloat16()
    lens = [40, 3, 85]
    seqs = [torch.randint(0, 97, (n,), device=DEV) for n in lens]
    positions = torch.cat([torch.arange(n, device=DEV) for n in lens])[None]
    with torch.no_grad():
        packed = model(torch.cat(seqs)[None], position_ids=positions)[0]
        start = 0
        for s in seqs:
            alone = model(s[None])[0]
            assert rel(packed[start:start + len(s)].float(), alone.float()) < 2e-2
            start += len(s)


# ------------------------------------------------------------------ autocast: the region's dtype
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("op", AUTOCAST_OPS)
def test_autocast_runs_the_op_in_the_region_dtype(op, dtype):
    """tests/test_ops.py's autocast test on CUDA, at shapes the kernels take: float32 inputs under CUDA autocast run
    the op in the region's dtype (float16 under fp16 autocast, not bfloat16), as aten's attention and matmul do
    there, on flash attention and (compute capability 9.0) the Hopper logprob kernel; outputs and float32 gradients
    against float64 on the CPU."""
    fn, inputs = autocast_cases(DEV)[op]

    def op_alone():
        with torch.no_grad(), torch.autocast(DEV, dtype=dtype):
            fn(*inputs)

    names = launched_kernels(op_alone, "logprob" if op == "linear_logprob" else "flash")
    # the kernels' template arguments name the dtype they run in
    cutlass, cuda = {torch.float16: ("cutlass::half_t", "__half"), torch.bfloat16: ("cutlass::bfloat16_t",
                                                                                      "__nv_bfloat16")}[dtype]
    if op == "linear_logprob":
        assert not SM90 or any(f"linear_logprob_sm90_kernel<{cuda}," in n for n in names), names
    else:
        assert flash_serves(inputs[0].to(dtype)) and any(cutlass in n for n in names), names
    poison()
    tol = {torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]   # tests/test_shared_prompt_attention.py's bounds
    check_region_dtype(op, fn, inputs, DEV, dtype, tol)


# ------------------------------------------------------------------ CUDA's last-error state
INVALID_DEVICE = 101  # cudaErrorInvalidDevice: an error that leaves the context usable (not sticky)


def cuda_runtimes() -> list[ctypes.CDLL]:
    """The CUDA runtime libraries mapped into this process once torch has initialised CUDA (torch's, which the
    extension resolves its libcudart to, and any other copy), each a handle on the loaded library."""
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if re.search(r"/libcudart\.so[.0-9]*$", line.rstrip())}
    libs = [ctypes.CDLL(p) for p in sorted(paths)]
    for lib in libs:
        lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    return libs


def _last_error_add_rms_norm():
    x, r, w = torch.randn(37, 1000, device=DEV), torch.randn(37, 1000, device=DEV), torch.randn(1000, device=DEV)

    def check(out):
        h64 = r.double() + x.double()
        y64 = h64 * (h64.square().mean(-1, keepdim=True) + 1e-6).rsqrt() * w.double()
        assert rel(out[0], h64) < TOL[torch.float32] and rel(out[1], y64) < TOL[torch.float32]
    return lambda: torch.ops.fw.add_rms_norm(x, r, w, 1e-6, None), check


def _last_error_sample(temperature: float):
    """temperature 0: the split kernels (greedy); else top_k = 1, the one-block-a-row kernel, which draws the
    maximum too."""
    logits = torch.randn(9, 20_000, device=DEV)

    def check(out):
        z = logits.double() / (temperature or 1.0)  # greedy: logprob under the unscaled softmax
        assert torch.equal(out[0], logits.argmax(-1))
        assert rel(out[1], z.gather(1, out[0][:, None]).squeeze(1) - z.logsumexp(-1)) < 1e-5
    return lambda: torch.ops.fw.sample(logits, temperature, 0 if temperature == 0 else 1, 1.0, 0.0, 7, None), check


def _last_error_linear_logprob(dtype: torch.dtype):
    """float32: cuBLAS logits and the chunk kernels; 16-bit on compute capability 9.0: the Hopper kernel."""
    h = torch.randn(37, 128, device=DEV).to(dtype)
    w = (torch.randn(5003, 128, device=DEV) / 128**0.5).to(dtype)
    t = torch.randint(0, 5003, (37,), device=DEV)

    def check(out):
        lp64, ent64 = logprob_entropy64((h.double() @ w.double().T) / 0.7, t)
        assert rel(out[0], lp64) < 1e-5 and rel(out[1], ent64) < 1e-5
    return lambda: torch.ops.fw.linear_logprob(h, w, t, 0.7, 0), check


def _last_error_adamw_step():
    params = [torch.randn(1000, device=DEV), torch.randn(3, 257, device=DEV)]
    grads, ms = [torch.randn_like(p) for p in params], [torch.randn_like(p) for p in params]
    vs = [torch.rand_like(p) for p in params]
    before = [[t.double() for t in ts] for ts in (params, ms, vs)]
    lr, b1, b2, wd, eps, step = 1e-2, 0.9, 0.95, 0.1, 1e-8, 3
    empty = torch.empty(0, device=DEV)

    def call():
        torch.ops.fw.adamw_step(params, grads, ms, [empty, empty], vs, [empty, empty], empty, empty, lr, b1, b2, wd,
                                eps, 1 - b1**step, 1 - b2**step, False, 0)
        return params, ms, vs

    def check(out):
        for i, g in enumerate(grads):
            p, m, v = (ts[i] for ts in before)
            m = b1 * m + (1 - b1) * g.double()
            v = b2 * v + (1 - b2) * g.double().square()
            p = p * (1 - lr * wd) - lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
            assert rel(out[0][i], p) < 1e-5 and rel(out[1][i], m) < 1e-6 and rel(out[2][i], v) < 1e-6
    return call, check


LAST_ERROR_OPS = {
    "add_rms_norm": _last_error_add_rms_norm,  # launch_kernel
    "sample_greedy": lambda: _last_error_sample(0.0),
    "sample_top_k": lambda: _last_error_sample(0.5),
    "linear_logprob_fp32": lambda: _last_error_linear_logprob(torch.float32),
    "linear_logprob_bf16": lambda: _last_error_linear_logprob(torch.bfloat16),
    "adamw_step": _last_error_adamw_step,
}


@pytest.mark.parametrize("op", list(LAST_ERROR_OPS))
def test_an_earlier_unread_cuda_error_is_not_the_ops(op):
    """A failed CUDA runtime call records its error in the thread's last-error state until cudaGetLastError reads
    it. An fw op called while such an error (not sticky) is unread runs and reports success, and leaves the error
    for its owner to read: its launches are checked by the value their launch call returns, never by that state
    (common.cuh, at cleared())."""
    libs = cuda_runtimes()
    if not libs:
        pytest.skip("no libcudart.so is mapped into this process (a CUDA runtime linked statically)")
    call, _ = LAST_ERROR_OPS[op]()
    call()  # the first call's one-off work (GEMM tuning, cached buffers) may run torch's kernels, which read it
    torch.cuda.synchronize()
    call, check = LAST_ERROR_OPS[op]()
    torch.cuda.synchronize()
    try:
        value = ctypes.c_int()
        for lib in libs:
            assert lib.cudaDeviceGetAttribute(ctypes.byref(value), 16, 10_000) == INVALID_DEVICE  # 16: SM count
            assert lib.cudaPeekAtLastError() == INVALID_DEVICE
        out = call()
        left = [lib.cudaGetLastError() for lib in libs]
    finally:
        for lib in libs:
            lib.cudaGetLastError()
    assert left == [INVALID_DEVICE] * len(libs), "the op read (or replaced) the earlier error"
    torch.cuda.synchronize()
    check(out)
