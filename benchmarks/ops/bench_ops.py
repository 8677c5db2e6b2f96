"""Benchmark every fw operator against eager torch and torch.compile of the same maths, at Qwen3-0.6B
shapes (training 8 x 2048 tokens, decode batch 1..256); one table.

    python -m benchmarks.ops.bench_ops            (needs a CUDA GPU)
    python -m benchmarks.ops.bench_ops --only rms_norm,swiglu --fw-only     (a subset, without the baselines)

Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph: GPU time without Python and
launch overhead; rows marked * could not be captured and use do_bench's plain launches instead), taken for fw,
eager and compile in turn, --rounds times (3; the linear_logprob rows once), so that a drift of the GPU's clocks
over a row reaches all three; the table gives the median of the rounds. The last column is the fw op launched
plainly from Python (do_bench), which adds the dispatcher/autograd overhead.
GB/s counts the bytes that must move once (inputs read + outputs written), TFLOP/s the GEMM FLOPs; the
ceilings are COPY_BW and BF16_FLOPS below, the benchmark GPU's copy bandwidth and dense bf16 rate.
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

import ops_cuda
from ops_cuda import library
from ops_cuda.add_rms_norm import add_rms_norm_reference
from ops_cuda.qk_norm_rope import qk_norm_rope_reference
from ops_cuda.qk_norm_rope_write import qk_norm_rope_write_reference
from ops_cuda.rope import rope_reference

COPY_BW = 4.26e12
BF16_FLOPS = 785e12
DEV = "cuda"
BF = torch.bfloat16


def bench(fn, reps_ms: int = 200) -> float:
    """Median ms of plain launches (CUDA events around each call)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=reps_ms, return_mode="median")


def bench_graph(fn, reps_ms: int = 100) -> tuple[float, bool]:
    """(median ms of CUDA-graph replays, True), or (plain-launch median, False) if fn cannot be captured."""
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=reps_ms, return_mode="median"), True
    except Exception as e:  # noqa: BLE001 (e.g. a host sync inside fn): fall back, and say so in the table
        print(f"  (no CUDA graph: {type(e).__name__}: {str(e)[:120]})")
        torch.cuda.synchronize()
        return bench(fn), False


def compiled(fn):
    return torch.compile(fn, fullgraph=False, dynamic=False)


def fwd_bwd(fn, inputs, grads):
    """A closure running fn forward and backward (grads w.r.t. inputs that require grad)."""
    def run():
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(outs, [i for i in inputs if isinstance(i, torch.Tensor) and i.requires_grad], grads)
    return run


# ------------------------------------------------------------------ eager torch baselines (what users write)
def rms_norm_torch(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rope_torch(q, k, pos, theta):
    return rope_reference(q, k, pos, theta)


def swiglu_torch(gu):
    g, u = gu.chunk(2, -1)
    return F.silu(g) * u


def decode_sdpa(q, kc, vc, lengths, scale):
    mask = torch.arange(kc.shape[2], device=q.device)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None], kc, vc, attn_mask=mask[:, None, None, :], scale=scale,
                                         enable_gqa=True)
    return out[:, :, 0]


def paged_sdpa(q, k_pool, v_pool, tables, lengths, scale):
    b = tables.shape[0]
    kc = k_pool[tables].permute(0, 2, 1, 3, 4).reshape(b, k_pool.shape[1], -1, k_pool.shape[3])
    vc = v_pool[tables].permute(0, 2, 1, 3, 4).reshape(b, v_pool.shape[1], -1, v_pool.shape[3])
    return decode_sdpa(q, kc, vc, lengths, scale)


def merge_torch(out, lse, other, other_lse):
    other_lse = other_lse.masked_fill(other_lse == float("inf"), float("-inf"))
    merged = torch.logaddexp(lse, other_lse)
    weight = (other_lse - merged).exp_()
    out += (other - out) * weight.T[..., None]
    lse.copy_(merged)


def linear_logprob_unfused(h, w, t, temperature):
    logits = (h @ w.T).float() / temperature
    logp = logits.log_softmax(-1)
    return logp.gather(1, t[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def linear_logprob_checkpointed(h, w, t, temperature, rows: int = 1024):
    """The memory-saving way to write it in torch: row chunks under activation checkpointing, so the backward
    recomputes each chunk's logits, as fw's recomputing mode does (a chunk's fp32 logits are rows x V; the
    peak-memory line of its row shows what it holds)."""
    from torch.utils.checkpoint import checkpoint

    outs = [checkpoint(linear_logprob_unfused, h[s:s + rows], w, t[s:s + rows], temperature, use_reentrant=False)
            for s in range(0, h.shape[0], rows)]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def sample_torch(logits, temperature, top_k, top_p):
    z = logits.float() / temperature
    logprobs = z.log_softmax(-1)
    zz = z
    if top_k:
        kth = zz.topk(top_k, -1).values[:, -1:]
        zz = zz.masked_fill(zz < kth, float("-inf"))
    if top_p < 1.0:
        s, idx = zz.sort(-1, descending=True)
        cum = s.softmax(-1).cumsum(-1)
        drop = cum - s.softmax(-1) > top_p
        zz = zz.scatter(1, idx, s.masked_fill(drop, float("-inf")))
    tok = torch.multinomial(zz.softmax(-1), 1).squeeze(1)
    return tok, logprobs.gather(1, tok[:, None]).squeeze(1)


def fw_sample(logits, temperature, top_k, top_p):
    return ops_cuda.sample(logits, temperature, top_k, top_p, 0.0, 1)


# ------------------------------------------------------------------ the table
ROWS: list[dict] = []
OPTS = argparse.Namespace(only=None, fw_only=False, rounds=3)


def time_compiled(op: str, shape: str, comp, args: tuple) -> tuple[float, bool]:
    try:
        comp(*args)  # compile outside any graph capture
        return bench_graph(lambda: comp(*args))
    except Exception as e:  # noqa: BLE001 (a baseline that fails to compile is reported, not fatal)
        print(f"  torch.compile baseline failed for {op} {shape}: {type(e).__name__}: {str(e)[:200]}")
        return math.nan, True


def row(op: str, shape: str, fw, eager, comp, args: tuple = (), nbytes: float = 0.0, flops: float = 0.0,
        rounds: int | None = None) -> None:
    """Time fw(*args), eager(*args) and comp(*args) (comp: torch.compile of the eager maths) in turn, `rounds`
    times (default OPTS.rounds); each gets the median of its rounds."""
    if OPTS.only and not any(o in op for o in OPTS.only):
        return
    t_plain = bench(lambda: fw(*args))
    times = {"fw": [], "eager": [], "compile": []}
    graphed = {k: True for k in times}
    for _ in range(rounds or OPTS.rounds):
        rnd = {"fw": bench_graph(lambda: fw(*args))}
        if not OPTS.fw_only:
            rnd["eager"] = bench_graph(lambda: eager(*args))
            failed = times["compile"] and math.isnan(times["compile"][-1])  # not compiled again
            rnd["compile"] = (math.nan, True) if failed else time_compiled(op, shape, comp, args)
        for k, (t, ok) in rnd.items():
            times[k].append(t)
            graphed[k] = graphed[k] and ok
    t_fw, t_e, t_c = (math.nan if not v or any(math.isnan(t) for t in v) else statistics.median(v)
                      for v in times.values())
    def mark(ok):
        return "" if ok else "*"

    r = {"op": op, "shape": shape, "fw": t_fw, "eager": t_e, "compile": t_c, "plain": t_plain,
         "marks": (mark(graphed["fw"]), mark(graphed["eager"]), mark(graphed["compile"]))}
    if nbytes:
        r["rate"] = f"{nbytes / t_fw / 1e6:.0f} GB/s"
        r["ceiling"] = f"{100 * nbytes / t_fw / 1e-3 / COPY_BW:.0f}% of copy"
    if flops:
        r["rate"] = f"{flops / t_fw / 1e9:.0f} TFLOP/s"
        r["ceiling"] = f"{100 * flops / t_fw / 1e-3 / BF16_FLOPS:.0f}% of bf16"
    ROWS.append(r)
    per_round = " ".join(f"{k} [" + " ".join(f"{t:.4f}" for t in v) + "]" for k, v in times.items() if v)
    print(f"  {op:24s} {shape:30s} fw {t_fw:8.3f} ms  eager {t_e:8.3f}  compile {t_c:8.3f}  "
          f"{r.get('rate', '')} {r.get('ceiling', '')}  (fw plain launch {t_plain:.3f} ms; rounds, ms: {per_round})",
          flush=True)


def print_table() -> None:
    head = (f"| {'op':24s} | {'shape':32s} | fw ms | eager ms | compile ms | fw vs compile | achieved | vs ceiling "
            "| fw plain-launch ms |")
    print("\n" + head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in ROWS:
        sp = r["compile"] / r["fw"] if r["compile"] == r["compile"] else float("nan")
        m = r["marks"]
        print(f"| {r['op']:24s} | {r['shape']:32s} | {r['fw']:.3f}{m[0]} | {r['eager']:.3f}{m[1]} | "
              f"{r['compile']:.3f}{m[2]} | {sp:.3f}x | {r.get('rate', '')} | {r.get('ceiling', '')} | "
              f"{r['plain']:.3f} |")


def peak_memory(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8 * 2048)
    ap.add_argument("--only", type=lambda v: v.split(","), default=None,
                    help="comma-separated substrings of op names to run (default: all)")
    ap.add_argument("--fw-only", action="store_true", help="time the fw ops only, not the baselines")
    ap.add_argument("--rounds", type=int, default=OPTS.rounds,
                    help="times each row's fw op and baselines are timed in turn (the table: their medians)")
    args = ap.parse_args()
    OPTS.only, OPTS.fw_only, OPTS.rounds = args.only, args.fw_only, max(1, args.rounds)
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    backend = library.activate_cuda()
    print(ops_cuda.doctor(), flush=True)
    assert backend == "kernels", library.cuda_state["error"]
    torch.manual_seed(0)
    N, d, Hq, Hk, D, I, V = args.tokens, 1024, 16, 8, 128, 3072, 151936
    B, T = max(1, N // 2048), min(N, 2048)
    es = 2  # bf16 bytes

    # rms_norm (hidden) and QK-norm (per head)
    for shape, label in [((N, d), f"[{N}, {d}]"), ((N, Hq, D), f"[{N}, {Hq}, {D}] (QK-norm)")]:
        x = torch.randn(shape, device=DEV, dtype=BF)
        w = torch.randn(shape[-1], device=DEV, dtype=BF)
        n = x.numel()
        row("rms_norm fwd", label, ops_cuda.rms_norm, rms_norm_torch, compiled(rms_norm_torch), (x, w, 1e-6),
            nbytes=2 * n * es)
        xg = x.clone().requires_grad_(True)
        wg = w.clone().requires_grad_(True)
        g = torch.randn_like(x)
        row("rms_norm fwd+bwd", label, fwd_bwd(lambda a, b: ops_cuda.rms_norm(a, b, 1e-6), (xg, wg), g),
            fwd_bwd(lambda a, b: rms_norm_torch(a, b, 1e-6), (xg, wg), g),
            fwd_bwd(compiled(lambda a, b: rms_norm_torch(a, b, 1e-6)), (xg, wg), g), nbytes=5 * n * es)

    # rope on q and k
    q = torch.randn(B, T, Hq, D, device=DEV, dtype=BF)
    k = torch.randn(B, T, Hk, D, device=DEV, dtype=BF)
    pos = torch.arange(T, device=DEV).expand(B, T).contiguous()
    nb = 2 * (q.numel() + k.numel()) * es
    row("rope fwd (q+k)", f"q[{B},{T},{Hq},{D}] k[..{Hk}..]", ops_cuda.rope, rope_torch, compiled(rope_torch),
        (q, k, pos, 1e6), nbytes=nb)

    # QK-norm + RoPE from the fused qkv (training): against the torch maths, and against the separate fw ops on views
    # of qkv that the model ran before (their backward: the norms', the rotation's, and the split's cat)
    W = (Hq + 2 * Hk) * D
    qkv_t = torch.randn(N, W, device=DEV, dtype=BF).requires_grad_(True)
    wq, wk = torch.ones(D, device=DEV, requires_grad=True), torch.ones(D, device=DEV, requires_grad=True)
    pos_t = pos.reshape(-1)[:N].contiguous()
    grads = (torch.randn(N, Hq, D, device=DEV, dtype=BF), torch.randn(N, Hk, D, device=DEV, dtype=BF),
             torch.randn(N, Hk, D, device=DEV, dtype=BF))

    def separate(a, b, c):
        qs, ks, vs = a.view(N, Hq + 2 * Hk, D).split([Hq, Hk, Hk], 1)
        qr, kr = ops_cuda.rope(ops_cuda.rms_norm(qs, b, 1e-6)[None], ops_cuda.rms_norm(ks, c, 1e-6)[None],
                               pos_t[None], 1e6)
        return qr[0], kr[0], vs

    def reference(a, b, c):
        return qk_norm_rope_reference(a, pos_t, b, c, 1e-6, 1e6, Hk)

    qk_bytes = N * (4 * W + (Hq + Hk) * D) * es
    row("qk_norm_rope fwd+bwd", f"[{N}, {W}] ({Hq}+{Hk}+{Hk} heads)",
        fwd_bwd(lambda a, b, c: ops_cuda.qk_norm_rope(a, pos_t, b, c, 1e-6, 1e6, Hk), (qkv_t, wq, wk), grads),
        fwd_bwd(reference, (qkv_t, wq, wk), grads), fwd_bwd(compiled(reference), (qkv_t, wq, wk), grads),
        nbytes=qk_bytes)
    row("qk_norm_rope fwd+bwd, vs the separate fw ops", f"[{N}, {W}] ({Hq}+{Hk}+{Hk} heads)",
        fwd_bwd(lambda a, b, c: ops_cuda.qk_norm_rope(a, pos_t, b, c, 1e-6, 1e6, Hk), (qkv_t, wq, wk), grads),
        fwd_bwd(separate, (qkv_t, wq, wk), grads), fwd_bwd(compiled(separate), (qkv_t, wq, wk), grads),
        nbytes=qk_bytes)

    # swiglu
    gu = torch.randn(N, 2 * I, device=DEV, dtype=BF)
    row("swiglu fwd", f"[{N}, {2 * I}]", ops_cuda.swiglu, swiglu_torch, compiled(swiglu_torch), (gu,),
        nbytes=3 * N * I * es)
    gug = gu.clone().requires_grad_(True)
    g = torch.randn(N, I, device=DEV, dtype=BF)
    row("swiglu fwd+bwd", f"[{N}, {2 * I}]", fwd_bwd(ops_cuda.swiglu, (gug,), g), fwd_bwd(swiglu_torch, (gug,), g),
        fwd_bwd(compiled(swiglu_torch), (gug,), g), nbytes=(3 + 5) * N * I * es)

    # the rollout's inference fusions at decode shapes (256 rows): residual add + RMSNorm; QK-norm + RoPE + paged
    # KV write against the separate steps they replace
    rows = 256
    xa, ra = torch.randn(rows, d, device=DEV, dtype=BF), torch.randn(rows, d, device=DEV, dtype=torch.float32)
    wa = torch.randn(d, device=DEV)
    row("add_rms_norm", f"[{rows}, {d}] bf16 + fp32 residual -> bf16", ops_cuda.add_rms_norm, add_rms_norm_reference,
        compiled(add_rms_norm_reference), (xa, ra, wa, 1e-6, BF), nbytes=rows * d * (2 * es + 2 * 4))
    pool_blocks, block = 4096, 16
    qkv = torch.randn(rows, (Hq + 2 * Hk) * D, device=DEV, dtype=BF)
    kp, vp = (torch.zeros(pool_blocks, Hk, block, D, device=DEV, dtype=BF) for _ in range(2))
    slots = torch.randperm(pool_blocks * block, device=DEV)[:rows]
    qpos = torch.randint(0, 2048, (rows,), device=DEV)
    qw, kw = torch.randn(D, device=DEV), torch.randn(D, device=DEV)
    qkv_args = (qkv, qpos, qw, kw, 1e-6, 1e6, kp, vp, slots // block, slots % block)
    row("qk_norm_rope_write", f"{rows} tokens, {Hq}+{Hk}+{Hk} heads of {D}", ops_cuda.qk_norm_rope_write,
        qk_norm_rope_write_reference, compiled(qk_norm_rope_write_reference), qkv_args,
        nbytes=rows * (Hq + 2 * Hk) * D * es * 2)

    # fused linear + logprob (fwd+bwd), FLOPs: the GEMMs of 2*N*d*V each: logits, grad_h, grad_W, and with
    # recomputation (save_logits=False) the logits again in the backward
    h = (torch.randn(N, d, device=DEV) * 0.5).to(BF).requires_grad_(True)
    lm = (torch.randn(V, d, device=DEV) / 32).to(BF).requires_grad_(True)
    tg = torch.randint(0, V, (N,), device=DEV)
    glp, gent = torch.randn(N, device=DEV), torch.randn(N, device=DEV)

    def fused(save_logits=True):
        lp, ent = ops_cuda.linear_logprob(h, lm, tg, 1.0, return_entropy=True, save_logits=save_logits)
        torch.autograd.grad((lp, ent), (h, lm), (glp, gent))

    def recomputing():
        fused(save_logits=False)

    def unfused(fn=linear_logprob_unfused):
        lp, ent = fn(h, lm, tg, 1.0)
        torch.autograd.grad((lp, ent), (h, lm), (glp, gent))

    # one round each: the unfused baselines hold several [N, V] fp32 tensors a call, so a second round can run out
    # of GPU memory, and these rows are far from parity anyway
    cu = compiled(linear_logprob_unfused)
    row("linear_logprob fwd+bwd", f"N={N} d={d} V={V} saved", fused, unfused, lambda: unfused(cu),
        flops=3 * 2 * N * d * V, rounds=1)
    row("linear_logprob fwd+bwd", f"N={N} d={d} V={V} recomp", recomputing, unfused, lambda: unfused(cu),
        flops=4 * 2 * N * d * V, rounds=1)
    # the same recomputing mode against baselines that also recompute the logits in the backward (checkpointed
    # row chunks): far below the unfused baselines' memory, though still above fw's
    cu_ckpt = compiled(linear_logprob_checkpointed)
    row("linear_logprob fwd+bwd", f"N={N} d={d} V={V} recomp/ckpt", recomputing,
        lambda: unfused(linear_logprob_checkpointed), lambda: unfused(cu_ckpt), flops=4 * 2 * N * d * V, rounds=1)
    run_mem = not args.only or any(o in "linear_logprob" for o in args.only)
    mem_fused = peak_memory(fused) if run_mem else math.nan
    mem_recomp = peak_memory(recomputing) if run_mem else math.nan
    mem_unfused = peak_memory(unfused) if run_mem and not args.fw_only else math.nan
    mem_comp = peak_memory(lambda: unfused(cu)) if run_mem and not args.fw_only else math.nan
    mem_ckpt = peak_memory(lambda: unfused(cu_ckpt)) if run_mem and not args.fw_only else math.nan

    # packed rows' attention, fwd+bwd: B rows of T tokens, each packed with documents of seeded lengths U[64, 1024]
    # (the last one cut at the row's end). fw: varlen flash over cu_seqlens; the baselines: the path packed rows
    # took before, SDPA with a [B, 1, T, T] document mask (ops_cuda.attention with positions), eager and compiled.
    # FLOPs: causal within each document, forward 2 matmuls of L^2 / 2 x D per head, backward 2.5x that.
    gen = torch.Generator().manual_seed(0)
    doc_lens = []
    for _ in range(B):
        left = T
        while left:
            n = min(left, int(torch.randint(64, 1025, (1,), generator=gen)))
            doc_lens.append(n)
            left -= n
    pos_docs = torch.cat([torch.arange(n) for n in doc_lens]).view(B, T).to(DEV)
    cu_docs, longest = ops_cuda.packed_sequences(pos_docs)
    qa = torch.randn(B, T, Hq, D, device=DEV, dtype=BF, requires_grad=True)
    ka = torch.randn(B, T, Hk, D, device=DEV, dtype=BF, requires_grad=True)
    va = torch.randn(B, T, Hk, D, device=DEV, dtype=BF, requires_grad=True)
    ga = torch.randn(B, T, Hq, D, device=DEV, dtype=BF)

    def varlen_fw(a, b, c):
        return ops_cuda.varlen_attention(a.flatten(0, 1), b.flatten(0, 1), c.flatten(0, 1), cu_docs, longest,
                                         D ** -0.5).view(a.shape)

    def masked_sdpa(a, b, c):
        return ops_cuda.attention(a, b, c, pos_docs, D ** -0.5)

    row("varlen_attention fwd+bwd", f"[{B}x{T}, {Hq}/{Hk}, {D}] {len(doc_lens)} docs",
        fwd_bwd(varlen_fw, (qa, ka, va), ga), fwd_bwd(masked_sdpa, (qa, ka, va), ga),
        fwd_bwd(compiled(masked_sdpa), (qa, ka, va), ga), flops=3.5 * 2 * sum(n * n for n in doc_lens) * Hq * D)

    # the merge of two attention parts by their logsumexps (shared_prompt_attention's forward: the completions' own
    # part and their prompt's), in place over N tokens; the baseline is the torch maths the op replaced
    out_m = torch.randn(N, Hq, D, device=DEV, dtype=BF)
    lse_m = torch.randn(Hq, N, device=DEV)
    other_m = torch.randn(N, Hq, D, device=DEV, dtype=BF)
    other_lse_m = torch.randn(Hq, N, device=DEV)
    row("merge_attention_states", f"[{N}, {Hq}, {D}]", ops_cuda.merge_attention_states, merge_torch,
        compiled(merge_torch), (out_m, lse_m, other_m, other_lse_m), nbytes=3 * N * Hq * D * es + 3 * N * Hq * 4)

    # decode attention over a context of 1024 (Qwen3-0.6B: 16 q heads, 8 kv heads, head_dim 128)
    S = 1024
    for b in (1, 64, 256):
        qd = torch.randn(b, Hq, D, device=DEV, dtype=BF)
        kc = torch.randn(b, Hk, S, D, device=DEV, dtype=BF)
        vc = torch.randn(b, Hk, S, D, device=DEV, dtype=BF)
        ln = torch.full((b,), S, device=DEV)
        row("decode_attention", f"B={b} ctx={S}", ops_cuda.decode_attention, decode_sdpa, compiled(decode_sdpa),
            (qd, kc, vc, ln, D ** -0.5), nbytes=(2 * kc.numel() + 2 * qd.numel()) * es)
        if b > 1:
            # ragged rows, as in a rollout (lengths uniform in [S/10, S], seeded): the bytes that must move are the
            # rows within each length; the masked SDPA baselines read every slot, fw stops at each row's length
            ln = torch.randint(S // 10, S + 1, (b,), generator=torch.Generator().manual_seed(b)).to(DEV)
            row("decode_attention", f"B={b} ctx={S} ragged", ops_cuda.decode_attention, decode_sdpa,
                compiled(decode_sdpa), (qd, kc, vc, ln, D ** -0.5),
                nbytes=(2 * int(ln.sum()) * Hk * D + 2 * qd.numel()) * es)

    # paged decode attention: the same contexts in shuffled 16-position blocks of one pool; the baselines gather
    # each row's blocks into a contiguous cache first, as a paged cache without a paged kernel has to
    bsz = 16
    for b in (64, 256):
        qd = torch.randn(b, Hq, D, device=DEV, dtype=BF)
        nblk = b * S // bsz
        kp = torch.randn(nblk + 1, Hk, bsz, D, device=DEV, dtype=BF)
        vp = torch.randn(nblk + 1, Hk, bsz, D, device=DEV, dtype=BF)
        tables = (torch.randperm(nblk, generator=torch.Generator().manual_seed(b)) + 1).view(b, S // bsz).to(DEV)
        ln = torch.full((b,), S, device=DEV)
        row("paged_decode_attention", f"B={b} ctx={S} block={bsz}", ops_cuda.paged_decode_attention, paged_sdpa,
            compiled(paged_sdpa), (qd, kp, vp, tables, ln, D ** -0.5),
            nbytes=(2 * b * S * Hk * D + 2 * qd.numel()) * es)

    # sampler over the full vocabulary (fp32 logits)
    for b in (1, 64, 256):
        lg = torch.randn(b, V, device=DEV) * 3
        for tk, tp in ((0, 1.0), (50, 0.9)):
            row("sample", f"B={b} V={V} top_k={tk} top_p={tp}", fw_sample, sample_torch, compiled(sample_torch),
                (lg, 1.0, tk, tp), nbytes=lg.numel() * 4)

    print_table()
    if not run_mem:
        return
    print(f"\nlinear_logprob peak memory (fwd+bwd, N={N}, V={V}, bf16): fused with saved logits {mem_fused:.2f} GiB, "
          f"fused recomputing {mem_recomp:.2f} GiB, unfused eager {mem_unfused:.2f} GiB, unfused compiled "
          f"{mem_comp:.2f} GiB, checkpointed chunks compiled {mem_ckpt:.2f} GiB; fused/unfused = "
          f"{mem_fused / mem_unfused:.3f} saved, {mem_recomp / mem_unfused:.3f} recomputing")


if __name__ == "__main__":
    main()
