"""The peer on grpo-bench-v1: TRL's GRPOTrainer (HF generate, no vLLM, beta 0, bf16) on one GPU.

    python -m benchmarks.trl_grpo --preset qwen3-4b --model-dir /tmp/qwen3-4b --tokenizer DIR [--lora-rank 16]

The model is a random Qwen3 of fw's preset shape, written by transformers' `save_pretrained` (bf16) into
--model-dir unless a config.json is already there; the workload is fw's: 32 prompts x 8 samples, 256 new
tokens at temperature 1.0, one update on all 256 completions in 4 micro-batches of 64. Prints one JSON
line: seconds per optimizer step (median after the first), peak allocated and reserved GiB. Needs trl,
datasets (and peft with --lora-rank), which are not fw dependencies.

--prompts arithmetic takes the other TRL harness's prompts: addition problems in filler words, 116 or 117
tokens, so TRL left-pads some rows by one token (which makes its step much slower; docs/PROFILES.md).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import time
from pathlib import Path

import torch

from benchmarks.grpo_step import RandomReward
from framework.config import schema_path
from framework.models.presets import preset_config

PROMPT_TOKENS = 116


def lora_targets() -> list[str]:
    """PEFT's names of the seven projections, as the schema's default for model.policy.lora.targets."""
    lora = json.loads(schema_path().read_text())["properties"]["model"]["properties"]["policy"]["properties"]["lora"]
    return list(lora["properties"]["targets"]["default"])


FILLER = ("apples", "boxes", "trains", "numbers", "carefully", "then", "add", "the", "total")


def bench_prompts(n: int = 32, kind: str = "letters") -> list[str]:
    """n prompts. "letters": PROMPT_TOKENS single-letter words, one Qwen3 token each, as fw's prompts are one token
    per character with its built-in tokenizer. "arithmetic": the other harness's wording, an addition problem after
    90 filler words (116 or 117 Qwen3 tokens, so TRL left-pads some rows by one token)."""
    rng = random.Random("bench:trl")
    if kind == "letters":
        return [" ".join(rng.choice(string.ascii_lowercase) for _ in range(PROMPT_TOKENS)) for _ in range(n)]
    prompts = []
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        words = " ".join(rng.choice(FILLER) for _ in range(90))
        prompts.append(f"Problem {i}: {words}. What is {a} + {b}? Think step by step and give the answer.")
    return prompts


def write_random_model(preset: str, model_dir: Path, vocab_size: int = 151936) -> None:
    """A random-init bf16 Qwen3 of `preset`'s shape in HF layout, built on the GPU in bf16 (fast)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (model_dir / "config.json").is_file():
        return
    hf = preset_config(preset, vocab_size, eos_token_id=151645, pad_token_id=151643).to_hf("bfloat16")
    config = Qwen3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(str(model_dir), max_shard_size="5GB")
    del model
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-4b")
    ap.add_argument("--model-dir", required=True, type=Path)
    ap.add_argument("--tokenizer", required=True, type=Path, help="directory holding Qwen3's tokenizer.json")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on all seven projections (0 = full)")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", choices=("letters", "arithmetic"), default="letters")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)

    import trl
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    write_random_model(args.preset, args.model_dir)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(args.tokenizer / "tokenizer.json"),
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.padding_side = "left"
    tok.save_pretrained(str(args.model_dir))
    prompts = bench_prompts(kind=args.prompts)
    reward = RandomReward()

    def reward_fn(prompts: list, completions: list, **_: object) -> list[float]:
        return [reward(p, c, {}) for p, c in zip(prompts, completions)]

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.marks = [time.perf_counter()]

        def on_step_end(self, *_: object, **__: object) -> None:
            torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                                 target_modules=lora_targets(), task_type="CAUSAL_LM")
    cfg = GRPOConfig(output_dir="/tmp/trl-out", per_device_train_batch_size=64, gradient_accumulation_steps=4,
                     num_generations=8, max_completion_length=256, temperature=1.0, learning_rate=1e-6, beta=0.0,
                     bf16=True, gradient_checkpointing=args.gradient_checkpointing, max_steps=args.steps,
                     logging_steps=1, report_to="none", save_strategy="no", use_vllm=False, seed=0)
    timer = Timer()
    trainer = GRPOTrainer(model=str(args.model_dir), reward_funcs=reward_fn, args=cfg,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts * args.steps]),
                          processing_class=tok, callbacks=[timer], peft_config=peft_config)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steps = [b - a for a, b in zip(timer.marks, timer.marks[1:])]
    result = {"peer": f"trl {trl.__version__}", "preset": args.preset, "lora_rank": args.lora_rank,
              "prompt_tokens": sorted({len(tok(p).input_ids) for p in prompts}),
              "gradient_checkpointing": args.gradient_checkpointing, "prompts": args.prompts,
              "step_s": [round(s, 2) for s in steps],
              "median_step_s": statistics.median(steps[1:] or steps),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
              "reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
