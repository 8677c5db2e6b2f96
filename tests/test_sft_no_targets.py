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
