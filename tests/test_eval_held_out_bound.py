"""The held-out bound against what real runs draw: RL runs whose rollout batch trains for `epochs` x `minibatches`
policy steps (GRPO, PPO, GRPO's dynamic sampling, resumes inside a cut batch), a resume from a checkpoint that
records no bound (a warning), and a 2-process SFT run in which global rank 0 alone counts the packed draws."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from framework.callbacks import EvalCallback
from framework.config import resolve
from framework.evaluation import HELD_OUT_ENTRY, training_draws
from framework.tasks import Digits
from framework.trainer import fit

ROOT = Path(__file__).resolve().parents[1]
P = 4   # rollout.prompts_per_step
EVAL = {"every_n_steps": 100, "at_start": False, "max_prompts": 4, "samples_per_prompt": 1}   # built, never run
WARNING = ("fw: warning: eval: the checkpoint records no held-out bound (written by an older fw, or by a run that "
           "did not hold out eval data), so the eval set is chosen anew for this run; the eval metrics from here on "
           "are not comparable with the earlier ones")


class IndexDigits(Digits):
    """The digits task, keeping every index asked of this instance in `asked`. The recipe's own instance is read:
    the memory plan and the evaluation build instances of their own, which sample the same task."""

    def __init__(self, num_digits: int = 2, rule: str = "next", seed: int = 0):
        super().__init__(num_digits, rule, seed=seed)
        self.asked: list[int] = []

    def sample(self, index: int):
        self.asked.append(index)
        return super().sample(index)


class ZeroReward:
    """0 for every completion: every GRPO group ties, so dynamic sampling spends all its rounds."""

    def __call__(self, prompt, completion, metadata):
        return 0.0


def rl_config(run_dir, recipe="grpo", max_steps=5, eval_cfg=None, **sections):
    cfg = {"recipe": recipe, "seed": 3, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
           "data": {"task": {"class_path": "test_eval_held_out_bound.IndexDigits"}, "chat_template": False},
           "rollout": {"prompts_per_step": P, "max_new_tokens": 1},
           "reward": {"name": "numeric_match"}, "optimizer": {"lr": 1e-3},
           "trainer": {"accelerator": "cpu", "max_steps": max_steps, "enable_progress_bar": False},
           "checkpoint": {"every_n_steps": 100, "keep_last": None},
           "logging": {"csv": False, "tensorboard": False}, "eval": eval_cfg or EVAL}
    if recipe == "ppo":
        cfg["ppo"] = {"critic": {"lr": 1e-3}}
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return resolve(cfg)


def run(cfg, resume=None):
    """fit(cfg): (the indices the run's task was asked for, its data position, its held-out record)."""
    trainer = fit(cfg, resume=resume)
    recipe = trainer.lightning_module.recipe
    callback = next(cb for cb in trainer.callbacks if isinstance(cb, EvalCallback))
    return recipe.task.asked, recipe.prompt_position, callback.held_out


def saved_record(run_dir, step):
    state = torch.load(Path(run_dir) / "checkpoints" / f"step-{step:06d}" / "trainer_state.pt", weights_only=False)
    return state.get(HELD_OUT_ENTRY)


# ---------------------------------------------------------------- RL: one rollout batch, several policy steps


@pytest.mark.parametrize(("recipe", "section", "batches"), [
    ("grpo", {"group_size": 4, "epochs": 2, "minibatches": 2}, 2),   # 4 steps a batch: steps 1-4, 5
    ("ppo", {"epochs": 1, "minibatches": 2}, 3),                      # 2 steps a batch: 1-2, 3-4, 5
])
def test_the_rl_bound_is_exactly_the_prompts_the_run_draws(tmp_path, recipe, section, batches):
    asked, position, record = run(rl_config(tmp_path / "run", recipe, max_steps=5, **{recipe: section}))
    assert sorted(set(asked)) == list(range(batches * P))   # every prompt of each rollout batch, once
    assert position == batches * P
    assert record["draws"] == max(asked) + 1 == batches * P
    assert saved_record(tmp_path / "run", 5)["draws"] == batches * P   # what fw eval and a resume read
    assert 5 * P > max(asked) + 1   # one batch a policy step (the count before) would leave out more


def test_dynamic_sampling_is_bounded_by_its_most_rounds_per_rollout_batch(tmp_path):
    # every group ties, so each of the 2 rollout batches (steps 1-2, 3-4) draws all 3 rounds: the bound is met
    cfg = rl_config(tmp_path / "run", max_steps=4,
                    reward={"name": None, "class_path": "test_eval_held_out_bound.ZeroReward"},
                    grpo={"group_size": 2, "epochs": 2, "minibatches": 1, "dynamic_sampling": True,
                          "dynamic_sampling_max_rounds": 3})
    asked, position, record = run(cfg)
    assert sorted(set(asked)) == list(range(2 * 3 * P)) and position == 2 * 3 * P
    assert record["draws"] == max(asked) + 1
    assert 4 * 3 * P > max(asked) + 1   # one batch a policy step, at its most rounds


@pytest.mark.parametrize(("resumed", "max_steps", "batches"), [
    # the same layout: the rest of the cut batch (steps 6-8) draws nothing, then one batch (steps 9-11)
    ({"epochs": 2, "minibatches": 2}, 11, 3),
    # another layout: the cut batch is dropped, then 2 steps a batch (6-7, 8-9, 10)
    ({"epochs": 1, "minibatches": 2}, 10, 5),
])
def test_a_run_resumed_inside_a_cut_rollout_batch_is_bounded_exactly(tmp_path, resumed, max_steps, batches):
    run_dir = tmp_path / "run"
    first, position, record = run(rl_config(run_dir, max_steps=5, grpo={"group_size": 4, "epochs": 2,
                                                                           "minibatches": 2}))
    assert position == record["draws"] == 2 * P   # steps 1-4, then step 5 of the second batch
    cfg = rl_config(run_dir, max_steps=max_steps, grpo={"group_size": 4, **resumed})
    second, position, record = run(cfg, resume="last")
    drawn = first + second
    assert sorted(set(drawn)) == list(range(batches * P)) and position == batches * P
    assert record["draws"] == max(drawn) + 1
    assert saved_record(run_dir, max_steps)["draws"] == batches * P


# ---------------------------------------------------------------- a checkpoint that records no bound


def edit_trainer_state(checkpoint: Path, edit):
    """`edit(state)` on a checkpoint's trainer state on disk, as another fw would have written it (the manifest's
    size and sha256 of the trainer state follow); returns what `edit` returns."""
    state_file = checkpoint / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    out = edit(state)
    torch.save(state, state_file)
    data = state_file.read_bytes()
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["trainer_state.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return out


def test_a_resume_from_a_checkpoint_without_a_bound_warns_once(tmp_path, capsys):
    eval_cfg = {**EVAL, "every_n_steps": 2}
    checkpoints = {"every_n_steps": 2, "keep_last": None, "verify": True}
    kept, old = tmp_path / "kept", tmp_path / "old"
    fit(rl_config(kept, max_steps=2, eval_cfg=eval_cfg, checkpoint=checkpoints))
    assert WARNING not in capsys.readouterr().err   # a fresh start
    shutil.copytree(kept, old)
    # as an fw without the entry wrote it
    assert edit_trainer_state(old / "checkpoints" / "step-000002", lambda s: s.pop(HELD_OUT_ENTRY))["draws"] > 0
    plain = tmp_path / "plain"   # held_out off: the eval set does not depend on the draws
    shutil.copytree(old, plain)

    fit(rl_config(kept, max_steps=4, eval_cfg=eval_cfg, checkpoint=checkpoints), resume="last")
    assert WARNING not in capsys.readouterr().err   # the entry is there
    fit(rl_config(plain, max_steps=4, eval_cfg={**eval_cfg, "held_out": False}, checkpoint=checkpoints),
        resume="last")
    assert WARNING not in capsys.readouterr().err
    fit(rl_config(old, max_steps=4, eval_cfg=eval_cfg, checkpoint=checkpoints), resume="last")
    assert capsys.readouterr().err.splitlines().count(WARNING) == 1
    assert saved_record(old, 4)["draws"] == saved_record(kept, 4)["draws"]   # a new bound, written on


OLDER = ("fw: warning: eval: the checkpoint was written by an older fw, which held eval samples out by their whole "
         "record; they are now held out by prompt (an eval sample whose prompt the run trains on is left out), so the "
         "eval set may differ and the eval metrics from here on may not be comparable with the earlier ones")


def test_a_bound_recorded_by_an_fw_that_compared_whole_records_is_named_on_resume(tmp_path, capsys):
    """A held-out record without `key` comes from an fw that held eval samples out by whole record: a resume says
    once that they are now held out by prompt, and writes the key on; a record with it says nothing."""
    eval_cfg = {**EVAL, "every_n_steps": 2}
    checkpoints = {"every_n_steps": 2, "keep_last": None, "verify": True}
    new, old = tmp_path / "new", tmp_path / "old"
    fit(rl_config(new, max_steps=2, eval_cfg=eval_cfg, checkpoint=checkpoints))
    assert saved_record(new, 2)["key"] == "prompt"
    shutil.copytree(new, old)
    edit_trainer_state(old / "checkpoints" / "step-000002", lambda state: state[HELD_OUT_ENTRY].pop("key"))
    capsys.readouterr()

    fit(rl_config(new, max_steps=4, eval_cfg=eval_cfg, checkpoint=checkpoints), resume="last")
    assert OLDER not in capsys.readouterr().err
    fit(rl_config(old, max_steps=4, eval_cfg=eval_cfg, checkpoint=checkpoints), resume="last")
    err = capsys.readouterr().err
    assert err.splitlines().count(OLDER) == 1 and WARNING not in err
    assert saved_record(old, 4) == saved_record(new, 4)   # the same bound, with the key written on


# ---------------------------------------------------------------- 2 processes: rank 0 counts, both ranks know


SCRIPT = """
import json, sys
from pathlib import Path
import framework.evaluation as evaluation
from framework.callbacks import EvalCallback
from framework.config import resolve
from framework.trainer import fit

CALLS = []   # this process's calls of training_draws, which packs every row an SFT run from a task trains on
counted = evaluation.training_draws


def training_draws(*args, **kwargs):
    CALLS.append(args[1])
    return counted(*args, **kwargs)


evaluation.training_draws = training_draws
trainer = fit(resolve(json.loads(sys.argv[1])))
callback = next(cb for cb in trainer.callbacks if isinstance(cb, EvalCallback))
out = {"calls": CALLS, "record": callback.held_out, "draws": callback.evaluation.draws,
       "examples": [e.ids for e in callback.evaluation.examples], "position": trainer.lightning_module.recipe.position}
(Path(sys.argv[2]) / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))
"""


@pytest.mark.slow   # two Lightning process start-ups: long on a 2-core machine
def test_two_processes_count_the_sft_draws_on_rank_zero_only(tmp_path):
    cfg = resolve({
        "recipe": "sft", "seed": 3, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
        "data": {"task": {"name": "arithmetic", "init_args": {"digits": 2}}, "chat_template": False,
                 "max_seq_len": 64, "batch_size": 2},
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": 3,
                    "accumulate_grad_batches": 2, "enable_progress_bar": False},
        "checkpoint": {"every_n_steps": 100}, "logging": {"csv": False, "tensorboard": False},
        "eval": {"every_n_steps": 3, "max_prompts": 6}})
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, str(script), json.dumps(cfg), str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert zero["calls"] == [2] and one["calls"] == []   # rank 1 packs nothing
    expected = training_draws(cfg, 2)   # the same packing in this one process
    # the examples the run's packed rows took over both ranks, far more than one a row (3 steps x 2 x 2 x 2)
    assert zero["position"] == expected > 3 * 2 * 2 * 2
    for rank in (zero, one):
        assert rank["record"]["draws"] == rank["draws"] == expected
    assert zero["examples"] == one["examples"]   # one eval set


def _from_rank_zero_on(rank: int, store: str, out_dir: str) -> None:
    """One of two gloo ranks: `from_rank_zero` of a count, then of a computation that raises; what it got goes to
    `rank<rank>.json` in `out_dir`."""
    import torch.distributed as dist

    from framework.errors import FwError
    from framework.evaluation import from_rank_zero

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    calls = []

    def compute():
        calls.append(rank)
        return {"draws": 100 + rank}

    def fails():
        raise FwError("data.task: cannot count")

    got = from_rank_zero(compute)
    try:
        from_rank_zero(fails)
        error = None
    except FwError as e:
        error = str(e)
    with open(Path(out_dir) / f"rank{rank}.json", "w") as f:
        json.dump({"calls": calls, "got": got, "error": error}, f)
    dist.destroy_process_group()


def test_rank_zero_computes_and_its_error_reaches_every_rank(tmp_path):
    """Two gloo processes: rank 0 alone computes, both get its result; rank 0's error is raised on rank 1 too,
    which would otherwise wait for a result forever."""
    from scripts.preloaded import run_ranks

    run_ranks(_from_rank_zero_on, str(tmp_path / "store"), str(tmp_path))
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert zero["calls"] == [0] and one["calls"] == []
    assert zero["got"] == one["got"] == {"draws": 100}
    assert zero["error"] == one["error"] == "data.task: cannot count"


def test_fit_chooses_the_held_out_set_once_for_its_validation_and_its_evaluation(tmp_path, monkeypatch):
    """`fw fit` checks the held-out set before it builds anything (fw validate's check), then its evaluation
    chooses it: one choice serves both (the fallback that holds every training sample's key takes seconds on a large
    run), and it is the set a fresh process chooses."""
    import yaml

    from framework import evaluation
    from framework.cli import main

    choices = []
    real = evaluation.Evaluation._choose

    def counted(self, *args):
        choices.append(args[-1])
        return real(self, *args)

    monkeypatch.setattr(evaluation.Evaluation, "_choose", counted)
    monkeypatch.setattr(evaluation, "_CHOSEN", {})
    cfg = rl_config(tmp_path / "run", max_steps=2, eval_cfg={**EVAL, "every_n_steps": 1, "held_out": True},
                    data={"task": {"class_path": "test_eval_held_out_bound.IndexDigits",
                                   "init_args": {"num_digits": 3}}})
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["fit", "--config", str(tmp_path / "fit.yaml")]) == 0
    assert choices == [2 * P]   # one choice, for the 2 rollout batches of P prompts the run draws
    (chosen,) = evaluation._CHOSEN.values()
    evaluation._CHOSEN.clear()   # as in a fresh process
    evaluation.Evaluation(cfg, None, draws=2 * P, choose_only=True)
    assert len(choices) == 2 and list(evaluation._CHOSEN.values()) == [chosen]
    assert len(chosen[0]) == EVAL["max_prompts"]
