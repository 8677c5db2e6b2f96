"""The host's time to queue one GRPO micro-batch's forward (and backward), against the device's time to run it.

One micro-batch of grpo-bench's update: --rows completions of --completion tokens after --prompt-token prompts, in
groups of --group rows that share their prompt (the shared layout, recipes/rl.py `shared_prompt_layout`), random
weights, bf16 autocast on CUDA. Each round starts with the device idle: "host" is when the call returned, "device"
when the device finished it (median of --rounds, after --warmup calls). "layout" times the layout alone. With
--profile-host, the torch ops of most host time in one forward (self CPU, the torch profiler's) follow.

    python -m benchmarks.forward_host [--preset qwen3-0.6b] [--rows 64] [--rounds 5] [--profile-host]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from framework.models import Qwen3ForCausalLM
from framework.models.presets import PRESETS, preset_config
from recipes.rl import completion_logprobs, response_layout

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def timed(f: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median ms until `f` returned, and until the device finished it, each round from an idle device."""
    host, device = [], []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        f()
        host.append(1e3 * (time.perf_counter() - t0))
        sync()
        device.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(host), statistics.median(device)


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=116)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-host", action="store_true")
    args = ap.parse_args(argv)
    cfg = preset_config(args.preset, PRESETS[args.preset]["vocab_size"] or 256)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(cfg).train()
    rows = torch.arange(args.rows)
    groups = rows // args.group
    tokens = torch.randint(0, cfg.vocab_size, (args.rows, args.prompt + args.completion))
    tokens[:, :args.prompt] = tokens[groups * args.group, :args.prompt]
    tokens = tokens.to(DEVICE)
    prompt_lens, completion_lens = torch.full((args.rows,), args.prompt), torch.full((args.rows,), args.completion)
    autocast = torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=CUDA)

    def forward() -> torch.Tensor:
        with autocast:
            return completion_logprobs(model, tokens, prompt_lens, completion_lens, args.completion, 1.0,
                                       groups=groups)[0]

    def forward_backward() -> None:
        forward().sum().backward()

    calls = {"layout": lambda: response_layout(tokens, prompt_lens, completion_lens, args.completion, groups=groups),
             "forward": forward, "forward + backward": forward_backward}
    for _ in range(args.warmup):
        forward_backward()
    results = {name: timed(f, args.rounds) for name, f in calls.items()}
    model.zero_grad(set_to_none=True)
    print(f"one micro-batch, {args.preset}: {args.rows} rows of {args.prompt} + {args.completion} tokens, groups of "
          f"{args.group} sharing their prompt, {torch.cuda.get_device_name() if CUDA else 'CPU'}; ms, median of "
          f"{args.rounds}, each from an idle device")
    print("| call | host returned | device done |\n|---|---|---|")
    for name, (host, device) in results.items():
        print(f"| {name} | {host:.2f} | {device:.2f} |")
    if args.profile_host:
        sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            forward()
        sync()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return results


if __name__ == "__main__":
    main()
