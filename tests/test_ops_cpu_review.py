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
