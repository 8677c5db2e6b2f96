"""What the rollout scheduler does with a KV budget, without a model: decode steps, prefills, preemptions, prefill
tokens (the prompts once, and what preempted rows recompute) and rows a step for the rollout workload
(`benchmarks.rollout`'s prompts and per-row output lengths), by admission watermark, admission batch and KV dtype.
It runs framework/rollout/scheduler.py's real `Scheduler` over a pool sized as the engine sizes it (a bf16 model's:
`--kv-cache-dtypes float8_e4m3` fits twice the blocks in a budget), each step growing every running row by one
token, as the engine does.

    python -m benchmarks.rollout_schedule --kv-cache-gib 16 4 --watermarks 0.01 0.05 0.1
    python -m benchmarks.rollout_schedule --admit-batches 1 8 --step-ms 1.7 --prefill-ms 14
    python -m benchmarks.rollout_schedule --kv-cache-gib 16 4 --kv-cache-dtypes auto float8_e4m3

`--step-ms` and `--prefill-ms` add an estimate of the wall time from assumed costs (per decode step besides the
KV reads, per prefill stall) and a KV read bandwidth, to compare policies; it is arithmetic, not a measurement.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.rollout import workload
from framework.config import defaults
from framework.models.presets import PRESETS, preset_config
from framework.rollout import scheduler as sched
from framework.rollout.block_manager import BlockManager
from framework.rollout.kv_cache import KV_CACHE_DTYPES, block_bytes, pool_dtype


def simulate(num_blocks: int, block_size: int, prompts: list[list[int]], outs: list[int], watermark: float,
             max_num_seqs: int, kv_bytes_per_token: int = 0, step_s: float = 0.0, prefill_s: float = 0.0,
             bandwidth: float = 1.0, admit_batch: int = 1) -> dict:
    """Run the scheduler to the end: counts, and the estimate when step_s / prefill_s are given."""
    seqs = [sched.RowState(row=i, prompt=p, limit=n) for i, (p, n) in enumerate(zip(prompts, outs))]
    s = sched.Scheduler(seqs, BlockManager(num_blocks, block_size), max_num_seqs, admit_batch)
    s.watermark = max(1, int(watermark * (num_blocks - 1)))
    steps = prefills = row_steps = prefill_tokens = 0
    estimate = 0.0

    def emit(rows: list[sched.RowState]) -> None:
        for r in rows:
            r.issued += 1
            r.tokens.append(0)
            if len(r.tokens) >= r.limit:
                s.finish(r, "length")

    while not s.done:
        new = s.admit()
        if new:
            prefills += 1
            prefill_tokens += sum(r.context - r.cached for r in new)
            estimate += prefill_s
            emit(new)
        rows = [r for r in s.running if r.issued < r.limit]
        if rows:
            rows, _ = s.grow(rows)
            steps += 1
            row_steps += len(rows)
            estimate += step_s + sum(r.context for r in rows) * kv_bytes_per_token / bandwidth
            emit(rows)
    out = {"watermark": watermark, "admit_batch": s.admit_batch, "steps": steps, "prefills": prefills,
           "preemptions": s.preemptions, "prefill_tokens": prefill_tokens,
           "rows_a_step": round(row_steps / max(steps, 1), 1)}
    if step_s or prefill_s:
        out["estimate_s"] = round(estimate, 2)
        out["estimate_tok_s"] = round(sum(outs) / estimate)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    rollout = defaults("grpo")["rollout"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--lo", type=int, default=100)
    ap.add_argument("--hi", type=int, default=1024)
    ap.add_argument("--kv-cache-gib", type=float, nargs="+", default=[16.0, 4.0])
    ap.add_argument("--watermarks", type=float, nargs="+", default=[0.01, sched.WATERMARK_FRACTION, 0.2])
    ap.add_argument("--admit-batches", type=int, nargs="+", default=[rollout["admit_batch"]])
    ap.add_argument("--kv-cache-dtypes", nargs="+", choices=list(KV_CACHE_DTYPES),
                    default=[rollout["kv_cache_dtype"]])
    ap.add_argument("--block-size", type=int, default=rollout["block_size"])
    ap.add_argument("--max-num-seqs", type=int, default=rollout["max_num_seqs"])
    ap.add_argument("--step-ms", type=float, default=0.0, help="assumed cost of a decode step besides its KV reads")
    ap.add_argument("--prefill-ms", type=float, default=0.0, help="assumed GPU idle time a prefill costs")
    ap.add_argument("--bandwidth-tbs", type=float, default=3.7, help="assumed KV read bandwidth, TB/s")
    args = ap.parse_args(argv)
    cfg = preset_config(args.preset, PRESETS[args.preset]["vocab_size"] or 256)
    prompts, outs = workload(args.num_seqs, args.lo, args.hi, cfg.vocab_size)
    results = []
    for gib in args.kv_cache_gib:
        for kv_dtype in args.kv_cache_dtypes:
            per_block = block_bytes(cfg, pool_dtype(kv_dtype, torch.bfloat16), args.block_size)
            blocks = int(gib * (1 << 30)) // per_block
            for wm in args.watermarks:
                for batch in args.admit_batches:
                    r = {"kv_cache_gib": gib, "kv_cache_dtype": kv_dtype, "blocks": blocks,
                         **simulate(blocks, args.block_size, prompts, outs, wm, args.max_num_seqs,
                                    per_block // args.block_size, args.step_ms / 1e3, args.prefill_ms / 1e3,
                                    args.bandwidth_tbs * 1e12, batch)}
                    print(r, flush=True)
                    results.append(r)
    return results


if __name__ == "__main__":
    main()
