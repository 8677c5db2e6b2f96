"""The scaling table: grpo-bench-v1 and packed SFT from Qwen3-0.6B to 8B on one GPU, beside the memory plan.

    python -m benchmarks.scale [--rows grpo-0.6b,grpo-4b,...] [--steps 3] [--out DIR]
    python -m benchmarks.scale --peers --tokenizer DIR      # TRL's GRPOTrainer on the rows that name a peer

Each row is a real `fw fit` (benchmarks.fit_timing) in its own process, so every peak starts from an empty
GPU: one warm-up step, then `--steps` timed steps whose median is reported, with the peak allocated and
reserved memory and `fw plan`'s estimate for the same config. A row's settings are part of its definition
and printed with it. `--peers` runs benchmarks.trl_grpo for the rows that name a peer workload instead.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

GRPO = "benchmarks/grpo_bench.yaml"
SFT = "recipes/sft.yaml"
# Weights, gradients and moments in bfloat16/8 bits: 6 bytes per parameter instead of 16.
LEAN = ("--model.policy.dtype=bfloat16", "--trainer.precision=bf16-true", "--optimizer.name=adamw8bit",
        "--optimizer.stochastic_rounding=true")
SELECTIVE = "--model.policy.gradient_checkpointing=selective"
# the rows with a tight memory goal hand the rollout's KV cache back after each rollout, so that the update gets its
# memory
HAND_BACK = "--rollout.keep_engine=false"


@dataclass(frozen=True)
class Row:
    name: str
    config: str
    overrides: tuple[str, ...]
    goal_peak_gib: float | None = None
    goal_step_s: float | None = None
    goal_tokens_per_s: float | None = None
    peer: dict = field(default_factory=dict)   # benchmarks.trl_grpo arguments for the same workload


ROWS = [
    Row("grpo-0.6b", GRPO, (*LEAN, HAND_BACK, "--trainer.accumulate_grad_batches=8"), goal_peak_gib=24,
        goal_step_s=2.4),
    # every completion after its own copy of the prompt (grpo.shared_prompt auto lays it out once here)
    Row("grpo-0.6b-unshared", GRPO, (*LEAN, HAND_BACK, "--trainer.accumulate_grad_batches=8",
                                     "--grpo.shared_prompt=false"), goal_peak_gib=24, goal_step_s=2.4),
    # keep_engine auto: the KV cache and decode graphs kept from one rollout to the next, when the job fits so
    Row("grpo-0.6b-kept", GRPO, (*LEAN, "--trainer.accumulate_grad_batches=8")),
    Row("grpo-0.6b-fp32-master", GRPO, ()),   # the benchmark's own config: float32 weights, bf16-mixed
    # selective recomputation buys micro-batches twice as large in about the same memory
    Row("grpo-0.6b-selective", GRPO, (*LEAN, SELECTIVE, HAND_BACK, "--trainer.accumulate_grad_batches=4"),
        goal_peak_gib=24, goal_step_s=2.4),
    Row("grpo-4b", GRPO, ("--model.policy.preset=qwen3-4b", *LEAN, "--trainer.accumulate_grad_batches=16"),
        goal_peak_gib=80, goal_step_s=8, peer={"preset": "qwen3-4b", "gradient_checkpointing": True}),
    # The other TRL harness's prompts are 116 or 117 tokens, so TRL left-pads some rows; fw lays out ragged prompts
    # without padding, and 117-token prompts bound its cost on that workload from above.
    Row("grpo-4b-117", GRPO, ("--model.policy.preset=qwen3-4b", *LEAN, "--trainer.accumulate_grad_batches=16",
                              "--data.task.init_args={length: 117}"), goal_peak_gib=80, goal_step_s=8,
        peer={"preset": "qwen3-4b", "gradient_checkpointing": True, "prompts": "arithmetic"}),
    # the update without grpo.shared_prompt's layout: 27% more tokens at grpo-bench's shape
    Row("grpo-4b-unshared", GRPO, ("--model.policy.preset=qwen3-4b", *LEAN, "--trainer.accumulate_grad_batches=16",
                                   "--grpo.shared_prompt=false"), goal_peak_gib=80, goal_step_s=8),
    Row("grpo-4b-selective", GRPO, ("--model.policy.preset=qwen3-4b", *LEAN, SELECTIVE,
                                    "--trainer.accumulate_grad_batches=8"), goal_peak_gib=80, goal_step_s=8),
    Row("grpo-8b", GRPO, ("--model.policy.preset=qwen3-8b", *LEAN, "--trainer.accumulate_grad_batches=16"),
        goal_step_s=20),
    # a 48 GiB goal: the engine's KV cache and graphs are handed back for the update (kept, the peak is 59 GiB)
    Row("grpo-8b-lora16", GRPO, ("--model.policy.preset=qwen3-8b", "--model.policy.dtype=bfloat16",
                                 "--model.policy.lora={rank: 16}", HAND_BACK, "--trainer.accumulate_grad_batches=16"),
        goal_peak_gib=48, goal_step_s=12,
        # TRL runs out of memory on this row without gradient checkpointing
        peer={"preset": "qwen3-8b", "lora_rank": 16, "gradient_checkpointing": True}),
    Row("sft-8b", SFT, ("--model.policy.preset=qwen3-8b", *LEAN, "--data.max_seq_len=2048", "--data.batch_size=2",
                        "--trainer.accumulate_grad_batches=4", "--checkpoint.every_n_steps=1000"),
        goal_tokens_per_s=6000),
]


def _records(run_dir: Path) -> list[dict]:
    file = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()] if file.is_file() else []


def run_fw(row: Row, steps: int, out: Path, timeout_s: int, keep_checkpoints: bool = False) -> dict:
    """One fw row in a fresh process: median step time of the steps after the first, peaks, plan. The row's
    checkpoints are deleted once measured unless ``keep_checkpoints``: an 8B row writes 31 GiB, and the next
    row's final save must find the disk free."""
    from framework.config import load_config
    from framework.memory_plan import estimate

    run_dir = out / row.name
    args = ["--config", row.config, *row.overrides, f"--trainer.max_steps={steps + 1}",
            "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", f"--run_dir={run_dir}"]
    plan = estimate(load_config([row.config], [a for a in args[2:] if a.startswith("--") and "=" in a]))
    # torch's allocator only: what max_memory_allocated measures (the CUDA context lies outside it)
    result = {"row": row.name, "overrides": " ".join(row.overrides), "plan_gib": round(plan.allocated_bytes / 2**30, 1),
              "plan_fits": plan.fits}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.fit_timing", *args], check=False, capture_output=True,
                              text=True, timeout=timeout_s)
        result["rc"] = proc.returncode
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        tail = lines[-3:]
        saves = [line.removeprefix("fw: ") for line in lines if line.startswith("fw: saved ")]
        if saves:   # the final checkpoint's write against its whole save (framework.checkpoint's report)
            result["last_save"] = saves[-1]
    except subprocess.TimeoutExpired:
        result["rc"], tail = "timeout", [f"over {timeout_s} s"]
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    ended_at = time.time()
    times_file = run_dir / "step_times.json"
    if times_file.is_file():
        times = json.loads(times_file.read_text())
        # after the last step: the final checkpoint's save (and the process's exit)
        result["after_last_step_s"] = round(ended_at - times["last_step_at"], 1)
        saved = sorted((run_dir / "checkpoints").glob("step-*"))
        if saved:
            result["checkpoint_gib"] = round(sum(f.stat().st_size for f in saved[-1].rglob("*") if f.is_file())
                                             / 2**30, 1)
        later = times["step_seconds"][1:] or times["step_seconds"]
        result.update(step_s=round(statistics.median(later), 3), rounds=len(later),
                      peak_gib=round(times["peak_gib"], 1), reserved_gib=round(times["reserved_gib"], 1))
        result["plan_error"] = round(result["plan_gib"] / times["peak_gib"] - 1, 3)
    records = _records(run_dir)
    for key, name, digits in (("tokens_per_s", "tokens_per_s", None), ("rollout/seconds", "rollout_s", 3)):
        values = [r[key] for r in records if key in r][1:]
        if values:
            result[name] = round(statistics.median(values), digits)
    if not keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if result["rc"] != 0:
        result["error"] = " | ".join(tail)
    return result


def run_peer(row: Row, tokenizer: Path, out: Path, timeout_s: int) -> dict:
    p = row.peer
    args = ["--preset", p["preset"], "--model-dir", f"/tmp/hf-{p['preset']}", "--tokenizer", str(tokenizer),
            "--json", str(out / f"peer-{row.name}.json")]
    if p.get("lora_rank"):
        args += ["--lora-rank", str(p["lora_rank"])]
    if p.get("gradient_checkpointing"):
        args.append("--gradient-checkpointing")
    if p.get("prompts"):
        args += ["--prompts", p["prompts"]]
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.trl_grpo", *args], check=False, capture_output=True,
                              text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"row": row.name, "peer_error": f"over {timeout_s} s"}
    file = out / f"peer-{row.name}.json"
    if proc.returncode != 0 or not file.is_file():
        return {"row": row.name, "peer_error": " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])}
    return {"row": row.name, **{f"peer_{k}": v for k, v in json.loads(file.read_text()).items()}}


def _goal(row: Row, r: dict) -> str:
    checks = []
    if row.goal_peak_gib is not None and "peak_gib" in r:
        checks.append(("peak", r["peak_gib"] <= row.goal_peak_gib, f"<= {row.goal_peak_gib} GiB"))
    if row.goal_step_s is not None and "step_s" in r:
        checks.append(("step", r["step_s"] <= row.goal_step_s, f"<= {row.goal_step_s} s"))
    if row.goal_tokens_per_s is not None and "tokens_per_s" in r:
        checks.append(("tok/s", r["tokens_per_s"] >= row.goal_tokens_per_s, f">= {row.goal_tokens_per_s:g}"))
    if not checks:
        return "none (reference row)"
    return ", ".join(f"{what} {want}: {'met' if ok else 'MISSED'}" for what, ok, want in checks)


def _save(r: dict) -> str:
    if "after_last_step_s" not in r:
        return "-"
    size = f"{r['checkpoint_gib']} GiB in " if "checkpoint_gib" in r else ""
    detail = f" ({r['last_save']})" if "last_save" in r else ""
    return f"{size}{r['after_last_step_s']} s{detail}"


def table(results: list[dict]) -> str:
    rows = {r.name: r for r in ROWS}
    head = ("job", "s/step", "of which rollout", "tokens/s", "peak GiB", "reserved GiB", "plan GiB (error)", "goal",
            "final save", "settings")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "rc" not in r:
            continue
        plan = f"{r['plan_gib']} ({r['plan_error']:+.0%})" if "plan_error" in r else f"{r['plan_gib']}"
        lines.append(f"| {r['row']} | {r.get('step_s', r.get('error', '-'))} | {r.get('rollout_s', '-')} | "
                     f"{r.get('tokens_per_s', '-')} | "
                     f"{r.get('peak_gib', '-')} | {r.get('reserved_gib', '-')} | {plan} | "
                     f"{_goal(rows[r['row']], r)} | {_save(r)} | `{r['overrides']}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(r.name for r in ROWS))
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step")
    ap.add_argument("--out", type=Path, default=Path("/tmp/scale"))
    ap.add_argument("--timeout", type=int, default=300, help="seconds per row")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep each row's checkpoints (deleted once "
                    "the row is measured)")
    ap.add_argument("--peers", action="store_true", help="run TRL on the rows that name a peer workload")
    ap.add_argument("--tokenizer", type=Path, help="directory with Qwen3's tokenizer.json (for --peers)")
    args = ap.parse_args(argv)
    wanted = args.rows.split(",")
    unknown = sorted(set(wanted) - {r.name for r in ROWS})
    if unknown:
        ap.error(f"unknown rows {unknown}; rows are {[r.name for r in ROWS]}")
    if args.peers and args.tokenizer is None:
        ap.error("--peers needs --tokenizer DIR")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for row in (r for r in ROWS if r.name in wanted):
        if args.peers:
            if row.peer:
                results.append(run_peer(row, args.tokenizer, args.out, args.timeout))
        else:
            results.append(run_fw(row, args.steps, args.out, args.timeout, args.keep_checkpoints))
        print(json.dumps(results[-1]) if results else "", flush=True)
    (args.out / ("peers.json" if args.peers else "scale.json")).write_text(json.dumps(results, indent=1) + "\n")
    if not args.peers:
        print("\n" + table(results), flush=True)
    return results


if __name__ == "__main__":
    main()
