"""Continuous batching over the paged KV cache: a small budget gives the same tokens and logprobs as an
unbounded one, groups prefill their prompt once, the hashed prefix cache reuses a shared system prompt, and
every block goes back."""
import pytest
import torch

from framework.errors import FwError
from framework.rollout import CacheSettings, RolloutEngine, SamplingParams, generate
from framework.rollout.block_manager import BlockManager, block_hashes
from framework.rollout.kv_cache import block_bytes
from framework.rollout.scheduler import RowState, Scheduler, blocks_for


def gib_for_blocks(model, n_blocks, block_size=16):
    return n_blocks * block_bytes(model.config, torch.float32, block_size) / (1 << 30)


def test_block_hashes_name_whole_prefixes():
    a = block_hashes(list(range(40)), 16)
    b = block_hashes(list(range(32)) + [7] * 8, 16)
    c = block_hashes([99] + list(range(1, 40)), 16)
    assert len(a) == 2 and a == b            # only full blocks; equal prefixes, equal hashes
    assert c[0] != a[0] and c[1] != a[1]     # the second block's hash depends on the first block too


def test_block_manager_refcounts_and_cache():
    bm = BlockManager(5, 4)
    assert bm.num_free == 4                  # block 0 is the scratch block
    x, y = bm.allocate(), bm.allocate()
    bm.register(x, 123)
    assert bm.cached_prefix([123, 456]) == [x] and bm.blocks_needed([x], 3) == 2
    bm.take(x)
    bm.release([x, y])
    assert bm.refs[x] == 1 and bm.refs[y] == 0 and bm.num_free == 3
    bm.release([x])
    assert bm.num_free == 4 and bm.cached_prefix([123]) == [x]          # free, still cached
    assert bm.blocks_needed([x], 3) == 3                                # reusing it takes a free block
    for _ in range(4):
        bm.allocate()
    assert bm.cached_prefix([123]) == []                                # handed out again: forgotten
    with pytest.raises(FwError, match="no free block"):
        bm.allocate()


def test_scheduler_admits_as_blocks_free_up():
    bm = BlockManager(1 + 2 * blocks_for(5, 4, 4), 4)   # room for two rows of 5 + 4 tokens
    rows = [RowState(row=i, prompt=[i + 1] * 5, limit=4) for i in range(3)]
    sched = Scheduler(rows, bm, max_num_seqs=8)
    assert sched.admit() == rows[:2] and sched.admit() == []
    sched.finish(rows[0], "length")
    assert sched.admit() == [rows[2]]
    for r in rows[1:]:
        sched.finish(r, "eos")
    assert sched.done and all(n == 0 for n in bm.refs) and bm.num_free == bm.num_blocks - 1
    with pytest.raises(FwError, match="raise rollout.kv_cache_gib"):
        Scheduler([RowState(row=0, prompt=[1] * 40, limit=8)], BlockManager(4, 4), 8)


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 8, "top_p": 0.9}])
def test_small_budget_gives_the_unbounded_tokens_and_logprobs(model, tok, sampling):
    """fp32 on CPU: a budget of 4 blocks (2 to 4 rows at a time) and max_num_seqs 3, against an unbounded pool:
    identical tokens and logprobs (the noise is keyed by row and step, never by batch slot)."""
    prompts = [tok.encode(t) for t in ("12+34=", "7=", "hello world, ", "a", "99*9=", "5-3=", "abc")]
    prompts.append(prompts[1])   # a repeated prompt: a group of two in the unbounded run
    params = SamplingParams(max_new_tokens=[12, 9, 12, 5, 12, 12, 7, 12], **sampling)
    eos = [tok.eos_id]
    unbounded = RolloutEngine(model, CacheSettings(kv_cache_gib=None, max_num_seqs=256, block_size=16))
    free = unbounded.generate(prompts, params, seed=3, eos_ids=eos, tokenizer=tok)
    assert unbounded.peak_rows == len(prompts)
    small = RolloutEngine(model, CacheSettings(kv_cache_gib=gib_for_blocks(model, 5.5), max_num_seqs=3,
                                               block_size=16))
    tight = small.generate(prompts, params, seed=3, eos_ids=eos, tokenizer=tok)
    assert small.cache.num_blocks == 5 and small.peak_rows <= 3
    assert tight.completion_ids == free.completion_ids and tight.finish_reasons == free.finish_reasons
    assert torch.equal(tight.logprobs, free.logprobs)
    assert all(n == 0 for n in small.blocks.refs)


def test_a_group_prefills_its_prompt_once(model, tok):
    prompt = tok.encode("what is 12+34? ")           # 15 tokens: a full block of 8 and a partial one
    engine = RolloutEngine(model, CacheSettings(kv_cache_gib=None, max_num_seqs=64, block_size=8))
    group = engine.generate([prompt] * 8, SamplingParams(max_new_tokens=6, temperature=1.0), seed=1)
    assert engine.prefill_tokens == len(prompt)
    assert all(n == 0 for n in engine.blocks.refs)
    assert len({tuple(c) for c in group.completion_ids}) > 1      # the samples still differ
    # each sample is what it would be alone: same row id, same noise, same context
    for b in (0, 5):
        alone = generate(model, [[1]] * b + [prompt], SamplingParams(max_new_tokens=6, temperature=1.0), seed=1)
        assert alone.completion_ids[b] == group.completion_ids[b]
        torch.testing.assert_close(alone.logprobs[b], group.logprobs[b], atol=1e-5, rtol=0)


def test_prefix_cache_reuses_a_shared_system_prompt(model, tok):
    system = tok.encode("You are a careful calculator. Answer with digits only. ")   # 55 tokens
    questions = [tok.encode(q) for q in ("1+1=", "22*3=", "9-4=")]
    prompts = [system + q for q in questions]
    engine = RolloutEngine(model, CacheSettings(kv_cache_gib=gib_for_blocks(model, 7.5), max_num_seqs=1,
                                                block_size=16))
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    r = engine.generate(prompts, params)
    full_blocks = len(system) // 16
    # one row at a time: the first computes its whole prompt, the others only past the shared full blocks
    assert engine.prefill_tokens == sum(map(len, prompts)) - 2 * full_blocks * 16
    assert all(n == 0 for n in engine.blocks.refs)
    for b, p in enumerate(prompts):   # and they generate what each prompt gives alone
        assert r.completion_ids[b] == generate(model, [p], params).completion_ids[0]
