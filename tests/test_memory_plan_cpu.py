"""The CPU plan's rows against what the CPU allocator holds: the loss's linear_logprob reference."""

import pytest
import torch
from test_memory_plan import _allocated_peak

import ops_cuda
from framework import memory_plan as mp
from framework.models.qwen3_config import Qwen3Config


# one tile of rows, and two; a frozen LM head (LoRA) and a trained one
@pytest.mark.parametrize("tokens,weight_grad", [(300, False), (2048, False), (2048, True)])
def test_the_cpu_logits_row_holds_the_peak_of_linear_logprobs_forward_and_backward(tokens, weight_grad):
    """linear_logprob's forward and backward on CPU (the torch reference, float32) over a vocabulary whose tile is
    REFERENCE_LOGITS_TILE_BYTES: the allocator's peak is at most the plan's logits row (with the LM head's gradient,
    which the plan's gradients row counts, where the head trains) and not far below it. The row counted the three
    tiles of the forward, half of what the backward holds."""
    vocab, hidden = 65536, 64
    model = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=1, num_key_value_heads=1, head_dim=64)
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=weight_grad)
    targets = torch.randint(0, vocab, (tokens,))

    def loss_and_backward():
        logprob, _ = ops_cuda.linear_logprob(h, w, targets)
        (-logprob.sum()).backward()

    loss_and_backward()   # the first call's one-off allocations (the op's registration) out of the measure
    h.grad = w.grad = None
    measured = _allocated_peak(loss_and_backward)
    planned, _ = mp._logits_rows(model, tokens, "float32", False, "cpu", weight_grad=weight_grad)
    head_grad = vocab * hidden * 4 if weight_grad else 0
    assert measured <= planned + head_grad, (measured / 2**20, planned / 2**20)
    assert planned <= 1.25 * measured, (measured / 2**20, planned / 2**20)
