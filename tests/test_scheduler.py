"""Continuous batching over the paged KV cache: a small budget gives the same tokens and logprobs as an
unbounded one, groups prefill their prompt once, the hashed prefix cache reuses a shared system prompt, and
every block goes back."""
import dataclasses
import hashlib

import pytest
import torch

from framework.errors import FwError
from framework.models import Qwen3ForCausalLM
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
    grown = list(range(40)) + [5] * 30       # a context that grew: only its new full blocks are hashed
    assert block_hashes(grown, 16, a) == block_hashes(grown, 16)
    def digest(prev: bytes, block: list[int]) -> bytes:   # BLAKE2b-128 of the hash before and the int64 tokens
        return hashlib.blake2b(prev + b"".join(t.to_bytes(8, "little", signed=True) for t in block),
                               digest_size=16).digest()

    third = digest(b"k2", grown[32:48])
    assert block_hashes(grown, 16, [b"k1", b"k2"]) == [b"k1", b"k2", third, digest(third, grown[48:64])]
    assert a[0] == digest(b"", list(range(16)))
    assert block_hashes(list(range(20)), 16, a) == a[:1]   # known hashes past the tokens' full blocks go


def test_block_hashes_do_not_collide_where_pythons_hash_does():
    """Python's hash of an int is the int modulo 2**61 - 1, so its hash of a tuple of tokens names two different
    blocks alike; the prefix cache's names tell them apart (a shared name would hand one prompt the other's K/V)."""
    x, y = [5] * 16, [5 + (1 << 61) - 1] + [5] * 15
    assert hash((0, tuple(x))) == hash((0, tuple(y)))
    assert block_hashes(x, 16) != block_hashes(y, 16)


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


def test_admission_batch_holds_back_a_row_that_fits_alone():
    """Four rows run on 8 blocks of 4; the first to finish frees 2 blocks, room for the next waiting row alone. With
    admit_batch 1 it joins at once; with admit_batch 2 it waits while two or more rows run, and joins with the rows
    after it once fewer do."""
    def setup(admit_batch):
        bm = BlockManager(1 + 8, 4)
        rows = [RowState(row=i, prompt=[i + 1] * 5, limit=4) for i in range(5)]   # 2 blocks each
        rows.append(RowState(row=5, prompt=[9] * 5, limit=4))
        sched = Scheduler(rows, bm, max_num_seqs=8, admit_batch=admit_batch)
        assert sched.admit() == rows[:4] and bm.num_free == 0
        sched.finish(rows[0], "length")
        return rows, sched

    rows, sched = setup(1)
    assert sched.admit() == [rows[4]]
    rows, sched = setup(2)
    assert sched.admit() == []                     # 3 rows run; the next two need 4 blocks, 2 are free
    sched.finish(rows[1], "length")
    assert sched.admit() == rows[4:]               # 4 free: both join in one prefill


def test_while_enough_rows_run_admission_waits_for_a_batch():
    """admit_batch 2: a group of two joins once its leader's 3 blocks and its second row's 1 fit together (the
    second shares the leader's full blocks); with no row running, a row joins alone."""
    def setup(admit_batch):
        bm = BlockManager(1 + 8, 4)   # 8 blocks: four rows of 5 + 4 tokens (2 blocks each)
        rows = [RowState(row=i, prompt=[i + 1] * 5, limit=4) for i in range(4)]
        rows += [RowState(row=4 + i, prompt=[9] * 8, limit=4) for i in range(2)]   # a group: 3 blocks, 1 + 2 shared
        rows.append(RowState(row=6, prompt=[7] * 5, limit=4))
        return rows, bm, Scheduler(rows, bm, max_num_seqs=8, admit_batch=admit_batch)

    rows, bm, sched = setup(1)
    assert sched.admit() == rows[:4]
    sched.finish(rows[0], "length")
    assert sched.admit() == []   # the group's leader takes 3 blocks; 2 are free
    rows, bm, sched = setup(2)
    assert sched.admit() == rows[:4] and bm.num_free == 0   # an empty batch admits whatever fits
    sched.finish(rows[0], "length")
    assert sched.admit() == []                               # 3 rows run: the group needs 4 free blocks
    sched.finish(rows[1], "length")
    assert bm.num_free == 4 and sched.admit() == rows[4:6]   # 3 for the leader, 1 for the follower
    assert rows[5].leader is rows[4] and rows[5].blocks[:2] == rows[4].blocks[:2]
    for r in rows[2:6]:
        sched.finish(r, "eos")
    assert sched.admit() == [rows[6]]                        # none run: one row joins alone
    sched.finish(rows[6], "eos")
    assert sched.done and all(n == 0 for n in bm.refs)


def test_a_batch_counts_the_prefix_blocks_its_rows_share_once():
    """admit_batch 2, two rows running: two waiting prompts that share their first two full blocks need 3 + 1 free
    blocks together (the second reuses the first's), as `admit` allocates them; the batch joins with exactly 4 free."""
    bm = BlockManager(1 + 3 * 2 + 3, 4)
    running = [RowState(row=i, prompt=[i + 1] * 5, limit=8) for i in range(3)]   # the longest limits: admitted first
    shared = [9] * 8
    waiting = [RowState(row=3, prompt=shared + [7], limit=4), RowState(row=4, prompt=shared + [8], limit=4)]
    sched = Scheduler(running + waiting, bm, max_num_seqs=8, admit_batch=2)
    assert sched.admit() == running and bm.num_free == 3   # the first waiting row would leave no watermark
    sched.finish(running[0], "length")
    assert bm.num_free == 5 and sched.admit() == waiting
    assert waiting[1].blocks[:2] == waiting[0].blocks[:2] and waiting[1].cached == 8 and bm.num_free == 1


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 8, "top_p": 0.9}])
def test_small_budget_gives_the_unbounded_tokens_and_logprobs(model, tok, sampling):
    """fp32 on CPU: a budget of 4 blocks (2 to 4 rows at a time) and max_num_seqs 3, against an unbounded pool:
    identical tokens and logprobs (the noise is keyed by row and step, never by batch slot)."""
    prompts = [tok.encode(t) for t in ("12+34=", "7=", "hello world, ", "a", "99*9=", "5-3=", "abc")]
    prompts.append(prompts[1])   # a repeated prompt: a group of two in the unbounded run
    params = SamplingParams(max_new_tokens=[12, 9, 12, 5, 12, 12, 7, 12], **sampling)
    eos = [tok.eos_id]
    unbounded = RolloutEngine(model, CacheSettings(kv_cache_gib=None, max_num_seqs=256, block_size=16, admit_batch=8,
                                                   kv_cache_dtype="auto"))
    free = unbounded.generate(prompts, params, seed=3, eos_ids=eos, tokenizer=tok)
    assert unbounded.peak_rows == len(prompts)
    small = RolloutEngine(model, CacheSettings(kv_cache_gib=gib_for_blocks(model, 5.5), max_num_seqs=3,
                                               block_size=16, admit_batch=8, kv_cache_dtype="auto"))
    tight = small.generate(prompts, params, seed=3, eos_ids=eos, tokenizer=tok)
    assert small.cache.num_blocks == 5 and small.peak_rows <= 3
    assert tight.completion_ids == free.completion_ids and tight.finish_reasons == free.finish_reasons
    assert torch.equal(tight.logprobs, free.logprobs)
    assert all(n == 0 for n in small.blocks.refs)


def test_a_group_prefills_its_prompt_once(model, tok):
    prompt = tok.encode("what is 12+34? ")           # 15 tokens: a full block of 8 and a partial one
    engine = RolloutEngine(model, CacheSettings(kv_cache_gib=None, max_num_seqs=64, block_size=8, admit_batch=8,
                                                kv_cache_dtype="auto"))
    group = engine.generate([prompt] * 8, SamplingParams(max_new_tokens=6, temperature=1.0), seed=1)
    assert engine.prefill_tokens == len(prompt)
    assert all(n == 0 for n in engine.blocks.refs)
    assert len({tuple(c) for c in group.completion_ids}) > 1      # the samples still differ
    # each sample is what it would be alone: same row id, same noise, same context
    for b in (0, 5):
        alone = generate(model, [[1]] * b + [prompt], SamplingParams(max_new_tokens=6, temperature=1.0), seed=1)
        assert alone.completion_ids[b] == group.completion_ids[b]
        torch.testing.assert_close(alone.logprobs[b], group.logprobs[b], atol=1e-5, rtol=0)


def test_decode_packs_group_the_rows_that_share_prompt_blocks():
    """Hand-computed, blocks of 8: rows 0, 2 and 5 hold the same two full prompt blocks (a group), row 4 the same
    prompt in other blocks (readmitted after a preemption), row 1 a prompt under one block, row 3 another prompt
    whose first block only is the group's. The batch lists each pack's rows together; every row's shared positions
    are its prompt's full blocks."""
    from framework.rollout.engine import decode_packs

    def row(i, prompt_len, blocks):
        return RowState(row=i, prompt=[7] * prompt_len, limit=4, blocks=blocks)

    rows = [row(5, 20, [3, 4, 12]), row(1, 6, [9]), row(4, 20, [10, 11, 14]), row(0, 20, [3, 4, 8]),
            row(3, 17, [3, 13, 15]), row(2, 20, [3, 4, 16])]
    ordered, packs = decode_packs(rows, 8)
    assert [s.row for s in ordered] == [1, 0, 2, 5, 3, 4]   # by their full prompt blocks: [], [3, 4], [3, 13], ...
    assert packs == [(0, 1, 0), (1, 3, 16), (1, 3, 16), (1, 3, 16), (4, 1, 16), (5, 1, 16)]


@pytest.mark.parametrize("shared", ["0", "1"])
def test_group_results_do_not_depend_on_decoding_with_packs(model, tok, shared, monkeypatch):
    """CPU, float32: a call of repeated prompts decodes its rows in pack order (FW_DECODE_SHARED=1) or as admitted
    (=0): the same tokens and logprobs as each row's prompt generated on its own among unrelated rows."""
    monkeypatch.setenv("FW_DECODE_SHARED", shared)
    prompts = [tok.encode("what is 12+34? "), tok.encode("and 5*6 is "), tok.encode("x")] * 3
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    group = generate(model, prompts, params, seed=4, cache=CacheSettings(
        kv_cache_gib=None, max_num_seqs=64, block_size=4, admit_batch=8, kv_cache_dtype="auto"))
    for b in (1, 4, 8):
        alone = generate(model, [[5 + i] for i in range(b)] + [prompts[b]], params, seed=4)
        assert alone.completion_ids[b] == group.completion_ids[b]
        torch.testing.assert_close(alone.logprobs[b], group.logprobs[b], atol=1e-5, rtol=0)


def test_groups_under_a_budget_that_preempts_give_the_unbounded_results(model, tok):
    """CPU, float32, blocks of 4: two prompts of 3 and 2 full blocks, 4 samples each, decoded in pack order. A pool of
    14 blocks preempts rows of the groups (readmitted into other blocks, so into packs of their own), and every row
    gets the tokens and logprobs of an unbounded pool."""
    prompts = [tok.encode("what is 12+34? "), tok.encode("and 5*6 is ")] * 4
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    free = generate(model, prompts, params, seed=2, cache=CacheSettings(
        kv_cache_gib=None, max_num_seqs=64, block_size=4, admit_batch=8, kv_cache_dtype="auto"))
    engine = RolloutEngine(model, CacheSettings(kv_cache_gib=gib_for_blocks(model, 14.5, 4), max_num_seqs=64,
                                                block_size=4, admit_batch=8, kv_cache_dtype="auto"))
    tight = engine.generate(prompts, params, seed=2)
    assert engine.cache.num_blocks == 14 and engine.preemptions > 0
    assert tight.completion_ids == free.completion_ids and torch.equal(tight.logprobs, free.logprobs)
    assert all(n == 0 for n in engine.blocks.refs)


def test_prefix_cache_reuses_a_shared_system_prompt(model, tok):
    system = tok.encode("You are a careful calculator. Answer with digits only. ")   # 55 tokens
    questions = [tok.encode(q) for q in ("1+1=", "22*3=", "9-4=")]
    prompts = [system + q for q in questions]
    engine = RolloutEngine(model, CacheSettings(kv_cache_gib=gib_for_blocks(model, 7.5), max_num_seqs=1,
                                                block_size=16, admit_batch=8, kv_cache_dtype="auto"))
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    r = engine.generate(prompts, params)
    full_blocks = len(system) // 16
    # one row at a time: the first computes its whole prompt, the others only past the shared full blocks
    assert engine.prefill_tokens == sum(map(len, prompts)) - 2 * full_blocks * 16
    assert all(n == 0 for n in engine.blocks.refs)
    for b, p in enumerate(prompts):   # and they generate what each prompt gives alone
        assert r.completion_ids[b] == generate(model, [p], params).completion_ids[0]


def test_lazy_admission_runs_more_rows_than_reserving(model):
    """Hand-computed, blocks of 4: six rows of 4 prompt + 8 new tokens may each use blocks_for(4, 8) = 3
    blocks (positions 0..10), so a pool of 12 usable blocks held 4 such rows when admission reserved them.
    Lazily, a row is admitted with 2 blocks (its prompt and its first sampled token, positions 0..4), keeping
    1 free block (the watermark, at least one block) while the running rows may still grow: 12 -> 10 -> 8 ->
    6 -> 4 -> 2, five rows, and the sixth waits (2 < 2 + 1). All five cross into their third block at the
    same step (position 8): two free blocks go to rows 0 and 1, row 2 preempts row 4, the newest, whose two
    blocks go to rows 2 and 3. Rows 4 and 5 run once the first four end: 5 rows at most, 1 preemption."""
    assert blocks_for(4, 8, 4) == 3 and 12 // blocks_for(4, 8, 4) == 4   # what reserving admitted
    prompts = [[3 + i, 4, 5, 6] for i in range(6)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    engine = RolloutEngine(model, CacheSettings(kv_cache_gib=gib_for_blocks(model, 13.5, 4), max_num_seqs=8,
                                                block_size=4, admit_batch=8, kv_cache_dtype="auto"))
    lazy = engine.generate(prompts, params, seed=2)
    assert engine.cache.num_blocks == 13
    assert engine.peak_rows == 5 and engine.preemptions == 1
    free = generate(model, prompts, params, seed=2)
    assert lazy.completion_ids == free.completion_ids and torch.equal(lazy.logprobs, free.logprobs)
    assert all(n == 0 for n in engine.blocks.refs) and engine.blocks.num_free == 12


def test_preemption_takes_the_newest_row_to_the_front():
    """Rows of 3 prompt tokens, blocks of 4: each is admitted with one block (positions 0..3). When all of them
    cross into their second block, the oldest rows get the free blocks and the newest running rows go back,
    to the front of the queue in their admission order, keeping their tokens; one ended by its token in
    flight leaves the queue instead of coming back; one with a token in flight waits for it."""
    bm = BlockManager(7, 4)   # 6 usable blocks
    rows = [RowState(row=i, prompt=[i + 1] * 3, limit=10) for i in range(6)]
    sched = Scheduler(rows, bm, max_num_seqs=8)
    assert sched.admit() == rows[:5] and bm.num_free == 1   # 6 -> 1 (the sixth would leave no watermark)
    for r in rows[:5]:   # the first sampled token received, the second in flight: its write is at position 4
        r.tokens, r.logprobs, r.issued = [9], [-0.5], 2
    decoding, changed = sched.grow(rows[:5])
    assert decoding == rows[:3] and sched.running == rows[:3] and sched.preemptions == 2
    assert list(sched.waiting) == [rows[3], rows[4], rows[5]]   # row 4 went first, row 3 in front of it
    assert [(r, i) for r, i, _ in changed] == [(0, 1), (1, 1), (2, 1)]
    assert [b for *_, b in changed] == [r.blocks[1] for r in rows[:3]]
    assert rows[3].blocks == [] and rows[3].tokens == [9] and rows[3].logprobs == [-0.5]
    assert bm.num_free == 0 and sorted(b for r in rows[:3] for b in r.blocks) == list(range(1, 7))
    sched.finish(rows[4], "eos")            # its token in flight was EOS: it is not resurrected
    assert list(sched.waiting) == [rows[3], rows[5]] and rows[4].reason == "eos"
    for r in rows[:3]:
        sched.finish(r, "length")
    assert sched.admit() == []              # row 3's second token is still on its way
    rows[3].tokens.append(8)
    rows[3].logprobs.append(-1.0)
    assert sched.admit() == [rows[3], rows[5]]
    assert len(rows[3].blocks) == 2 and rows[3].room == 2 * 4 - 3   # context 5 and its next write: 2 blocks
    for r in (rows[3], rows[5]):
        sched.finish(r, "length")
    assert sched.done and all(n == 0 for n in bm.refs) and bm.num_free == 6


def test_rollout_schedule_counts_the_real_scheduler():
    """benchmarks.rollout_schedule on a small pool: reserving each row's limit (a watermark past the pool)
    never preempts; lazy admission runs more rows a step in fewer steps, and a wider watermark preempts less."""
    from benchmarks.rollout_schedule import main

    reserve, tight, wide = main(["--preset", "tiny", "--num-seqs", "48", "--lo", "8", "--hi", "64",
                                 "--kv-cache-gib", "0.0005", "--watermarks", "1e9", "0.0", "0.3"])
    assert reserve["preemptions"] == 0 and tight["preemptions"] > 0
    assert tight["rows_a_step"] > reserve["rows_a_step"] and tight["steps"] < reserve["steps"]
    assert wide["preemptions"] <= tight["preemptions"]
    assert "estimate_s" not in reserve   # no assumed costs given: counts only


def test_admission_starts_the_longest_limits_first():
    """The waiting queue runs by limit, longest first, rows of equal limits in their given order; a preempted
    row still goes back to its front. With room for two rows: the two 9-token rows (in row order), then the
    4-token row once one leaves, then the 2-token row."""
    rows = [RowState(row=i, prompt=[1, 2, 3], limit=n) for i, n in enumerate([4, 9, 9, 2])]
    sched = Scheduler(rows, BlockManager(64, 4), max_num_seqs=2)
    assert sched.admit() == [rows[1], rows[2]]
    sched.finish(rows[2], "eos")
    assert sched.admit() == [rows[0]]
    sched.preempt(rows[0])
    assert list(sched.waiting) == [rows[0], rows[3]]
    sched.finish(rows[1], "length")
    assert sched.admit() == [rows[0], rows[3]]


def test_reserving_whole_limits_never_preempts():
    """A watermark past the pool admits a row only while every running row, and the row itself, can grow to
    its limit: decoding every row to its limit then never needs a preemption (limits of every length, the
    longest first)."""
    bs = 4
    rows = [RowState(row=i, prompt=[7] * (1 + i % 5), limit=1 + (7 * i) % 23) for i in range(30)]
    sched = Scheduler(rows, BlockManager(16, bs), max_num_seqs=256)
    sched.watermark = 10**9
    while not sched.done:
        for r in sched.admit():
            r.issued += 1
            r.tokens.append(0)
            if len(r.tokens) >= r.limit:
                sched.finish(r, "length")
        running = [r for r in sched.running if r.issued < r.limit]
        if running:
            sched.grow(running)
            for r in running:
                r.issued += 1
                r.tokens.append(0)
                if len(r.tokens) >= r.limit:
                    sched.finish(r, "length")
        assert sum(len(r.blocks) for r in sched.running) <= 15
    assert sched.preemptions == 0


def test_a_diverged_rows_blocks_do_not_reach_the_row_that_takes_them(model):
    """fp32 on CPU: token 50's embedding is NaN (its LM-head row is not), so the keys/values of the first row, whose
    prompt ends on it, are NaN at that position. A pool of one usable block runs the rows one after the other, the
    second in the block the first wrote: it gets the unbounded pool's finite tokens and logprobs."""
    untied = Qwen3ForCausalLM(dataclasses.replace(model.config, tie_word_embeddings=False))
    weights = model.state_dict()
    untied.load_state_dict({**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()})
    with torch.no_grad():
        untied.model.embed_tokens.weight[50] = float("nan")
    prompts = [[20, 21, 22, 23, 24, 25, 26, 50], [30, 31, 32]]
    params = SamplingParams(max_new_tokens=[6, 4], temperature=1.0)
    free = generate(untied.eval(), prompts, params, seed=1)
    engine = RolloutEngine(untied, CacheSettings(kv_cache_gib=gib_for_blocks(model, 2.5), max_num_seqs=8,
                                                 block_size=16, admit_batch=8, kv_cache_dtype="auto"))
    tight = engine.generate(prompts, params, seed=1)
    assert engine.cache.num_blocks == 2 and engine.peak_rows == 1
    assert free.logprobs[1].isfinite().all()
    assert tight.completion_ids == free.completion_ids
    assert torch.equal(tight.logprobs[1], free.logprobs[1])
