"""Checkpoints and resume under attack: content changed behind an unchanged path, manifests that parse but hold
the wrong types, a stale lock of a killed run."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from framework.cli import main
from framework.config import resolve
from framework.errors import FwError
from framework.run_lock import RunLock
from framework.trainer import fit


def config(run_dir, data, max_steps=2):
    return resolve({
        "recipe": "sft", "seed": 0, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
        "data": {"path": str(data), "max_seq_len": 64, "batch_size": 2},
        "optimizer": {"lr": 3e-3}, "scheduler": {"name": "constant"},
        "trainer": {"accelerator": "cpu", "max_steps": max_steps, "enable_progress_bar": False},
        "checkpoint": {"every_n_steps": 2},
        "logging": {"csv": False, "tensorboard": False}})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run directory trained to its step-2 checkpoint, its data file beside it."""
    root = tmp_path_factory.mktemp("review")
    data = root / "chats.jsonl"
    data.write_text("\n".join(Path("recipes/data/arithmetic_chat.jsonl").read_text().splitlines()[:10]) + "\n")
    fit(config(root / "run", data))
    return root


def _copy(trained: Path, to: Path) -> tuple[Path, Path]:
    """The trained run and its data copied to `to`, the run's config.yaml pointing at the copied data."""
    shutil.copytree(trained, to)
    step = to / "run" / "checkpoints" / "step-000002"
    text = (step / "config.yaml").read_text().replace(str(trained), str(to))
    (step / "config.yaml").chmod(0o644)
    (step / "config.yaml").write_text(text)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["config.yaml"] = {"size": len(text.encode()), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))
    return to / "run", to / "chats.jsonl"


def test_a_data_file_changed_in_place_is_refused_at_resume(trained, tmp_path):
    """The saved data position indexes the data the checkpoint was trained on: the same `data.path` holding other
    examples (reordered here) cannot continue the run, as a moved path with other content cannot."""
    run, data = _copy(trained, tmp_path / "copy")
    data.write_text("".join(reversed(data.read_text().splitlines(keepends=True))))
    with pytest.raises(FwError, match=rf"data\.path .*{data} differs in content from what the checkpoint recorded"):
        fit(config(run, data, max_steps=4), resume="last")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    # the same content written again resumes
    shutil.copy(trained / "chats.jsonl", data)
    assert fit(config(run, data, max_steps=4), resume="last").global_step == 4


def test_a_data_file_changed_in_place_is_refused_with_its_own_remedy(trained, tmp_path):
    """The refusal of a data file rewritten under its unchanged path says to put its content back, not to keep a
    value of the checkpoint's config.yaml, which the config keeps already; a changed value beside it keeps that
    remedy too."""
    run, data = _copy(trained, tmp_path / "copy")
    data.write_text("".join(reversed(data.read_text().splitlines(keepends=True))))
    with pytest.raises(FwError) as e:
        fit(config(run, data, max_steps=4), resume="last")
    assert str(e.value).endswith(f"; put back what data.path {data} held when the checkpoint was written or start "
                                 "a new run_dir")
    seeded = config(run, data, max_steps=4)
    seeded["seed"] = 1
    with pytest.raises(FwError) as e:
        fit(seeded, resume="last")
    step = run / "checkpoints" / "step-000002"
    assert str(e.value).endswith(f"; keep the value of {step / 'config.yaml'}, put back what data.path {data} held "
                                 "when the checkpoint was written or start a new run_dir")


def test_an_unreadable_data_path_at_an_unchanged_spelling_is_left_to_the_data_loader(trained, tmp_path):
    """A path key whose file is gone is not refused as changed content: the run's own reading of it names it."""
    run, data = _copy(trained, tmp_path / "copy")
    data.unlink()
    with pytest.raises(FwError) as e:
        fit(config(run, data, max_steps=4), resume="last")
    assert "differs in content" not in str(e.value) and str(data) in str(e.value)


@pytest.mark.parametrize("edit, what", [
    (lambda m: m.pop("components"), "components"),
    (lambda m: m.update(step="2"), "step"),
    (lambda m: m.update(components="policy"), "components"),
    (lambda m: m["files"]["config.yaml"].pop("sha256"), "config.yaml"),
    (lambda m: m.update(sources=["x"]), "sources"),
])
def test_a_manifest_with_a_field_of_the_wrong_type_is_one_line(trained, tmp_path, capsys, edit, what):
    """A manifest that parses but whose fields are not what fw writes (a flipped bit in a key, a hand edit) is a
    damaged checkpoint: one line naming the manifest and the field, exit 2, no traceback."""
    run, data = _copy(trained, tmp_path / "copy")
    file = run / "checkpoints" / "step-000002" / "manifest.json"
    manifest = json.loads(file.read_text())
    edit(manifest)
    file.write_text(json.dumps(manifest))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(config(run, data, max_steps=4)))
    capsys.readouterr()
    assert main(["fit", "--config", str(cfg), "--resume", "last"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("fw: error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert f"{file}: malformed manifest" in lines[0] and what in lines[0]


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path):
    """The kernel drops a SIGKILLed holder's flock: the next run takes the lock and records its own pid, though the
    file still names the dead one."""
    run_dir = tmp_path / "run"
    script = ("import time; from framework.run_lock import RunLock\n"
              f"with RunLock({str(run_dir)!r}):\n print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(FwError, match=rf"in use by another fw fit \(pid {holder.pid}\)"), RunLock(run_dir):
        pass
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (run_dir / ".lock").read_text().splitlines()[0] == str(holder.pid)
    with RunLock(run_dir):
        assert (run_dir / ".lock").read_text().splitlines()[0] == str(os.getpid())
