"""Compare two runs' metrics.jsonl: per-step relative differences and the throughput ratio.

    python -m benchmarks.compare_runs RUN_A RUN_B [--keys loss,grad_norm] [--gpus-b-over-a 2] [--skip 1]

For the multi-GPU checks (docs/MULTI_GPU.md): RUN_A on 1 GPU, RUN_B on N GPUs. With the same global batch
the per-step values should agree; with the same per-GPU batch, `efficiency` is the tokens/s scaling
efficiency, median tokens_per_s(B) / (N x median tokens_per_s(A)) over the steps after the first
`--skip` (warm-up). Prints one JSON object; exit status 1 when `--rtol` is given and exceeded.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from framework.metrics import read_metrics


def compare(a_dir: str, b_dir: str, keys: list[str], gpus_b_over_a: float, skip: int) -> dict:
    a = {r["step"]: r for r in read_metrics(Path(a_dir) / "metrics.jsonl")}
    b = {r["step"]: r for r in read_metrics(Path(b_dir) / "metrics.jsonl")}
    steps = sorted(set(a) & set(b))
    rel = {}
    for key in keys:
        rel[key] = {s: abs(b[s][key] - a[s][key]) / max(abs(a[s][key]), 1e-12)
                    for s in steps if key in a[s] and key in b[s]}
    out = {"steps": steps, "max_rel": {k: max(v.values(), default=None) for k, v in rel.items()}, "rel": rel}
    tps = [[r["tokens_per_s"] for s, r in sorted(run.items()) if s > skip and "tokens_per_s" in r] for run in (a, b)]
    if all(tps):
        ta, tb = statistics.median(tps[0]), statistics.median(tps[1])
        out.update(tokens_per_s_a=ta, tokens_per_s_b=tb, efficiency=tb / (gpus_b_over_a * ta))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--keys", default="loss,grad_norm")
    p.add_argument("--gpus-b-over-a", type=float, default=1.0)
    p.add_argument("--skip", type=int, default=1)
    p.add_argument("--rtol", type=float, default=None)
    args = p.parse_args(argv)
    out = compare(args.run_a, args.run_b, [k for k in args.keys.split(",") if k], args.gpus_b_over_a, args.skip)
    print(json.dumps(out, indent=1, default=str))
    worst = [v for v in out["max_rel"].values() if v is not None]
    if not out["steps"]:
        print("no common steps", file=sys.stderr)
        return 1
    return 1 if args.rtol is not None and worst and max(worst) > args.rtol else 0


if __name__ == "__main__":
    sys.exit(main())
