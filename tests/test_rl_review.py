"""A review of the RL maths against independent float64 references: what pi_old and the KL forward see."""
import copy
import math
from typing import ClassVar

import pytest
import torch
from test_grpo import config as grpo_config
from test_grpo import token_logprobs
from test_ppo import config as ppo_config

import recipes.rl
from framework.callbacks import Callback
from framework.trainer import fit
from recipes.losses import kl_estimate

LORA = {"rank": 4, "alpha": 8, "dropout": 0.5}
TIS = {"name": "tis", "cap": 2.0}


class ScoredLogprobs(Callback):
    """At the first policy step of the second rollout batch (the adapters have moved, no step of this batch is
    taken yet): the trainer's no-grad logprobs of the batch against a float64 eval-mode forward of the policy."""

    captured: ClassVar[list] = []   # the trainer's no-grad logprobs of each rollout batch, as the recipe read them
    results: ClassVar[list] = []

    def before_optimizer_step(self, trainer, module, optimizer):
        if module.optimizer_role(optimizer) != "policy" or module.policy_version != 1:
            return
        assert module.policy.training   # the scoring forwards hand the training mode back
        data = module.recipe.last_rollout
        policy = copy.deepcopy(module.policy).double().eval()
        with torch.no_grad():
            want = token_logprobs(policy, data, module.cfg["rollout"]["temperature"])
        got = ScoredLogprobs.captured[-1]
        ScoredLogprobs.results.append(max(abs(float(got[b, j]) - float(lp)) for b, row in enumerate(want)
                                          for j, lp in enumerate(row)))


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_pi_old_and_the_kl_forward_see_no_dropout(tmp_path, monkeypatch, recipe):
    """pi_old of the clipped ratio under an off-policy correction, and PPO's KL-to-reference forward, are the
    policy itself: LoRA dropout (a training-time noise) must not reach them, as verl scores in eval mode."""
    plain = recipes.rl.loss_inputs

    def recording(section, behaviour_logp, mask, truncated, trainer_logprobs):
        def recorded():
            out = trainer_logprobs()
            ScoredLogprobs.captured.append(out.detach().clone())
            return out
        return plain(section, behaviour_logp, mask, truncated, recorded)

    monkeypatch.setattr(recipes.rl, "loss_inputs", recording)
    ScoredLogprobs.captured, ScoredLogprobs.results = [], []
    probe = {"class_path": "test_rl_review.ScoredLogprobs"}
    model = {"policy": {"preset": "tiny", "lora": LORA}}
    reward = {"name": None, "class_path": "test_grpo.LetterReward"}
    if recipe == "grpo":
        cfg = grpo_config(tmp_path / "run", [probe], model=model, reward=reward,
                          grpo={"group_size": 4, "off_policy_correction": TIS})
    else:
        cfg = ppo_config(tmp_path / "run", [probe], model=model, reward=reward,
                         ppo={"kl_coef": 0.1, "off_policy_correction": TIS, "critic": {"lr": 1e-2,
                                                                                      "max_grad_norm": None}})
    fit(cfg)
    assert len(ScoredLogprobs.captured) == 2
    [worst] = ScoredLogprobs.results
    assert worst < 1e-5


@pytest.mark.parametrize("estimator, value, grad", [
    # l = ref - logp = (-0.5, 1): k1 = -l, d/dlogp = 1; k2 = l^2 / 2, d/dlogp = -l; k3 = e^l - l - 1, d/dlogp = 1 - e^l
    ("k1", [0.5, -1.0], [1.0, 1.0]),
    ("k2", [0.125, 0.5], [0.5, -1.0]),
    ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0], [1.0 - math.exp(-0.5), 1.0 - math.e]),
])
def test_kl_estimators_values_and_gradients_hand_computed(estimator, value, grad):
    """The KL term of GRPO's loss pulls the policy towards the reference through logp only."""
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64, requires_grad=True)
    kl = kl_estimate(logp, ref.detach(), estimator)
    assert kl.tolist() == pytest.approx(value, rel=1e-12)
    kl.sum().backward()
    assert logp.grad.tolist() == pytest.approx(grad, rel=1e-12)


def test_scoring_restores_each_modules_own_mode():
    """Scoring runs every module in eval mode and hands each its own mode back: a part kept in eval mode (a
    frozen tower, say) stays there, where model.train() would flip it."""
    seen = []

    class Probe(recipes.rl.RLRecipe):
        def __init__(self):
            pass

        def logprobs(self, model, batch):
            seen.append([m.training for m in model.modules()])
            return torch.zeros(1), None

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5), torch.nn.Linear(2, 2)).train()
    model[2].eval()
    Probe().scored_logprobs(model, None)
    assert seen == [[False, False, False, False]]
    assert [m.training for m in model.modules()] == [True, True, True, False]
