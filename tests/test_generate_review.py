"""Review checks of `fw generate`: a prompt past the policy's positions is said on stderr; the CPU paged attention
the rollout engine runs gives the results of an independent formulation (float64 sums by cumsum) to float32 rounding,
the same sampled tokens, and float64 attention for a long prompt."""
import re

import pytest
import torch
from test_generate import make_cfg

import ops_cuda
from framework.generate import generate_text
from framework.models import Qwen3ForCausalLM
from framework.models.presets import preset_config
from framework.rollout import SamplingParams, generate
from framework.tokenizer import Tokenizer
from ops_cuda import paged_attention
from ops_cuda.library import acc_dtype


def test_a_prompt_past_the_policys_positions_is_said_on_stderr(capsys):
    cfg = make_cfg(chat_template=False)
    prompt = "12" * 2046   # 4,092 tokens of the builtin character tokenizer
    generate_text(cfg, prompt, max_new_tokens=4, temperature=0.0)
    assert capsys.readouterr().err == ""   # 4,096 positions: the preset's max_position_embeddings, not past it
    generate_text(cfg, prompt, max_new_tokens=6, temperature=0.0)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.fullmatch(
        r"fw: warning: the prompt \(4,092 tokens\) plus max_new_tokens \(6\) allows rows of 4,098 tokens, more than "
        r"the policy's max_position_embeddings \(4,096\), the positions it is made for; fw applies no RoPE "
        r"scaling\n", err), err


def cumsum_attention(q, k_pool, v_pool, tables, lengths, scale):
    """The CPU attention's formulation before the walk over positions: every query's context gathered to the
    call's longest, the weighted values summed by one cumsum over [N, Hq, T, D] (float64 sums of float32 terms)."""
    N, Hq, D = q.shape
    Hk, bs = k_pool.shape[1], k_pool.shape[2]
    G, acc = Hq // Hk, acc_dtype(q.dtype)
    n_blocks = -(-int(lengths.max()) // bs)
    if n_blocks == 0:
        return torch.zeros_like(q)
    T = n_blocks * bs
    past = torch.arange(T)[None, :] >= lengths[:, None]
    k = k_pool[tables[:, :n_blocks]].to(acc)
    v = v_pool[tables[:, :n_blocks]].to(acc).masked_fill_(past.view(N, n_blocks, 1, bs, 1), 0.0)
    v = v.permute(0, 2, 1, 3, 4)[:, :, None]
    s = (q.to(acc).reshape(N, 1, Hk, G, 1, D) * k[:, :, :, None]).sum(-1)
    s = s.permute(0, 2, 3, 1, 4).reshape(N, Hk, G, T) * scale
    s.masked_fill_(past[:, None, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m.masked_fill_(m == float("-inf"), 0.0)
    e = (s - m).exp_()
    den = e.cumsum(-1)[..., -1:]
    num = (e.view(N, Hk, G, n_blocks, bs, 1) * v).view(N, Hk, G, T, D).cumsum(-2)[..., -1, :]
    o = torch.where(lengths[:, None, None, None] > 0, num / den, 0.0)
    return o.reshape(N, Hq, D).to(q.dtype)


def test_seeded_sampling_keeps_the_tokens_of_the_cumsum_formulation(monkeypatch):
    tok = Tokenizer.builtin()
    torch.manual_seed(5)
    model = Qwen3ForCausalLM(preset_config("tiny", tok.vocab_size, tok.eos_id, tok.pad_id)).eval()
    prompts = [tok.encode(p) for p in ("1+1=", "7*8=" * 30, "30-4=" * 9)]
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    got = generate(model, prompts, params, seed=11)
    monkeypatch.setattr(paged_attention, "_batched_attention", cumsum_attention)
    want = generate(model, prompts, params, seed=11)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_is_the_cumsum_formulation_to_rounding(dtype):
    """Rows of 0 to 320 positions over shuffled blocks; a NaN value at a diverged row's own position makes that
    row's outputs of its kv head NaN, and adds nothing where it lies past other rows' lengths."""
    g = torch.Generator().manual_seed(2)
    k_pool, v_pool = (torch.randn(60, 2, 16, 64, generator=g).to(dtype) for _ in range(2))
    v_pool[9, 1, 3] = float("nan")   # a diverged row's own position, and a position past other rows' lengths
    tables = torch.randint(0, 60, (40, 20), generator=g)
    lengths = torch.randint(0, 321, (40,), generator=g)
    q = torch.randn(40, 4, 64, generator=g).to(dtype)
    got = ops_cuda.paged_decode_attention(q, k_pool, v_pool, tables, lengths, 0.125)
    want = cumsum_attention(q, k_pool, v_pool, tables, lengths, 0.125)
    assert want.isnan().any() and torch.equal(got.isnan(), want.isnan())
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.nan_to_num().float(), want.nan_to_num().float(), atol=tol, rtol=tol)


def test_a_long_prefill_against_float64():
    """1,500 query tokens after a 500-token cached prefix, against softmax attention in float64."""
    g = torch.Generator().manual_seed(3)
    n, cached, bs, Hq, Hk, D = 2000, 500, 16, 4, 2, 64
    blocks = torch.randperm(n // bs, generator=g)
    k_pool, v_pool = (torch.randn(n // bs, Hk, bs, D, generator=g) for _ in range(2))
    q = torch.randn(n - cached, Hq, D, generator=g)
    out = ops_cuda.paged_prefill_attention(q, k_pool, v_pool, blocks[None], torch.tensor([0, n - cached]),
                                           torch.tensor([n]), 0.125)
    k = k_pool[blocks].permute(1, 0, 2, 3).reshape(Hk, n, D).double().repeat_interleave(Hq // Hk, 0)
    v = v_pool[blocks].permute(1, 0, 2, 3).reshape(Hk, n, D).double().repeat_interleave(Hq // Hk, 0)
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) * 0.125                      # [Hq, Tq, n]
    causal = torch.arange(n)[None, :] <= torch.arange(cached, n)[:, None]
    want = (s.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(0, 1)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
