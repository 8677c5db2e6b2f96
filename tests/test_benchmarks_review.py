"""The benchmark scripts compute what docs/PERFORMANCE.md says their figures are (CPU runs at tiny sizes)."""
from __future__ import annotations

import pytest


def test_train_step_mfu_counts_packed_documents_attention():
    """MFU = tokens/s x FLOPs a token / PEAK_FLOPS, where causal attention spans a token's document: the packed
    impl's documents of 16 (and a row's 16 + 16 + 16 + 16) cost 16 positions of attention, not the row's 64."""
    from benchmarks.train_step import PEAK_FLOPS, main

    rows = main(["--preset", "tiny", "--batch", "2", "--seq", "64", "--steps", "1", "--impls", "fw,fw-packed",
                 "--doc-len", "16"])
    flops = {r["impl"]: r["mfu"] * PEAK_FLOPS / r["tok_s"] for r in rows}
    # tiny: hidden 64, 4 q heads and 2 kv heads of 64 (q 256, kv 128), intermediate 192, 2 layers, vocab 256.
    # Matrix parameters: 256 x 64 + 2 x (64 x (256 + 2 x 128) + 256 x 64 + 3 x 64 x 192) = 188,416.
    # Attention: 6 x 2 layers x positions x 256.
    params = 188_416
    assert flops["fw"] == pytest.approx(6 * params + 6 * 2 * 64 * 256, rel=1e-12)
    assert flops["fw-packed"] == pytest.approx(6 * params + 6 * 2 * 16 * 256, rel=1e-12)


def test_train_step_attended_len_of_a_cut_last_document():
    """Documents of 24 in rows of 64: 24, 24 and 16 tokens, (576 + 576 + 256) / 64 = 22 positions a token."""
    from benchmarks.train_step import attended_len

    assert attended_len(64, 24) == 22.0
    assert attended_len(2048, 0) == 2048.0
    assert attended_len(2048, 512) == 512.0



def test_rollout_hands_fws_pool_back_before_hf():
    """HF `generate` runs without fw's KV pool allocated: its row's peak is HF's own (the pool is gone, so the row
    reports no blocks)."""
    from benchmarks.rollout import main

    rows = main(["--preset", "tiny", "--num-seqs", "8", "--lo", "4", "--hi", "12", "--impls", "fw,hf",
                 "--rounds", "1"])
    by = {r["impl"]: r for r in rows}
    assert by["fw"]["kv_blocks"] > 0
    assert by["hf"]["kv_blocks"] == 0


@pytest.mark.gpu
def test_rollout_hf_peak_leaves_out_fws_memory():
    """HF's peak is the same whether or not fw's engine ran the whole workload before it: neither fw's KV pool nor
    its model counts, and HF's own model does."""
    import transformers

    from benchmarks.rollout import main
    from framework.models.presets import preset_config

    args = ["--preset", "small", "--num-seqs", "64", "--lo", "64", "--hi", "256", "--rounds", "1"]
    alone = {r["impl"]: r for r in main([*args, "--impls", "hf"])}["hf"]
    after = {r["impl"]: r for r in main([*args, "--impls", "fw,hf"])}["hf"]
    # small: 256-wide, 4 layers, vocab 256; the pool of this workload is about 80 MiB
    assert abs(after["peak_gib"] - alone["peak_gib"]) * 2**10 < 8
    cfg = preset_config("small", 256)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg.to_hf()))
    model_gib = sum(p.numel() for p in hf.parameters()) * 2 / 2**30
    assert alone["peak_gib"] > model_gib


def test_packed_update_runs_every_layout_on_cpu():
    """The script's layouts on CPU at a tiny size: each computes the same loss (to bf16 autocast's rounding)."""
    from benchmarks.packed_update import main

    results = main(["--preset", "tiny", "--completions", "16", "--prompt", "8", "--min-len", "4", "--max-len", "16",
                    "--rounds", "1", "--split", "groups", "--group", "4"])
    assert list(results) == ["padded", "packed", "auto", "shared"]
    for r in results.values():
        assert r["loss"] == pytest.approx(results["padded"]["loss"], rel=1e-3)


@pytest.mark.gpu
def test_packed_update_peaks_leave_out_earlier_layouts_gradients():
    """With equal completions `auto` pads, so it runs exactly the padded layout's work: the same peak. The earlier
    layouts' gradient copies (float32, one a layout) must not count in a later layout's peak."""
    from benchmarks.packed_update import main

    results = main(["--preset", "small", "--completions", "64", "--prompt", "32", "--max-len", "64", "--equal",
                    "--rounds", "1", "--split", "groups"])
    # small's gradients in float32 are about 16 MiB: the old code added one copy a layout run before
    assert abs(results["auto"]["alloc"] - results["padded"]["alloc"]) * 2**10 < 1


def test_host_cost_times_every_op_of_a_training_layer(capsys):
    """Every row is a positive time, the table names them all, and a call with gradients of an fw op costs the
    host more than the one-element add it is read against."""
    from benchmarks.ops.host_cost import main

    rows = main(["--device", "cpu", "--calls", "50", "--rounds", "1"])
    assert {"host probe: one-element add_", "nn.Linear, grad", "rms_norm, grad", "add_rms_norm, grad",
            "qk_norm_rope, grad", "swiglu, grad", "parts: its reference called directly"} <= set(rows)
    assert all(us > 0 for us in rows.values())
    assert rows["add_rms_norm, grad"] > rows["host probe: one-element add_"]
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in rows)


def test_host_costs_plain_function_gives_the_registered_gradients():
    """The plain autograd.Function that host_cost prices against the op's registration computes what the
    registration does: the same outputs and gradients (float64, CPU)."""
    import torch

    import ops_cuda
    from benchmarks.ops.host_cost import _PlainAddRmsNorm

    g = torch.Generator().manual_seed(0)
    x, h, w = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((3, 16), (3, 16), (16,)))
    grads = []
    calls = (lambda a, b, c: ops_cuda.add_rms_norm(a, b, c, 1e-6),
             lambda a, b, c: _PlainAddRmsNorm.apply(a, b, c, 1e-6, None))
    for f in calls:
        a, b, c = (t.clone().requires_grad_() for t in (x, h, w))
        hs, y = f(a, b, c)
        (hs.sum() * 0.5 + (y * torch.arange(16, dtype=torch.float64)).sum()).backward()
        grads.append((hs.detach(), y.detach(), a.grad, b.grad, c.grad))
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_forward_host_times_the_layout_the_forward_and_the_backward(capsys):
    """Each call's two times, the device's never before the host's return, a forward with its backward longer than
    the forward alone, and the layout a small part of the forward."""
    from benchmarks.forward_host import main

    results = main(["--preset", "tiny", "--rows", "16", "--prompt", "8", "--completion", "16", "--group", "4",
                    "--rounds", "3", "--warmup", "1"])
    assert set(results) == {"layout", "forward", "forward + backward"}
    assert all(0 < host <= device for host, device in results.values())
    assert results["forward + backward"][1] > results["forward"][1] > results["layout"][1]
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in results)
