"""Extending an RL run: a run stopped by trainer.max_steps inside a rollout batch's epochs x minibatches steps and
resumed with a larger max_steps trains exactly as one uninterrupted run to the larger count (the rest of the cut
batch first: its rows, its minibatch order, its pinned advantages and old logprobs)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from framework.callbacks import Callback
from framework.config import resolve
from framework.metrics import read_metrics
from framework.trainer import fit

TIMING = {"tokens_per_s", "rollout/tokens_per_s", "rollout/seconds"}   # wall-clock dependent


class StepTrace(Callback):
    """Appends each policy step's gradient norm and weight checksum (float64) to <run_dir>/steps-rank<r>.jsonl."""

    def after_optimizer_step(self, trainer, module, optimizer):
        if module.optimizer_role(optimizer) != "policy":
            return
        record = {"step": module.policy_version, "grad_norm": float(module.grad_norms["policy"]),
                  "checksum": float(sum(p.detach().double().sum() for p in module.policy.parameters()))}
        with open(Path(module.cfg["run_dir"]) / f"steps-rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def config(run_dir, recipe, max_steps, **sections):
    cfg = {
        "recipe": recipe, "seed": 5, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
        "data": {"task": {"name": "digits", "init_args": {"num_digits": 2, "rule": "sum"}}, "chat_template": False},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 3, "temperature": 1.0},
        "reward": {"class_path": "test_grpo.LetterReward"},   # varied rewards: advantages that are not 0
        recipe: {"epochs": 2, "minibatches": 2},   # 4 policy steps per rollout batch
        "optimizer": {"lr": 1e-2, "max_grad_norm": None},
        "trainer": {"accelerator": "cpu", "max_steps": max_steps, "enable_progress_bar": False,
                    "log_every_n_steps": 1},
        "checkpoint": {"every_n_steps": 100, "keep_last": None},
        "logging": {"csv": False, "tensorboard": False},
        "callbacks": [{"class_path": "test_rl_extend.StepTrace"}],
    }
    if recipe == "grpo":
        cfg[recipe]["group_size"] = 4
    else:
        cfg[recipe].update(samples_per_prompt=4, critic={"lr": 1e-2, "max_grad_norm": None})
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return resolve(cfg)


def trace(run, rank=0):
    return [json.loads(line) for line in (run / f"steps-rank{rank}.jsonl").read_text().splitlines()]


def metrics(run):
    return {r["step"]: {k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run / "metrics.jsonl")}


def weights(run, step, component="policy"):
    return load_file(str(run / "checkpoints" / f"step-{step:06d}" / component / "model.safetensors"))


@pytest.mark.parametrize("recipe, options", [
    ("grpo", {}),
    # pinned across the cut: the reference's logprobs and the trainer's pre-update ones (the correction's pi_old)
    ("grpo", {"kl_coef": 0.1, "off_policy_correction": {"name": "tis"}}),
    ("ppo", {"kl_coef": 0.1, "off_policy_correction": {"name": "tis"}}),
])
def test_a_run_extended_past_a_cut_rollout_batch_equals_the_uninterrupted_run(tmp_path, recipe, options):
    # 4 steps a rollout batch: the first run stops after 2 of the second batch's 4 steps, the resumed one trains
    # their other 2, then a third batch's first 2
    straight, extended = tmp_path / "straight", tmp_path / "extended"
    fit(config(straight, recipe, 10, **{recipe: options}))
    fit(config(extended, recipe, 6, **{recipe: options}))
    trainer = fit(config(extended, recipe, 10, **{recipe: options}), resume="last")
    assert trainer.global_step == 10

    expected, got = trace(straight), trace(extended)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(1, 11))
    assert all(r["grad_norm"] > 0 for r in expected)   # every step learns something
    assert got == expected   # the same gradient and the same weights at every step, the resumed ones included
    a, b = weights(straight, 10), weights(extended, 10)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if recipe == "ppo":
        a, b = weights(straight, 10, "value"), weights(extended, 10, "value")
        assert all(torch.equal(a[k], b[k]) for k in a)
    # the third batch (steps 9-10) is logged alike; the cut batch's rollout metrics once, in the first run's record
    want, have = metrics(straight), metrics(extended)
    assert sorted(want) == [4, 8, 10] and sorted(have) == [4, 6, 8, 10]
    assert have[10] == want[10]
    assert have[6]["reward/mean"] == want[8]["reward/mean"] and "reward/mean" not in have[8]
    assert have[8]["policy_version"] == 8


def test_a_cut_batch_resumed_under_another_split_is_dropped_with_a_warning(tmp_path, capsys):
    """Its steps were counted in epochs x minibatches = 2 x 2: under 2 x 1 there is no "rest" to train, so the
    resumed run says so on stderr and draws the next batch (samples 8..11), which its 2 steps finish."""
    run = tmp_path / "run"
    fit(config(run, "grpo", 6))
    capsys.readouterr()
    fit(config(run, "grpo", 8, grpo={"minibatches": 1}), resume="last")
    err = capsys.readouterr().err
    assert "stopped after 2 policy steps of rollout batch 1" in err and "grpo.minibatches was 2, now 1" in err
    state = torch.load(run / "checkpoints" / "step-000008" / "trainer_state.pt", weights_only=False)["fw_recipe"]
    assert state == {"rollout_step": 3, "prompt_position": 12}   # no cut batch left


@pytest.mark.slow   # three 2-process Lightning start-ups and a 1-process one
def test_a_cut_batch_holds_every_ranks_share_and_another_world_size_drops_it(tmp_path):
    """2 ranks, 2 steps a rollout batch: stopped after step 3 (inside batch 1) and resumed to 4 on 2 ranks, each
    rank trains the rest of its own rows, as the uninterrupted run did; resumed on 1 process instead, the rest of
    the batch is dropped, with a warning, and a new batch is drawn at the next prompts."""
    from test_ddp import fit_in_subprocess

    def cfg(run, devices, prompts, max_steps):
        c = config(run, "grpo", max_steps, grpo={"epochs": 1, "minibatches": 2},
                   rollout={"prompts_per_step": prompts, "max_new_tokens": 3, "temperature": 1.0},
                   trainer={"devices": devices, "strategy": "ddp" if devices > 1 else "auto"})
        return c

    straight, cut, one = tmp_path / "straight", tmp_path / "cut", tmp_path / "one"
    fit_in_subprocess(tmp_path, cfg(straight, 2, 2, 4))
    fit_in_subprocess(tmp_path, cfg(cut, 2, 2, 3))
    state = torch.load(cut / "checkpoints" / "step-000003" / "trainer_state.pt", weights_only=False)["fw_recipe"]
    assert (state["rollout_step"], state["prompt_position"]) == (2, 8)   # batch 1 drawn: samples 4..7
    assert state["cut"]["rollout_step"] == 1 and state["cut"]["taken"] == 1 and len(state["cut"]["ranks"]) == 2
    shutil.copytree(cut / "checkpoints", one / "checkpoints")
    fit_in_subprocess(tmp_path, cfg(cut, 2, 2, 4), resume="last")
    for rank in (0, 1):
        assert trace(cut, rank) == trace(straight, rank), rank
    a, b = weights(straight, 4), weights(cut, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)

    proc = fit_in_subprocess(tmp_path, cfg(one, 1, 4, 4), resume="last")
    assert "drawn by 2 processes and this run has 1" in proc.stderr and "dropped" in proc.stderr
    state = torch.load(one / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=False)["fw_recipe"]
    # a new batch (samples 8..11) for step 4, itself cut after its first step
    assert (state["rollout_step"], state["prompt_position"]) == (3, 12)
    assert state["cut"]["rollout_step"] == 2 and state["cut"]["taken"] == 1 and len(state["cut"]["ranks"]) == 1


def _gather_on(rank: int, cfg: dict, port: int, out_dir: str) -> None:
    """One of two gloo ranks: a GRPO recipe holding this rank's share of a cut batch saves its state_dict."""
    import torch.distributed as dist

    from framework.tokenizer import Tokenizer
    from recipes.grpo import GRPORecipe
    from recipes.rl import CutBatch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    recipe = GRPORecipe(cfg, Tokenizer.builtin())
    recipe.cut = CutBatch(1, 3, recipe.update_layout(), cut_share(rank))
    torch.save(recipe.state_dict(), Path(out_dir) / f"state-rank{rank}.pt")
    dist.destroy_process_group()


def cut_share(rank):
    """A rank's pinned share of a cut batch, its values set by the rank (the layout ``RLRecipe.pin`` makes)."""
    from recipes.rl import ScoredRollout

    r = float(rank)
    rollout = ScoredRollout(
        tokens=torch.full((2, 5), rank + 3), prompt_lens=torch.tensor([2, 3]), completion_lens=torch.tensor([3, rank]),
        old_logp=torch.full((2, 3), -r - 0.5), mask=torch.ones(2, 3), rewards=torch.tensor([r, 1.0]),
        correct=torch.tensor([False, True]), n_reward_errors=rank, eos_frac=0.5,
        truncated=torch.tensor([rank == 1, False]), gen_seconds=1.5 + r, texts=[f"rank {rank} a", f"rank {rank} b"])
    return {"rollout": rollout, "old_logp": torch.full((2, 3), -r), "loss_mask": torch.ones(2, 3), "weight": None,
            "advantages": torch.tensor([r, -r]), "ref_logp": None}


def test_a_cut_batch_is_gathered_on_rank_zero_only(tmp_path):
    """2 gloo processes, each with its own share of a cut batch: rank 0's recipe state (the checkpoint rank 0
    writes) holds both shares in rank order, exactly as each rank pinned them; rank 1's, which no checkpoint
    keeps, receives none."""
    import socket

    from scripts.preloaded import run_ranks

    from recipes.rl import pinned_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # through JSON, as a config reaches a process
    run_ranks(_gather_on, json.loads(json.dumps(config(tmp_path / "run", "grpo", 4))), port, str(tmp_path))
    states = [torch.load(tmp_path / f"state-rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    for state in states:
        assert {k: v for k, v in state["cut"].items() if k != "ranks"} == {
            "rollout_step": 1, "taken": 3, "layout": {"epochs": 2, "minibatches": 2, "shared_prompt": False}}
    assert states[1]["cut"]["ranks"] is None
    gathered = states[0]["cut"]["ranks"]
    assert len(gathered) == 2
    for rank, share in enumerate(gathered):
        got, want = flat(share), flat(pinned_state(cut_share(rank)))
        assert got.keys() == want.keys(), rank
        for key, expected in want.items():
            assert (torch.equal(got[key], expected) if isinstance(expected, torch.Tensor) else got[key] == expected), (
                rank, key)


def flat(state):
    """A pinned share as {name: value}, the rollout's fields as "rollout.<field>"."""
    return {**{k: v for k, v in state.items() if k != "rollout"},
            **{f"rollout.{k}": v for k, v in state["rollout"].items()}}
