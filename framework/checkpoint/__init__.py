"""Atomic checkpoint directories: write, publish, discover, verify, prune, and the checkpoint callback.

A checkpoint is a directory `<run_dir>/checkpoints/step-000123/`:

    manifest.json        format version, step, policy version, config hash, every file's size and sha256
    policy/              HF layout: config.json + model.safetensors or shards + index (+ files like tokenizer.json)
    value/               the PPO critic, same layout (only when present)
    trainer_state.pt     the rest of Lightning's checkpoint dict (optimizers, schedulers, loops, callbacks, ...),
                         its tensors replaced by `TensorRef` names
    trainer_state.safetensors (or -00001-of-0000N shards)  those tensors (optimizer moments, ...)
    config.yaml          the resolved config
    generation_config.json  the one of the model directory the run started from, as it was then (only when that
                         directory has one); `fw export` writes it with the model

It is built in a hidden staging sibling, every file and directory fsynced, then published by one rename
(or, when the step already exists, one `renameat2(RENAME_EXCHANGE)` swap), and the parent fsynced. A
crash at any moment leaves either the old state or the new one plus hidden leftovers that discovery
ignores and `clean_leftovers` removes (without RENAME_EXCHANGE a replace is two renames, and `recover`,
called by `find_latest`, undoes a crash between them). A directory counts as complete when its manifest
parses and every file it lists exists with the listed size; a `step-*` directory that is not is damaged,
and `find_latest` says so rather than pass over it (unless asked to skip it). Tensor files are hashed while
they are written, several at a time; loads check sizes always and (`checkpoint.verify`) every sha256,
hashing while the files are read.

Modules: `tensors` (safetensors written and read, the trainer state's tensors), `directory` (one checkpoint
directory), `store` (a run's checkpoints), `resume` (what a resume may change), `lightning_io` (the CheckpointIO
plugin and the checkpoint callback); durable file operations are `framework.durable`'s.
"""

from framework.checkpoint.directory import (
    CONFIG_FILE,
    FORMAT,
    FORMAT_VERSION,
    HF_CONFIG_FILE,
    MANIFEST,
    TRAINER_STATE,
    config_sha256,
    is_complete,
    read_checkpoint_dir,
    read_manifest,
    verify_checkpoint,
    write_checkpoint_dir,
)
from framework.checkpoint.store import (
    checkpoints_dir,
    clean_leftovers,
    damage,
    find_latest,
    in_run_dir,
    list_checkpoints,
    pin_resume,
    prune,
    read_resolved,
    recover,
    refuse_existing_checkpoints,
    refuse_missing_run_dir,
    resolve_checkpoint,
    resolve_resume,
    resume_refusal,
    run_of_checkpoints_folder,
    step_dir_name,
    step_dirs,
)
from framework.durable import exchange_supported, fsync_dir, hash_and_fsync, hidden_sibling, publish_dir


def __getattr__(name: str) -> object:
    # the Lightning glue imports Lightning (seconds): only when asked for, so `fw generate` and `fw export`
    # start without it
    if name in ("AtomicCheckpointIO", "CheckpointCallback"):
        from framework.checkpoint import lightning_io

        return getattr(lightning_io, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "HF_CONFIG_FILE",
    "MANIFEST",
    "TRAINER_STATE",
    "AtomicCheckpointIO",
    "CheckpointCallback",
    "checkpoints_dir",
    "clean_leftovers",
    "config_sha256",
    "damage",
    "exchange_supported",
    "find_latest",
    "fsync_dir",
    "hash_and_fsync",
    "hidden_sibling",
    "in_run_dir",
    "is_complete",
    "list_checkpoints",
    "pin_resume",
    "prune",
    "publish_dir",
    "read_checkpoint_dir",
    "read_manifest",
    "read_resolved",
    "recover",
    "refuse_existing_checkpoints",
    "refuse_missing_run_dir",
    "resolve_checkpoint",
    "resolve_resume",
    "resume_refusal",
    "run_of_checkpoints_folder",
    "step_dir_name",
    "step_dirs",
    "verify_checkpoint",
    "write_checkpoint_dir",
]
