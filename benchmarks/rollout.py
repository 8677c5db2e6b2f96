"""Rollout throughput on the rollout workload (docs/BENCHMARKS.md): fw's engine against HF `generate`, same run.

Random prompt ids, prompt and output lengths uniform in [lo, hi] (seed 0), EOS ignored, temperature
0.6; throughput = useful output tokens / wall time including prefill. `fw` ends each row at its own
output length (generate's per-row max_new_tokens; a finished row leaves the batch and frees its KV blocks), as the
workload's floor assumes; `fw-longest` and HF `generate` (which has no per-row limit) run every row to
the longest output, so both are charged the same padding; `fw-eager` is `fw` without the CUDA graph of
the decode step. `--kv-cache-gib` is the paged cache's budget (rows wait for blocks beyond it) and
`--kv-cache-dtype` the dtype it holds (`float8_e4m3`: twice the positions a budget holds); the table
reports the peak allocated and reserved memory (HF's own: fw's KV pool handed back first, its model's bytes left
out) and the most rows that decoded together. Each fw impl runs
`--rounds` times on the one engine (the first round captures the decode graphs of the buckets it meets) and
reports the median round; HF runs once.

    python -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw --kv-cache-gib 16
    python -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw --kv-cache-gib 4
    python -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw,fw-longest,fw-eager
    python -m benchmarks.rollout --num-seqs 64 --lo 100 --hi 256 --impls fw,fw-longest,hf
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from framework.models import Qwen3ForCausalLM
from framework.models.presets import PRESETS, preset_config
from framework.rollout import CacheSettings, RolloutEngine, SamplingParams
from framework.rollout.kv_cache import KV_CACHE_DTYPES

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outs


def run_fw(engine, prompts, outs, temperature, impl):
    limits = max(outs) if impl == "fw-longest" else outs
    engine.cuda_graph = impl != "fw-eager"
    sync()
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=limits, temperature=temperature), seed=0)
    sync()
    return time.perf_counter() - t0


def run_hf(model, prompts, outs, temperature, pad_id=0):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):   # HF generate wants left padding
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    sync()
    t0 = time.perf_counter()
    model.generate(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), do_sample=True, temperature=temperature,
                   top_k=0, top_p=1.0, max_new_tokens=max(outs), min_new_tokens=max(outs), eos_token_id=None,
                   pad_token_id=pad_id)
    sync()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--lo", type=int, default=100)
    ap.add_argument("--hi", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--impls", default="fw,hf")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of each fw impl; the median is reported")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="the KV budget (default: the GPU's free memory)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="rows decoding together (default: the schema's)")
    ap.add_argument("--admit-batch", type=int, default=None, help="rows joining at once (default: the schema's)")
    ap.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=None,
                    help="the KV pool's dtype (default: the schema's)")
    args = ap.parse_args(argv)
    cfg = preset_config(args.preset, PRESETS[args.preset]["vocab_size"] or 256)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).to(DEVICE).eval()
    prompts, outs = workload(args.num_seqs, args.lo, args.hi, cfg.vocab_size)
    useful = sum(outs)
    base = CacheSettings.from_config(None)
    settings = CacheSettings(args.kv_cache_gib, args.max_num_seqs or base.max_num_seqs, base.block_size,
                             args.admit_batch or base.admit_batch, args.kv_cache_dtype or base.kv_cache_dtype)
    engine = RolloutEngine(model, settings)
    # Warm-up: kernels, allocator, cuBLAS handles; the engine keeps its pool and graphs for the timed call.
    engine.generate(prompts[:4], SamplingParams(max_new_tokens=8, temperature=args.temperature), seed=1)
    rows = []
    for impl in args.impls.split(","):
        CUDA and torch.cuda.reset_peak_memory_stats()
        rounds = []
        held = held_reserved = 0   # bytes of fw's left out of an HF row's peaks
        if impl.startswith("fw"):
            rounds = [run_fw(engine, prompts, outs, args.temperature, impl) for _ in range(args.rounds)]
            secs = sorted(rounds)[len(rounds) // 2]
        else:
            import transformers
            # HF's peaks are its own: fw's KV pool and graphs go back (a later fw impl takes new ones), and what
            # fw's model still holds is subtracted
            engine.release()
            if CUDA:
                held, held_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg.to_hf(), attn_implementation="sdpa"))
            hf.load_state_dict(model.hf_state_dict(), strict=False)  # tied head: lm_head comes from the embedding
            hf = hf.to(torch.bfloat16).to(DEVICE).eval()
            run_hf(hf, prompts[:2], [8, 8], args.temperature)
            CUDA and torch.cuda.reset_peak_memory_stats()
            secs = run_hf(hf, prompts, outs, args.temperature)
            del hf
        rows.append({"impl": impl, "seconds": secs, "rounds": rounds, "useful_tokens": useful, "tok_s": useful / secs,
                     "peak_gib": ((torch.cuda.max_memory_allocated() - held) / 2**30 if CUDA else 0.0),
                     "reserved_gib": ((torch.cuda.max_memory_reserved() - held_reserved) / 2**30 if CUDA else 0.0),
                     "kv_cache_gib": args.kv_cache_gib, "kv_cache_dtype": settings.kv_cache_dtype,
                     "kv_blocks": engine.cache.num_blocks if engine.cache is not None else 0,
                     "peak_rows": engine.peak_rows, "preemptions": engine.preemptions})
        print(json.dumps(rows[-1]), flush=True)
        CUDA and torch.cuda.empty_cache()
    hf_row = next((r for r in rows if r["impl"] == "hf"), None)
    print(f"\nRollout, {args.preset} bf16, {args.num_seqs} seqs, prompt/output uniform [{args.lo}, {args.hi}], "
          f"T={args.temperature}, {useful} useful output tokens, {(torch.cuda.get_device_name() if CUDA else 'CPU')}")
    print(f"KV budget: {args.kv_cache_gib or 'free memory'} GiB, KV dtype {settings.kv_cache_dtype}")
    print(f"{'impl':<11}{'seconds':>10}{'tok/s':>10}{'peak GiB':>10}{'rsvd GiB':>10}{'vs HF':>8}")
    if hf_row:
        print("(vs HF: fw-longest does HF's work, every row to the longest output; fw stops rows at their lengths)")
    for r in rows:
        ratio = f"{r['tok_s'] / hf_row['tok_s']:.1f}x" if hf_row else "-"
        print(f"{r['impl']:<11}{r['seconds']:>10.2f}{r['tok_s']:>10.0f}{r['peak_gib']:>10.1f}{r['reserved_gib']:>10.1f}"
              f"{ratio:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
