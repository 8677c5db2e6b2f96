"""Evaluation on held-out data: pass@k against hand counts, held-out prompts (against the prompts real runs
drew: dynamic sampling, 2 processes, resumes on fewer processes or to more steps, SFT's packed rows), RL and
SFT metrics against independent computations, training untouched by evaluation, exact resume with evaluation
on, fw eval (overrides, the settings in its report, reports of other settings kept)."""

import hashlib
import itertools
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_eval_held_out_bound import edit_trainer_state

from framework.callbacks import EvalCallback
from framework.cli import main
from framework.config import load_config, resolve
from framework.errors import FwError
from framework.evaluation import HELD_OUT_ENTRY, Evaluation, pass_at_k, training_draws
from framework.metrics import read_metrics
from framework.tasks import Digits, build_task
from framework.tokenizer import build_tokenizer
from framework.trainer import fit

TIMING = {"tokens_per_s", "rollout/tokens_per_s", "rollout/seconds"}   # wall-clock dependent
ROOT = Path(__file__).resolve().parent.parent


class RecordingReward:
    """1 for a completion whose first character is an even digit; appends (prompt, completion, reward)
    to a JSONL file."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, prompt, completion, metadata):
        reward = float(completion[:1].isdigit() and int(completion[0]) % 2 == 0)
        with open(self.path, "a") as f:
            f.write(json.dumps([prompt, completion, reward]) + "\n")
        return reward


def grpo_config(run_dir, eval_cfg=None, callbacks=(), reward=None, **changes):
    cfg = {"recipe": "grpo", "seed": 5, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
           "data": {"task": {"name": "digits", "init_args": {"num_digits": 3, "rule": "next"}}, "chat_template": False},
           "rollout": {"prompts_per_step": 4, "max_new_tokens": 2}, "reward": reward or {"name": "numeric_match"},
           "grpo": {"group_size": 4}, "optimizer": {"lr": 3e-3},
           "trainer": {"accelerator": "cpu", "max_steps": 4, "enable_progress_bar": False},
           "checkpoint": {"every_n_steps": 2, "keep_last": None},
           "logging": {"csv": False, "tensorboard": False}, "callbacks": list(callbacks)}
    if eval_cfg is not None:
        cfg["eval"] = eval_cfg
    cfg.update(changes)
    return resolve(cfg)


EVAL = {"every_n_steps": 2, "at_start": True, "max_prompts": 6, "samples_per_prompt": 3}
# 2-digit prompts: 100 of them, so that a few dozen training draws hold many of the eval candidates
TWO_DIGITS = {"task": {"name": "digits", "init_args": {"num_digits": 2, "rule": "next"}}, "chat_template": False}
ONE_TOKEN = {"prompts_per_step": 4, "max_new_tokens": 1}


# ---------------------------------------------------------------- pass@k


def test_pass_at_k_against_hand_counts():
    # 5 samples, 2 correct: of the 10 pairs, the 3 pairs of wrong ones fail -> pass@2 = 7/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0 and pass_at_k(4, 1, 4) == 1.0
    # every k-subset of every pattern of n samples, counted one by one
    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_rl_eval_metrics_against_the_scored_samples(tmp_path):
    log = tmp_path / "rewards.jsonl"
    cfg = grpo_config(tmp_path / "run", {**EVAL, "samples_per_prompt": 4},
                      reward={"class_path": "test_eval.RecordingReward", "init_args": {"path": str(log)}})
    torch.manual_seed(0)
    from framework.models import build_policy

    tokenizer = build_tokenizer(cfg)
    policy = build_policy(cfg["model"]["policy"], tokenizer)
    metrics = Evaluation(cfg, tokenizer).run(policy)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 6 * 4   # max_prompts x samples_per_prompt
    by_prompt = {}
    for prompt, completion, reward in rows:
        by_prompt.setdefault(prompt, []).append((completion, reward))
    assert len(by_prompt) == 6 and all(len(v) == 4 for v in by_prompt.values())
    rewards = [r for _, _, r in rows]
    solved = sum(any(r for _, r in v) for v in by_prompt.values())
    assert 0 < sum(rewards) < len(rewards)   # a mix, so the counts below say something
    assert metrics["eval/reward_mean"] == pytest.approx(sum(rewards) / 24)
    assert metrics["eval/accuracy"] == pytest.approx(sum(rewards) / 24)
    assert metrics["eval/pass@k"] == pytest.approx(solved / 6)   # k = n: a prompt passes if any sample does
    assert metrics["eval/pass@1"] == pytest.approx(sum(sum(r for _, r in v) / 4 for v in by_prompt.values()) / 6)
    assert metrics["eval/mean@k"] == pytest.approx(sum(rewards) / 24)
    assert metrics["eval/prompts"] == 6
    assert 1 <= metrics["eval/response_len"] <= 2


def test_greedy_eval_samples_agree(tmp_path):
    log = tmp_path / "rewards.jsonl"
    cfg = grpo_config(tmp_path / "run", {**EVAL, "temperature": 0.0},
                      reward={"class_path": "test_eval.RecordingReward", "init_args": {"path": str(log)}})
    from framework.models import build_policy

    tokenizer = build_tokenizer(cfg)
    Evaluation(cfg, tokenizer).run(build_policy(cfg["model"]["policy"], tokenizer))
    by_prompt = {}
    for prompt, completion, _ in (json.loads(line) for line in log.read_text().splitlines()):
        by_prompt.setdefault(prompt, set()).add(completion)
    assert len(by_prompt) == 6 and all(len(v) == 1 for v in by_prompt.values())


# ---------------------------------------------------------------- held-out prompts


def test_eval_prompts_are_never_training_prompts(tmp_path):
    log = tmp_path / "train_rewards.jsonl"
    reward = {"class_path": "test_eval.RecordingReward", "init_args": {"path": str(log)}}
    # 2-digit prompts: 100 of them, 40 training draws, so many eval candidates are training prompts
    task = {"task": {"name": "digits", "init_args": {"num_digits": 2, "rule": "next"}}, "chat_template": False}
    cfg = grpo_config(tmp_path / "run", reward=reward, data=task,
                      rollout={"prompts_per_step": 4, "max_new_tokens": 1}, trainer={
                          "accelerator": "cpu", "max_steps": 10, "enable_progress_bar": False})
    fit(cfg)
    trained = {json.loads(line)[0] for line in log.read_text().splitlines()}
    assert len(trained) > 20
    cfg["eval"].update(max_prompts=40)
    evaluation = Evaluation(cfg, build_tokenizer(cfg))
    assert len(evaluation.texts) == 40 and len(set(evaluation.texts)) == 40
    assert not set(evaluation.texts) & trained
    # the same seed as training draws the training prompts first: all of those are skipped
    same = Evaluation({**cfg, "eval": {**cfg["eval"], "seed": cfg["seed"]}}, build_tokenizer(cfg))
    assert not set(same.texts) & trained


class Unanswered(Digits):
    """Digits whose samples keep no reference answer in their metadata."""

    def sample(self, index):
        return {**super().sample(index), "metadata": {}}


def test_a_held_out_sample_without_the_metadata_its_reward_reads_is_named(tmp_path):
    """The eval set's samples are checked for what the reward reads of them, as training's are, when it is built to
    be scored; choosing them alone (fw validate's check of the held-out set) reads no reward."""
    cfg = grpo_config(tmp_path / "run", EVAL, data={"task": {"class_path": "test_eval.Unanswered"},
                                                    "chat_template": False}, rollout=ONE_TOKEN)
    with pytest.raises(FwError, match=r"^data\.task: Unanswered\.sample\(\d+\): metadata has no 'answer', which the "
                                      r"reward 'numeric_match' reads \(it is empty\)$"):
        Evaluation(cfg, build_tokenizer(cfg))
    Evaluation(cfg, None, choose_only=True)


@pytest.mark.parametrize(("max_steps", "wanted"), [(10, 40), (50, 10), (50, 60)])
def test_the_held_out_set_is_the_first_eval_prompts_no_training_draw_has(tmp_path, max_steps, wanted):
    # (10, 40): few of the first candidates are training prompts; (50, 10): most are, so more are read;
    # (50, 60): fewer than 60 prompts are left, and every one of them is taken
    cfg = grpo_config(tmp_path / "run", {**EVAL, "max_prompts": wanted}, data=TWO_DIGITS, rollout=ONE_TOKEN,
                      trainer={"accelerator": "cpu", "max_steps": max_steps})
    train, source = build_task(cfg["data"], seed=cfg["seed"]), build_task(cfg["data"], seed=cfg["seed"] + 1)
    trained = {train.sample(i)["prompt"] for i in range(max_steps * 4)}   # 4 prompts a step, one process
    expected = []
    for i in range(100 * wanted + len(trained)):
        prompt = source.sample(i)["prompt"]
        if prompt not in trained and prompt not in expected:
            expected.append(prompt)
            if len(expected) == wanted:
                break
    assert Evaluation(cfg, build_tokenizer(cfg)).texts == expected


@pytest.fixture(scope="module")
def dynamic_run(tmp_path_factory):
    """A 5-step GRPO run with dynamic sampling (up to 10 rounds a step) that does not evaluate: its directory,
    config, the prompts it scored and the number of prompts it drew (from its metrics)."""
    base = tmp_path_factory.mktemp("dynamic")
    log = base / "rewards.jsonl"
    reward = {"class_path": "test_eval.RecordingReward", "init_args": {"path": str(log)}}
    cfg = grpo_config(base / "run", reward=reward, data=TWO_DIGITS, rollout=ONE_TOKEN,
                      grpo={"group_size": 4, "dynamic_sampling": True, "dynamic_sampling_max_rounds": 10},
                      trainer={"accelerator": "cpu", "max_steps": 5, "enable_progress_bar": False})
    fit(cfg)
    trained = {json.loads(line)[0] for line in log.read_text().splitlines()}
    log.write_text("")
    metrics = read_metrics(base / "run" / "metrics.jsonl")
    drawn = sum(r["rollout/groups_drawn"] for r in metrics if "rollout/groups_drawn" in r)
    assert drawn > 5 * 4 and len(trained) > 5 * 4   # steps of several rounds: more than one batch a step
    return SimpleNamespace(run=base / "run", cfg=cfg, trained=trained, drawn=drawn, log=log)


def test_dynamic_sampling_rounds_are_left_out_of_the_eval_set(dynamic_run):
    cfg = {**dynamic_run.cfg, "eval": {**dynamic_run.cfg["eval"], "max_prompts": 30}}
    texts = Evaluation(cfg, build_tokenizer(cfg)).texts
    assert texts and not set(texts) & dynamic_run.trained


def test_fw_eval_of_a_run_that_did_not_evaluate_leaves_out_what_it_drew(dynamic_run, tmp_path):
    out = tmp_path / "report.json"
    dynamic_run.log.write_text("")
    assert main(["eval", "--checkpoint", str(dynamic_run.run), "--eval.max_prompts=30", "--eval.samples_per_prompt=1",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["held_out_draws"] == dynamic_run.drawn   # the checkpoint's data position
    evaluated = {json.loads(line)[0] for line in dynamic_run.log.read_text().splitlines()}
    assert len(evaluated) == report["metrics"]["eval/prompts"] and not evaluated & dynamic_run.trained


def eval_start(cfg, tokenizer, world_size, step=0, position=0, saved=None):
    """An EvalCallback started as `fit` starts it, on `world_size` processes at `step` and data `position`
    (a resumed run restores `saved`, the callback's state in the checkpoint, first)."""
    callback = EvalCallback(cfg)
    trainer = SimpleNamespace(world_size=world_size, global_step=step, is_global_zero=True)
    module = SimpleNamespace(tokenizer=tokenizer, recipe=SimpleNamespace(prompt_position=position))
    if saved is not None:
        callback.on_load_checkpoint(trainer, module, saved)
    callback.on_train_start(trainer, module)
    return callback


def saved_checkpoint(callback):
    """The entries `callback` puts in a checkpoint."""
    checkpoint = {}
    callback.on_save_checkpoint(SimpleNamespace(), SimpleNamespace(), checkpoint)
    return checkpoint


def test_a_run_resumed_on_fewer_processes_keeps_its_eval_set(tmp_path):
    cfg = grpo_config(tmp_path / "run", {**EVAL, "at_start": False, "max_prompts": 30}, data=TWO_DIGITS,
                      rollout=ONE_TOKEN, trainer={"accelerator": "cpu", "max_steps": 5})
    tokenizer = build_tokenizer(cfg)
    first = eval_start(cfg, tokenizer, world_size=2)
    train = build_task(cfg["data"], seed=cfg["seed"])
    trained = {train.sample(i)["prompt"] for i in range(5 * 4 * 2)}   # 5 steps of 4 prompts on each of 2 ranks
    assert not set(first.evaluation.texts) & trained
    # resumed at step 2 (16 prompts drawn) on 1 process: the 2-process run's eval set still
    resumed = eval_start(cfg, tokenizer, world_size=1, step=2, position=16, saved=saved_checkpoint(first))
    assert resumed.evaluation.texts == first.evaluation.texts
    assert Evaluation(cfg, tokenizer).texts != first.evaluation.texts   # what a 1-process run leaves out


def test_a_longer_resume_raises_the_held_out_bound_and_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    eval_cfg = {**EVAL, "at_start": False, "max_prompts": 30, "samples_per_prompt": 1}
    fit(grpo_config(run, eval_cfg, data=TWO_DIGITS, rollout=ONE_TOKEN,
                    trainer={"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False}))
    out = tmp_path / "two.json"
    assert main(["eval", "--checkpoint", str(run), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["held_out_draws"] == 2 * 4
    capsys.readouterr()
    cfg = grpo_config(run, eval_cfg, data=TWO_DIGITS, rollout=ONE_TOKEN,
                      trainer={"accelerator": "cpu", "max_steps": 10, "enable_progress_bar": False})
    fit(cfg, resume="last")
    assert "fw: warning: eval: this run can draw 40 training samples, more than the 8" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["step"] == 10 and report["held_out_draws"] == 10 * 4
    train = build_task(cfg["data"], seed=cfg["seed"])
    trained = {train.sample(i)["prompt"] for i in range(10 * 4)}
    assert not set(Evaluation(cfg, build_tokenizer(cfg), draws=report["held_out_draws"]).texts) & trained


@pytest.mark.slow   # two Lightning process start-ups: long on a 2-core machine
def test_fw_eval_of_a_two_process_run_leaves_out_both_ranks_prompts(tmp_path):
    from test_ddp import fit_in_subprocess

    log = tmp_path / "rewards.jsonl"
    run = tmp_path / "run"
    cfg = grpo_config(run, reward={"class_path": "test_eval.RecordingReward", "init_args": {"path": str(log)}},
                      data=TWO_DIGITS, rollout=ONE_TOKEN,
                      trainer={"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": 5,
                               "enable_progress_bar": False})
    fit_in_subprocess(tmp_path, cfg)
    trained = {json.loads(line)[0] for line in log.read_text().splitlines()}
    assert len(trained) > 5 * 4   # both ranks' prompts
    log.write_text("")
    assert main(["eval", "--checkpoint", str(run), "--eval.max_prompts=30", "--eval.samples_per_prompt=1",
                 "--out", str(tmp_path / "report.json")]) == 0
    evaluated = {json.loads(line)[0] for line in log.read_text().splitlines()}
    assert evaluated and not evaluated & trained
    assert json.loads((tmp_path / "report.json").read_text())["held_out_draws"] == 5 * 4 * 2


def test_a_task_without_held_out_prompts_is_refused(tmp_path):
    task = {"task": {"name": "digits", "init_args": {"num_digits": 1}}, "chat_template": False}
    cfg = grpo_config(tmp_path / "run", EVAL, data=task, trainer={"accelerator": "cpu", "max_steps": 20})
    assert {Digits(seed=5).sample(i)["prompt"] for i in range(80)} == {f"{d}=" for d in range(10)}
    with pytest.raises(FwError, match="every sample of the training task drawn with eval.seed is also a training"):
        Evaluation(cfg, build_tokenizer(cfg))


def test_jsonl_eval_file_leaves_out_training_records(tmp_path):
    train = tmp_path / "train.jsonl"
    held = tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(5)))
    held.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3, 9)))
    cfg = grpo_config(tmp_path / "run", {**EVAL, "path": str(held), "max_prompts": 10},
                      data={"path": str(train), "chat_template": False})
    texts = Evaluation(cfg, build_tokenizer(cfg)).texts
    assert sorted(texts) == [f"{i}+1=" for i in range(5, 9)]


def test_an_eval_file_answer_numeric_match_cannot_read_is_named_before_the_run(tmp_path):
    """The eval file's answers are checked as the training file's are, naming the file and line, before any
    training; not met mid-run while scoring."""
    train = tmp_path / "train.jsonl"
    held = tmp_path / "held.jsonl"
    train.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    held.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n"
                    + json.dumps({"prompt": "3+3=", "answer": "six"}) + "\n")
    cfg = grpo_config(tmp_path / "run", {**EVAL, "path": str(held)}, data={"path": str(train), "chat_template": False})
    with pytest.raises(FwError, match=f"^{held}:2: the reference answer 'six' is not one number"):
        Evaluation(cfg, build_tokenizer(cfg))


def test_jsonl_training_data_needs_an_eval_path(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    cfg = grpo_config(tmp_path / "run", EVAL, data={"path": str(train), "chat_template": False})
    with pytest.raises(FwError, match="set eval.path to a held-out JSONL file"):
        EvalCallback(cfg)


# ---------------------------------------------------------------- training untouched, exact resume


def training_lines(records):
    """The records without eval and wall-clock metrics (records of eval metrics alone left out)."""
    out = [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("eval/")} for r in records]
    return [r for r in out if len(r) > 1]


def eval_lines(records):
    """{step, eval/...} of every record that holds eval metrics."""
    return [{k: v for k, v in r.items() if k == "step" or k.startswith("eval/")} for r in records
            if any(k.startswith("eval/") for k in r)]


def weights(run_dir, step=4):
    return load_file(str(Path(run_dir) / "checkpoints" / f"step-{step:06d}" / "policy" / "model.safetensors"))


def test_eval_leaves_training_untouched_and_resumes_exactly(tmp_path, capsys):
    plain, evaluated, broken = tmp_path / "plain", tmp_path / "eval", tmp_path / "broken"
    fit(grpo_config(plain))
    trainer = fit(grpo_config(evaluated, EVAL, trainer={"accelerator": "cpu", "max_steps": 4,
                                                        "enable_progress_bar": True}))
    shown = capsys.readouterr()
    assert "\reval: " in shown.out + shown.err   # the progress bar says when it evaluates
    got = read_metrics(evaluated / "metrics.jsonl")
    assert training_lines(got) == training_lines(read_metrics(plain / "metrics.jsonl"))
    a, b = weights(plain), weights(evaluated)
    assert all(torch.equal(a[k], b[k]) for k in a)
    evals = eval_lines(got)
    assert [r["step"] for r in evals] == [0, 2, 4]
    history = next(cb for cb in trainer.callbacks if isinstance(cb, EvalCallback)).history
    assert [(s, {"step": s, **m}) for s, m in history] == [(r["step"], r) for r in evals]

    crash = {"class_path": "test_resume.CrashAt", "init_args": {"step": 3}}
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(grpo_config(broken, EVAL, callbacks=[crash]))
    fit(grpo_config(broken, EVAL), resume="last")
    resumed = read_metrics(broken / "metrics.jsonl")
    assert eval_lines(resumed) == evals   # the step-2 eval before the crash, the step-4 one after the resume
    assert training_lines(resumed) == training_lines(got)
    c = weights(broken)
    assert all(torch.equal(a[k], c[k]) for k in a)

    # fw eval of the step-4 checkpoint: what training logged at step 4, as a table and a JSON file
    capsys.readouterr()
    out = tmp_path / "report.json"
    assert main(["eval", "--checkpoint", str(evaluated / "checkpoints" / "step-000004"), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["step"] == 4
    assert {"step": 4, **report["metrics"]} == evals[-1]
    assert "eval/pass@k" in table and f"wrote {out}" in table
    # a run directory: its newest checkpoint, the report under <run_dir>/eval/
    assert main(["eval", "--checkpoint", str(evaluated)]) == 0
    assert json.loads((evaluated / "eval" / "step-000004.json").read_text())["metrics"] == report["metrics"]
    # a report path that cannot be written: one line, before the evaluation (no table printed)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(evaluated), "--out", str(tmp_path)]) == 2
    shown = capsys.readouterr()
    assert shown.err.splitlines() == [(f"fw: error: --out {tmp_path}: a directory; give the JSON report's file path, "
                                      f"e.g. {tmp_path / 'report.json'}")] and shown.out == ""
    assert main(["eval", "--checkpoint", str(evaluated), "--out", str(out / "sub" / "r.json")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"fw: error: --out {out / 'sub' / 'r.json'}: cannot create its folder: {out} is a file"]


def test_fw_eval_errors_are_one_line(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fw: error: ")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A 2-step GRPO run that evaluates, its checkpoint at step 2."""
    run = tmp_path_factory.mktemp("small") / "run"
    fit(grpo_config(run, {**EVAL, "at_start": False}, trainer={"accelerator": "cpu", "max_steps": 2,
                                                               "enable_progress_bar": False}))
    return run


def test_fw_eval_reports_record_their_settings_and_never_replace_other_settings(small_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    reports = run / "eval"
    own = reports / "step-000002.json"
    assert main(["eval", "--checkpoint", str(run)]) == 0
    first = own.read_bytes()
    report = json.loads(first)
    assert report["eval"] == load_config([str(run / "config.yaml")])["eval"]
    assert report["eval"]["samples_per_prompt"] == 3
    assert report["reward"]["name"] == "numeric_match" and report["changes"] == {}
    # other settings (a config file and overrides): a report of their own, named by the config's sha256
    argv = ["eval", "--checkpoint", str(run), "--config", str(run / "config.yaml"), "--eval.samples_per_prompt=1",
            "--eval.temperature=0"]
    assert main(argv) == 0
    assert own.read_bytes() == first
    cfg = load_config([str(run / "config.yaml")], argv[-2:])
    del cfg["run_dir"], cfg["name"]   # where the run writes: not a setting of the evaluation
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())
    other = reports / f"step-000002-{digest.hexdigest()[:8]}.json"
    second = json.loads(other.read_text())
    assert second["eval"]["samples_per_prompt"] == 1 and second["eval"]["temperature"] == 0
    assert second["changes"] == {"eval.samples_per_prompt": 1, "eval.temperature": 0}
    assert second["metrics"]["eval/pass@k"] == second["metrics"]["eval/pass@1"]   # k = 1
    # the same settings again replace their own report; nothing else is left in the folder
    assert main(argv) == 0
    assert sorted(reports.iterdir()) == sorted([own, other])
    # a report at the default path that records no settings (an older fw's) is not replaced
    legacy = json.dumps({"checkpoint": "x", "step": 2, "recipe": "grpo", "metrics": {"eval/accuracy": 0.5}})
    own.write_text(legacy)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run)]) == 2
    assert own.read_text() == legacy
    assert capsys.readouterr().err.splitlines() == [
        (f"fw: error: {own} holds the report of an evaluation with other settings (or of an fw that did not record "
         "them); move it away, or give --out FILE for this one")]


def test_fw_eval_reports_are_named_by_the_settings_it_reads_alone(small_run, tmp_path, capsys):
    """How the run trains, logs and saves (optimizer, scheduler, logging, checkpoint cadence, trainer.max_steps of a
    checkpoint that records its held-out bound) changes nothing the evaluation reads: a config that differs there
    alone evaluates as the checkpoint's own, and one that differs in read settings too keeps the name those alone
    give, which is the name they always gave. They used to be changes, each combination a report of its own."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    reports = run / "eval"
    own = reports / "step-000002.json"
    training = ["--optimizer.lr=0.5", "--scheduler.warmup_steps=1", "--logging.csv=true", "--checkpoint.keep_last=1",
                "--trainer.max_steps=50", "--trainer.log_every_n_steps=3"]
    assert main(["eval", "--checkpoint", str(run), *training]) == 0
    assert sorted(p.name for p in reports.iterdir()) == [own.name]
    assert json.loads(own.read_text())["changes"] == {}
    read = ["--eval.samples_per_prompt=1"]
    cfg = load_config([str(run / "config.yaml")], read)
    del cfg["run_dir"], cfg["name"]
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())
    other = reports / f"step-000002-{digest.hexdigest()[:8]}.json"
    for argv in ([*read, *training], read):
        assert main(["eval", "--checkpoint", str(run), *argv]) == 0
        assert sorted(reports.iterdir()) == sorted([own, other]), argv
        assert json.loads(other.read_text())["changes"] == {"eval.samples_per_prompt": 1}
    # a checkpoint that records neither its held-out bound nor its data position: its training samples are counted
    # from trainer.max_steps, which then counts as a setting
    shutil.rmtree(reports)
    state = edit_trainer_state(run / "checkpoints" / "step-000002",
                               lambda s: (s.pop(HELD_OUT_ENTRY), s["fw_recipe"].pop("prompt_position")))
    assert state[0]["draws"] > 0 and state[1] > 0
    assert main(["eval", "--checkpoint", str(run), "--trainer.max_steps=50"]) == 0
    (hashed,) = reports.iterdir()
    assert hashed != own and json.loads(hashed.read_text())["changes"] == {"trainer.max_steps": 50}
    capsys.readouterr()


def test_fw_eval_names_its_report_by_the_keys_it_reads_alone(small_run, tmp_path, capsys):
    """fw eval of an RL checkpoint reads none of the recipe section's loss settings, model.reference / model.value,
    the eval cadence, checkpoint.verify, rollout.temperature (eval.temperature is what it samples at) or the SFT data
    keys: a config that differs there alone generates the same completions, into the same report. They used to be
    changes, each a report of its own. A key it reads (eval.temperature, the sample count, the run's seed where
    eval.seed is null, a sampling setting of rollout) gives other completions and a report of its own, named as it
    always was, whatever the unread keys say."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    reports = run / "eval"
    log = tmp_path / "scored.jsonl"
    # a reward that records what it scores: the completions each evaluation generated
    recording = ["--reward.name=null", "--reward.class_path=test_eval.RecordingReward",
                 f"--reward.init_args.path={log}"]

    def evaluate(*args: str) -> list:
        log.unlink(missing_ok=True)
        assert main(["eval", "--checkpoint", str(run), *recording, *args]) == 0, args
        return [json.loads(line) for line in log.read_text().splitlines()]

    scored = evaluate()
    (first,) = reports.iterdir()
    assert json.loads(first.read_text())["changes"] == {"reward.class_path": "test_eval.RecordingReward",
                                                       "reward.init_args.path": str(log), "reward.name": None}
    unread = ["--grpo.clip_eps_high=0.3", "--grpo.loss_agg=seq-mean-token-mean", f"--model.reference.path={tmp_path}",
              f"--model.value.path={tmp_path}", "--eval.every_n_steps=7", "--eval.at_start=true",
              "--checkpoint.verify=false", "--rollout.temperature=0.5", "--rollout.keep_engine=false",
              "--data.max_seq_len=64", "--data.batch_size=3", "--data.pack=false", "--data.format=messages"]
    for arg in unread:
        assert evaluate(arg) == scored, arg
        assert list(reports.iterdir()) == [first], arg
    cfg = load_config([str(run / "config.yaml")])
    assert cfg["eval"]["seed"] is None and cfg["eval"]["held_out"]   # the run's seed draws the eval samples
    read = {"--eval.temperature=0.5": {"eval.temperature": 0.5}, "--eval.samples_per_prompt=2":
            {"eval.samples_per_prompt": 2}, "--seed=6": {"seed": 6}, "--eval.max_new_tokens=1":
            {"eval.max_new_tokens": 1}, "--rollout.top_k=3": {"rollout.top_k": 3}}
    for arg, changes in read.items():
        before = set(reports.iterdir())
        assert evaluate(arg) != scored, arg
        (report,) = set(reports.iterdir()) - before
        assert json.loads(report.read_text())["changes"] == {**json.loads(first.read_text())["changes"], **changes}
        # the name a config that differs in these keys alone always had
        cfg = load_config([str(run / "config.yaml")], [*recording, arg])
        del cfg["run_dir"], cfg["name"]
        digest = hashlib.sha256(json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())
        assert report.name == f"step-000002-{digest.hexdigest()[:8]}.json", arg
        # with every unread key changed too: the same report, replaced
        evaluate(arg, *unread)
        assert set(reports.iterdir()) == before | {report}, arg
    capsys.readouterr()


def test_fw_eval_of_sft_names_its_report_by_the_keys_sft_reads(tmp_path, capsys):
    """SFT evaluates the loss of eval.path's examples: it reads no reward, rollout or RL eval setting, not
    sft.train_on_prompt (the eval loss covers the completions), and neither seed nor eval.seed, which draw nothing
    from a JSONL file. Its data keys are read, each a change."""
    lines = (ROOT / "recipes" / "data" / "arithmetic_chat.jsonl").read_text().splitlines()
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("\n".join(lines[:8]) + "\n")
    held.write_text("\n".join(lines[8:12]) + "\n")
    run = tmp_path / "run"
    fit(sft_config(run, train, held))
    reports = run / "eval"
    own = reports / "step-000002.json"
    assert main(["eval", "--checkpoint", str(run)]) == 0
    metrics = json.loads(own.read_text())["metrics"]
    for arg in ["--sft.train_on_prompt=true", "--reward.name=numeric_match", "--rollout.max_new_tokens=5",
                "--eval.samples_per_prompt=1", "--eval.temperature=0", "--seed=7", "--eval.seed=3",
                "--data.shuffle=false", "--data.pack=false"]:
        assert main(["eval", "--checkpoint", str(run), arg]) == 0, arg
        assert sorted(reports.iterdir()) == [own], arg
        report = json.loads(own.read_text())
        assert report["changes"] == {} and report["metrics"] == metrics, arg
    for arg, changes in {"--data.max_seq_len=128": {"data.max_seq_len": 128},
                         "--data.batch_size=1": {"data.batch_size": 1}}.items():
        before = set(reports.iterdir())
        assert main(["eval", "--checkpoint", str(run), arg]) == 0
        (report,) = set(reports.iterdir()) - before
        assert json.loads(report.read_text())["changes"] == changes, arg
    capsys.readouterr()


def test_fw_eval_out_replaces_an_earlier_report_but_no_other_file(small_run, tmp_path, capsys):
    config = tmp_path / "train.yaml"   # --out given the config meant for --config
    config.write_text("recipe: grpo\n")
    assert main(["eval", "--checkpoint", str(small_run), "--out", str(config)]) == 2
    shown = capsys.readouterr()
    assert config.read_text() == "recipe: grpo\n" and shown.out == ""
    assert shown.err.splitlines() == [(f"fw: error: --out {config}: the file there is not an fw eval report, which "
                                       "is all --out replaces; give another path, or move it away")]
    out = tmp_path / "r.json"
    assert main(["eval", "--checkpoint", str(small_run), "--out", str(out)]) == 0
    assert main(["eval", "--checkpoint", str(small_run), "--out", str(out), "--eval.samples_per_prompt=1"]) == 0
    assert json.loads(out.read_text())["eval"]["samples_per_prompt"] == 1


def test_fw_eval_overrides_apply_to_the_checkpoints_own_config(small_run, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["eval", "--checkpoint", str(small_run), "--eval.samples_per_prompt=1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["eval"]["samples_per_prompt"] == 1 and report["changes"] == {"eval.samples_per_prompt": 1}
    m = report["metrics"]
    assert m["eval/pass@k"] == m["eval/pass@1"] == m["eval/accuracy"]   # one 0/1 sample a prompt
    # a bad override: its own line, as fw fit prints it
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(small_run), "--eval.samples_per_prompt=0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "override '--eval.samples_per_prompt=0': eval.samples_per_prompt: must be >= 1, got 0"]



def test_fw_eval_names_an_override_that_changes_the_checkpoints_recipe(small_run, capsys):
    """The checkpoint's config.yaml holds its recipe's grpo: section, which recipe sft refuses: the refusal is
    the override's, with the way that works (a config of that recipe), not a line of the file the user never
    wrote; the other overrides' problems keep their places."""
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(small_run), "--eval.samples_per_prompt=0", "--recipe=sft"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "override '--eval.samples_per_prompt=0': eval.samples_per_prompt: must be >= 1, got 0",
        ("override '--recipe=sft': recipe: the checkpoint's config.yaml is of recipe grpo and holds grpo:, which "
         "recipe sft does not allow; to read the checkpoint under recipe sft, give a config of that recipe with "
         "--config FILE")]


# ---------------------------------------------------------------- SFT


def sft_config(run_dir, train, held, **eval_changes):
    return resolve({
        "recipe": "sft", "seed": 1, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
        "data": {"path": str(train), "max_seq_len": 256, "batch_size": 2},
        "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False},
        "logging": {"csv": False, "tensorboard": False},
        "eval": {"path": str(held), "every_n_steps": 1, "max_prompts": 5, **eval_changes}})


def test_sft_eval_against_float64_reference(tmp_path):
    lines = (ROOT / "recipes" / "data" / "arithmetic_chat.jsonl").read_text().splitlines()
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("\n".join(lines[:6]) + "\n")
    held.write_text("\n".join(lines[4:11]) + "\n")   # two training records, then five held-out ones
    cfg = sft_config(tmp_path / "run", train, held)
    from framework.data import IGNORE, encode_record
    from framework.models import build_policy

    tokenizer = build_tokenizer(cfg)
    torch.manual_seed(0)
    policy = build_policy(cfg["model"]["policy"], tokenizer)
    metrics = Evaluation(cfg, tokenizer).run(policy)

    nll = correct = count = 0.0
    for line in lines[6:11]:
        ex = encode_record(json.loads(line), "auto", tokenizer, cfg, "ref", train_on_prompt=False)
        with torch.no_grad():
            hidden = policy(torch.tensor([ex.ids]), return_hidden=True)[0].double()
        logits = hidden @ policy.lm_head_weight.detach().double().T
        targets = torch.tensor(ex.targets)
        keep = targets != IGNORE
        logp = torch.log_softmax(logits[keep], dim=-1).gather(1, targets[keep][:, None])
        nll -= float(logp.sum())
        correct += float((logits[keep].argmax(-1) == targets[keep]).sum())
        count += float(keep.sum())
    assert metrics["eval/tokens"] == count
    assert metrics["eval/loss"] == pytest.approx(nll / count, rel=1e-5)
    assert metrics["eval/perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert metrics["eval/token_accuracy"] == pytest.approx(correct / count)


def test_sft_fit_logs_eval_every_step(tmp_path):
    lines = (ROOT / "recipes" / "data" / "arithmetic_chat.jsonl").read_text().splitlines()
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("\n".join(lines[:8]) + "\n")
    held.write_text("\n".join(lines[8:12]) + "\n")
    fit(sft_config(tmp_path / "run", train, held))
    evals = eval_lines(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in evals] == [1, 2]
    assert all(set(r) == {"step", "eval/loss", "eval/perplexity", "eval/token_accuracy", "eval/tokens"} for r in evals)
    assert evals[1]["eval/loss"] != evals[0]["eval/loss"]   # the weights changed in between


def test_fw_eval_names_eval_path_when_it_cannot_use_it(small_run, tmp_path, capsys):
    """An --eval.path that is missing, a directory or empty is reported as eval.path (its readers are the training
    data's), for SFT and RL; an empty SFT file is not said to hold the training data."""
    lines = (ROOT / "recipes" / "data" / "arithmetic_chat.jsonl").read_text().splitlines()
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("\n".join(lines[:8]) + "\n")
    held.write_text("\n".join(lines[8:12]) + "\n")
    fit(sft_config(tmp_path / "sft", train, held))
    missing, empty = tmp_path / "missing.jsonl", tmp_path / "empty.jsonl"
    empty.write_text("\n")
    wanted = [f"fw: error: eval.path: cannot read {missing}: No such file or directory",
              f"fw: error: eval.path: cannot read {tmp_path}: Is a directory",
              f"fw: error: eval.path {empty}: no records (every line is empty)"]
    for run in (tmp_path / "sft", small_run):
        capsys.readouterr()
        for path in (missing, tmp_path, empty):
            assert main(["eval", "--checkpoint", str(run), f"--eval.path={path}"]) == 2
        assert capsys.readouterr().err.splitlines() == wanted, run


def test_sft_task_leaves_out_exactly_the_examples_training_packs(tmp_path):
    cfg = resolve({
        "recipe": "sft", "seed": 3, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
        "data": {"task": {"name": "arithmetic", "init_args": {"digits": 2}}, "chat_template": False,
                 "max_seq_len": 64, "batch_size": 2},
        "trainer": {"accelerator": "cpu", "max_steps": 3, "accumulate_grad_batches": 2, "enable_progress_bar": False},
        "logging": {"csv": False, "tensorboard": False}, "eval": {"every_n_steps": 3, "max_prompts": 8}})
    trainer = fit(cfg)
    position = trainer.lightning_module.recipe.position   # the examples the run's packed rows took
    assert 3 * 2 * 2 < position < 3 * 2 * 2 * 64 // 2   # several a row, far fewer than 2-token examples
    assert training_draws(cfg, 1) == position
    callback = next(cb for cb in trainer.callbacks if isinstance(cb, EvalCallback))
    assert callback.evaluation.draws == position
    train = build_task(cfg["data"], seed=cfg["seed"])
    trained = {json.dumps(train.sft_example(i), sort_keys=True) for i in range(position)}
    source = build_task(cfg["data"], seed=cfg["seed"] + 1)
    evaluated = [source.sft_example(i) for i in range(200)]
    tokenizer = build_tokenizer(cfg)
    from framework.data import encode_record

    expected = [encode_record(r, "prompt_completion", tokenizer, cfg, "ref", train_on_prompt=False).ids
                for r in evaluated if json.dumps(r, sort_keys=True) not in trained][:8]
    assert [e.ids for e in callback.evaluation.examples] == expected


@pytest.mark.parametrize("path", ["train.yaml", "recipes/grpo.yaml", "recipes/ppo.yaml", "recipes/sft.yaml"])
def test_shipped_configs_evaluate(path):
    cfg = load_config([str(ROOT / path)])
    assert cfg["eval"]["every_n_steps"] is not None
    evaluation = Evaluation(cfg, build_tokenizer(cfg))   # held-out data, or a task with held-out prompts
    held = evaluation.texts if evaluation.rl else evaluation.examples
    assert len(held) == cfg["eval"]["max_prompts"]


def test_an_evaluation_hands_each_module_its_own_training_mode_back(tmp_path):
    """The evaluation runs the policy in eval mode and gives every module its own flag back: a layer kept in eval
    mode inside a training policy stays in eval mode."""
    from framework.evaluation import Evaluation
    from framework.models import build_policy
    from framework.tokenizer import build_tokenizer

    cfg = resolve({"recipe": "grpo", "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
                   "data": {"task": {"name": "digits"}}, "rollout": {"max_new_tokens": 4},
                   "eval": {"every_n_steps": 1, "max_prompts": 4, "held_out": False},
                   "trainer": {"accelerator": "cpu"}})
    tok = build_tokenizer(cfg)
    policy = build_policy(cfg["model"]["policy"], tok, seed=0).train()
    kept = policy.model.layers[0]
    kept.eval()
    Evaluation(cfg, tok).run(policy)
    assert policy.training and not any(m.training for m in kept.modules())


# Every schema key `read_keys` never counts, for any recipe or case: how a run trains, logs, saves and where it
# writes. A key added to the schema fails the test below until it is placed: in framework/evaluation.py's read lists
# if `fw eval` reads it (else two evals that differ there would share a report, the second replacing the first),
# here if it does not.
NEVER_READ_BY_EVAL = {
    "name", "run_dir", "callbacks", "checkpoint.every_n_steps", "checkpoint.keep_last", "checkpoint.verify",
    "eval.at_start", "eval.every_n_steps", "logging.csv", "logging.loggers", "logging.tensorboard",
    "model.reference.path", "model.value.path", "rollout.keep_engine", "rollout.temperature",
    "optimizer.betas", "optimizer.cpu_offload", "optimizer.eps", "optimizer.fused", "optimizer.lr",
    "optimizer.max_grad_norm", "optimizer.name", "optimizer.stochastic_rounding", "optimizer.weight_decay",
    "scheduler.min_lr_ratio", "scheduler.name", "scheduler.warmup_steps", "sft.train_on_prompt",
    "trainer.devices", "trainer.enable_progress_bar", "trainer.log_every_n_steps", "trainer.memory_limit_gib",
    "trainer.num_nodes", "trainer.stop_grace_s", "trainer.strategy",
}


def _schema_leaves(node: dict, prefix: str = "") -> set[str]:
    leaves = set()
    for key, sub in node.get("properties", {}).items():
        dotted = f"{prefix}.{key}" if prefix else key
        below = set().union(*(_schema_leaves(alt, dotted) for alt in [sub, *sub.get("anyOf", []),
                                                                     *sub.get("oneOf", [])]))
        leaves |= below or {dotted}
    return leaves


def test_every_schema_key_is_placed_as_read_or_not_read_by_fw_eval(tmp_path):
    from framework.config import schema_text
    from framework.evaluation import _is_read, read_keys

    leaves = _schema_leaves(json.loads(schema_text()))
    assert not NEVER_READ_BY_EVAL - leaves, "keys no longer in the schema"
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    ever_read = set()
    for recipe, changes in (("grpo", []), ("ppo", []), ("sft", []), ("grpo", [f"--data.path={data}"])):
        cfg = load_config([str(ROOT / "recipes" / f"{recipe}.yaml")],
                          [*changes, "--eval.seed=null", "--eval.held_out=true"])
        if changes:
            cfg["data"]["task"] = None
        for known in (True, False):
            read = read_keys(cfg, known)
            ever_read |= {k for k in leaves if _is_read(k, read)}
    unplaced = leaves - ever_read - NEVER_READ_BY_EVAL
    assert not unplaced, f"place each in framework/evaluation.py's read lists or in NEVER_READ_BY_EVAL: {unplaced}"
    assert not ever_read & NEVER_READ_BY_EVAL
