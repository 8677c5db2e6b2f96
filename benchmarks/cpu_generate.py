"""fw's `generate` against HF `generate` on CPU: a 10M-parameter Qwen3 (hidden 64, 2 layers) with the real
151,936-token vocabulary, 128 prompts x 32 new tokens, sampling at temperature 1, EOS ignored. Each runs once
untimed (the process's first call pays its imports and first allocations), then `--rounds` timed calls; prints
the median and every round of each, the time of fw's sampler alone on one step's logits against
`torch.multinomial` (best of 3), and the process's peak resident memory after each (fw runs first, so its figure
is its own).

    python -m benchmarks.cpu_generate [--rows 128] [--new 32] [--prompt-len 16] [--threads N] [--rounds 3]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import torch

from framework.models import Qwen3ForCausalLM
from framework.models.qwen3_config import Qwen3Config
from framework.rollout import SamplingParams, generate
from framework.rollout.sampling import draw

VOCAB = 151936


def model_config() -> Qwen3Config:
    return Qwen3Config.from_hf({"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 192,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 16, "tie_word_embeddings": True, "max_position_embeddings": 512})


def peak_rss_gib() -> float:
    """The process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rounds(n: int, fn: Callable[[], object]) -> list[float]:
    """Seconds of `n` timed calls after one untimed call."""
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_of(n: int, fn: Callable[[], object]) -> float:
    """The fastest of `n` timed calls after one warm-up: on a shared machine the others measure its load."""
    return min(rounds(n, fn))


def show(times: list[float]) -> str:
    return f"{statistics.median(times):8.3f} s (rounds {', '.join(f'{t:.3f}' for t in times)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(model_config()).eval()
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, VOCAB, (args.rows, args.prompt_len), generator=g)
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0)

    fw_s = rounds(args.rounds, lambda: generate(model, prompts.tolist(), params, seed=0))
    fw_rss = peak_rss_gib()

    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**model.config.to_hf()))
    hf.load_state_dict(model.hf_state_dict(), strict=False)   # tied head: lm_head comes from the embedding
    hf.eval()

    @torch.no_grad()
    def hf_generate() -> None:
        hf.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                    top_k=0, top_p=1.0, max_new_tokens=args.new, min_new_tokens=args.new, eos_token_id=None,
                    pad_token_id=0)

    hf_s = rounds(args.rounds, hf_generate)
    hf_rss = peak_rss_gib()

    logits = torch.randn(args.rows, VOCAB, generator=g) * 3
    counters = torch.stack([torch.arange(args.rows), torch.zeros(args.rows, dtype=torch.long)], 1)
    sampler_s = best_of(3, lambda: draw(logits, params, 1, counters))
    multinomial_s = best_of(3, lambda: torch.multinomial(torch.softmax(logits, -1), 1))
    print(f"{params_m:.1f}M parameters, vocab {VOCAB}, {args.rows} x {args.new} new tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"fw generate  {show(fw_s)}   peak RSS {fw_rss:.2f} GiB")
    print(f"HF generate  {show(hf_s)}   peak RSS {hf_rss:.2f} GiB (the process so far)")
    print(f"fw sampler   {sampler_s:8.3f} s a step   torch.multinomial {multinomial_s:8.3f} s")


if __name__ == "__main__":
    main()
