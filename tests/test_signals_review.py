"""Real `fw fit` processes signalled at chosen moments: during a checkpoint save, twice around the stop's save, and
SIGUSR1 (SLURM's warning ahead of a time limit). Exit codes, lines, checkpoints, metrics and the resume's losses.

Each run is a process forked from the session's forkserver (tests/scripts/preloaded.py). A signal "during a save"
is sent by the process to itself from inside the write of a checkpoint file (the real `kill` at a moment chosen
in the code, not by a timer that a loaded machine would make miss the save).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from scripts.fw_logged import run_logged
from scripts.preloaded import forkserver
from test_stop import NOISE, callbacks, metric_steps, newest, policy_weights, sft_argv, steps_done, wait_for
from test_stop import Run as StopRun

from framework import checkpoint as ck

# the environment under which Lightning takes a process for a SLURM task (SLURMEnvironment.detect) and puts its
# own SIGUSR1 handler (auto-requeue) in place
SLURM = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
         "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}


def _fit(argv: list[str], log: str, env: dict[str, str], kills: dict[int, int]) -> None:
    """`fw` with `env` set; `kills`: {step: signal} sent to this process while step's checkpoint file is written."""
    os.environ.update(env)
    if kills:
        from framework.checkpoint import directory

        write, sent = directory.write_safetensors, set()

        def write_and_signal(path, *args, **kwargs):   # the save's staging directory holds the step's name
            out = write(path, *args, **kwargs)
            step = next((s for s in kills if f"step-{s:06d}" in str(path) and s not in sent), None)
            if step is not None:
                sent.add(step)
                os.kill(os.getpid(), kills[step])
            return out

        directory.write_safetensors = write_and_signal
    run_logged(argv, log)


class Run(StopRun):
    """One `fw fit` process forked from the forkserver, its stdout and stderr in `log`, with `env` set and `kills`
    sent to it (`_fit`)."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None,
                 kills: dict[int, int] | None = None):
        self.log = log
        self.proc = forkserver().Process(target=_fit, args=(argv, str(log), env or {}, kills or {}))
        self.proc.start()


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def hidden(run_dir: Path) -> list[str]:
    return [n for n in os.listdir(ck.checkpoints_dir(run_dir)) if n.startswith(".")]


def _resumed_matches_a_straight_run(tmp_path: Path, run_dir: Path, end: int) -> None:
    """`--resume last` to `end` leaves no staging behind and logs the losses and ends on the weights of a run that
    was never stopped (bit for bit: the CPU run is deterministic)."""
    resumed = Run(sft_argv(run_dir, "--resume", "last", max_steps=end), tmp_path / "resume.log")
    assert resumed.wait() == 0, resumed.output()
    straight = Run(sft_argv(tmp_path / "straight", max_steps=end), tmp_path / "straight.log")
    assert straight.wait() == 0, straight.output()
    assert metric_steps(run_dir) == list(range(1, end + 1)) and hidden(run_dir) == []
    assert losses(run_dir) == losses(tmp_path / "straight")
    got, want = policy_weights(run_dir), policy_weights(tmp_path / "straight")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_sigterm_during_a_checkpoint_save_lets_it_finish_then_stops_with_that_step(tmp_path):
    """The save of step 2 is under way when SIGTERM comes: it is published whole and the run stops there, exiting
    143 with its two lines, step 2 its last. Fails if the handler raised into the save (a torn step 2), or if the
    stop waited for the next step's end (a step 3 trained and saved against the signal's grace)."""
    run_dir = tmp_path / "run"
    run = Run(sft_argv(run_dir, "--checkpoint.every_n_steps=2", "--checkpoint.keep_last=3", max_steps=8),
              tmp_path / "fit.log", kills={2: signal.SIGTERM})
    assert run.wait() == 143, run.output()
    out = run.output()
    assert "Traceback" not in out and not [n for n in NOISE if n in out], out
    assert [Path(p).name for p in ck.list_checkpoints(run_dir)] == [ck.step_dir_name(2)]
    ck.verify_checkpoint(ck.list_checkpoints(run_dir)[0])
    assert hidden(run_dir) == [] and metric_steps(run_dir) == [1, 2]
    lines = [line for line in out.splitlines() if line.startswith(("fw: SIGTERM", "fw: stopped"))]
    assert lines == ["fw: SIGTERM: finishing the current step and saving a checkpoint (send it again to exit now)",
                     f"fw: stopped by SIGTERM after step 2; checkpoint {ck.checkpoints_dir(run_dir) / 'step-000002'}; "
                     + f"continue with fw fit --config {run_dir / 'config.yaml'} --resume last"]
    assert out.splitlines()[-1] == lines[-1]
    _resumed_matches_a_straight_run(tmp_path, run_dir, end=5)


def test_a_second_signal_during_the_stops_own_save_exits_at_once_keeping_the_published_ones(tmp_path):
    """SIGTERM while step 3 trains, then Ctrl+C while the stop's checkpoint (step 3) is written: the process ends at
    once (130, the "again" line last, naming step 2 as the newest intact checkpoint and the command that continues),
    step 3's staging is left unpublished, steps 1 and 2 stay intact, and `--resume last` continues from step 2 to the
    straight run's losses and weights."""
    run_dir = tmp_path / "run"
    run = Run(sft_argv(run_dir, "--checkpoint.every_n_steps=1", "--checkpoint.keep_last=3",
                       callbacks(("SignalAtStep", {"step": 2, "signum": int(signal.SIGTERM)})), max_steps=8),
              tmp_path / "fit.log", kills={3: signal.SIGINT})
    assert run.wait() == 130, run.output()
    out = run.output()
    assert "Traceback" not in out, out
    assert out.splitlines()[-1] == (
        "fw: SIGINT again as the run was ending: exiting now; the save of step 3 is cut short and publishes nothing; "
        f"the newest intact checkpoint is {ck.checkpoints_dir(run_dir) / ck.step_dir_name(2)} (step 2); continue with "
        f"fw fit --config {run_dir / 'config.yaml'} --resume last")
    assert [Path(p).name for p in ck.list_checkpoints(run_dir)] == [ck.step_dir_name(1), ck.step_dir_name(2)]
    assert newest(run_dir) == ck.step_dir_name(2)
    _resumed_matches_a_straight_run(tmp_path, run_dir, end=5)


@pytest.mark.parametrize("env", [SLURM, {}], ids=["slurm", "plain"])
def test_sigusr1_stops_as_sigterm_does_without_lightnings_slurm_checkpoint(tmp_path, env):
    """SIGUSR1 is what a SLURM job is told to expect ahead of its time limit (`--signal=USR1@90`). Before fw took it,
    a SLURM task got Lightning's auto-requeue handler (an `hpc_ckpt_1.ckpt` written into run_dir mid-step, the
    loggers finalized, `scontrol requeue`) and trained on; any other process was killed by it (exit -10, no
    checkpoint of the step). Now it is a stop request: the step finishes, is saved, and the run exits 138."""
    run_dir, progress = tmp_path / "run", tmp_path / "steps"
    run = Run(sft_argv(run_dir, "--checkpoint.every_n_steps=1000", callbacks(("StepFile", {"path": str(progress)}))),
              tmp_path / "fit.log", env=env)
    wait_for(lambda: steps_done(progress) >= 2, "second step", run)   # type: ignore[arg-type]
    os.kill(run.proc.pid, signal.SIGUSR1)
    assert run.wait() == 128 + signal.SIGUSR1, run.output()
    out = run.output()
    assert "Traceback" not in out and not [n for n in NOISE if n in out], out
    assert "auto-requeue signal" not in out and "scontrol" not in out, out   # Lightning's handler did not run
    assert "auto-requeueing enabled" not in out and "Received SIGUSR1" not in out, out   # nor says it would
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith("hpc_ckpt")]
    reached = metric_steps(run_dir)[-1]
    assert reached >= 2 and metric_steps(run_dir) == list(range(1, reached + 1))
    assert newest(run_dir) == ck.step_dir_name(reached)
    assert "fw: SIGUSR1: finishing the current step and saving a checkpoint (send it again to exit now)" in out
    assert out.splitlines()[-1] == (f"fw: stopped by SIGUSR1 after step {reached}; checkpoint "
                                    f"{ck.checkpoints_dir(run_dir) / ck.step_dir_name(reached)}; continue with "
                                    f"fw fit --config {run_dir / 'config.yaml'} --resume last")
