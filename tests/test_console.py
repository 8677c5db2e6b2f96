"""fw's lines on stderr (framework/console.py): without a progress bar exactly what print writes; during a fit,
where Lightning's bar is drawn on stdout without ending its line, each a line of its own above the bar, as the
terminal that receives both streams shows them."""

import io
import logging
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
from conftest import on_screen

from framework.callbacks import Callback
from framework.config import resolve
from framework.signals import Stopped
from framework.trainer import fit

ROOT = Path(__file__).resolve().parents[1]


class Recorded(io.StringIO):
    """A stream that keeps every write and flush made to it, in order."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def write(self, s):
        self.calls.append(("write", s))
        return super().write(s)

    def flush(self):
        self.calls.append(("flush",))
        super().flush()


@pytest.mark.parametrize("flush", [False, True])
def test_without_a_bar_a_line_is_written_as_print_writes_it(monkeypatch, flush):
    from framework.console import say

    said, printed = Recorded(), Recorded()
    monkeypatch.setattr(sys, "stderr", said)
    say("fw: warning: a line", flush=flush)
    monkeypatch.setattr(sys, "stderr", printed)
    print("fw: warning: a line", file=sys.stderr, flush=flush)
    assert said.calls == printed.calls
    assert ("flush",) in said.calls if flush else ("flush",) not in said.calls


class FailingReward:
    """The share of letters in the completion; every 8th call raises: 2 of each rollout batch's 16 samples."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompt, completion, metadata):
        self.calls += 1
        if self.calls % 8 == 0:
            raise ValueError("no score")
        return sum(c.isalpha() for c in completion) / max(len(completion), 1)


class LinkThenStop(Callback):
    """At step 3 moves step 2's checkpoint to <run_dir>/../archive and links it back, so that the next save prunes
    a link (keep_last 1), and sends this process SIGTERM: the rollout batch in progress is finished and saved."""

    def after_optimizer_step(self, trainer, module, optimizer):
        run_dir = Path(module.cfg["run_dir"])
        if module.policy_version == 3:
            saved = run_dir / "checkpoints" / "step-000002"
            archive = run_dir.parent / "archive"
            archive.mkdir()
            shutil.move(saved, archive / saved.name)
            saved.symlink_to(archive / saved.name)
            os.kill(os.getpid(), signal.SIGTERM)


def grpo_config(run_dir, max_steps, minibatches):
    """A GRPO run of epochs x minibatches = 2 x `minibatches` policy steps a rollout batch, saved at the end of
    each batch (a batch is one Lightning step) and keeping one checkpoint."""
    return resolve({
        "recipe": "grpo", "seed": 5, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
        "data": {"task": {"name": "digits", "init_args": {"num_digits": 2, "rule": "sum"}}, "chat_template": False},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 3, "temperature": 1.0},
        "reward": {"class_path": "test_console.FailingReward", "on_error": "zero", "max_error_fraction": 0.5},
        "grpo": {"group_size": 4, "epochs": 2, "minibatches": minibatches},
        "optimizer": {"lr": 1e-2},
        "trainer": {"accelerator": "cpu", "max_steps": max_steps, "enable_progress_bar": True},
        "checkpoint": {"every_n_steps": 1, "keep_last": 1},
        "logging": {"csv": False, "tensorboard": False},
        "callbacks": [{"class_path": "test_console.LinkThenStop"}],
    })


def test_fw_lines_during_a_fit_are_lines_of_their_own_above_the_progress_bar(tmp_path, monkeypatch):
    """A run that saves every rollout batch of 2 steps (each save reported), prunes a linked checkpoint, scores
    rewards that fail (logging's warnings, which no handler takes) and is stopped by SIGTERM; resumed, it stops
    inside a rollout batch by trainer.max_steps, and resumed again under another split, drops the rest of that batch
    with a warning. On the screen each of fw's lines stands alone, the bar drawn below it."""
    from framework.checkpoint import lightning_io

    monkeypatch.setattr(lightning_io, "REPORT_BYTES", 0)   # every save is reported
    # the reward's warnings reach no handler, as outside pytest (whose capture handler sits on the root logger)
    monkeypatch.setattr(logging.getLogger("framework.rewards"), "propagate", False)
    last_resort = logging.lastResort
    screen = io.StringIO()   # stdout and stderr, as one terminal receives them
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    run_dir = tmp_path / "run"

    def screen_of(*args, **kwargs):
        screen.seek(0)
        screen.truncate()
        fit(*args, **kwargs)
        return on_screen(screen.getvalue())

    with pytest.raises(Stopped):
        screen_of(grpo_config(run_dir, max_steps=8, minibatches=1))   # stopped in step 3: saves step 4
    first = on_screen(screen.getvalue())
    screen_of(grpo_config(run_dir, max_steps=5, minibatches=1), resume="last")   # saves step 5, inside a batch
    last = screen_of(grpo_config(run_dir, max_steps=9, minibatches=2), resume="last")
    assert logging.lastResort is last_resort   # Python's again once a fit ends

    link, archive = run_dir / "checkpoints" / "step-000002", tmp_path / "archive" / "step-000002"
    saved = r"fw: saved step-00000{}: \d+\.\d MiB written in \d+\.\d s \(\d+\.\d\d GB/s\), \d+\.\d s with gathering " \
            r"the states"
    reward = r"reward failed on 2 of 16 samples; first: sample \d+: raised ValueError: no score \(at .*\); " \
             r"prompt=.* completion=.*; scored 0 \(reward\.on_error: zero\)"
    expected = [
        (first, [reward, saved.format(2),
                 re.escape("fw: SIGTERM: finishing the current step and saving a checkpoint (send it again to exit "
                           "now)"),
                 saved.format(4),
                 re.escape(f"fw: pruned {link}, a link: removed the link, kept its target {archive}")]),
        (last, [re.escape("fw: warning: the checkpoint's run stopped after 1 policy steps of rollout batch 2; its "
                          "steps were counted in another split (grpo.minibatches was 1, now 2), so the rest of that "
                          "batch is dropped and training continues with a new rollout batch"),
                reward, saved.format(9)]),
    ]
    for lines, wanted in expected:
        ours = [line for line in lines if "fw: " in line or "reward failed" in line]
        for pattern in wanted:   # each in a line of its own: nothing before it, nothing after it
            assert any(re.fullmatch(pattern, line) for line in ours), (pattern, ours)
        assert all(line.startswith(("fw: ", "reward failed")) for line in ours), ours
        assert re.search(r"\| \d+/", [line for line in lines if line][-1])   # the bar, drawn last
    assert re.search(r"\| 9/", last[-2])
    # the resumed runs count optimizer steps as a fresh one does, though Lightning resumes them inside an epoch
    assert re.match(r"step: +100%\|.*\| 9/9 ", last[-2]), last[-2]


_STOPPED_IN_A_STEP = """
import os, signal, sys, time
from tqdm import tqdm
from framework.signals import StopSignals
bar = tqdm(total=10, file=sys.stdout, ascii=True, ncols=60)   # Lightning's bar: stdout, no newline
bar.update(3)
bar.refresh()
with StopSignals(grace_s=0.2) as stops:
    stops.start_training()
    os.kill(os.getpid(), signal.SIGTERM)   # the first signal: a stop request and the grace's watchdog
    time.sleep(30)                         # a step that does not finish in time
"""


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="a pseudo-terminal")
def test_the_line_before_a_forced_exit_stands_alone_on_the_terminal(tmp_path):
    """The grace of a stop runs out: the line written just before `os._exit`, which may not wait for the bar's lock,
    stands on a line of its own on the terminal that shows both streams, the bar's unfinished line cleared."""
    import fcntl
    import struct
    import subprocess
    import termios

    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))   # a terminal's size: tqdm draws
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_IN_A_STEP], stdin=subprocess.DEVNULL, stdout=follower,
                            stderr=follower, cwd=ROOT)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:   # EIO: the child is gone and the terminal closed
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    lines = [line for line in on_screen(out.decode()) if line]
    assert lines == [
        "fw: SIGTERM: finishing the current step and saving a checkpoint (send it again to exit now)",
        ("fw: SIGTERM: the step did not finish within trainer.stop_grace_s = 0.2 s; exiting without its checkpoint "
         "(the checkpoints published so far are kept)")], lines
