"""adamw_step: one AdamW step over lists of tensors, in place: torchao's AdamW8bit / _AdamW arithmetic and state
layout (framework/optim.py steps them with it), in one launch per 24 tensors on CUDA instead of a compiled call per
parameter.

A tensor's moments are plain (the parameter's dtype; its scales an empty tensor) or 8-bit: uint8 codes into a
256-value map (signed for the first moment, unsigned for the second) times one float32 scale per 256-element block,
the block's absolute maximum. CUDA kernels: csrc/adamw_step.cu.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ops_cuda.library import define, fail

BLOCK = 256   # elements per quantization block (torchao's default block_size for AdamW8bit)


def dequantize(codes: Tensor, scale: Tensor, qmap: Tensor) -> Tensor:
    """float32 values of 8-bit moments: qmap[code] times the code's block scale."""
    return (qmap[codes.long()].view(scale.numel(), -1) * scale.view(-1, 1)).view(codes.shape)


def quantize(x: Tensor, qmap: Tensor) -> tuple[Tensor, Tensor]:
    """(uint8 codes, float32 block scales) of float32 `x`: each block divided by its absolute maximum (at least
    1e-12), then the code of the largest map value at or below it, or the next one up from the midpoint on."""
    blocks = x.reshape(-1, BLOCK)
    scale = blocks.abs().amax(-1).clamp_min(1e-12)
    y = blocks / scale[:, None]
    codes = torch.zeros_like(y, dtype=torch.long)
    for step in (128, 64, 32, 16, 8, 4, 2, 1):   # branch-free binary search, as torchao's
        codes += torch.where(y >= qmap[codes + step], step, 0)
    up = (codes + 1).clamp_max(255)
    down_v, up_v = qmap[codes], qmap[up]
    codes = torch.where(y - down_v >= (up_v - down_v) * 0.5, up, codes)
    return codes.to(torch.uint8).view(x.shape), scale


def bf16_stochastic(x: Tensor, generator: torch.Generator) -> Tensor:
    """float32 -> bfloat16, away from zero with probability (the 16 bits dropped) / 2^16, else towards zero."""
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    up = noise < (bits & 0xFFFF)
    return torch.where(up, (bits & -65536) + 65536, bits & -65536).view(torch.float32).bfloat16()


def adamw_step_reference(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                         exp_avg_scales: list[Tensor], exp_avg_sqs: list[Tensor], exp_avg_sq_scales: list[Tensor],
                         qmap_signed: Tensor, qmap_unsigned: Tensor, lr: float, beta1: float, beta2: float,
                         weight_decay: float, eps: float, bias_correction1: float, bias_correction2: float,
                         stochastic_round: bool, seed: int) -> None:
    generator = torch.Generator(device=params[0].device if params else "cpu").manual_seed(seed)
    sqrt_bc2 = bias_correction2 ** 0.5
    for p, g, m, ms, v, vs in zip(params, grads, exp_avgs, exp_avg_scales, exp_avg_sqs, exp_avg_sq_scales,
                                  strict=True):
        quantized = ms.numel() > 0
        p32, g32 = p.float(), g.float()
        p32 = p32 - lr * weight_decay * p32
        m_old = dequantize(m, ms, qmap_signed) if quantized else m.float()
        v_old = dequantize(v, vs, qmap_unsigned) if quantized else v.float()
        m32 = m_old.lerp(g32, 1 - beta1)
        v32 = v_old.lerp(g32.square(), 1 - beta2)
        if quantized:
            for codes, scale, new, qmap in ((m, ms, m32, qmap_signed), (v, vs, v32, qmap_unsigned)):
                c, s = quantize(new, qmap)
                codes.copy_(c)
                scale.copy_(s)
        else:
            m.copy_(m32)
            v.copy_(v32)
        p32 = p32 - lr * (m32 / bias_correction1) / (v32.sqrt() / sqrt_bc2 + eps)
        p.copy_(bf16_stochastic(p32, generator) if stochastic_round and p.dtype == torch.bfloat16 else p32)


define("adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_scales, "
       "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] exp_avg_sq_scales, Tensor qmap_signed, Tensor qmap_unsigned, "
       "float lr, float beta1, float beta2, float weight_decay, float eps, float bias_correction1, "
       "float bias_correction2, bool stochastic_round, int seed) -> ()",
       adamw_step_reference, fake=lambda *args: None)


def _check_tensor(i: int, p: Tensor, g: Tensor, m: Tensor, ms: Tensor, v: Tensor, vs: Tensor, qmap_signed: Tensor,
                  qmap_unsigned: Tensor) -> None:
    """Tensor i's gradient and moments fit its parameter, as the CUDA host code requires: the reference would
    broadcast a gradient of another shape over the parameter, or read past a short code map."""
    shapes = {"gradient": g.shape, "exp_avg": m.shape, "exp_avg_sq": v.shape}
    for name, shape in shapes.items():
        if shape != p.shape:
            fail("adamw_step", f"tensor {i}: the {name} is {tuple(shape)}, its parameter {tuple(p.shape)}: they must "
                               "have one shape")
    if ms.numel() == 0:
        return
    blocks = p.numel() // BLOCK
    if (p.numel() % BLOCK or ms.numel() != blocks or vs.numel() != blocks or m.dtype != torch.uint8
            or v.dtype != torch.uint8):
        fail("adamw_step", f"tensor {i}: 8-bit moments need uint8 codes (got {m.dtype} and {v.dtype}), a multiple of "
                           f"{BLOCK} elements (got {p.numel()}) and one scale per block of {BLOCK} (got {ms.numel()} "
                           f"and {vs.numel()})")
    if qmap_signed.numel() != 256 or qmap_unsigned.numel() != 256:
        fail("adamw_step", f"the quantization maps must hold 256 values each, got {qmap_signed.numel()} and "
                           f"{qmap_unsigned.numel()}")


def adamw_step(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_scales: list[Tensor],
               exp_avg_sqs: list[Tensor], exp_avg_sq_scales: list[Tensor], qmap_signed: Tensor, qmap_unsigned: Tensor,
               *, lr: float, betas: tuple[float, float], weight_decay: float, eps: float, step: int,
               stochastic_round: bool = False, seed: int = 0) -> None:
    """AdamW (decoupled weight decay, bias-corrected moments) on every tensor of `params`, in place, each at the same
    `step` (1 for the first). A tensor's moments are 8-bit where its scales are non-empty (then it has a multiple of
    256 elements), else plain tensors of its dtype. `stochastic_round` rounds bfloat16 parameters stochastically
    (noise from `seed`), else to nearest."""
    lists = (params, grads, exp_avgs, exp_avg_scales, exp_avg_sqs, exp_avg_sq_scales)
    if len({len(x) for x in lists}) != 1:
        fail("adamw_step", f"the six tensor lists must have one length, got {[len(x) for x in lists]}")
    if step < 1:
        fail("adamw_step", f"`step` counts from 1, got {step}")
    for i, (p, g, m, ms, v, vs) in enumerate(zip(*lists)):
        _check_tensor(i, p, g, m, ms, v, vs, qmap_signed, qmap_unsigned)
    beta1, beta2 = betas
    torch.ops.fw.adamw_step(list(params), list(grads), list(exp_avgs), list(exp_avg_scales), list(exp_avg_sqs),
                            list(exp_avg_sq_scales), qmap_signed, qmap_unsigned, float(lr), float(beta1),
                            float(beta2), float(weight_decay), float(eps), 1.0 - beta1 ** step, 1.0 - beta2 ** step,
                            bool(stochastic_round), int(seed))
