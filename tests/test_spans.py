"""framework.spans: named spans of a step timed on the host and the device without a profiler."""

import json
import re
import time
from pathlib import Path

import pytest
import torch

from framework.callbacks import Callback
from framework.spans import SpanClock, span

ROOT = Path(__file__).resolve().parents[1]


def test_a_span_is_a_profiler_range_with_no_clock_running():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, span("fw.test.outer"):
        torch.ones(3).sum()
    assert "fw.test.outer" in {e.key for e in prof.key_averages()}


def test_spans_are_timed_per_step_and_nested_ones_count_in_both():
    clock = SpanClock("cpu").start()
    try:
        for _ in range(2):
            clock.boundary()
            with span("outer"):
                time.sleep(0.02)
                for _ in range(3):
                    with span("inner"):
                        time.sleep(0.01)
        clock.boundary()
    finally:
        clock.stop()
    steps = clock.steps()
    assert len(steps) == 2
    for step in steps:
        outer, inner = step["spans"]["outer"], step["spans"]["inner"]
        assert (outer["calls"], inner["calls"]) == (1, 3)
        assert 0.03 <= inner["host_s"] < outer["host_s"] <= step["host_s"]
        assert outer["host_s"] >= 0.05
        # on the CPU both clocks are the host's: no lag, the same seconds
        assert outer["device_s"] == outer["host_s"] and outer["lag_begin_s"] == outer["lag_end_s"] == 0.0


def test_a_span_raising_still_closes_and_no_clock_runs_after_stop():
    clock = SpanClock("cpu").start()
    clock.boundary()
    with pytest.raises(ValueError), span("fails"):
        raise ValueError("boom")
    clock.boundary()
    clock.stop()
    with span("after"):
        pass
    (step,) = clock.steps()
    assert step["spans"]["fails"]["calls"] == 1
    assert "after" not in step["spans"] and all(m.name != "after" for m in clock.marks)


def test_a_span_open_across_a_boundary_is_left_out_of_the_next_step():
    clock = SpanClock("cpu").start()
    try:
        clock.boundary()
        with span("across"):
            clock.boundary()
        clock.boundary()
    finally:
        clock.stop()
    first, second = clock.steps()
    assert first["spans"] == {} and second["spans"] == {}


def test_only_one_clock_runs_at_a_time():
    clock = SpanClock("cpu").start()
    try:
        with pytest.raises(RuntimeError, match="another SpanClock"):
            SpanClock("cpu").start()
    finally:
        clock.stop()


def test_fit_timing_step_spans_times_an_rl_steps_phases(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.fit_timing import main as fit_timing

    fit_timing(["--config", str(ROOT / "train.yaml"), f"--run_dir={tmp_path / 'run'}", "--trainer.max_steps=3",
                "--step-spans", "--trainer.enable_progress_bar=false", "--logging.tensorboard=false",
                "--logging.csv=false"])
    steps = json.loads((tmp_path / "run" / "step_spans.json").read_text())
    assert len(steps) == 3
    for step in steps:
        spans = step["spans"]
        assert {"fw.training_step", "fw.rl.generate", "fw.rl.reward", "fw.rl.loss", "fw.backward",
                "fw.optimizer_step", "fw.metrics.flush", "fit.batch_end_to_next"} <= set(spans)
        assert spans["fw.rl.generate"]["host_s"] < spans["fw.training_step"]["host_s"] <= step["host_s"]
        # the step's parts that do not overlap: the recipe's step, the flush, the rest of the batch's end
        parts = sum(spans[n]["host_s"] for n in ("fw.training_step", "fw.metrics.flush", "fit.batch_end_to_next"))
        assert parts <= step["host_s"]
    out = capsys.readouterr().out
    line = re.search(r"fw\.rl\.generate +host ([\d.]+) s, device ([\d.]+) s, 1 calls", out)
    assert line and float(line[1]) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_seconds_and_lag_follow_the_stream_not_the_host():
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.05)   # about 50 ms of device time
    clock = SpanClock("cuda").start()
    try:
        clock.boundary()
        with span("queued"):
            torch.cuda._sleep(cycles)
        with span("waits"):
            torch.cuda.synchronize()
        with span("after"):
            torch.ones(1, device="cuda").add_(1)
        clock.boundary()
    finally:
        clock.stop()
    (step,) = clock.steps()
    queued, waits, after = (step["spans"][n] for n in ("queued", "waits", "after"))
    # queued: the host returns at once, the device runs the sleep; its end is reached long after the host queued it
    assert queued["host_s"] < 0.01 and queued["device_s"] >= 0.03 and queued["lag_end_s"] >= 0.03
    # after a synchronisation the device has caught up: it reaches the next mark as soon as it is queued
    assert waits["host_s"] >= 0.03 and after["lag_begin_s"] < 0.005



class RaisesAtSecondBatch(Callback):
    """A user callback that fails in the fit's second training batch."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == 1:
            raise RuntimeError("a user callback failed")


def test_a_fit_that_fails_leaves_no_clock_running(tmp_path, monkeypatch):
    """StepSpans stops its clock when the fit raises, so a later fit in the process can start its own."""
    monkeypatch.syspath_prepend(str(ROOT))
    import framework.spans
    from benchmarks.fit_timing import main as fit_timing

    with pytest.raises(RuntimeError, match="a user callback failed"):
        fit_timing(["--config", str(ROOT / "train.yaml"), f"--run_dir={tmp_path / 'run'}", "--trainer.max_steps=3",
                    "--step-spans", "--trainer.enable_progress_bar=false", "--logging.tensorboard=false",
                    "--logging.csv=false", "--callbacks=[{class_path: test_spans.RaisesAtSecondBatch}]"])
    assert framework.spans._clock is None
