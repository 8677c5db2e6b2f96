"""fw::adamw_step, the fused step of the lean optimizers: its quantizer against a brute-force nearest-value search, the
fused optimizer against torchao's own per-parameter step (the arithmetic it claims to share), opcheck, and on a GPU
the CUDA kernel against the torch reference and against torchao's step there."""

import io
import math

import pytest
import torch

import ops_cuda
from ops_cuda.adamw_step import BLOCK, dequantize, quantize

torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim.subclass_8bit import OptimState8bit

from framework.optim import _fused_class

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def eager_torchao():
    """torchao's reference steps run eagerly: the same arithmetic as its per-shape compiled calls, without a cold
    inductor compile of each shape (which would dominate this file's time on a CPU)."""
    with torch.compiler.set_stance("force_eager"):
        yield


def qmaps(device="cpu"):
    z = OptimState8bit.zeros((BLOCK,), signed=True, device=device), OptimState8bit.zeros((BLOCK,), signed=False,
                                                                                        device=device)
    return z[0].qmap, z[1].qmap


def test_quantize_picks_the_nearest_map_value():
    """Each code is the map value nearest to x / scale (float64 brute force; the upper one at an exact midpoint), and
    each block's scale is its absolute maximum."""
    g = torch.Generator().manual_seed(0)
    for qmap, x in zip(qmaps(), (torch.randn(64 * BLOCK, generator=g) * 1e-3,
                                 torch.rand(64 * BLOCK, generator=g).square() * 1e-6)):
        codes, scale = quantize(x, qmap)
        blocks = x.double().view(-1, BLOCK)
        torch.testing.assert_close(scale.double(), blocks.abs().amax(-1), rtol=0, atol=0)
        y = (blocks / blocks.abs().amax(-1, keepdim=True)).view(-1)
        distance = (y[:, None] - qmap.double()[None, :]).abs()
        nearest = distance.min(-1).values
        chosen = distance.gather(1, codes.long().view(-1, 1)).squeeze(1)
        # float32 division of x by its scale may move y by an ulp: the chosen value is the nearest up to that
        assert float((chosen - nearest).max()) <= 2**-22
        assert float((chosen > nearest).float().mean()) < 1e-3
        back = dequantize(codes, scale, qmap).double()
        assert float((back - x.double()).abs().max()) <= float(blocks.abs().max()) * 0.05


def _models(dtype, device, seed=0):
    """Two copies of the same weights: a matrix with 8-bit moments (>= 4096 values, blocks of 256), a vector and a
    matrix of an odd size with plain moments."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(512, 64), (64,), (37, 29)]
    values = [torch.randn(s, generator=g) for s in shapes]
    return [[torch.nn.Parameter(v.clone().to(device, dtype)) for v in values] for _ in range(2)]


def _steps(opt_a, opt_b, a, b, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p, q in zip(a, b, strict=True):
            grad = (torch.randn(p.shape, generator=g) + 0.3).to(p.device, p.dtype)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()


def _compare(opt_a, opt_b, a, b, param_rtol):
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=param_rtol, atol=param_rtol)
        for key in ("exp_avg", "exp_avg_sq"):
            s, t = opt_a.state[p][key], opt_b.state[q][key]
            if isinstance(s, OptimState8bit):
                # a code may flip where float rounding puts a value at a midpoint between two map values
                assert float((s.codes != t.codes).float().mean()) < 2e-3
                torch.testing.assert_close(s.scale, t.scale, rtol=1e-5, atol=0)
                torch.testing.assert_close(s.dequantize(), t.dequantize(), rtol=0, atol=float(t.scale.max()) * 0.05)
            else:
                torch.testing.assert_close(s, t, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_step_equals_torchaos_adamw8bit(device):
    """Four steps, two parameter groups: the fused optimizer keeps torchao AdamW8bit's states and takes its steps."""
    if device == "cuda" and not CUDA:
        pytest.skip("no CUDA")
    a, b = _models(torch.float32, device)
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    groups = lambda ps: [{"params": [ps[0], ps[2]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}]
    fused = _fused_class(torchao_optim.AdamW8bit)(groups(a), **kwargs)
    plain = torchao_optim.AdamW8bit(groups(b), **kwargs)
    _steps(fused, plain, a, b, 4)
    assert isinstance(fused.state[a[0]]["exp_avg"], OptimState8bit)
    _compare(fused, plain, a, b, 2e-5)
    loaded = _fused_class(torchao_optim.AdamW8bit)(groups(_models(torch.float32, device)[0]), **kwargs)
    loaded.load_state_dict(plain.state_dict())   # the state dicts are interchangeable
    assert loaded.state_dict()["state"][0]["exp_avg"].codes.equal(plain.state[b[0]]["exp_avg"].codes)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_step_equals_torchaos_adamw_on_bfloat16_weights(device):
    """torchao's _AdamW on bfloat16 weights with nearest rounding (its plain moments in bfloat16): the same steps."""
    if device == "cuda" and not CUDA:
        pytest.skip("no CUDA")
    a, b = _models(torch.bfloat16, device)
    fused = _fused_class(torchao_optim._AdamW)(a, lr=1e-2, weight_decay=0.01, bf16_stochastic_round=False)
    plain = torchao_optim._AdamW(b, lr=1e-2, weight_decay=0.01, bf16_stochastic_round=False)
    _steps(fused, plain, a, b, 3)
    for p, q in zip(a, b, strict=True):   # a bfloat16 rounding of the last step may differ: one ulp
        p, q = p.detach().float(), q.detach().float()
        assert float((p - q).abs().max()) <= 2**-7 * float(q.abs().max())
        assert float((p != q).float().mean()) < 0.01


def saved(state_dict: dict) -> dict:
    """The state dict through torch.save and torch.load, as a checkpoint holds it (loading one into an optimizer
    keeps its 8-bit state objects, which would then be shared)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_fused_step_makes_float32_states_under_a_bfloat16_default_and_converts_loaded_ones():
    """Under a bfloat16 default dtype (bf16-true's forward context) the fused step's new states are float32; a
    state dict whose counters and scales are bfloat16 (torchao's own step made it there) loads and steps as the
    float32 one does."""
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    a, b = _models(torch.float32, "cpu")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        fused = _fused_class(torchao_optim.AdamW8bit)(a, **kwargs)
        plain = torchao_optim.AdamW8bit(b, **kwargs)
        _steps(fused, plain, a, b, 2)
    finally:
        torch.set_default_dtype(default)
    for opt, p, dtype in ((fused, a[0], torch.float32), (plain, b[0], torch.bfloat16)):
        assert opt.state[p]["step"].dtype == dtype and opt.state[p]["exp_avg"].scale.dtype == dtype
    c, _ = _models(torch.float32, "cpu")
    for p, q in zip(c, b, strict=True):
        p.data.copy_(q.detach())
    loaded = _fused_class(torchao_optim.AdamW8bit)(c, **kwargs)
    loaded.load_state_dict(saved(plain.state_dict()))
    reference = _fused_class(torchao_optim.AdamW8bit)([torch.nn.Parameter(q.detach().clone()) for q in b], **kwargs)
    state = saved(plain.state_dict())
    for s in state["state"].values():   # the same values in float32
        s["step"] = s["step"].float()
        for key in ("exp_avg", "exp_avg_sq"):
            if isinstance(s[key], OptimState8bit):
                s[key].scale = s[key].scale.float()
    reference.load_state_dict(state)
    _steps(loaded, reference, c, reference.param_groups[0]["params"], 1)
    assert loaded.state[c[0]]["step"].dtype == torch.float32 and float(loaded.state[c[0]]["step"]) == 3.0
    assert loaded.state[c[0]]["exp_avg"].scale.dtype == torch.float32
    for p, q in zip(c, reference.param_groups[0]["params"], strict=True):
        assert torch.equal(p, q)


def _op_inputs(device, dtype=torch.float32, count=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    qs, qu = qmaps()
    sizes = [8 * BLOCK, 1000, 64, 16 * BLOCK][:count] if count <= 4 else [
        (8 + i % 3) * BLOCK if i % 2 else 100 + 37 * i for i in range(count)]
    params, grads, ms, mss, vs, vss = [], [], [], [], [], []
    for n in sizes:
        params.append(torch.randn(n, generator=g).to(device, dtype))
        grads.append(torch.randn(n, generator=g).to(device, dtype))
        m, v = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
        if n % BLOCK == 0 and n >= 4096:
            (mc, msc), (vc, vsc) = quantize(m, qs), quantize(v, qu)
            ms.append(mc.to(device)), mss.append(msc.to(device)), vs.append(vc.to(device)), vss.append(vsc.to(device))
        else:
            empty = torch.empty(0, device=device)
            ms.append(m.to(device, dtype)), mss.append(empty), vs.append(v.to(device, dtype)), vss.append(empty)
    return params, grads, ms, mss, vs, vss, qs.to(device), qu.to(device)


HYPER = {"lr": 3e-3, "betas": (0.9, 0.999), "weight_decay": 0.05, "eps": 1e-8, "step": 7}


def test_opcheck():
    torch.library.opcheck(torch.ops.fw.adamw_step.default, (
        *_op_inputs("cpu"), 1e-3, 0.9, 0.999, 0.01, 1e-8, 0.1, 0.001, False, 0))


def test_lists_of_different_lengths_are_refused():
    params, grads, ms, mss, vs, vss, qs, qu = _op_inputs("cpu")
    with pytest.raises(ValueError, match="ops_cuda.adamw_step: the six tensor lists"):
        ops_cuda.adamw_step(params, grads[:2], ms, mss, vs, vss, qs, qu, **HYPER)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_equals_the_reference(dtype):
    """50 tensors (three launches), 8-bit and plain moments, odd sizes: the kernel against the torch reference on the
    CPU (the outputs are the inputs, updated in place: an element the kernel skips keeps its old, distant value)."""
    cpu = _op_inputs("cpu", dtype, count=50, seed=3)
    gpu = [[t.cuda() for t in x] if isinstance(x, list) else x.cuda() for x in cpu]
    ops_cuda.adamw_step(*cpu, **HYPER)
    ops_cuda.adamw_step(*gpu, **HYPER)
    torch.cuda.synchronize()
    for i in range(50):
        p_ref, p = cpu[0][i].double(), gpu[0][i].cpu().double()
        bound = 1e-6 if dtype == torch.float32 else 2**-8
        assert float((p - p_ref).abs().max()) <= bound * max(1.0, float(p_ref.abs().max())), i
        if cpu[3][i].numel():
            for codes, scale, codes_ref, scale_ref in ((gpu[2][i], gpu[3][i], cpu[2][i], cpu[3][i]),
                                                       (gpu[4][i], gpu[5][i], cpu[4][i], cpu[5][i])):
                assert float((codes.cpu() != codes_ref).float().mean()) < 2e-3, i
                torch.testing.assert_close(scale.cpu(), scale_ref, rtol=1e-6, atol=0)
        else:   # plain moments: within a few roundings of their largest value (the kernel may fuse a multiply-add)
            for new, ref in ((gpu[2][i].cpu(), cpu[2][i]), (gpu[4][i].cpu(), cpu[4][i])):
                scale = float(ref.float().abs().max())
                ulp = 2**-23 if dtype == torch.float32 else 2**-7
                assert float((new.float() - ref.float()).abs().max()) <= 4 * ulp * scale, i


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA")
def test_cuda_stochastic_rounding_lands_on_a_neighbour_without_bias():
    """bfloat16 weights in [1, 2) and a step far below their resolution: each weight lands on one of the two bfloat16
    neighbours of the float32 update, and their mean on the float32 update's mean."""
    n = 64 * BLOCK
    g = torch.Generator().manual_seed(5)
    start = (1 + torch.rand(n, generator=g)).bfloat16()
    grad = torch.rand(n, generator=g) + 0.1
    empty = torch.empty(0)
    exact = start.float().clone()
    m, v = torch.zeros(n), torch.zeros(n)
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0, "eps": 1e-8, "step": 1}
    ops_cuda.adamw_step([exact], [grad], [m], [empty], [v], [empty], empty, empty, **hyper)
    p = start.cuda()
    mb, vb = torch.zeros(n, device="cuda", dtype=torch.bfloat16), torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    e = torch.empty(0, device="cuda")
    ops_cuda.adamw_step([p], [grad.cuda()], [mb], [e], [vb], [e], e, e, **hyper, stochastic_round=True, seed=11)
    p = p.cpu().double()
    assert bool(((p - exact.double()).abs() <= 2**-7).all())
    assert bool((p != start.double()).any())   # nearest rounding would leave every weight where it was
    bias = float((p - exact.double()).mean())
    assert abs(bias) < 5 * 2**-8 / math.sqrt(n), bias
