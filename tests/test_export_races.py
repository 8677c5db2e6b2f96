"""`fw export`, `fw generate` and `fw eval` given the run directory of a live fit: a checkpoint pruned by the run
while it is read is resolved again (the run's newer one) and read once more; a second loss is one line. A
`fit --resume` from it lists the run again when its newest goes while verified, and says in one line that it went
while loaded.
`fw export --out DIR` into an existing empty mount point (also under a read-only parent) exports there; a
read-only parent without DIR is one line naming --out; a killed export's staging inside DIR is cleaned up.

The pruning is the real `prune` of a writer that has just published its next checkpoint, run from an audit hook
at the reader's first (or second) open of a file of the checkpoint's policy/: the interleaving a timing race
hits a few times in a hundred, every time. Each reader runs in a subprocess, which keeps the hook out of the
test process; the mount cases run in a private mount namespace (`unshare`), skipped where one cannot be made."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from framework.config import resolve
from framework.errors import FwError
from framework.export import export_checkpoint
from framework.trainer import fit

REPO = Path(__file__).resolve().parent.parent

# argv: run_dir, side (the writer's next checkpoints, oldest first), how many prunes, which open of a policy file
# prunes, then what to read: "export OUT", "generate" or "eval"; prints {"ok": result} or {"error": type, message}
READER = r"""
import json, os, sys, threading
from pathlib import Path
from framework.checkpoint.store import prune, step_dirs

run, side, prunes, nth, what = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
pending = sorted(side.iterdir())
lock, local = threading.Lock(), threading.local()   # the reader's threads (hashing, loading) open files too
state = {"opens": 0, "prunes": prunes}

def hook(event, args):
    if event != "open" or getattr(local, "busy", False) or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    local.busy = True   # the opens of the hook's own work pass through
    try:
        with lock:
            if state["prunes"] == 0 or not os.fsdecode(args[0]).startswith(f"{step_dirs(run)[-1]}/policy/"):
                return
            state["opens"] += 1
            if state["opens"] == nth:   # the writer publishes its next checkpoint, then prunes with keep_last 1
                state["opens"] = 0
                state["prunes"] -= 1
                nxt = pending.pop(0)
                os.rename(nxt, run / "checkpoints" / nxt.name)
                prune(run, 1)
    finally:
        local.busy = False

sys.addaudithook(hook)
try:
    if what == "export":
        from framework.export import export_checkpoint
        out = export_checkpoint(run, sys.argv[6])
    elif what == "generate":
        from framework.generate import generate_text
        out = generate_text(None, "123", checkpoint=str(run))
    elif what == "resume":   # a new run resuming from the live run's newest: argv[6] its config as JSON
        from framework.config import resolve
        from framework.trainer import fit
        fit(resolve(json.loads(sys.argv[6])), resume=str(run))
        out = "resumed"
    else:
        from framework.evaluation import evaluate_checkpoint
        report, _ = evaluate_checkpoint(run)
        out = [report["checkpoint"], report["step"]]
    print(json.dumps({"ok": out}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A GRPO run with checkpoints at steps 1, 2 and 3, as a fit that saves every step writes them."""
    run = tmp_path_factory.mktemp("live") / "run"
    fit(resolve(live_config(run, max_steps=3)))
    return run


def live_config(run: Path, max_steps: int) -> dict:
    return {
        "recipe": "grpo", "seed": 5, "run_dir": str(run), "model": {"policy": {"preset": "tiny"}},
        "data": {"task": {"name": "digits", "init_args": {"num_digits": 3, "rule": "next"}}, "chat_template": False},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 2}, "reward": {"name": "numeric_match"},
        # weight decay moves the weights at every step, whatever the rewards: each checkpoint differs
        "grpo": {"group_size": 4}, "optimizer": {"lr": 3e-3, "weight_decay": 0.1},
        "eval": {"max_prompts": 4, "samples_per_prompt": 2},
        "trainer": {"accelerator": "cpu", "max_steps": max_steps, "enable_progress_bar": False},
        "checkpoint": {"every_n_steps": 1, "keep_last": None}, "logging": {"csv": False, "tensorboard": False}}


def _staged(live_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run holding step 1 only, its steps 2 and 3 set aside for the writer to publish."""
    run, side = tmp_path / "run", tmp_path / "side"
    shutil.copytree(live_run, run)
    side.mkdir()
    for step in ("step-000002", "step-000003"):
        os.rename(run / "checkpoints" / step, side / step)
    return run, side


def _read(run: Path, side: Path, prunes: int, nth: int, *what: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run([sys.executable, "-c", READER, str(run), str(side), str(prunes), str(nth), *what],
                          check=False, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _policy_files(checkpoint: Path) -> dict[str, str]:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    return {rel.split("/", 1)[1]: meta["sha256"] for rel, meta in manifest["files"].items()
            if rel.startswith("policy/")}


def _sha256s(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def test_export_of_a_checkpoint_pruned_mid_copy_exports_the_runs_newer_one(live_run, tmp_path):
    """Step 1 pruned after export copied its first policy file: the export is of step 2, every file as step 2's
    manifest lists it, and no staging directory is left."""
    run, side = _staged(live_run, tmp_path)
    step2 = _policy_files(side / "step-000002")
    out = tmp_path / "model"
    assert _read(run, side, 1, 2, "export", str(out)) == {"ok": str(out)}
    exported = _sha256s(out)
    assert {name: exported[name] for name in step2} == step2
    assert step2 != _policy_files(live_run / "checkpoints" / "step-000001")   # another checkpoint indeed
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_export_losing_the_checkpoint_twice_is_one_line(live_run, tmp_path):
    """Steps 1 and then 2 pruned while each is read: one line naming the run directory and the pruned step;
    nothing exported, nothing left behind."""
    run, side = _staged(live_run, tmp_path)
    out = tmp_path / "model"
    assert _read(run, side, 2, 1, "export", str(out)) == {
        "error": "FwError",
        "message": f"--checkpoint {run}: step-000002 was pruned by the run writing it while it was read; run again"}
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("what", ["generate", "eval"])
def test_generate_and_eval_read_the_runs_newer_checkpoint_when_theirs_is_pruned(live_run, tmp_path, what):
    """`fw generate` / `fw eval` of the run directory, step 1 pruned once they open its policy/: they use step 2,
    and give what they give when named step 2 itself."""
    run, side = _staged(live_run, tmp_path)
    got = _read(run, side, 1, 1, what)
    assert "ok" in got, got
    step2 = run / "checkpoints" / "step-000002"
    if what == "eval":
        assert got["ok"] == [str(step2), 2]
        return
    from framework.generate import generate_text

    assert got["ok"] == generate_text(None, "123", checkpoint=str(step2))


# ---------------------------------------------------------------- --out on a mount point

MOUNTED = r"""
set -e
mkdir -p "$VOL"
mount -t tmpfs -o size=64m tmpfs "$VOL"
mkdir "$VOL/parent"
case "$CASE" in
  mount) mkdir "$VOL/parent/model"; mount -t tmpfs -o size=64m tmpfs "$VOL/parent/model" ;;
  ro_parent) mkdir "$VOL/parent/model"
             mount --bind "$VOL/parent" "$VOL/parent"; mount -o remount,bind,ro "$VOL/parent"
             mount -t tmpfs -o size=64m tmpfs "$VOL/parent/model" ;;
  ro_absent) mount --bind "$VOL/parent" "$VOL/parent"; mount -o remount,bind,ro "$VOL/parent" ;;
esac
exec "$PYTHON" -c '
import hashlib, json, os, sys
from pathlib import Path
from framework.errors import FwError
from framework.export import export_checkpoint
out = Path(os.environ["VOL"]) / "parent" / "model"
try:
    export_checkpoint(sys.argv[1], out)
except FwError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit()
print(json.dumps({"mount": os.path.ismount(out), "files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                  for p in out.iterdir()}, "hidden": sorted(p.name for p in out.iterdir() if p.name[0] == ".")}))
' "$CKPT"
"""


def _unshare() -> list[str]:
    """The command that runs a shell in a private mount namespace, or a skip where none can be made."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare: a private mount namespace for the tmpfs cannot be made")
    for cmd in (["unshare", "--mount"], ["unshare", "--mount", "--map-root-user"]):
        probe = subprocess.run([*cmd, "sh", "-c", "mount -t tmpfs tmpfs /mnt"], check=False, capture_output=True)
        if probe.returncode == 0:
            return cmd
    pytest.skip(f"mounting a tmpfs in a private mount namespace is not allowed here: {probe.stderr.decode().strip()}")


def _export_mounted(case: str, live_run: Path, tmp_path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1", VOL=str(tmp_path / "vol"),
               CASE=case, PYTHON=sys.executable, CKPT=str(live_run / "checkpoints" / "step-000003"))
    done = subprocess.run([*_unshare(), "sh", "-c", MOUNTED], check=False, capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["mount", "ro_parent"])
def test_export_into_an_empty_mount_point(live_run, tmp_path, case):
    """--out an empty tmpfs mount point (under a writable parent, and under a read-only one): the model is
    exported into it, every policy file as the manifest lists it, and no staging directory is left."""
    got = _export_mounted(case, live_run, tmp_path)
    assert got.get("mount") is True, got
    want = _policy_files(live_run / "checkpoints" / "step-000003")
    assert {name: got["files"][name] for name in want} == want
    assert set(got["files"]) == set(want) | {"generation_config.json"} and got["hidden"] == []


def test_export_under_a_read_only_parent_is_one_line_naming_out(live_run, tmp_path):
    got = _export_mounted("ro_absent", live_run, tmp_path)
    out = tmp_path / "vol" / "parent" / "model"
    assert got["error"].startswith(f"--out {out}: Read-only file system ")
    assert got["error"].endswith("; nothing was exported there: choose a directory this user can write")


def test_a_killed_exports_staging_inside_out_is_removed_and_its_partial_copy_refused(live_run, tmp_path):
    """What an export killed while it moved files into an existing directory leaves: its hidden staging
    directory (a dead process's) is removed, and the files it moved in are refused with what to do."""
    out = tmp_path / "model"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    staging = out / f".staging-model-{dead.pid}-0123abcd"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"partial")
    with pytest.raises(FwError) as e:
        export_checkpoint(live_run, out)
    assert str(e.value) == (f"--out {out}: already exists and is not an empty directory, holding the files a killed "
                            "export moved in: empty it")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    (out / "model.safetensors").unlink()
    assert export_checkpoint(live_run, out) == str(out)
    want = _policy_files(live_run / "checkpoints" / "step-000003")
    assert {name: _sha256s(out)[name] for name in want} == want


def test_a_resume_from_a_live_run_whose_newest_is_pruned_while_verified_takes_the_newer_one(live_run, tmp_path):
    """Another run resumes from the live run's directory; the live run publishes step 2 and prunes step 1 while
    the resume verifies step 1's files: the resume lists the run again and goes on from step 2."""
    run, side = _staged(live_run, tmp_path)
    new = tmp_path / "new"
    assert _read(run, side, 1, 1, "resume", json.dumps(live_config(new, max_steps=4))) == {"ok": "resumed"}
    assert sorted(p.name for p in (new / "checkpoints").iterdir()) == ["step-000003", "step-000004"]   # none before 3


@pytest.mark.slow   # a subprocess fit; its neighbour above covers the relisting in the CPU suite
def test_a_resume_from_a_live_runs_checkpoint_pruned_while_loaded_is_one_line(live_run, tmp_path):
    """The same without verification: the pruning comes while the resume loads step 1's policy. One line naming
    the checkpoint and what happened, no step taken in the new run."""
    run, side = _staged(live_run, tmp_path)
    new = tmp_path / "new"
    cfg = live_config(new, max_steps=4)
    cfg["checkpoint"]["verify"] = False
    got = _read(run, side, 1, 1, "resume", json.dumps(cfg))
    assert got == {"error": "FwError", "message": (
        f"--resume: the checkpoint {run / 'checkpoints' / 'step-000001'} was deleted while this run read it, pruned "
        "by the run writing it; no step was taken: run again, naming a checkpoint that run keeps or its run "
        "directory (its newest)")}
    assert not (new / "checkpoints").exists() or not any((new / "checkpoints").iterdir())
