"""``fw generate``: one completion from a config's policy or from a checkpoint, to sanity-check a model."""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from framework.checkpoint import CONFIG_FILE
from framework.checkpoint.directory import Verifier, component_weight_files, read_complete_manifest, verifying
from framework.checkpoint.tensors import check_header
from framework.errors import ConfigError, FwError, Problem

if TYPE_CHECKING:
    from framework.rollout import SamplingParams

POLICY = "policy"


def _device(cfg: dict) -> torch.device:
    accelerator = cfg["trainer"]["accelerator"]
    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def autocast_context(cfg: dict, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast training used (`trainer.precision` *-mixed on CUDA), for `fw eval` and `fw generate` outside
    Lightning."""
    precision = cfg["trainer"]["precision"]
    if device.type == "cuda" and precision in ("bf16-mixed", "16-mixed"):
        return torch.autocast("cuda", dtype=torch.bfloat16 if precision == "bf16-mixed" else torch.float16)
    return contextlib.nullcontext()


def run_config(cfg: dict | None, checkpoint: str | os.PathLike | None, overrides: list[str] | None = None) -> dict:
    """The config to generate with: ``cfg``, else the ``config.yaml`` of ``checkpoint`` (a checkpoint
    directory, as ``resolve_checkpoint`` returns it) with ``overrides`` (``--a.b=v``) on top."""
    if checkpoint is None:
        if cfg is None:
            raise FwError("fw generate needs a config or a checkpoint")
        return cfg
    if cfg is not None:
        return cfg
    return checkpoint_config(checkpoint, overrides, imports=())


def checkpoint_config(checkpoint: str | os.PathLike, overrides: list[str] | None,
                      imports: Collection[str]) -> dict:
    """The ``config.yaml`` of ``checkpoint`` with ``overrides`` (``--a.b=v``) on top (``imports`` as in
    ``load_config``). An override of ``recipe`` is refused at the override: the file holds its own recipe's
    section (``sft:``, ``grpo:``, ...), which another recipe does not allow and no override removes."""
    from framework import yaml12
    from framework.config import load_config, override_label

    own_file = str(Path(checkpoint) / CONFIG_FILE)
    try:
        return load_config([own_file], overrides or [], imports=imports)
    except ConfigError as e:
        arg = next((a for a in reversed(overrides or []) if a.removeprefix("--").partition("=")[0] == "recipe"), None)
        label = override_label(arg) if arg is not None else None
        in_file = [p for p in e.problems if p.file == own_file]
        if arg is None or not in_file or any(p.file == label for p in e.problems):
            raise
        try:
            own = load_config([own_file], imports=imports)["recipe"]
        except FwError:   # the file has problems of its own
            raise e from None
        new = yaml12.parse_scalar(arg.partition("=")[2])[0]
        if new == own:
            raise
        held = ", ".join(dict.fromkeys(f"{p.key_path}:" for p in in_file))
        problem = Problem(label, None, None, "recipe",
                          f"the checkpoint's config.yaml is of recipe {own} and holds {held}, which recipe {new} does "
                          f"not allow; to read the checkpoint under recipe {new}, give a config of that recipe with "
                          "--config FILE")
        order = {override_label(a): i for i, a in enumerate(overrides)}   # as load_config lists them
        problems = [p for p in e.problems if p.file != own_file] + [problem]
        raise ConfigError(sorted(problems, key=lambda p: order.get(p.file, -1))) from None


# model.policy keys a config may set to other values than the checkpoint's own when it reads the checkpoint's policy:
# they change how the same weights load or run. Every other key fixes which weights and shapes the policy has.
_POLICY_KEYS_THAT_APPLY = ("dtype", "compile", "gradient_checkpointing", "keep_logits")


def checkpoint_policy_config(cfg: dict, checkpoint: Path, adapters: bool, moved: str | None = None) -> dict:
    """The model.policy config that reads `checkpoint`'s policy (LoRA `adapters` or a full model) under `cfg`: the
    checkpoint's own (its config.yaml), with `cfg`'s dtype. `cfg` may name the base model at another path that
    holds the same files (checked against the manifest's record, as a resume checks a move; said on stderr with
    `moved`, what goes on with it, unless None); any other change of the policy (preset, base model, LoRA
    settings) is refused, naming the key."""
    from framework.checkpoint.resume import RESUME_RULES, recorded_move_problem, say_moved
    from framework.config import load_config

    new = cfg["model"]["policy"]
    try:
        own = load_config([str(checkpoint / CONFIG_FILE)], imports=())["model"]["policy"]
    except FwError:
        if adapters:   # the base model is named there alone
            raise
        # a full model's weights and shapes are the checkpoint's: a config.yaml that this fw cannot read (keys of
        # another version, or none) leaves nothing to check
        return new
    out = {**own, **{k: new[k] for k in _POLICY_KEYS_THAT_APPLY}}

    from framework.yaml12 import inline as shown

    def refuse(key: str, was: Any, now: Any, why: str) -> FwError:
        return FwError(f"{key} is {shown(now)} here, but the policy of {checkpoint} has {shown(was)} ({why}); leave "
                       f"{key} as the checkpoint's config.yaml has it")

    if (own["lora"] is None) != (new["lora"] is None):
        kind = "a full model" if own["lora"] is None else "LoRA adapters"
        raise refuse("model.policy.lora", own["lora"], new["lora"], f"the checkpoint holds {kind}")
    for key in [k for k in own if k not in _POLICY_KEYS_THAT_APPLY and k != "lora"] + \
            [f"lora.{k}" for k in (own["lora"] or {})]:
        sub = key.removeprefix("lora.")
        was, now = (own, new) if sub == key else (own["lora"], new["lora"])
        was, now, full = was[sub], now[sub], f"model.policy.{key}"
        if was == now:
            continue
        why = RESUME_RULES[full][1]
        if key == "path" and was is not None and now is not None:
            problem = recorded_move_problem(read_complete_manifest(checkpoint), full, was, now)
            if problem is None:   # the same base model, copied or moved
                out["path"] = now
                if moved is not None:
                    say_moved(full, was, now, moved)
                continue
            why = f"{why}; {problem}"
        raise refuse(full, was, now, why)
    return out


def _checkpoint_policy(cfg: dict, path: Path, moved: str | None = None) -> tuple[dict, bool, dict]:
    """(manifest, whether its policy is LoRA adapters, the model.policy config that reads it) of checkpoint `path`
    under `cfg`; refused changes of the policy stop here, before any weights load. `moved`: as
    `checkpoint_policy_config` takes it."""
    from framework.models.lora import ADAPTER_CONFIG

    manifest = read_complete_manifest(path)
    if POLICY not in manifest["components"]:
        raise FwError(f"--checkpoint {path}: the checkpoint holds no {POLICY}/ component")
    adapters = f"{POLICY}/{ADAPTER_CONFIG}" in manifest["files"]
    return manifest, adapters, checkpoint_policy_config(cfg, path, adapters, moved)


def _policy_shapes(cfg: dict, checkpoint: Path | None) -> tuple[Any, Any, torch.dtype] | None:
    """(tokenizer, Qwen3Config, weights' dtype) of the policy that `load_policy` loads, read without its weights;
    None where they do not read as that load reads them (it then says why, a checkpoint's file checked against its
    manifest)."""
    from framework.models.build import policy_config
    from framework.models.hf_io import read_config, resolve_dtype
    from framework.tokenizer import Tokenizer, build_tokenizer

    policy_cfg, full, own = cfg["model"]["policy"], None, False
    if checkpoint is not None:
        _, adapters, policy_cfg = _checkpoint_policy(cfg, checkpoint)
        own = (checkpoint / POLICY / "tokenizer.json").is_file()
        if adapters and not own:
            return None   # the tokenizer comes from the checkpoint's own config.yaml there (`adapted_policy`)
        full = None if adapters else checkpoint / POLICY   # else the base's shapes: model.policy's path or preset
    try:
        with warnings.catch_warnings():   # the load that follows warns of what this read finds
            warnings.simplefilter("ignore")
            tokenizer = Tokenizer.from_pretrained(checkpoint / POLICY) if own else build_tokenizer(cfg)
            config = read_config(full)[0] if full is not None else policy_config(policy_cfg, tokenizer)
    except Exception:  # noqa: BLE001 (whatever fails here fails in the load, which explains it)
        return None
    return None if config is None else (tokenizer, config, resolve_dtype(policy_cfg["dtype"]))


def _check_cache_holds(cfg: dict, checkpoint: Path | None, prompt: str, params: SamplingParams) -> None:
    """Refuse, before any weights load, the completion of `prompt` that the rollout's KV cache cannot hold (as the
    engine refuses it once they have loaded): the pool's size from the `rollout` section, the policy's shapes and
    dtype and the device (`check_fresh_pool`); nothing where those do not read without the weights."""
    from framework.rollout import CacheSettings
    from framework.rollout.engine import check_fresh_pool, row_states
    from framework.tasks import render_prompt

    shapes = _policy_shapes(cfg, checkpoint)
    if shapes is None:
        return
    tokenizer, config, weights = shapes
    ids = tokenizer.encode(render_prompt(prompt, tokenizer, cfg["data"]["chat_template"],
                                         cfg["tokenizer"]["enable_thinking"]))
    if not ids:   # refused once the policy is there, naming the prompt
        return
    device = _device(cfg)
    with autocast_context(cfg, device):
        check_fresh_pool(row_states([ids], params), CacheSettings.from_config(cfg["rollout"]), config, weights,
                         device)


def load_policy(cfg: dict, checkpoint: str | os.PathLike | None, moved: str | None = None) -> tuple[Any, Any]:
    """(tokenizer, policy): from ``checkpoint``'s ``policy/`` (a checkpoint directory, its sizes checked;
    with ``checkpoint.verify`` every file read is hashed while it loads), else built from ``cfg`` (random
    init for a preset, seeded with ``cfg["seed"]``). ``moved``: what a base model found moved goes on to do, said
    on stderr (None: nothing said)."""
    from framework.export import adapted_policy
    from framework.models import build_policy, load_pretrained
    from framework.models.lora import merged_copy
    from framework.tokenizer import Tokenizer, build_tokenizer

    if checkpoint is None:
        tokenizer = build_tokenizer(cfg)
        torch.manual_seed(cfg["seed"])
        return tokenizer, build_policy(cfg["model"]["policy"], tokenizer)
    path = Path(checkpoint)
    manifest, adapters, policy_cfg = _checkpoint_policy(cfg, path, moved)
    rels = [rel for rel in manifest["files"] if rel.startswith(POLICY + "/") or rel == CONFIG_FILE]
    policy_dir = path / POLICY
    with verifying(Verifier(path, manifest, rels) if cfg["checkpoint"]["verify"] else None):
        for fname in component_weight_files(manifest, POLICY):
            check_header(policy_dir / fname)
        if adapters:
            # LoRA: the base the checkpoint's config names, the adapters folded in for plain decoding
            tokenizer, policy = adapted_policy(path, policy_dir, policy_cfg)
            return tokenizer, merged_copy(policy)
        # A checkpoint's policy/ carries the tokenizer the run trained with; fall back to the config's.
        has_tokenizer = (policy_dir / "tokenizer.json").is_file()
        tokenizer = Tokenizer.from_pretrained(policy_dir) if has_tokenizer else build_tokenizer(cfg)
        policy = load_pretrained(policy_dir, policy_cfg["dtype"])
    return tokenizer, policy


def _check_prompt_text(prompt: str) -> None:
    """FwError when `prompt` is no UTF-8 text: bytes of another encoding on the command line, which Python keeps as
    lone surrogates and which no tokenizer takes."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(prompt[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"the lone surrogate U+{code:04X}"
        raise FwError(f"--prompt is not UTF-8 text ({what} at character {e.start + 1}); give the prompt in UTF-8") \
            from None


def _warn_past_positions(prompt_len: int, params: SamplingParams, positions: int) -> None:
    """A line on stderr when the prompt plus max_new_tokens passes the policy's `max_position_embeddings`, as `fw fit`
    warns (memory_plan.position_warnings): the model computes there but was not trained there."""
    new = params.max_new_tokens if isinstance(params.max_new_tokens, int) else max(params.max_new_tokens)
    if prompt_len + new > positions:
        print(f"fw: warning: the prompt ({prompt_len:,} tokens) plus max_new_tokens ({new:,}) allows rows of "
              f"{prompt_len + new:,} tokens, more than the policy's max_position_embeddings ({positions:,}), the "
              "positions it is made for; fw applies no RoPE scaling", file=sys.stderr, flush=True)


def generate_text(cfg: dict | None, prompt: str, checkpoint: str | None = None, max_new_tokens: int | None = None,
                  temperature: float | None = None, seed: int | None = None, skip_damaged: bool = False,
                  overrides: list[str] | None = None) -> str:
    """The completion of ``prompt`` (the user message; rendered with the chat template when
    ``data.chat_template``). Unset options come from ``rollout.max_new_tokens``, ``rollout.temperature``
    (0 = greedy) and ``seed``; top-k/top-p/min-p/stop strings and the KV cache's settings from ``rollout``; on
    CUDA under the run's autocast (`trainer.precision` *-mixed), as its rollouts sample.
    ``checkpoint`` is a checkpoint directory or a run directory (its newest checkpoint; ``skip_damaged`` as in
    ``fw fit``); without ``cfg``, ``overrides`` apply on top of its config.yaml."""
    from framework.checkpoint import read_resolved
    from framework.config import key_schema
    from framework.rollout import CacheSettings, SamplingParams, generate, stop_token_ids
    from framework.tasks import render_prompt

    _check_prompt_text(prompt)
    top = key_schema("seed")["maximum"]   # the config's seed's bounds: the sampler's seeding takes no more
    if seed is not None and not 0 <= seed <= top:
        raise FwError(f"--seed must be an integer from 0 to {top}, as the config's seed is; got {seed}")
    # one limit for the one prompt (SamplingParams, for many prompts, takes one a prompt too)
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                       or max_new_tokens < 1):
        raise FwError(f"--max-new-tokens must be an int >= 1, got {max_new_tokens!r}")
    changes = {k: v for k, v in (("max_new_tokens", max_new_tokens), ("temperature", temperature)) if v is not None}
    given = cfg

    @contextlib.contextmanager
    def cache_limit_named() -> Iterator[None]:
        try:
            yield
        except FwError as e:   # the engine names the config key; here the option set it
            if "max_new_tokens" not in changes or "rollout.max_new_tokens" not in str(e):
                raise
            raise FwError(str(e).replace("rollout.max_new_tokens", "--max-new-tokens")) from None

    def prepare(path: Path | None) -> tuple[dict, SamplingParams, Any, Any]:
        run_cfg = run_config(given, path, overrides)
        # the arguments are checked before any weights load
        if not prompt and not run_cfg["data"]["chat_template"]:
            raise FwError("--prompt is empty, and data.chat_template is false, so the model would read no token; "
                          "give the text to continue")
        try:
            params = SamplingParams.from_config(run_cfg["rollout"], **changes)
        except FwError as e:   # "sampling: KEY must be ...", said of the option or the config key that set KEY
            message = str(e).removeprefix("sampling: ")
            key = message.split(" ", 1)[0]
            where = f"--{key.replace('_', '-')}" if key in changes else f"rollout.{key}"
            raise FwError(where + message[len(key):]) from None
        with cache_limit_named():
            _check_cache_holds(run_cfg, path, prompt, params)
        return (run_cfg, params, *load_policy(run_cfg, path, "generating with it"))

    # a run directory's newest checkpoint, read again if the fit writing the run prunes it meanwhile
    cfg, params, tokenizer, policy = (prepare(None) if checkpoint is None
                                      else read_resolved(checkpoint, prepare, skip_damaged))
    policy.to(_device(cfg))
    text = render_prompt(prompt, tokenizer, cfg["data"]["chat_template"], cfg["tokenizer"]["enable_thinking"])
    ids = tokenizer.encode(text)
    if not ids:
        raise FwError(f"--prompt {prompt!r} encodes to no token; give text the tokenizer keeps")
    _warn_past_positions(len(ids), params, policy.config.max_position_embeddings)
    # as the run's rollouts sample: its cache settings (rollout.kv_cache_dtype changes what is sampled) and, on CUDA,
    # its autocast (a float8 pool needs 16-bit compute there)
    # the pool's budget may hang on the memory the weights leave (kv_cache_gib null on CUDA): checked again here
    with cache_limit_named(), autocast_context(cfg, _device(cfg)):
        result = generate(policy, [ids], params, eos_ids=stop_token_ids(tokenizer, policy),
                          tokenizer=tokenizer, seed=cfg["seed"] if seed is None else seed,
                          cache=CacheSettings.from_config(cfg["rollout"]))
    return result.texts[0]
