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
