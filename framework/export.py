"""`fw export`: a checkpoint's policy as a Hugging Face model directory.

The checkpoint's `policy/` already is HF layout (config.json, safetensors, tokenizer files), or PEFT's
adapter directory for a LoRA run, so export verifies the checkpoint against its manifest and copies that
directory, publishing it atomically. `merge=True` (`fw export --merge`) turns a LoRA checkpoint into the
merged model: the base is rebuilt from the checkpoint's config.yaml (`model.policy.path`, or the preset
from the seed), the adapters are folded in, and the result is written in HF layout.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from framework.checkpoint import CONFIG_FILE, MANIFEST, checkpoints_dir, find_latest, verify_checkpoint
from framework.checkpoint.files import fsync_dir, hash_and_fsync, hidden_sibling, publish_dir
from framework.errors import FwError
from framework.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

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


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, merge: bool = False) -> str:
    """Verify `checkpoint` (a checkpoint dir, or a run dir = its newest checkpoint) and write its policy to
    `out` in HF layout, loadable by transformers' `AutoModelForCausalLM.from_pretrained` (a LoRA checkpoint:
    PEFT's adapter directory, or with `merge` the merged model). `out` must not exist or be empty.
    Returns `out`."""
    source = resolve_checkpoint(checkpoint)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FwError(f"--out {out}: already exists and is not an empty directory; choose a new one")
    manifest = verify_checkpoint(source)
    if POLICY not in manifest["components"]:
        raise FwError(f"{source}: the checkpoint holds no {POLICY}/ component")
    files = [rel.split("/", 1)[1] for rel in manifest["files"] if rel.startswith(POLICY + "/")]
    if merge and ADAPTER_CONFIG not in files:
        raise FwError(f"--merge: {source} holds a full model, not LoRA adapters (no {POLICY}/{ADAPTER_CONFIG}); "
                      "export it without --merge")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = hidden_sibling(out, "staging")
    staging.mkdir()
    try:
        if merge:
            _write_merged(source, staging)
            files = [f for f in files if f not in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]   # the tokenizer's
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


def _write_merged(source: Path, out: Path) -> None:
    """The merged policy of LoRA checkpoint `source` as config.json + safetensors in `out`."""
    from safetensors.torch import load_file

    from framework.config import load_config
    from framework.models import build_policy, save_pretrained
    from framework.models.lora import check_adapter_config, merged_copy, peft_targets
    from framework.models.qwen3 import load_targets
    from framework.tokenizer import Tokenizer, build_tokenizer

    cfg = load_config([str(source / CONFIG_FILE)])
    lora = cfg["model"]["policy"]["lora"]
    if lora is None:
        raise FwError(f"{source / CONFIG_FILE}: model.policy.lora is null, but {POLICY}/ holds adapters")
    check_adapter_config(json.loads((source / POLICY / ADAPTER_CONFIG).read_text()), lora,
                         str(source / POLICY / ADAPTER_CONFIG))
    policy_dir = source / POLICY
    # The vocabulary of a preset comes from the tokenizer the run trained with, which policy/ carries.
    tokenizer = Tokenizer.from_pretrained(policy_dir) if (policy_dir / "tokenizer.json").is_file() \
        else build_tokenizer(cfg)
    model_cfg = {**cfg["model"]["policy"], "compile": False, "gradient_checkpointing": False}
    policy = build_policy(model_cfg, tokenizer, seed=cfg["seed"])
    load_targets(peft_targets(policy), load_file(str(policy_dir / ADAPTER_WEIGHTS)),
                 source=str(policy_dir / ADAPTER_WEIGHTS))
    save_pretrained(merged_copy(policy), out)
