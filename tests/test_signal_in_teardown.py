"""Signals to `python -m framework fit` after its last step, while the run ends: during the final checkpoint's save,
a callback's `on_fit_end` or `teardown`, and the process's exit (an atexit hook, as a user logger's upload at exit
is). Each exit says one line: that the signal came as the run was ending, what is published (the final checkpoint,
or that its save was cut short and which one is the newest intact), and the command that continues the run.

`scripts.stalls.HoldAt` holds the run at the chosen point: it writes a marker file, which the test waits for before
it signals the process, and waits for a `go` file."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_stop import metric_steps, newest

from framework import checkpoint as ck

REPO = Path(__file__).parents[1]
MAX_STEPS = 2
WAIT_S = 300   # generous: a loaded 2-core machine


class Fit:
    """`python -m framework fit` of train.yaml for MAX_STEPS steps, held at `point`; its stderr in `<tmp>/err.log`."""

    def __init__(self, tmp_path: Path, point: str, *extra: str):
        self.run_dir, self.marker, self.go = tmp_path / "run", tmp_path / "held", tmp_path / "go"
        self.log = tmp_path / "err.log"
        hold = json.dumps([{"class_path": "scripts.stalls.HoldAt",
                            "init_args": {"point": point, "marker": str(self.marker), "go": str(self.go)}}])
        argv = ["fit", "--config", str(REPO / "train.yaml"), f"--run_dir={self.run_dir}",
                f"--trainer.max_steps={MAX_STEPS}", "--rollout.prompts_per_step=2", "--grpo.group_size=2",
                "--eval.every_n_steps=null", "--trainer.enable_progress_bar=false", "--logging.tensorboard=false",
                f"--callbacks={hold}", *extra]
        self.proc = _fw(argv, self.log)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert self.proc.poll() is None, f"fw exited ({self.proc.returncode}) before {what}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s:\n{self.output()}"
            time.sleep(0.05)

    def held(self) -> None:
        self.wait_for(self.marker.exists, "the hold")

    def said(self, text: str) -> None:
        self.wait_for(lambda: text in self.output(), repr(text))

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"fw did not exit within {WAIT_S} s:\n{self.output()}")

    def lines(self) -> list[str]:
        out = self.output()
        assert "Traceback" not in out and "Exception ignored" not in out, out
        return [line for line in out.splitlines() if line.startswith("fw: ")]


def _fw(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    with log.open("w") as err:
        return subprocess.Popen([sys.executable, "-m", "framework", *argv], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)


def _step(run_dir: Path, step: int) -> Path:
    return ck.checkpoints_dir(run_dir) / ck.step_dir_name(step)


def _continue(run_dir: Path) -> str:
    return f"continue with fw fit --config {run_dir / 'config.yaml'} --resume last"


ENDING = "came as the run was ending: letting its final save and teardown finish (send it again to exit now)"


def test_a_second_signal_during_the_final_save_names_the_newest_intact_checkpoint(tmp_path):
    """SIGTERM while the last step's checkpoint is being saved lets the save go on; Ctrl+C then exits at once (130)
    with a line saying that the save was cut short, that step 1's checkpoint is the newest intact one, and the
    command that continues; nothing of step 2 is published, and that command trains step 2 again."""
    fit = Fit(tmp_path, "final_save", "--checkpoint.every_n_steps=1")
    fit.held()
    fit.proc.send_signal(signal.SIGTERM)
    fit.said(f"fw: SIGTERM {ENDING}")
    fit.proc.send_signal(signal.SIGINT)
    assert fit.wait() == 130, fit.output()
    run_dir = fit.run_dir
    assert fit.lines() == [
        f"fw: SIGTERM {ENDING}",
        (f"fw: SIGINT again as the run was ending: exiting now; the save of step 2 is cut short and publishes "
         f"nothing; the newest intact checkpoint is {_step(run_dir, 1)} (step 1); {_continue(run_dir)}")]
    assert [p.name for p in ck.step_dirs(run_dir)] == [ck.step_dir_name(1)] and newest(run_dir) == "step-000001"

    fit.go.write_text("go")   # the resumed run holds nowhere
    command = shlex.split(fit.lines()[-1].partition("; continue with ")[2])
    resumed = _fw(command[1:], tmp_path / "resume.log")
    assert resumed.wait(timeout=WAIT_S) == 0, (tmp_path / "resume.log").read_text()
    assert newest(run_dir) == ck.step_dir_name(MAX_STEPS) and metric_steps(run_dir) == [1, 2]


def test_a_signal_during_a_callbacks_on_fit_end_lets_the_ending_finish(tmp_path):
    """SIGTERM in a callback's `on_fit_end`, after the final checkpoint is published: the line says the run is
    ending (not that a step is finishing), the callback finishes, and the run ends complete (exit 0) with its line."""
    fit = Fit(tmp_path, "on_fit_end")
    fit.held()
    fit.proc.send_signal(signal.SIGTERM)
    fit.said(f"fw: SIGTERM {ENDING}")
    fit.go.write_text("go")
    assert fit.wait() == 0, fit.output()
    assert fit.lines() == [
        f"fw: SIGTERM {ENDING}",
        (f"fw: SIGTERM came as the run ended: it reached trainer.max_steps 2; its newest checkpoint is "
         f"{_step(fit.run_dir, 2)}, nothing is lost")]
    assert newest(fit.run_dir) == ck.step_dir_name(2) and metric_steps(fit.run_dir) == [1, 2]


def test_a_teardown_that_outlasts_the_grace_exits_saying_the_final_checkpoint_is_written(tmp_path):
    """A callback's `teardown` that does not return: `trainer.stop_grace_s` after SIGTERM the process exits (143),
    saying that the final checkpoint and the metrics up to it are written, not that a step's checkpoint is lost."""
    fit = Fit(tmp_path, "teardown", "--trainer.stop_grace_s=1")
    fit.held()
    fit.proc.send_signal(signal.SIGTERM)
    assert fit.wait() == 143, fit.output()
    assert fit.lines() == [
        f"fw: SIGTERM {ENDING}",
        ("fw: SIGTERM: the run's ending (its final save, the callbacks' and loggers' last work) did not finish "
         "within trainer.stop_grace_s = 1 s of the signal; exiting now; it reached trainer.max_steps 2; its final "
         f"checkpoint {_step(fit.run_dir, 2)} and the metric files up to it are written")]
    assert newest(fit.run_dir) == ck.step_dir_name(2) and metric_steps(fit.run_dir) == [1, 2]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_process_exits_after_the_run_says_its_line(tmp_path, signum):
    """A signal in the process's exit, after fit returned (an atexit hook runs): the process exits with 128 + the
    signal and one line saying the run is complete and written, where Python's own exit would end it with no line
    (SIGTERM) or with a traceback and exit 0 (SIGINT)."""
    fit = Fit(tmp_path, "exit")
    fit.held()
    fit.proc.send_signal(signum)
    assert fit.wait() == 128 + signum, fit.output()
    name = signal.Signals(signum).name
    assert fit.lines() == [
        (f"fw: {name} came as the process was exiting after the run: it reached trainer.max_steps 2; its final "
         f"checkpoint {_step(fit.run_dir, 2)} and the metric files up to it are written")]
    assert newest(fit.run_dir) == ck.step_dir_name(2) and metric_steps(fit.run_dir) == [1, 2]


_PUBLISHED_UNREADABLE = """
import os, signal, sys, threading, time
from framework import signals
signals.STATE_WAIT_S = 0.5
with signals.StopSignals(grace_s=float(sys.argv[1])) as stops:
    stops.start_training()
    stops.ending()
    stops.state = lambda saving: threading.Event().wait() and ""   # run_dir on a file system that does not answer
    os.kill(os.getpid(), signal.SIGTERM)   # the first signal as the run ends: the grace's watchdog starts
    if sys.argv[2] == "again":
        os.kill(os.getpid(), signal.SIGINT)
    time.sleep(120)                        # a final save stuck on that file system
"""



@pytest.mark.parametrize("how", ["grace", "again"])
def test_an_exit_at_once_as_the_run_ends_does_not_wait_on_reading_its_checkpoints(how):
    """The grace's expiry or a second signal as the run ends exits at once even where reading what the run has
    published does not return (its run_dir on a file system that hangs, the likely reason its final save is stuck):
    the line then gives the general account instead of waiting for it."""
    grace, code = ("0.2", 143) if how == "grace" else ("600", 130)
    proc = subprocess.run([sys.executable, "-c", _PUBLISHED_UNREADABLE, grace, how], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    last = ("fw: SIGTERM: the run's ending (its final save, the callbacks' and loggers' last work) did not finish "
            "within trainer.stop_grace_s = 0.2 s of the signal; exiting now" if how == "grace"
            else "fw: SIGINT again as the run was ending: exiting now")
    assert proc.stderr.splitlines() == [f"fw: SIGTERM {ENDING}", f"{last}; the checkpoints published so far are kept"]


def test_a_signal_after_a_library_fit_ended_leaves_the_callers_process_running(capsys):
    """In-process (fit called from Python, not as the `fw` program): a signal between fit's outcome and its return
    gets one line and no exit, and the caller's handlers are back after the context."""
    from framework.signals import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(grace_s=60.0) as stop:
        stop.start_training()
        stop.ended()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)   # the handler runs in the main thread at the next bytecode boundary
    assert "fw: SIGTERM came as the run had ended; nothing is left to stop" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
