"""tokens_per_s counts training time only: an evaluation and a checkpoint's save (a logger's save included) are
left out of the interval it divides by. Both are slowed here by a real sleep around the real thing."""

import time
from pathlib import Path

from lightning.pytorch.loggers import Logger

from framework.cli import main
from framework.evaluation import Evaluation
from framework.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
PAUSE = 1.0   # seconds each evaluation and each logger save adds


class SlowSave(Logger):
    """A logger whose save, which the checkpoint callback calls before each checkpoint, takes PAUSE seconds."""

    @property
    def name(self) -> str:
        return "slow"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        pass

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def save(self) -> None:
        time.sleep(PAUSE)


def test_tokens_per_s_leaves_out_evaluation_and_checkpoint_time(tmp_path, monkeypatch, capsys):
    run = Evaluation.run

    def slow_run(self, *args, **kwargs):
        time.sleep(PAUSE)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(Evaluation, "run", slow_run)
    code = main(["fit", "--config", str(ROOT / "recipes" / "sft.yaml"), f"--run_dir={tmp_path / 'run'}",
                 "--data.max_seq_len=64", "--data.batch_size=2", "--trainer.max_steps=3",
                 "--trainer.log_every_n_steps=1", "--trainer.accumulate_grad_batches=1", "--trainer.accelerator=cpu",
                 "--checkpoint.every_n_steps=2", "--eval.every_n_steps=2", "--eval.max_prompts=4",
                 "--logging.tensorboard=false", "--trainer.enable_progress_bar=false",
                 "--logging.loggers=[{class_path: test_tokens_per_s.SlowSave}]"])
    assert code == 0, capsys.readouterr().err[-2000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "eval/loss" in records[1]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    # step 2's interval holds its evaluation, step 3's the save of step 2: each would take at least PAUSE s
    for r in records[1:]:
        assert r["tokens"] / r["tokens_per_s"] < PAUSE * 2 / 3, r
