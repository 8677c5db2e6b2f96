"""The GRPO update with packed against right-padded micro-batches (recipes/rl.py `response_layout`).

One update = forward and backward of `completion_logprobs` and GRPO's clipped surrogate (token-mean) over
every micro-batch of one rollout batch, as `RLRecipe.update` runs it: 256 completions of lengths U[16, 256]
(seeded; --equal: all 256, as in grpo-bench) after 116-token prompts, 4 micro-batches of even token counts
(`balanced_split`; --split rows: 64 rows each; --split sorted: buckets of similar lengths), the lengths on
the host, the micro-batch weights read once, autocast bf16 over float32 weights, random weights built on
the device. Every layout runs the same micro-batches: padded, packed, auto (the recipes' packed=None), and
shared: each micro-batch's prompts laid out once per group of --group rows, which hold the same prompt
(`grpo.shared_prompt`; --split groups cuts the micro-batches between groups, as the recipes then do).
Prints the median of --rounds updates per layout, when the host returned from it (before the device was
waited for: about the whole time where enqueueing, not the kernels, sets it), its time per real token, peak
allocated and reserved GiB, and how far the packed loss and gradients are from the padded ones; --equal adds the
share of tokens packing must remove to pay, --profile the kernels that take the most device time in one update of
each layout (and --profile-host the ops of most host time, --trace their chrome traces).

    python -m benchmarks.packed_update [--preset qwen3-0.6b] [--micro 4] [--rounds 3] [--equal] [--profile N]
    python -m benchmarks.packed_update --equal --split groups      # grpo-bench's update, prompts shared or not
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.profiling import top_kernels
from framework.allocator import to_device
from framework.config import resolve
from framework.models import Qwen3ForCausalLM
from framework.models.presets import PRESETS, preset_config
from recipes.losses import aggregate_weights, build_policy_loss
from recipes.rl import PACK_MIN_SAVING, balanced_split, completion_logprobs, packs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
LAYOUTS = {"padded": False, "packed": True, "auto": None, "shared": "shared"}


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def rollout(n: int, prompt: int, lo: int, hi: int, vocab: int, group: int, seed: int = 0):
    """Device tokens (each group of `group` rows with one prompt), host prompt and completion lengths, the
    completion width."""
    g = torch.Generator().manual_seed(seed)
    completion_lens = torch.randint(lo, hi + 1, (n,), generator=g)
    tokens = torch.randint(0, vocab, (n, prompt + hi), generator=g)
    tokens[:, :prompt] = tokens[torch.arange(n) // group * group, :prompt]
    return tokens.to(DEVICE), torch.full((n,), prompt), completion_lens, hi


def update(model, batch, micro, old_logp, adv, mask, loss_fn, packed: bool | str | None, group: int) -> torch.Tensor:
    """Forward + backward over the micro-batches (host rows), weighted as RLRecipe.update weighs them;
    packed "shared": the prompts of each group of `group` rows once."""
    tokens, prompt_lens, completion_lens, width = batch
    rows = [to_device(r, DEVICE) for r in micro]
    weights = aggregate_weights([mask[r] for r in rows], mask, "token-mean")
    total = torch.zeros((), device=DEVICE)
    for host, dev, weight in zip(micro, rows, weights, strict=True):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            layout = {"groups": host // group} if packed == "shared" else {"packed": packed}
            logp, _ = completion_logprobs(model, tokens[dev], prompt_lens[host], completion_lens[host], width, 1.0,
                                          **layout)
        loss = loss_fn(logp, old_logp[dev], adv[dev], mask[dev]).loss * weight
        loss.backward()
        total += loss.detach()
    return total


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--completions", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=116)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--equal", action="store_true", help="every completion --max-len tokens (grpo-bench's rows)")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches (trainer.accumulate_grad_batches)")
    ap.add_argument("--split", choices=("tokens", "rows", "sorted", "groups"), default="tokens",
                    help="micro-batches of even token counts (the recipes'), of even row counts, of the "
                         "length-sorted rows in order (buckets of similar lengths: the least padding), or of "
                         "whole groups in order (the recipes' under shared_prompt)")
    ap.add_argument("--group", type=int, default=8, help="rows a prompt (grpo.group_size)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the N kernels of most device time in one update of each layout")
    ap.add_argument("--profile-host", action="store_true", help="with --profile, also the N ops of most host time")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="with --profile, write each layout's profiled update as DIR/<layout>.json (chrome trace)")
    args = ap.parse_args(argv)
    if args.trace:
        if not args.profile:
            ap.error("--trace needs --profile N: it keeps the profiled update's trace")
        os.makedirs(args.trace, exist_ok=True)
    cfg = preset_config(args.preset, PRESETS[args.preset]["vocab_size"] or 256)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(cfg).train()
    lo = args.max_len if args.equal else args.min_len
    batch = rollout(args.completions, args.prompt, lo, args.max_len, cfg.vocab_size, args.group)
    tokens, prompt_lens, completion_lens, width = batch
    lens = prompt_lens + completion_lens
    everything = torch.arange(len(lens))
    if args.split == "tokens":
        micro = balanced_split(everything, lens, args.micro)
    else:
        order = lens.sort(stable=True).indices if args.split == "sorted" else everything   # rows: groups in order
        micro = list(torch.tensor_split(order, args.micro))
    mask = (torch.arange(width)[None, :] < completion_lens[:, None]).float().to(DEVICE)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        old_logp = torch.zeros(len(lens), width, device=DEVICE)
        for r in micro:
            old_logp[to_device(r, DEVICE)] = completion_logprobs(model, tokens[to_device(r, DEVICE)], prompt_lens[r],
                                                                 completion_lens[r], width, 1.0)[0]
    adv = torch.randn(len(lens), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    section = resolve({"recipe": "grpo", "model": {"policy": {"preset": "tiny"}}})["grpo"]
    loss_fn = build_policy_loss(section, width)
    results, profiles = {}, {}
    for name, packed in LAYOUTS.items():
        times, returned = [], []
        CUDA and torch.cuda.reset_peak_memory_stats()
        for _ in range(args.rounds + 1):   # the first: warm-up
            model.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            loss = update(model, batch, micro, old_logp, adv, mask, loss_fn, packed, args.group)
            returned.append(time.perf_counter() - t0)
            sync()
            times.append(time.perf_counter() - t0)
        # where the host returns about when the device ends, the host's enqueueing sets the time, not the kernels
        results[name] = {"s": statistics.median(times[1:]), "host": statistics.median(returned[1:]),
                         "loss": float(loss),
                         "alloc": torch.cuda.max_memory_allocated() / 2**30 if CUDA else float("nan"),
                         "reserved": torch.cuda.max_memory_reserved() / 2**30 if CUDA else float("nan")}
        # kept on the host: a device copy would count in the next layouts' peaks
        results[name]["grads"] = torch.cat([p.grad.float().reshape(-1).cpu() for p in model.parameters()])
        if args.profile:
            model.zero_grad(set_to_none=True)
            profiles[name] = top_kernels(
                lambda p=packed: update(model, batch, micro, old_logp, adv, mask, loss_fn, p, args.group), args.profile,
                args.profile_host, args.trace and f"{args.trace}/{name}.json")
        model.zero_grad(set_to_none=True)
        CUDA and torch.cuda.empty_cache()
    real = int(lens.sum())
    padded = sum(len(r) * int(lens[r].max()) for r in micro)
    auto = [("packed" if packs(prompt_lens[r], completion_lens[r]) else "padded") for r in micro]
    print(f"\nGRPO update, {args.preset}, {args.completions} completions U[{lo}, {args.max_len}] after "
          f"{args.prompt}-token prompts, {args.micro} micro-batches split by {args.split} "
          f"(tokens {[int(lens[r].sum()) for r in micro]}; auto lays them out {auto}), autocast bf16, "
          f"{torch.cuda.get_device_name() if CUDA else 'CPU'}; real tokens {real}, padded {padded}")
    print(f"| layout | median s ({args.rounds}) | host returned after, s | us per real token | peak allocated GiB "
          "| peak reserved GiB | loss |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['s']:.3f} | {r['host']:.3f} | {1e6 * r['s'] / real:.2f} | {r['alloc']:.2f} "
              f"| {r['reserved']:.2f} | {r['loss']:.6g} |")
    pad, pk = results["padded"], results["packed"]
    diff = float((pk["grads"] - pad["grads"]).norm() / pad["grads"].norm())
    print(f"speed-up packed / padded: {pad['s'] / pk['s']:.2f}x, auto / padded: {pad['s'] / results['auto']['s']:.2f}x "
          f"(ideal, time per padded token: {padded / real:.2f}x); gradient relative difference {diff:.2e}, "
          f"loss difference {abs(pk['loss'] - pad['loss']):.2e} (bf16 autocast: both round differently)")
    sh = results["shared"]
    shared_tokens = sum(int(completion_lens[r].sum()) + len(torch.unique(r // args.group)) * args.prompt
                        for r in micro)
    diff = float((sh["grads"] - pad["grads"]).norm() / pad["grads"].norm())
    print(f"shared prompts: {shared_tokens} tokens ({shared_tokens / real:.0%} of the real ones); speed-up shared / "
          f"padded {pad['s'] / sh['s']:.2f}x, shared / packed {pk['s'] / sh['s']:.2f}x; gradient relative difference "
          f"{diff:.2e}, loss difference {abs(sh['loss'] - pad['loss']):.2e}")
    if args.equal:   # the same tokens in both layouts: what the packed layout costs beyond the math
        ratio = pk["s"] / pad["s"]
        print(f"equal rows: packed takes {ratio:.3f}x the padded time; packing pays when it removes more than "
              f"{max(0.0, 1.0 - 1.0 / ratio):.1%} of the tokens (recipes.rl.PACK_MIN_SAVING is {PACK_MIN_SAVING:.1%})")
    for name, table in profiles.items():
        print(f"\n{name}: the kernels of one update\n{table}")
    return results


if __name__ == "__main__":
    main()
