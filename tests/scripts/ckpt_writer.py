"""Writes checkpoints in a loop with AtomicCheckpointIO, for the SIGKILL crash-safety test.

Every checkpoint's contents are a pure function of (step, version), so a reader can check what it loads
without trusting the writer: `expected(step, version)`. Steps continue after the newest complete
checkpoint (like `--resume last`); every third step re-publishes the previous step with a new version
first, so kills also land inside a replace.

Run as a script: python tests/scripts/ckpt_writer.py RUN_DIR [--no-exchange]
"""

from __future__ import annotations

import sys

import torch

MB_FLOATS = 1 << 18  # one MiB of fp32


def expected(step: int, version: int, size_mb: int = 4) -> dict:
    """A realistic Lightning checkpoint dict: HF-named weights, Adam states, loops, RNG, recipe state."""
    g = torch.Generator().manual_seed(step * 1000 + version)
    hidden = 64
    vocab = size_mb * MB_FLOATS // hidden
    weights = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(hidden, hidden, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(hidden) + step,
    }
    return {
        "epoch": 0,
        "global_step": step,
        "policy_version": step,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": {},
        "loops": {"fit_loop": {"epoch_loop.batch_progress": {"total": {"completed": step, "ready": step}}}},
        "callbacks": {"CheckpointCallback": {"last_saved": step - 1}},
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(vocab, hidden, generator=g),
                              "exp_avg_sq": torch.rand(vocab, hidden, generator=g)}},
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
            }
        ],
        "lr_schedulers": [{"last_epoch": step, "_step_count": step + 1}],
        "recipe_state": {"data_position": step * 4, "rng": torch.Generator().manual_seed(step).get_state(),
                         "version": version},
        "fw_components": {
            "policy": {
                "config": {"model_type": "qwen3", "hidden_size": hidden, "vocab_size": vocab, "step": step},
                "state_dict": weights,
                "files": {"tokenizer.json": f'{{"step": {step}, "version": {version}}}'.encode()},
            }
        },
    }


def assert_same(a, b, where="checkpoint"):
    """Deep equality of nested dict/list/tuple/tensor structures; tensors must match in dtype and values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def policy_checkpoint(model, tok, step: int, tok_dir) -> dict:
    """A checkpoint dict as FwModule hands it over (DESIGN.md "Checkpoints"): `model`'s HF weights and `tok`'s
    files (saved into the scratch directory `tok_dir`) under fw_components' policy."""
    tok.save_pretrained(tok_dir)
    files = {n: (tok_dir / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")}
    state = {k: v.detach().clone() for k, v in model.hf_state_dict().items()}
    return {"global_step": step, "policy_version": step, "state_dict": {},
            "fw_components": {"policy": {"config": model.config.to_hf("float32"), "state_dict": state,
                                         "files": files}}}


def make_cfg(run_dir: str) -> dict:
    from framework.config import resolve

    return resolve({"recipe": "sft", "run_dir": run_dir, "model": {"policy": {"preset": "tiny"}},
                    "checkpoint": {"every_n_steps": 1, "keep_last": 2, "verify": True}})


def write_forever(run_dir: str, use_exchange: bool = True, size_mb: int = 4) -> None:
    from framework.checkpoint import (
        checkpoints_dir,
        clean_leftovers,
        find_latest,
        prune,
        read_manifest,
        step_dir_name,
        write_checkpoint_dir,
    )

    cfg = make_cfg(run_dir)
    ckpt_dir = checkpoints_dir(run_dir)
    clean_leftovers(ckpt_dir)
    latest = find_latest(run_dir)
    step = read_manifest(latest)["step"] + 1 if latest else 1
    while True:
        if step % 3 == 0 and step > 1:  # replace the previous step with a new version of it
            write_checkpoint_dir(expected(step - 1, 1, size_mb), ckpt_dir / step_dir_name(step - 1), cfg,
                                 use_exchange=use_exchange)
        write_checkpoint_dir(expected(step, 0, size_mb), ckpt_dir / step_dir_name(step), cfg,
                             use_exchange=use_exchange)
        prune(run_dir, cfg["checkpoint"]["keep_last"])
        step += 1


if __name__ == "__main__":
    write_forever(sys.argv[1], use_exchange="--no-exchange" not in sys.argv[2:])
