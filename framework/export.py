"""`fw export`: a checkpoint's policy as a Hugging Face model directory.

The checkpoint's `policy/` already is HF layout (config.json, safetensors, tokenizer files), so export
verifies the checkpoint against its manifest and copies that directory, publishing it atomically.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from framework.checkpoint import MANIFEST, checkpoints_dir, find_latest, verify_checkpoint
from framework.checkpoint.files import fsync_dir, hash_and_fsync, hidden_sibling, publish_dir
from framework.errors import FwError

POLICY = "policy"


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory as given, or a run directory's newest complete checkpoint."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if checkpoints_dir(path).is_dir():
        latest = find_latest(path)
        if latest is None:
            raise FwError(f"{path}: a run directory without a complete checkpoint under {checkpoints_dir(path)}")
        return Path(latest)
    if not path.exists():
        raise FwError(f"--checkpoint {path}: no such directory")
    raise FwError(f"--checkpoint {path}: not a checkpoint (no {MANIFEST}) nor a run directory (no checkpoints/)")


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike) -> str:
    """Verify `checkpoint` (a checkpoint dir, or a run dir = its newest checkpoint) and write its policy to
    `out` in HF layout, loadable by transformers' `AutoModelForCausalLM.from_pretrained`. `out` must not
    exist or be empty. Returns `out`."""
    source = resolve_checkpoint(checkpoint)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FwError(f"--out {out}: already exists and is not an empty directory; choose a new one")
    manifest = verify_checkpoint(source)
    if POLICY not in manifest["components"]:
        raise FwError(f"{source}: the checkpoint holds no {POLICY}/ component")
    files = [rel.split("/", 1)[1] for rel in manifest["files"] if rel.startswith(POLICY + "/")]

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = hidden_sibling(out, "staging")
    staging.mkdir()
    try:
        for name in files:
            shutil.copyfile(source / POLICY / name, staging / name)
            size, digest = hash_and_fsync(staging / name)
            meta = manifest["files"][f"{POLICY}/{name}"]
            if (size, digest) != (meta["size"], meta["sha256"]):
                raise FwError(f"{source / POLICY / name}: changed while it was being exported")
        fsync_dir(staging)
        publish_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return str(out)
