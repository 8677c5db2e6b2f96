"""A run's checkpoints under `<run_dir>/checkpoints`: discovery, recovery, leftovers, pruning, resume."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from framework.checkpoint.directory import is_complete, read_complete_manifest
from framework.checkpoint.files import dead_leftovers, fsync_dir, remove_tree
from framework.errors import FwError

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def recover(ckpt_dir: str | os.PathLike) -> None:
    """Put back a checkpoint that an interrupted fallback replace had set aside (its new copy never appeared)."""
    ckpt_dir = Path(ckpt_dir)
    for entry, kind, name in dead_leftovers(ckpt_dir):
        final = ckpt_dir / name
        if kind == "replaced" and not final.exists() and is_complete(entry):
            try:
                os.rename(entry, final)
            except OSError:  # gone or target exists: another rank (same shared run_dir) recovered it first
                if not final.is_dir():
                    raise
            fsync_dir(ckpt_dir)


def clean_leftovers(ckpt_dir: str | os.PathLike) -> list[str]:
    """Recover, then delete hidden leftovers of dead processes (staging, replaced, trash); return their names."""
    ckpt_dir = Path(ckpt_dir)
    recover(ckpt_dir)
    removed = []
    for entry, _, _ in dead_leftovers(ckpt_dir):
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed.append(entry.name)
    return removed


def list_checkpoints(run_dir: str | os.PathLike) -> list[str]:
    """Complete checkpoints under `<run_dir>/checkpoints`, oldest step first (hidden leftovers ignored)."""
    ckpt_dir = checkpoints_dir(run_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for entry in ckpt_dir.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir() and is_complete(entry):
            found.append((int(m.group(1)), str(entry)))
    return [p for _, p in sorted(found)]


def find_latest(run_dir: str | os.PathLike) -> str | None:
    """The newest complete checkpoint of the run, or None. First puts back a checkpoint left aside by an
    interrupted fallback replace, so a crash there never loses the newest checkpoint."""
    recover(checkpoints_dir(run_dir))
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def refuse_existing_checkpoints(run_dir: str | os.PathLike) -> None:
    """FwError if `run_dir` already holds checkpoints: a fresh run there would prune them and mix its
    own in with them."""
    existing = list_checkpoints(run_dir)
    if existing:
        raise FwError(f"{checkpoints_dir(run_dir)} already holds checkpoints ({Path(existing[-1]).name} is the "
                      "newest): resume with --resume last, or choose another run_dir")


def resolve_resume(resume: str | None, run_dir: str | os.PathLike) -> str | None:
    """`--resume` value → checkpoint dir: None stays None (after refusing a run_dir that holds checkpoints),
    "last" → newest complete one (FwError if none), a path → that checkpoint, which must be complete."""
    if resume is None:
        refuse_existing_checkpoints(run_dir)
        return None
    if resume == "last":
        latest = find_latest(run_dir)
        if latest is None:
            raise FwError(f"--resume last: no complete checkpoint under {checkpoints_dir(run_dir)}")
        return latest
    read_complete_manifest(resume)
    return str(resume)


def prune(run_dir: str | os.PathLike, keep_last: int | None) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints (None keeps all); return the deleted paths."""
    if keep_last is None:
        return []
    if keep_last < 1:
        raise FwError(f"checkpoint.keep_last: {keep_last} is not allowed, expected an integer >= 1 or null")
    old = list_checkpoints(run_dir)[:-keep_last]
    for path in old:
        remove_tree(Path(path))
    return old
