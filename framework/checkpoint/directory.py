"""One checkpoint directory: its manifest, writing it atomically, reading it back, completeness, verification."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from framework.checkpoint.tensors import (
    TRAINER_TENSORS_PREFIX,
    DiskFull,
    SubclassRef,
    TensorRef,
    is_trainer_tensor_file,
    join_tensors,
    read_safetensors,
    run_parallel,
    shard_names,
    split_tensors,
    write_safetensors,
)
from framework.config import save_resolved
from framework.durable import (
    fsync_dir,
    hash_and_fsync,
    hidden_sibling,
    no_room,
    no_room_text,
    publish_dir,
    room_left,
    sha256,
)
from framework.errors import FwError
from framework.models.hf_io import GENERATION_CONFIG, INDEX_FILE, parse_size, plan_shards

FORMAT = "fw.checkpoint"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)   # 1: the whole trainer state pickled in trainer_state.pt
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
HF_CONFIG_FILE = "config.json"
# the generation_config.json of the model directory the run started from, as its bytes: written beside config.yaml
SOURCE_GENERATION_CONFIG = "fw_generation_config"

_COMPONENT_NAME = re.compile(r"^[A-Za-z0-9_]+$")
# the trainer state's shards are cut smaller than the weights' for a large state, but no smaller than this
MIN_TRAINER_SHARD = 256 << 20


def config_sha256(cfg: dict) -> str:
    """sha256 of the resolved config's canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class DamagedFile(FwError):
    """A file of a checkpoint found missing or corrupt while it is read; `file` names it, `problem` is the message
    as raised (a multi-process run prefixes the error's own text with the rank that raised it)."""

    def __init__(self, message: str, file: Path):
        super().__init__(message)
        self.file = file
        self.problem = message


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
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise FwError(
            f"{file}: checkpoint format version {manifest.get('format_version')!r} is not supported "
            f"(this fw reads versions {', '.join(map(str, READABLE_VERSIONS))})"
        )
    problem = _malformed(manifest)
    if problem is not None:
        raise FwError(f"{file}: malformed manifest ({problem})")
    return manifest


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _malformed(manifest: dict) -> str | None:
    """What in a parsed manifest is not as fw writes it, for the fields that readers use; None when all are. A
    flipped bit or a hand edit can leave the JSON valid and a key or a type wrong, which would otherwise fail
    later as a KeyError or TypeError far from the file."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "'files' is not an object"
    for rel, meta in files.items():
        if not isinstance(meta, dict) or not _is_int(meta.get("size")) or not isinstance(meta.get("sha256"), str):
            return f"'files' entry {rel!r} is not {{size: integer, sha256: string}}"
    components = manifest.get("components")
    if not isinstance(components, list) or not all(isinstance(c, str) for c in components):
        return "'components' is not a list of names"
    for key in ("step", "global_step", "policy_version"):
        if manifest.get(key) is not None and not _is_int(manifest[key]):
            return f"{key!r} is not an integer"
    if not isinstance(manifest.get("sources", {}), dict):
        return "'sources' is not an object"
    return None


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


def enclosing_checkpoint(path: str | os.PathLike) -> Path | None:
    """The checkpoint directory (one holding a manifest) that `path` is or lies inside, or None: files written
    there are none of its manifest's, and a prune deletes them with it."""
    folder = Path(os.path.abspath(path))
    return next((f for f in (folder, *folder.parents) if (f / MANIFEST).is_file()), None)


# Checkpoints whose every file this process hashed and found as listed, by directory, with each file's hash and
# what it was on disk then (inode, size, modification time): `fw fit --resume` verifies the newest checkpoint
# before it loads it, and the load does not hash the same, unchanged files again (on an 8B run, tens of GB).
_VERIFIED: dict[str, dict[str, tuple]] = {}
SETTLED_NS = 2_000_000_000   # how long before its hashing a file must have been written to be remembered


def _on_disk(path: Path, rels: list[str]) -> dict[str, tuple] | None:
    """(inode, size, modification time) of each file `rels` of `path`, or None when one is missing."""
    try:
        return {rel: (st.st_ino, st.st_size, st.st_mtime_ns) for rel in rels for st in [(path / rel).stat()]}
    except FileNotFoundError:
        return None


def verified(path: Path, manifest: dict) -> bool:
    """Whether this process already verified every file of checkpoint `path` against `manifest`'s hashes, and
    none of them changed on disk since."""
    checked = _VERIFIED.get(str(path.resolve()))
    if checked is None or set(checked) != set(manifest["files"]):
        return False
    now = _on_disk(path, sorted(checked))
    return now is not None and all(checked[rel] == (manifest["files"][rel]["sha256"], *now[rel]) for rel in checked)


class Verifier:
    """sha256 of checkpoint files computed on background threads while the caller reads the same files (the
    page cache serves both), checked against the manifest at the end."""

    def __init__(self, path: Path, manifest: dict, rels: list[str] | None = None):
        self.path = path
        # the files as they are before they are hashed: a file changed while hashed is not remembered as verified.
        # Only files last written a while before are remembered, so that a later write, whose modification time
        # can fall in the same tick of a coarse file-system clock, still changes it.
        seen = _on_disk(path, sorted(manifest["files"])) if rels is None else None
        settled = time.time_ns() - SETTLED_NS
        self.seen = seen if seen is not None and all(mtime < settled for *_, mtime in seen.values()) else None
        self.expected = {rel: manifest["files"][rel]["sha256"] for rel in (rels or sorted(manifest["files"]))}
        # largest first, so the threads finish together
        order = sorted(self.expected, key=lambda rel: -manifest["files"][rel]["size"])
        self.pool = ThreadPoolExecutor(max_workers=min(io_threads(), max(1, len(order))))
        self.futures: dict[str, Future] = {rel: self.pool.submit(sha256, path / rel) for rel in order}
        self.bad: Path | None = None   # the file `problem` names

    def problem(self) -> str | None:
        """Wait for every hash; the first mismatching file (in path order) as a message, or None."""
        self.pool.shutdown(wait=True)
        for rel in sorted(self.futures):
            try:
                digest = self.futures[rel].result()
            except FileNotFoundError:
                self.bad = self.path / rel
                return f"{self.path / rel}: missing from checkpoint {self.path} (listed in its manifest)"
            if digest != self.expected[rel]:
                self.bad = self.path / rel
                return (f"{self.path / rel}: sha256 {digest} does not match the manifest's {self.expected[rel]}: "
                        "the file is corrupt")
        if self.seen is not None:
            _VERIFIED[str(self.path.resolve())] = {rel: (self.expected[rel], *self.seen[rel]) for rel in self.seen}
        return None

    def check(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise DamagedFile(problem, self.bad)

    def explain(self, error: BaseException) -> None:
        """After `error` while reading the files: raise the hash mismatch instead when there is one (a corrupt
        file often fails to parse, and its hash is the root cause); an interrupt only stops the hashing."""
        if not isinstance(error, Exception):
            self.pool.shutdown(wait=False, cancel_futures=True)
            return
        problem = self.problem()
        if problem is not None:
            raise DamagedFile(problem, self.bad) from None



@contextlib.contextmanager
def verifying(verifier: Verifier | None) -> Iterator[None]:
    """Around a read of the files that `verifier` hashes (None: no verification): an error while reading
    becomes the hash mismatch when there is one, and a read that succeeded is checked at the end."""
    try:
        yield
    except BaseException as e:
        if verifier is not None:
            verifier.explain(e)
        raise
    if verifier is not None:
        verifier.check()


def mismatch(path: Path, manifest: dict, rels: list[str] | None = None) -> DamagedFile | None:
    """The first of checkpoint `path`'s files `rels` (None: every file) whose sha256 differs from `manifest`'s, or
    that is missing, as a DamagedFile; None when all of them are as listed."""
    verifier = Verifier(path, manifest, rels)
    problem = verifier.problem()
    return None if problem is None else DamagedFile(problem, verifier.bad)


@contextlib.contextmanager
def explaining(path: Path, manifest: dict) -> Iterator[None]:
    """Around a read of checkpoint `path` that does not hash its files (`checkpoint.verify: false`): an error while
    reading becomes the hash mismatch of one of them when there is one, found by hashing them then. A corrupt
    file fails to parse, or parses into names and values that fail later, and its hash names the root cause; a
    read that succeeds costs no hashing."""
    try:
        yield
    except Exception:
        damaged = mismatch(path, manifest)
        if damaged is not None:
            raise damaged from None
        raise


def verify_checkpoint(path: str | os.PathLike, rels: list[str] | None = None) -> dict:
    """Check every file's size and sha256 (or only those of `rels`) against the manifest; return the manifest
    or raise FwError naming the bad file."""
    path = Path(path)
    manifest = read_complete_manifest(path)
    Verifier(path, manifest, rels).check()
    return manifest




def _is_model_file(fname: str) -> bool:
    """config.json and the weights (single file, shards, index, or a config-less component's one
    safetensors file such as PEFT's adapters): written from "state_dict", not "files"."""
    return fname in (HF_CONFIG_FILE, INDEX_FILE) or fname.endswith(".safetensors")


def _component_jobs(folder: Path, name: str, component: dict, limit: int) -> list[tuple[int, str, Callable]]:
    """Write the component's small files now; return its weight shards as (bytes, rel path, job) to run."""
    if not _COMPONENT_NAME.match(name):
        raise ValueError(f"fw_components: component name {name!r} must match {_COMPONENT_NAME.pattern}")
    files = component.get("files") or {}
    for fname in files:
        if _is_model_file(fname) or Path(fname).name != fname or fname.startswith("."):
            raise ValueError(f"fw_components[{name!r}]['files']: {fname!r} is not an allowed file name")
    folder.mkdir()
    tensors = component["state_dict"]
    if component.get("config") is None:
        # Tensors without a model config (e.g. PEFT adapters): one safetensors file under the given name.
        weights = component["weights_file"]
        if Path(weights).name != weights or not weights.endswith(".safetensors"):
            raise ValueError(f"fw_components[{name!r}]['weights_file']: {weights!r} is not a safetensors file name")
        for fname, data in files.items():
            (folder / fname).write_bytes(bytes(data))
        return [_tensor_job(folder / weights, f"{name}/{weights}", tensors, {"format": "pt"})]
    shards = plan_shards(tensors, limit)
    names = shard_names("model", len(shards))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {n: file for file, shard in zip(names, shards) for n in shard}}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (folder / HF_CONFIG_FILE).write_text(json.dumps(component["config"], indent=2) + "\n")
    for fname, data in files.items():
        (folder / fname).write_bytes(bytes(data))
    return [_tensor_job(folder / file, f"{name}/{file}", {n: tensors[n] for n in shard}, {"format": "pt"})
            for file, shard in zip(names, shards)]


def _tensor_job(file: Path, rel: str, tensors: dict, metadata: dict | None) -> tuple[int, str, Callable]:
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return nbytes, rel, lambda: write_safetensors(file, tensors, metadata)


def write_checkpoint_dir(
    checkpoint: dict, final: str | os.PathLike, cfg: dict, use_exchange: bool = True,
    max_shard_size: int | str = "5GB", sources: dict | None = None,
) -> dict:
    """Write `checkpoint` (a Lightning checkpoint dict, with weights under "fw_components") as the directory
    `final`, atomically. Pops "fw_components", and SOURCE_GENERATION_CONFIG (bytes, written as the top-level
    generation_config.json when not None). Returns the manifest. Components are sharded like HF's
    save_pretrained (5 GB shards by default); the trainer state's tensors go to safetensors shards no larger
    (smaller for a large state, to spread it over the writing threads) beside the pickled rest. A write that
    finds no room (a full disk or quota, a file size limit) raises DiskFull (an FwError) after removing the
    staging directory; earlier checkpoints are never touched. `sources`: what the config's data and model paths
    hold (resume.py `source_fingerprints`), kept in the manifest."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    components = checkpoint.pop("fw_components", None) or {}
    generation_config = checkpoint.pop(SOURCE_GENERATION_CONFIG, None)
    limit = parse_size(max_shard_size)
    staging = hidden_sibling(final, "staging")
    staging.mkdir()
    try:
        jobs = []
        for name, component in components.items():
            jobs += _component_jobs(staging / name, name, component, limit)
        skeleton, tensors = split_tensors(checkpoint)
        shards = plan_shards(tensors, _trainer_shard_limit(tensors, limit, io_threads())) if tensors else []
        for file, shard in zip(shard_names(TRAINER_TENSORS_PREFIX, len(shards)), shards):
            jobs.append(_tensor_job(staging / file, file, {n: tensors[n] for n in shard}, None))
        with open(staging / TRAINER_STATE, "wb") as f:
            torch.save(skeleton, f)
        save_resolved(cfg, staging / CONFIG_FILE)
        if generation_config is not None:   # hashed and fsynced with the other small files below
            (staging / GENERATION_CONFIG).write_bytes(bytes(generation_config))
            if (components.get("policy") or {}).get("config") is not None:
                # and in policy/, a whole HF directory that a next run, fw generate or transformers may load
                (staging / "policy" / GENERATION_CONFIG).write_bytes(bytes(generation_config))

        jobs.sort(key=lambda job: -job[0])   # largest first: the threads finish together
        sums = dict(zip([rel for _, rel, _ in jobs], run_parallel([job for _, _, job in jobs], io_threads())))
        for p in staging.rglob("*"):
            rel = p.relative_to(staging).as_posix()
            if p.is_file() and rel not in sums:
                sums[rel] = hash_and_fsync(p)   # the small files: read back what is on disk
        policy_version = checkpoint.get("policy_version")
        step = policy_version if policy_version is not None else checkpoint.get("global_step")
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "policy_version": policy_version,
            "global_step": checkpoint.get("global_step"),
            "config_sha256": config_sha256(cfg),
            # what the config's data and model paths held, so a resume accepts them moved, not changed
            "sources": sources or {},
            "components": sorted(components),
            "files": {rel: {"size": size, "sha256": digest} for rel, (size, digest) in sorted(sums.items())},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        hash_and_fsync(staging / MANIFEST)
        for name in components:
            fsync_dir(staging / name)
        fsync_dir(staging)
        publish_dir(staging, final, use_exchange=use_exchange)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)   # before room_left: the space it held is free again
        code = no_room(e) if isinstance(e, Exception) else None
        if isinstance(e, DiskFull):   # named by its published path: the staging directory is gone
            room = room_left(code or errno.ENOSPC, final.parent)
            raise DiskFull(f"{str(e).replace(str(staging), str(final))} ({room}); the checkpoint {final.name} was "
                           "not written, the earlier checkpoints are intact") from None
        if code is not None:
            text = no_room_text(code, final.parent, f"writing the checkpoint {final.name}")
            raise DiskFull(f"{final.parent}: {text}; the earlier checkpoints are intact") from None
        raise
    return manifest


def io_threads() -> int:
    """Threads that write (or read) a checkpoint's files, one file each."""
    return max(1, min(8, os.cpu_count() or 1))


def _trainer_shard_limit(tensors: dict[str, torch.Tensor], limit: int, workers: int) -> int:
    """The size of the trainer state's shards: `limit`, or less for a large state, so that it spreads over
    about `workers` files. A file streams no faster than one core hashes it (sha256 is sequential), so the
    optimizer states, the bulk of a save, must not sit in one or two files. Only fw reads these files."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return min(limit, max(MIN_TRAINER_SHARD, -(-total // workers)))


def _safetensors_device(map_location: Any) -> str:
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    return "cpu"


def component_weight_files(manifest: dict, name: str) -> list[str]:
    """The weight files of component `name` (relative to it), in order."""
    return sorted(rel.split("/", 1)[1] for rel in manifest["files"]
                  if rel.startswith(name + "/") and rel.endswith(".safetensors"))


def read_checkpoint_dir(
    path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None, verify: bool = False
) -> dict:
    """Rebuild the checkpoint dict from directory `path`; weights come back under "fw_components" as
    {name: {"config": dict (None without config.json), "state_dict": {hf name: tensor}, "files": {name: bytes}}},
    the source model's generation_config.json (when the checkpoint keeps one) under SOURCE_GENERATION_CONFIG as
    bytes. Sizes are always checked; `verify` also checks every sha256, hashing on other threads while the
    files are read; without it, a read that fails hashes them then, so that a corrupt file is named as such."""
    path = Path(path)
    manifest = read_complete_manifest(path)
    if verified(path, manifest):   # hashed by this process already (a resume's), and unchanged since
        return _read(path, manifest, map_location, weights_only)
    with verifying(Verifier(path, manifest)) if verify else explaining(path, manifest):
        return _read(path, manifest, map_location, weights_only)


def weights_only_refusal(obj: Any) -> str | None:
    """What a resume's weights-only load of the trainer state would refuse in `obj` (a global's name, such as
    `numpy._core.multiarray.scalar`), or None when it loads: `obj` is pickled as `write_checkpoint_dir` pickles the
    trainer state (its large tensors stored apart) and read back as `read_checkpoint_dir` reads it."""
    skeleton, _ = split_tensors(obj)
    buffer = io.BytesIO()
    torch.save(skeleton, buffer)
    buffer.seek(0)
    try:
        with torch.serialization.safe_globals([TensorRef, SubclassRef]):
            torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as e:
        return _refused(e) or str(e).strip().splitlines()[0]
    return None


def _refused(error: BaseException) -> str | None:
    """The global (`module.name`) that a weights-only load refused with `error`, or None for another error."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    return found.group(1) if found and isinstance(error, pickle.UnpicklingError) else None


def _read(path: Path, manifest: dict, map_location: Any, weights_only: bool | None) -> dict:
    device = _safetensors_device(map_location)
    # like Lightning's TorchCheckpointIO, default to CPU: never onto the GPU the state was saved from
    # (another rank's device under DDP); Lightning moves optimizer state to the right device itself
    try:
        with open(path / TRAINER_STATE, "rb") as f, torch.serialization.safe_globals([TensorRef, SubclassRef]):
            checkpoint = torch.load(f, map_location=map_location if map_location is not None else "cpu",
                                    weights_only=weights_only)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        refused = _refused(e)
        if refused is not None:   # whole, as written: a callback's or a recipe's state holds an object of this type
            raise FwError(f"{path / TRAINER_STATE}: the trainer state holds {refused}, which a weights-only load "
                          "refuses (a callback's or a recipe's saved state holds it); if you trust this checkpoint, "
                          "set TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 to load it in full") from None
        raise FwError(f"{path / TRAINER_STATE}: corrupt trainer state ({str(e).splitlines()[0]})") from None
    # every tensor file at once, on several threads (safetensors reads without holding the GIL)
    trainer_files = sorted(r for r in manifest["files"] if is_trainer_tensor_file(r))
    weight_files = {name: component_weight_files(manifest, name) for name in manifest["components"]}
    rels = trainer_files + [f"{name}/{f}" for name, files in weight_files.items() for f in files]
    loaded = dict(zip(rels, run_parallel([lambda rel=rel: read_safetensors(path / rel, device) for rel in rels],
                                         io_threads())))
    tensors: dict[str, torch.Tensor] = {}
    for rel in trainer_files:
        tensors.update(loaded[rel])
    checkpoint = join_tensors(checkpoint, tensors, str(path))
    components = {}
    for name in manifest["components"]:
        folder = path / name
        names = sorted(rel.split("/", 1)[1] for rel in manifest["files"] if rel.startswith(name + "/"))
        state_dict: dict[str, torch.Tensor] = {}
        for fname in weight_files[name]:
            state_dict.update(loaded[f"{name}/{fname}"])
        try:
            config = json.loads((folder / HF_CONFIG_FILE).read_text()) if HF_CONFIG_FILE in names else None
        except ValueError as e:
            raise FwError(f"{folder / HF_CONFIG_FILE}: invalid JSON ({e})") from None
        components[name] = {
            "config": config,
            "state_dict": state_dict,
            "files": {f: (folder / f).read_bytes() for f in names if not _is_model_file(f)},
        }
    checkpoint["fw_components"] = components
    if GENERATION_CONFIG in manifest["files"]:
        checkpoint[SOURCE_GENERATION_CONFIG] = (path / GENERATION_CONFIG).read_bytes()
    return checkpoint
