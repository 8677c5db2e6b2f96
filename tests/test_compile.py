"""torch.compile(fullgraph=True) of the tiny Qwen3 forward and backward (every fw op on the training path:
rms_norm, QK-norm, rope, attention plain and packed, swiglu, fused linear + logprob) runs with no graph
break on CPU and matches eager."""
from __future__ import annotations

import pytest
import torch

import ops_cuda
from framework.models import PRESETS, Qwen3Config, Qwen3ForCausalLM


def tiny(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config.from_hf({**PRESETS["tiny"], "vocab_size": 97}))


def loss_fn(model, ids, positions):
    hidden = model(ids[:, :-1], position_ids=positions, return_hidden=True)
    lp, ent = ops_cuda.linear_logprob(hidden.reshape(-1, hidden.shape[-1]), model.lm_head_weight,
                                      ids[:, 1:].reshape(-1), 0.9, return_entropy=True)
    return -lp.mean() + 0.01 * ent.mean()


@pytest.mark.parametrize("packed", [False, True])
def test_compiled_model_matches_eager(packed):
    model = tiny()
    ids = torch.randint(0, 97, (2, 17))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3],
                              list(range(16))]) if packed else None
    eager = loss_fn(model, ids, positions)
    g_eager = torch.autograd.grad(eager, list(model.parameters()))
    torch._dynamo.reset()
    compiled_fn = torch.compile(loss_fn, fullgraph=True)  # raises on any graph break
    compiled = compiled_fn(model, ids, positions)
    g_comp = torch.autograd.grad(compiled, list(model.parameters()))
    assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_comp, g_eager):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_compile_model_module_fullgraph():
    model = tiny(1)
    ids = torch.randint(0, 97, (3, 9))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out, ref = compiled(ids), model(ids)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_compiled_model_matches_eager_cuda(packed):
    """The same on CUDA: the fw CUDA kernels inside an inductor graph, forward and backward."""
    model = tiny(2).cuda()
    ids = torch.randint(0, 97, (2, 17), device="cuda")
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3], list(range(16))],
                             device="cuda") if packed else None
    eager = loss_fn(model, ids, positions)
    g_eager = torch.autograd.grad(eager, list(model.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True)(model, ids, positions)
    g_comp = torch.autograd.grad(compiled, list(model.parameters()))
    assert torch.allclose(compiled, eager, rtol=1e-4, atol=1e-5)
    for a, b in zip(g_comp, g_eager):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5)
