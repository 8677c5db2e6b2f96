"""Randomized differential test of the rollout engine on CPU, fp32 compute: random workloads (prompts of random
lengths, groups of equal prompts, a shared system prefix, per-row limits, EOS ids and stop strings that end rows
mid-way) under random engine settings (block size, a KV budget from one row's worth up to unbounded, max_num_seqs,
admit_batch; engines that ran a call before) give exactly the tokens, logprobs, finish reasons and lengths of an
unbounded run with the same pool dtype, and the block bookkeeping holds at every forward and after every call."""
import dataclasses
import random
from collections import Counter

import pytest
import torch

from framework.models import Qwen3ForCausalLM
from framework.rollout import CacheSettings, RolloutEngine, SamplingParams
from framework.rollout.kv_cache import block_bytes, pool_dtype
from framework.rollout.scheduler import blocks_for

BLOCK_SIZES = (1, 2, 4, 8, 16)
LONGEST = 32                    # the largest per-row limit drawn
GROUPS = (1, 1, 1, 2, 3, 4, 8)   # how often a prompt repeats
KV_DTYPES = ("auto", "auto", "auto", "float8_e4m3")   # float8: the same promise over rounded keys/values
SAMPLINGS = ({"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.8, "top_k": 8, "top_p": 0.9},
             {"temperature": 1.2, "min_p": 0.05})


class CheckedModel(Qwen3ForCausalLM):
    """The real model, checking the block bookkeeping of `engine` at each paged forward it runs."""

    engine: RolloutEngine | None = None
    forwards = 0

    def forward_paged(self, tokens, batch, cache, last):
        if self.engine is not None:
            check_forward(self.engine.blocks, batch, cache.block_size)
            self.forwards += 1
        return super().forward_paged(tokens, batch, cache, last)


def check_manager(bm) -> None:
    """The block manager's own invariants: the free list is exactly the unreferenced blocks (the scratch block 0
    never among them, never referenced), counts never negative, and the prefix cache and its inverse agree."""
    assert bm.refs[0] == 0 and 0 not in bm.free
    assert all(n >= 0 for n in bm.refs)
    assert set(bm.free) == {b for b in range(1, bm.num_blocks) if bm.refs[b] == 0}
    assert bm.num_free + sum(1 for n in bm.refs if n) == bm.num_blocks - 1
    assert {b: h for h, b in bm.cached.items()} == bm.hash_of


def check_forward(bm, batch, bs: int) -> None:
    """Before a forward: every block a real row reads is referenced, no two tokens write one slot, and a decode
    step writes each row's next position into a block that row alone holds (a shared or free block would be
    overwritten under another row)."""
    check_manager(bm)
    tables = batch.block_tables.tolist()
    lengths = batch.lengths.tolist()
    if batch.cu_seqlens is None:   # decode: padding rows have all-scratch tables
        real = [r for r in range(len(tables)) if tables[r][0] != 0]
        n_real = len(real)
        writes = [(int(batch.write_blocks[r]), int(batch.write_offsets[r])) for r in real]
        assert all(bm.refs[b] == 1 for b, _ in writes), writes
        held = [b for r in real for b in tables[r][:-(-lengths[r] // bs)]]
        for b, _ in writes:
            assert held.count(b) == 1
        if batch.packs is not None:   # the CUDA kernel trusts them: a pack's rows hold its shared positions' blocks
            packs = batch.packs.tolist()
            for r, (first, n, shared) in enumerate(packs):
                assert first <= r < first + n and packs[first:first + n] == [[first, n, shared]] * n
                assert shared % bs == 0 and (r not in real or shared < lengths[r])
                assert tables[r][:shared // bs] == tables[first][:shared // bs]
    else:
        n_real = int(batch.cu_seqlens[-1])
        writes = list(zip(batch.write_blocks[:n_real].tolist(), batch.write_offsets[:n_real].tolist()))
        real = range(len(lengths))
    assert len(set(writes)) == len(writes) and all(bm.refs[b] >= 1 for b, _ in writes)
    for r in real:
        assert all(bm.refs[b] >= 1 for b in tables[r][:-(-lengths[r] // bs)]), (r, tables[r], lengths[r])
    assert n_real > 0


def check_after_call(engine) -> None:
    """After a call every block is free again (cached ones keep their hash, with no reference)."""
    bm = engine.blocks
    check_manager(bm)
    assert all(n == 0 for n in bm.refs) and bm.num_free == bm.num_blocks - 1


def expected_prefill_tokens(prompts: list[list[int]], limits: list[int], bs: int) -> int:
    """Tokens an unbounded pool prefills when every row joins in one step: each distinct prompt once (a group's
    followers compute nothing), less the full blocks of its prefix that a prompt admitted before it holds (at least
    its last token computed). Rows join longest limit first."""
    order = sorted(range(len(prompts)), key=lambda i: -limits[i])
    seen: list[list[int]] = []
    total = 0
    for i in order:
        p = prompts[i]
        if p in seen:
            continue
        reused = 0
        for q in seen:
            k = 0
            while k < (len(p) - 1) // bs and (k + 1) * bs <= len(q) and p[:(k + 1) * bs] == q[:(k + 1) * bs]:
                k += 1
            reused = max(reused, k)
        total += len(p) - reused * bs
        seen.append(p)
    return total


def random_workload(rng: random.Random) -> tuple[list[list[int]], list[int], dict]:
    """Prompts (printable ids of the built-in tokenizer), per-row limits and sampling settings."""
    def text(n: int) -> list[int]:
        return [rng.randrange(3, 95) for _ in range(n)]

    system = text(rng.randint(8, 40)) if rng.random() < 0.6 else []
    prompts = []
    for _ in range(rng.randint(1, 6)):
        if system and rng.random() < 0.6:   # the prefix alone, or with a question after it
            prompt = system + text(rng.choice([0, 1, 2, rng.randint(1, 8), rng.randint(1, 24)]))
        else:
            prompt = text(rng.choice([1, 2, rng.randint(1, 8), rng.randint(1, 24)]))
        prompts += [prompt] * rng.choice(GROUPS)
    rng.shuffle(prompts)
    if rng.random() < 0.3:
        limits = [rng.randint(1, LONGEST)] * len(prompts)
    else:
        limits = [rng.choice([1, 2, rng.randint(1, 8), rng.randint(1, LONGEST)]) for _ in prompts]
    return prompts, limits, dict(rng.choice(SAMPLINGS))


def random_settings(rng: random.Random, model, prompts, limits, kv_dtype: str) -> tuple[CacheSettings, int | None]:
    """Engine settings of a `kv_dtype` pool: block size, a budget from barely one row (the scratch block and the
    largest row's blocks) up to unbounded, max_num_seqs and admit_batch; and the pool's block count (None:
    unbounded)."""
    bs = rng.choice(BLOCK_SIZES)
    need = [blocks_for(len(p), n, bs) for p, n in zip(prompts, limits)]
    least, most = 1 + max(need), 1 + sum(need)
    pick = rng.random()
    if pick < 0.15:
        blocks = None
    elif pick < 0.45:
        blocks = least + rng.choice([0, 0, 1, 2])
    else:
        blocks = rng.randint(least, max(least, most - 1))
    per_block = block_bytes(model.config, pool_dtype(kv_dtype, torch.float32), bs)
    gib = None if blocks is None else (blocks + 0.5) * per_block / (1 << 30)
    settings = CacheSettings(kv_cache_gib=gib, max_num_seqs=rng.choice([1, 2, 3, 5, 8, 256]), block_size=bs,
                             admit_batch=rng.choice([1, 2, 3, 8]), kv_cache_dtype=kv_dtype)
    return settings, None if blocks is None else min(blocks, most)


def run(model, settings, prompts, params, seed, eos, tok, calls: int = 1, warmup: list[int] | None = None):
    """`calls` generate calls of one engine, each checked at every forward and after it; the results. `warmup`: rows
    of a call before them, with another seed (its pool is smaller: the next call makes a larger one)."""
    engine = RolloutEngine(model, settings)
    model.engine, model.forwards = engine, 0
    try:
        if warmup:
            limits = dataclasses.replace(params, max_new_tokens=[params.max_new_tokens[i] for i in warmup])
            engine.generate([prompts[i] for i in warmup], limits, seed=seed + 1, eos_ids=eos, tokenizer=tok)
            check_after_call(engine)
        out = []
        for _ in range(calls):
            out.append(engine.generate(prompts, params, seed=seed, eos_ids=eos, tokenizer=tok))
            check_after_call(engine)
        assert model.forwards > 0
        return engine, out
    finally:
        model.engine = None


def same(a, b) -> None:
    assert a.completion_ids == b.completion_ids
    assert a.finish_reasons == b.finish_reasons
    assert a.completion_lens.tolist() == b.completion_lens.tolist()
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert a.texts == b.texts


def check_case(model, tok, case: int, variants: int = 3) -> Counter:
    """One random workload (case: the random seed) against `variants` random settings; what it covered: finish
    reasons, float8 pools, preemptions, engines that ran a call before."""
    rng = random.Random(case)
    prompts, limits, sampling = random_workload(rng)
    seed = rng.randrange(1000)
    kv_dtype = rng.choice(KV_DTYPES)
    unbounded = CacheSettings(kv_cache_gib=None, max_num_seqs=256, block_size=16, admit_batch=8,
                              kv_cache_dtype=kv_dtype)
    params = SamplingParams(max_new_tokens=limits, **sampling)
    _, (plain,) = run(model, unbounded, prompts, params, seed, (), tok)
    # EOS ids and a stop string that this draw produces mid-way, so that some rows end early
    produced = [c[:-1] for c in plain.completion_ids if len(c) > 1]
    eos = sorted({rng.choice(c) for c in rng.sample(produced, min(len(produced), rng.randint(0, 2)))})
    texts = [t for t in plain.texts if len(t) > 3]
    stop = ()
    if texts and rng.random() < 0.3:
        t = rng.choice(texts)
        i = rng.randrange(1, len(t) - 2)
        stop = (t[i:i + rng.randint(1, 2)],)
    params = SamplingParams(max_new_tokens=limits, stop=stop, **sampling)
    engine, (ref,) = run(model, unbounded, prompts, params, seed, eos, tok)
    assert engine.preemptions == 0 and engine.peak_rows == len(prompts)
    assert engine.prefill_tokens == expected_prefill_tokens(prompts, limits, 16)
    for b, ids in enumerate(ref.completion_ids):   # the reference's own stopping rules
        reason = ref.finish_reasons[b]
        assert 1 <= len(ids) <= limits[b] and not set(ids[:-1]) & set(eos)
        assert (reason == "eos") == (ids[-1] in eos)
        assert reason != "length" or len(ids) == limits[b]
        assert reason != "stop" or ref.texts[b].endswith(stop)
    seen = Counter(ref.finish_reasons)
    seen[kv_dtype] += 1
    for _ in range(variants):
        settings, blocks = random_settings(rng, model, prompts, limits, kv_dtype)
        calls = 2 if rng.random() < 0.2 else 1   # an engine's next call starts afresh
        warmup = sorted(rng.sample(range(len(prompts)), rng.randint(1, len(prompts)))) if rng.random() < 0.2 else None
        engine, results = run(model, settings, prompts, params, seed, eos, tok, calls, warmup)
        if blocks is not None:
            assert engine.cache.num_blocks == blocks
        assert engine.peak_rows <= settings.max_num_seqs
        seen.update(preemptions=engine.preemptions, warmup=bool(warmup), again=calls - 1)
        for r in results:
            same(r, ref)
    return seen


@pytest.fixture(scope="module")
def checked(model):
    m = CheckedModel(model.config)
    m.load_state_dict(model.state_dict())
    return m.eval()


def test_random_workloads_give_the_unbounded_results(checked, tok):
    """100 random workloads, 3 random engine settings each: exactly the unbounded results. The cases cover every
    finish reason, both pool dtypes, preemptions, and engines called before."""
    seen = sum((check_case(checked, tok, case) for case in range(100)), Counter())
    assert all(seen[k] > 0 for k in ("eos", "stop", "length", "auto", "float8_e4m3", "preemptions", "warmup",
                                     "again")), seen


@pytest.mark.slow
@pytest.mark.parametrize("start", range(1000, 1500, 250))
def test_random_workloads_sweep(checked, tok, start):
    """More of them: 2,000 workloads."""
    for case in range(start, start + 250):
        check_case(checked, tok, case)
