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

