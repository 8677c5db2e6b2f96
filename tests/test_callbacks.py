"""fw optimizer-step hooks: exactly once around every real optimizer step, for every optimizer, in
automatic (with and without accumulation) and manual optimization, loaded from `callbacks:`."""

import json
from pathlib import Path
from typing import ClassVar

import lightning
import pytest
import torch

from framework.callbacks import Callback
from framework.config import resolve
from framework.data import IGNORE
from framework.recipe import POLICY, OptimizerRole, Requirements
from framework.schedule import LRSchedule
from framework.trainer import fit
from recipes.sft import SFTRecipe

DATA = "recipes/data/arithmetic_chat.jsonl"


class Recorder(Callback):
    """Records every fw hook call with the optimizer's role and the state of its gradients."""

    def __init__(self, tag: str = ""):
        self.tag = tag
        self.events = []
        self.micro_batches = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.micro_batches += 1

    def before_optimizer_step(self, trainer, module, optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
        self.events.append(("before", module.optimizer_role(optimizer), module.policy_version,
                            self.micro_batches, len(grads) == len(params), norm,
                            [p.detach().clone() for p in params]))

    def after_optimizer_step(self, trainer, module, optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.events.append(("after", module.optimizer_role(optimizer), module.policy_version,
                            self.micro_batches, None, None, [p.detach().clone() for p in params]))


def changed(before, after):
    return any(not torch.equal(a, b) for a, b in zip(before, after))


def base_cfg(tmp_path, recipe="sft", **trainer):
    return {"recipe": recipe, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
            "data": {"path": DATA, "max_seq_len": 64, "batch_size": 2},
            "optimizer": {"lr": 1e-3, "max_grad_norm": 0.05},
            "trainer": {"accelerator": "cpu", "max_steps": 3, "enable_progress_bar": False, **trainer},
            "checkpoint": {"every_n_steps": 100}, "logging": {"csv": False, "tensorboard": False},
            "callbacks": [{"class_path": "test_callbacks.Recorder", "init_args": {"tag": "mine"}}]}


def recorder(trainer) -> Recorder:
    found = [c for c in trainer.callbacks if isinstance(c, Recorder)]
    assert len(found) == 1 and found[0].tag == "mine"   # built from `callbacks:` with its init_args
    return found[0]


@pytest.mark.parametrize("accumulate", [1, 3])
def test_automatic_fires_once_per_real_step(tmp_path, accumulate):
    trainer = fit(resolve(base_cfg(tmp_path, accumulate_grad_batches=accumulate)))
    rec = recorder(trainer)
    assert rec.micro_batches == 3 * accumulate
    kinds = [(e[0], e[1]) for e in rec.events]
    assert kinds == [("before", "policy"), ("after", "policy")] * 3
    for i in range(3):
        before, after = rec.events[2 * i], rec.events[2 * i + 1]
        # Fired after the whole accumulation window, before / after the parameters change.
        assert before[2] == i and after[2] == i + 1
        assert before[3] == after[3] == (i + 1) * accumulate
        assert before[4]                                  # every parameter has its final gradient
        assert before[5] <= 0.05 * (1 + 1e-5)             # ... already clipped to max_grad_norm
        assert changed(before[6], after[6])                 # the step happened in between
    assert trainer.lightning_module.policy_version == 3


class ManualTwoOptimizers(SFTRecipe):
    """A manual-optimization recipe with a critic: 2 micro-batches per step, then both optimizers. The
    critic's settings are the PPO critic's section, which this recipe's config does not have: it reuses
    `optimizer:` with its own section path."""

    MICRO = 2

    @classmethod
    def requirements(cls, cfg):
        critic = OptimizerRole("critic", "value", ("critic_settings",))
        return Requirements(automatic_optimization=False, optimizers=(POLICY, critic), value_model=True)

    def __init__(self, cfg, tokenizer):
        super().__init__({**cfg, "sft": {"train_on_prompt": False}}, tokenizer)

    def training_step(self, ctx, batch, batch_idx):
        rows = batch["input_ids"].shape[0]
        for part in torch.arange(rows).chunk(self.MICRO):
            ids, pos, tgt = batch["input_ids"][part], batch["position_ids"][part], batch["targets"][part]
            logits = ctx.policy(ids, position_ids=pos)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=IGNORE)
            ctx.backward(loss / self.MICRO)
            values = ctx.value(ids, position_ids=pos)
            ctx.backward((values - 1.0).pow(2).mean() / self.MICRO)
        ctx.step("policy")
        ctx.step("critic")
        self.position = batch["next_position"]


def test_manual_two_optimizers(tmp_path, install_recipe):
    install_recipe({"two_optimizers": "test_callbacks:ManualTwoOptimizers"})
    cfg = resolve(base_cfg(tmp_path, recipe="two_optimizers", accumulate_grad_batches=4))  # ignored: manual
    cfg["scheduler"] = {"name": "linear", "warmup_steps": 1, "min_lr_ratio": 0.0}
    # the critic's section: its lr, weight decay and clipping (None: measured, not clipped)
    cfg["critic_settings"] = {"lr": 2e-4, "weight_decay": 0.0, "max_grad_norm": None}
    trainer = fit(cfg)
    rec = recorder(trainer)
    module = trainer.lightning_module
    assert rec.micro_batches == 3   # one Lightning batch per policy step
    assert [(e[0], e[1]) for e in rec.events] == [("before", "policy"), ("after", "policy"),
                                                  ("before", "critic"), ("after", "critic")] * 3
    # max_steps counts policy steps only: the critic's steps do not move global_step.
    assert trainer.global_step == 3 and module.policy_version == 3
    for i in range(3):
        bp, ap, bc, ac = rec.events[4 * i: 4 * i + 4]
        assert (bp[2], ap[2], bc[2], ac[2]) == (i, i + 1, i + 1, i + 1)
        assert bp[4] and bc[4]
        assert bp[5] <= 0.05 * (1 + 1e-5)                      # policy clipped to optimizer.max_grad_norm
        assert changed(bp[6], ap[6]) and changed(bc[6], ac[6])
    # Gradients were zeroed by step_optimizer; the LR schedule stepped once per policy step.
    assert all(p.grad is None for p in module.policy.parameters())
    schedule = LRSchedule("linear", 1, 3, 0.0)
    assert module.optimizers()[0].param_groups[0]["lr"] == pytest.approx(1e-3 * schedule(3))
    assert module.optimizers()[1].param_groups[0]["lr"] == 2e-4


def test_user_callback_must_be_a_lightning_callback(tmp_path):
    from framework.errors import FwError

    cfg = base_cfg(tmp_path)
    cfg["callbacks"] = [{"class_path": "collections.OrderedDict", "init_args": {}}]
    with pytest.raises(FwError, match=r"callbacks\[0\]: collections.OrderedDict is a OrderedDict, not a"):
        fit(resolve(cfg))


# ------------------------------------------------------------------------------------------ a diverged run stops

def test_a_diverging_run_exits_2_keeping_the_last_good_checkpoint(tmp_path, capsys):
    from framework import checkpoint as ck
    from framework.cli import main

    run_dir = tmp_path / "run"
    # lr 1e30: the first update is finite, the second step's loss and gradients are not
    code = main(["fit", "--config", "recipes/sft.yaml", f"--run_dir={run_dir}", f"--data.path={DATA}",
                 "--data.max_seq_len=64", "--data.batch_size=4", "--optimizer.lr=1e30", "--scheduler.warmup_steps=0",
                 "--trainer.max_steps=4", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
                 "--checkpoint.every_n_steps=1", "--checkpoint.keep_last=1", "--logging.tensorboard=false"])
    err = capsys.readouterr().err
    assert code == 2
    (line,) = [ln for ln in err.splitlines() if ln.startswith("fw: error: ")]
    assert " after 1 policy steps: the run has diverged" in line and "Traceback" not in err
    latest = ck.find_latest(run_dir)
    assert Path(latest).name == ck.step_dir_name(1)   # not pruned in favour of a diverged step
    ck.verify_checkpoint(latest)
    weights = ck.read_checkpoint_dir(latest)["fw_components"]["policy"]["state_dict"]
    assert all(bool(w.isfinite().all()) for w in weights.values())
    assert [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]


class NanWeightAtStart(Callback):
    """Makes one policy weight NaN before the first step, as a broken checkpoint would hold it."""

    def on_train_start(self, trainer, module):
        with torch.no_grad():
            next(module.policy.parameters()).view(-1)[0] = float("nan")


def test_a_policy_with_a_nan_weight_stops_grpo_with_one_line(tmp_path, capsys):
    """Its rollout's logits are NaN (CPU): the draw goes on (NaN rows draw as the sampler's reference does, logprob
    NaN) and the non-finite guard stops the run with its line, exit 2, nothing saved; the draw used to index past
    the vocabulary (a RuntimeError traceback)."""
    from framework import checkpoint as ck
    from framework.cli import main

    run_dir = tmp_path / "run"
    code = main(["fit", "--config", "train.yaml", f"--run_dir={run_dir}", "--trainer.max_steps=2",
                 "--trainer.enable_progress_bar=false", "--logging.tensorboard=false", "--eval.every_n_steps=null",
                 "--callbacks=[{class_path: test_callbacks.NanWeightAtStart}]"])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("fw: error: ")]
    assert line.startswith("fw: error: the loss is nan after 0 policy steps: the run has diverged"), line
    assert "Traceback" not in err
    assert ck.list_checkpoints(run_dir) == []


def test_the_non_finite_guard_stops_on_an_infinite_loss_gradient_or_weight(tmp_path):
    # infinities pass the NaN check of the metrics (an fp16 step skipped by loss scaling has an infinite
    # gradient norm); outside 16-mixed they mean divergence. The guard reads its checks at the batch end.
    from framework.callbacks import StopOnNonFinite
    from framework.errors import FwError
    from framework.module import FwModule

    module = FwModule(resolve(base_cfg(tmp_path)))
    (optimizer,), _ = module.configure_optimizers()
    guard = StopOnNonFinite("32-true")
    guard.on_before_backward(None, module, torch.tensor(2.5))
    guard.check()
    guard.on_before_backward(None, module, torch.tensor(float("inf")))
    with pytest.raises(FwError, match=r"^the loss is inf after 0 policy steps: the run has diverged"):
        guard.check()
    params = list(module.policy.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    # an FwModule hands over the norm it clipped with; the guard measures none of its own
    module.grad_norms["policy"] = torch.tensor(3.0)
    guard.on_before_optimizer_step(None, module, optimizer)
    guard.before_optimizer_step(None, module, optimizer)
    guard.check()
    module.grad_norms["policy"] = torch.tensor(float("inf"))
    guard.before_optimizer_step(None, module, optimizer)
    with pytest.raises(FwError, match=r"^the policy gradient's norm is inf after 0 policy steps"):
        guard.check()
    StopOnNonFinite("16-mixed").before_optimizer_step(None, module, optimizer)   # the scaler's business
    # any other LightningModule: the guard measures the gradients before the clip itself
    plain = torch.nn.Linear(2, 2)
    plain_optimizer = torch.optim.SGD(plain.parameters())
    for p in plain.parameters():
        p.grad = torch.ones_like(p)
    guard.on_before_optimizer_step(None, plain, plain_optimizer)
    guard.check()
    plain.bias.grad[0] = float("nan")
    guard.on_before_optimizer_step(None, plain, plain_optimizer)
    with pytest.raises(FwError, match=r"^the policy gradient's norm is nan after None policy steps"):
        guard.check()
    guard.after_optimizer_step(None, module, optimizer)
    guard.check()
    with torch.no_grad():
        params[-1][0] = float("-inf")
    guard.after_optimizer_step(None, module, optimizer)
    # the first check that failed is the one reported
    guard.on_before_backward(None, module, torch.tensor(float("nan")))
    with pytest.raises(FwError, match=r"^a policy weight is not finite after 0 policy steps"):
        guard.check()
    assert guard.pending == []


class MonitorReader(lightning.Callback):
    """A plain Lightning callback that reads a monitored metric, as ModelCheckpoint(monitor=...) does."""

    seen: ClassVar[list] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        MonitorReader.seen.append((trainer.global_step, float(trainer.callback_metrics["loss"])
                                   if "loss" in trainer.callback_metrics else None))


def test_lightning_callbacks_see_the_logged_metrics_in_callback_metrics(tmp_path):
    from framework.metrics import read_metrics

    MonitorReader.seen = []
    cfg = base_cfg(tmp_path, log_every_n_steps=2)
    cfg["callbacks"] = [{"class_path": "test_callbacks.MonitorReader"}]
    fit(resolve(cfg))
    logged = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert sorted(logged) == [2, 3]
    # nothing before the first record, then each record's value until the next one
    assert MonitorReader.seen == [(1, None), (2, pytest.approx(logged[2])), (3, pytest.approx(logged[3]))]


class StopAt(Callback):
    """Ends the run after policy step `step`, as an early-stopping rule would (in its batch end)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_a_run_a_callback_stops_logs_its_last_steps_and_resumes_without_counting_them_twice(tmp_path, capsys):
    from framework.metrics import read_metrics

    def cfg(run, max_steps, callbacks=()):
        c = base_cfg(tmp_path, max_steps=max_steps, log_every_n_steps=3)
        c["run_dir"] = str(tmp_path / run)
        c["callbacks"] = list(callbacks)
        return resolve(c)

    fit(cfg("straight", 9))
    stop = {"class_path": "test_callbacks.StopAt", "init_args": {"step": 5}}
    capsys.readouterr()
    fit(cfg("stopped", 9, [stop]))
    last = tmp_path / "stopped" / "checkpoints" / "step-000005"
    assert capsys.readouterr().err.splitlines()[-1] == (   # said, though it exits 0
        f"fw: stopped at step 5 of trainer.max_steps 9: a callback asked to (trainer.should_stop); checkpoint {last}; "
        f"fw fit --config {tmp_path / 'stopped' / 'config.yaml'} --resume last continues")
    stopped = read_metrics(tmp_path / "stopped" / "metrics.jsonl")
    assert [r["step"] for r in stopped] == [3, 5]   # steps 4 and 5 are logged, not lost
    assert (tmp_path / "stopped" / "checkpoints" / "step-000005").is_dir()
    fit(cfg("stopped", 9), resume="last")
    resumed = read_metrics(tmp_path / "stopped" / "metrics.jsonl")
    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [3, 5, 6, 9] and [r["step"] for r in straight] == [3, 6, 9]
    # every step's tokens counted once: the checkpoint at 5 held no part of the interval written at 5
    assert sum(r["tokens"] for r in resumed) == sum(r["tokens"] for r in straight)


class StopInBatch(Callback):
    """Asks to stop in the batch end of batch `batch` (0-based); counts the batches run and records
    (global_step, policy_version) as training ends."""

    def __init__(self, batch: int):
        self.batch = batch
        self.batches = 0
        self.ended = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.batches += 1
        if batch_idx == self.batch:
            trainer.should_stop = True

    def on_train_end(self, trainer, module):
        self.ended = (trainer.global_step, module.policy_version)


def test_a_stop_asked_within_an_accumulation_window_ends_the_run_at_that_steps_end(tmp_path):
    from framework.checkpoint import find_latest

    cfg = base_cfg(tmp_path, max_steps=5, accumulate_grad_batches=3)
    # batch 3 is the first micro-batch of step 2 (batches 3, 4, 5)
    cfg["callbacks"] = [{"class_path": "test_callbacks.StopInBatch", "init_args": {"batch": 3}}]
    trainer = fit(resolve(cfg))
    stopper = next(c for c in trainer.callbacks if isinstance(c, StopInBatch))
    assert stopper.batches == 6 and stopper.ended == (2, 2)   # step 2 completed, nothing after it
    assert Path(find_latest(tmp_path / "run")).name == "step-000002"


class Counting(Callback):
    """Keeps a count in checkpoints (state_dict) under the default state_key: its class name."""

    def __init__(self, start: int = 0):
        self.count = start

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_two_stateful_callbacks_of_one_state_key_are_refused_at_the_second(tmp_path, capsys):
    """A checkpoint holds one callback state per state_key, and Lightning refuses a second stateful callback of the
    same key with a traceback: fw validate and fw fit name the second entry, before anything is written."""
    from framework.cli import main

    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: sft\nrun_dir: {tmp_path / 'run'}\nmodel: {{policy: {{preset: tiny}}}}\n"
                      "data: {task: {name: digits}}\ntrainer: {max_steps: 1}\ncallbacks:\n"
                      "  - {class_path: test_callbacks.Counting}\n"
                      "  - {class_path: test_callbacks.Counting, init_args: {start: 5}}\n"
                      "  - {class_path: test_callbacks.Recorder}\n")
    line = (f"{config}:8:18: callbacks[1].class_path: test_callbacks.Counting keeps its state under the state_key of "
            "callbacks[0] (Counting), and a checkpoint holds one state per key: give the class a state_key property "
            "that tells its instances apart")
    for command in ("validate", "fit"):
        assert main([command, "--config", str(config)]) == 2
        assert capsys.readouterr().err.splitlines() == [line], command
    assert not (tmp_path / "run").exists()


def test_a_progress_bar_of_the_users_replaces_fws_and_a_second_one_is_refused(tmp_path, capsys):
    """Lightning runs one progress bar and none under enable_progress_bar=False, refusing either with a traceback:
    a user's bar replaces fw's own, and the bars it cannot run are named, one line each, before anything is written."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    from framework.callbacks import ProgressBar
    from framework.cli import main

    cfg = base_cfg(tmp_path, enable_progress_bar=True)
    cfg["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.TQDMProgressBar", "init_args": {"refresh_rate": 2}}]
    trainer = fit(resolve(cfg))
    bars = [cb for cb in trainer.callbacks if isinstance(cb, TQDMProgressBar)]
    assert len(bars) == 1 and not isinstance(bars[0], ProgressBar) and bars[0].refresh_rate == 2
    assert trainer.lightning_module.policy_version == 3
    capsys.readouterr()

    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: sft\nrun_dir: {tmp_path / 'run2'}\nmodel: {{policy: {{preset: tiny}}}}\n"
                      "data: {task: {name: digits}}\ntrainer: {max_steps: 1}\ncallbacks:\n"
                      "  - {class_path: lightning.pytorch.callbacks.TQDMProgressBar}\n"
                      "  - {class_path: lightning.pytorch.callbacks.TQDMProgressBar, init_args: {refresh_rate: 5}}\n")
    line = (f"{config}:8:18: callbacks[1].class_path: lightning.pytorch.callbacks.TQDMProgressBar is a progress bar, "
            "as callbacks[0] is, and a run shows one: keep one")
    for command in ("validate", "fit"):
        assert main([command, "--config", str(config)]) == 2
        assert capsys.readouterr().err.splitlines() == [line], command
    one_bar = "--callbacks=[{class_path: lightning.pytorch.callbacks.TQDMProgressBar}]"
    assert main(["fit", "--config", str(config), "--trainer.enable_progress_bar=false", one_bar]) == 2
    off = (f"override '{one_bar}': callbacks[0].class_path: lightning.pytorch.callbacks.TQDMProgressBar is a progress "
           "bar, but trainer.enable_progress_bar is false; set it to true to show this bar instead of fw's")
    assert capsys.readouterr().err.splitlines() == [off]
    assert not (tmp_path / "run2").exists()


def test_the_non_finite_guard_measures_float16_gradients_without_overflow():
    """float16 gradients, each finite, whose norm (512 x 300 = 153,600) is past float16's 65,504: a norm taken in
    the gradients' dtype is inf and would stop a run that has not diverged."""
    from framework.callbacks import StopOnNonFinite

    plain = torch.nn.Linear(512, 512, bias=False).half()
    plain.weight.grad = torch.full_like(plain.weight, 300.0)
    guard = StopOnNonFinite("32-true")
    guard.on_before_optimizer_step(None, plain, torch.optim.SGD(plain.parameters()))
    [(_, _, finite, norm)] = guard.pending
    assert bool(finite) and float(norm) == pytest.approx(153_600.0, rel=1e-3)   # float32 sums
    guard.check()
