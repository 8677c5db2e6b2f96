"""Several processes on CPU (gloo through Lightning's `strategy: ddp`, 2 ranks):

- GRPO with `scale_rewards: batch`: the advantages on each rank are those of the concatenated rewards of
  both ranks (global std), the all-reduced gradient equals an independent float64 gradient of the
  token-mean loss over both ranks' rollouts (what 1 process holding both would compute), and
  reward/mean and reward/std in metrics.jsonl are those of the global batch.
- Save on 2 ranks -> resume on 1 -> resume on 2 (SFT and GRPO): the runs finish, the checkpoints
  verify, and the data position carries over: SFT with the same global batch logs the metrics of the
  uninterrupted run (across logging intervals cut by the saves), GRPO draws the prompts the
  uninterrupted run would have drawn.
"""

import json
import math
import shutil
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_ddp import ROOT, fit_in_subprocess
from test_grpo import GradProbe, config, token_logprobs

from framework import checkpoint as ck
from framework.callbacks import Callback
from framework.metrics import read_metrics
from framework.models import build_policy
from framework.tasks import build_task, render_prompt
from framework.tokenizer import Tokenizer


class RolloutDump(Callback):
    """At policy step `step` (before the optimizer steps), each rank saves its rollout, the advantages it
    used, the policy weights and the (all-reduced) gradients to <run_dir>/probe-rank<r>.pt."""

    def __init__(self, step: int):
        self.step = step

    def before_optimizer_step(self, trainer, module, optimizer):
        if module.optimizer_role(optimizer) != "policy" or module.policy_version != self.step - 1:
            return
        data, recipe = module.recipe.last_rollout, module.recipe
        dump = {name: getattr(data, name).detach().cpu().clone()
                for name in ("tokens", "prompt_lens", "completion_lens", "old_logp", "mask", "rewards")}
        dump["advantages"] = recipe.last_advantages.detach().cpu().clone()
        dump["weights"] = {k: v.detach().cpu().clone() for k, v in module.policy.state_dict().items()}
        dump["grads"] = {n: p.grad.detach().cpu().clone() for n, p in module.policy.named_parameters()}
        torch.save(dump, Path(module.cfg["run_dir"]) / f"probe-rank{trainer.global_rank}.pt")


class PromptLog(Callback):
    """After every policy step, each rank appends the distinct prompts (token ids) of its rollout batch to
    <run_dir>/prompts-rank<r>.jsonl."""

    def after_optimizer_step(self, trainer, module, optimizer):
        if module.optimizer_role(optimizer) != "policy":
            return
        data = module.recipe.last_rollout
        size = module.cfg["grpo"]["group_size"]
        prompts = [data.tokens[b, :int(data.prompt_lens[b])].tolist() for b in range(0, data.tokens.shape[0], size)]
        with open(Path(module.cfg["run_dir"]) / f"prompts-rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": module.policy_version, "prompts": prompts}) + "\n")


class RngProbe(Callback):
    """After every policy step rank r draws r + 1 numbers from torch's global generator (rank-dependent
    RNG use, as a user's callback might) and appends the last to <run_dir>/rng-rank<r>.jsonl."""

    def after_optimizer_step(self, trainer, module, optimizer):
        if module.optimizer_role(optimizer) != "policy":
            return
        value = float(torch.rand(trainer.global_rank + 1)[-1])
        with open(Path(module.cfg["run_dir"]) / f"rng-rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": module.policy_version, "value": value}) + "\n")


def rng_log(run_dir, rank):
    path = Path(run_dir) / f"rng-rank{rank}.jsonl"
    return {r["step"]: r["value"] for r in map(json.loads, path.read_text().splitlines())}


def prompt_log(run_dir, rank):
    path = Path(run_dir) / f"prompts-rank{rank}.jsonl"
    return {r["step"]: r["prompts"] for r in map(json.loads, path.read_text().splitlines())}


def copy_checkpoint(src_run, step, dst_run):
    """A new run directory holding only checkpoint `step` of `src_run` (resumed there with --resume last)."""
    name = ck.step_dir_name(step)
    shutil.copytree(ck.checkpoints_dir(src_run) / name, ck.checkpoints_dir(dst_run) / name)


def trainer_state(run_dir, step):
    return torch.load(ck.checkpoints_dir(run_dir) / ck.step_dir_name(step) / ck.TRAINER_STATE, weights_only=False)


def ddp(devices):
    return {"accelerator": "cpu", "devices": devices, "strategy": "ddp" if devices > 1 else "auto",
            "enable_progress_bar": False, "log_every_n_steps": 1}


# ------------------------------------------------------------------------------------------------ GRPO
GRPO = {"reward": {"name": None, "class_path": "test_grpo.LetterReward"},
        # stop strings cut completions at different lengths, so the ranks' token counts differ
        "rollout": {"prompts_per_step": 2, "max_new_tokens": 6, "temperature": 0.9, "stop": ["1", "5", "+"]},
        "grpo": {"group_size": 4, "scale_rewards": "batch", "minibatches": 1, "clip_eps_low": 0.2,
                 "clip_eps_high": 0.2},
        "checkpoint": {"every_n_steps": 2, "keep_last": None, "verify": True}}


def grpo_cfg(run_dir, devices, prompts, max_steps, callbacks=()):
    sections = json.loads(json.dumps(GRPO))
    sections["rollout"]["prompts_per_step"] = prompts
    return config(run_dir, list(callbacks), **sections,
                  trainer={**ddp(devices), "max_steps": max_steps, "accumulate_grad_batches": 2})


@pytest.fixture(scope="module")
def grpo_two_ranks(tmp_path_factory):
    """4 policy steps on 2 ranks x 2 prompts x 4 samples, checkpoints at 2 and 4, probe at step 1."""
    tmp = tmp_path_factory.mktemp("grpo")
    run = tmp / "two"
    cbs = [{"class_path": "test_multi_process.RolloutDump", "init_args": {"step": 1}},
           {"class_path": "test_multi_process.PromptLog"}, {"class_path": "test_multi_process.RngProbe"}]
    fit_in_subprocess(tmp, grpo_cfg(run, 2, 2, 4, cbs))
    return tmp, run


@pytest.mark.slow   # one 2-process Lightning start-up (shared with the resume test)
def test_grpo_batch_std_and_update_are_global(grpo_two_ranks):
    _, run = grpo_two_ranks
    cfg = grpo_cfg(run, 2, 2, 4)
    g = cfg["grpo"]
    dumps = [torch.load(run / f"probe-rank{r}.pt", weights_only=False) for r in (0, 1)]
    rewards = [float(x) for d in dumps for x in d["rewards"]]
    assert len(rewards) == 16
    # advantages of the concatenated batch, by hand: group-centred, divided by the batch's sample std
    std = statistics.stdev(rewards)
    size = g["group_size"]
    expected = []
    for start in range(0, len(rewards), size):
        group = rewards[start:start + size]
        expected += [(r - sum(group) / size) / (std + g["adv_eps"]) for r in group]
    got = [float(a) for d in dumps for a in d["advantages"]]
    assert got == pytest.approx(expected, abs=1e-6)
    local = [statistics.stdev([float(x) for x in d["rewards"]]) for d in dumps]
    assert max(abs(s - std) for s in local) > 1e-3   # a per-rank std would have given other advantages

    # the all-reduced gradient == float64 gradient of the token-mean loss over both ranks' rollouts
    assert torch.equal(dumps[0]["weights"]["model.norm.weight"], dumps[1]["weights"]["model.norm.weight"])
    tokens = [int(d["mask"].sum()) for d in dumps]
    assert tokens[0] != tokens[1], tokens   # the ranks' token counts differ: a per-rank mean would not match
    policy = build_policy(cfg["model"]["policy"], Tokenizer.builtin())
    policy.load_state_dict(dumps[0]["weights"])
    policy = policy.double()
    terms = []
    low, high = 1 - g["clip_eps_low"], 1 + g["clip_eps_high"]
    for d, advs in zip(dumps, (expected[:8], expected[8:])):
        for b, row in enumerate(token_logprobs(policy, SimpleNamespace(**d), cfg["rollout"]["temperature"])):
            for j, logp in enumerate(row):
                ratio = torch.exp(logp - float(d["old_logp"][b, j]))
                terms.append(-torch.minimum(ratio * advs[b], ratio.clamp(low, high) * advs[b]))
    GradProbe.agg([terms], "token-mean", None).backward()
    for name, p in policy.named_parameters():
        for d in dumps:
            rel = float((p.grad - d["grads"][name].double()).abs().max() / p.grad.abs().max().clamp(min=1e-12))
            assert rel < 1e-4, (name, rel)

    # metrics.jsonl holds the global batch's reward statistics
    first = read_metrics(run / "metrics.jsonl")[0]
    assert first["step"] == 1
    assert first["reward/mean"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-6)   # fp32 per rank
    assert first["reward/std"] == pytest.approx(std, rel=1e-6)
    assert first["reward/accuracy"] == pytest.approx(sum(r >= 1 for r in rewards) / len(rewards), abs=1e-7)


@pytest.mark.slow   # a 1-process and a 2-process resume
def test_grpo_resumes_on_another_number_of_processes(grpo_two_ranks):
    tmp, two = grpo_two_ranks
    log = [{"class_path": "test_multi_process.PromptLog"}]
    # 2 ranks x 2 prompts -> 1 process x 4 prompts (the same global batch), from step 2 to 4
    one = tmp / "one"
    copy_checkpoint(two, 2, one)
    fit_in_subprocess(tmp, grpo_cfg(one, 1, 4, 4, log), resume="last")
    a = [prompt_log(two, r) for r in (0, 1)]
    b = prompt_log(one, 0)
    assert sorted(b) == [3, 4]
    for step in (3, 4):   # the prompts the uninterrupted 2-rank run drew, rank 0's then rank 1's
        assert b[step] == a[0][step] + a[1][step]
    assert trainer_state(one, 4)["fw_recipe"] == trainer_state(two, 4)["fw_recipe"] == \
        {"rollout_step": 4, "prompt_position": 16}
    # 1 process -> 2 ranks x 2 prompts, from step 4 to 5: samples 16..19, rank r takes 16 + 2r, 17 + 2r
    again = tmp / "again"
    copy_checkpoint(one, 4, again)
    fit_in_subprocess(tmp, grpo_cfg(again, 2, 2, 5, log), resume="last")
    cfg = grpo_cfg(again, 2, 2, 5)
    task, tok = build_task(cfg["data"], seed=cfg["seed"]), Tokenizer.builtin()
    for rank in (0, 1):
        expected = [tok.encode(render_prompt(task.sample(i)["prompt"], tok, False, False))
                    for i in (16 + 2 * rank, 17 + 2 * rank)]
        assert prompt_log(again, rank) == {5: expected}
    assert trainer_state(again, 5)["fw_recipe"] == {"rollout_step": 5, "prompt_position": 20}
    for run, step in ((one, 4), (again, 5)):
        manifest = ck.verify_checkpoint(ck.checkpoints_dir(run) / ck.step_dir_name(step))
        assert manifest["policy_version"] == step
    assert [r["step"] for r in read_metrics(again / "metrics.jsonl")] == [5]


@pytest.mark.slow   # one 2-process resume
def test_grpo_same_world_resume_is_exact_and_restores_each_ranks_rng(grpo_two_ranks):
    """2 ranks -> save at 2 -> 2 ranks: the same prompts and metrics as the straight run, and each rank
    continues its own RNG stream (its state, not rank 0's)."""
    tmp, two = grpo_two_ranks
    same = tmp / "same"
    copy_checkpoint(two, 2, same)
    cbs = [{"class_path": "test_multi_process.PromptLog"}, {"class_path": "test_multi_process.RngProbe"}]
    fit_in_subprocess(tmp, grpo_cfg(same, 2, 2, 4, cbs), resume="last")
    for rank in (0, 1):
        straight = rng_log(two, rank)
        assert rng_log(same, rank) == {s: straight[s] for s in (3, 4)}, rank
        assert prompt_log(same, rank) == {s: prompt_log(two, rank)[s] for s in (3, 4)}
    assert rng_log(two, 0)[3] != rng_log(two, 1)[3]   # the ranks' streams did differ
    timing = {"tokens_per_s", "rollout/tokens_per_s", "rollout/seconds"}
    straight = [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(two / "metrics.jsonl")][2:]
    assert [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(same / "metrics.jsonl")] == straight


# ------------------------------------------------------------------------------------------------- SFT
def sft_cfg(run_dir, devices, batch_size, callbacks=()):
    return {"recipe": "sft", "seed": 5, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
            "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 96,
                     "batch_size": batch_size},
            "optimizer": {"lr": 3e-3, "max_grad_norm": 0.5},
            # intervals 1-3 and 4-6; the saves at 2 and 4 fall inside them
            "trainer": {**ddp(devices), "max_steps": 6, "accumulate_grad_batches": 2, "log_every_n_steps": 3},
            "checkpoint": {"every_n_steps": 2, "keep_last": None, "verify": True},
            "logging": {"csv": False, "tensorboard": False}, "callbacks": list(callbacks)}


@pytest.mark.slow   # three Lightning start-ups, two of them 2-process
def test_sft_save_on_two_resume_on_one_then_on_two(tmp_path):
    """2 ranks x 2 rows -> (step 2) 1 process x 4 rows -> (step 4) 2 ranks x 2 rows: the same global batch
    throughout, so positions, tokens, losses and weights follow the uninterrupted 2-rank run."""
    two = tmp_path / "two"
    fit_in_subprocess(tmp_path, sft_cfg(two, 2, 2))
    one = tmp_path / "one"
    copy_checkpoint(two, 2, one)
    crash = {"class_path": "test_resume.CrashAt", "init_args": {"step": 5}}   # leaves the save at step 4
    proc = fit_in_subprocess(tmp_path, sft_cfg(one, 1, 4, [crash]), resume="last", check=False)
    assert proc.returncode != 0 and "simulated crash after step 5" in proc.stderr, proc.stderr[-3000:]
    again = tmp_path / "again"
    copy_checkpoint(one, 4, again)
    fit_in_subprocess(tmp_path, sft_cfg(again, 2, 2), resume="last")

    for step in (2, 4, 6):
        run = again if step == 6 else one if step == 4 else two
        assert trainer_state(run, step)["fw_recipe"] == trainer_state(two, step)["fw_recipe"], step
        ck.verify_checkpoint(ck.checkpoints_dir(run) / ck.step_dir_name(step))
    straight = {r["step"]: r for r in read_metrics(two / "metrics.jsonl")}
    resumed = {r["step"]: r for r in [*read_metrics(one / "metrics.jsonl"), *read_metrics(again / "metrics.jsonl")]}
    assert sorted(straight) == [3, 6] and sorted(resumed) == [3, 6]
    for step in (3, 6):   # each interval mixes steps before and after a save on another number of processes
        a, b = straight[step], resumed[step]
        assert b["tokens"] == a["tokens"] and b["lr"] == a["lr"], step
        for key in ("loss", "token_accuracy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (step, key)
    a, b = (load_file(str(ck.checkpoints_dir(run) / "step-000006" / "policy" / "model.safetensors"))
            for run in (two, again))
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4
    assert not math.isnan(straight[6]["loss"])


# ------------------------------------------------------------------------------- fast, single process
def test_rng_state_choice_follows_the_number_of_processes():
    """Per-rank states when the checkpoint's world size matches, rank 0's (fw_rng) on every rank otherwise
    and for checkpoints without per-rank states."""
    from framework.module import choose_rng_state

    states = [{"torch": torch.tensor([r])} for r in range(2)]
    saved = {"fw_rng": states[0], "fw_rng_ranks": states}
    assert [choose_rng_state(saved, r, 2) for r in (0, 1)] == states
    assert [choose_rng_state(saved, r, 3) for r in (0, 1, 2)] == [states[0]] * 3
    assert choose_rng_state({"fw_rng": states[0], "fw_rng_ranks": None}, 0, 1) is states[0]


def test_step_metrics_state_is_held_by_one_rank():
    """A restored interval: the holder continues the accumulated values, another rank only the update
    counts; what both add afterwards combines like one uninterrupted process (summed here by hand)."""
    from framework.metrics import StepMetrics

    before = StepMetrics()
    before.update("loss", 2.0, weight=3.0)
    before.update("loss", 4.0, weight=1.0)
    before.update("peak", 7.0, reduce="max")
    state = before.state()
    holder, other = StepMetrics(), StepMetrics()
    holder.load_state(state, holder=True)
    other.load_state(state, holder=False)
    assert other.metrics["loss"].update_count == 2 and float(other.metrics["loss"].weight) == 0.0
    holder.update("loss", 1.0, weight=2.0)
    got = holder.compute()
    assert got["loss"] == pytest.approx((2 * 3 + 4 * 1 + 1 * 2) / 6) and got["peak"] == 7.0


# ------------------------------------------------------------------------------------------------- PPO
class AdvantageDump(Callback):
    """At the first policy step each rank saves its GAE advantages before and after whitening."""

    def before_optimizer_step(self, trainer, module, optimizer):
        if module.optimizer_role(optimizer) != "policy" or module.policy_version != 0:
            return
        recipe = module.recipe
        out = Path(module.cfg["run_dir"]) / f"adv-rank{trainer.global_rank}.pt"
        torch.save({"raw": recipe.last_advantages_raw.cpu(), "whitened": recipe.last_advantages.cpu(),
                    "mask": recipe.last_rollout.mask.cpu()}, out)


@pytest.mark.slow   # one 2-process Lightning start-up
def test_ppo_whitens_with_the_statistics_of_every_rank(tmp_path):
    from test_ppo import config as ppo_config

    run = tmp_path / "run"
    cfg = ppo_config(run, [{"class_path": "test_multi_process.AdvantageDump"}],
                     reward={"name": None, "class_path": "test_grpo.LetterReward"},
                     rollout={"prompts_per_step": 4, "max_new_tokens": 6, "temperature": 1.1, "stop": ["1", "5", "+"]},
                     trainer={**ddp(2), "max_steps": 1})
    fit_in_subprocess(tmp_path, cfg)
    dumps = [torch.load(run / f"adv-rank{r}.pt", weights_only=False) for r in (0, 1)]
    values = [float(a) for d in dumps for a, m in zip(d["raw"].flatten(), d["mask"].flatten()) if m > 0]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)   # population variance, as whiten()
    for d in dumps:
        expected = (d["raw"].double() - mean) / math.sqrt(var + 1e-8) * d["mask"].double()
        assert torch.allclose(d["whitened"].double(), expected, atol=1e-5)
    local_means = [float((d["raw"] * d["mask"]).sum() / d["mask"].sum()) for d in dumps]
    assert max(abs(m - mean) for m in local_means) > 1e-4   # per-rank whitening would have differed
