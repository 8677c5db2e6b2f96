"""skinny_linear: x [M, K] @ weight [N, K]^T for the few rows of a decode step. Schema, checks, the torch reference
(float64-capable), fake; inference only (no autograd). CUDA kernel: csrc/skinny_linear.cu, for 1 to 64 rows of
bfloat16 or float16 with K and N multiples of 64.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ops_cuda.library import acc_dtype, define, fail, need_dim

MAX_ROWS = 64   # the most rows of x the CUDA kernel takes


def skinny_linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    acc = acc_dtype(x.dtype)
    return F.linear(x.to(acc), weight.to(acc)).to(x.dtype)


define("skinny_linear(Tensor x, Tensor weight) -> Tensor", skinny_linear_reference,
       fake=lambda x, weight: x.new_empty((x.shape[0], weight.shape[0])))


def skinny_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [M, K] @ weight [N, K]^T, as F.linear without a bias, float32 accumulation. On CUDA: bfloat16 or float16
    operands of one dtype, 1 <= M <= MAX_ROWS, K and N multiples of 64; every weight byte is read once, by a wave of
    blocks whatever N is (an output of few tiles splits K, reduced in a fixed order: the same result at every call)."""
    op = "skinny_linear"
    need_dim(op, "x", x, 2, "[M, K]")
    need_dim(op, "weight", weight, 2, "[N, K]")
    if x.shape[1] != weight.shape[1]:
        fail(op, f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    if x.dtype != weight.dtype:
        fail(op, f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    return torch.ops.fw.skinny_linear(x, weight)
