"""One rank of a 2-process `fw fit` (CPU, gloo) fails alone: a user callback, a step, an eval reward. The job ends
within moments with the failed rank's report only: one `fw: error: global rank N: ...` line and exit code 2 for a
FwError, that rank's traceback alone and exit code 1 for any other exception; no other rank's traceback, no process
left behind (the output is read to its end, which comes when the last process has ended). A callback that stops one
rank alone stops every rank at the same step, exit code 0; a signal to one rank during a save stops every rank once
that save is published, exit code 143."""

import atexit
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from test_ddp import run_fit, without_plans

from framework.callbacks import Callback
from framework.errors import FwError

ROOT = Path(__file__).resolve().parents[1]
LATE_S = 20   # from the failure to the last process's end: moments, not a collective's timeout (minutes)


class FailOnRank(Callback):
    """Raises on global rank `rank` at its `call`-th `hook` (`on_train_batch_end`, or `before_optimizer_step`,
    inside the training step) a FwError (`error: fw`) or a ValueError, writing the time first to `stamp`; that
    rank's process takes `exit_s` seconds more to end after fw's exit hooks (a logger uploading, say)."""

    def __init__(self, rank: int, hook: str, stamp: str, error: str = "fw", call: int = 2, exit_s: float = 0.0):
        self.rank, self.hook, self.stamp, self.error, self.call = rank, hook, stamp, error, call
        self.exit_s = exit_s
        self.calls = 0

    def _maybe_fail(self, trainer, hook: str) -> None:
        if hook != self.hook or trainer.global_rank != self.rank:
            return
        self.calls += 1
        if self.calls == self.call:
            Path(self.stamp).write_text(str(time.time()))
            if self.exit_s:   # registered before fw's hooks, so it runs after them
                atexit.register(time.sleep, self.exit_s)
            if self.error == "fw":
                raise FwError(f"my_callback.threshold: must be below 1 on rank {self.rank}")
            raise ValueError(f"a bug in my_callback on rank {self.rank}")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._maybe_fail(trainer, "on_train_batch_end")

    def before_optimizer_step(self, trainer, module, optimizer):
        self._maybe_fail(trainer, "before_optimizer_step")


class EvalRankReward:
    """0.0 for every sample, except on global rank `rank`, where it raises (writing the time first to `stamp`)."""

    def __init__(self, rank: int, stamp: str):
        self.rank, self.stamp = rank, stamp

    def __call__(self, prompt, completion, metadata):
        if dist.get_rank() == self.rank:
            Path(self.stamp).write_text(str(time.time()))
            raise ValueError(f"eval reward broken on rank {self.rank}")
        return 0.0


EVAL_RAISE_LINE = EvalRankReward.__call__.__code__.co_firstlineno + 3


def fw_fit(tmp_path: Path, cfg: dict) -> tuple[int, str, float]:
    """`run_fit`: (exit code, stderr, seconds from the failure's stamp to the end)."""
    proc = run_fit(tmp_path, cfg)
    end = time.time()
    stamp = tmp_path / "failed_at"
    assert stamp.exists(), proc.stderr[-3000:]   # the failure happened
    return proc.returncode, proc.stderr, end - float(stamp.read_text())


def sft_config(tmp_path: Path, **callback) -> dict:
    return {"recipe": "sft", "seed": 5, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
            "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 96,
                     "batch_size": 2},
            "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": 4,
                        "enable_progress_bar": False},
            "callbacks": [{"class_path": "test_ddp_one_rank_failures.FailOnRank",
                           "init_args": {"stamp": str(tmp_path / "failed_at"), **callback}}],
            "checkpoint": {"every_n_steps": 100}, "logging": {"csv": False, "tensorboard": False}}


def reported(stderr: str) -> list[str]:
    """The lines of `stderr` after the memory plan's table and its verdict, which global rank 0 prints as the run
    starts."""
    assert stderr.startswith("fw plan: "), stderr[-3000:]
    return without_plans(stderr)


@pytest.mark.parametrize("rank, hook", [(1, "on_train_batch_end"),   # the suite's one failing 2-process fit
                                        pytest.param(0, "before_optimizer_step", marks=pytest.mark.slow)])
def test_a_fw_error_on_one_rank_ends_every_rank_with_its_one_line(tmp_path, rank, hook):
    code, err, late = fw_fit(tmp_path, sft_config(tmp_path, rank=rank, hook=hook))
    assert code == 2, err[-3000:]
    line = f"fw: error: global rank {rank}: my_callback.threshold: must be below 1 on rank {rank}"
    assert reported(err) == [line], err[-3000:]   # no traceback, nothing from the other rank
    assert late < LATE_S, err[-3000:]


@pytest.mark.slow   # a 2-process Lightning start-up
def test_another_exception_on_one_rank_shows_that_ranks_traceback_alone(tmp_path):
    code, err, late = fw_fit(tmp_path, sft_config(tmp_path, rank=1, hook="on_train_batch_end", error="value"))
    assert code == 1, err[-3000:]
    lines = reported(err)
    assert lines[0] == "[rank1]: Traceback (most recent call last):", err[-3000:]
    # the exception's line, then the note fit adds to a bug's traceback: what the run kept
    assert lines[-2:] == ["[rank1]: ValueError: a bug in my_callback on rank 1",
                          "[rank1]: fw: the run ended at step 2 on this error; no checkpoint is saved"], err[-3000:]
    assert all(line.startswith("[rank1]: ") for line in lines), err[-3000:]   # rank 1's traceback alone
    assert err.count("Traceback") == 1, err[-3000:]
    assert late < LATE_S, err[-3000:]


@pytest.mark.slow   # a 2-process Lightning start-up
def test_an_eval_reward_failing_on_one_rank_ends_every_rank_with_one_line(tmp_path):
    # 5 eval prompts in chunks of 2: rank 0 scores 2 batches, rank 1 fails on its only one
    cfg = {"recipe": "grpo", "seed": 0, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
           "data": {"task": {"name": "digits"}, "chat_template": False},
           "rollout": {"prompts_per_step": 2, "max_new_tokens": 2},
           "reward": {"class_path": "test_ddp_one_rank_failures.EvalRankReward",
                      "init_args": {"rank": 1, "stamp": str(tmp_path / "failed_at")}, "on_error": "raise"},
           "grpo": {"group_size": 2},
           "eval": {"at_start": True, "max_prompts": 5, "samples_per_prompt": 2, "held_out": False},
           "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": 2,
                       "enable_progress_bar": False},
           "logging": {"csv": False, "tensorboard": False}}
    code, err, late = fw_fit(tmp_path, cfg)
    assert code == 2, err[-3000:]
    (line,) = reported(err)   # no traceback, nothing from the other rank
    assert line.startswith("fw: error: global rank 1: reward failed on 4 of 4 samples; first: sample 0: raised "
                           f"ValueError: eval reward broken on rank 1 (at {__file__}:{EVAL_RAISE_LINE}); prompt="), \
        err[-3000:]
    assert line.endswith("(set reward.on_error: zero to count and zero such samples)"), err[-3000:]
    assert late < LATE_S, err[-3000:]


class SleepInSetup(Callback):
    """Writes `<stamp>.<rank>` in setup, then sleeps there: every rank waits before its first step."""

    def __init__(self, stamp: str):
        self.stamp = stamp

    def setup(self, trainer, module, stage):
        Path(f"{self.stamp}.{trainer.global_rank}").write_text("1")
        time.sleep(60)


def plain_sft(tmp_path: Path, **trainer) -> dict:
    cfg = sft_config(tmp_path, rank=0, hook="none")
    cfg["trainer"].update(trainer)
    cfg["callbacks"] = []
    return cfg


def launch(tmp_path: Path, cfg: dict, *launcher: str) -> subprocess.Popen:
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
    env.pop("FW_DEBUG", None)
    return subprocess.Popen([sys.executable, *launcher, "-m", "framework", "fit", "--config", str(path)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.slow   # a 2-process Lightning start-up
def test_a_sigterm_before_the_first_step_ends_every_rank_with_143_and_one_line(tmp_path):
    """SIGTERM to the whole job while its ranks set up (as `timeout`, Ctrl+C or a scheduler sends it): the README's
    exit code 143 and its one line, from one rank; not a crash's exit code 1."""
    import signal

    stamp = tmp_path / "setup"
    cfg = plain_sft(tmp_path)
    cfg["callbacks"] = [{"class_path": "test_ddp_one_rank_failures.SleepInSetup", "init_args": {"stamp": str(stamp)}}]
    proc = launch(tmp_path, cfg)
    deadline = time.time() + 240
    while not all(Path(f"{stamp}.{r}").exists() for r in (0, 1)) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert reported(err) == ["fw: stopped by SIGTERM before the first step; nothing to save"], err[-3000:]


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork", "ddp_spawn_find_unused_parameters_true"])
def test_strategies_whose_launcher_trains_nothing_are_refused(tmp_path, strategy):
    """ddp_spawn / ddp_fork train in processes the launching one starts and never joins: a SIGTERM to `fw fit` left
    them training, and its end line ("stopped at step 0") was false. fw refuses them before anything starts."""
    proc = launch(tmp_path, plain_sft(tmp_path, strategy=strategy, max_steps=2))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    (line,) = err.splitlines()
    assert re.fullmatch(rf"{re.escape(str(tmp_path / 'config.yaml'))}:1:\d+: trainer.strategy: '{strategy}' is not "
                        "supported by fw: the process fw fit runs in would start the training processes and train in "
                        r"none of them, so a SIGTERM or Ctrl\+C to it would not stop them; use ddp \(the same "
                        r"training, one process a device\)", line), line


@pytest.mark.slow   # a 2-process torchrun start-up
def test_torchrun_names_the_failed_rank_as_the_root_cause(tmp_path):
    """torchrun's agent reports the first process to end as the root cause of a failed job: the failed rank ends
    first, its one line printed, the other rank after it."""
    _rank_1_is_the_root_cause(tmp_path, 29400 + os.getpid() % 500)


def _rank_1_is_the_root_cause(tmp_path: Path, port: int, **callback) -> None:
    """A torchrun job of 2 processes whose rank 1 fails: torchrun's report names rank 1, exit code 2."""
    cfg = sft_config(tmp_path, rank=1, hook="on_train_batch_end", **callback)
    proc = launch(tmp_path, cfg, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err[-3000:]
    assert err.count("fw: error: global rank 1: my_callback.threshold: must be below 1 on rank 1") == 1, err[-3000:]
    root = err[err.index("Root Cause (first observed failure):"):]
    assert "rank      : 1 (local_rank: 1)" in root.splitlines()[4], root
    assert "exitcode  : 2" in root.splitlines()[5], root


@pytest.mark.slow   # a 2-process torchrun start-up
def test_torchrun_names_the_failed_rank_when_its_process_ends_slowly(tmp_path):
    """The failed rank's process ends seconds after its report (an exit hook of its own): the other rank on its
    host ends only once the agent has seen it end, so the agent still names the failed rank."""
    _rank_1_is_the_root_cause(tmp_path, 29400 + (os.getpid() + 250) % 500, exit_s=4.0)


class StopOnOneRank(Callback):
    """Sets `trainer.should_stop` on global rank `rank` alone, as an early-stopping rule that reads a rank-local value
    would: in the batch end of its batch `batch` (0-based), or in `hook` (`setup`, `on_fit_start`, `on_train_start`)
    before any step; every rank writes the step it ended at to `<out>.<rank>`."""

    def __init__(self, rank: int, batch: int, out: str, hook: str = "on_train_batch_end"):
        self.rank, self.batch, self.out, self.hook = rank, batch, out, hook

    def _stop(self, trainer, hook: str) -> None:
        if trainer.global_rank == self.rank and hook == self.hook:
            trainer.should_stop = True

    def setup(self, trainer, module, stage):
        self._stop(trainer, "setup")

    def on_fit_start(self, trainer, module):
        self._stop(trainer, "on_fit_start")

    def on_train_start(self, trainer, module):
        self._stop(trainer, "on_train_start")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == self.batch:
            self._stop(trainer, "on_train_batch_end")

    def on_fit_end(self, trainer, module):   # Lightning skips `on_train_end` when the loop never starts
        Path(f"{self.out}.{trainer.global_rank}").write_text(json.dumps([trainer.global_step, module.policy_version]))


def run_stopped_on_one_rank(tmp_path: Path, cfg: dict, step: int) -> str:
    """Runs `cfg` to its end (a hang is a failure) and returns its stderr, after checking exit code 0 and that its
    one report is the early stop's at `step`, from rank 0 alone."""
    import signal

    proc = launch(tmp_path, cfg)
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:   # the other rank waits in a collective the stopped one never joins
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the job did not end: a rank waits for the one that stopped")
    assert proc.returncode == 0, err[-3000:]
    latest = Path(cfg["run_dir"]) / "checkpoints" / f"step-{step:06d}"
    resume = f"fw fit --config {Path(cfg['run_dir']) / 'config.yaml'} --resume last"
    saved = f"checkpoint {latest}; {resume} continues" if step else "no checkpoint"
    line = (f"fw: stopped at step {step} of trainer.max_steps {cfg['trainer']['max_steps']}: a callback asked to "
            f"(trainer.should_stop); {saved}")
    assert reported(err) == [line], err[-3000:]   # no traceback, no error line
    return err


@pytest.mark.parametrize("accumulate, batch", [
    pytest.param(1, 1, marks=pytest.mark.slow),   # the step's own batch end
    pytest.param(2, 2, marks=pytest.mark.slow),   # the first micro-batch of step 2: the stop waits for its end
])   # slow: a 2-process Lightning start-up each
def test_a_callback_stopping_one_rank_stops_every_rank_at_the_same_step(tmp_path, accumulate, batch):
    from framework.checkpoint import find_latest, verify_checkpoint
    from framework.metrics import read_metrics

    end = tmp_path / "ended"
    cfg = plain_sft(tmp_path, max_steps=6, accumulate_grad_batches=accumulate, log_every_n_steps=4)
    cfg["callbacks"] = [{"class_path": "test_ddp_one_rank_failures.StopOnOneRank",
                         "init_args": {"rank": 1, "batch": batch, "out": str(end)}}]
    run_stopped_on_one_rank(tmp_path, cfg, 2)
    assert [json.loads(Path(f"{end}.{r}").read_text()) for r in (0, 1)] == [[2, 2], [2, 2]]
    run = Path(cfg["run_dir"])
    latest = find_latest(run)
    assert Path(latest).name == "step-000002"   # the step the run stopped at
    verify_checkpoint(latest)   # every file whole
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [2]   # its last steps logged


@pytest.mark.slow   # a 2-process Lightning start-up each
@pytest.mark.parametrize("hook", ["setup", "on_train_start"])   # agreed before the loop and at its start
def test_a_callback_stopping_one_rank_before_the_first_step_stops_every_rank(tmp_path, hook):
    from framework.checkpoint import list_checkpoints

    end = tmp_path / "ended"
    cfg = plain_sft(tmp_path, max_steps=6)
    cfg["callbacks"] = [{"class_path": "test_ddp_one_rank_failures.StopOnOneRank",
                         "init_args": {"rank": 1, "batch": -1, "out": str(end), "hook": hook}}]
    run_stopped_on_one_rank(tmp_path, cfg, 0)
    assert [json.loads(Path(f"{end}.{r}").read_text()) for r in (0, 1)] == [[0, 0], [0, 0]]
    assert list_checkpoints(cfg["run_dir"]) == []   # no step, nothing saved


class SignalOneRankDuringSave(Callback):
    """Sends SIGTERM to global rank `rank`'s own process while the checkpoint of policy step `step` is being saved
    (from the save's `on_save_checkpoint`, which every rank runs); every rank writes the step it ended at to
    `<out>.<rank>`."""

    def __init__(self, rank: int, step: int, out: str):
        self.rank, self.step, self.out = rank, step, out

    def on_save_checkpoint(self, trainer, module, checkpoint):
        import signal

        if trainer.global_rank == self.rank and module.policy_version == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_fit_end(self, trainer, module):
        Path(f"{self.out}.{trainer.global_rank}").write_text(json.dumps(module.policy_version))


@pytest.mark.slow   # a 2-process Lightning start-up
def test_a_signal_to_one_rank_during_a_save_stops_every_rank_with_that_step(tmp_path):
    """SIGTERM reaches rank 1 alone while step 2's periodic checkpoint is saved: once that save is published every
    rank stops (agreed after the save), none trains step 3, and the job exits 143 naming step 2."""
    import signal

    from framework.checkpoint import list_checkpoints, verify_checkpoint

    end = tmp_path / "ended"
    cfg = plain_sft(tmp_path, max_steps=6)
    cfg["checkpoint"] = {"every_n_steps": 2}
    cfg["callbacks"] = [{"class_path": "test_ddp_one_rank_failures.SignalOneRankDuringSave",
                         "init_args": {"rank": 1, "step": 2, "out": str(end)}}]
    proc = launch(tmp_path, cfg)
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:   # a rank waits in a collective the other never joins
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the job did not end: one rank stopped and the other waits for it")
    assert proc.returncode == 143, err[-3000:]
    assert [json.loads(Path(f"{end}.{r}").read_text()) for r in (0, 1)] == [2, 2]
    saved = list_checkpoints(cfg["run_dir"])
    assert [Path(p).name for p in saved] == ["step-000002"]
    verify_checkpoint(saved[0])
    resume = f"fw fit --config {Path(cfg['run_dir']) / 'config.yaml'} --resume last"
    assert reported(err)[-1] == (f"fw: stopped by SIGTERM after step 2; checkpoint {saved[0]}; continue with "
                                 f"{resume}"), err[-3000:]
