"""One checkpoint directory: its manifest, writing it atomically, reading it back, completeness, verification."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from framework.checkpoint.files import fsync_dir, hash_and_fsync, hidden_sibling, publish_dir, sha256
from framework.config import save_resolved
from framework.errors import FwError
from framework.models.hf_io import INDEX_FILE, write_checkpoint

FORMAT = "fw.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
HF_CONFIG_FILE = "config.json"

_COMPONENT_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def config_sha256(cfg: dict) -> str:
    """sha256 of the resolved config's canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of checkpoint `path`; FwError when it is missing or unreadable."""
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise FwError(f"{file}: missing; {path} is not a complete fw checkpoint") from None
    except (OSError, ValueError) as e:
        raise FwError(f"{file}: unreadable checkpoint manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FwError(f"{file}: not an fw checkpoint manifest (expected format {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise FwError(
            f"{file}: checkpoint format version {manifest.get('format_version')!r} is not supported "
            f"(this fw reads version {FORMAT_VERSION})"
        )
    return manifest


def _check_sizes(path: Path, manifest: dict) -> None:
    for rel, meta in manifest["files"].items():
        file = path / rel
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise FwError(f"{file}: missing from checkpoint {path} (listed in its manifest)") from None
        if size != meta["size"]:
            raise FwError(f"{file}: size {size} bytes, the manifest says {meta['size']}: the file is corrupt")


def read_complete_manifest(path: str | os.PathLike) -> dict:
    """The manifest of checkpoint `path` once every file it lists exists with the listed size; FwError if not."""
    manifest = read_manifest(path)
    _check_sizes(Path(path), manifest)
    return manifest


def is_complete(path: str | os.PathLike) -> bool:
    """Manifest parses and every file it lists exists with the listed size (no hashing)."""
    try:
        read_complete_manifest(path)
    except (FwError, KeyError, TypeError, AttributeError):
        return False
    return True


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check every file's size and sha256 against the manifest; return the manifest or raise FwError naming
    the bad file."""
    path = Path(path)
    manifest = read_complete_manifest(path)
    files = list(manifest["files"].items())
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        digests = list(pool.map(lambda item: sha256(path / item[0]), files))
    for (rel, meta), digest in zip(files, digests):
        if digest != meta["sha256"]:
            raise FwError(
                f"{path / rel}: sha256 {digest} does not match the manifest's {meta['sha256']}: the file is corrupt"
            )
    return manifest


def _is_model_file(fname: str) -> bool:
    """config.json and the weights (single file, shards, index): written by hf_io, not passed as "files"."""
    return fname in (HF_CONFIG_FILE, INDEX_FILE) or fname.endswith(".safetensors")


def _write_component(folder: Path, name: str, component: dict, max_shard_size: int | str) -> None:
    """A component's files: config.json + safetensors shards ("config" given) or one safetensors file named
    "weights_file" ("config" None), then its other "files"."""
    if not _COMPONENT_NAME.match(name):
        raise ValueError(f"fw_components: component name {name!r} must match {_COMPONENT_NAME.pattern}")
    files = component.get("files") or {}
    for fname in files:
        if _is_model_file(fname) or Path(fname).name != fname or fname.startswith("."):
            raise ValueError(f"fw_components[{name!r}]['files']: {fname!r} is not an allowed file name")
    if component.get("config") is None:
        # Tensors without a model config (e.g. PEFT adapters): one safetensors file under the given name.
        weights = component["weights_file"]
        if Path(weights).name != weights or not weights.endswith(".safetensors"):
            raise ValueError(f"fw_components[{name!r}]['weights_file']: {weights!r} is not a safetensors file name")
        folder.mkdir(parents=True, exist_ok=True)
        save_file({n: t.detach().to("cpu").contiguous() for n, t in component["state_dict"].items()},
                  str(folder / weights), metadata={"format": "pt"})
    else:
        write_checkpoint(component["config"], component["state_dict"], folder, max_shard_size)
    for fname, data in files.items():
        (folder / fname).write_bytes(bytes(data))


def write_checkpoint_dir(
    checkpoint: dict, final: str | os.PathLike, cfg: dict, use_exchange: bool = True,
    max_shard_size: int | str = "5GB",
) -> dict:
    """Write `checkpoint` (a Lightning checkpoint dict, with weights under "fw_components") as the directory
    `final`, atomically. Pops "fw_components". Returns the manifest. Components are sharded like HF's
    save_pretrained (5 GB shards by default)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    components = checkpoint.pop("fw_components", None) or {}
    staging = hidden_sibling(final, "staging")
    staging.mkdir()
    try:
        for name, component in components.items():
            _write_component(staging / name, name, component, max_shard_size)
        with open(staging / TRAINER_STATE, "wb") as f:
            torch.save(checkpoint, f)
        save_resolved(cfg, staging / CONFIG_FILE)

        rels = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
        with ThreadPoolExecutor(max_workers=min(8, len(rels))) as pool:
            sums = list(pool.map(lambda rel: hash_and_fsync(staging / rel), rels))
        policy_version = checkpoint.get("policy_version")
        step = policy_version if policy_version is not None else checkpoint.get("global_step")
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "policy_version": policy_version,
            "global_step": checkpoint.get("global_step"),
            "config_sha256": config_sha256(cfg),
            "components": sorted(components),
            "files": {rel: {"size": size, "sha256": digest} for rel, (size, digest) in zip(rels, sums)},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        hash_and_fsync(staging / MANIFEST)
        for name in components:
            fsync_dir(staging / name)
        fsync_dir(staging)
        publish_dir(staging, final, use_exchange=use_exchange)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _safetensors_device(map_location: Any) -> str:
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    return "cpu"


def read_checkpoint_dir(
    path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None, verify: bool = False
) -> dict:
    """Rebuild the checkpoint dict from directory `path`; weights come back under "fw_components" as
    {name: {"config": dict (None without config.json), "state_dict": {hf name: tensor}, "files": {name: bytes}}}."""
    path = Path(path)
    manifest = verify_checkpoint(path) if verify else read_complete_manifest(path)
    # like Lightning's TorchCheckpointIO, default to CPU: never onto the GPU the state was saved from
    # (another rank's device under DDP); Lightning moves optimizer state to the right device itself
    with open(path / TRAINER_STATE, "rb") as f:
        checkpoint = torch.load(f, map_location=map_location if map_location is not None else "cpu",
                                weights_only=weights_only)
    device = _safetensors_device(map_location)
    components = {}
    for name in manifest["components"]:
        folder = path / name
        names = sorted(rel.split("/", 1)[1] for rel in manifest["files"] if rel.startswith(name + "/"))
        state_dict = {}
        for fname in names:
            if fname.endswith(".safetensors"):
                state_dict.update(load_file(folder / fname, device=device))
        components[name] = {
            "config": json.loads((folder / HF_CONFIG_FILE).read_text()) if HF_CONFIG_FILE in names else None,
            "state_dict": state_dict,
            "files": {f: (folder / f).read_bytes() for f in names if not _is_model_file(f)},
        }
    checkpoint["fw_components"] = components
    return checkpoint
