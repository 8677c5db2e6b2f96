"""Real `fw fit` processes that are signalled, hang, or share a run_dir: exit codes, checkpoints, metrics.

The runs are processes forked from a forkserver with torch and fw preloaded (as in test_crash_safety),
so each costs its model build and steps, not a fresh interpreter's imports; one slow test uses
`python -m framework` itself. Each process writes its stdout and stderr to a log file that the test reads.
"""

from __future__ import annotations

import inspect
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from scripts.fw_logged import run_logged
from scripts.preloaded import forkserver

from framework import checkpoint as ck

REPO = Path(__file__).parents[1]
# Lightning lines that a user of fw cannot act on (framework/trainer.py silences them)
NOISE = ["GPU available", "TPU available", "Tip:", "LeafSpec", "eval mode", "`Trainer.fit` stopped",
         "does not have many workers"]


def sft_argv(run_dir: Path, *extra: str, max_steps: int = 1000) -> list[str]:
    return ["fit", "--config", str(REPO / "recipes" / "sft.yaml"), f"--run_dir={run_dir}",
            f"--data.path={REPO / 'recipes' / 'data' / 'arithmetic_chat.jsonl'}", "--data.max_seq_len=64",
            "--data.batch_size=4", f"--trainer.max_steps={max_steps}", "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false", "--logging.tensorboard=false", "--checkpoint.verify=true",
            *extra]


def callbacks(*specs: tuple[str, dict]) -> str:
    return "--callbacks=" + json.dumps([{"class_path": f"scripts.stalls.{name}", "init_args": args}
                                        for name, args in specs])


class Run:
    """One `fw` process forked from the forkserver, logging to `log`."""

    def __init__(self, argv: list[str], log: Path):
        ctx = forkserver()   # the session's one forkserver, fw preloaded
        self.log = log
        self.proc = ctx.Process(target=run_logged, args=(argv, str(log)))
        self.proc.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def wait(self, timeout: float = 120) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
            pytest.fail(f"fw did not exit within {timeout} s; it printed:\n{self.output()}")
        return self.proc.exitcode

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def wait_for(predicate, what: str, run: Run, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert run.proc.is_alive(), f"fw exited ({run.proc.exitcode}) before {what}:\n{run.output()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def steps_done(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except FileNotFoundError:
        return 0


def metric_steps(run_dir: Path) -> list[int]:
    """The steps of metrics.jsonl, every line parsed (a torn or foreign line fails the test)."""
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def newest(run_dir: Path) -> str:
    latest = ck.find_latest(run_dir)
    assert latest is not None, f"no checkpoint under {run_dir}"
    ck.verify_checkpoint(latest)
    return Path(latest).name


def policy_weights(run_dir: Path) -> dict:
    return ck.read_checkpoint_dir(ck.find_latest(run_dir))["fw_components"]["policy"]["state_dict"]


# ------------------------------------------------------------------------------------------ one signal

@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_finishes_the_step_saves_it_and_resume_continues(tmp_path, signum, code):
    run_dir, progress = tmp_path / "run", tmp_path / "steps"
    run = Run(sft_argv(run_dir, "--checkpoint.every_n_steps=1000", callbacks(("StepFile", {"path": str(progress)}))),
              tmp_path / "fit.log")
    wait_for(lambda: steps_done(progress) >= 2, "second step", run)
    run.signal(signum)
    assert run.wait() == code
    out = run.output()
    # the step in progress finished and is the one checkpoint (none was due before max_steps)
    reached = metric_steps(run_dir)[-1]
    assert reached >= 2 and metric_steps(run_dir) == list(range(1, reached + 1))
    assert newest(run_dir) == ck.step_dir_name(reached)
    name = signal.Signals(signum).name
    assert f"fw: {name}: finishing the current step and saving a checkpoint" in out
    assert out.splitlines()[-1] == (f"fw: stopped by {name} after step {reached}; checkpoint "
                                    f"{ck.checkpoints_dir(run_dir) / ck.step_dir_name(reached)}; continue with "
                                    f"fw fit --config {run_dir / 'config.yaml'} --resume last")
    assert "Traceback" not in out and not [n for n in NOISE if n in out], out

    # --resume last continues from it, to the weights of a run that was never stopped
    end = reached + 2
    resumed = Run(sft_argv(run_dir, "--resume", "last", max_steps=end), tmp_path / "resume.log")
    assert resumed.wait() == 0, resumed.output()
    assert metric_steps(run_dir) == list(range(1, end + 1))
    assert newest(run_dir) == ck.step_dir_name(end)
    straight = Run(sft_argv(tmp_path / "straight", max_steps=end), tmp_path / "straight.log")
    assert straight.wait() == 0, straight.output()
    got, want = policy_weights(run_dir), policy_weights(tmp_path / "straight")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_stop_lines_command_continues_with_the_overrides_the_run_started_with(tmp_path):
    """The stop line's command resumes from the run's config.yaml, which keeps the overrides the run was started with
    (a learning rate, a checkpoint every step kept for good, the last step): no setting changes, every checkpoint
    stays, and the run ends on the weights of a straight run with the same overrides. The config file and
    `--resume last` alone would set them back to the file's and prune all but its keep_last newest checkpoints."""
    run_dir, progress = tmp_path / "run", tmp_path / "steps"
    extra = ("--optimizer.lr=3e-4", "--checkpoint.every_n_steps=1", "--checkpoint.keep_last=null")
    run = Run(sft_argv(run_dir, *extra, callbacks(("StepFile", {"path": str(progress)})), max_steps=6),
              tmp_path / "fit.log")
    wait_for(lambda: steps_done(progress) >= 2, "second step", run)
    run.signal(signal.SIGTERM)
    assert run.wait() == 143, run.output()
    reached = metric_steps(run_dir)[-1]
    assert reached < 6, "the run ended before the signal"
    command = shlex.split(run.output().splitlines()[-1].partition("; continue with ")[2])
    assert command == ["fw", "fit", "--config", str(run_dir / "config.yaml"), "--resume", "last"]
    resumed = Run(command[1:], tmp_path / "resume.log")
    assert resumed.wait() == 0, resumed.output()
    assert "changed settings" not in resumed.output(), resumed.output()
    assert [Path(p).name for p in ck.list_checkpoints(run_dir)] == [ck.step_dir_name(s) for s in range(1, 7)]
    assert metric_steps(run_dir) == list(range(1, 7))
    straight = Run(sft_argv(tmp_path / "straight", *extra, max_steps=6), tmp_path / "straight.log")
    assert straight.wait() == 0, straight.output()
    got, want = policy_weights(run_dir), policy_weights(tmp_path / "straight")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_python_m_framework_fit_on_sigterm_exits_143_with_a_checkpoint(tmp_path):
    run_dir, progress = tmp_path / "run", tmp_path / "steps"
    argv = sft_argv(run_dir, "--checkpoint.every_n_steps=1000", callbacks(("StepFile", {"path": str(progress)})))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "framework", *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while steps_done(progress) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    reached = metric_steps(run_dir)[-1]
    assert newest(run_dir) == ck.step_dir_name(reached) and err.splitlines()[-1].startswith("fw: stopped by SIGTERM")


# ------------------------------------------------------------------------------------------ a step that never ends

def _hang_at_step_2(tmp_path: Path, *extra: str) -> tuple[Run, Path]:
    run_dir, marker = tmp_path / "run", tmp_path / "hanging"
    run = Run(sft_argv(run_dir, "--checkpoint.every_n_steps=1", *extra,
                       callbacks(("HangAtStep", {"step": 1, "marker": str(marker)}))), tmp_path / "fit.log")
    wait_for(marker.exists, "the hang", run)
    return run, run_dir


def test_a_second_signal_ends_a_hanging_step_at_once(tmp_path):
    run, run_dir = _hang_at_step_2(tmp_path)
    run.signal(signal.SIGTERM)
    time.sleep(1.0)
    assert run.proc.is_alive()   # the first signal waits for the step (stop_grace_s is 600 s)
    start = time.monotonic()
    run.signal(signal.SIGINT)
    assert run.wait(timeout=30) == 130
    assert time.monotonic() - start < 10
    out = run.output()
    assert "fw: SIGTERM: finishing the current step" in out and out.splitlines()[-1] == (
        "fw: SIGINT again: exiting now; the checkpoints published so far are kept")
    assert newest(run_dir) == ck.step_dir_name(1)


def test_the_watchdog_ends_a_step_that_does_not_finish_within_the_grace_period(tmp_path):
    run, run_dir = _hang_at_step_2(tmp_path, "--trainer.stop_grace_s=1")
    start = time.monotonic()
    run.signal(signal.SIGTERM)
    assert run.wait(timeout=30) == 143
    assert time.monotonic() - start < 10
    assert run.output().splitlines()[-1] == (
        "fw: SIGTERM: the step did not finish within trainer.stop_grace_s = 1 s; exiting without its checkpoint "
        "(the checkpoints published so far are kept)")
    assert newest(run_dir) == ck.step_dir_name(1)


def test_a_hanging_reward_is_ended_by_reward_timeout(tmp_path):
    marker = tmp_path / "scoring"
    reward = json.dumps({"class_path": "scripts.stalls.HangingReward", "init_args": {"marker": str(marker)}})
    argv = ["fit", "--config", str(REPO / "train.yaml"), f"--run_dir={tmp_path / 'run'}", "--trainer.max_steps=2",
            "--rollout.prompts_per_step=2", "--grpo.group_size=2", "--grpo.kl_coef=0.1", "--logging.tensorboard=false",
            f"--reward={reward}", "--reward.timeout_s=1"]
    run = Run(argv, tmp_path / "fit.log")
    wait_for(marker.exists, "the first reward call", run)
    start = time.monotonic()
    assert run.wait(timeout=60) == 2
    assert time.monotonic() - start < 20
    out = run.output()
    last = out.split("\n")[-2]   # the progress bar's line was ended: the error is a line of its own
    assert last.startswith("fw: error: reward call did not return within reward.timeout_s = 1 s; sample 0: "), out
    assert "Traceback" not in out and not [n for n in NOISE if n in out], out   # grpo.kl_coef: an eval-mode model


def test_a_keyboard_interrupt_in_a_callback_stops_the_run_in_one_line(tmp_path):
    """Lightning ends a fit that meets a KeyboardInterrupt with exit 1 and no word; one that user code raises outside
    a reward (here a callback) ends it as Ctrl+C does: exit 130, one line naming where it was raised and the newest
    checkpoint, which stays as it was."""
    import scripts.stalls

    run_dir = tmp_path / "run"
    run = Run(sft_argv(run_dir, callbacks(("InterruptAtStep", {"step": 2})), "--checkpoint.every_n_steps=1"),
              tmp_path / "fit.log")
    assert run.wait() == 130, run.output()
    out = run.output()
    lines, first = inspect.getsourcelines(scripts.stalls.InterruptAtStep.on_train_batch_start)
    raised = first + next(i for i, line in enumerate(lines) if "raise KeyboardInterrupt" in line)
    assert out.splitlines()[-1] == (
        f"fw: interrupted at step 2: KeyboardInterrupt raised at {scripts.stalls.__file__}:{raised}; the newest "
        f"checkpoint is {ck.checkpoints_dir(run_dir) / ck.step_dir_name(2)}, and what came after it is not saved; "
        f"continue with fw fit --config {run_dir / 'config.yaml'} --resume last")
    assert "Traceback" not in out and not [n for n in NOISE if n in out], out
    assert newest(run_dir) == ck.step_dir_name(2) and metric_steps(run_dir) == [1, 2]


def _interrupting_reward_run(tmp_path: Path, how: str, *extra: str) -> tuple[Run, Path]:
    """A GRPO run of 3 steps, a checkpoint each, whose reward is interrupted in its 6th call: step 2's (4 a step)."""
    reward = json.dumps({"class_path": "scripts.stalls.InterruptingReward", "init_args": {"at_call": 6, "how": how}})
    run_dir = tmp_path / "run"
    argv = ["fit", "--config", str(REPO / "train.yaml"), f"--run_dir={run_dir}", "--trainer.max_steps=3",
            "--rollout.prompts_per_step=2", "--grpo.group_size=2", "--logging.tensorboard=false",
            "--checkpoint.every_n_steps=1", "--trainer.log_every_n_steps=1", "--eval.every_n_steps=null",
            f"--reward={reward}", *extra]
    return Run(argv, tmp_path / "fit.log"), run_dir


@pytest.mark.parametrize("timeout", [[], ["--reward.timeout_s=60"]], ids=["same-thread", "timed-thread"])
def test_a_keyboard_interrupt_in_the_reward_stops_the_run_as_ctrl_c_does(tmp_path, timeout):
    """Not a failed sample, and not Lightning's silent exit 1: exit 130 with one line, the published checkpoints and
    metrics kept, and --resume last continues."""
    run, run_dir = _interrupting_reward_run(tmp_path, "raise", *timeout)
    assert run.wait() == 130, run.output()
    out = run.output()
    assert out.splitlines()[-1] == (
        "fw: interrupted at step 1: KeyboardInterrupt in the reward call on sample 1; the newest checkpoint is "
        f"{ck.checkpoints_dir(run_dir) / ck.step_dir_name(1)}, and what came after it is not saved; continue with "
        f"fw fit --config {run_dir / 'config.yaml'} --resume last")
    assert "Traceback" not in out and "reward failed" not in out and not [n for n in NOISE if n in out], out
    assert newest(run_dir) == ck.step_dir_name(1) and metric_steps(run_dir) == [1]
    resumed = Run(["fit", "--config", str(run_dir / "config.yaml"), "--resume", "last",
                   "--reward={name: numeric_match}"], tmp_path / "resume.log")
    assert resumed.wait() == 0, resumed.output()
    assert newest(run_dir) == ck.step_dir_name(3) and metric_steps(run_dir) == [1, 2, 3]


def test_ctrl_c_while_the_reward_runs_finishes_the_step(tmp_path):
    """The reference the test above matches: SIGINT during a reward call is a stop request; the step finishes."""
    run, run_dir = _interrupting_reward_run(tmp_path, "signal")
    assert run.wait() == 130, run.output()
    assert run.output().splitlines()[-1] == (
        f"fw: stopped by SIGINT after step 2; checkpoint {ck.checkpoints_dir(run_dir) / ck.step_dir_name(2)}; "
        f"continue with fw fit --config {run_dir / 'config.yaml'} --resume last")
    assert newest(run_dir) == ck.step_dir_name(2) and metric_steps(run_dir) == [1, 2]


# ------------------------------------------------------------------------------------------ one run per run_dir

def test_a_second_fit_into_a_run_dir_in_use_is_refused_naming_the_holder(tmp_path):
    first, run_dir = _hang_at_step_2(tmp_path)
    config = (run_dir / "config.yaml").read_text()
    second = Run(sft_argv(run_dir, "--resume", "last", "--trainer.max_steps=3", "--optimizer.lr=0.5"),
                 tmp_path / "second.log")
    assert second.wait() == 2
    assert second.output() == (f"fw: error: run_dir {run_dir} is in use by another fw fit (pid {first.pid}); "
                               "wait for it to end or choose another run_dir\n")
    assert (run_dir / "config.yaml").read_text() == config and newest(run_dir) == ck.step_dir_name(1)
    # the kernel drops the lock with its holder, however it ends
    first.signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    third = Run(sft_argv(run_dir, "--resume", "last", max_steps=2), tmp_path / "third.log")
    assert third.wait() == 0, third.output()
    assert newest(run_dir) == ck.step_dir_name(2)


def test_a_grace_past_what_a_timer_can_wait_is_refused_by_the_schema():
    """A grace beyond threading.TIMEOUT_MAX kills the watchdog's thread at the first signal (OverflowError); the
    schema caps it at a year, far below that, and says so at the setting."""
    from framework.config import load_config
    from framework.errors import ConfigError

    assert 31536000 < threading.TIMEOUT_MAX
    train = str(Path(__file__).resolve().parents[1] / "train.yaml")
    with pytest.raises(ConfigError) as e:
        load_config([train], ["--trainer.stop_grace_s=1e300"])
    assert [str(p) for p in e.value.problems] == [
        "override '--trainer.stop_grace_s=1e300': trainer.stop_grace_s: must be <= 31536000, got 1e+300"]
    assert load_config([train], ["--trainer.stop_grace_s=31536000"])["trainer"]["stop_grace_s"] == 31536000


def test_a_lock_that_cannot_be_created_is_one_line(tmp_path):
    """Where the run directory cannot be made (validate's access() check can pass as root on special file systems):
    an FwError naming the lock, not an OSError's traceback."""
    from framework.errors import FwError
    from framework.run_lock import RunLock

    (tmp_path / "file").write_text("x\n")
    run_dir = tmp_path / "file" / "run"
    with pytest.raises(FwError, match=rf"^run_dir {run_dir}: cannot create {run_dir}/\.lock: "), RunLock(run_dir):
        pass
