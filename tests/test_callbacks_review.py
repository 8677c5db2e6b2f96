"""User callbacks as a user writes them: metrics under any name, and state that a resume must get back."""

import pytest

from framework.callbacks import Callback
from framework.metrics import StepMetrics, read_metrics

DATA = "recipes/data/arithmetic_chat.jsonl"


def fit_args(run_dir, *extra):
    return ["fit", "--config", "recipes/sft.yaml", f"--run_dir={run_dir}", f"--data.path={DATA}",
            "--data.max_seq_len=64", "--data.batch_size=2", "--trainer.enable_progress_bar=false",
            "--logging.tensorboard=false", "--logging.csv=false", *extra]


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
