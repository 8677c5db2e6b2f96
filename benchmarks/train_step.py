"""Training-step throughput at the Qwen3-0.6B shape: fw's model against HF transformers, same run.

One step = forward, token-mean cross-entropy, backward, clip, fused AdamW; autocast bf16 with fp32
master weights, for fw and HF alike (docs/BENCHMARKS.md). Prints one table; `--json` writes the rows.

    python -m benchmarks.train_step --batch 8 --seq 2048 --steps 10
    python -m benchmarks.train_step --impls fw,fw-packed --doc-len 512   # packed rows: varlen attention
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import ops_cuda
from benchmarks.profiling import top_kernels
from framework.models import Qwen3ForCausalLM
from framework.models.presets import PRESETS, preset_config

# Dense bf16 matrix rate measured on the H200 (docs/BENCHMARKS.md): the denominator of MFU.
PEAK_FLOPS = 785e12

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def flops_per_token(cfg, seq: float) -> float:
    """6 × params (matrix params, embedding counted once as the tied head) + causal attention over `seq` positions."""
    d = cfg.hidden_size
    per_layer = d * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * d + 3 * d * cfg.intermediate_size
    params = cfg.vocab_size * d + cfg.num_hidden_layers * per_layer
    return 6 * params + 6 * cfg.num_hidden_layers * seq * cfg.q_size


def attended_len(seq: int, doc_len: int) -> float:
    """The `seq` of `flops_per_token` for rows of `seq` tokens packed with documents of `doc_len` (the last one cut
    at the row's end; 0: one document a row): causal attention within each document costs the sum of the squares
    of their lengths, not the square of the row's."""
    if not doc_len:
        return float(seq)
    docs = [doc_len] * (seq // doc_len) + ([seq % doc_len] if seq % doc_len else [])
    return sum(n * n for n in docs) / seq


def fw_loss(model, ids, save_logits=None, positions=None):
    """The recipes' loss: logits kept for the backward unless the model recomputes activations (or
    save_logits=False, the fw-recomp impl, which changes that choice and nothing else). positions: packed
    rows (the fw-packed impl: SFT's path, varlen attention within each document)."""
    hidden = model(ids[:, :-1], position_ids=positions, return_hidden=True)
    keep = model.saves_logits if save_logits is None else save_logits
    logp, _ = ops_cuda.linear_logprob(hidden.reshape(-1, hidden.shape[-1]), model.lm_head_weight,
                                      ids[:, 1:].reshape(-1), save_logits=keep)
    return -logp.mean()


def hf_loss(model, ids):
    logits = model(input_ids=ids[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def run(name, model, loss_fn, batch, seq, steps, vocab, profile=0):
    model.to(DEVICE).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=CUDA)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    times = []
    CUDA and torch.cuda.reset_peak_memory_stats()

    def step(ids):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = loss_fn(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(steps + 3):
        ids = torch.randint(0, vocab, (batch, seq + 1), device=DEVICE, generator=gen)
        sync()
        t0 = time.perf_counter()
        loss = step(ids)
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0)
    med = statistics.median(times)
    if profile:
        print(f"{name}: one step's top {profile} kernels\n" + top_kernels(lambda: step(ids), profile), flush=True)
    return {"impl": name, "median_s": med, "tok_s": batch * seq / med, "peak_gib": peak, "loss": float(loss)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--impls", default="fw,fw-compile,fw-ckpt,hf",
                    help="comma list of fw, fw-compile, fw-ckpt (activation checkpointing), fw-recomp (loss logits "
                         "recomputed in the backward instead of kept), fw-packed (rows packed with documents "
                         "of --doc-len tokens, as SFT feeds them: varlen attention), fw-selective (fw-packed's rows "
                         "with gradient_checkpointing: selective, which also recomputes the loss logits), hf")
    ap.add_argument("--doc-len", type=int, default=0,
                    help="fw-packed: tokens per packed document (0: one document a row)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, print the N kernels of most device time in one more step of each impl")
    args = ap.parse_args(argv)
    cfg = preset_config(args.preset, PRESETS[args.preset]["vocab_size"] or 256)
    rows = []
    for impl in args.impls.split(","):
        torch.manual_seed(0)
        if impl.startswith("fw"):
            model = Qwen3ForCausalLM(cfg)
            if impl == "fw-ckpt":
                model.gradient_checkpointing = True
            if impl == "fw-compile":
                model.compile()
            loss_fn = (lambda m, ids: fw_loss(m, ids, save_logits=False)) if impl == "fw-recomp" else fw_loss
            if impl in ("fw-packed", "fw-selective"):
                positions = (torch.arange(args.seq, device=DEVICE) % (args.doc_len or args.seq)).expand(
                    args.batch, args.seq)
                loss_fn = lambda m, ids, p=positions: fw_loss(m, ids, positions=p)
            if impl == "fw-selective":
                model.gradient_checkpointing = "selective"
        else:
            import transformers
            hf_cfg = transformers.Qwen3Config(**cfg.to_hf(), attn_implementation="sdpa")
            model = transformers.Qwen3ForCausalLM(hf_cfg)
            loss_fn = hf_loss
        try:
            row = run(impl, model, loss_fn, args.batch, args.seq, args.steps, cfg.vocab_size, args.profile)
        except torch.cuda.OutOfMemoryError as e:
            row = {"impl": impl, "error": f"OOM: {str(e).splitlines()[0]}"}
        del model
        CUDA and torch.cuda.empty_cache()
        if "tok_s" in row:   # the packed impls' attention spans their documents, not the whole row
            packed = impl in ("fw-packed", "fw-selective")
            row["mfu"] = row["tok_s"] * flops_per_token(cfg, attended_len(args.seq, args.doc_len if packed else 0)) \
                / PEAK_FLOPS
        rows.append(row)
        print(json.dumps(row), flush=True)
    hf = next((r for r in rows if r["impl"] == "hf" and "tok_s" in r), None)
    print(f"\nTraining step, {args.preset}, {args.batch}x{args.seq} tokens, autocast bf16, fused AdamW, "
          f"{(torch.cuda.get_device_name() if CUDA else 'CPU')}")
    print(f"{'impl':<12}{'median s':>10}{'tok/s':>10}{'MFU':>8}{'peak GiB':>10}{'vs HF':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<12}{r['error']}")
            continue
        ratio = f"{r['tok_s'] / hf['tok_s']:.2f}x" if hf else "-"
        print(f"{r['impl']:<12}{r['median_s']:>10.3f}{r['tok_s']:>10.0f}{r['mfu']:>8.1%}{r['peak_gib']:>10.1f}"
              f"{ratio:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
