"""Loading a sharded Hugging Face checkpoint: time and the host / GPU memory it takes on the way.

    python -m benchmarks.hf_load --preset qwen3-8b --model-dir /tmp/hf-qwen3-8b [--dtype bfloat16]

The checkpoint is a random Qwen3 of the preset's shape written by transformers' `save_pretrained`
(sharded safetensors) unless --model-dir already holds one. fw's `load_pretrained` then streams it into
`--dtype` straight onto the GPU, as `fw fit` does, one tensor at a time through host memory. Host memory
is sampled as the process's anonymous resident set (file pages mapped from the shards are the page
cache, not a copy): a full host copy would show as a peak near the weights' size.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Self

import torch

from benchmarks.trl_grpo import write_random_model


def _anon_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024 / 2**30
    return 0.0


class PeakSampler:
    """The highest anonymous RSS seen while it runs, sampled every 20 ms."""

    def __init__(self) -> None:
        self.peak = _anon_rss_gib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _anon_rss_gib())

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon_rss_gib())


def main(argv: list[str] | None = None) -> dict:
    from framework.models.hf_io import checkpoint_files, load_pretrained

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--model-dir", required=True, type=Path)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    write_random_model(args.preset, args.model_dir)
    written_s = time.perf_counter() - t0
    files = checkpoint_files(args.model_dir)
    size_gib = sum(f.stat().st_size for f in files) / 2**30
    base = _anon_rss_gib()
    torch.cuda.reset_peak_memory_stats()
    with PeakSampler() as host:
        t0 = time.perf_counter()
        model = load_pretrained(args.model_dir, args.dtype, device="cuda")
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    result = {"preset": args.preset, "dtype": args.dtype, "shards": len(files), "checkpoint_gib": round(size_gib, 2),
              "weights_gib": round(weights_gib, 2), "write_s": round(written_s, 1), "load_s": round(load_s, 1),
              "load_gib_per_s": round(size_gib / load_s, 2),
              "host_peak_gib": round(host.peak - base, 2),
              "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
