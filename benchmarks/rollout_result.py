"""Host time of a rollout's last stage: its rows' Python lists of tokens and logprobs made into padded tensors, and
their texts decoded (`framework.rollout.engine._result`), at grpo-bench's shape by default. The device idles
through it inside an RL step, so it counts in the step's time; this measures it on the host alone (no device).

    python -m benchmarks.rollout_result [--rows 256] [--prompt-len 116] [--new-tokens 256] [--rounds 9]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from framework.config import load_config
from framework.rollout.engine import RowState, _result
from framework.tokenizer import build_tokenizer


def rows(n: int, prompt_len: int, new_tokens: int, vocab: int, seed: int = 0) -> list[RowState]:
    """`n` finished rows of random prompt and completion ids (the completions run to their limit)."""
    rng = random.Random(seed)
    out = []
    for b in range(n):
        s = RowState(row=b, prompt=[rng.randrange(vocab) for _ in range(prompt_len)], limit=new_tokens)
        s.tokens = [rng.randrange(vocab) for _ in range(new_tokens)]
        s.logprobs = [-10 * rng.random() for _ in range(new_tokens)]
        s.reason = "length"
        out.append(s)
    return out


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=116)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936, help="ids drawn below this (Qwen3's vocabulary)")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    tok = build_tokenizer(load_config(["benchmarks/grpo_bench.yaml"], []))
    seqs = rows(args.rows, args.prompt_len, args.new_tokens, args.vocab)
    prompts = [s.prompt for s in seqs]
    times = []
    for _ in range(args.rounds + 1):   # the first: warm-up
        t = time.perf_counter()
        _result(seqs, prompts, 0, tok, (), torch.device("cpu"), 0)
        times.append(time.perf_counter() - t)
    out = (f"rollout result of {args.rows} rows x ({args.prompt_len} + {args.new_tokens}) tokens: median "
           f"{statistics.median(times[1:]) * 1e3:.2f} ms over {args.rounds} rounds (min {min(times[1:]) * 1e3:.2f})")
    print(out)
    return out


if __name__ == "__main__":
    main()
