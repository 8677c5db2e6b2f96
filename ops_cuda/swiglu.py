"""swiglu and its backward: schemas, argument checks, torch references, fakes, autograd.

CUDA kernels: csrc/swiglu.cu.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ops_cuda.library import acc_dtype, define, fail


def swiglu_reference(gate_up: Tensor) -> Tensor:
    acc = acc_dtype(gate_up.dtype)
    gate, up = gate_up.to(acc).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def swiglu_backward_reference(grad: Tensor, gate_up: Tensor) -> Tensor:
    acc = acc_dtype(gate_up.dtype)
    gate, up = gate_up.to(acc).chunk(2, dim=-1)
    g = grad.to(acc)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dgate = g * up * sig * (1 + gate * (1 - sig))
    return torch.cat([dgate, g * silu], dim=-1).to(gate_up.dtype)


define("swiglu(Tensor gate_up) -> Tensor", swiglu_reference,
       fake=lambda gate_up: gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2)))
define("swiglu_backward(Tensor grad, Tensor gate_up) -> Tensor", swiglu_backward_reference,
       fake=lambda grad, gate_up: gate_up.new_empty(gate_up.shape))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return torch.ops.fw.swiglu_backward(grad, gate_up)


torch.library.register_autograd("fw::swiglu", _backward, setup_context=_setup)


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate_up[..., :I]) * gate_up[..., I:]."""
    if not isinstance(gate_up, Tensor) or gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        fail("swiglu", f"`gate_up` must be a tensor [..., 2*I], got {getattr(gate_up, 'shape', gate_up)}")
    return torch.ops.fw.swiglu(gate_up)
