"""The rollout engine's host side where the randomized test rarely goes: a call that raises part-way (in the stop
check, or a KeyboardInterrupt in the forward) leaves an engine whose next call is a fresh engine's; the prefix cache
never serves keys/values of the weights before an update; rows of a group preempted together are readmitted as a
group, the second one reading the first one's prefill. A row whose prompt alone does not fit the pool is refused
without asking for a lower new-token limit."""
import pytest
import torch
from conftest import peaked_tiny_model

from framework.errors import FwError
from framework.models import Qwen3ForCausalLM
from framework.rollout import CacheSettings, RolloutEngine, SamplingParams, generate
from framework.rollout import scheduler as scheduler_module
from framework.rollout.kv_cache import block_bytes
from framework.rollout.scheduler import RowTooLong


def settings(model, blocks=None, block_size=4, admit_batch=1):
    """`blocks` blocks of `block_size` positions (None: unbounded), fp32 pool."""
    gib = None if blocks is None else (blocks + 0.5) * block_bytes(model.config, torch.float32, block_size) / (1 << 30)
    return CacheSettings(kv_cache_gib=gib, max_num_seqs=256, block_size=block_size, admit_batch=admit_batch,
                         kv_cache_dtype="auto")


def all_free(engine) -> bool:
    bm = engine.blocks
    return all(n == 0 for n in bm.refs) and bm.num_free == bm.num_blocks - 1


def same(a, b) -> bool:
    return (a.completion_ids == b.completion_ids and a.finish_reasons == b.finish_reasons
            and torch.equal(a.logprobs, b.logprobs) and a.texts == b.texts)


class FailingTokenizer:
    """The built-in tokenizer, whose `decode` raises at its `fail_at`-th call (the stop check decodes each new
    token's window)."""

    def __init__(self, tok, fail_at: int) -> None:
        self.tok, self.fail_at, self.calls = tok, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("tokenizer failed")
        return self.tok.decode(ids)


@pytest.fixture
def workload(tok):
    """Prompts sharing full blocks of 4 (a group of three, a prompt on the group's first two blocks, others), limits
    per row, a stop string no row produces (so the stop check runs at every token)."""
    group = tok.encode("what is 12+34? ")   # 15 tokens: three full blocks and a partial one
    prompts = [group] * 3 + [group[:8] + tok.encode("5*5=")] + [tok.encode(t) for t in ("7=", "hello world, ")]
    return prompts, SamplingParams(max_new_tokens=[14, 14, 10, 14, 6, 14], temperature=1.0, stop=("\x01",))


@pytest.mark.parametrize("where", ["stop check", "forward"])
def test_a_call_that_raises_part_way_leaves_an_engine_whose_next_call_is_fresh(tok, workload, where):
    """A tight pool (rows preempted, blocks shared by the group and cached) and a call that fails part-way: the
    tokenizer raising in the stop check, or the model's forward raising KeyboardInterrupt. The error reaches the
    caller, the model gets its training mode back, and the engine's next call gives a fresh engine's results with
    every block back (a block still counted for the dead call would shrink the pool, or be freed twice)."""
    prompts, params = workload
    model = peaked_tiny_model(tok)
    fresh = generate(model, prompts, params, seed=7, tokenizer=tok, cache=settings(model))
    engine = RolloutEngine(model, settings(model, blocks=14))
    forwards = []
    if where == "forward":
        def forward_paged(tokens, batch, cache, last):
            forwards.append(len(tokens))
            if len(forwards) == 12:
                raise KeyboardInterrupt
            return Qwen3ForCausalLM.forward_paged(model, tokens, batch, cache, last)

        model.forward_paged = forward_paged
        failing, error = tok, KeyboardInterrupt
    else:
        failing, error = FailingTokenizer(tok, fail_at=30), RuntimeError
    model.train()
    with pytest.raises(error):
        engine.generate(prompts, params, seed=7, tokenizer=failing)
    assert model.training and engine.preemptions > 0   # it failed after rows were preempted
    if where == "forward":
        del model.forward_paged
    again = engine.generate(prompts, params, seed=7, tokenizer=tok)
    assert same(again, fresh) and all_free(engine)


def test_the_prefix_cache_never_serves_keys_and_values_of_old_weights(tok, workload):
    """A kept engine whose prompts share full blocks (prefix-cache hits, a group), called, then the weights change
    in place (an optimizer step): its next call gives a fresh engine's results on the new weights, not keys/values
    of the old ones found under the same prefix hashes; so does a call after release()."""
    prompts, params = workload
    model = peaked_tiny_model(tok)
    engine = RolloutEngine(model, settings(model, blocks=14))
    before = engine.generate(prompts, params, seed=3, tokenizer=tok)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    fresh = generate(model, prompts, params, seed=3, tokenizer=tok, cache=settings(model))
    assert not same(before, fresh)
    after = engine.generate(prompts, params, seed=3, tokenizer=tok)
    assert same(after, fresh) and all_free(engine)
    engine.release()
    assert same(engine.generate(prompts, params, seed=3, tokenizer=tok), fresh) and all_free(engine)


def test_group_rows_preempted_together_are_readmitted_as_a_group(tok, monkeypatch):
    """Greedy, blocks of 4, a pool of 10, a group of three 6-token prompts and two longer rows admitted before it. At
    the step row 1 and the group cross into their third block one block is free: row 1 takes it, the group's leader
    the one its newest row gives back, and its second row preempts itself, so the group's two newest rows wait with
    the same tokens. Readmitted together, the second is the first one's follower: it takes the first's full blocks
    and a copy of its partial last block (context 6 + 3 tokens) and draws from its prefill's logits. Every row gets
    the unbounded pool's tokens and logprobs."""
    followers = []
    admit = scheduler_module.Scheduler.admit

    def logged(self):
        new = admit(self)
        followers.extend((s.row, s.leader.row, len(s.tokens)) for s in new if s.leader is not None and s.tokens)
        return new

    monkeypatch.setattr(scheduler_module.Scheduler, "admit", logged)
    model = peaked_tiny_model(tok)
    prompts = [tok.encode("Q: 9*"), tok.encode("hello ")] + [tok.encode("abcdef")] * 3
    params = SamplingParams(max_new_tokens=[30, 29, 12, 12, 12], temperature=0.0)
    free = generate(model, prompts, params, cache=settings(model))
    engine = RolloutEngine(model, settings(model, blocks=10))
    tight = engine.generate(prompts, params)
    assert engine.cache.num_blocks == 10 and engine.preemptions > 0
    assert followers == [(4, 3, 3)]
    assert tight.completion_ids == free.completion_ids and torch.equal(tight.logprobs, free.logprobs)
    assert all_free(engine)


def test_a_rollout_hands_each_module_its_own_training_mode_back(tok):
    """The engine samples in eval mode and gives every module its own flag back: a layer the user keeps in eval
    mode inside a training policy stays in eval mode (model.train() would flip it)."""
    model = peaked_tiny_model(tok).train()
    kept = model.model.layers[0]
    kept.eval()
    seen = []
    plain = Qwen3ForCausalLM.forward_paged

    def forward_paged(tokens, batch, cache, last):
        seen.append(model.training or any(m.training for m in model.modules()))
        return plain(model, tokens, batch, cache, last)

    model.forward_paged = forward_paged
    generate(model, [tok.encode("7=")], SamplingParams(max_new_tokens=3, temperature=1.0), tokenizer=tok,
             cache=settings(model))
    assert seen and not any(seen)
    assert model.training and not any(m.training for m in kept.modules())
    assert all(m.training for m in model.modules() if not any(m is k for k in kept.modules()))


def test_a_prompt_the_pool_cannot_hold_is_not_blamed_on_the_new_token_limit(tok):
    """Blocks of 4, a pool holding 2 besides the scratch block. A 12-token prompt fills 3 blocks before its first
    new token: no max_new_tokens fits it, so the refusal asks only for a larger budget (fw plan says "not even the
    prompt fits" for it too). Beside a short prompt with a long limit, which needs more blocks, the refusal names
    the prompt that no limit can fit; the limit still names the setting it came from (eval.max_new_tokens)."""
    model = peaked_tiny_model(tok)
    long, short = [5] * 12, [6] * 2
    one = SamplingParams(max_new_tokens=1, temperature=1.0)
    with pytest.raises(RowTooLong) as alone:
        generate(model, [long], one, cache=settings(model, blocks=3))
    assert str(alone.value) == ("rollout: one row of 12 prompt + 1 new tokens needs 3 KV blocks of 4 positions, the "
                                "cache holds 2, and not even its prompt fits, whatever rollout.max_new_tokens: raise "
                                "rollout.kv_cache_gib")
    mixed = SamplingParams(max_new_tokens=[1, 30], temperature=1.0)
    with pytest.raises(RowTooLong) as beside:
        generate(model, [long, short], mixed, cache=settings(model, blocks=3))
    assert str(beside.value) == str(alone.value)
    assert str(beside.value.for_key("eval.max_new_tokens")).endswith(
        "whatever eval.max_new_tokens: raise rollout.kv_cache_gib")
    # a prompt that fits, with a limit that does not: lowering the limit is the other way out
    with pytest.raises(RowTooLong, match=r"^rollout: one row of 2 prompt \+ 30 new tokens needs 8 KV blocks of 4 "
                                         r"positions, the cache holds 2: raise rollout.kv_cache_gib or lower "
                                         r"rollout.max_new_tokens$"):
        generate(model, [short], SamplingParams(max_new_tokens=30, temperature=1.0), cache=settings(model, blocks=3))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_row_keys_key_the_noise_instead_of_the_row_index(tok, device):
    """Without keys a row's noise is its index's, so keys 0..n-1 change nothing, and other keys draw otherwise. On
    CPU in fp32, rows named by the same key draw the same tokens and logprobs in calls of other rows, orders and
    budgets (on CUDA the kernels of other batch sizes round otherwise, so that is not asked there)."""
    model = peaked_tiny_model(tok).to(device)
    prompts = [tok.encode(p) for p in ("12+3=", "7*8=", "99-4=", "1=")]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    plain = generate(model, prompts, params, seed=3, cache=settings(model))
    assert same(plain, generate(model, prompts, params, seed=3, cache=settings(model), row_keys=[0, 1, 2, 3]))
    keys = [40, 7, 2**62, 5]
    keyed = generate(model, prompts, params, seed=3, cache=settings(model), row_keys=keys)
    assert keyed.completion_ids != plain.completion_ids
    if device == "cuda":
        return
    order = [3, 0, 2]
    part = generate(model, [prompts[i] for i in order], params, seed=3, cache=settings(model, blocks=5),
                    row_keys=[keys[i] for i in order])
    for j, i in enumerate(order):
        assert part.completion_ids[j] == keyed.completion_ids[i]
        n = len(keyed.completion_ids[i])
        assert torch.equal(part.logprobs[j, :n], keyed.logprobs[i, :n])
    engine = RolloutEngine(model, settings(model))
    try:
        for bad, message in (([1, 2], "generate: 2 row keys for 4 prompts"),
                             ([0, 1, 2, -1], r"generate: row keys must be ints in \[0, 2\*\*63\)"),
                             ([0, 1, 2, True], r"generate: row keys must be ints")):
            with pytest.raises(FwError, match=message):
                engine.generate(prompts, params, seed=3, row_keys=bad)
    finally:
        engine.release()
