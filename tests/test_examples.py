"""The examples are real code: examples/step_timer.py times every policy step of a real `fw fit`."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_timer_records_every_policy_step(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))   # examples/ and benchmarks/ live beside the packages
    from benchmarks.fit_timing import main as fit_timing

    fit_timing(["--config", str(ROOT / "train.yaml"), f"--run_dir={tmp_path / 'run'}", "--trainer.max_steps=3",
                "--trainer.enable_progress_bar=false", "--logging.tensorboard=false", "--logging.csv=false"])
    times = json.loads((tmp_path / "run" / "step_times.json").read_text())
    assert len(times["step_seconds"]) == 3 and all(t > 0 for t in times["step_seconds"])
    assert "median later step" in capsys.readouterr().out
