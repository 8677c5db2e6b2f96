"""Atomic checkpoint directories: write, publish, discover, verify, prune, and the checkpoint callback.

A checkpoint is a directory `<run_dir>/checkpoints/step-000123/`:

    manifest.json        format version, step, policy version, config hash, every file's size and sha256
    policy/              HF layout: config.json + model.safetensors or shards + index (+ files like tokenizer.json)
    value/               the PPO critic, same layout (only when present)
    trainer_state.pt     the rest of Lightning's checkpoint dict (optimizers, schedulers, loops, callbacks, ...)
    config.yaml          the resolved config

It is built in a hidden staging sibling, every file and directory fsynced, then published by one rename
(or, when the step already exists, one `renameat2(RENAME_EXCHANGE)` swap), and the parent fsynced. A
crash at any moment leaves either the old state or the new one plus hidden leftovers that discovery
ignores and `clean_leftovers` removes (without RENAME_EXCHANGE a replace is two renames, and `recover`,
called by `find_latest`, undoes a crash between them). A directory counts as complete when its manifest parses and every
file it lists exists with the listed size.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.io import CheckpointIO
from safetensors.torch import load_file

from framework.config import save_resolved
from framework.errors import FwError
from framework.models.hf_io import INDEX_FILE, write_checkpoint

FORMAT = "fw.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
HF_CONFIG_FILE = "config.json"

_STEP_DIR = re.compile(r"^step-(\d+)$")
# hidden siblings: .staging-<name>-<pid>-<hex> (being built, or an old dir swapped out),
# .replaced-<name>-<pid>-<hex> (set aside by the fallback replace), .trash-<name>-<pid>-<hex> (being deleted)
_HIDDEN = re.compile(r"^\.(staging|replaced|trash)-(.+)-(\d+)-([0-9a-f]+)$")
_COMPONENT_NAME = re.compile(r"^[A-Za-z0-9_]+$")
_HASH_CHUNK = 8 << 20


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def config_sha256(cfg: dict) -> str:
    """sha256 of the resolved config's canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- durable file system primitives


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_and_fsync(path: Path) -> tuple[int, str]:
    """Read the file back (what is on disk is what gets hashed), fsync it, return (size, sha256)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return size, digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def hidden_sibling(final: Path, kind: str) -> Path:
    return final.parent / f".{kind}-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)


def exchange_supported() -> bool:
    """Whether this libc offers renameat2 (the kernel and file system may still refuse it)."""
    return _renameat2 is not None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; False when the platform or file system cannot."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


def publish_dir(staging: Path, final: Path, use_exchange: bool = True) -> None:
    """Make the complete, fsynced directory `staging` appear as `final` in one step.

    A new `final` is one rename. An existing `final` is swapped with `staging` by RENAME_EXCHANGE and
    the old contents (now under the staging name) deleted. Without RENAME_EXCHANGE the old dir is
    renamed aside to `.replaced-*` first; a crash between the two renames is undone by `recover`.
    """
    staging, final = Path(staging), Path(final)
    parent = final.parent
    if not final.exists():
        os.rename(staging, final)
        fsync_dir(parent)
        return
    if use_exchange and _exchange(staging, final):
        fsync_dir(parent)
        _remove_tree(staging)
        return
    aside = hidden_sibling(final, "replaced")
    os.rename(final, aside)
    fsync_dir(parent)
    os.rename(staging, final)
    fsync_dir(parent)
    _remove_tree(aside)


def _remove_tree(path: Path) -> None:
    """Delete a directory so that a crash midway leaves only a hidden `.trash-*` leftover."""
    path = Path(path)
    if not path.exists():
        return
    if not _HIDDEN.match(path.name):
        trash = hidden_sibling(path, "trash")
        os.rename(path, trash)
        fsync_dir(path.parent)
        path = trash
    shutil.rmtree(path)


def _other_process_alive(pid: int) -> bool:
    """Whether `pid` is a live process other than this one. Our own pid counts as dead: callers run when this
    process is not saving, and a restarted container often gets the crashed process's pid back."""
    from ops_cuda.extension import pid_alive

    return pid != os.getpid() and pid_alive(pid)


def recover(ckpt_dir: str | os.PathLike) -> None:
    """Put back a checkpoint that an interrupted fallback replace had set aside (its new copy never appeared)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return
    for entry in sorted(ckpt_dir.iterdir()):
        m = _HIDDEN.match(entry.name)
        if not m or m.group(1) != "replaced" or _other_process_alive(int(m.group(3))):
            continue
        final = ckpt_dir / m.group(2)
        if not final.exists() and is_complete(entry):
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
    if not ckpt_dir.is_dir():
        return removed
    for entry in sorted(ckpt_dir.iterdir()):
        m = _HIDDEN.match(entry.name)
        if m and not _other_process_alive(int(m.group(3))):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            removed.append(entry.name)
    return removed


# ---------------------------------------------------------------- discovery and verification


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


def is_complete(path: str | os.PathLike) -> bool:
    """Manifest parses and every file it lists exists with the listed size (no hashing)."""
    path = Path(path)
    try:
        _check_sizes(path, read_manifest(path))
    except (FwError, KeyError, TypeError, AttributeError):
        return False
    return True


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check every file's size and sha256 against the manifest; return the manifest or raise FwError naming
    the bad file."""
    path = Path(path)
    manifest = read_manifest(path)
    _check_sizes(path, manifest)
    files = list(manifest["files"].items())
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        digests = list(pool.map(lambda item: _sha256(path / item[0]), files))
    for (rel, meta), digest in zip(files, digests):
        if digest != meta["sha256"]:
            raise FwError(
                f"{path / rel}: sha256 {digest} does not match the manifest's {meta['sha256']}: the file is corrupt"
            )
    return manifest


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
    _check_sizes(Path(resume), read_manifest(resume))
    return str(resume)


def prune(run_dir: str | os.PathLike, keep_last: int | None) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints (None keeps all); return the deleted paths."""
    if keep_last is None:
        return []
    if keep_last < 1:
        raise FwError(f"checkpoint.keep_last: {keep_last} is not allowed, expected an integer >= 1 or null")
    old = list_checkpoints(run_dir)[:-keep_last]
    for path in old:
        _remove_tree(Path(path))
    return old


# ---------------------------------------------------------------- writing and reading


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _write_json(path: Path, obj: Any) -> None:
    _write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def _is_model_file(fname: str) -> bool:
    """config.json and the weights (single file, shards, index): written by hf_io, not passed as "files"."""
    return fname in (HF_CONFIG_FILE, INDEX_FILE) or fname.endswith(".safetensors")


def _write_component(folder: Path, name: str, component: dict, max_shard_size: int | str) -> None:
    if not _COMPONENT_NAME.match(name):
        raise ValueError(f"fw_components: component name {name!r} must match {_COMPONENT_NAME.pattern}")
    files = component.get("files") or {}
    for fname in files:
        if _is_model_file(fname) or Path(fname).name != fname or fname.startswith("."):
            raise ValueError(f"fw_components[{name!r}]['files']: {fname!r} is not an allowed file name")
    write_checkpoint(component["config"], component["state_dict"], folder, max_shard_size)
    for fname, data in files.items():
        _write_bytes(folder / fname, bytes(data))


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
        _write_json(staging / MANIFEST, manifest)
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
    {name: {"config": dict, "state_dict": {hf name: tensor}, "files": {name: bytes}}}."""
    path = Path(path)
    manifest = verify_checkpoint(path) if verify else read_manifest(path)
    if not verify:
        _check_sizes(path, manifest)
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
            "config": json.loads((folder / HF_CONFIG_FILE).read_text()),
            "state_dict": state_dict,
            "files": {f: (folder / f).read_bytes() for f in names if not _is_model_file(f)},
        }
    checkpoint["fw_components"] = components
    return checkpoint


class AtomicCheckpointIO(CheckpointIO):
    """Lightning CheckpointIO writing fw checkpoint directories (see the module docstring)."""

    def __init__(self, cfg: dict):
        self.cfg = cfg

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO.save_checkpoint takes no storage_options, got {storage_options!r}")
        write_checkpoint_dir(checkpoint, path, self.cfg)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict:
        return read_checkpoint_dir(
            path, map_location=map_location, weights_only=weights_only, verify=self.cfg["checkpoint"]["verify"]
        )

    def remove_checkpoint(self, path: Any) -> None:
        _remove_tree(Path(path))


class CheckpointCallback(pl.Callback):
    """Saves `<run_dir>/checkpoints/step-%06d` every `checkpoint.every_n_steps` policy optimizer steps and at
    the end of fit, flushing every logger first, then prunes to `checkpoint.keep_last`.

    The step is the module's `policy_version` when it has one (it moves between the optimizer-step hooks
    in both optimization modes, whereas Lightning updates global_step at different points in each),
    else `trainer.global_step`. A save happens only in a batch where the step advanced, so never in the
    middle of gradient accumulation.
    """

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.every = cfg["checkpoint"]["every_n_steps"]
        self.keep_last = cfg["checkpoint"]["keep_last"]
        self.max_steps = cfg["trainer"]["max_steps"]  # policy optimizer steps in every recipe (DESIGN.md)
        self.ckpt_dir = checkpoints_dir(cfg["run_dir"])
        self._seen_step: int | None = None
        self._last_saved: int | None = None

    @staticmethod
    def step_of(trainer: pl.Trainer, module: pl.LightningModule) -> int:
        version = getattr(module, "policy_version", None)
        return int(version) if version is not None else int(trainer.global_step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = self.step_of(trainer, pl_module)
        self._seen_step = step
        resumed = trainer.ckpt_path is not None  # set by now under every strategy
        if resumed:
            self._last_saved = step
        # every rank checks (a shared run_dir), so all of them stop together rather than leaving some
        # waiting in a collective; only rank 0 touches the directory
        if not resumed:
            refuse_existing_checkpoints(self.cfg["run_dir"])
        if trainer.is_global_zero:
            clean_leftovers(self.ckpt_dir)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = self.step_of(trainer, pl_module)
        previous, self._seen_step = self._seen_step, step
        if previous is None or step == previous:
            return
        crossed = step // self.every > previous // self.every
        if crossed or step >= self.max_steps > 0:
            self.save(trainer, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = self.step_of(trainer, pl_module)
        if step > 0 and step != self._last_saved:
            self.save(trainer, step)

    def save(self, trainer: pl.Trainer, step: int) -> None:
        for logger in trainer.loggers:
            logger.save()
        trainer.save_checkpoint(self.ckpt_dir / step_dir_name(step), weights_only=False)
        self._last_saved = step
        if trainer.is_global_zero:
            prune(self.cfg["run_dir"], self.keep_last)
