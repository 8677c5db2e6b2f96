"""`fw export`: a checkpoint's policy as a Hugging Face model directory.

The checkpoint's `policy/` already is HF layout (config.json, safetensors, tokenizer files), or PEFT's
adapter directory for a LoRA run, so export copies that directory, hashing each file as it copies it and
checking it against the manifest, and publishes the copy atomically (see `export_checkpoint` for an `--out` that
is an existing empty mount point). `merge=True` (`fw export --merge`)
turns a LoRA checkpoint into the merged model: the base is rebuilt from the checkpoint's config.yaml
(`model.policy.path`, or the preset from the seed), the checked copy of the adapters is folded in, and
the result is written in HF layout. A LoRA checkpoint's base that has moved is named by `base`
(`--model.policy.path`), once its files match the checkpoint's record of them: the merge reads it there, and
the adapter directory's adapter_config.json names it.

A model (not an adapter directory) gets a generation_config.json, which transformers' `generate` reads for
its stop tokens and sampling defaults: the one of the model the run started from, which the checkpoint keeps
(checked against the manifest like the rest); for a checkpoint without that copy, the one `model.policy.path`
of its config.yaml (or `base`) holds now; else one made from config.json and the exported tokenizer.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from framework.checkpoint import CONFIG_FILE, read_resolved, run_of_checkpoints_folder
from framework.checkpoint.directory import DamagedFile, enclosing_checkpoint, read_complete_manifest, verify_checkpoint
from framework.checkpoint.tensors import DiskFull
from framework.durable import (
    dead_leftovers,
    file_in_the_way,
    fsync_dir,
    hidden_sibling,
    no_room,
    no_room_text,
)
from framework.errors import FwError
from framework.models.hf_io import (
    GENERATION_CONFIG,
    MODEL_CONFIG,
    default_generation_config,
    read_config,
    read_generation_config,
    recover_leftovers,
    tokenizer_in,
    write_json,
)
from framework.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from framework.signals import Stopped

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
        raise DamagedFile(f"{src}: size {size} bytes, the manifest says {meta['size']}: the file is corrupt", src)
    if digest.hexdigest() != meta["sha256"]:
        raise DamagedFile(f"{src}: sha256 {digest.hexdigest()} does not match the manifest's {meta['sha256']}: "
                          "the file is corrupt", src)


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, merge: bool = False,
                      skip_damaged: bool = False, base: str | os.PathLike | None = None) -> str:
    """Write the policy of `checkpoint` (a checkpoint dir, or a run dir = its newest checkpoint; with
    `skip_damaged` its newest intact one) to `out` in HF layout, loadable by transformers'
    `AutoModelForCausalLM.from_pretrained` (a LoRA checkpoint: PEFT's adapter directory, or with `merge` the
    merged model), every file checked against the manifest's sha256. `out` must not exist or be empty.
    `base` (`--model.policy.path`) is where a LoRA checkpoint's base model is now, when it has moved from
    `model.policy.path` of the checkpoint's config.yaml; another directory than that must hold the files the
    checkpoint recorded.
    Returns `out`.

    The copy is staged in a hidden sibling of `out` and renamed into place, so `out` appears whole or not at
    all. An existing empty `out` that a rename cannot replace (a mount point, another file system than its
    parent's, or a parent this user cannot write) gets the staging directory inside it instead, whose files
    are then renamed into it one by one, config.json (adapter_config.json) last: it holds a loadable model
    only once every file is in, and a killed export leaves it without one, its partial copy refused by the
    next export into it."""
    given, out = out, Path(out).resolve()   # a link's target (staged beside it), "." a named directory
    inside = _checkpoint_around(out)
    if inside is not None:
        raise FwError(f"--out {given}: {inside}")
    try:
        recover_leftovers(out)   # a killed export's staging copy; a model that a killed save_pretrained set aside
        killed = [entry for entry, _, name in dead_leftovers(out) if name == out.name] if out.is_dir() else []
        for entry in killed:   # a killed export's staging inside `out`
            shutil.rmtree(entry)
    except OSError as e:
        raise _out_error(given, e) from None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        hint = ", holding the files a killed export moved in: empty it" if killed else "; choose a new one"
        raise FwError(f"--out {given}: already exists and is not an empty directory{hint}")
    blocking = file_in_the_way(given)
    if blocking is not None:
        raise FwError(f"--out {given}: cannot create its folder: {blocking} is a file")
    if Path.cwd().resolve().is_relative_to(out):
        raise FwError(f"--out {given}: the working directory (or one above it), which the export would replace; "
                      "choose a new directory")
    try:
        source = read_resolved(checkpoint, lambda source: _export(source, given, out, merge, base), skip_damaged,
                               settled=False)
    except _Terminated:
        raise Stopped(signal.SIGTERM, f"stopped by SIGTERM while exporting {checkpoint}; nothing was written to "
                                      f"--out {given}") from None
    if source != Path(checkpoint):   # a run directory: say which of its checkpoints this is
        print(f"fw: exported {source}, the newest {'intact ' if skip_damaged else ''}checkpoint of {checkpoint}",
              file=sys.stderr)
    return str(out)


def _checkpoint_around(out: Path) -> str | None:
    """Why `out` (resolved) is no place for an export, or None: it lies in a checkpoint directory, whose files are
    the ones its manifest lists and which a prune deletes whole, or in a run's checkpoints/ folder, where fw reads
    a `step-*` folder as a checkpoint (one without a manifest passes for the run's damaged newest)."""
    checkpoint = enclosing_checkpoint(out)
    run = run_of_checkpoints_folder(out)
    if run is not None:
        if checkpoint is not None:
            why = f"inside checkpoint {checkpoint}, which a prune deletes whole"
        else:
            where = "" if out == run / "checkpoints" else "inside "
            why = f"{where}the checkpoints/ folder of run directory {run}, where fw reads step-* folders as checkpoints"
        return f"{why}; give a directory outside {run / 'checkpoints'}, such as {run / 'export'}"
    if checkpoint is not None:
        return f"inside checkpoint {checkpoint}, whose files are those its manifest lists; give a directory outside it"
    return None


def _export(source: Path, given: str | os.PathLike, out: Path, merge: bool, base: str | os.PathLike | None) -> Path:
    """`export_checkpoint` of the resolved checkpoint directory `source`; returns `source`."""
    manifest = read_complete_manifest(source)
    if POLICY not in manifest["components"]:
        raise FwError(f"{source}: the checkpoint holds no {POLICY}/ component")
    files = [rel.split("/", 1)[1] for rel in manifest["files"] if rel.startswith(POLICY + "/")]
    if merge and ADAPTER_CONFIG not in files:
        raise FwError(f"--merge: {source} holds a full model, not LoRA adapters (no {POLICY}/{ADAPTER_CONFIG}); "
                      "export it without --merge")
    if base is not None and ADAPTER_CONFIG not in files:
        raise FwError(f"--model.policy.path {base}: {source} holds a full model, not LoRA adapters (no "
                      f"{POLICY}/{ADAPTER_CONFIG}), so it has no base model to name; leave --model.policy.path out")
    policy_cfg = None if base is None else _moved_base(source, manifest, base)

    staging = None
    try:
        inside = _stage_inside(out)
        if not inside:
            out.parent.mkdir(parents=True, exist_ok=True)
        staging = hidden_sibling(out / out.name if inside else out, "staging")
        with _sigterm_removes_staging():
            staging.mkdir()
            for name in files:
                _copy_checked(source / POLICY / name, staging / name, manifest["files"][f"{POLICY}/{name}"])
            if merge:   # from the checked copies of the adapters, which then make way for the merged model
                _write_merged(source, staging, manifest, policy_cfg)
                for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                    (staging / name).unlink()
            elif policy_cfg is not None:
                _name_base(staging / ADAPTER_CONFIG, policy_cfg["path"])
            elif MODEL_CONFIG in files and GENERATION_CONFIG not in files:
                if GENERATION_CONFIG in manifest["files"]:   # the source model's, as the run started from it
                    _copy_checked(source / GENERATION_CONFIG, staging / GENERATION_CONFIG,
                                  manifest["files"][GENERATION_CONFIG])
                else:
                    write_json(staging / GENERATION_CONFIG, _generation_config(source, staging))
            fsync_dir(staging)
        if inside:
            _move_into(staging, out, given)
        else:
            try:   # replaces an empty directory only: whatever another process wrote there meanwhile stays
                os.rename(staging, out)
            except OSError as e:
                if e.errno == errno.EBUSY and out.is_dir():   # a mount point of the parent's file system
                    _move_into(staging, out, given)
                elif e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise _written_meanwhile(given) from None
                else:
                    raise
            fsync_dir(out.parent)
    except BaseException as e:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        code = no_room(e) if isinstance(e, Exception) else None
        if code is not None:
            raise DiskFull(f"--out {out}: {no_room_text(code, out.parent, f'exporting {source}')}; nothing was "
                           "written") from None
        if isinstance(e, OSError) and not _names(e, source) and (
                e.errno in _OUT_ERRORS or e.errno in _OUT_PATH_ERRORS and _names_out(e, out, staging)):
            raise _out_error(given, e) from None
        raise
    return source


class _Terminated(BaseException):
    """SIGTERM while the staging copy is written: a BaseException, so that no retry of the read catches it."""


@contextmanager
def _sigterm_removes_staging() -> Iterator[None]:
    """While inside (the copy, up to its publication), SIGTERM raises `_Terminated`, whose way out removes the
    staging copy as Ctrl+C's does; its default action ends the process where it stands and leaves the copy (an 8B
    model's 16 GB) hidden beside `--out` until the next export to that path."""
    if threading.current_thread() is not threading.main_thread():   # signal.signal works only there
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)   # None: set outside Python


# what writing to `--out` can meet that the user fixes by choosing another place (or permissions)
_OUT_ERRORS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.EBUSY, errno.EXDEV)
# a folder of `--out` that cannot be made (under /proc, say); about `--out` only when the error names it
_OUT_PATH_ERRORS = (errno.ENOENT, errno.ENOTDIR)


def _names(e: OSError, source: Path) -> bool:
    """Whether `e` is about a file of checkpoint `source` (not of `--out`)."""
    return any(isinstance(f, (str, bytes)) and Path(os.fsdecode(f)).is_relative_to(source)
               for f in (e.filename, e.filename2))


def _names_out(e: OSError, out: Path, staging: Path | None) -> bool:
    """Whether `e` is about `out`, a folder above it, or the staging directory (not, say, a LoRA run's base)."""
    for f in (e.filename, e.filename2):
        if isinstance(f, (str, bytes)):
            path = Path(os.fsdecode(f))
            if out.is_relative_to(path) or staging is not None and path.is_relative_to(staging):
                return True
    return False


def _out_error(given: str | os.PathLike, e: OSError) -> FwError:
    where = f" ({e.filename})" if e.filename is not None else ""
    return FwError(f"--out {given}: {e.strerror or e}{where}; nothing was exported there: choose a directory "
                   "this user can write")


def _written_meanwhile(given: str | os.PathLike) -> FwError:
    return FwError(f"--out {given}: another process wrote into it during the export; it is left as it was, and "
                   "nothing was exported there")


def _stage_inside(out: Path) -> bool:
    """Whether the staging directory goes inside `out`: `out` is an existing empty directory that a rename of
    a sibling cannot replace (a mount point, on another file system than its parent) or whose parent this
    user cannot write."""
    if not out.is_dir():
        return False
    return (os.path.ismount(out) or out.stat().st_dev != out.parent.stat().st_dev
            or not os.access(out.parent, os.W_OK | os.X_OK))


def _move_into(staging: Path, out: Path, given: str | os.PathLike) -> None:
    """Rename the files of `staging` (inside `out`, or beside it on the same file system) into the empty `out`,
    the model's config last, so that `out` holds a loadable model only once it is complete."""
    if any(entry != staging for entry in out.iterdir()):
        raise _written_meanwhile(given)
    names = sorted(os.listdir(staging), key=lambda name: (name in (MODEL_CONFIG, ADAPTER_CONFIG), name))
    for name in names:
        os.rename(staging / name, out / name)
    fsync_dir(out)
    staging.rmdir()
    fsync_dir(out)


def adapted_policy(source: Path, adapter_dir: Path, policy_cfg: dict | None = None) -> tuple[Any, Any]:
    """(tokenizer, policy with adapters) of LoRA checkpoint `source`: the base rebuilt from its config.yaml
    (`model.policy.path`, or the preset from the seed; `policy_cfg` in place of its model.policy, from
    `framework.generate.checkpoint_policy_config`), the adapters of `adapter_dir` (checked copies, or the
    checkpoint's own `policy/` once its files were checked) loaded into it."""
    from safetensors.torch import load_file

    from framework.config import load_config
    from framework.models import build_policy
    from framework.models.lora import check_adapter_config, peft_targets
    from framework.models.qwen3 import load_targets
    from framework.tokenizer import Tokenizer, build_tokenizer

    cfg = load_config([str(source / CONFIG_FILE)], imports=())
    if policy_cfg is not None:
        cfg["model"]["policy"] = policy_cfg
    lora = cfg["model"]["policy"]["lora"]
    if lora is None:
        raise FwError(f"{source / CONFIG_FILE}: model.policy.lora is null, but {POLICY}/ holds adapters")
    check_adapter_config(json.loads((adapter_dir / ADAPTER_CONFIG).read_text()), lora,
                         str(source / POLICY / ADAPTER_CONFIG))
    # The vocabulary of a preset comes from the tokenizer the run trained with, which policy/ carries.
    tokenizer = Tokenizer.from_pretrained(adapter_dir) if (adapter_dir / "tokenizer.json").is_file() \
        else build_tokenizer(cfg)
    base = cfg["model"]["policy"]["path"]
    found = None if base is None else _missing_model(base)
    if found is not None:
        raise FwError(f"{source}: the base model of its LoRA adapters, model.policy.path of its {CONFIG_FILE}, is "
                      f"{base}: {found}; put that model back there (fw generate, fw eval and fw export --merge "
                      "also take --model.policy.path=DIR of a copy, checked against the checkpoint's record of its "
                      "files)")
    if base is not None:
        # the frozen base is as much the trained model as the adapters: one changed in place (a new revision
        # downloaded over it, another model written there) must not be merged or sampled as if it were the same
        from framework.checkpoint.resume import base_changed_in_place

        problem = base_changed_in_place(read_complete_manifest(source), base)
        if problem is not None:
            raise FwError(f"{source}: the base model of its LoRA adapters, {base} (model.policy.path), is not the one "
                          f"they were trained on ({problem}); put that model back there, or name a copy of it with "
                          "--model.policy.path=DIR")
    model_cfg = {**cfg["model"]["policy"], "compile": False, "gradient_checkpointing": False}
    policy = build_policy(model_cfg, tokenizer, seed=cfg["seed"])
    load_targets(peft_targets(policy), load_file(str(adapter_dir / ADAPTER_WEIGHTS)),
                 source=str(source / POLICY / ADAPTER_WEIGHTS))
    return tokenizer, policy


def _missing_model(path: str | os.PathLike) -> str | None:
    """What `path` lacks as a model directory (its config.json, or the directory itself), or None."""
    p = Path(path)
    if (p / MODEL_CONFIG).is_file():
        return None
    return "no config.json there" if p.is_dir() else "not a directory" if p.exists() else "no such directory"


def _moved_base(source: Path, manifest: dict, given: str | os.PathLike) -> dict:
    """The model.policy config of LoRA checkpoint `source` (its config.yaml) with the base model at `given`
    (`--model.policy.path`), once that directory holds the files that the checkpoint recorded of its base."""
    from framework.checkpoint.resume import recorded_move_problem, say_moved
    from framework.config import load_config

    policy = load_config([str(source / CONFIG_FILE)], imports=())["model"]["policy"]
    was = policy["path"]
    if was is None:
        raise FwError(f"--model.policy.path {given}: the LoRA adapters of {source} are on the preset "
                      f"{policy['preset']} (model.policy.preset of its {CONFIG_FILE}), built from its seed, not on a "
                      "model directory; leave --model.policy.path out")
    path = os.path.abspath(os.path.expanduser(given))   # as fw reads a path override: from the working directory
    found = _missing_model(path)
    if found is not None:
        raise FwError(f"--model.policy.path {given}: {found}; give the directory that the base model of {source} "
                      f"({was}) was moved or copied to")
    if path != was:   # the base at its own place is read as without the option
        if (manifest.get("sources") or {}).get("model.policy.path") is None and not Path(was).is_dir():
            # nothing to check the copy against: what the old place held is neither recorded nor there
            raise FwError(f"--model.policy.path {given}: {source} was written without a record of its base "
                          f"model's files, and {was} is gone, so the move cannot be checked; put the base model back "
                          f"at {was} (a symlink to {path} will do) and leave --model.policy.path out")
        problem = recorded_move_problem(manifest, "model.policy.path", was, path)
        if problem is not None:
            raise FwError(f"--model.policy.path {given}: not the base model of the LoRA adapters of {source}, "
                          f"{was} ({problem}); give the directory that model was moved or copied to")
        say_moved("model.policy.path", was, path, "exporting with it")
    return {**policy, "path": path}


def _name_base(adapter_config: Path, base: str) -> None:
    """Point the exported `adapter_config` at `base`: PEFT loads the base from its base_model_name_or_path,
    which fw writes as model.policy.path of the run, where the base is no longer."""
    config = json.loads(adapter_config.read_text())
    config["base_model_name_or_path"] = base
    adapter_config.unlink()
    write_json(adapter_config, config)


def _write_merged(source: Path, staging: Path, manifest: dict, policy_cfg: dict | None = None) -> None:
    """The merged policy of LoRA checkpoint `source` as config.json, generation_config.json and safetensors in
    `staging`, from the adapter files already copied (and checked) there; `policy_cfg` (`_moved_base`) in place
    of the model.policy of its config.yaml."""
    from framework.models.hf_io import write_model
    from framework.models.lora import merged_copy

    _, policy = adapted_policy(source, staging, policy_cfg)
    base = None if policy_cfg is None else policy_cfg["path"]
    write_model(merged_copy(policy), staging, generation_config=_source_generation_config(source, manifest, base))


def _source_generation_config(source: Path, manifest: dict, base: str | None = None) -> dict | None:
    """The generation_config.json of the model directory run `source` started from: the checkpoint's copy
    (its sha256 checked against `manifest`), else `_generation_config_at_path`."""
    if GENERATION_CONFIG in manifest["files"]:
        verify_checkpoint(source, [GENERATION_CONFIG])
        return read_generation_config(source)
    return _generation_config_at_path(source, base)


def _generation_config_at_path(source: Path, base: str | None = None) -> dict | None:
    """For a checkpoint written without the source model's copy: the generation_config.json that the directory
    named by its config.yaml's `model.policy.path` (or `base`, where that model is now) holds now; None for a
    preset, or a directory without one."""
    from framework.config import load_config

    path = base
    if path is None:   # read as every fw command reads config.yaml: relative paths from its directory, `~` expanded
        path = load_config([str(source / CONFIG_FILE)], imports=())["model"]["policy"]["path"]
    return read_generation_config(path) if path is not None and Path(path).is_dir() else None


def _generation_config(source: Path, staging: Path) -> dict:
    """generation_config.json of the full model checkpoint `source`, written without the source model's copy,
    exported to `staging`: `_generation_config_at_path`, else one from the config.json and tokenizer copied
    there."""
    carried = _generation_config_at_path(source)
    if carried is not None:
        return carried
    return default_generation_config(read_config(staging)[1], tokenizer_in(staging))
