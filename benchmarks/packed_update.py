"""The GRPO update with packed against right-padded micro-batches (recipes/rl.py `response_layout`).

One update = forward and backward of `completion_logprobs` and GRPO's clipped surrogate (token-mean) over
every micro-batch of one rollout batch: 256 completions of lengths U[16, 256] (seeded) after 116-token
prompts, 4 micro-batches of 64 rows as in benchmarks/grpo_bench.yaml, autocast bf16 over float32 weights,
random weights built on the device. Prints the median of --rounds updates per layout, peak allocated and
reserved GiB, and how far the packed loss and gradients are from the padded ones.

    python -m benchmarks.packed_update [--preset qwen3-0.6b] [--micro 4] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from framework.config import resolve
from framework.models import Qwen3ForCausalLM
from framework.models.presets import PRESETS, preset_config
from recipes.losses import aggregate_weight, build_policy_loss
from recipes.rl import completion_logprobs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def rollout(n: int, prompt: int, lo: int, hi: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    completion_lens = torch.randint(lo, hi + 1, (n,), generator=g)
    tokens = torch.randint(0, vocab, (n, prompt + hi), generator=g)
    return (tokens.to(DEVICE), torch.full((n,), prompt).to(DEVICE), completion_lens.to(DEVICE), hi)


def update(model, batch, old_logp, adv, loss_fn, micro: int, packed: bool) -> float:
    """Forward + backward over the micro-batches, each weighted as RLRecipe.update weighs it; returns the loss."""
    tokens, prompt_lens, completion_lens, width = batch
    mask = (torch.arange(width, device=DEVICE)[None, :] < completion_lens[:, None]).float()
    total = 0.0
    for rows in torch.tensor_split(torch.arange(tokens.shape[0], device=DEVICE), micro):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            logp, _ = completion_logprobs(model, tokens[rows], prompt_lens[rows], completion_lens[rows], width, 1.0,
                                          packed=packed)
        loss = loss_fn(logp, old_logp[rows], adv[rows], mask[rows]).loss * aggregate_weight(mask[rows], mask,
                                                                                           "token-mean")
        loss.backward()
        total += float(loss)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--completions", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=116)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches (trainer.accumulate_grad_batches)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cfg = preset_config(args.preset, PRESETS[args.preset]["vocab_size"] or 256)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(cfg).train()
    batch = rollout(args.completions, args.prompt, args.min_len, args.max_len, cfg.vocab_size)
    tokens, prompt_lens, completion_lens, width = batch
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        old_logp = torch.cat([completion_logprobs(model, tokens[r], prompt_lens[r], completion_lens[r], width, 1.0)[0]
                              for r in torch.tensor_split(torch.arange(len(tokens), device=DEVICE), args.micro)])
    adv = torch.randn(len(tokens), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    section = resolve({"recipe": "grpo", "model": {"policy": {"preset": "tiny"}}})["grpo"]
    loss_fn = build_policy_loss(section, width)
    results = {}
    for packed in (False, True):
        name = "packed" if packed else "padded"
        times = []
        CUDA and torch.cuda.reset_peak_memory_stats()
        for _ in range(args.rounds + 1):   # the first: warm-up
            model.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            loss = update(model, batch, old_logp, adv, loss_fn, args.micro, packed)
            sync()
            times.append(time.perf_counter() - t0)
        grads = torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])
        results[name] = {"s": statistics.median(times[1:]), "loss": loss, "grads": grads,
                         "alloc": torch.cuda.max_memory_allocated() / 2**30 if CUDA else float("nan"),
                         "reserved": torch.cuda.max_memory_reserved() / 2**30 if CUDA else float("nan")}
        model.zero_grad(set_to_none=True)
        CUDA and torch.cuda.empty_cache()
    lens = (prompt_lens + completion_lens).tolist()
    padded = sum(len(r) * max(lens[int(r[0]):int(r[-1]) + 1])
                 for r in torch.tensor_split(torch.arange(len(lens)), args.micro))
    print(f"\nGRPO update, {args.preset}, {args.completions} completions U[{args.min_len}, {args.max_len}] after "
          f"{args.prompt}-token prompts, {args.micro} micro-batches, autocast bf16, "
          f"{torch.cuda.get_device_name() if CUDA else 'CPU'}; real tokens {sum(lens)}, padded {padded}")
    print(f"| layout | median s ({args.rounds}) | peak allocated GiB | peak reserved GiB | loss |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['s']:.3f} | {r['alloc']:.2f} | {r['reserved']:.2f} | {r['loss']:.6g} |")
    pad, pk = results["padded"], results["packed"]
    diff = float((pk["grads"] - pad["grads"]).norm() / pad["grads"].norm())
    print(f"speed-up packed / padded: {pad['s'] / pk['s']:.2f}x; gradient relative difference {diff:.2e}, "
          f"loss difference {abs(pk['loss'] - pad['loss']):.2e} (bf16 autocast: both round differently)")


if __name__ == "__main__":
    main()
