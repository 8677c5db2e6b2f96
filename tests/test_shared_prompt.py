"""The update with each group's prompt laid out once (`grpo.shared_prompt` / `ppo.shared_prompt`,
recipes/rl.py `shared_prompt_layout`): in float64 its logprobs, entropies, values, losses and gradients equal those
of every sequence run alone and of the right-padded layout; a fit with it trains like one without."""
import math

import pytest
import torch
from test_grpo import TIMING, config
from test_ppo import config as ppo_config
from test_rl_packing import (
    TEMPERATURE,
    VOCAB,
    _grads,
    alone_logprobs,
    assert_same_gradients,
    tiny_policy,
    value_model,
)

from framework.config import resolve
from framework.errors import FwError
from framework.metrics import read_metrics
from framework.trainer import fit
from recipes.losses import ClippedValueLoss, build_policy_loss
from recipes.rl import completion_logprobs, completion_values, response_layout

PROMPTS = {0: 5, 1: 2, 2: 7}                 # group -> prompt length
GROUPS = torch.tensor([2, 0, 1, 2, 0, 2, 1, 0, 2])   # a micro-batch's rows, groups interleaved
COMPLETIONS = torch.tensor([8, 3, 0, 1, 6, 8, 2, 5, 4])   # an empty completion, full-width ones
WIDTH = 8


def grouped_batch(seed: int = 0):
    """Rows whose group's prompt tokens are the same, completions of their own, right-padded with random tokens
    that no layout may read."""
    g = torch.Generator().manual_seed(seed)
    prompts = {k: torch.randint(0, VOCAB, (n,), generator=g) for k, n in PROMPTS.items()}
    prompt_lens = torch.tensor([PROMPTS[int(k)] for k in GROUPS])
    tokens = torch.randint(0, VOCAB, (len(GROUPS), max(PROMPTS.values()) + WIDTH + 2), generator=g)
    for b, k in enumerate(GROUPS.tolist()):
        tokens[b, :PROMPTS[k]] = prompts[k]
    return tokens, prompt_lens, COMPLETIONS.clone()


def test_layout_holds_each_prompt_once_then_the_completions():
    tokens, prompt_lens, completion_lens = grouped_batch()
    x = response_layout(tokens, prompt_lens, completion_lens, WIDTH, groups=GROUPS)
    n = sum(PROMPTS.values())
    assert x.packing.prompt_tokens == n and x.input_ids.shape == (1, n + int(completion_lens.sum()))
    # the prompts in group order, each from one of its rows, positions from 0
    first = {k: GROUPS.tolist().index(k) for k in PROMPTS}
    assert torch.equal(x.input_ids[0, :n], torch.cat([tokens[first[k], :PROMPTS[k]] for k in sorted(PROMPTS)]))
    assert x.position_ids[0, :n].tolist() == [i for k in sorted(PROMPTS) for i in range(PROMPTS[k])]
    # then the completions group after group, a group's rows in batch order, each at its own positions
    order = sorted(range(len(GROUPS)), key=lambda b: (int(GROUPS[b]), b))
    lens = completion_lens.tolist()
    own = torch.cat([tokens[b, prompt_lens[b]:prompt_lens[b] + lens[b]] for b in order])
    assert torch.equal(x.input_ids[0, n:], own)
    assert x.position_ids[0, n:].tolist() == [int(prompt_lens[b]) + j for b in order for j in range(lens[b])]
    # each completion token is predicted from the token before it in its own sequence
    assert torch.equal(x.targets, tokens[x.rows, prompt_lens[x.rows] + x.cols])
    assert torch.equal(x.input_ids[0, x.source], tokens[x.rows, prompt_lens[x.rows] + x.cols - 1])
    # the attention's spans: group g's completion tokens, and each prompt and non-empty completion (an empty one is
    # none)
    per_group = [sum(lens[b] for b in order if GROUPS[b] == k) for k in sorted(PROMPTS)]
    assert x.packing.cu_groups.tolist() == [0, *torch.tensor(per_group).cumsum(0).tolist()]
    assert x.packing.cu_prompts.tolist() == [0, *torch.tensor([PROMPTS[k] for k in sorted(PROMPTS)]).cumsum(0).tolist()]
    seqs = [PROMPTS[k] for k in sorted(PROMPTS)] + [lens[b] for b in order if lens[b]]
    assert x.packing.cu_seqs.tolist() == [0, *torch.tensor(seqs).cumsum(0).tolist()]
    assert (x.packing.max_prompt, x.packing.max_group, x.packing.max_seq) == (7, max(per_group), 8)
    assert x.packing.cu_prompts.dtype == x.packing.cu_groups.dtype == x.packing.cu_seqs.dtype == torch.int32


def test_logprobs_entropies_and_values_equal_each_sequence_alone():
    model = tiny_policy(1)
    tokens, prompt_lens, completion_lens = grouped_batch(1)
    with torch.no_grad():
        shared, ent_s = completion_logprobs(model, tokens, prompt_lens, completion_lens, WIDTH, TEMPERATURE, True,
                                            groups=GROUPS)
        alone, ent_a = alone_logprobs(model, tokens, prompt_lens, completion_lens, WIDTH)
    assert shared.dtype == torch.float64 and shared.abs().max() > 0.5 and (shared[2] == 0).all()
    assert (shared - alone).abs().max() <= 1e-12 and (ent_s - ent_a).abs().max() <= 1e-12
    critic = value_model(model)
    with torch.no_grad():
        v_shared = completion_values(critic, tokens, prompt_lens, completion_lens, WIDTH, groups=GROUPS)
        v_padded = completion_values(critic, tokens, prompt_lens, completion_lens, WIDTH, packed=False)
    # the float64 critic's values, which the rollout keeps in float32: equal to float32 rounding
    assert v_shared.abs().max() > 0.1 and (v_shared - v_padded).abs().max() <= 1e-6


@pytest.mark.parametrize("recipe,loss_agg", [("grpo", "token-mean"), ("ppo", "seq-mean-token-mean")])
def test_losses_and_gradients_equal_the_padded_layout(recipe, loss_agg):
    """The policy loss (and PPO's value loss) with the prompts shared against the right-padded layout, float64:
    equal losses and equal gradients of every parameter, the prompts' included (each prompt's tokens get the
    gradients of all its group's completions)."""
    section = resolve({"recipe": recipe, "model": {"policy": {"preset": "tiny"}},
                       recipe: {"loss_agg": loss_agg, "clip_eps_low": 0.05, "clip_eps_high": 0.05}})[recipe]
    tokens, prompt_lens, completion_lens = grouped_batch(2)
    mask = (torch.arange(WIDTH)[None, :] < completion_lens[:, None]).float()
    g = torch.Generator().manual_seed(3)
    model = tiny_policy(4)
    with torch.no_grad():
        ref, _ = completion_logprobs(model, tokens, prompt_lens, completion_lens, WIDTH, TEMPERATURE, packed=False)
    old_logp = (ref + 0.1 * torch.randn(ref.shape, generator=g)) * mask
    adv = torch.randn(ref.shape, generator=g) if recipe == "ppo" else torch.randn(len(GROUPS), generator=g)
    policy_loss = build_policy_loss(section, WIDTH)
    results = []
    for layout in ({"groups": GROUPS}, {"packed": False}):
        logp, _ = completion_logprobs(model, tokens, prompt_lens, completion_lens, WIDTH, TEMPERATURE, **layout)
        pl = policy_loss(logp, old_logp, adv, mask)
        results.append((pl.loss.detach(), _grads(pl.loss, model)))
    (loss_s, grads_s), (loss_d, grads_d) = results
    assert abs(loss_s.item() - loss_d.item()) <= 1e-12
    assert_same_gradients(grads_s, grads_d)
    if recipe != "ppo":
        return
    critic = value_model(model)
    value_loss = ClippedValueLoss.from_section(section, WIDTH)
    returns = torch.randn(ref.shape, generator=g) * mask
    out = []
    for layout in ({"groups": GROUPS}, {"packed": False}):
        values = completion_values(critic, tokens, prompt_lens, completion_lens, WIDTH, **layout)
        vl = value_loss(values, returns + 0.2 * mask, returns, mask)
        out.append((vl.loss.detach(), _grads(vl.loss, critic)))
    assert abs(float(out[0][0]) - float(out[1][0])) <= 1e-6
    for a, b in zip(out[0][1], out[1][1], strict=True):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max())


@pytest.mark.parametrize("layout", [{"groups": torch.tensor([0, 0, 1])}, {"packed": False}, {"packed": True}])
def test_a_micro_batch_without_completion_tokens_gives_zeros(layout):
    model = tiny_policy(2)
    tokens = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(4))
    tokens[1, :3] = tokens[0, :3]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, tokens, torch.tensor([3, 3, 2]), torch.zeros(3, dtype=torch.long), 2,
                                      TEMPERATURE, **layout)
    assert logp.shape == (3, 2) and (logp == 0).all()


def test_a_group_with_prompts_of_different_lengths_is_refused():
    tokens, prompt_lens, completion_lens = grouped_batch()
    prompt_lens[3] += 1   # a row of group 2
    with pytest.raises(FwError, match="shared_prompt: rows of one group have prompts of different lengths"):
        response_layout(tokens, prompt_lens, completion_lens, WIDTH, groups=GROUPS)


def test_micro_batches_are_cut_from_shuffled_whole_groups():
    from framework.tokenizer import Tokenizer
    from recipes.grpo import GRPORecipe

    cfg = config("/tmp/unused", grpo={"group_size": 4, "shared_prompt": True, "minibatches": 2},
                 rollout={"prompts_per_step": 6}, trainer={"accumulate_grad_batches": 3})
    recipe = GRPORecipe(cfg, Tokenizer.builtin())
    parts = recipe.minibatches(24, 0)
    rows = [r for mb in parts for m in mb for r in m.tolist()]
    assert sorted(rows) == list(range(24)) and len(parts) == 2 and all(len(mb) == 3 for mb in parts)
    for mb in parts:
        for m in mb:   # 12 rows a minibatch in 3 micro-batches of 4: each one group
            assert len(m) == 4 and len({r // 4 for r in m.tolist()}) == 1
    assert rows != list(range(24))   # the groups are shuffled
    # 5 micro-batches of 10 or 9 rows over 6 groups of 8: the cuts fall inside groups, in row order
    cfg = config("/tmp/unused", grpo={"group_size": 8, "shared_prompt": True},
                 rollout={"prompts_per_step": 6}, trainer={"accumulate_grad_batches": 5})
    (micro,) = GRPORecipe(cfg, Tokenizer.builtin()).minibatches(48, 0)
    assert [len(m) for m in micro] == [10, 10, 10, 9, 9]
    order = torch.cat(micro)
    assert all(len({int(r) // 8 for r in order[i:i + 8]}) == 1 for i in range(0, 48, 8))


@pytest.mark.parametrize("recipe, samples", [("grpo", "group_size"), ("ppo", "samples_per_prompt")])
def test_shared_prompt_auto_lays_prompts_out_once_on_cuda_with_16_bit_matmuls(recipe, samples):
    """The default, "auto": on where flash attention serves the layout in the compute dtype (CUDA, bf16 or fp16
    matmuls), off on CPU and in float32; true and false hold anywhere; one completion a prompt has nothing to share.
    The memory plan's micro-batch of most tokens follows the same choice."""
    from framework.tokenizer import Tokenizer
    from recipes.grpo import GRPORecipe
    from recipes.ppo import PPORecipe
    from recipes.rl import shares_prompts

    cls = GRPORecipe if recipe == "grpo" else PPORecipe
    make = config if recipe == "grpo" else ppo_config
    cases = [("cpu", "bf16-mixed", "auto", 4, False), ("gpu", "bf16-mixed", "auto", 4, True),
             ("cuda", "16-mixed", "auto", 4, True), ("gpu", "bf16-true", "auto", 4, True),
             ("cpu", "16-mixed", "auto", 4, False), ("gpu", "16-true", "auto", 4, True),
             ("gpu", "32-true", "auto", 4, False), ("cpu", "32-true", True, 4, True),
             ("gpu", "bf16-mixed", False, 4, False)]
    if recipe == "ppo":   # GRPO's groups hold 2 completions or more
        cases += [("gpu", "bf16-mixed", "auto", 1, False), ("gpu", "bf16-mixed", True, 1, False)]
    for accelerator, precision, setting, n, want in cases:
        cfg = make("/tmp/unused", **{recipe: {samples: n, "shared_prompt": setting}})
        assert cfg[recipe]["shared_prompt"] == setting
        cfg["trainer"].update(accelerator=accelerator, precision=precision)   # a GPU job, planned anywhere
        assert shares_prompts(cfg, recipe, samples) is want, (accelerator, precision, setting, n)
        shapes = cls.batch_shapes(cfg, Tokenizer.builtin())
        assert (shapes.tokens > 0) is want   # the plan counts each group's prompt once only when shared
    assert make("/tmp/unused")[recipe]["shared_prompt"] == "auto"


def test_a_fit_with_shared_prompts_trains_like_one_without(tmp_path):
    """GRPO and PPO fits on the tiny preset: every logged metric of two steps equals the usual layout's, to
    float32 rounding (the micro-batches hold other rows, and the sums run in another order)."""
    runs = {}
    for recipe, samples in (("grpo", "group_size"), ("ppo", "samples_per_prompt")):
        for shared in (False, True):
            run = tmp_path / f"{recipe}-{shared}"
            make = config if recipe == "grpo" else ppo_config
            fit(make(run, **{recipe: {samples: 4, "shared_prompt": shared}}, trainer={"accumulate_grad_batches": 2}))
            runs[recipe, shared] = [{k: v for k, v in r.items() if k not in TIMING}
                                    for r in read_metrics(run / "metrics.jsonl")]
    for recipe in ("grpo", "ppo"):
        base, shared = runs[recipe, False], runs[recipe, True]
        assert len(base) == len(shared) == 2
        for a, b in zip(base, shared, strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (recipe, key, a[key], b[key])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_shared_prompts_on_cuda_match_the_padded_layout(dtype):
    """Under 16-bit autocast on CUDA (flash attention, the suffix backward's kernel): logprobs and gradients with
    the prompts shared against the right-padded layout, both against the float64 CPU run."""
    tokens, prompt_lens, completion_lens = grouped_batch(3)
    model64 = tiny_policy(5)
    logp64, _ = completion_logprobs(model64, tokens, prompt_lens, completion_lens, WIDTH, TEMPERATURE, packed=False)
    want = _grads(logp64.sum(), model64)
    model = tiny_policy(5).float().cuda()
    results = {}
    for name, layout in (("shared", {"groups": GROUPS}), ("padded", {"packed": False})):
        with torch.autocast("cuda", dtype=dtype):
            logp, _ = completion_logprobs(model, tokens.cuda(), prompt_lens, completion_lens, WIDTH, TEMPERATURE,
                                          **layout)
        results[name] = (logp.detach().double().cpu(), [g.double().cpu() for g in _grads(logp.sum(), model)])
    # the longest completion one token and another empty: flash's one-query path serves the suffix attention
    short = (tokens[:3], prompt_lens[:3], torch.tensor([1, 0, 1]), WIDTH, TEMPERATURE)
    one64 = completion_logprobs(model64, *short, packed=False)[0].detach()
    one = {}
    for name, layout in (("shared", {"groups": GROUPS[:3]}), ("padded", {"packed": False})):
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            one[name] = float((completion_logprobs(model, short[0].cuda(), *short[1:], **layout)[0].double().cpu()
                               - one64).abs().max())
    assert one["shared"] <= 2 * one["padded"] + 1e-3, one
    errors = {}
    for name, (logp, grads) in results.items():
        errors[name] = (float((logp - logp64.detach()).abs().max()),
                        max(float((g - w).norm() / w.norm()) for g, w in zip(grads, want, strict=True)))
    # 16-bit autocast rounds both layouts; the shared one is no further from float64 than the padded one
    assert errors["padded"][0] < 0.1 and errors["padded"][1] < 0.05, errors
    assert errors["shared"][0] <= 2 * errors["padded"][0] + 1e-3, errors
    assert errors["shared"][1] <= 2 * errors["padded"][1] + 1e-3, errors
