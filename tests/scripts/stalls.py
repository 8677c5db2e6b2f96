"""User code that reports its progress or never returns, for the tests of stopping a run."""

from __future__ import annotations

import atexit
import os
import signal
import time
from pathlib import Path

import lightning


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


class StepFile(lightning.Callback):
    """Writes the number of policy steps done to `path` at the end of every batch."""

    def __init__(self, path: str):
        self.path = path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        _write(self.path, str(module.policy_version))


class HangAtStep(lightning.Callback):
    """Never returns from the start of the batch that follows policy step `step`; touches `marker` first."""

    def __init__(self, step: int, marker: str):
        self.step = step
        self.marker = marker

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if module.policy_version == self.step:
            _write(self.marker, "")
            time.sleep(3600)


class InterruptAtStep(lightning.Callback):
    """Raises KeyboardInterrupt at the start of the batch that follows policy step `step`, as user code may."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if module.policy_version == self.step:
            raise KeyboardInterrupt


class SignalAtStep(lightning.Callback):
    """Sends `signum` to its own process at the start of the batch that follows policy step `step`, as `kill` does
    while that batch trains."""

    def __init__(self, step: int, signum: int):
        self.step = step
        self.signum = signum

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if module.policy_version == self.step:
            os.kill(os.getpid(), self.signum)


class HangingReward:
    """A reward whose first call touches `marker` and never returns."""

    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self, prompt: str, completion: str, metadata: dict) -> float:
        _write(self.marker, "")
        time.sleep(3600)
        return 0.0


class InterruptingReward:
    """Scores 0 until its call number `at_call` (from 1), which raises KeyboardInterrupt (`how`: "raise", as a
    `raise KeyboardInterrupt` or a library's own SIGINT handling does) or sends SIGINT to its process ("signal", as
    Ctrl+C does while the reward runs) and scores 0."""

    def __init__(self, at_call: int, how: str = "raise"):
        self.at_call = at_call
        self.how = how
        self.calls = 0

    def __call__(self, prompt: str, completion: str, metadata: dict) -> float:
        self.calls += 1
        if self.calls == self.at_call:
            if self.how == "raise":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)
        return 0.0


def _hold(marker: str, go: str) -> None:
    """Write `marker`, then wait (up to 300 s) until the file `go` exists."""
    _write(marker, "held")
    deadline = time.monotonic() + 300
    while not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


class HoldAt(lightning.Callback):
    """Holds the run (`_hold`) at `point` as it ends: "final_save" (the last step's checkpoint, before any of it is
    written), "on_fit_end", "teardown", or "exit" (an atexit hook that `teardown` registers, as a logger's upload at
    exit is)."""

    def __init__(self, point: str, marker: str, go: str):
        self.point, self.marker, self.go = point, marker, go

    def on_save_checkpoint(self, trainer, module, checkpoint):
        if self.point == "final_save" and module.policy_version == trainer.max_steps:
            _hold(self.marker, self.go)

    def on_fit_end(self, trainer, module):
        if self.point == "on_fit_end":
            _hold(self.marker, self.go)

    def teardown(self, trainer, module, stage):
        if self.point == "teardown":
            _hold(self.marker, self.go)
        elif self.point == "exit":
            atexit.register(_hold, self.marker, self.go)
