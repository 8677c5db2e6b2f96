"""`fw export`: a checkpoint's policy as a Hugging Face model directory.

The checkpoint's `policy/` already is HF layout (config.json, safetensors, tokenizer files), so export
copies that directory, hashing each file as it copies it and checking it against the manifest, and
publishes the copy atomically.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from framework.checkpoint import resolve_checkpoint
from framework.checkpoint.directory import read_complete_manifest
from framework.checkpoint.files import fsync_dir, hidden_sibling, publish_dir
from framework.checkpoint.tensors import DiskFull, is_disk_full
from framework.errors import FwError

POLICY = "policy"
_CHUNK = 16 << 20


def _copy_checked(src: Path, dst: Path, meta: dict) -> None:
    """Copy `src` to `dst` (fsynced), hashing what is read; FwError naming `src` when it is not what the
    manifest lists."""
    digest, size = hashlib.sha256(), 0
    with open(src, "rb") as f, open(dst, "wb") as g:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            g.write(chunk)
        g.flush()
        os.fsync(g.fileno())
    if size != meta["size"]:
        raise FwError(f"{src}: size {size} bytes, the manifest says {meta['size']}: the file is corrupt")
    if digest.hexdigest() != meta["sha256"]:
        raise FwError(f"{src}: sha256 {digest.hexdigest()} does not match the manifest's {meta['sha256']}: "
                      "the file is corrupt")


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, skip_damaged: bool = False) -> str:
    """Write the policy of `checkpoint` (a checkpoint dir, or a run dir = its newest checkpoint; with
    `skip_damaged` its newest intact one) to `out` in HF layout, loadable by transformers'
    `AutoModelForCausalLM.from_pretrained`, every file checked against the manifest's sha256. `out` must not
    exist or be empty. Returns `out`."""
    source = resolve_checkpoint(checkpoint, skip_damaged=skip_damaged, verify=skip_damaged)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FwError(f"--out {out}: already exists and is not an empty directory; choose a new one")
    manifest = read_complete_manifest(source)
    if POLICY not in manifest["components"]:
        raise FwError(f"{source}: the checkpoint holds no {POLICY}/ component")
    files = [rel.split("/", 1)[1] for rel in manifest["files"] if rel.startswith(POLICY + "/")]

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = hidden_sibling(out, "staging")
    staging.mkdir()
    try:
        for name in files:
            _copy_checked(source / POLICY / name, staging / name, manifest["files"][f"{POLICY}/{name}"])
        fsync_dir(staging)
        publish_dir(staging, out)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, Exception) and is_disk_full(e):
            raise DiskFull(f"--out {out}: no space left on device while exporting {source}; nothing was "
                           "written") from None
        raise
    return str(out)
