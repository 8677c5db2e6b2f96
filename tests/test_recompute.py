"""Selective recomputation (`gradient_checkpointing: selective`, framework/models/recompute.py): the same
gradients bit for bit as keeping every activation, and the activation bytes the memory plan counts, measured
by the storages the autograd graph saves for the backward."""
from __future__ import annotations

import json
from typing import Self

import pytest
import torch
from test_fit_step import DATA

import ops_cuda
from framework.config import resolve
from framework.errors import FwError
from framework.memory_plan import layer_saved_bytes, model_saved_bytes
from framework.models import Qwen3ForCausalLM, recompute
from framework.models.lora import add_adapters
from framework.models.presets import preset_config
from framework.models.value import Qwen3ValueModel
from framework.trainer import fit
from ops_cuda.qk_norm_rope import _separate_ops


class SavedStorages:
    """The storages the autograd graph keeps for the backward, seen where it saves them: each tensor a saved-tensor
    hook packs as itself (under selective recomputation, each that SelectiveRecompute._pack keeps, and the inputs of
    the recipes it packs instead), by storage: the views of one storage count once, with the storage's bytes."""

    def __init__(self) -> None:
        self.kept: dict[int, tuple[int, torch.dtype]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._keep, lambda t: t)
        self._pack = recompute.SelectiveRecompute._pack

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        self.kept[s.data_ptr()] = (s.nbytes(), t.dtype)
        return t

    def _selective_pack(self, recorder: recompute.SelectiveRecompute, t: torch.Tensor) -> object:
        out = self._pack(recorder, t)
        for kept in out.recipe.args if isinstance(out, recompute._Saved) else (out,):
            if isinstance(kept, torch.Tensor):
                self._keep(kept)
        return out

    def __enter__(self) -> Self:
        # SelectiveRecompute's own hooks replace these inside the layers: observe what its _pack keeps there
        recompute.SelectiveRecompute._pack = lambda recorder, t: self._selective_pack(recorder, t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        recompute.SelectiveRecompute._pack = self._pack

    def kept_bytes(self, exclude: set[int]) -> int:
        return sum(n for ptr, (n, _) in self.kept.items() if ptr not in exclude)


def _grads(model, ids, positions, autocast: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, positions)
        loss = out.float().logsumexp(-1).mean() if out.dim() == 3 else out.float().square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _inputs(packed: bool, T: int = 24):
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(T).repeat(2, 1)
    if packed:
        positions[:, T // 2:] -= T // 2
    return ids, positions


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_selective_gives_the_same_gradients_bit_for_bit(autocast, packed):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(preset_config("tiny", 256)).train()
    ids, positions = _inputs(packed)
    kept = _grads(model, ids, positions if packed else None, autocast)
    model.gradient_checkpointing = "selective"
    recomputed = _grads(model, ids, positions if packed else None, autocast)
    assert len(kept) == len(recomputed) == len(list(model.parameters()))
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)


def test_selective_with_lora_and_the_value_model():
    torch.manual_seed(0)
    value = Qwen3ValueModel.from_policy(Qwen3ForCausalLM(preset_config("tiny", 256))).train()
    torch.nn.init.normal_(value.v_head.weight, std=0.02)   # a zero head would give the trunk zero gradients
    policy = Qwen3ForCausalLM(preset_config("tiny", 256)).train()
    add_adapters(policy, {"rank": 4, "alpha": 8, "dropout": 0.0,
                          "targets": ["q_proj", "v_proj", "gate_proj", "down_proj"]})
    for p in policy.parameters():   # adapters start with B = 0: give every adapter a gradient path
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    ids, positions = _inputs(packed=True)
    for model in (policy, value):
        model.gradient_checkpointing = False
        kept = _grads(model, ids, positions, autocast=True)
        model.gradient_checkpointing = "selective"
        recomputed = _grads(model, ids, positions, autocast=True)
        assert kept and len(kept) == len(recomputed)
        assert all(torch.equal(a, b) for a, b in zip(kept, recomputed))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_activation_bytes_are_what_the_memory_plan_counts(autocast):
    """Measured on Qwen3-0.6B's layer shapes (two layers, packed rows, a small vocabulary): the bytes per token
    the autograd graph keeps for the backward in each mode, against layer_saved_bytes (under gradient checkpointing
    the layers' inputs). Under autocast the weights' bf16 casts (autocast's cache) are left out: the plan counts
    them apart."""
    cfg = preset_config("qwen3-0.6b", 512)
    cfg.num_hidden_layers = 2
    T = 128
    ids = torch.randint(0, 512, (1, T), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(T)[None].clone()
    positions[:, T // 2:] -= T // 2
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    casts = {p.numel() * 2 for p in model.parameters()}
    residual, compute = 4, (2 if autocast else 4)
    measured = {}
    for mode in (False, True, "selective"):
        model.gradient_checkpointing = mode
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), SavedStorages() as saved:
            h = model(ids, positions, return_hidden=True)
        exclude = params | {h.untyped_storage().data_ptr()}
        if autocast:   # autocast's cached bf16 copies of the weights
            exclude |= {ptr for ptr, (n, dtype) in saved.kept.items() if dtype == torch.bfloat16 and n in casts}
        measured[mode] = saved.kept_bytes(exclude) / T
        del h, saved
    outside = model_saved_bytes(cfg, residual)
    for mode, selective in ((False, False), ("selective", True)):
        plan = cfg.num_hidden_layers * layer_saved_bytes(cfg, T, True, residual, compute, "cpu",
                                                         selective=selective) + outside
        assert measured[mode] == pytest.approx(plan, abs=16), (mode, measured, plan)
    assert measured[True] == pytest.approx(cfg.num_hidden_layers * cfg.hidden_size * residual + outside, abs=16)
    # by hand: the norms' outputs (2 x hidden), q and k after RoPE with v's copy (q_size + 2 kv_size) and SwiGLU's
    # output
    by_hand = (2 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + cfg.intermediate_size) * compute
    assert measured[False] - measured["selective"] == pytest.approx(cfg.num_hidden_layers * by_hand, abs=16)


def _qk_norm_rope_by_hand(qkv, positions, q_weight, k_weight, eps, theta, num_kv_heads):
    """Qwen3's QK-norm then NeoX RoPE, float64 throughout."""
    D = q_weight.shape[0]
    q, k, v = qkv.view(qkv.shape[0], -1, D).split([qkv.shape[1] // D - 2 * num_kv_heads, num_kv_heads,
                                                     num_kv_heads], dim=1)
    angle = positions[:, None, None].double() / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    cos, sin = angle.cos(), angle.sin()

    def rotated(x, w):
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rotated(q, q_weight), rotated(k, k_weight), v


@pytest.mark.parametrize("fn", [ops_cuda.qk_norm_rope, _separate_ops], ids=["op", "separate-ops"])
def test_qk_norm_rope_outputs_are_recomputed_through_the_callers_views(fn):
    """q, k and v own their storage (the op's CPU kernel, also the CUDA fallback, and the separate ops of the head
    sizes the CUDA kernel does not take), so selective recomputation finds them behind the views the attention
    takes: the graph keeps none of them, and the values and gradients are the float64 maths by hand."""
    N, Hk, D, eps, theta = 5, 1, 6, 1e-6, 1e4
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(N, (3 + 2 * Hk) * D, dtype=torch.float64, generator=g, requires_grad=True)
    positions = torch.tensor([0, 1, 2, 0, 1])
    q_weight, k_weight = (1 + 0.2 * torch.randn(2, D, dtype=torch.float64, generator=g)).requires_grad_().unbind(0)
    w = [torch.randn(N, H, D, dtype=torch.float64, generator=g) for H in (3, Hk, Hk)]
    with SavedStorages() as saved, recompute.SelectiveRecompute():
        out = recompute.cheap(fn, qkv, positions, q_weight, k_weight, eps, theta, Hk)
        # as Qwen3Attention._qkv hands them on; the products save the views
        loss = sum((t.view(1, N, -1, D) * t.view(1, N, -1, D) * wt[None]).sum() for t, wt in zip(out, w))
    assert not {t.untyped_storage().data_ptr() for t in out} & saved.kept.keys()
    grads = torch.autograd.grad(loss, (qkv, q_weight, k_weight))
    ref = _qk_norm_rope_by_hand(qkv, positions, q_weight, k_weight, eps, theta, Hk)
    ref_grads = torch.autograd.grad(sum((t * t * wt).sum() for t, wt in zip(ref, w)), (qkv, q_weight, k_weight))
    for a, b in zip(out + grads, ref + ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_an_input_changed_in_place_after_the_forward_is_an_error():
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(preset_config("tiny", 256)).train()
    model.gradient_checkpointing = "selective"
    ids, _ = _inputs(packed=False)
    loss = model(ids).logsumexp(-1).mean()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.0)    # bumps a version the backward checks anyway
        model.model.layers[1].self_attn.q_norm.weight.add_(1.0)  # an input of a recomputed op
    with pytest.raises(RuntimeError, match="modified"):
        loss.backward()


def test_the_mode_is_checked_and_selective_recomputes_the_logits():
    model = Qwen3ForCausalLM(preset_config("tiny", 256))
    with pytest.raises(FwError, match='gradient_checkpointing must be false, true or "selective"'):
        model.gradient_checkpointing = "layers"
    assert model.saves_logits
    model.gradient_checkpointing = "selective"
    assert not model.saves_logits
    model.keep_logits = True
    assert model.saves_logits


def test_fw_fit_with_selective_logs_the_same_losses(tmp_path):
    runs = {}
    for mode in (False, "selective"):
        fit(resolve({
            "recipe": "sft", "run_dir": str(tmp_path / str(mode) / "run"),
            "model": {"policy": {"preset": "tiny", "gradient_checkpointing": mode, "keep_logits": False}},
            "data": {"path": DATA, "max_seq_len": 64, "batch_size": 2},
            "trainer": {"accelerator": "cpu", "max_steps": 4, "log_every_n_steps": 1},
            "checkpoint": {"every_n_steps": 100}}))
        lines = (tmp_path / str(mode) / "run" / "metrics.jsonl").read_text().splitlines()
        runs[mode] = [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines) if "loss" in r]
    assert len(runs[False]) >= 3
    assert runs[False] == runs["selective"]


@pytest.mark.gpu
def test_selective_on_cuda_same_gradients_and_the_memory_it_saves():
    """The CUDA kernels (flash varlen attention, fw's norms, RoPE and SwiGLU) under bf16 autocast: the same
    gradients up to the run-to-run noise of flash attention's backward (its atomics add in any order), and the
    peak memory of forward + backward lower by what the recomputed tensors take."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = preset_config("qwen3-0.6b", 4096)
    cfg.num_hidden_layers = 8   # one layer's recompute, alive in the backward, stays a small share
    T, rows = 2048, 4
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).cuda().train()
    ids = torch.randint(0, 4096, (rows, T), device="cuda")
    positions = (torch.arange(T, device="cuda") % 512).expand(rows, T)
    grads, peaks = {}, {}
    for run, mode in enumerate((False, "selective", False)):
        model.gradient_checkpointing = mode
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model(ids, positions, return_hidden=True)
        h.float().square().mean().backward()
        torch.cuda.synchronize()
        peaks[run] = torch.cuda.max_memory_allocated() - base
        grads[run] = [p.grad.clone() for p in model.parameters()]
        del h

    def rel(a, b):
        return max(((x - y).norm() / y.norm().clamp_min(1e-30)).item() for x, y in zip(a, b))

    noise, err = rel(grads[2], grads[0]), rel(grads[1], grads[0])
    print(f"selective vs kept: {err:.2e}; kept vs kept: {noise:.2e}")
    # A recompute that differs from the tensor it replaces (a missed cast, a wrong input) moves the gradients
    # by far more than the backward's own ordering noise.
    assert err <= 2 * noise + 1e-3, (err, noise)
    saved = (2 * cfg.hidden_size + cfg.q_size + cfg.kv_size + cfg.intermediate_size) * 2 * rows * T
    assert peaks[0] - peaks[1] == pytest.approx(cfg.num_hidden_layers * saved, rel=0.2), peaks
