"""Hugging Face checkpoint directories in and out: config.json, generation_config.json and safetensors
(sharded with an index).

Loading builds the model on the meta device, allocates it once in the requested dtype and streams
the shards in tensor by tensor (`safe_open`), so no second full copy of the weights is ever held.

Saving is atomic: the directory is built in a hidden staging sibling, every file and directory fsynced, and
published by renames (`publish_atomically`), so a crash leaves the previous directory or the new one, never
a mix of the two.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from framework.durable import (
    dead_leftovers,
    fsync_dir,
    fsync_file,
    fsync_tree,
    hidden_sibling,
    link_or_copy,
    publish_dir,
    write_new_file,
)
from framework.errors import FwError
from framework.models.qwen3 import HfTargets, Qwen3ForCausalLM, check_tied_head, check_weight_dtype, copy_into
from framework.models.qwen3_config import Qwen3Config
from framework.models.value import ARCHITECTURE as VALUE_ARCHITECTURE
from framework.models.value import Qwen3ValueModel
from framework.tokenizer import TURN_END, Tokenizer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
MODEL_CONFIG = "config.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """None -> float32 (training master weights); names as in config.json ("bfloat16", ...)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise FwError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB" (decimal units, as HF) or "512MiB"."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not m or float(m.group(1)) <= 0:
        raise FwError(f"max_shard_size {size!r}: expected a positive byte count or a size like '5GB'")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def read_config(path: str | os.PathLike) -> tuple[Qwen3Config, dict]:
    """(validated config, raw config.json dict) of a checkpoint directory."""
    file = Path(path) / MODEL_CONFIG
    if not file.is_file():
        raise FwError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FwError(f"{file}: invalid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise FwError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return Qwen3Config.from_hf(raw, source=str(file)), raw


def _weight_map(path: Path) -> dict[str, str]:
    """The weight_map of the index of checkpoint directory `path`: tensor name -> shard file of the directory."""
    try:
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise FwError(f"{path / INDEX_FILE}: not a safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) and f and Path(f).name == f and f not in (".", "..") for f in weight_map.values()):
        raise FwError(f"{path / INDEX_FILE}: weight_map must map tensor names to shard files of this directory")
    return weight_map


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the index, or the single model.safetensors."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        if (path / SINGLE_FILE).is_file():   # transformers would read the single file, fw the shards
            raise FwError(f"{path}: holds both {SINGLE_FILE} and {INDEX_FILE}, which may hold different weights; "
                          "remove the one another tool left behind")
        files = [path / f for f in sorted(set(_weight_map(path).values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FwError(f"{path / INDEX_FILE} names shard files that do not exist: {absent}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    others = sorted(p.name for p in path.glob("*.bin")) if path.is_dir() else []
    hint = f" (found {others}: only safetensors checkpoints are supported)" if others else ""
    raise FwError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def empty_model(cls: type[nn.Module], config: Qwen3Config, dtype: torch.dtype,
                device: torch.device | str | None) -> nn.Module:
    """The module allocated once in dtype on device, without initialising it (it is loaded next)."""
    with torch.device("meta"):
        model = cls(config)
    return model.to(dtype).to_empty(device=device or "cpu")


def stream_load(targets: HfTargets, path: str | os.PathLike, tied: bool = False) -> None:
    """Copy every tensor of the checkpoint at `path` into `targets`, one tensor at a time; strict."""
    seen: set[str] = set()
    lm_head = None
    files = checkpoint_files(path)
    for file in files:
        try:   # a truncated or garbled shard: the error names the file, which safetensors' own does not
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    if name in seen:
                        raise FwError(f"{file}: tensor {name} appears in more than one shard")
                    seen.add(name)
                    if tied and name == "lm_head.weight":
                        lm_head = f.get_tensor(name)
                        check_weight_dtype(name, lm_head, str(file))
                    elif name not in targets:
                        raise FwError(f"{file}: unexpected tensor {name} (not part of this Qwen3 model)")
                    else:
                        copy_into(targets, name, f.get_tensor(name), str(file))
        except SafetensorError as e:
            raise FwError(f"{file}: not a readable safetensors file ({e})") from None
    missing = sorted(set(targets) - seen)
    if missing:
        raise FwError(_missing_message(Path(path), missing, files))
    if lm_head is not None:
        check_tied_head(lm_head, targets["model.embed_tokens.weight"][0], str(path))


def _listed(names: list[str]) -> str:
    """The first 8 of `names`, and how many more."""
    return f"{names[:8]}" + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _missing_message(path: Path, missing: list[str], files: list[Path]) -> str:
    """The model's tensors that no file of checkpoint `path` holds, each named against the file that should hold
    it (the one to fetch again): the single model.safetensors; of shards, the shard the index places it in, or
    the index where it places it in none."""
    if files == [path / SINGLE_FILE]:
        return f"{files[0]}: missing tensors {_listed(missing)}"
    weight_map = _weight_map(path)
    by_file: dict[str, list[str]] = {}
    for name in missing:
        by_file.setdefault(weight_map.get(name, ""), []).append(name)
    parts = [f"{path / shard}: missing tensors {_listed(names)}, which {INDEX_FILE} places in that shard"
             for shard, names in sorted(by_file.items()) if shard]
    if "" in by_file:
        parts.append(f"{path / INDEX_FILE}: missing tensors {_listed(by_file[''])}: the index maps them to no "
                     f"shard, and none of its shards {_listed([f.name for f in files])} holds them")
    return "; ".join(parts)


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None) -> Qwen3ForCausalLM:
    """The policy from an HF Qwen3 directory, in `dtype` (None = float32) on `device` (None = cpu).

    `model.generation_config` holds the directory's generation_config.json (None without one), which
    `save_pretrained` writes back unchanged."""
    config, raw = read_config(path)
    if VALUE_ARCHITECTURE in (raw.get("architectures") or []):
        raise FwError(f"{path} holds a value model ({VALUE_ARCHITECTURE}); load it with load_value_model")
    generation_config = read_generation_config(path)
    model = empty_model(Qwen3ForCausalLM, config, resolve_dtype(dtype), device)
    stream_load(model.hf_targets(), path, tied=config.tie_word_embeddings)
    model.generation_config = generation_config
    return model


def read_generation_config(path: str | os.PathLike) -> dict | None:
    """The generation_config.json of directory `path` as a dict; None when there is none."""
    file = Path(path) / GENERATION_CONFIG
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FwError(f"{file}: invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise FwError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def default_generation_config(config: dict, tokenizer: Tokenizer | None) -> dict:
    """generation_config.json for a model without one: bos from config.json; eos every id that ends a reply
    (config.json's, the tokenizer's eos and <|im_end|>), so that `generate` stops at the end of a chat turn;
    pad the tokenizer's (else config.json's)."""
    eos = config.get("eos_token_id")
    ids = list(eos) if isinstance(eos, list) else [] if eos is None else [eos]
    if tokenizer is not None:
        ids += [tokenizer.eos_id, tokenizer.token_to_id(TURN_END)]
    ids = list(dict.fromkeys(i for i in ids if i is not None))
    pad = tokenizer.pad_id if tokenizer is not None else config.get("pad_token_id")
    out = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": ids[0] if len(ids) == 1 else ids or None,
           "pad_token_id": pad}
    return {k: v for k, v in out.items() if v is not None}


def load_value_model(path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                     device: torch.device | str | None = None) -> Qwen3ValueModel:
    """A critic written by `save_value_model`."""
    config, raw = read_config(path)
    if VALUE_ARCHITECTURE not in (raw.get("architectures") or []):
        raise FwError(f"{path}/config.json: architectures {raw.get('architectures')} is not "
                      f"[{VALUE_ARCHITECTURE!r}]; a value model directory is written by save_value_model")
    model = empty_model(Qwen3ValueModel, config, resolve_dtype(dtype), device)
    stream_load(model.hf_targets(), path)
    return model


def save_pretrained(model: Qwen3ForCausalLM, path: str | os.PathLike, max_shard_size: int | str = "5GB",
                    tokenizer: Tokenizer | None = None) -> None:
    """Write HF layout: config.json, generation_config.json, model.safetensors (or shards + index when over
    max_shard_size) and, when given, `tokenizer`'s files; atomically (`publish_atomically`).

    generation_config.json is the one the model was loaded with, else `default_generation_config` of its
    config and `tokenizer` (or the tokenizer `path` already holds). Like transformers, files of `path` that are
    not the model's (a tokenizer, a README) stay, and the model files are replaced."""
    limit = parse_size(max_shard_size)
    publish_atomically(path, lambda staging: write_model(model, staging, limit, tokenizer))


def save_value_model(model: Qwen3ValueModel, path: str | os.PathLike, max_shard_size: int | str = "5GB") -> None:
    """Write a critic: config.json (architectures [Qwen3ValueModel]) + safetensors with v_head.*; atomically."""
    config = model.config.to_hf(dtype_name(model.v_head.weight.dtype))
    config["architectures"] = [VALUE_ARCHITECTURE]
    limit = parse_size(max_shard_size)
    publish_atomically(path, lambda staging: write_weights(config, model.hf_state_dict(), staging, limit))


def write_model(model: Qwen3ForCausalLM, directory: str | os.PathLike, max_shard_size: int | str = "5GB",
                tokenizer: Tokenizer | None = None, generation_config: dict | None = None) -> None:
    """`save_pretrained`'s files, each fsynced, written into `directory` in place: a staging directory that the
    caller publishes. `generation_config` stands for the model's own."""
    directory = Path(directory)
    if tokenizer is not None:
        for name, data in tokenizer.files().items():
            write_new_file(directory / name, data)
    config = model.config.to_hf(dtype_name(model.lm_head_weight.dtype))
    if generation_config is None:
        generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        generation_config = default_generation_config(config, tokenizer or tokenizer_in(directory))
    write_json(directory / GENERATION_CONFIG, generation_config)
    write_weights(config, model.hf_state_dict(), directory, max_shard_size)


def tokenizer_in(directory: Path) -> Tokenizer | None:
    """The tokenizer that `directory` holds (tokenizer.json), if any."""
    if not (directory / "tokenizer.json").is_file():
        return None
    with warnings.catch_warnings():   # only its special tokens are read, not its chat template
        warnings.simplefilter("ignore")
        return Tokenizer.from_pretrained(directory)


def plan_shards(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Tensor names split into shards of at most `limit` bytes, in order (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(config: dict, tensors: dict[str, Tensor], directory: str | os.PathLike,
                  max_shard_size: int | str) -> None:
    """config.json + safetensors shards (+ index), each fsynced, into `directory` in place; its earlier
    model*.safetensors files are removed."""
    limit = parse_size(max_shard_size)
    directory = Path(directory)
    for old in directory.iterdir():
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(old.name):
            old.unlink()
    shards = plan_shards(tensors, limit)
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    write_json(directory / MODEL_CONFIG, config)
    # safetensors creates its files readable by their owner alone; a model is read by other users' processes
    # (serving, evaluation), so the shards get the mode this umask gives config.json
    mode = stat.S_IMODE((directory / MODEL_CONFIG).stat().st_mode)
    for file, shard in zip(names, shards):
        # One shard at a time on the CPU: memory beyond the model is bounded by max_shard_size.
        save_file({n: tensors[n].detach().to("cpu").contiguous() for n in shard}, str(directory / file),
                  metadata={"format": "pt"})
        os.chmod(directory / file, mode)
        fsync_file(directory / file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {n: file for file, shard in zip(names, shards) for n in shard}}
        write_json(directory / INDEX_FILE, index)


# ------------------------------------------------------------------ atomic publishing

def _is_model_file(name: str) -> bool:
    """What `save_pretrained` writes anew; an earlier directory's other files are kept."""
    return name in (MODEL_CONFIG, GENERATION_CONFIG, SINGLE_FILE, INDEX_FILE) or bool(_SHARD_RE.match(name))


def publish_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Build the directory `path` by calling `write(staging)` on a hidden staging sibling (same file system),
    fsync every file and directory, and publish it in its place (`durable.publish_dir`); return the path
    published (a link's target).

    A `path` holding files is rebuilt: the staging directory starts with its files (hard links, else copies)
    except the model files, which `write` writes anew (as new files: `durable.write_new_file`), so a carried
    file is never written through. A crash leaves the old directory or the new one; where the file system
    cannot swap two directories in one step, the old one is renamed aside first, and if a crash falls between
    the two renames the next save to `path` puts it back. A failure removes the staging directory; the next
    save removes what a killed one left. Concurrent saves to one path are not supported.
    """
    final = Path(path).resolve()
    if final.exists() and not final.is_dir():
        raise FwError(f"{path}: exists and is not a directory; expected a model directory or a new path")
    if final.exists() and Path.cwd().resolve().is_relative_to(final):
        raise FwError(f"{path}: the working directory (or one above it), which the save would replace; "
                      "choose another directory")
    final.parent.mkdir(parents=True, exist_ok=True)
    recover_leftovers(final)
    staging = hidden_sibling(final, "staging")
    try:
        if final.is_dir():
            shutil.copytree(final, staging, symlinks=True, copy_function=link_or_copy,
                            ignore=lambda d, names: [n for n in names if Path(d) == final and _is_model_file(n)])
        else:
            staging.mkdir()
        write(staging)
        fsync_tree(staging)
        publish_dir(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def recover_leftovers(final: Path) -> None:
    """Undo what a killed save of `final` left beside it: put back the old directory it had set aside when
    `final` is missing, and delete the other hidden siblings of `final` whose process is gone."""
    dead = [(entry, kind) for entry, kind, name in dead_leftovers(final.parent) if name == final.name]
    aside = sorted((e for e, kind in dead if kind == "replaced"), key=lambda e: e.stat().st_mtime)
    if aside and not os.path.lexists(final):
        os.rename(aside[-1], final)
        fsync_dir(final.parent)
    for entry, _ in dead:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        elif os.path.lexists(entry):
            entry.unlink()


def write_json(file: Path, data: dict) -> None:
    """`data` as indented JSON in a new, fsynced file."""
    write_new_file(file, (json.dumps(data, indent=2) + "\n").encode())
