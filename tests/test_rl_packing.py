"""Packed RL micro-batches (recipes/rl.py `response_layout`) in float64: the logprobs, entropies, values,
GRPO and PPO losses and their gradients equal the right-padded path's, and each sequence run alone."""
import pytest
import torch

from framework.config import resolve
from framework.models import Qwen3ForCausalLM, Qwen3ValueModel
from framework.models.qwen3_config import Qwen3Config
from recipes.losses import ClippedValueLoss, build_policy_loss
from recipes.rl import completion_logprobs, completion_values, response_layout

VOCAB = 61
TEMPERATURE = 0.8


def tiny_policy(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config.from_hf({
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return model.double()


def value_model(policy: Qwen3ForCausalLM) -> Qwen3ValueModel:
    """A critic on the policy's float64 trunk with a random head (its float32 head is zero at the start)."""
    critic = Qwen3ValueModel.from_policy(policy)
    with torch.no_grad():
        critic.v_head.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))
    return critic


def rollout_batch(seed: int = 0):
    """Rows of varied prompt and completion lengths (an empty completion, a full-width one), right-padded with
    random tokens that neither path may read."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.tensor([3, 9, 1, 5, 7, 4])
    completion_lens = torch.tensor([8, 0, 5, 1, 3, 8])
    width = 8
    tokens = torch.randint(0, VOCAB, (6, 9 + width + 3), generator=g)
    return tokens, prompt_lens, completion_lens, width


def alone_logprobs(model, tokens, prompt_lens, completion_lens, width):
    """Independent reference: each sequence alone, a full float64 log-softmax of its logits."""
    out = torch.zeros(tokens.shape[0], width, dtype=torch.float64)
    ent = torch.zeros_like(out)
    for b in range(tokens.shape[0]):
        p, c = int(prompt_lens[b]), int(completion_lens[b])
        logp = torch.log_softmax(model(tokens[b:b + 1, :p + c])[0] / TEMPERATURE, -1)
        for j in range(c):
            out[b, j] = logp[p + j - 1, tokens[b, p + j]]
            ent[b, j] = -(logp[p + j - 1].exp() * logp[p + j - 1]).sum()
    return out, ent


def test_layout_packs_the_sequences_end_to_end():
    tokens, prompt_lens, completion_lens, width = rollout_batch()
    x = response_layout(tokens, prompt_lens, completion_lens, width)
    lens = (prompt_lens + completion_lens).tolist()
    assert x.input_ids.shape == (1, sum(lens))   # no pad token computed
    assert x.position_ids[0].tolist() == [i for n in lens for i in range(n)]
    expected = torch.cat([tokens[b, :n] for b, n in enumerate(lens)])
    assert torch.equal(x.input_ids[0], expected)
    # the state before each completion token is the token before it in the packed row
    assert torch.equal(x.input_ids[0, x.source + 1], x.targets)
    assert torch.equal(x.targets, tokens[x.rows, prompt_lens[x.rows] + x.cols])


def test_packed_logprobs_and_values_equal_padded_and_alone():
    model = tiny_policy(1)
    tokens, prompt_lens, completion_lens, width = rollout_batch()
    with torch.no_grad():
        packed, ent_p = completion_logprobs(model, tokens, prompt_lens, completion_lens, width, TEMPERATURE, True)
        padded, ent_d = completion_logprobs(model, tokens, prompt_lens, completion_lens, width, TEMPERATURE, True,
                                            packed=False)
        alone, ent_a = alone_logprobs(model, tokens, prompt_lens, completion_lens, width)
    assert packed.dtype == torch.float64 and packed.abs().max() > 0.5
    assert torch.equal(packed == 0, padded == 0) and (packed[1] == 0).all()
    assert (packed - padded).abs().max() <= 1e-12 and (ent_p - ent_d).abs().max() <= 1e-12
    assert (packed - alone).abs().max() <= 1e-12 and (ent_p - ent_a).abs().max() <= 1e-12
    critic = value_model(model)
    with torch.no_grad():
        v_packed = completion_values(critic, tokens, prompt_lens, completion_lens, width)
        v_padded = completion_values(critic, tokens, prompt_lens, completion_lens, width, packed=False)
        hidden = [critic(tokens[b:b + 1, :int(prompt_lens[b] + completion_lens[b])])[0] for b in range(6)]
    # the float64 critic's values, which the rollout keeps in float32: equal to float32 rounding
    assert v_packed.dtype == torch.float32 and hidden[0].dtype == torch.float64
    assert v_packed.abs().max() > 0.1 and (v_packed - v_padded).abs().max() <= 1e-6
    for b in range(6):
        p, c = int(prompt_lens[b]), int(completion_lens[b])
        assert torch.allclose(v_packed[b, :c], hidden[b][p - 1:p + c - 1].float(), rtol=0, atol=1e-6)
        assert (v_packed[b, c:] == 0).all()


def assert_same_gradients(grads, want) -> None:
    """Every gradient equals the padded layout's `want` (float64), and `want` is not all zero."""
    assert max(b.abs().max() for b in want) > 1e-3
    for a, b in zip(grads, want, strict=True):
        assert (a - b).abs().max() <= 1e-10 * max(1.0, b.abs().max())


def _grads(loss, model):
    return torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("recipe,loss_agg", [("grpo", "token-mean"), ("grpo", "seq-mean-token-sum-norm"),
                                             ("ppo", "seq-mean-token-mean")])
def test_losses_and_gradients_equal_the_padded_path(recipe, loss_agg):
    """The recipe's policy loss (and PPO's clipped value loss) on packed vs padded micro-batches, float64
    model: equal losses and equal gradients of every parameter."""
    section = resolve({"recipe": recipe, "model": {"policy": {"preset": "tiny"}},
                       recipe: {"loss_agg": loss_agg, "clip_eps_low": 0.05, "clip_eps_high": 0.05}})[recipe]
    tokens, prompt_lens, completion_lens, width = rollout_batch(2)
    mask = (torch.arange(width)[None, :] < completion_lens[:, None]).float()
    g = torch.Generator().manual_seed(3)
    model = tiny_policy(4)
    with torch.no_grad():
        ref, _ = completion_logprobs(model, tokens, prompt_lens, completion_lens, width, TEMPERATURE)
    old_logp = (ref + 0.1 * torch.randn(ref.shape, generator=g)) * mask   # some ratios clipped
    adv = torch.randn(ref.shape, generator=g) if recipe == "ppo" else torch.randn(6, generator=g)
    policy_loss = build_policy_loss(section, width)
    results = []
    for packed in (True, False):
        logp, _ = completion_logprobs(model, tokens, prompt_lens, completion_lens, width, TEMPERATURE, packed=packed)
        pl = policy_loss(logp, old_logp, adv, mask)
        results.append((pl.loss.detach(), pl.clip_frac, _grads(pl.loss, model)))
    (loss_p, clip_p, grads_p), (loss_d, clip_d, grads_d) = results
    assert 0 < float(clip_p) < 1 and clip_p == clip_d
    assert abs(loss_p.item() - loss_d.item()) <= 1e-12
    assert_same_gradients(grads_p, grads_d)
    if recipe != "ppo":
        return
    critic = value_model(model)
    value_loss = ClippedValueLoss.from_section(section, width)
    returns = torch.randn(ref.shape, generator=g) * mask
    with torch.no_grad():
        old_values = completion_values(critic, tokens, prompt_lens, completion_lens, width)
    out = []
    for packed in (True, False):
        values = completion_values(critic, tokens, prompt_lens, completion_lens, width, packed=packed)
        vl = value_loss(values, old_values + 0.3 * mask, returns, mask)
        out.append((vl.loss.detach(), _grads(vl.loss, critic)))
    assert abs(float(out[0][0]) - float(out[1][0])) <= 1e-6
    for a, b in zip(out[0][1], out[1][1], strict=True):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max())


def test_layout_bounds_come_from_the_host_lengths():
    """The packed layout hands the model the sequence bounds: cu_seqlens by hand from the lengths, and
    what ops_cuda.packed_sequences finds from the positions."""
    import ops_cuda

    tokens, prompt_lens, completion_lens, width = rollout_batch()
    x = response_layout(tokens, prompt_lens, completion_lens, width, packed=True)
    lens = [3 + 8, 9 + 0, 1 + 5, 5 + 1, 7 + 3, 4 + 8]
    bounds = [sum(lens[:i]) for i in range(len(lens) + 1)]
    assert x.packing.cu_seqlens.dtype == torch.int32 and x.packing.cu_seqlens.tolist() == bounds
    assert x.packing.max_seqlen == max(lens)
    cu, longest = ops_cuda.packed_sequences(x.position_ids)
    assert torch.equal(cu, x.packing.cu_seqlens) and longest == x.packing.max_seqlen


def test_packing_only_when_it_removes_tokens():
    """packed=None pads rows that are all as long as the longest (packing removes nothing) and packs
    rows of varied lengths; the logprobs are the same either way."""
    from recipes.rl import PACK_MIN_SAVING, packs

    model = tiny_policy(2)
    tokens, _, _, width = rollout_batch(1)
    prompt_lens, completion_lens = torch.tensor([4, 6, 2]), torch.tensor([6, 4, 8])   # all 10 tokens
    x = response_layout(tokens[:3], prompt_lens, completion_lens, width, packed=None)
    assert x.position_ids is None and x.packing is None and x.input_ids.shape == (3, 10)
    with torch.no_grad():
        auto, _ = completion_logprobs(model, tokens[:3], prompt_lens, completion_lens, width, TEMPERATURE)
        packed, _ = completion_logprobs(model, tokens[:3], prompt_lens, completion_lens, width, TEMPERATURE,
                                        packed=True)
    assert auto.abs().max() > 0.5 and (auto - packed).abs().max() <= 1e-12
    # 3 rows padded to 10 = 30 tokens: packing k of them removes (30 - k) / 30
    assert 0 < PACK_MIN_SAVING < 0.5
    for k in range(22, 31):
        completions = torch.tensor([6, 4, 8 - (30 - k)])
        assert packs(prompt_lens, completions) == ((30 - k) / 30 >= PACK_MIN_SAVING), k
    assert not packs(prompt_lens, completion_lens, packed=None)
    assert not packs(prompt_lens, torch.tensor([6, 4, 1]), packed=False) and packs(prompt_lens, completion_lens, True)


def test_forward_with_packing_equals_forward_from_positions():
    from framework.errors import FwError

    model = tiny_policy(3)
    tokens, prompt_lens, completion_lens, width = rollout_batch(4)
    x = response_layout(tokens, prompt_lens, completion_lens, width, packed=True)
    with torch.no_grad():
        given = model(x.input_ids, position_ids=x.position_ids, packing=x.packing)
        found = model(x.input_ids, position_ids=x.position_ids)
    assert given.abs().max() > 0.1 and torch.equal(given, found)
    with pytest.raises(FwError, match="packing needs the position_ids"):
        model(x.input_ids, packing=x.packing)


def test_balanced_split_evens_the_tokens_under_the_row_cap():
    from recipes.rl import balanced_split

    lengths = torch.tensor([10, 90, 20, 80, 30, 70, 40, 60, 50, 5])
    rows = torch.tensor([9, 0, 8, 1, 7, 2, 6, 3, 5, 4])   # a shuffled minibatch
    parts = balanced_split(rows, lengths, 3)
    # longest first, each to the lightest part with room (at most 4 rows):
    # 90->A 80->B 70->C 60->C(130) 50->B(130) 40->A(130) 30->A(160) 20->B(150) 10->C(140) 5->C(145)
    assert [sorted(int(lengths[r]) for r in p) for p in parts] == [[30, 40, 90], [20, 50, 80], [5, 10, 60, 70]]
    assert sorted(torch.cat(parts).tolist()) == list(range(10))
    # each part keeps the minibatch's (shuffled) order
    for p in parts:
        order = [rows.tolist().index(r) for r in p.tolist()]
        assert order == sorted(order)
    # equal lengths: the row counts of tensor_split (ceil, then floor)
    assert [len(p) for p in balanced_split(torch.arange(10), torch.full((10,), 7), 4)] == [3, 3, 2, 2]


def test_aggregate_weights_read_once_equal_hand_shares():
    from recipes.losses import aggregate_weight, aggregate_weights

    full = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    micro = [full[:1], full[1:3], full[3:]]
    assert aggregate_weights(micro, full, "token-mean") == [2 / 6, 4 / 6, 0.0]
    assert aggregate_weights(micro, full, "token-mean", full_count=8.0) == [2 / 8, 4 / 8, 0.0]
    # seq-mean-token-mean counts the completions left in the loss (the last row has no token in it)
    assert aggregate_weights(micro, full, "seq-mean-token-mean") == [1 / 3, 2 / 3, 0.0]
    assert aggregate_weights(micro, full, "seq-mean-token-sum-norm") == [1 / 4, 2 / 4, 1 / 4]
    assert [aggregate_weight(m, full, "token-mean") for m in micro] == [2 / 6, 4 / 6, 0.0]


@pytest.mark.gpu
def test_packed_forward_does_not_sync_the_device():
    """Layout from host lengths, packed forward, fused logprobs and the scatter back to [B, width], under
    CUDA's sync debug mode set to error: any device->host sync raises."""
    model = tiny_policy(5).float().cuda()
    tokens, prompt_lens, completion_lens, width = rollout_batch(6)
    tokens = tokens.cuda()

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return completion_logprobs(model, tokens, prompt_lens, completion_lens, width, TEMPERATURE,
                                       with_entropy=True, packed=True)

    expected, _ = run()   # the first CUDA call builds and loads the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logp, _ = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (logp - expected).abs().max() <= 1e-6 and expected.abs().max() > 0.5
