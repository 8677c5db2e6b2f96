"""The rollout engine against independent references: a cache-free greedy loop over full forwards,
log_softmax of full-forward logits, the filtered softmax for sampling statistics, and transformers."""
import dataclasses
import math
from collections import Counter

import pytest
import torch
from conftest import OpLog, peaked_tiny_model

from framework.errors import FwError
from framework.models import Qwen3Config, Qwen3ForCausalLM, save_pretrained
from framework.rollout import CacheSettings, Rollout, RolloutEngine, SamplingParams, generate
from framework.rollout.kv_cache import block_bytes, pool_dtype
from framework.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t) for t in ("12+34=", "7=", "hello world, ", "a", "99*9=")]


def naive_greedy(model, prompt, max_new_tokens, eos_ids=()):
    """Reference: re-run the full forward on the growing sequence, no cache."""
    seq, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([seq], device=model.lm_head_weight.device))[0, -1].double().cpu()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            seq.append(token)
            if token in eos_ids:
                return tokens, logprobs, "eos"
    return tokens, logprobs, "length"


def full_forward_logprobs(model, rollout, temperature):
    """log_softmax(full-forward logits / T) at each completion token: [B, Tc] (float64), 0 past the end."""
    with torch.no_grad():
        logits = model(rollout.tokens).double()
    out = torch.zeros(rollout.logprobs.shape, dtype=torch.float64)
    for b in range(len(rollout.prompt_ids)):
        p, n = int(rollout.prompt_lens[b]), int(rollout.completion_lens[b])
        lp = torch.log_softmax(logits[b, p - 1:p + n - 1] / temperature, -1)
        out[b, :n] = lp.gather(1, rollout.tokens[b, p:p + n, None]).squeeze(1).cpu()
    return out


def test_greedy_equals_naive_full_forward_loop(model, prompts):
    r = generate(model, prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
    for b, prompt in enumerate(prompts):
        tokens, logprobs, reason = naive_greedy(model, prompt, 12)
        assert r.completion_ids[b] == tokens and r.finish_reasons[b] == reason
        torch.testing.assert_close(r.logprobs[b].double(), torch.tensor(logprobs, dtype=torch.float64), atol=1e-5,
                                   rtol=0)


def test_rollout_layout(model, prompts, tok):
    r = generate(model, prompts, SamplingParams(max_new_tokens=6, temperature=1.0), seed=3, eos_ids=[tok.eos_id],
                 tokenizer=tok, policy_version=7)
    assert isinstance(r, Rollout) and r.policy_version == 7
    assert r.prompt_ids == prompts and r.prompt_lens.tolist() == [len(p) for p in prompts]
    assert r.completion_lens.tolist() == [len(c) for c in r.completion_ids]
    assert r.tokens.shape == (5, max(len(p) + len(c) for p, c in zip(prompts, r.completion_ids)))
    assert r.logprobs.dtype == torch.float32 and r.logprobs.shape == (5, max(r.completion_lens.tolist()))
    for b, (p, c) in enumerate(zip(prompts, r.completion_ids)):
        row = r.tokens[b].tolist()
        assert row[:len(p) + len(c)] == p + c and set(row[len(p) + len(c):]) <= {tok.pad_id}
        assert (r.logprobs[b, len(c):] == 0).all() and (r.logprobs[b, :len(c)] < 0).all()
        assert r.completion_mask[b].tolist() == [j < len(c) for j in range(r.logprobs.shape[1])]
        assert r.texts[b] == tok.decode(c[:-1] if r.finish_reasons[b] == "eos" else c)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 20, 0.9, 0.05),
])
def test_behaviour_logprobs_are_full_softmax(model, prompts, temperature, top_k, top_p, min_p):
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    r = generate(model, prompts, params, seed=11)
    expected = full_forward_logprobs(model, r, temperature)
    torch.testing.assert_close(r.logprobs.double(), expected, atol=1e-5, rtol=0)
    if top_k or top_p < 1:
        # Renormalised over the filtered set, the logprobs would be visibly larger: the check has power.
        with torch.no_grad():
            logits = model(r.tokens)
        p = int(r.prompt_lens[0])
        truncated = [math.log(filtered_probs(logits[0, p - 1 + j], temperature, top_k, top_p, min_p)[t])
                     for j, t in enumerate(r.completion_ids[0])]
        assert max(t - float(lp) for t, lp in zip(truncated, r.logprobs[0])) > 1e-2


def filtered_probs(logits, temperature, top_k, top_p, min_p):
    """Independent float64 reference of the sampling distribution: top-k, then top-p, then min-p."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[:top_k or len(probs)]] = True
    mass = probs[keep].sum()
    running = 0.0
    nucleus = torch.zeros_like(keep)
    for i in order.tolist():
        if not keep[i]:
            break
        nucleus[i] = True
        running += float(probs[i])
        if running >= top_p * float(mass) - 1e-12:
            break
    keep &= nucleus
    keep &= probs >= min_p * probs.max()
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (1.5, 6, 1.0, 0.0), (0.8, 0, 0.7, 0.0), (1.0, 0, 1.0, 0.1),
])
def test_first_token_distribution_matches_filtered_softmax(model, tok, temperature, top_k, top_p, min_p):
    prompt = tok.encode("3+4=")
    n = 2000
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    r = generate(model, [prompt] * n, params, seed=5)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1]
    want = filtered_probs(logits, temperature, top_k, top_p, min_p)
    counts = Counter(c[0] for c in r.completion_ids)
    assert all(want[t] > 0 for t in counts), "drew a token outside the filtered set"
    # Pearson chi-square over the allowed tokens, pooling the rare ones (expected < 5) into one cell.
    cells, rare_obs, rare_exp = [], 0, 0.0
    for t in want.nonzero().flatten().tolist():
        expected = n * float(want[t])
        if expected < 5:
            rare_obs, rare_exp = rare_obs + counts[t], rare_exp + expected
        else:
            cells.append((counts[t], expected))
    if rare_exp > 0:
        cells.append((rare_obs, rare_exp))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = max(len(cells) - 1, 1)
    # Wilson-Hilferty upper tail at z = 4 (p ~ 3e-5): fails only on a real mismatch.
    bound = dof * (1 - 2 / (9 * dof) + 4 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < bound, (chi2, bound, dof)
    assert len(cells) >= 2  # the distribution is not degenerate: the test has power


def test_top_k_one_is_greedy(model, prompts):
    greedy = generate(model, prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    topk1 = generate(model, prompts, SamplingParams(max_new_tokens=8, temperature=0.9, top_k=1), seed=123)
    assert topk1.completion_ids == greedy.completion_ids


def test_seeds_reproduce(model, prompts):
    a = generate(model, prompts, SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95), seed=42)
    b = generate(model, prompts, SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95), seed=42)
    c = generate(model, prompts, SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95), seed=43)
    assert a.completion_ids == b.completion_ids and torch.equal(a.logprobs, b.logprobs)
    assert a.completion_ids != c.completion_ids


def test_eos_ends_rows_individually(model, prompts):
    free = [naive_greedy(model, p, 10)[0] for p in prompts]
    eos = free[0][3]  # row 0 emits this at step 4; the others stop wherever they emit it, if ever
    r = generate(model, prompts, SamplingParams(max_new_tokens=10, temperature=0.0), eos_ids=[eos, 10_000])
    for b, p in enumerate(prompts):
        tokens, logprobs, reason = naive_greedy(model, p, 10, eos_ids=(eos,))
        assert r.completion_ids[b] == tokens and r.finish_reasons[b] == reason
        torch.testing.assert_close(r.logprobs[b, :len(tokens)].double(), torch.tensor(logprobs,
                                   dtype=torch.float64), atol=1e-5, rtol=0)
    assert r.finish_reasons[0] == "eos" and len(r.completion_ids[0]) <= 4
    assert "length" in r.finish_reasons  # some rows ran on to max_new_tokens past row 0's end
    # EOS ids as a tensor (a config's eos_token_id read from a checkpoint, say) end the same rows
    t = generate(model, prompts, SamplingParams(max_new_tokens=10, temperature=0.0), eos_ids=torch.tensor([eos]))
    assert t.completion_ids == r.completion_ids and t.finish_reasons == r.finish_reasons


def test_per_row_token_limits(model, prompts):
    """max_new_tokens per prompt: each row ends at its own limit with reason "length" (or earlier on
    EOS), with the tokens and logprobs of the naive loop; the loop runs to the largest limit."""
    limits = [3, 9, 1, 6, 9]
    eos = naive_greedy(model, prompts[4], 9)[0][4]   # row 4 ends on EOS at its 5th token, before its limit
    r = generate(model, prompts, SamplingParams(max_new_tokens=limits, temperature=0.0), eos_ids=[eos])
    for b, p in enumerate(prompts):
        tokens, logprobs, reason = naive_greedy(model, p, limits[b], eos_ids=(eos,))
        assert r.completion_ids[b] == tokens and r.finish_reasons[b] == reason, b
        torch.testing.assert_close(r.logprobs[b, :len(tokens)].double(), torch.tensor(logprobs, dtype=torch.float64),
                                   atol=1e-5, rtol=0)
    assert r.finish_reasons[4] == "eos" and r.completion_lens.tolist()[:4] == limits[:4]
    assert r.logprobs.shape[1] == 9


def test_stop_string_on_a_rows_last_allowed_token_is_a_stop(model, prompts, tok):
    """A per-row limit does not hide a stop string completed by the row's last allowed token."""
    free = generate(model, prompts, SamplingParams(max_new_tokens=12, temperature=0.0), tokenizer=tok)
    stop = free.texts[1][4:6]   # completed by row 1's 6th token (char-level tokenizer)
    limits = [12, 6, 12, 12, 12]
    r = generate(model, prompts, SamplingParams(max_new_tokens=limits, temperature=0.0, stop=[stop]), tokenizer=tok)
    assert free.texts[1].find(stop) == 4 and r.finish_reasons[1] == "stop" and r.texts[1] == free.texts[1][:6]


def test_loop_stops_early_when_all_rows_finished(model, prompts):
    firsts = {naive_greedy(model, p, 1)[0][0] for p in prompts}
    r = generate(model, prompts, SamplingParams(max_new_tokens=50, temperature=0.0), eos_ids=list(firsts))
    assert r.completion_lens.tolist() == [1] * len(prompts) and r.logprobs.shape == (len(prompts), 1)
    assert r.finish_reasons == ["eos"] * len(prompts)


def test_stop_strings_end_rows_and_keep_the_stop_text(model, prompts, tok):
    free = generate(model, prompts, SamplingParams(max_new_tokens=12, temperature=0.0), tokenizer=tok)
    stop = free.texts[1][4:6]  # two characters row 1 produces at steps 5-6 (char-level tokenizer)
    r = generate(model, prompts, SamplingParams(max_new_tokens=12, temperature=0.0, stop=[stop, "@@never@@"]),
                 tokenizer=tok)
    for b in range(len(prompts)):
        end = free.texts[b].find(stop)
        if end == -1:
            assert r.finish_reasons[b] == "length" and r.completion_ids[b] == free.completion_ids[b]
        else:
            end += len(stop)
            assert r.finish_reasons[b] == "stop" and r.texts[b] == free.texts[b][:end]
            # the completion ends with the token that completes the stop string's text
            ids = free.completion_ids[b]
            last = next(i for i in range(1, len(ids) + 1) if len(tok.decode(ids[:i])) >= end)
            assert r.completion_ids[b] == ids[:last]
            assert r.texts[b].endswith(stop)
    assert r.finish_reasons[1] == "stop" and len(r.completion_ids[1]) < 12


def test_stop_string_split_over_tokens_of_several_steps(model, tok):
    prompt = tok.encode("hello world, ")
    free = generate(model, [prompt], SamplingParams(max_new_tokens=10, temperature=0.0), tokenizer=tok)
    stop = free.texts[0][2:7]
    r = generate(model, [prompt], SamplingParams(max_new_tokens=10, temperature=0.0, stop=[stop]), tokenizer=tok)
    assert r.texts[0] == free.texts[0][:free.texts[0].find(stop) + len(stop)] and r.finish_reasons == ["stop"]


def test_model_mode_is_restored(model, prompts):
    model.train()
    generate(model, prompts[:2], SamplingParams(max_new_tokens=2, temperature=1.0))
    assert model.training
    model.eval()
    generate(model, prompts[:2], SamplingParams(max_new_tokens=2, temperature=1.0))
    assert not model.training


@pytest.mark.parametrize("kwargs, message", [
    ({"prompts": [[1], []]}, "prompt 1 is empty"),
    ({"prompts": [[1], [2, 10**9]]}, r"prompt 1 holds token id 1000000000, outside the model's vocabulary \[0, "),
    ({"prompts": [[-1, 2]]}, r"prompt 0 holds token id -1, outside the model's vocabulary"),
    ({"prompts": []}, "no prompts"),
    ({"max_new_tokens": [2, 3]}, r"max_new_tokens has 2 limits for 1 prompts"),
    ({"stop": ["x"]}, "stop strings need a tokenizer"),
])
def test_bad_arguments(model, kwargs, message):
    args = {"prompts": [[1, 2]], "max_new_tokens": 2, **kwargs}
    prompts = args.pop("prompts")
    with pytest.raises(FwError, match=message):
        generate(model, prompts, SamplingParams(temperature=1.0, **args))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
    ({"max_new_tokens": [2, 0]}, r"max_new_tokens must be an int >= 1 or one such int per prompt, got \[2, 0\]"),
    ({"max_new_tokens": "3"}, "max_new_tokens must be an int >= 1 or one such int per prompt, got '3'"),
    ({"max_new_tokens": 32.0}, "max_new_tokens must be an int >= 1 or one such int per prompt, got 32.0"),
    ({"temperature": -1.0}, r"temperature must be 0 \(greedy\) or a finite number >= 1e-05, got -1.0"),
    ({"temperature": float("nan")}, r"temperature must be 0 \(greedy\) or a finite number >= 1e-05"),
    ({"temperature": 1e-38}, r"temperature must be 0 \(greedy\) or a finite number >= 1e-05, got 1e-38"),
    ({"top_k": -1}, r"top_k must be an int >= 0 \(0 = off\), got -1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"min_p": 1.0}, r"min_p must be in \[0, 1\) \(0 = off\), got 1.0"),
    ({"stop": "x"}, "stop must be a list of non-empty strings"),
    ({"stop": [""]}, "stop must be a list of non-empty strings"),
])
def test_sampling_params_are_checked_once_when_built(kwargs, message):
    with pytest.raises(FwError, match=message):
        SamplingParams(**{"max_new_tokens": 2, "temperature": 1.0, **kwargs})


def test_sampling_params_take_integers_of_other_types():
    """A numpy integer is an integer (operator.index), as the elements of a per-prompt sequence already were; a
    sequence stays a sequence, even of one integer."""
    np = pytest.importorskip("numpy")
    assert SamplingParams(max_new_tokens=np.int64(32), temperature=1.0).max_new_tokens == 32
    assert SamplingParams(max_new_tokens=np.array([3, 4]), temperature=1.0).max_new_tokens == (3, 4)
    # a sequence of one is a limit per prompt, not one limit for all
    assert SamplingParams(max_new_tokens=torch.tensor([5]), temperature=1.0).max_new_tokens == (5,)


def test_the_smallest_temperature_is_the_schemas():
    import json

    from framework.config import schema_text
    from framework.rollout.sampling import MIN_TEMPERATURE

    schema = json.loads(schema_text())
    nodes = [schema["properties"]["rollout"]["properties"]["temperature"],
             schema["properties"]["eval"]["properties"]["temperature"]]
    for node in nodes:
        assert node["anyOf"] == [{"const": 0}, {"minimum": MIN_TEMPERATURE}]
    SamplingParams(max_new_tokens=1, temperature=MIN_TEMPERATURE)   # the bound itself is allowed


def test_sampling_params_from_config_is_frozen_and_takes_changes():
    rollout = {"max_new_tokens": 7, "temperature": 0.5, "top_k": 3, "top_p": 0.9, "min_p": 0.1, "stop": ["\n"],
               "prompts_per_step": 4}
    params = SamplingParams.from_config(rollout, temperature=0.0)
    assert params == SamplingParams(7, 0.0, 3, 0.9, 0.1, ("\n",))
    assert SamplingParams(max_new_tokens=[3, 5], temperature=1.0).max_new_tokens == (3, 5)
    with pytest.raises(AttributeError):
        params.temperature = 1.0


def test_greedy_matches_transformers_generate(model, prompts, tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    save_pretrained(model, tmp_path)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = generate(model, prompts, SamplingParams(max_new_tokens=10, temperature=0.0), eos_ids=[tok.eos_id])
    for b, prompt in enumerate(prompts):
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=10, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        assert ours.completion_ids[b] == out[0, len(prompt):].tolist()


def test_bf16_model_and_autocast(model, prompts):
    r = generate(model, prompts, SamplingParams(max_new_tokens=6, temperature=1.0), seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = generate(model, prompts, SamplingParams(max_new_tokens=6, temperature=1.0), seed=2)
    # bf16 keys/values: the logprobs of the tokens drawn are those of the float32 model within bf16 rounding
    assert auto.logprobs.dtype == torch.float32 and r.logprobs.dtype == torch.float32
    assert (auto.logprobs.double() - full_forward_logprobs(model, auto, 1.0)).abs().max() < 0.2
    half = Qwen3ForCausalLM(model.config)
    half.load_state_dict(model.state_dict())
    half = half.to(torch.bfloat16).eval()
    rb = generate(half, prompts, SamplingParams(max_new_tokens=6, temperature=1.0), seed=2)
    assert rb.logprobs.dtype == torch.float32
    # bf16 rounding of prefill/decode vs the full forward: same magnitude as bf16 logits' error
    assert (rb.logprobs.double() - full_forward_logprobs(half, rb, 1.0)).abs().max() < 0.1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("setup", ["bfloat16 weights", "float32 weights under bfloat16 autocast"])
def test_16bit_sampling_logits_are_float32_sums_of_16bit_products(tok, setup, device):
    """The logits a 16-bit paged forward hands the sampler (the behaviour logprobs' source) are the trainer's kind
    (ops_cuda.linear_logprob): the 16-bit final hidden state times the 16-bit LM head, summed and kept in float32.
    Against a float64 product of the same 16-bit operands they agree to float32 rounding; logits rounded to
    bfloat16 would be off by up to 2^-9 of their size (about 0.03 at this model's logits of 15)."""
    from framework.models.qwen3 import PagedBatch

    m = peaked_tiny_model(tok)
    m = (m.to(torch.bfloat16) if setup == "bfloat16 weights" else m).to(device)
    ids = torch.tensor(tok.encode("hello world, 12+34="), device=device)
    n, bs = len(ids), 8
    table = torch.arange(-(-n // bs), device=device)[None]
    pos = torch.arange(n, device=device)
    batch = PagedBatch(positions=pos, write_blocks=table[0, pos // bs], write_offsets=pos % bs, block_tables=table,
                       lengths=torch.tensor([n], device=device), cu_seqlens=torch.tensor([0, n], device=device))
    with torch.autocast(device, dtype=torch.bfloat16, enabled=setup != "bfloat16 weights"):
        logits = m.forward_paged(ids, batch, m.new_paged_kv_cache(table.shape[1], bs), pos)
        hidden = m.model.paged(ids, batch, m.new_paged_kv_cache(table.shape[1], bs))
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    exact = hidden.double() @ m.lm_head_weight.to(torch.bfloat16).double().T
    assert exact.abs().max() > 8
    torch.testing.assert_close(logits.double(), exact, rtol=0, atol=exact.abs().max().item() * 2**-20)


def test_autocast_without_its_cache_gives_the_same_rollout(model, prompts):
    """Lightning's bf16-mixed region turns autocast's weight cache off; generate caches the casts for its call
    anyway (so decode graphs read them instead of casting at every replay): same tokens and logprobs as under a
    caching region, and the caller's setting is back afterwards."""
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cached = generate(model, prompts, params, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        uncached = generate(model, prompts, params, seed=3)
        assert not torch.is_autocast_cache_enabled()
    assert uncached.completion_ids == cached.completion_ids
    assert torch.equal(uncached.logprobs, cached.logprobs)


def test_an_engine_under_autocast_refreshes_its_weight_casts_at_each_call(model, prompts):
    """float32 weights under bf16 autocast: a kept engine multiplies by its bf16 copies of the weights, made at the
    first call and written again in place at each later one. After an update of the weights, its next call gives
    the tokens and logprobs of a fresh engine on the new weights, from the same copies' memory; the copies are the
    weights rounded to bf16, as autocast rounds them."""
    m = Qwen3ForCausalLM(model.config)
    m.load_state_dict(model.state_dict())
    m.eval()
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        engine = RolloutEngine(m)
        engine.generate(prompts, params, seed=5)
        casts = engine.casts
        weights = m.paged_matmul_weights()
        assert list(casts) == weights and all(c.dtype == torch.bfloat16 for c in casts.values())
        assert engine.graph_casts is casts   # what graphs captured in the call would read (on CUDA), kept for the next
        storage = [c.data_ptr() for c in casts.values()]
        with torch.no_grad():   # an optimizer step's worth of change
            for w in weights:
                w.add_(torch.randn_like(w) * 0.05)
        after = engine.generate(prompts, params, seed=5)
        fresh = generate(m, prompts, params, seed=5)
    assert engine.casts is casts and [c.data_ptr() for c in casts.values()] == storage
    assert all(torch.equal(c, w.to(torch.bfloat16)) for w, c in casts.items())
    assert after.completion_ids == fresh.completion_ids and torch.equal(after.logprobs, fresh.logprobs)
    engine.release()
    assert engine.casts is None


def test_an_engine_keeps_its_decode_buckets_under_autocast_unless_adapters_cast_per_call(model, prompts):
    """bf16 weights under bf16 autocast need no cast: a kept engine keeps the buckets it ran (on CUDA their graphs,
    which read the weights themselves) from one call to the next. With adapters, whose matmuls read autocast's casts
    made for the call, it forgets them at the end of each call."""
    from framework.models.lora import add_adapters

    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    for adapters in (False, True):
        m = Qwen3ForCausalLM(model.config)
        m.load_state_dict(model.state_dict())
        if adapters:
            add_adapters(m, {"rank": 2, "alpha": 4, "dropout": 0.0, "targets": ["q_proj"]})
        m = m.to(torch.bfloat16).eval()
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            engine = RolloutEngine(m)
            engine.generate(prompts, params, seed=1)
            assert engine.casts is None
            assert (not engine.warm) == adapters, adapters
            warm = set(engine.warm)
            engine.generate(prompts, params, seed=1)
            assert engine.warm == warm


def test_an_engine_forgets_its_decode_buckets_when_the_autocast_state_changes(model, prompts):
    """bf16 weights read no cast with autocast on or off, but the kernels a bucket ran (on CUDA its graph) were chosen
    under the first call's autocast state: a call under another state starts its buckets again. The first call's
    20 rows run in a wider bucket than the second's 5, so a bucket kept from the first call shows."""
    m = Qwen3ForCausalLM(model.config)
    m.load_state_dict(model.state_dict())
    m = m.to(torch.bfloat16).eval()
    params = SamplingParams(max_new_tokens=3, temperature=1.0)
    many = (prompts * 4)[:20]
    for first_autocast in (True, False):
        engine = RolloutEngine(m)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=first_autocast):
            engine.generate(many, params, seed=1)
        wide = {key[0] for key in engine.warm}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not first_autocast):
            engine.generate(prompts, params, seed=1)
        narrow = {key[0] for key in engine.warm}
        assert max(wide) > max(narrow), (first_autocast, wide, narrow)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not first_autocast):
            engine.generate(many, params, seed=1)
        assert {key[0] for key in engine.warm} == wide | narrow   # the same state again: its buckets kept


@pytest.mark.gpu
def test_cuda_graphs_captured_under_autocast_are_not_replayed_without_it(model, prompts):
    """bf16 weights on CUDA: a call without autocast after one under it captures its own graphs, and gives a fresh
    engine's tokens and logprobs without autocast."""
    m = Qwen3ForCausalLM(model.config)
    m.load_state_dict(model.state_dict())
    m = m.to("cuda", torch.bfloat16).eval()
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    engine = RolloutEngine(m)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        engine.generate(prompts, params, seed=5)
    under = dict(engine.graphs)
    assert under
    plain = engine.generate(prompts, params, seed=5)
    assert engine.graphs and not {id(g) for g in engine.graphs.values()} & {id(g) for g in under.values()}
    fresh = generate(m, prompts, params, seed=5)
    engine.release()
    assert plain.completion_ids == fresh.completion_ids and torch.equal(plain.logprobs, fresh.logprobs)


@pytest.mark.gpu
def test_cuda_graphs_kept_across_calls_under_autocast_read_the_updated_weights(model, prompts):
    """float32 weights under bf16 autocast (fw fit's bf16-mixed) on CUDA: the later calls of a kept engine replay the
    first call's decode graphs (no capture), and after an update of the weights they give a fresh engine's tokens
    and logprobs on the new weights."""
    m = Qwen3ForCausalLM(model.config)
    m.load_state_dict(model.state_dict())
    m = m.to("cuda").eval()
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        engine = RolloutEngine(m)
        engine.generate(prompts, params, seed=5)   # each bucket's first step eager, its later ones captured
        graphs = dict(engine.graphs)
        assert graphs
        engine.generate(prompts, params, seed=5)
        assert engine.graphs == graphs
        with torch.no_grad():
            for w in m.paged_matmul_weights():
                w.add_(torch.randn_like(w) * 0.05)
        after = engine.generate(prompts, params, seed=5)
        assert engine.graphs == graphs   # the same graph objects: replayed, not captured again
        fresh = generate(m, prompts, params, seed=5)
    engine.release()
    assert after.completion_ids == fresh.completion_ids and torch.equal(after.logprobs, fresh.logprobs)


def test_an_engine_with_adapters_keeps_no_weight_casts(model, prompts):
    """A LoRA layer does its own matmuls (autocast casts its weights for the call): the model names no weights to
    copy, and the engine keeps none."""
    from framework.models.lora import add_adapters

    m = Qwen3ForCausalLM(model.config)
    m.load_state_dict(model.state_dict())
    add_adapters(m, {"rank": 2, "alpha": 4, "dropout": 0.0, "targets": ["q_proj"]})
    assert m.paged_matmul_weights() is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine = RolloutEngine(m.eval())
        engine.generate(prompts, SamplingParams(max_new_tokens=3, temperature=1.0), seed=1)
    assert engine.casts is None


@pytest.mark.gpu
def test_cuda_decode_graphs_do_not_cast_the_weights_at_each_step(model, prompts):
    """fp32 weights under an autocast region without its cache (Lightning's bf16-mixed): the weights are cast
    once in the call (into the engine's copies), not again at every decode step the graphs replay. The copy
    kernels of a call of 40 new tokens and of one of 20 differ by those of 20 decode steps: at each, a few casts of
    activations (the embedding's rows), against one per weight if the graphs had captured the weights' casts."""
    from framework.rollout import RolloutEngine

    m = Qwen3ForCausalLM(model.config)
    m.load_state_dict(model.state_dict())
    m = m.to("cuda").eval()
    weights = sum(1 for p in m.parameters() if p.dim() == 2)
    engine = RolloutEngine(m)

    def casts(new_tokens: int) -> int:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params, seed=1)
            torch.cuda.synchronize()
        return sum(e.count for e in prof.key_averages() if "bfloat16_copy" in e.key)

    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        casts(40)   # warm-up: the decode-attention counters, cuBLAS
        short, long = casts(20), casts(40)
        assert all(torch.equal(c, w.to(torch.bfloat16)) for w, c in engine.casts.items())
    engine.release()
    per_step = (long - short) / 20
    assert per_step < weights / 2, (short, long, weights)


@pytest.mark.gpu
def test_cuda_decode_graph_copies_no_input_per_layer(model, prompts):
    """A replay of a decode graph copies the fed positions (a strided column of its inputs) once, not once per layer
    in the QK-norm kernel's wrapper: the copies of a step do not grow with the layers."""
    from dataclasses import replace

    from framework.rollout import RolloutEngine

    def copies(layers: int) -> int:
        torch.manual_seed(0)
        m = Qwen3ForCausalLM(replace(model.config, num_hidden_layers=layers)).to("cuda").eval()
        engine = RolloutEngine(m)
        engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0), seed=1)
        graph = next(iter(engine.graphs.values()))
        graph(graph.inputs, graph.tables)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            graph(graph.inputs, graph.tables)
            torch.cuda.synchronize()
        engine.release()
        return sum(e.count for e in prof.key_averages() if "direct_copy" in e.key)

    two, four = copies(2), copies(4)
    assert two == four, (two, four)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.2)])
def test_cuda_greedy_and_logprobs(model, prompts, dtype, tol):
    cuda = Qwen3ForCausalLM(model.config)
    cuda.load_state_dict(model.state_dict())
    cuda = cuda.to("cuda", dtype).eval()
    greedy = generate(cuda, prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    assert greedy.tokens.device.type == "cuda"
    if dtype == torch.float32:
        for b, prompt in enumerate(prompts):
            assert greedy.completion_ids[b] == naive_greedy(cuda, prompt, 10)[0]
    r = generate(cuda, prompts, SamplingParams(max_new_tokens=10, temperature=0.8, top_k=10, top_p=0.9), seed=4)
    expected = full_forward_logprobs(cuda, r, 0.8).to("cuda")
    assert (r.logprobs.double() - expected).abs().max() < tol
    again = generate(cuda, prompts, SamplingParams(max_new_tokens=10, temperature=0.8, top_k=10, top_p=0.9), seed=4)
    assert again.completion_ids == r.completion_ids
    # every row ends on EOS at its first token: the loop notices within a few steps, the result is exact
    firsts = sorted({c[0] for c in greedy.completion_ids})
    ended = generate(cuda, prompts, SamplingParams(max_new_tokens=50, temperature=0.0), eos_ids=firsts)
    assert ended.completion_lens.tolist() == [1] * len(prompts) and ended.logprobs.shape == (len(prompts), 1)
    assert ended.finish_reasons == ["eos"] * len(prompts)


@pytest.mark.gpu
def test_cuda_groups_decode_with_packs(model, tok, monkeypatch):
    """bfloat16 (the tensor-core decode kernel, which reads packs; FW_DECODE_PACKS=2 at this model's size): a call
    of 3 prompts x 8 samples and a lone prompt decodes in graphs whose inputs carry packs, and its logprobs match a
    full forward's as closely as the same call's without packs (FW_DECODE_SHARED=0)."""
    monkeypatch.setenv("FW_DECODE_PACKS", "2")
    cuda = Qwen3ForCausalLM(model.config)
    cuda.load_state_dict(model.state_dict())
    cuda = cuda.to("cuda", torch.bfloat16).eval()
    texts = ("what is 12+34? think step by step. ", "and 5*6 is how much, exactly? ", "count: 1 2 3 4 5 6 7 8 9 ")
    prompts = [tok.encode(t) for t in texts] * 8 + [tok.encode("a")]
    params = SamplingParams(max_new_tokens=24, temperature=0.9)
    errors = {}
    for shared in ("1", "0"):
        monkeypatch.setenv("FW_DECODE_SHARED", shared)
        engine = RolloutEngine(cuda)
        r = engine.generate(prompts, params, seed=3)
        assert engine.graphs and {key[2] for key in engine.graphs} == {shared == "1"}
        assert engine.graphs[max(engine.graphs)].inputs.shape[1] == (5 if shared == "1" else 2)
        engine.release()
        assert len({tuple(c) for c in r.completion_ids[:24:3]}) > 1   # a group's samples differ
        errors[shared] = float((r.logprobs.double() - full_forward_logprobs(cuda, r, 0.9).to("cuda")).abs().max())
    assert errors["1"] < 0.2 and errors["0"] < 0.2, errors


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_steps_order_rows_longest_first(model, tok, dtype, monkeypatch):
    """A CUDA decode step hands the attention its rows longest context first (FW_DECODE_ORDER=admission: the
    scheduler's order). Graphs replay the eager steps' order; against the scheduler's order the tokens are the same
    and the logprobs within 1e-5: a row's logits do not depend on its place in the batch, but the sampler sums a
    row's masses in another order where the row does not start on 16 bytes (this vocabulary's rows; not Qwen3's)."""
    import ops_cuda
    from framework.models import qwen3

    m = Qwen3ForCausalLM(model.config)
    m.load_state_dict(model.state_dict())
    m = m.to("cuda", dtype).eval()
    # the scheduler admits the longest limit first: its order runs contexts of 1, 9, 33, 48, 5 and 17 tokens, not the
    # longest-first one
    prompts = [tok.encode("a" * n) for n in (1, 5, 9, 17, 33, 48)]
    params = SamplingParams(max_new_tokens=[20, 12, 20, 7, 20, 16], temperature=0.9, top_k=20)
    attention = ops_cuda.paged_decode_attention
    lengths = []

    def spy(q, k_pool, v_pool, tables, lens, *rest):
        lengths.append(lens.tolist())
        return attention(q, k_pool, v_pool, tables, lens, *rest)

    results = {}
    for order in ("admission", "longest"):
        monkeypatch.setenv("FW_DECODE_ORDER", order)
        with monkeypatch.context() as patch:
            patch.setattr(qwen3.ops_cuda, "paged_decode_attention", spy)
            lengths.clear()
            eager = generate(m, prompts, params, seed=5, cuda_graph=False)
        steps = [row for row in lengths[::m.config.num_hidden_layers] if len(row) > 1]
        assert steps
        descending = all(row == sorted(row, reverse=True) for row in steps)
        assert descending == (order == "longest"), steps[:3]
        graphed = generate(m, prompts, params, seed=5)
        assert graphed.completion_ids == eager.completion_ids
        assert torch.equal(graphed.logprobs, eager.logprobs)
        results[order] = eager
    assert results["longest"].completion_ids == results["admission"].completion_ids
    assert (results["longest"].logprobs - results["admission"].logprobs).abs().max() <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("setup", ["fp32", "bf16", "fp32 weights under bf16 autocast",
                                   "bf16 weights under bf16 autocast"])
def test_cuda_graph_decode_gives_the_eager_tokens(model, prompts, tok, setup, monkeypatch):
    """The replayed decode graphs run the same kernels on the same data as eager decode steps: same tokens
    and logprobs, also under autocast (the trainer's bf16-mixed); rows ending on EOS or at their own limit
    leave the batch, which moves through smaller buckets. An engine captures each bucket once and replays it
    in later calls, under autocast too, whose graphs read the engine's copies of fp32 weights, or bf16 weights
    themselves."""
    from framework.rollout import RolloutEngine, kv_cache

    captures = []

    class CountingGraph(kv_cache.DecodeGraph):   # the real graph, counted by (batch bucket, table width)
        def __init__(self, model, cache, inputs, tables, *rest):
            captures.append((inputs.shape[0], tables.shape[1]))
            super().__init__(model, cache, inputs, tables, *rest)

    monkeypatch.setattr(kv_cache, "DecodeGraph", CountingGraph)
    from framework.rollout import engine as engine_module
    monkeypatch.setattr(engine_module, "DecodeGraph", CountingGraph)
    m = Qwen3ForCausalLM(model.config)
    m.load_state_dict(model.state_dict())
    m = m.to("cuda", torch.bfloat16 if setup.startswith("bf16") else torch.float32).eval()
    params = SamplingParams(max_new_tokens=[24, 24, 24, 11, 24], temperature=0.9, top_k=20, top_p=0.95)
    kw = {"seed": 7, "tokenizer": tok}
    autocast = setup.endswith("autocast")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        free = generate(m, prompts, params, cuda_graph=False, **kw).completion_ids
        kw["eos_ids"] = [free[0][5], free[2][12]]   # tokens this draw emits mid-way: those rows stop early
        eager = generate(m, prompts, params, cuda_graph=False, **kw)
        assert not captures
        engine = RolloutEngine(m)
        graphed = engine.generate(prompts, params, **kw)
        first = len(captures)
        again = engine.generate(prompts, params, **kw)
        engine.release()
    assert first >= 2   # the batch shrank through several buckets
    # never a bucket twice; the second call captures only buckets the first ran once, eagerly
    assert len(set(captures)) == len(captures)
    assert "eos" in eager.finish_reasons and "length" in eager.finish_reasons and len(eager.completion_ids[3]) <= 11
    assert graphed.completion_ids == eager.completion_ids == again.completion_ids
    assert graphed.finish_reasons == eager.finish_reasons
    assert torch.equal(graphed.logprobs, eager.logprobs) and torch.equal(again.logprobs, eager.logprobs)


def test_stop_string_inside_a_multi_character_token():
    """Byte-level BPE: the token completing the stop string is the last one; the text is cut after it."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HfTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    corpus = ["the cat sat on the mat; the dog ate the hat. " * 3, "numbers: 12345 67890 ünïcödé ✓✓"] * 20
    hf.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Tokenizer(hf)
    model = peaked_tiny_model(tok, seed=3)
    prompts = [tok.encode("the cat")] * 16
    free = generate(model, prompts, SamplingParams(max_new_tokens=16, temperature=1.0), seed=0, tokenizer=tok)
    # the first sampled multi-character token whose first character, with the character before it,
    # makes a stop string not seen earlier in that row
    for b, completion in enumerate(free.completion_ids):
        found = None
        for j in range(1, len(completion)):
            piece, before = tok.decode([completion[j]]), tok.decode(completion[:j])
            stop = before[-1:] + piece[:1]
            if len(piece) >= 2 and "\ufffd" not in piece + stop and free.texts[b].find(stop) == len(before) - 1:
                found = (j, piece, before, stop)
                break
        if found:
            break
    assert found, "no multi-character token was sampled"
    j, piece, before, stop = found
    r = generate(model, prompts, SamplingParams(max_new_tokens=16, temperature=1.0, stop=[stop]), seed=0, tokenizer=tok)
    assert r.finish_reasons[b] == "stop" and r.texts[b] == before + piece[0]
    assert r.completion_ids[b] == free.completion_ids[b][:j + 1]
    assert tok.decode(r.completion_ids[b]) == before + piece != r.texts[b]


class CountingModel(Qwen3ForCausalLM):
    """The real model, recording each paged forward: tokens computed, rows in the batch (padding rows, whose
    tables point only at the scratch block 0, left out) and the real rows' context lengths."""

    def __init__(self, config):
        super().__init__(config)
        self.calls = []

    def forward_paged(self, tokens, batch, cache, last):
        real = batch.block_tables[:, 0] != 0
        kind = "decode" if batch.cu_seqlens is None else "prefill"
        computed = int(real.sum()) if kind == "decode" else int(batch.cu_seqlens[-1])
        self.calls.append((kind, computed, batch.lengths[real].tolist()))
        return super().forward_paged(tokens, batch, cache, last)


def test_one_batched_forward_per_decode_step(model, prompts):
    counting = CountingModel(model.config)
    counting.load_state_dict(model.state_dict())
    r = generate(counting, prompts, SamplingParams(max_new_tokens=7, temperature=1.0), seed=9)
    lens = [len(p) for p in prompts]
    assert counting.calls == [("prefill", sum(lens), lens)] + [
        ("decode", 5, [n + j for n in lens]) for j in range(1, 7)]
    assert r.completion_lens.tolist() == [7] * 5


def test_finished_rows_leave_the_batch(model, prompts):
    """A row that ended on EOS is decoded once more (the host learns of the EOS one step late; that token is
    dropped) and then no longer; the others are, at their full context; what they produce is the naive
    loop's (test_eos_ends_rows_individually)."""
    counting = CountingModel(model.config)
    counting.load_state_dict(model.state_dict())
    eos = naive_greedy(model, prompts[0], 10)[0][3]
    r = generate(counting, prompts, SamplingParams(max_new_tokens=10, temperature=0.0), eos_ids=[eos])
    ended_at = [n if reason == "eos" else None for n, reason in zip(r.completion_lens.tolist(), r.finish_reasons)]
    assert ended_at[0] is not None and None in ended_at
    decodes = [c for c in counting.calls if c[0] == "decode"]
    for step, (_, rows, lengths) in enumerate(decodes, start=1):   # decode call i feeds completion token i
        alive = [b for b in range(len(prompts)) if ended_at[b] is None or step <= ended_at[b]]
        assert rows == len(alive) and lengths == [len(prompts[b]) + step for b in alive], step


def test_an_engine_grows_its_pool_for_a_larger_call(model, prompts, tok):
    """A kept engine sized by a small first call (a warm-up) grows its pool for a larger one, and returns what a
    fresh engine does."""
    from framework.rollout import RolloutEngine

    params = SamplingParams(max_new_tokens=12, temperature=0.8)
    engine = RolloutEngine(model)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, temperature=0.8), seed=1, tokenizer=tok)
    small = engine.cache.num_blocks
    grown = engine.generate(prompts, params, seed=3, tokenizer=tok)
    assert engine.cache.num_blocks > small and engine.peak_rows == len(prompts)
    fresh = generate(model, prompts, params, seed=3, tokenizer=tok)
    assert grown.completion_ids == fresh.completion_ids and torch.equal(grown.logprobs, fresh.logprobs)
    engine.release()


@pytest.mark.parametrize("fresh", [False, True], ids=["same-engine", "fresh-engine"])
def test_rollout_profile_reports_each_phase_of_one_call(fresh):
    """benchmarks.rollout_profile on CPU: one prefill of every row (they all fit at once) and one decode step
    per token of the longest row after its first, in the phase table and summed over the bucket table."""
    import re

    from benchmarks.rollout import workload
    from benchmarks.rollout_profile import main

    report = main(["--preset", "tiny", "--num-seqs", "6", "--lo", "4", "--hi", "12"] + (["--fresh"] if fresh else []))
    _, outs = workload(6, 4, 12, 256)
    phases = {m[1]: (int(m[2]), float(m[3])) for m in re.finditer(r"^\| (prefill|decode) \| (\d+) \| ([\d.]+) \|",
                                                                   report, re.MULTILINE)}
    assert phases["prefill"] == (1, 6.0) and phases["decode"][0] == max(outs) - 1
    buckets = [int(m[1]) for m in re.finditer(r"^\| \d+ \| (\d+) \| [\d.]+ \| \d+ \|", report, re.MULTILINE)]
    assert sum(buckets) == max(outs) - 1
    assert re.search(r"peak rows 6, preemptions 0, KV blocks \d+", report)


def test_timeline_counts_each_step_and_the_context_it_reads(model, tok):
    """A Timeline on a CPU engine: one prefill computing every prompt token once, and decode steps whose rows
    and context positions match a hand count: row i reads len(prompt_i) + k positions at its k-th decode step,
    k = 1 .. limit_i - 1 (its first token comes from the prefill). Every duration is >= 0 and the parts fit in
    the span."""
    from framework.rollout.timeline import Timeline

    prompts = [tok.encode(t) for t in ("12+34=", "hello there", "a")]
    limits = [5, 9, 3]
    engine = RolloutEngine(model)
    engine.timeline = Timeline(torch.device("cpu"))
    engine.generate(prompts, SamplingParams(max_new_tokens=limits, temperature=1.0), seed=2, tokenizer=tok)
    s = engine.timeline.summary()
    assert s["prefill"]["steps"] == 1 and s["prefill"]["rows"] == 3
    assert s["prefill"]["tokens"] == sum(map(len, prompts))
    assert s["decode"]["steps"] == max(limits) - 1
    assert s["decode"]["rows"] == sum(n - 1 for n in limits)
    assert s["decode"]["tokens"] == sum(len(p) + k for p, n in zip(prompts, limits) for k in range(1, n))
    assert sum(b["steps"] for b in s["decode"]["by_bucket"].values()) == s["decode"]["steps"]
    parts = [s[k][f] for k in ("prefill", "decode") for f in ("forward_s", "sample_s")] + [s["idle_s"]]
    assert min(parts) >= 0 and sum(parts) <= s["span_s"] + 1e-6
    assert s["captures"] == 0 and s["waited_s"] == 0.0   # CPU: no graphs, nothing to wait for
    # the host time outside the steps, split where the engine marks its parts, in the order they run
    assert list(s["setup_parts"]) == ["weight copies", "pool", "admission"]
    assert list(s["finish_parts"]) == ["drain", "restore", "result"]
    for key, total in (("setup_parts", "setup_s"), ("finish_parts", "finish_s")):
        assert min(s[key].values()) >= 0 and abs(sum(s[key].values()) - s[total]) < 1e-9


@pytest.mark.gpu
def test_rollout_profile_on_cuda_times_the_device_and_lists_the_decode_kernels():
    """On CUDA the timeline reads the device's clock (events): its parts fit in the span, graphs are captured
    and timed, and `--kernels` lists the decode step's kernels with the sampler's among them."""
    import re

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from benchmarks.rollout_profile import main

    report = main(["--preset", "tiny", "--num-seqs", "40", "--lo", "8", "--hi", "64", "--kernels", "3"])
    m = re.search(r"device span of the steps ([\d.]+) s, idle between steps ([\d.]+) s", report)
    assert m and 0 <= float(m[2]) <= float(m[1])
    assert re.search(r"kernels of one decode step at bucket \d+ .*: \d+ kinds, \d+ launches", report)
    assert re.search(r"^\| `[^`]*sample[^`]*` \| [\d.]+ \| \d+ \|$", report, re.MULTILINE)   # a kernel row


@pytest.mark.parametrize("block_size, blocks, admit_batch", [(4, 24, 1), (8, 14, 1), (4, 24, 2)])
def test_preemption_gives_the_unbounded_tokens_and_logprobs(model, tok, block_size, blocks, admit_batch):
    """fp32 on CPU, budgets that preempt rows again and again: exactly the tokens and logprobs of an unbounded pool,
    also when rows are admitted two at a time while two or more run (admit_batch 2). The rows: a group of 8
    identical prompts (prefilled once), a prompt sharing their first full block (a prefix-cache hit), others of
    their own, limits per row, and EOS ids that end some rows mid-way. A readmitted row's next token comes from the
    prefill's logits, which equal those of the decode step it replaces bit for bit (matmuls of row counts padded to
    16, `_batched_attention` summing in position order). Every block goes back, and none is released more often than
    taken (that would raise)."""
    group = tok.encode("what is 12+34? ")                       # 15 tokens
    prompts = [group] * 8 + [group[:8] + tok.encode("5*5=")] + [tok.encode(t) for t in ("7=", "hello world, ", "a")]
    limits = [24, 24, 20, 24, 24, 16, 24, 24, 24, 9, 24, 5]
    params = SamplingParams(max_new_tokens=limits, temperature=1.0, top_p=0.95)
    settings = CacheSettings(kv_cache_gib=None, max_num_seqs=256, block_size=block_size, admit_batch=1,
                             kv_cache_dtype="auto")
    plain = RolloutEngine(model, settings).generate(prompts, params, seed=5, tokenizer=tok).completion_ids
    eos = [plain[0][6], plain[10][11]]   # tokens this draw emits mid-way: rows stop there
    counting = CountingModel(model.config)
    counting.load_state_dict(model.state_dict())
    unbounded = RolloutEngine(counting, settings)
    free = unbounded.generate(prompts, params, seed=5, eos_ids=eos, tokenizer=tok)
    assert unbounded.preemptions == 0 and "eos" in free.finish_reasons and "length" in free.finish_reasons
    assert unbounded.prefill_tokens == len(group) + 4 + sum(map(len, prompts[9:]))   # once a group, one cached block
    counting.calls.clear()
    gib = (blocks + 0.5) * block_bytes(model.config, torch.float32, block_size) / (1 << 30)
    tight = RolloutEngine(counting, CacheSettings(kv_cache_gib=gib, max_num_seqs=256, block_size=block_size,
                                                  admit_batch=admit_batch, kv_cache_dtype="auto"))
    r = tight.generate(prompts, params, seed=5, eos_ids=eos, tokenizer=tok)
    assert tight.cache.num_blocks == blocks and tight.preemptions >= 5
    prefills = [c for c in counting.calls if c[0] == "prefill"]
    assert any(computed < sum(lengths) for _, computed, lengths in prefills)         # cached blocks were reused
    assert max(max(lengths) for *_, lengths in prefills) > max(map(len, prompts))    # prompt + tokens recomputed
    assert r.completion_ids == free.completion_ids and r.finish_reasons == free.finish_reasons
    assert torch.equal(r.logprobs, free.logprobs)
    assert all(n == 0 for n in tight.blocks.refs) and tight.blocks.num_free == blocks - 1
    if admit_batch > 1:   # fewer prefills than when every row joins as soon as it fits
        counting.calls.clear()
        one = RolloutEngine(counting, dataclasses.replace(tight.settings, admit_batch=1)).generate(
            prompts, params, seed=5, eos_ids=eos, tokenizer=tok)
        assert one.completion_ids == r.completion_ids
        assert len([c for c in counting.calls if c[0] == "prefill"]) > len(prefills)


@pytest.mark.gpu
def test_cuda_preemption_keeps_greedy_tokens(model, prompts):
    """CUDA, fp32, decode graphs on: under a budget that preempts rows, the device's block tables follow the
    rows' new blocks and readmissions (changed entries and rows uploaded, not the whole table), and the
    greedy tokens are those of a naive full-forward loop and of an unbounded pool."""
    cuda = Qwen3ForCausalLM(model.config)
    cuda.load_state_dict(model.state_dict())
    cuda = cuda.to("cuda").eval()
    many = prompts * 4
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    free = generate(cuda, many, params)
    gib = 12.5 * block_bytes(cuda.config, torch.float32, 8) / (1 << 30)
    engine = RolloutEngine(cuda, CacheSettings(kv_cache_gib=gib, max_num_seqs=256, block_size=8, admit_batch=8,
                                               kv_cache_dtype="auto"))
    tight = engine.generate(many, params)
    assert engine.cache.num_blocks == 12 and engine.preemptions > 0 and engine.graphs
    assert tight.completion_ids == free.completion_ids
    assert (tight.logprobs - free.logprobs).abs().max() < 1e-4
    for b, prompt in enumerate(prompts):
        assert tight.completion_ids[b] == naive_greedy(cuda, prompt, 40)[0]
    assert all(n == 0 for n in engine.blocks.refs)
    engine.release()


def test_cpu_prefill_logits_are_the_decode_logits_bit_for_bit(model, tok):
    """What readmission after a preemption relies on, on CPU fp32: a context's last-position logits from one
    prefill (the engine's padding: tokens and logits rows to multiples of 16) equal, bit for bit, those of the
    decode step that feeds its last token after a prefill of the rest, whatever the batch holds besides."""
    from framework.models.qwen3 import PagedBatch

    bs, pad = 8, 16
    ctx = tok.encode("hello world, 12+34=")
    n = len(ctx)
    cache = model.new_paged_kv_cache(16, bs)
    mine, other = torch.tensor([1, 2, 3, 0]), torch.tensor([4, 5, 6, 7])   # row tables, 4 blocks a row

    def prefill(table, tokens, extra=0):
        """tokens at positions 0.., padded with `extra` scratch rows' worth of tokens; logits of the last."""
        m = len(tokens)
        count = -(-(m + extra) // pad) * pad
        pos = torch.cat([torch.arange(m), torch.zeros(count - m, dtype=torch.long)])
        blk = torch.cat([table[torch.arange(m) // bs], torch.zeros(count - m, dtype=torch.long)])
        batch = PagedBatch(positions=pos, write_blocks=blk, write_offsets=pos % bs, block_tables=table[None],
                           lengths=torch.tensor([m]), cu_seqlens=torch.tensor([0, m]))
        ids = torch.tensor(tokens + [0] * (count - m))
        return model.forward_paged(ids, batch, cache, torch.full((pad,), m - 1))[0]

    def decode(token, p, rows):
        """one decode step of `rows` rows: ours first (token at position p), the others on scratch"""
        tables = torch.zeros(rows, 4, dtype=torch.long)
        tables[0] = mine
        pos = torch.zeros(rows, dtype=torch.long)
        pos[0] = p
        batch = PagedBatch(positions=pos, write_blocks=tables.gather(1, (pos // bs)[:, None]).squeeze(1),
                           write_offsets=pos % bs, block_tables=tables, lengths=pos + 1, cu_seqlens=None)
        ids = torch.zeros(rows, dtype=torch.long)
        ids[0] = token
        return model.forward_paged(ids, batch, cache, torch.arange(rows))[0]

    whole = prefill(other, ctx)
    for extra, rows in ((0, 16), (40, 48)):
        prefill(mine, ctx[:-1], extra)
        stepped = decode(ctx[-1], n - 1, rows)
        assert torch.equal(stepped, whole), (extra, rows, (stepped - whole).abs().max())
        # the keys/values the two paths wrote for the last position agree too
        b, o = (n - 1) // bs, (n - 1) % bs
        assert torch.equal(cache.k[:, mine[b], :, o], cache.k[:, other[b], :, o])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 37, 64])
def test_cuda_decode_step_projections_run_fws_gemm(model, rows, monkeypatch):
    """A bf16 decode step's projections go through fw::skinny_linear (ops_cuda.linear): the `o` and `down` ones at up
    to 16 rows by default, all four a layer at up to 64 with FW_SKINNY_LINEAR=all. Its logits are as close to a
    float32 step on the same cache as those of the step through cuBLAS (FW_SKINNY_LINEAR=0)."""
    from framework.models.qwen3 import PagedKVCache
    from framework.rollout.kv_cache import decode_step

    g = torch.Generator().manual_seed(rows)
    L, Hk, D = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    blocks, bs, width = 4 * rows + 1, 16, 4
    pool = torch.randn(2, L, blocks, Hk, bs, D, generator=g)
    tables = torch.randperm(blocks - 1, generator=g)[: rows * width].reshape(rows, width).cuda()
    positions = torch.randint(0, bs * width, (rows,), generator=g)
    tokens = torch.randint(0, model.config.vocab_size, (rows,), generator=g)
    inputs = torch.stack([tokens, positions], 1).cuda()

    def step(dtype, mode):
        monkeypatch.setenv("FW_SKINNY_LINEAR", mode)
        m = Qwen3ForCausalLM(model.config)
        m.load_state_dict(model.state_dict())
        m = m.to("cuda", dtype).eval()
        cache = PagedKVCache(k=pool[0].to("cuda", dtype), v=pool[1].to("cuda", dtype))
        with OpLog() as log:
            logits = decode_step(m, cache, inputs, tables)
        return logits.double(), log.ops.count("fw.skinny_linear")

    want, none = step(torch.float32, "all")
    cublas, zero = step(torch.bfloat16, "0")
    assert none == 0 and zero == 0
    for mode, calls in (("1", 2 * L if rows <= 16 else 0), ("all", 4 * L)):
        fw, n = step(torch.bfloat16, mode)
        assert n == calls, (mode, n)
        assert (fw - want).abs().max() <= 1.5 * (cublas - want).abs().max() + 1e-2


# ------------------------------------------------------------------ rollout.kv_cache_dtype float8_e4m3

FP8 = torch.float8_e4m3fn


def e4m3(t):
    """t as a float8 pool holds it (rounded to nearest e4m3, saturating at +-448), back in t's dtype."""
    return t.clamp(-448, 448).to(FP8).to(t.dtype)


def fp8_settings(**changes):
    """The schema's cache settings with a float8 pool, and `changes`."""
    return dataclasses.replace(CacheSettings.from_config(None), **{"kv_cache_dtype": "float8_e4m3", **changes})


def rounded_kv_reference(model):
    """A copy of `model` whose full forwards round every layer's keys and values as a float8 pool holds them."""
    ref = Qwen3ForCausalLM(model.config)
    ref.load_state_dict(model.state_dict())
    for layer in ref.model.layers:
        def qkv(x, positions, inner=layer.self_attn._qkv):
            q, k, v = inner(x, positions)
            return q, e4m3(k), e4m3(v)

        layer.self_attn._qkv = qkv
    return ref.eval()


@pytest.mark.parametrize("block_size, blocks, admit_batch", [(4, 24, 1), (8, 14, 2)])
def test_fp8_preemption_gives_the_unbounded_fp8_tokens_and_logprobs(model, tok, block_size, blocks, admit_batch):
    """kv_cache_dtype float8_e4m3, float32 compute on CPU, budgets that preempt rows again and again: exactly the
    tokens and logprobs of an unbounded float8 pool (a readmitted row's prefill reads the rounded keys and values its
    decode steps would have), which are not the float32 pool's. The rows of the float32 preemption test."""
    group = tok.encode("what is 12+34? ")
    prompts = [group] * 8 + [group[:8] + tok.encode("5*5=")] + [tok.encode(t) for t in ("7=", "hello world, ", "a")]
    limits = [24, 24, 20, 24, 24, 16, 24, 24, 24, 9, 24, 5]
    params = SamplingParams(max_new_tokens=limits, temperature=1.0, top_p=0.95)
    settings = fp8_settings(kv_cache_gib=None, block_size=block_size, admit_batch=1)
    unbounded = RolloutEngine(model, settings)
    free = unbounded.generate(prompts, params, seed=5, tokenizer=tok)
    assert unbounded.cache.k.dtype == FP8 and unbounded.preemptions == 0
    exact = RolloutEngine(model, dataclasses.replace(settings, kv_cache_dtype="auto")).generate(
        prompts, params, seed=5, tokenizer=tok)
    assert not torch.equal(exact.logprobs, free.logprobs)   # the rounding shows
    gib = (blocks + 0.5) * block_bytes(model.config, FP8, block_size) / (1 << 30)
    tight = RolloutEngine(model, dataclasses.replace(settings, kv_cache_gib=gib, admit_batch=admit_batch))
    r = tight.generate(prompts, params, seed=5, tokenizer=tok)
    assert tight.cache.num_blocks == blocks and tight.preemptions >= 5
    assert r.completion_ids == free.completion_ids and r.finish_reasons == free.finish_reasons
    assert torch.equal(r.logprobs, free.logprobs)
    assert all(n == 0 for n in tight.blocks.refs) and tight.blocks.num_free == blocks - 1


def test_fp8_greedy_equals_full_forwards_over_rounded_keys_and_values(model, prompts):
    """kv_cache_dtype float8_e4m3, float32 compute on CPU: the greedy tokens and logprobs are those of a cache-free
    loop of full forwards whose attention rounds k and v to e4m3 (saturating) before using them, and far from those
    of the unrounded model: the pool holds the rounded values, and the prefill and every decode step read them."""
    r = generate(model, prompts, SamplingParams(max_new_tokens=12, temperature=0.0), cache=fp8_settings())
    ref = rounded_kv_reference(model)
    for b, prompt in enumerate(prompts):
        tokens, logprobs, _ = naive_greedy(ref, prompt, 12)
        assert r.completion_ids[b] == tokens
        # float32 sums in another order, before the rounding: a little more than the float32 paths' 1e-5 apart
        torch.testing.assert_close(r.logprobs[b].double(), torch.tensor(logprobs, dtype=torch.float64), atol=1e-4,
                                   rtol=0)
    assert (r.logprobs.double() - full_forward_logprobs(model, r, 1.0)).abs().max() > 1e-2


def test_fp8_flash_prefill_attends_over_the_values_the_pool_holds(model):
    """Qwen3Attention.paged's flash branch (a CUDA prefill of whole contexts; here on CPU through the ops'
    references) into a float8 pool: it writes k and v rounded to nearest e4m3 and saturated at +-448 (inputs large
    enough that v passes it), exactly a float32 pool's values rounded, and attends over those rounded values, as
    the pool-reading prefill (the CPU's, and a readmitted row's on CUDA) does."""
    from framework.models.qwen3 import FlashPrefill, PagedBatch

    attn, c, bs = model.model.layers[0].self_attn, model.config, 4
    lens = [5, 11]
    x = torch.randn(sum(lens), c.hidden_size, generator=torch.Generator().manual_seed(0)) * 300
    positions = torch.cat([torch.arange(n) for n in lens])
    tables = torch.tensor([[1, 2, 0], [3, 4, 5]])
    blk = tables[torch.repeat_interleave(torch.arange(2), torch.tensor(lens)), positions // bs]
    cu = torch.tensor([0, lens[0], sum(lens)])

    def prefill(dtype, flash):
        k_pool = torch.zeros(6, c.num_key_value_heads, bs, c.head_dim, dtype=dtype)
        v_pool = torch.zeros_like(k_pool)
        batch = PagedBatch(positions=positions, write_blocks=blk, write_offsets=positions % bs, block_tables=tables,
                           lengths=torch.tensor(lens), cu_seqlens=cu, flash=flash)
        with torch.no_grad():
            return attn.paged(x, batch, k_pool, v_pool), k_pool.float(), v_pool.float()

    whole = FlashPrefill(cu.int(), max(lens), cu.int(), max(lens))
    out32, k32, v32 = prefill(torch.float32, whole)
    out8, k8, v8 = prefill(FP8, whole)
    pooled, _, _ = prefill(FP8, None)
    assert v32.abs().max() > 448 and v8.abs().max() == 448
    assert torch.equal(k8, e4m3(k32)) and torch.equal(v8, e4m3(v32))
    scale = out32.abs().max()
    assert (out8 - pooled).abs().max() < 1e-5 * scale < (out8 - out32).abs().max()


def test_fp8_pool_takes_half_the_bytes_of_bf16_and_computes_in_bf16(model, prompts, monkeypatch):
    """A float8 block takes one byte an element, half a bfloat16 one; under bf16 autocast and one kv_cache_gib an
    engine with kv_cache_dtype float8_e4m3 gets twice the blocks of an "auto" one (its pool bfloat16) in the same
    bytes, and attends in bfloat16 over them; a float32 model's attends in float32. rollout.kv_cache_dtype reaches
    the settings."""
    import ops_cuda
    from framework.config import resolve

    bs = 4
    half = block_bytes(model.config, torch.bfloat16, bs)
    assert 2 * block_bytes(model.config, FP8, bs) == half == block_bytes(model.config, torch.float32, bs) // 2
    assert pool_dtype("auto", torch.bfloat16) is torch.bfloat16 and pool_dtype("float8_e4m3", torch.float32) is FP8
    seen = set()

    def decode_attention(q, k_pool, *args):
        seen.add((q.dtype, k_pool.dtype))
        return real(q, k_pool, *args)

    real = ops_cuda.paged_decode_attention
    monkeypatch.setattr(ops_cuda, "paged_decode_attention", decode_attention)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)   # the rows could use 23 blocks at once
    pools = {}
    for kv in ("auto", "float8_e4m3"):
        engine = RolloutEngine(model, fp8_settings(kv_cache_gib=8.25 * half / (1 << 30), block_size=bs,
                                                   kv_cache_dtype=kv))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine.generate(prompts, params, seed=2)
        pools[kv] = engine.cache
    assert (pools["auto"].k.dtype, pools["auto"].num_blocks) == (torch.bfloat16, 8)
    assert (pools["float8_e4m3"].k.dtype, pools["float8_e4m3"].num_blocks) == (FP8, 16)
    assert pools["auto"].k.nbytes == pools["float8_e4m3"].k.nbytes
    assert seen == {(torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8)}
    seen.clear()
    generate(model, prompts, params, seed=2, cache=fp8_settings())
    assert seen == {(torch.float32, FP8)}
    cfg = resolve({"recipe": "grpo", "model": {"policy": {"preset": "tiny"}},
                   "rollout": {"kv_cache_dtype": "float8_e4m3"}})
    assert CacheSettings.from_config(cfg["rollout"]) == fp8_settings()
    assert CacheSettings.from_config(None).kv_cache_dtype == "auto"


@pytest.mark.gpu
def test_cuda_fp8_pool_under_a_tight_budget_preempts_and_completes(model, prompts):
    """CUDA, bfloat16 compute (the float8 decode kernel takes 16-bit queries), float8 pool, decode graphs on: a budget
    of 12 blocks preempts rows and the call completes with every row's tokens, finite logprobs, and every block
    back. Token equality with an unbounded float8 pool is checked on CPU in float32; on CUDA in bfloat16 it is not
    claimed."""
    cuda = Qwen3ForCausalLM(model.config)
    cuda.load_state_dict(model.state_dict())
    cuda = cuda.to("cuda", torch.bfloat16).eval()
    many = prompts * 4
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    gib = 12.5 * block_bytes(cuda.config, FP8, 8) / (1 << 30)
    engine = RolloutEngine(cuda, fp8_settings(kv_cache_gib=gib, block_size=8, admit_batch=8))
    tight = engine.generate(many, params)
    assert engine.cache.k.dtype == FP8 and engine.cache.num_blocks == 12 and engine.preemptions > 0 and engine.graphs
    assert all(len(c) > 0 for c in tight.completion_ids) and torch.isfinite(tight.logprobs).all()
    assert all(n == 0 for n in engine.blocks.refs)
    engine.release()


@pytest.mark.gpu
def test_cuda_fp8_pool_refuses_a_float32_rollout(model, prompts):
    """The float8 decode kernel takes 16-bit queries: a float32 rollout on CUDA is refused before any step, naming
    the setting."""
    cuda = Qwen3ForCausalLM(model.config)
    cuda.load_state_dict(model.state_dict())
    cuda = cuda.to("cuda").eval()
    with pytest.raises(FwError, match="rollout.kv_cache_dtype: float8_e4m3 needs a bfloat16 or float16 rollout"):
        generate(cuda, prompts, SamplingParams(max_new_tokens=4, temperature=0.0), cache=fp8_settings())


def test_kv_cache_dtypes_are_the_schemas():
    """The engine maps every value the schema allows for rollout.kv_cache_dtype, and no other."""
    import json

    from framework.config import schema_text
    from framework.rollout.kv_cache import KV_CACHE_DTYPES

    schema = json.loads(schema_text())
    assert sorted(schema["properties"]["rollout"]["properties"]["kv_cache_dtype"]["enum"]) == sorted(KV_CACHE_DTYPES)



def test_fp8_cuda_problem_names_what_the_decode_kernel_takes(model):
    """The rule the engine and fw fit's check share: 16-bit compute, head_dim 64 or 128, 2+ query heads a kv head."""
    from framework.rollout.kv_cache import fp8_cuda_problem

    c = model.config   # the tiny preset: head_dim 64, 4 / 2 heads
    assert fp8_cuda_problem(torch.bfloat16, c) is None and fp8_cuda_problem(torch.float16) is None
    assert "computes in float32" in fp8_cuda_problem(torch.float32, c)
    assert "head_dim 96" in fp8_cuda_problem(torch.bfloat16, dataclasses.replace(c, head_dim=96))
    assert "2 / 2 heads" in fp8_cuda_problem(torch.bfloat16, dataclasses.replace(c, num_attention_heads=2))


def test_padded_rows_lays_each_row_left_aligned_then_the_pad():
    from framework.rollout.engine import padded_rows

    ids = padded_rows([[5, 6, 7], [], [2**40, -1]], -9, torch.long)
    assert ids.dtype == torch.long
    assert ids.tolist() == [[5, 6, 7], [-9, -9, -9], [2**40, -1, -9]]
    values = [[0.1, -1e-8], [1 / 3], []]
    logp = padded_rows(values, 0.0, torch.float32)
    # each value rounded once from its float64, as torch.tensor(float64 values).float() rounds it
    expected = [[torch.tensor(v, dtype=torch.float64).float().item() for v in row] + [0.0] * (2 - len(row))
                for row in values]
    assert logp.dtype == torch.float32 and logp.tolist() == expected
    assert padded_rows([], 0, torch.long).shape == (0, 0)
    assert padded_rows([[], []], 0.0, torch.float32).shape == (2, 0)


def test_rollout_result_benchmark_times_the_assembly_of_finished_rows():
    from benchmarks.rollout_result import main

    out = main(["--rows", "8", "--prompt-len", "5", "--new-tokens", "3", "--rounds", "2"])
    assert out.startswith("rollout result of 8 rows x (5 + 3) tokens: median ") and out.endswith(")")


def test_the_cpu_draw_of_rows_with_nan_or_inf_logits_is_the_reference_draw():
    """The CPU rollout draws a row holding a NaN logit (or a +inf) as the sampler's reference does (plain_mass:
    a NaN carries no mass, a row without mass draws column 0), with the full softmax's logprob (NaN, -inf); the
    other rows of the batch draw as they would alone."""
    from framework.rollout.sampling import SamplingParams, draw
    from ops_cuda.sample import sample_reference

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=g) * 3
    logits[1, [0, 7, 250]] = float("nan")
    logits[2, 5] = float("inf")
    logits[3] = float("nan")
    counters = torch.tensor([[10, 2], [11, 2], [12, 2], [13, 2], [14, 2]])
    params = SamplingParams(max_new_tokens=1, temperature=0.8)
    tokens, logprob = draw(logits, params, 9, counters)
    ref_tokens, _ = sample_reference(logits.double(), 0.8, 0, 1.0, 0.0, 9, counters)
    assert tokens.tolist() == ref_tokens.tolist()
    assert tokens[1] not in (0, 7, 250) and tokens[2] == 0 and tokens[3] == 0
    assert logprob[1].isnan() and logprob[2] == float("-inf") and logprob[3].isnan()
    for row in (0, 4):   # as alone
        alone = draw(logits[row:row + 1], params, 9, counters[row:row + 1])
        assert alone[0].item() == tokens[row].item() and alone[1].item() == logprob[row].item()
        full = torch.log_softmax(logits[row].double() / 0.8, -1)[tokens[row]]
        assert abs(logprob[row].item() - full.item()) < 1e-5


def successor_model(tok, successor: dict[int, int]):
    """A tiny model whose greedy next token after token t is ``successor[t]``: its layers add nothing to the
    residual stream (o_proj and down_proj zero), and the untied LM head's row for ``successor[t]`` is t's embedding,
    which random 64-wide embeddings match far better than any other token's."""
    from framework.models.presets import PRESETS

    torch.manual_seed(0)
    config = Qwen3Config.from_hf({**PRESETS["tiny"], "vocab_size": tok.vocab_size, "tie_word_embeddings": False,
                                  "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id})
    m = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = m.model.embed_tokens.weight
        emb.normal_()
        m.lm_head.weight.zero_()
        for t, nxt in successor.items():
            m.lm_head.weight[nxt] = emb[t]
    return m.eval()


def test_a_stop_string_of_four_byte_characters_sampled_a_byte_a_token_is_found():
    """The stop check decodes a window of each row's last tokens: one wide enough for the longest stop string's
    bytes, a token each (the most tokens a byte-level vocabulary spends on a text of that many characters)."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HfTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    # bytes only, no merges: every byte of a 4-byte character is a token of its own
    hf.train_from_iterator(["x"], trainers.BpeTrainer(vocab_size=258, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Tokenizer(hf)
    face, stop = "\U0001F600", "\U0001F600" * 8   # 4 UTF-8 bytes; a stop string of 8 of them, 32 tokens
    cycle = tok.encode(face)
    assert len(cycle) == 4 and tok.decode(cycle) == face
    prompt = tok.encode("ab")
    model = successor_model(tok, {prompt[-1]: cycle[0], **{a: b for a, b in zip(cycle, cycle[1:] + cycle[:1])}})
    free = generate(model, [prompt], SamplingParams(max_new_tokens=40, temperature=0.0), tokenizer=tok)
    assert free.completion_ids[0] == (cycle * 10)[:40]   # the model emits the character byte by byte
    r = generate(model, [prompt], SamplingParams(max_new_tokens=40, temperature=0.0, stop=[stop, "zz"]),
                 tokenizer=tok)
    assert r.finish_reasons == ["stop"] and r.completion_ids[0] == cycle * 8 and r.texts[0] == stop


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_kept_float32_engine_gives_the_trainers_logprobs_after_optimizer_steps(tok, device):
    """float32 weights without autocast (fit's 32-true) and train.yaml's shape of call (32 prompts x 16 samples, 2 new
    tokens: on CUDA two decode steps of the 256-row bucket, their graphs captured in the first call and replayed in the
    later ones): after each in-place AdamW step the kept engine samples with the trainer's logprobs and a fresh
    engine's tokens."""
    from framework.models.build import preset_config, seeded_init
    from recipes.rl import completion_logprobs

    model = Qwen3ForCausalLM(preset_config("tiny", tok.vocab_size, tok.eos_id, tok.pad_id))
    seeded_init(model, model.config.initializer_range, 0)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=device == "cuda")
    prompts = [tok.encode(f"{i % 10}=") for i in range(32) for _ in range(16)]
    params = SamplingParams(max_new_tokens=2, temperature=1.0)
    engine = RolloutEngine(model)
    gen = torch.Generator(device).manual_seed(0)
    for step in range(4):
        r = engine.generate(prompts, params, seed=step)
        mask = r.completion_mask.to(r.logprobs.dtype)
        logp, _ = completion_logprobs(model, r.tokens, r.prompt_lens, r.completion_lens, r.logprobs.shape[1], 1.0)
        worst = float(((r.logprobs - logp.detach()).abs() * mask).max())
        assert worst < 1e-4, (step, worst)
        assert r.completion_ids == generate(model, prompts, params, seed=step, cuda_graph=False).completion_ids, step
        adv = torch.randn(len(prompts), 1, device=device, generator=gen)
        opt.zero_grad(set_to_none=True)
        (-(logp * adv * mask).sum() / mask.sum()).backward()
        opt.step()
    assert device == "cpu" or engine.graphs
    engine.release()
