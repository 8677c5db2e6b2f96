"""Causal attention forward + backward over packed documents, by backend: which kernel should serve
fw::varlen_attention on this GPU.

    python -m benchmarks.ops.varlen_backends                      # 8 x 2048 tokens in 512-token documents
    python -m benchmarks.ops.varlen_backends --docs 372 --rows 64 # grpo-bench's micro-batch: 64 rows of 372

Backends, all on the same q, k, v (bf16, Qwen3-0.6B's 16 query and 8 key/value heads of 128):
- `fw`: fw::varlen_attention (PyTorch's varlen flash attention through aten, what fw runs);
- `sdpa-rows`: the documents as equal rows [docs, H, T, D] through scaled_dot_product_attention, causal, with
  torch's own backend choice (what a padded layout without padding gets);
- `sdpa-flash`, `sdpa-cudnn`, `sdpa-efficient`: the same, one SDPA backend forced;
- `cudnn-varlen`: aten._cudnn_attention_forward over cu_seqlens through ATen's autograd, where this torch has it
  (the nested-tensor path); `cudnn-varlen-expanded`: the same with k and v expanded to the query heads first;
- `flex`: FlexAttention, compiled, over the packed tokens as one row with a causal document block mask.
Before timing, each cu_seqlens backend runs once on documents of unequal lengths against the float64 reference.
Times are CUDA-event medians of `--reps` calls after a warm-up, each row in turn, `--rounds` rounds; equal-length
documents so that every backend computes the same thing.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ops_cuda
from ops_cuda.varlen_attention import varlen_attention_reference

HQ, HK, D = 16, 8, 128


def time_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def make(rows: int, doc: int, per_row: int):
    """q, k, v [N, H, D] of rows x per_row documents of `doc` tokens, and their int32 cu_seqlens."""
    n_docs = rows * per_row
    N = n_docs * doc
    q = torch.randn(N, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(N, HK, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(N, HK, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.arange(0, N + 1, doc, device="cuda", dtype=torch.int32)
    return q, k, v, cu, n_docs


def backends(q, k, v, cu, doc: int, n_docs: int, scale: float) -> dict:
    g = torch.randn_like(q)

    def fw():
        out = ops_cuda.varlen_attention(q, k, v, cu, doc, scale)
        torch.autograd.grad(out, (q, k, v), g)

    def as_rows(t: torch.Tensor) -> torch.Tensor:
        return t.view(n_docs, doc, t.shape[1], D).transpose(1, 2)

    def sdpa(backend=None):
        def run():
            ctx = sdpa_kernel(backend) if backend is not None else torch.enable_grad()
            with ctx:
                out = F.scaled_dot_product_attention(as_rows(q), as_rows(k), as_rows(v), is_causal=True, scale=scale,
                                                     enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), as_rows(g))
        return run

    rows = {"fw": fw, "sdpa-rows": sdpa(), "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION)}
    if hasattr(torch.ops.aten, "_cudnn_attention_forward"):
        for name, gqa in (("cudnn-varlen", True), ("cudnn-varlen-expanded", False)):
            rows[name] = cudnn_varlen_run(q, k, v, g, cu, doc, scale, gqa)
    try:
        rows["flex"] = flex_document(q, k, v, g, doc, n_docs, scale)
    except Exception as e:  # noqa: BLE001 (a torch without FlexAttention, or whose mask building fails here)
        print(f"  flex: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return rows


def cudnn_varlen(q, k, v, cu, max_len: int, scale: float, gqa: bool = True) -> torch.Tensor:
    """cuDNN's varlen attention over cu_seqlens (aten._cudnn_attention_forward, the nested-tensor path), through
    ATen's autograd: its backward takes no bias from Python. gqa=False expands k and v to the query heads first."""
    if not gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False,
                                                   scale=scale)[0]


def cudnn_varlen_run(q, k, v, g, cu, doc: int, scale: float, gqa: bool):
    def run():
        out = cudnn_varlen(q, k, v, cu, doc, scale, gqa)
        torch.autograd.grad(out, (q, k, v), g)
    return run


def check_ragged(scale: float) -> None:
    """Each cu_seqlens backend against the float64 reference on documents of unequal lengths: output and
    gradients, the largest error relative to the reference's largest magnitude."""
    torch.manual_seed(1)
    lens = [1, 37, 372, 116, 255, 64, 300]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    N = int(cu[-1])
    q, k, v = (torch.randn(N, h, D, device="cuda", dtype=torch.float64, requires_grad=True) for h in (HQ, HK, HK))
    g = torch.randn(N, HQ, D, device="cuda", dtype=torch.float64)
    ref = varlen_attention_reference(q, k, v, cu.cpu(), max(lens), scale)[0]
    want = (ref, *torch.autograd.grad(ref, (q, k, v), g))
    candidates = {"fw": lambda a, b, c: ops_cuda.varlen_attention(a, b, c, cu, max(lens), scale)}
    if hasattr(torch.ops.aten, "_cudnn_attention_forward"):
        candidates["cudnn-varlen"] = lambda a, b, c: cudnn_varlen(a, b, c, cu, max(lens), scale, True)
        candidates["cudnn-varlen-expanded"] = lambda a, b, c: cudnn_varlen(a, b, c, cu, max(lens), scale, False)
    for name, fn in candidates.items():
        try:
            x = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
            out = fn(*x)
            got = (out, *torch.autograd.grad(out, x, g.bfloat16()))
            errs = [float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max())
                    for a, b in zip(got, want)]
            print(f"  ragged check {name}: relative max error out {errs[0]:.1e}, dq {errs[1]:.1e}, dk {errs[2]:.1e}, "
                  f"dv {errs[3]:.1e}")
        except Exception as e:  # noqa: BLE001 (a backend that does not take these inputs: say so and go on)
            print(f"  ragged check {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")


def flex_document(q, k, v, g, doc: int, n_docs: int, scale: float):
    """FlexAttention (compiled) over the packed tokens as one row, with a causal document block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc_id = torch.arange(n_docs, device="cuda").repeat_interleave(doc)

    def document_causal(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

    N = q.shape[0]
    mask = create_block_mask(document_causal, 1, None, N, N, device="cuda")
    attend = torch.compile(flex_attention, dynamic=False)

    def as_row(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1)[None]

    def run():
        out = attend(as_row(q), as_row(k), as_row(v), block_mask=mask, scale=scale, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), as_row(g))
    return run


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048, help="tokens a row")
    ap.add_argument("--docs", type=int, default=512, help="tokens a document (it divides --seq)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    torch.manual_seed(0)
    per_row = max(1, args.seq // args.docs)
    q, k, v, cu, n_docs = make(args.rows, args.docs, per_row)
    scale = D ** -0.5
    check_ragged(scale)
    runs = backends(q, k, v, cu, args.docs, n_docs, scale)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            try:
                times[name].append(time_ms(fn, args.reps))
            except Exception as e:  # noqa: BLE001 (a backend that does not take these inputs here: a row of NaN)
                times[name].append(float("nan"))
                print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    tokens = q.shape[0]
    fw_ms = statistics.median(times["fw"])
    print(f"causal attention fwd+bwd, {tokens} tokens in {n_docs} documents of {args.docs}, "
          f"{HQ}/{HK} heads of {D}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'backend':<16}{'median ms':>10}{'vs fw':>8}   rounds")
    out = []
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<16}{med:>10.3f}{fw_ms / med:>8.2f}   " + " ".join(f"{t:.3f}" for t in ts))
        out.append({"backend": name, "median_ms": med, "rounds": ts})
    return out


if __name__ == "__main__":
    main()
