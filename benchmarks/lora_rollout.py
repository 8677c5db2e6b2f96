"""Rollout throughput with LoRA adapters: adapter-aware decoding (what fw's RL recipes run) against a merged copy.

The rollout workload of benchmarks/rollout.py (random prompts, per-row output lengths, EOS ignored) on a
bf16 base with float32 adapters of `--rank` on all seven projections (B random, so the adapters are not
a no-op). Implementations: `base` (the model without adapters: the ceiling), `lora` (the policy as it is:
extra low-rank matmuls in every projection, inside the CUDA graph), `lora-eager` (the same without the
graph), `lora-autocast` (`lora` under bf16 autocast, as Lightning's bf16-mixed runs the rollout) and
`merged` (a separate merged copy built by `framework.models.lora.merged_copy` before each rollout; its
build time is counted and also shown on its own).

    python -m benchmarks.lora_rollout --preset qwen3-0.6b --num-seqs 256 --lo 100 --hi 1024
    python -m benchmarks.lora_rollout --preset qwen3-1.7b --rank 64 --impls base,lora,merged
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from benchmarks.rollout import DEVICE, sync, workload
from framework.models import Qwen3ForCausalLM
from framework.models.lora import adapters_detached, add_adapters, merged_copy, peft_targets, projections
from framework.models.presets import PRESETS, preset_config
from framework.rollout import SamplingParams, generate


def rollout(model, prompts, outs, temperature: float, cuda_graph: bool = True, autocast: bool = False) -> float:
    amp = torch.autocast(DEVICE, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    sync()
    t0 = time.perf_counter()
    with amp:
        generate(model, prompts, SamplingParams(max_new_tokens=outs, temperature=temperature), seed=0,
                 cuda_graph=cuda_graph)
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--lo", type=int, default=100)
    ap.add_argument("--hi", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--impls", default="base,lora,lora-eager,lora-autocast,merged")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = preset_config(args.preset, PRESETS[args.preset]["vocab_size"] or 256)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).to(DEVICE).eval()
    add_adapters(model, {"rank": args.rank, "alpha": 2 * args.rank, "dropout": 0.0, "targets": list(projections(cfg))})
    with torch.no_grad():
        for t, _, _ in peft_targets(model).values():
            t.normal_(0.0, 0.02)
    prompts, outs = workload(args.num_seqs, args.lo, args.hi, cfg.vocab_size)
    useful = sum(outs)
    generate(model, prompts[:4], SamplingParams(max_new_tokens=8, temperature=args.temperature), seed=1)  # warm-up
    if "merged" in args.impls:
        merged_copy(model)   # warm-up of the merge's first-call set-up, which a training run pays once
    rows = []
    for impl in args.impls.split(","):
        torch.cuda.is_available() and torch.cuda.reset_peak_memory_stats()
        merge_s = 0.0
        if impl == "base":
            with adapters_detached(model):
                secs = rollout(model, prompts, outs, args.temperature)
        elif impl == "merged":
            sync()
            t0 = time.perf_counter()
            merged = merged_copy(model)
            sync()
            merge_s = time.perf_counter() - t0
            secs = merge_s + rollout(merged, prompts, outs, args.temperature)
            del merged
        else:
            secs = rollout(model, prompts, outs, args.temperature, cuda_graph=impl != "lora-eager",
                           autocast=impl == "lora-autocast")
        rows.append({"impl": impl, "seconds": secs, "merge_seconds": merge_s, "useful_tokens": useful,
                     "tok_s": useful / secs,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0})
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["impl"] == "base"), None)
    print(f"\nLoRA rollout, {args.preset} bf16, rank {args.rank}, {args.num_seqs} seqs, prompt/output uniform "
          f"[{args.lo}, {args.hi}], {useful} useful output tokens")
    print(f"{'impl':<15}{'seconds':>10}{'merge s':>10}{'tok/s':>10}{'peak GiB':>10}{'vs base':>9}")
    for r in rows:
        ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
        print(f"{r['impl']:<15}{r['seconds']:>10.2f}{r['merge_seconds']:>10.2f}{r['tok_s']:>10.0f}"
              f"{r['peak_gib']:>10.1f}{ratio:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
