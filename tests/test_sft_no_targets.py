"""SFT steps whose rows keep no target token (a prompt that fills data.max_seq_len): the loss and token accuracy
of such a logging interval are left out of the record, not written as NaN, and the run goes on."""

import json
from pathlib import Path

from framework.cli import main
from framework.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _chat(user: str, reply: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def test_an_interval_without_targets_logs_no_loss_and_no_nan(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    records = [_chat("What is 1 + 1?", "2"), _chat("What is 2 + 1?", "3"),
               _chat("Summarize: " + "lorem ipsum " * 80, "short"), _chat("What is 3 + 1?", "4")]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    run_dir = tmp_path / "run"
    code = main(["fit", "--config", str(ROOT / "recipes" / "sft.yaml"), f"--run_dir={run_dir}", f"--data.path={data}",
                 "--data.shuffle=false", "--data.pack=false", "--data.batch_size=1",
                 "--data.max_seq_len=64", "--trainer.max_steps=4", "--trainer.log_every_n_steps=1",
                 "--trainer.accumulate_grad_batches=1", "--trainer.accelerator=cpu", "--eval.every_n_steps=null",
                 "--logging.tensorboard=false", "--trainer.enable_progress_bar=false"])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert "1 of them keeps no token to train on" in capsys.readouterr().err
    text = (run_dir / "metrics.jsonl").read_text()
    assert "nan" not in text.lower()
    steps = {m["step"]: m for m in read_metrics(run_dir / "metrics.jsonl")}
    assert sorted(steps) == [1, 2, 3, 4]
    for step in (1, 2, 4):
        assert {"loss", "token_accuracy"} <= set(steps[step]), steps[step]
    # the third example alone makes step 3: its prompt fills the row, so no token of it is a target
    assert not {"loss", "token_accuracy"} & set(steps[3]), steps[3]
    assert steps[3]["tokens"] == 64


def test_data_that_keeps_no_target_is_refused_with_the_length_that_would(tmp_path, capsys):
    """Every example cut to data.max_seq_len keeps no target: fit refuses before training, naming the key and
    the least length that keeps one; at that length the run trains and logs a loss."""
    data = tmp_path / "data.jsonl"
    records = [_chat("What is 1 + 1? " * 6, "2"), _chat("Tell me the sum of 2 and 3, please.", "5")]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))

    def fit(max_len: int, run: str) -> int:
        return main(["fit", "--config", str(ROOT / "recipes" / "sft.yaml"), f"--run_dir={tmp_path / run}",
                     f"--data.path={data}", "--data.shuffle=false", "--data.pack=false", "--data.batch_size=2",
                     f"--data.max_seq_len={max_len}", "--trainer.max_steps=1", "--trainer.log_every_n_steps=1",
                     "--trainer.accumulate_grad_batches=1", "--trainer.accelerator=cpu",
                     "--eval.every_n_steps=null", "--logging.tensorboard=false",
                     "--trainer.enable_progress_bar=false"])

    assert fit(12, "short") == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("fw: error:"))
    assert line.startswith("fw: error: data.max_seq_len: all 2 examples of data.path are longer than "
                           "data.max_seq_len (12)"), line
    least = int(line.rsplit(" ", 1)[1])
    assert not (tmp_path / "short" / "metrics.jsonl").exists()
    assert fit(least - 1, "below") == 2
    assert fit(least, "enough") == 0, capsys.readouterr().err[-2000:]
    (record,) = read_metrics(tmp_path / "enough" / "metrics.jsonl")
    assert record["loss"] > 0 and record["token_accuracy"] >= 0
