"""Hugging Face checkpoint directories in and out: config.json + safetensors (sharded with an index).

Loading builds the model on the meta device, allocates it once in the requested dtype and streams
the shards in tensor by tensor (`safe_open`), so no second full copy of the weights is ever held.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from framework.errors import FwError
from framework.models.qwen3 import HfTargets, Qwen3ForCausalLM, check_tied_head, copy_into
from framework.models.qwen3_config import Qwen3Config
from framework.models.value import ARCHITECTURE as VALUE_ARCHITECTURE
from framework.models.value import Qwen3ValueModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
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
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FwError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise FwError(f"{file}: invalid JSON: {e}") from None
    return Qwen3Config.from_hf(raw, source=str(file)), raw


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the index, or the single model.safetensors."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise FwError(f"{path / INDEX_FILE}: not a safetensors index ({e})") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
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
    for file in checkpoint_files(path):
        try:   # a truncated or garbled shard: the error names the file, which safetensors' own does not
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    if name in seen:
                        raise FwError(f"{file}: tensor {name} appears in more than one shard")
                    seen.add(name)
                    if tied and name == "lm_head.weight":
                        lm_head = f.get_tensor(name)
                    elif name not in targets:
                        raise FwError(f"{file}: unexpected tensor {name} (not part of this Qwen3 model)")
                    else:
                        copy_into(targets, name, f.get_tensor(name), str(file))
        except SafetensorError as e:
            raise FwError(f"{file}: not a readable safetensors file ({e})") from None
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise FwError(f"{path}: missing tensors {missing[:8]}{more}")
    if lm_head is not None:
        check_tied_head(lm_head, targets["model.embed_tokens.weight"][0], str(path))


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None) -> Qwen3ForCausalLM:
    """The policy from an HF Qwen3 directory, in `dtype` (None = float32) on `device` (None = cpu)."""
    config, raw = read_config(path)
    if VALUE_ARCHITECTURE in (raw.get("architectures") or []):
        raise FwError(f"{path} holds a value model ({VALUE_ARCHITECTURE}); load it with load_value_model")
    model = empty_model(Qwen3ForCausalLM, config, resolve_dtype(dtype), device)
    stream_load(model.hf_targets(), path, tied=config.tie_word_embeddings)
    return model


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


def save_pretrained(model: Qwen3ForCausalLM, path: str | os.PathLike, max_shard_size: int | str = "5GB") -> None:
    """Write HF layout: config.json + model.safetensors, or shards + index when over max_shard_size."""
    config = model.config.to_hf(dtype_name(model.lm_head_weight.dtype))
    write_checkpoint(config, model.hf_state_dict(), path, max_shard_size)


def save_value_model(model: Qwen3ValueModel, path: str | os.PathLike, max_shard_size: int | str = "5GB") -> None:
    """Write a critic: config.json (architectures [Qwen3ValueModel]) + safetensors with v_head.*."""
    config = model.config.to_hf(dtype_name(model.v_head.weight.dtype))
    config["architectures"] = [VALUE_ARCHITECTURE]
    write_checkpoint(config, model.hf_state_dict(), path, max_shard_size)


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



def write_checkpoint(config: dict, tensors: dict[str, Tensor], path: str | os.PathLike,
                     max_shard_size: int | str) -> None:
    """config.json + safetensors shards; earlier model*.safetensors files in `path` are replaced."""
    limit = parse_size(max_shard_size)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in path.iterdir():
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(old.name):
            old.unlink()
    shards = plan_shards(tensors, limit)
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(names, shards):
        # One shard at a time on the CPU: memory beyond the model is bounded by max_shard_size.
        save_file({n: tensors[n].detach().to("cpu").contiguous() for n in shard}, str(path / file),
                  metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {n: file for file, shard in zip(names, shards) for n in shard}}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
