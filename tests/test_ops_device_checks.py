"""The ops whose CUDA kernels read every tensor argument through its pointer refuse arguments on another device
than the first, naming both, before any kernel runs (a host pointer in a CUDA kernel faults and ends the
process's CUDA context). Checked on CPU with one argument on the meta device."""

import pytest
import torch

import ops_cuda


def meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def cases():
    x, w = torch.randn(3, 8), torch.ones(8)
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 1, 8)
    pos = torch.arange(2).view(1, 2)
    h, vocab, targets = torch.randn(4, 8), torch.randn(16, 8), torch.tensor([1, 2, 3, 4])
    dq, kc, lengths = torch.randn(2, 2, 8), torch.randn(2, 1, 5, 8), torch.tensor([3, 5])
    pool, tables = torch.randn(4, 1, 4, 8), torch.tensor([[0, 1], [2, 3]])
    packs, cu = torch.tensor([[0, 1, 0], [1, 1, 0]]), torch.tensor([0, 1, 2])
    yield "rms_norm", "weight", lambda: ops_cuda.rms_norm(x, meta(w), 1e-6)
    yield "rope", "k", lambda: ops_cuda.rope(q, meta(k), pos, 1e4)
    yield "rope", "positions", lambda: ops_cuda.rope(q, k, meta(pos), 1e4)
    yield "linear_logprob", "weight", lambda: ops_cuda.linear_logprob(h, meta(vocab), targets)
    yield "linear_logprob", "targets", lambda: ops_cuda.linear_logprob(h, vocab, meta(targets))
    yield "decode_attention", "v_cache", lambda: ops_cuda.decode_attention(dq, kc, meta(kc), lengths, 0.3)
    yield "decode_attention", "lengths", lambda: ops_cuda.decode_attention(dq, kc, kc, meta(lengths), 0.3)
    yield "paged_decode_attention", "k_pool", lambda: ops_cuda.paged_decode_attention(
        dq, meta(pool), pool, tables, lengths, 0.3)
    yield "paged_decode_attention", "block_tables", lambda: ops_cuda.paged_decode_attention(
        dq, pool, pool, meta(tables), lengths, 0.3)
    yield "paged_decode_attention", "packs", lambda: ops_cuda.paged_decode_attention(
        dq, pool, pool, tables, lengths, 0.3, meta(packs))
    yield "paged_prefill_attention", "cu_seqlens", lambda: ops_cuda.paged_prefill_attention(
        dq, pool, pool, tables, meta(cu), lengths, 0.3)


@pytest.mark.parametrize("op,name,call", list(cases()), ids=[f"{o}-{n}" for o, n, _ in cases()])
def test_an_argument_on_another_device_is_named(op, name, call):
    with pytest.raises(ValueError, match=rf"^ops_cuda\.{op}: `{name}` is on meta, `\w+` on cpu: every tensor "
                                         "must be on one device$"):
        call()


def test_arguments_on_one_device_pass_the_check():
    x, w = torch.randn(3, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
    expected = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(ops_cuda.rms_norm(x, w, 1e-6), expected)
