"""User callbacks as a user writes them: metrics under any name, and state that a resume must get back."""

import collections
import json
from pathlib import Path

import numpy as np
import pytest

from framework.callbacks import Callback
from framework.metrics import StepMetrics, read_metrics

DATA = "recipes/data/arithmetic_chat.jsonl"


def fit_args(run_dir, *extra):
    return ["fit", "--config", "recipes/sft.yaml", f"--run_dir={run_dir}", f"--data.path={DATA}",
            "--data.max_seq_len=64", "--data.batch_size=2", "--trainer.enable_progress_bar=false",
            "--logging.tensorboard=false", "--logging.csv=false", *extra]


# ------------------------------------------------------------------ where the class comes from

def test_a_callback_file_named_like_a_package_that_comes_first_is_told_to_be_renamed(tmp_path, capsys):
    """A user's recipes.py beside the config: `recipes` is fw's own package, which comes first on sys.path, so
    `recipes.Mine` named a missing attribute of fw's package, and nothing said that the user's file was not the one
    imported."""
    import recipes
    from framework.cli import main

    (tmp_path / "recipes.py").write_text("from framework.callbacks import Callback\n\n\nclass Mine(Callback):\n"
                                         "    pass\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: sft\nrun_dir: {tmp_path / 'run'}\nmodel: {{policy: {{preset: tiny}}}}\n"
                      "data: {task: {name: digits}}\ntrainer: {max_steps: 1}\ncallbacks:\n"
                      "  - {class_path: recipes.Mine}\n")
    assert main(["validate", "--config", str(config)]) == 2
    line = (f"{config}:7:18: callbacks[0].class_path: cannot import 'recipes.Mine': module 'recipes' has no attribute "
            f"'Mine'; 'recipes' is fw's own package ({recipes.__file__}), which your {tmp_path / 'recipes.py'} of that "
            "name does not replace: rename your file")
    assert capsys.readouterr().err.splitlines() == [line]


# ------------------------------------------------------------------ metric names

class PlainNames(Callback):
    """Logs the policy step's number (1, 2, ...) under plain English names, each with another reduction."""

    def before_optimizer_step(self, trainer, module, optimizer):
        step = module.policy_version + 1
        module.log_metric("values", float(step))
        module.log_metric("update", float(step), reduce="sum")
        module.log_metric("type", float(step), reduce="max")
        module.log_metric("training", float(step), reduce="min")


def test_a_metric_may_have_any_name_fw_does_not_write(tmp_path, capsys):
    """Names such as `values` or `update` (attributes of the torch container that holds the aggregators) used to
    stop the run with a KeyError traceback from inside torch."""
    from framework.cli import main

    run_dir = tmp_path / "run"
    code = main(fit_args(run_dir, "--trainer.max_steps=4", "--trainer.log_every_n_steps=3",
                         "--callbacks=[{class_path: test_callbacks_review.PlainNames}]"))
    assert code == 0, capsys.readouterr().err[-3000:]
    records = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
    assert sorted(records) == [3, 4]
    # steps 1..3, then step 4 alone
    assert {k: records[3][k] for k in ("values", "update", "type", "training")} == \
        {"values": 2.0, "update": 6.0, "type": 3.0, "training": 1.0}
    assert {k: records[4][k] for k in ("values", "update", "type", "training")} == \
        {"values": 4.0, "update": 4.0, "type": 4.0, "training": 4.0}


def test_an_interval_of_such_a_name_continues_from_its_saved_state():
    first = StepMetrics()
    first.update("values", 1.0, weight=1.0, user=True)
    first.update("items", 5.0, reduce="sum", user=True)
    resumed = StepMetrics()
    resumed.load_state(first.state())
    resumed.update("values", 4.0, weight=2.0, user=True)
    resumed.update("items", 2.0, reduce="sum", user=True)
    assert resumed.compute() == {"values": pytest.approx((1.0 + 2 * 4.0) / 3), "items": 7.0}


@pytest.mark.parametrize(("first", "then"), [("last", "mean"), ("sum", "last"), ("last", "max")])
def test_a_name_logged_with_last_and_another_reduction_is_refused(first, then):
    """A 'last' value and an aggregated one of one name were both kept and written under that name, the 'last' one
    silently replacing the other in the record; two aggregations of one name are refused, and so is this."""
    metrics = StepMetrics()
    metrics.update("user/x", 1.0, reduce=first, user=True)
    with pytest.raises(ValueError, match=rf"^log_metric\('user/x'\): logged with reduce='{first}' before, now "
                                         rf"'{then}'$"):
        metrics.update("user/x", 3.0, reduce=then, user=True)
    assert metrics.compute() == {"user/x": 1.0}
    # the name keeps its reduction in the next interval, and in one continued from a checkpoint
    with pytest.raises(ValueError, match="logged with reduce="):
        metrics.update("user/x", 3.0, reduce=then, user=True)
    metrics.update("user/x", 2.0, reduce=first, user=True)
    resumed = StepMetrics()
    resumed.load_state(metrics.state())
    with pytest.raises(ValueError, match="logged with reduce="):
        resumed.update("user/x", 3.0, reduce=then, user=True)
    resumed.update("user/x", 4.0, reduce=first, user=True)
    assert resumed.compute() == {"user/x": {"last": 4.0, "sum": 6.0, "max": 4.0}[first]}


class WeighsASum(Callback):
    """Logs a value with a weight, under reduction `reduce`."""

    def __init__(self, reduce: str):
        self.reduce = reduce

    def before_optimizer_step(self, trainer, module, optimizer):
        module.log_metric("user/tokens", 3.0, weight=0.5, reduce=self.reduce)


@pytest.mark.parametrize("reduce", ["sum", "max", "min", "last"])
def test_a_weight_with_another_reduction_than_mean_is_refused(tmp_path, reduce):
    """A weight applies to a mean alone; with sum, max, min or last it was dropped, silently, so a user weighing a
    sum by a count read an unweighted sum in the records."""
    from framework.cli import main

    spec = f"--callbacks=[{{class_path: test_callbacks_review.WeighsASum, init_args: {{reduce: {reduce}}}}}]"
    with pytest.raises(ValueError) as raised:
        main(fit_args(tmp_path / "run", "--trainer.max_steps=1", spec))
    assert str(raised.value) == f"log_metric('user/tokens'): a weight applies to reduce='mean' only, not '{reduce}'"
    # the traceback ends with what the run kept: it ended before its first step
    assert raised.value.__notes__ == ["fw: the run ended at step 0 on this error; no checkpoint is saved"]


# ------------------------------------------------------------------ state a resume gets back

class Keeps(Callback):
    """Keeps `kind` of value in its checkpointed state: what a weights-only load (a resume's) refuses."""

    def __init__(self, kind: str):
        self.kind = kind

    def state_dict(self):
        value = {"numpy": np.float64(0.5), "deque": collections.deque([1, 2], maxlen=3),
                 "path": Path("runs/best")}[self.kind]
        return {"best": value}

    def load_state_dict(self, state):
        self.best = state["best"]


class AddsToCheckpoint(Callback):
    """Adds a key of its own to the checkpoint (Lightning's `on_save_checkpoint`), holding a NumPy scalar."""

    def on_save_checkpoint(self, trainer, module, checkpoint):
        checkpoint["my_best"] = np.float32(1.25)


@pytest.mark.parametrize(("spec", "what", "refused"), [
    ("{class_path: test_callbacks_review.Keeps, init_args: {kind: numpy}}",
     "the state of callbacks[0] (test_callbacks_review.Keeps)", "numpy."),
    ("{class_path: test_callbacks_review.Keeps, init_args: {kind: deque}}",
     "the state of callbacks[0] (test_callbacks_review.Keeps)", "collections.deque"),
    ("{class_path: test_callbacks_review.Keeps, init_args: {kind: path}}",
     "the state of callbacks[0] (test_callbacks_review.Keeps)", "pathlib.PosixPath"),
    ("{class_path: test_callbacks_review.AddsToCheckpoint}",
     ("the checkpoint's key 'my_best' (added by the on_save_checkpoint of callbacks[0] "
      "(test_callbacks_review.AddsToCheckpoint))"), "numpy"),
    # the callback that adds the key is named, not one before it that keeps to the other hooks
    (("{class_path: test_callbacks_review.WeighsASum, init_args: {reduce: mean}}, "
      "{class_path: test_callbacks_review.AddsToCheckpoint}"),
     ("the checkpoint's key 'my_best' (added by the on_save_checkpoint of callbacks[1] "
      "(test_callbacks_review.AddsToCheckpoint))"), "numpy"),
])
def test_a_callback_state_that_a_resume_cannot_load_stops_the_run_at_its_first_save(tmp_path, capsys, spec, what,
                                                                                     refused):
    """Such a state used to be saved without a word, and every resume from the run's checkpoints then failed,
    calling the checkpoint's trainer state corrupt."""
    from framework import checkpoint as ck
    from framework.cli import main

    run_dir = tmp_path / "run"
    code = main(fit_args(run_dir, "--trainer.max_steps=3", "--trainer.log_every_n_steps=1",
                         "--checkpoint.every_n_steps=2", f"--callbacks=[{spec}]"))
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("fw: error: ")]
    assert line.startswith(f"fw: error: checkpoint step-000002: {what} holds {refused}"), line
    assert "a resume's weights-only load refuses" in line and "Traceback" not in err
    assert ck.list_checkpoints(run_dir) == []
    # nothing of the refused save is left behind (no staging directory either), and the steps before it are logged
    checkpoints = run_dir / "checkpoints"
    assert not checkpoints.exists() or list(checkpoints.iterdir()) == []
    assert [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_checkpoint_whose_state_a_weights_only_load_refuses_is_named_so_not_corrupt(tmp_path, capsys,
                                                                                       monkeypatch):
    """A checkpoint written before the save checked the callbacks' states: its resume said the trainer state was
    corrupt. It is whole; the line names what the load refuses and the setting that loads it."""
    from framework import checkpoint as ck
    from framework.callbacks import RestorableState
    from framework.cli import main

    run_dir = tmp_path / "run"
    keeps = "--callbacks=[{class_path: test_callbacks_review.Keeps, init_args: {kind: deque}}]"
    with monkeypatch.context() as m:
        m.setattr(RestorableState, "on_save_checkpoint", lambda *args: None)   # the save as it was
        assert main(fit_args(run_dir, "--trainer.max_steps=2", "--checkpoint.every_n_steps=2", keeps)) == 0
    latest = ck.find_latest(run_dir)
    capsys.readouterr()
    assert main(fit_args(run_dir, "--trainer.max_steps=3", "--resume", "last", keeps)) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("fw: error: ")]
    assert line == (f"fw: error: {Path(latest) / 'trainer_state.pt'}: the trainer state holds collections.deque, "
                    "which a weights-only load refuses (a callback's or a recipe's saved state holds it); if you "
                    "trust this checkpoint, set TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 to load it in full")
    # the way out that the line names: the resume loads and continues (its own last save as the old one was)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.setattr(RestorableState, "on_save_checkpoint", lambda *args: None)
    assert main(fit_args(run_dir, "--trainer.max_steps=3", "--resume", "last", keeps)) == 0, \
        capsys.readouterr().err[-3000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")][-1] == 3


class Counts(Callback):
    """Counts the optimizer steps it saw, in checkpoints as plain numbers."""

    def __init__(self):
        self.count = 0
        self.restored = None

    def after_optimizer_step(self, trainer, module, optimizer):
        self.count += 1

    def state_dict(self):
        return {"count": self.count, "history": [float(self.count)], "seen": {self.count}}

    def load_state_dict(self, state):
        self.restored = state
        self.count = state["count"]


def test_a_callback_state_of_plain_values_comes_back_on_resume(tmp_path):
    """The check refuses only what a resume cannot load: numbers, lists and sets pass, and come back."""
    from framework.config import resolve
    from framework.trainer import fit

    def cfg(max_steps):
        return resolve({"recipe": "sft", "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
                        "data": {"path": DATA, "max_seq_len": 64, "batch_size": 2},
                        "trainer": {"accelerator": "cpu", "max_steps": max_steps, "enable_progress_bar": False},
                        "checkpoint": {"every_n_steps": 2}, "logging": {"csv": False, "tensorboard": False},
                        "callbacks": [{"class_path": "test_callbacks_review.Counts"}]})

    fit(cfg(2))
    trainer = fit(cfg(3), resume="last")
    counts = next(cb for cb in trainer.callbacks if isinstance(cb, Counts))
    assert counts.restored == {"count": 2, "history": [2.0], "seen": {2}} and counts.count == 3
