"""What a resume may change: one rule per config key, the check of a new config against the checkpoint's
own `config.yaml`, and the optimizer settings put back from the config after Lightning restores the old.

A key's rule is one of
- APPLIES: read afresh from the config whenever it is used, so the new value simply takes effect;
- RESET: Lightning restores it from the checkpoint (optimizer param_groups, LambdaLR's base_lrs), so
  `reset_optimizers` sets it again from the config right after the restore;
- REFUSED: the checkpoint's state depends on it (shapes, data stream, recipe, ...): a resume with another
  value stops before anything runs, naming the key.
The run's `config.yaml` is the new config, so it always records what runs.

A REFUSED key whose value is a path (`data.path`, `model.policy.path`, ...) depends on what the path holds,
not on its spelling: each checkpoint's manifest records, under "sources", the size and sha256 of every file
such a path named when it was written (`source_fingerprints`), so a resume accepts the same content at
another path (a moved project, a per-job scratch copy, another cache home) and refuses other content, at
another path, and for `data.path` at the same one too (a data file rewritten in place).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from framework.checkpoint.directory import CONFIG_FILE, read_manifest
from framework.durable import sha256
from framework.errors import FwError
from framework.yaml12 import inline as shown

APPLIES, RESET, REFUSED = "applies", "reset", "refused"

# key -> (rule, why); `why` is the reason given when a refused key changes
RESUME_RULES: dict[str, tuple[str, str]] = {
    "recipe": (REFUSED, "the checkpoint holds this recipe's state"),
    "seed": (REFUSED, "it seeds the data order and the rollouts of the run being continued"),
    "name": (APPLIES, "the loggers' run name"),
    "run_dir": (APPLIES, "where the run writes from now on"),
    "model.policy.path": (REFUSED, "the weights and their shapes come from the checkpoint"),
    "model.policy.preset": (REFUSED, "the weights and their shapes come from the checkpoint"),
    "model.policy.dtype": (REFUSED, "the checkpoint's weights and optimizer state have their dtype"),
    "model.policy.gradient_checkpointing": (APPLIES, "recomputation only, the same numbers"),
    "model.policy.keep_logits": (APPLIES, "a memory setting of the forward pass"),
    "model.policy.lora": (REFUSED, "the checkpoint holds a full model where it is null, LoRA adapters where set"),
    "model.policy.lora.rank": (REFUSED, "the adapters' shapes are in the checkpoint"),
    "model.policy.lora.alpha": (REFUSED, "the adapters were trained with this scale"),
    "model.policy.lora.dropout": (REFUSED, "part of the adapter setup the checkpoint was trained with"),
    "model.policy.lora.targets": (REFUSED, "the adapters in the checkpoint sit on these modules"),
    "model.policy.compile": (APPLIES, "how the same model runs"),
    "model.value.path": (REFUSED, "the critic's weights come from the checkpoint"),
    "model.reference.path": (APPLIES, "the reference model is never saved; it is rebuilt from this path"),
    "tokenizer.path": (REFUSED, "the model was trained with the checkpoint's tokenizer"),
    "tokenizer.enable_thinking": (REFUSED, "it changes how the data stream renders prompts"),
    "data.path": (REFUSED, "the saved data position indexes this data"),
    "data.task": (REFUSED, "the saved data position indexes this task's prompts"),
    "data.task.name": (REFUSED, "the saved data position indexes this task's prompts"),
    "data.task.class_path": (REFUSED, "the saved data position indexes this task's prompts"),
    "data.task.init_args": (REFUSED, "the saved data position indexes this task's prompts"),
    "data.format": (REFUSED, "the saved data position indexes the examples read this way"),
    "data.prompt_key": (REFUSED, "the saved data position indexes the examples read this way"),
    "data.answer_key": (REFUSED, "the saved data position indexes the examples read this way"),
    "data.chat_template": (REFUSED, "it changes the examples of the data stream being continued"),
    "data.max_seq_len": (REFUSED, "it changes the examples (truncation) and batches of the data stream"),
    "data.pack": (REFUSED, "it changes the batches of the data stream being continued"),
    "data.batch_size": (APPLIES, "the position counts examples, so batches of another size continue it"),
    "data.shuffle": (REFUSED, "the saved data position indexes this order"),
    "rollout.prompts_per_step": (APPLIES, "the position counts prompts, so batches of another size continue it"),
    "rollout.max_new_tokens": (APPLIES, "a sampling setting read at every rollout"),
    "rollout.temperature": (APPLIES, "a sampling setting read at every rollout"),
    "rollout.top_k": (APPLIES, "a sampling setting read at every rollout"),
    "rollout.top_p": (APPLIES, "a sampling setting read at every rollout"),
    "rollout.min_p": (APPLIES, "a sampling setting read at every rollout"),
    "rollout.stop": (APPLIES, "a sampling setting read at every rollout"),
    "rollout.kv_cache_gib": (APPLIES, "sizes the KV pool of each rollout; the tokens do not depend on it"),
    "rollout.max_num_seqs": (APPLIES, "rows decoding together; the tokens do not depend on it"),
    "rollout.block_size": (APPLIES, "the KV pool's block size; the tokens do not depend on it"),
    "rollout.kv_cache_dtype": (APPLIES, "the KV pool's dtype, read at every rollout, as a sampling setting is"),
    "rollout.admit_batch": (APPLIES, "how many waiting rows join at once; the tokens do not depend on it"),
    "rollout.keep_engine": (APPLIES, "whether the KV pool outlives a rollout; the tokens do not depend on it"),
    "reward.name": (APPLIES, "the reward is built from the config"),
    "reward.class_path": (APPLIES, "the reward is built from the config"),
    "reward.init_args": (APPLIES, "the reward is built from the config"),
    "reward.on_error": (APPLIES, "the reward is built from the config"),
    "reward.timeout_s": (APPLIES, "read at every reward call"),
    "reward.max_error_fraction": (APPLIES, "read at every rollout batch"),
    "sft.train_on_prompt": (APPLIES, "the loss mask is made for each batch"),
    "grpo.group_size": (REFUSED, "the rollouts of the run being continued are drawn in groups of this size"),
    "grpo.scale_rewards": (APPLIES, "a loss setting read at every step"),
    "grpo.adv_eps": (APPLIES, "a loss setting read at every step"),
    "grpo.clip_eps_low": (APPLIES, "a loss setting read at every step"),
    "grpo.clip_eps_high": (APPLIES, "a loss setting read at every step"),
    "grpo.clip_ratio_c": (APPLIES, "a loss setting read at every step"),
    "grpo.kl_coef": (APPLIES, "a loss setting; the reference model is rebuilt, never saved"),
    "grpo.kl_estimator": (APPLIES, "a loss setting read at every step"),
    "grpo.loss_agg": (APPLIES, "a loss setting read at every step"),
    "grpo.policy_loss": (APPLIES, "a loss setting read at every step"),
    "grpo.epochs": (APPLIES, "updates per rollout batch"),
    "grpo.minibatches": (APPLIES, "updates per rollout batch"),
    "grpo.off_policy_correction.name": (APPLIES, "a loss setting read at every step"),
    "grpo.off_policy_correction.cap": (APPLIES, "a loss setting read at every step"),
    "grpo.off_policy_correction.low": (APPLIES, "a loss setting read at every step"),
    "grpo.off_policy_correction.high": (APPLIES, "a loss setting read at every step"),
    "grpo.off_policy_correction.level": (APPLIES, "a loss setting read at every step"),
    "grpo.overlong.mask_truncated": (APPLIES, "a loss and reward-shaping setting read at every step"),
    "grpo.overlong.buffer": (APPLIES, "a loss and reward-shaping setting read at every step"),
    "grpo.overlong.penalty_factor": (APPLIES, "a loss and reward-shaping setting read at every step"),
    "grpo.dynamic_sampling": (APPLIES, "read at every step; the prompt position continues either way"),
    "grpo.dynamic_sampling_max_rounds": (APPLIES, "read at every step; the prompt position continues either way"),
    "grpo.shared_prompt": (APPLIES, "the update's layout and its cut into micro-batches, read at every step"),
    "ppo.samples_per_prompt": (REFUSED, "the rollouts of the run being continued are drawn this many per prompt"),
    "ppo.gamma": (APPLIES, "a loss setting read at every step"),
    "ppo.lam": (APPLIES, "a loss setting read at every step"),
    "ppo.kl_coef": (APPLIES, "a loss setting; the reference model is rebuilt, never saved"),
    "ppo.kl_estimator": (APPLIES, "a loss setting read at every step"),
    "ppo.whiten_advantages": (APPLIES, "a loss setting read at every step"),
    "ppo.clip_eps_low": (APPLIES, "a loss setting read at every step"),
    "ppo.clip_eps_high": (APPLIES, "a loss setting read at every step"),
    "ppo.clip_ratio_c": (APPLIES, "a loss setting read at every step"),
    "ppo.value_clip": (APPLIES, "a loss setting read at every step"),
    "ppo.vf_coef": (APPLIES, "a loss setting read at every step"),
    "ppo.loss_agg": (APPLIES, "a loss setting read at every step"),
    "ppo.policy_loss": (APPLIES, "a loss setting read at every step"),
    "ppo.epochs": (APPLIES, "updates per rollout batch"),
    "ppo.minibatches": (APPLIES, "updates per rollout batch"),
    "ppo.shared_prompt": (APPLIES, "the update's layout and its cut into micro-batches, read at every step"),
    "ppo.off_policy_correction.name": (APPLIES, "a loss setting read at every step"),
    "ppo.off_policy_correction.cap": (APPLIES, "a loss setting read at every step"),
    "ppo.off_policy_correction.low": (APPLIES, "a loss setting read at every step"),
    "ppo.off_policy_correction.high": (APPLIES, "a loss setting read at every step"),
    "ppo.off_policy_correction.level": (APPLIES, "a loss setting read at every step"),
    "ppo.overlong.mask_truncated": (APPLIES, "a loss and reward-shaping setting read at every step"),
    "ppo.overlong.buffer": (APPLIES, "a loss and reward-shaping setting read at every step"),
    "ppo.overlong.penalty_factor": (APPLIES, "a loss and reward-shaping setting read at every step"),
    "ppo.critic.lr": (RESET, "set on the critic optimizer after the restore"),
    "ppo.critic.weight_decay": (RESET, "set on the critic optimizer after the restore"),
    "ppo.critic.max_grad_norm": (APPLIES, "read at every critic step"),
    "optimizer.name": (REFUSED, "the checkpoint holds this optimizer's state"),
    "optimizer.lr": (RESET, "set on the policy optimizer and its schedule after the restore"),
    "optimizer.betas": (RESET, "set on every optimizer after the restore"),
    "optimizer.eps": (RESET, "set on every optimizer after the restore"),
    "optimizer.weight_decay": (RESET, "set on the policy optimizer after the restore"),
    "optimizer.max_grad_norm": (APPLIES, "read at every policy step"),
    "optimizer.fused": (REFUSED, "it selects the kernel of the optimizer the checkpoint restores"),
    "optimizer.stochastic_rounding": (REFUSED, "it changes the optimizer whose state the checkpoint holds"),
    "optimizer.cpu_offload": (REFUSED, "it changes the optimizer whose state the checkpoint holds"),
    "scheduler.name": (RESET, "the schedule is rebuilt from the config and the lr set after the restore"),
    "scheduler.warmup_steps": (RESET, "the schedule is rebuilt from the config and the lr set after the restore"),
    "scheduler.min_lr_ratio": (RESET, "the schedule is rebuilt from the config and the lr set after the restore"),
    "trainer.accelerator": (APPLIES, "the state loads onto any device"),
    "trainer.devices": (APPLIES, "the data position is global (README: resume on another number of processes)"),
    "trainer.num_nodes": (APPLIES, "the data position is global (README: resume on another number of processes)"),
    "trainer.strategy": (APPLIES, "the state loads under any supported strategy"),
    "trainer.precision": (REFUSED, "the weights and optimizer state were kept in this precision"),
    "trainer.max_steps": (APPLIES, "the run continues to the new count (the schedule's length too)"),
    "trainer.accumulate_grad_batches": (REFUSED, "Lightning counts its windows from the restored batch index"),
    "trainer.log_every_n_steps": (APPLIES, "logging cadence"),
    "trainer.enable_progress_bar": (APPLIES, "display only"),
    "trainer.memory_limit_gib": (APPLIES, "the memory plan is checked at every start"),
    "trainer.stop_grace_s": (APPLIES, "read when a signal arrives"),
    "checkpoint.every_n_steps": (APPLIES, "checkpoint cadence"),
    "checkpoint.keep_last": (APPLIES, "pruning"),
    "checkpoint.verify": (APPLIES, "how checkpoints are read"),
    "eval.every_n_steps": (APPLIES, "evaluation cadence"),
    "eval.at_start": (APPLIES, "a fresh run's baseline; a resumed run has its own already"),
    "eval.path": (APPLIES, "evaluation reads the weights and never the training state"),
    "eval.held_out": (APPLIES, "evaluation reads the weights and never the training state"),
    "eval.seed": (APPLIES, "evaluation reads the weights and never the training state"),
    "eval.max_prompts": (APPLIES, "evaluation reads the weights and never the training state"),
    "eval.samples_per_prompt": (APPLIES, "evaluation reads the weights and never the training state"),
    "eval.temperature": (APPLIES, "evaluation reads the weights and never the training state"),
    "eval.max_new_tokens": (APPLIES, "evaluation reads the weights and never the training state"),
    "logging.csv": (APPLIES, "loggers"),
    "logging.tensorboard": (APPLIES, "loggers"),
    "logging.loggers": (APPLIES, "loggers"),
    "callbacks": (APPLIES, "callbacks are built from the config"),
}

_ABSENT = object()


def _schema_leaves(node: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf key -> its schema node (a leaf: no `properties`, e.g. a free-form `init_args`)."""
    out = {}
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        if "properties" in sub:
            out.update(_schema_leaves(sub, path + "."))
        else:
            out[path] = sub
    return out


def _value(cfg: dict, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _null_above(old: dict, new: dict, key: str) -> str | None:
    """The dotted key of the object above `key` that is null in one config and set in the other (a nullable
    section such as `model.policy.lora`), or None."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        above = ".".join(parts[:i])
        a, b = _value(old, above), _value(new, above)
        if a is not _ABSENT and b is not _ABSENT and (a is None) != (b is None):
            return above
    return None


def config_changes(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every schema key whose value differs, in schema order. A key the old
    config lacks (a section of another recipe, or a key the schema gained) counts as its default. A nullable
    section set in one config and null in the other is one change, of the section's key: the keys under a null
    one have no value, not their defaults."""
    from framework.config import schema_text

    changes = []
    for key, node in _schema_leaves(json.loads(schema_text())).items():
        above = _null_above(old, new, key)
        if above is not None:
            if above not in [k for k, _, _ in changes]:
                changes.append((above, _value(old, above), _value(new, above)))
            continue
        a, b = _value(old, key), _value(new, key)
        if a is _ABSENT and b is not _ABSENT:
            a = node.get("default", _ABSENT)
        if a != b and b is not _ABSENT:
            changes.append((key, a, b))
    return changes


def check_resume_config(checkpoint: str | os.PathLike, cfg: dict) -> list[tuple[str, Any, Any]]:
    """Compare `cfg` with the checkpoint's config.yaml: FwError naming every changed key that a resume cannot
    apply; else the changes that apply, for the caller to report. A refused path key whose new path holds what
    the checkpoint recorded for it (`source_fingerprints`) is a move: said on stderr, not refused; an unchanged
    `data.path` (and under LoRA `model.policy.path`: `in_place_keys`) that holds other content than recorded is
    refused."""
    from framework.config import load_config

    file = Path(checkpoint) / CONFIG_FILE
    old = load_config([str(file)], imports=())   # the new config's modules are the ones this run imports
    changes = config_changes(old, cfg)
    unclassified = [key for key, _, _ in changes if key not in RESUME_RULES]
    if unclassified:   # tests/test_resume.py keeps the table complete; this guards a plugin's schema edit
        raise FwError(f"--resume: config key {unclassified[0]} has no resume rule in framework/checkpoint/resume.py")
    recorded = read_manifest(checkpoint).get("sources") or {}
    movable = set(moved_path_keys())
    refused, moved = [], []
    for k, a, b in changes:
        if RESUME_RULES[k][0] != REFUSED:
            continue
        why = RESUME_RULES[k][1]
        if k in movable and a is not None and b is not None:
            problem = move_problem(k, a, b, recorded.get(k))
            if problem is None:
                moved.append((k, a, b))
                continue
            why = f"{why}; {problem}"
        refused.append((k, f"{k} changed from {shown(a)} to {shown(b)} ({why})"))
    changed = {k for k, _, _ in changes}
    in_place = []
    for k in in_place_keys(cfg):
        if k not in changed:
            in_place += _changed_in_place(k, _value(cfg, k), recorded.get(k))
    refused += in_place
    if any(k == "recipe" for k, _ in refused):   # the other recipe's sections and defaults differ as a consequence
        refused = [(k, text) for k, text in refused if k == "recipe"]
    if refused:
        # a value that changed goes back to the checkpoint's; a file rewritten under its unchanged path has its
        # content put back instead, since its value is the checkpoint's already
        rewritten = [k for k, _ in in_place if any(k == key for key, _ in refused)]
        fixes = ([f"keep the value of {file}"] if len(refused) > len(rewritten) else []) + [
            f"put back what {k} {shown(_value(cfg, k))} held when the checkpoint was written" for k in rewritten]
        raise FwError(f"--resume {checkpoint}: a resume cannot apply: {'; '.join(text for _, text in refused)}; "
                      f"{', '.join(fixes)} or start a new run_dir")
    for k, a, b in moved:
        say_moved(k, a, b, "resuming with it")
    return [change for change in changes if change[0] not in {k for k, _, _ in moved}]


def say_moved(key: str, was: Any, now: Any, doing: str) -> None:
    """Say on stderr, on the first rank only, that path key `key` moved from `was` to `now`, which holds what the
    checkpoint recorded (a verified move), and that `doing` goes on with it."""
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
        print(f"fw: {key} moved from {shown(was)} to {shown(now)}, which holds the same content (size and sha256 of "
              f"every file); {doing}", file=sys.stderr)


# the path keys whose content is checked against the checkpoint's record even when the path is unchanged: the
# saved position indexes the data as it was. A model or tokenizer directory may change in place (a resumed run
# keeps the generation config it started from, and the weights come from the checkpoint), except the base model
# of LoRA adapters (`in_place_keys`), whose weights the checkpoint does not hold.
IN_PLACE_KEYS = ("data.path",)


# why an in-place change of a key is refused, where its resume rule's reason is about another change
_IN_PLACE_WHY = {"model.policy.path": "the checkpoint's LoRA adapters were trained on this frozen base model"}


def in_place_keys(cfg: dict) -> tuple[str, ...]:
    """The path keys of `cfg` whose content a resume checks even at an unchanged path: `IN_PLACE_KEYS`, and under
    LoRA `model.policy.path`, the frozen base that the adapters were trained on."""
    return IN_PLACE_KEYS + (("model.policy.path",) if cfg["model"]["policy"]["lora"] is not None else ())


def _changed_in_place(key: str, value: Any, recorded: Any) -> list[tuple[str, str]]:
    """[(key, why)] when path key `key`, spelled as in the checkpoint's config, holds other content than the
    checkpoint `recorded` for it (a data file rewritten in place);
    [] when it holds the same, has no record, or cannot be read (what reads it names it then)."""
    if value is None or value is _ABSENT or recorded is None:
        return []
    paths, wanted = (v if isinstance(v, list) else [v] for v in (value, recorded))
    if len(paths) != len(wanted):
        return []
    for path, want in zip(paths, wanted):
        try:
            path_fingerprint(path)
        except OSError:
            return []
        problem = _differs(want, path, weights=key == "model.policy.path")
        if problem is not None:
            why = f"{_IN_PLACE_WHY.get(key, RESUME_RULES[key][1])}; {problem} from what the checkpoint recorded"
            return [(key, f"{key} {shown(value)} holds other content than when the checkpoint was written ({why})")]
    return []


def moved_path_keys() -> list[str]:
    """The REFUSED keys whose value is a path (`"format": "path"` in the schema): a resume compares what they
    hold, not how they are spelled."""
    from framework.config import path_keys

    paths = {".".join(keys) for keys in path_keys()}
    return [key for key, (rule, _) in RESUME_RULES.items() if rule == REFUSED and key in paths]


# path -> (what its files were on disk when hashed, its fingerprint): a run hashes its data and model files
# once, not at every checkpoint, and a checkpoint written after they are gone still records what they held
_FINGERPRINTS: dict[str, tuple[list[tuple], dict]] = {}


def _files_of(path: Path) -> list[Path]:
    """The files whose content a path key names: the file itself, or a directory's top-level regular files
    (hidden ones left out: caches, staging leftovers)."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_file())
    if path.is_file():
        return [path]
    raise FileNotFoundError(2, "No such file or directory", str(path))


def path_fingerprint(path: str | os.PathLike, remembered: bool = False) -> dict:
    """What `path` holds: a file as {"size", "sha256"}, a directory as {"files": {name: {"size", "sha256"}}}
    of its top-level files. The whole of each file is hashed (about 1 s per GB on one core), once per process
    while the files stay as they are. OSError when the path cannot be read, unless `remembered` and this
    process hashed it before: then what it held then."""
    path = Path(path)
    key = str(path.absolute())
    try:
        single = path.is_file()
        files = _files_of(path)
        signature = [(f.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()]]
    except OSError:
        if remembered and key in _FINGERPRINTS:
            return _FINGERPRINTS[key][1]
        raise
    cached = _FINGERPRINTS.get(key)
    if cached is not None and cached[0] == signature:
        return cached[1]
    sums = {f.name: {"size": size, "sha256": sha256(f)} for f, (_, _, _, size, _) in zip(files, signature)}
    found = next(iter(sums.values())) if single else {"files": sums}
    _FINGERPRINTS[key] = (signature, found)
    return found


def source_fingerprints(cfg: dict) -> dict[str, Any]:
    """{key: fingerprint} of every `moved_path_keys` key that `cfg` sets (a list of paths: a list of
    fingerprints), for the manifest's "sources"; a path that cannot be read is left out (a resume from this
    checkpoint then refuses a change of that key, as it refuses any change of a key without a record)."""
    out: dict[str, Any] = {}
    for key in moved_path_keys():
        value = _value(cfg, key)
        if value is None or value is _ABSENT:
            continue
        try:
            out[key] = ([path_fingerprint(v, remembered=True) for v in value] if isinstance(value, list)
                        else path_fingerprint(value, remembered=True))
        except OSError:
            continue
    return out


def move_problem(key: str, old: Any, new: Any, recorded: Any) -> str | None:
    """None when `new` (a path or a list of paths) holds what the checkpoint `recorded` for `key`, or, for a
    checkpoint without a record, what `old` holds now; else why the change counts as another content."""
    olds, news = (v if isinstance(v, list) else [v] for v in (old, new))
    if len(olds) != len(news):
        return "another number of files"
    if recorded is not None:
        wanted = recorded if isinstance(recorded, list) else [recorded]
        if len(wanted) != len(news):
            return "another number of files"
        for want, path in zip(wanted, news):
            problem = _differs(want, path)
            if problem is not None:
                return f"{problem} from what the checkpoint recorded"
        return None
    for was, path in zip(olds, news):
        try:
            want = path_fingerprint(was)
        except OSError:
            return (f"the checkpoint records no fingerprint of what {was} held and it is gone, so the move cannot be "
                    f"checked: restore {was} (a symlink to {path} will do) and set {key} to {shown(old)} again")
        problem = _differs(want, path)
        if problem is not None:
            return f"{problem} from what {was} holds now"
    return None


def recorded_move_problem(manifest: dict, key: str, old: Any, new: Any) -> str | None:
    """`move_problem` of `key` set to `new` in place of `old`, its value in the config.yaml of the checkpoint
    whose manifest is `manifest`, against the record of `key`'s files kept there (a checkpoint written before
    such records has none)."""
    return move_problem(key, old, new, (manifest.get("sources") or {}).get(key))


def base_changed_in_place(manifest: dict, path: str) -> str | None:
    """How the LoRA base model directory `path`, where the config.yaml of the checkpoint whose manifest is `manifest`
    names it, differs in its weights from the checkpoint's record of it; None when it does not, or when there is no
    record (a checkpoint written before such records) or no directory to read (its loader names what is missing)."""
    recorded = (manifest.get("sources") or {}).get("model.policy.path")
    if not isinstance(recorded, dict) or not Path(path).is_dir():
        return None
    problem = _differs(recorded, path, weights=True)
    return None if problem is None else f"{problem} from what the checkpoint recorded"


def _weights(fingerprint: dict) -> dict:
    """The part of a model directory's fingerprint that decides its weights: config.json and the safetensors files
    with their index (a generation config, a tokenizer or a README may change: the checkpoint keeps its own)."""
    files = fingerprint.get("files")
    if not isinstance(files, dict):
        return fingerprint
    return {"files": {name: f for name, f in files.items()
                      if name == "config.json" or name.endswith((".safetensors", ".safetensors.index.json"))}}


def _differs(want: dict, path: str, weights: bool = False) -> str | None:
    """How what `path` holds differs from fingerprint `want`, or None when it is the same; `weights`: in the files
    that decide a model directory's weights alone."""
    try:
        have = path_fingerprint(path)
    except OSError as e:
        return f"{path} cannot be read ({e.strerror})"
    if weights:
        want, have = _weights(want), _weights(have)
    if have == want:
        return None
    if "files" in want and "files" in have:
        names = sorted(set(want["files"]) ^ set(have["files"]))
        if names:
            return f"{path} holds other files ({', '.join(names)})"
        changed = sorted(n for n in want["files"] if want["files"][n] != have["files"][n])
        return f"{Path(path) / changed[0]} differs in content"
    return f"{path} differs in content"


def reset_optimizers(module: Any) -> None:
    """After Lightning restored optimizer and scheduler states, set every optimizer role's hyperparameters
    (lr, weight_decay, betas, eps) from the config, and the schedule's base_lrs and current lr.

    Each group's values come from `framework.optim` (its groups and hyperparameters), so the reset follows
    what the optimizer is built with; nothing is allocated. torchao keeps some values as tensors, which are
    filled in place."""
    from framework.optim import hyperparameters, param_groups

    trainer = module.trainer
    for role in module.requirements.optimizers:
        optimizer = module._optimizer_of[role.name]
        model = module.policy if role.model == "policy" else module.value
        settings = module._settings[role.name]
        groups = param_groups(model, settings)
        values = [{k: v for k, v in g.items() if k != "params"} | hyperparameters(settings, module.cfg)
                  for g in groups]
        fresh = [values[i] for i in _config_group_of(optimizer, groups, role.name)]
        for group, new in zip(optimizer.param_groups, fresh):
            for key, value in new.items():
                _set(group, key, value)
            if "initial_lr" in group:
                _set(group, "initial_lr", new["lr"])
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if scheduler.optimizer is not optimizer:
                continue
            # as the scheduler's own constructor takes them: the groups' initial_lr (a tensor's copy where
            # torchao keeps lr as a tensor), so a resumed schedule computes in the same dtype as a fresh one
            scheduler.base_lrs = [_copy(g["initial_lr"]) if "initial_lr" in g else new["lr"]
                                  for g, new in zip(optimizer.param_groups, fresh)]
            if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                step = scheduler.last_epoch
                lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
                for group, lr in zip(optimizer.param_groups, lrs):
                    _set(group, "lr", lr)
                scheduler._last_lr = lrs


def _config_group_of(optimizer: Any, groups: list[dict], role: str) -> list[int]:
    """For each of the optimizer's parameter groups, the index of the config group its parameters come from.

    torchao's CPU-offloaded optimizer has one group per large parameter (holding its host copy) beside the
    on-device groups of the small ones, so groups are matched by their parameters rather than by position."""
    index = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    for device_param, host_param in getattr(optimizer, "param_d2h_map", {}).items():
        if id(device_param) in index:
            index[id(host_param)] = index[id(device_param)]
    found = []
    for group in optimizer.param_groups:
        i = {index.get(id(p)) for p in group["params"]}
        if len(i) != 1 or None in i:
            raise FwError(f"--resume: the {role} optimizer's parameter groups do not match the config's "
                          f"({len(optimizer.param_groups)} in the optimizer, {len(groups)} by the config)")
        found.append(i.pop())
    return found


def _set(group: dict, key: str, value: Any) -> None:
    """group[key] = value, in place when the optimizer keeps that value as a tensor (torchao's lr)."""
    if isinstance(group.get(key), torch.Tensor):
        group[key].fill_(value)
    else:
        group[key] = value


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
