"""A signal to `fw fit` in its run's last step: the step finishes, and the run ends with exit code 0 and a line
that says so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning

REPO = Path(__file__).parents[1]

class HoldLastStep(lightning.Callback):
    """At the start of the run's last step, writes `marker` and waits until the file `go` exists."""

    def __init__(self, marker: str, go: str):
        self.marker, self.go = marker, go

    def on_train_batch_start(self, trainer: lightning.Trainer, module: lightning.LightningModule, batch: object,
                             batch_idx: int) -> None:
        if module.policy_version == trainer.max_steps - 1:
            Path(self.marker).write_text("last step")
            deadline = time.monotonic() + 300
            while not Path(self.go).exists() and time.monotonic() < deadline:
                time.sleep(0.05)


def _argv(run_dir: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(REPO / "train.yaml"), f"--run_dir={run_dir}", "--trainer.max_steps=2",
            "--trainer.enable_progress_bar=false", "--logging.tensorboard=false", *extra]


def _wait_for(done, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while not done():
        assert proc.poll() is None, f"fw exited ({proc.returncode}) before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} within 300 s"
        time.sleep(0.05)


def test_a_signal_in_the_last_step_ends_its_finishing_line_with_the_runs_end(tmp_path):
    """SIGTERM in the last step: fw says it finishes the step and saves it; then the run is complete (exit 0, as
    the README says of a run that reached trainer.max_steps), and its last line says so, not nothing."""
    run_dir, marker, go, log = tmp_path / "run", tmp_path / "last", tmp_path / "go", tmp_path / "err.log"
    hold = json.dumps([{"class_path": "test_signal_in_last_step.HoldLastStep",
                        "init_args": {"marker": str(marker), "go": str(go)}}])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "framework", *_argv(run_dir, f"--callbacks={hold}")],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        _wait_for(marker.exists, "the last step", proc, log)
        proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: "fw: SIGTERM: finishing the current step" in log.read_text(), "the SIGTERM line", proc, log)
        go.write_text("go")
        proc.wait(timeout=120)
    finally:
        proc.kill()
    newest = run_dir / "checkpoints" / "step-000002"
    said = (f"fw: SIGTERM came as the run ended: it reached trainer.max_steps 2; its newest checkpoint is {newest}, "
            "nothing is lost")
    assert (proc.returncode, log.read_text().splitlines()[-1]) == (0, said), log.read_text()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002"]
