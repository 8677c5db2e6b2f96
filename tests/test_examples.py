"""The examples are real code: examples/step_timer.py times every policy step of a real `fw fit`."""

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_timer_records_every_policy_step(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))   # examples/ and benchmarks/ live beside the packages
    from benchmarks.fit_timing import main as fit_timing

    fit_timing(["--config", str(ROOT / "train.yaml"), f"--run_dir={tmp_path / 'run'}", "--trainer.max_steps=3",
                "--trainer.enable_progress_bar=false", "--logging.tensorboard=false", "--logging.csv=false"])
    times = json.loads((tmp_path / "run" / "step_times.json").read_text())
    assert len(times["step_seconds"]) == 3 and all(t > 0 for t in times["step_seconds"])
    out = capsys.readouterr().out
    assert "median later step" in out
    probe = re.search(r"host probe +([\d.]+) us to queue a one-element add on cpu \(median of 5 runs: (.*)\)", out)
    assert probe and float(probe[1]) > 0
    assert statistics.median(float(t) for t in probe[2].split(", ")) == float(probe[1])


def test_rollout_timeline_accounts_for_each_rollout(tmp_path, capsys, monkeypatch):
    """--rollout-timeline times every step's rollout inside the real fit: one call a step, its parts within its
    wall time, and each of the 512 rows decoded at most once (its second and last token)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.fit_timing import main as fit_timing

    fit_timing(["--config", str(ROOT / "train.yaml"), f"--run_dir={tmp_path / 'run'}", "--trainer.max_steps=3",
                "--trainer.enable_progress_bar=false", "--logging.tensorboard=false", "--logging.csv=false",
                "--rollout-timeline"])
    summaries = json.loads((tmp_path / "run" / "rollout_timeline.json").read_text())
    assert len(summaries) == 3
    for s in summaries:
        assert s["calls"] == 1 and s["prefill"]["rows"] == 512 and 0 < s["decode"]["rows"] <= 512
        assert 0 < s["setup_s"] + s["span_s"] + s["finish_s"] <= s["call_s"] * 1.001
    out = capsys.readouterr().out
    assert "rollout timeline (median of 2 later steps" in out and "host before 1st step" in out
    assert re.search(r"host before 1st step +[\d.]+ \(weight copies [\d.]+, pool [\d.]+, admission [\d.]+\)", out)
    assert re.search(r"host after last step +[\d.]+ \(drain [\d.]+, restore [\d.]+, result [\d.]+\)", out)
