"""skinny_linear: x [M, K] @ weight [N, K]^T for the few rows of a decode step. Schema, checks, the torch reference
(float64-capable), fake; inference only (no autograd). CUDA kernel: csrc/skinny_linear.cu, for 1 to 64 rows of
bfloat16 or float16 with K and N multiples of 64.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from ops_cuda.library import acc_dtype, cuda_state, define, fail, need_dim

MAX_ROWS = 64      # the most rows of x the CUDA kernel takes
ROUTED_ROWS = 16   # the most rows `linear` sends to it


def skinny_linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    acc = acc_dtype(x.dtype)
    return F.linear(x.to(acc), weight.to(acc)).to(x.dtype)


define("skinny_linear(Tensor x, Tensor weight) -> Tensor", skinny_linear_reference,
       fake=lambda x, weight: x.new_empty((x.shape[0], weight.shape[0])))


def skinny_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [M, K] @ weight [N, K]^T, as F.linear without a bias, float32 accumulation. On CUDA: bfloat16 or float16
    operands of one dtype, 1 <= M <= MAX_ROWS, K and N multiples of 64; every weight byte is read once. An output of
    few tiles splits K over a cluster of up to 8 blocks (sm_90), summed in a fixed order: the same result at every
    call."""
    op = "skinny_linear"
    need_dim(op, "x", x, 2, "[M, K]")
    need_dim(op, "weight", weight, 2, "[N, K]")
    if x.shape[1] != weight.shape[1]:
        fail(op, f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    if x.dtype != weight.dtype:
        fail(op, f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    return torch.ops.fw.skinny_linear(x, weight)


def skinny_fits(x: Tensor, weight: Tensor) -> bool:
    """Whether `skinny_linear`'s CUDA kernel takes x @ weight.T: CUDA operands of one 16-bit dtype, x [M, K] with
    M <= MAX_ROWS, K and N multiples of 64, no gradient wanted, and the kernels loaded (or not tried yet)."""
    return (x.is_cuda and x.dim() == 2 and weight.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[1] == weight.shape[1] and x.shape[1] % 64 == 0 and weight.shape[0] % 64 == 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and cuda_state["backend"] != "reference")


def takes_skinny(x: Tensor, weight: Tensor) -> bool:
    """Whether `linear` sends x @ weight.T to `skinny_linear`: where it fits, for up to ROUTED_ROWS rows of a
    projection whose output is no wider than its input (onto the hidden state: few output tiles, which cuBLAS
    spreads over few SMs). There it is the faster of the two; elsewhere cuBLAS is (`python -m
    benchmarks.ops.decode_gemm`). FW_SKINNY_LINEAR=0 never (the benchmarks' cuBLAS baseline), =all wherever it fits."""
    if not skinny_fits(x, weight):
        return False
    mode = os.environ.get("FW_SKINNY_LINEAR", "1")
    return mode == "all" or (mode != "0" and x.shape[0] <= ROUTED_ROWS and weight.shape[0] <= weight.shape[1])


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear(x, weight) without a bias: through `skinny_linear` where `takes_skinny`, else cuBLAS."""
    return torch.ops.fw.skinny_linear(x, weight) if takes_skinny(x, weight) else F.linear(x, weight)
