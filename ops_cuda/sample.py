"""sample: sampling with top-k / top-p / min-p from a batch of logits, and its logprob. Schema, shape checks,
torch reference (Philox4x32 noise, the inverse CDF, the sampling mask), fake (inference only: no autograd).
CUDA kernels: csrc/sample.cu.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ops_cuda.library import acc_dtype, define, fail, need_dim, need_long

_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: int, k1: int, rounds: int = 10):
    """Philox4x32 (Random123) on int64 tensors holding uint32 values; returns the 4 output words."""
    c = [x & _MASK32 for x in (c0, c1, c2, c3)]
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        p0, p1 = c[0] * _PHILOX_M[0], c[2] * _PHILOX_M[1]  # int64 wraps; the masks recover the uint64 words
        hi0, lo0 = (p0 >> 32) & _MASK32, p0 & _MASK32
        hi1, lo1 = (p1 >> 32) & _MASK32, p1 & _MASK32
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return c


def row_counters(batch: int, counters: Tensor | None, device: torch.device | str) -> Tensor:
    """int64 [batch, 2]: the rows' `counters`, or (b, 0) for row b without them."""
    if counters is not None:
        return counters.to(device=device, dtype=torch.int64)
    rows = torch.arange(batch, device=device, dtype=torch.int64)
    return torch.stack([rows, torch.zeros_like(rows)], 1)


def gumbel_noise(batch: int, vocab: int, seed: int, device: torch.device | str = "cpu",
                 counters: Tensor | None = None) -> Tensor:
    """float32 [batch, vocab] Gumbel(0, 1) noise from Philox4x32-10 with key = seed (64 bit) and
    counter (col // 4, c1, c2, 0), output word col % 4; u = ((x >> 9) + 0.5) * 2^-23. (c1, c2) of row b is
    counters[b] (int64 [batch, 2], low 32 bits of each), or (b, 0) without counters."""
    groups = (vocab + 3) // 4
    c0 = torch.arange(groups, device=device, dtype=torch.int64)[None, :].expand(batch, groups)
    c = row_counters(batch, counters, device)
    c1, c2 = c[:, 0:1].expand(batch, groups), c[:, 1:2].expand(batch, groups)
    words = philox4x32(c0, c1, c2, torch.zeros_like(c0), seed & _MASK32, (seed >> 32) & _MASK32)
    x = torch.stack(words, dim=-1).reshape(batch, 4 * groups)[:, :vocab]  # column 4g + j = word j of group g
    u = ((x >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)
    return -torch.log(-torch.log(u))


def row_uniform53(seed: int, counters: Tensor) -> Tensor:
    """float64 [B] in (0, 1]: one uniform a row from Philox4x32-10 keyed by `seed`, counter (c1, c2, 1, 0) with
    (c1, c2) = counters[b] (int64 [B, 2], low 32 bits of each): 32 + 21 bits of the first two words, a stream apart
    from gumbel_noise's, whose counters end in (.., 0, 0)."""
    c = counters.to(torch.int64)
    one = torch.ones_like(c[:, 0])
    w = philox4x32(c[:, 0], c[:, 1], one, torch.zeros_like(one), seed & _MASK32, (seed >> 32) & _MASK32)
    bits = ((w[0] << 21) | (w[1] >> 11)) & ((1 << 53) - 1)
    return (bits.double() + 0.5) * 2.0 ** -53


_CHUNK = 128   # columns a chunk of inverse_cdf's two-level scan


def inverse_cdf(p: Tensor, u: Tensor) -> Tensor:
    """The first column whose cumulative mass exceeds u x the row's mass, for p [B, V] >= 0 and u [B]: the chunk by
    the float64 running sums of the chunks' sums, then the column within it (two small scans instead of one over
    V). A chunk sum may round above its columns' running sum; the pick then falls back to the last column (chunk)
    before it with mass, so a column of zero mass is never drawn."""
    B, V = p.shape
    pad = -V % _CHUNK
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    # the chunk count spelled out: view(B, -1, ...) cannot infer it for an empty batch (B = 0)
    sums = p.view(B, p.shape[1] // _CHUNK, _CHUNK).sum(-1).double().cumsum(-1)
    target = (u.to(sums.device) * sums[:, -1])[:, None]
    chunk = torch.searchsorted(sums, target, right=True).clamp_(max=sums.shape[1] - 1)
    chunk = torch.searchsorted(sums, sums.gather(1, chunk))       # the last chunk with mass at or before
    before = torch.where(chunk > 0, sums.gather(1, (chunk - 1).clamp(min=0)), 0.0)
    cols = chunk * _CHUNK + torch.arange(_CHUNK, device=p.device)[None, :]
    inner = p.gather(1, cols).cumsum(-1, dtype=torch.float64)
    j = torch.searchsorted(inner, target - before, right=True).clamp_(max=_CHUNK - 1)
    j = torch.searchsorted(inner, inner.gather(1, j))             # the last column with mass at or before
    return (chunk * _CHUNK + j).squeeze(1)


def plain_mass(z: Tensor) -> Tensor:
    """The mass plain sampling draws from, for scaled logits z [B, V]: softmax(z) over the columns whose z is not
    NaN. A NaN logit carries no mass, as -inf does, so a row with NaN among finite logits is still drawn from by its
    own uniform (its seed and counters). A row whose NaN-free maximum is not finite (every z -inf or NaN, or a +inf,
    where exp(inf - inf) is NaN) has no mass at all: zeros, which inverse_cdf draws as column 0. The CPU rollout's
    draw (framework/rollout/sampling.py) takes it for rows whose softmax is NaN."""
    p = torch.softmax(torch.where(z.isnan(), float("-inf"), z), -1)
    return torch.where(p.isnan(), 0.0, p)


def sampling_mask(z: Tensor, top_k: int, top_p: float, min_p: float) -> Tensor:
    """Tokens that may be drawn from scaled logits z [B, V] (float32): z >= max(tau_k, tau_p, tau_min).
    tau_k = the k-th largest z; tau_p = the largest value whose tail {z >= tau} (within top-k) holds at
    least top_p of the top-k mass; tau_min = max z + log(min_p). Ties at a threshold are all kept."""
    B, V = z.shape
    tau = torch.full((B,), float("-inf"), dtype=z.dtype, device=z.device)
    zmax = z.max(-1).values
    if 0 < top_k < V:
        tau = torch.maximum(tau, z.topk(top_k, dim=-1).values[:, -1])
    if top_p < 1.0:
        e = torch.where(z >= tau[:, None], (z - zmax[:, None]).exp(), 0.0)
        s, order = z.sort(dim=-1, descending=True)
        cum = e.gather(1, order).cumsum(-1)
        need = top_p * e.sum(-1, keepdim=True)
        idx = (cum < need).sum(-1, keepdim=True).clamp(max=V - 1)
        tau = torch.maximum(tau, s.gather(1, idx).squeeze(1))
    if min_p > 0.0:
        tau = torch.maximum(tau, zmax + torch.tensor(math.log(min_p), dtype=z.dtype))
    return z >= tau[:, None]


def is_plain(vocab: int, top_k: int, top_p: float, min_p: float) -> bool:
    """Whether top-k, top-p and min-p leave every token allowed (the kernels' "plain" sampling)."""
    return (top_k <= 0 or top_k >= vocab) and top_p >= 1.0 and min_p <= 0.0


def need_vocab(logits: Tensor) -> None:
    """logits [B, V] with V > 0: a row of no columns has no token to draw, and the reference's reductions over its
    columns would fail on it deep inside."""
    if logits.shape[1] == 0:
        fail("sample", f"`logits` has no columns (shape {tuple(logits.shape)}): a vocabulary of zero tokens has "
                       "nothing to draw")


def sample_reference(logits: Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                     seed: int, counters: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(tokens int64 [B], logprob float32 [B]). Plain sampling (no top-k / top-p / min-p): the inverse CDF of
    softmax(logits / temperature) at one Philox uniform a row (row_uniform53), NaN logits carrying no mass and a row
    without mass drawing column 0 (plain_mass). Otherwise Gumbel-max over the allowed tokens of logits / temperature
    (gumbel_noise). logprob under the temperature-scaled FULL softmax (NaN for a row with a NaN logit).
    temperature 0: greedy (first maximum), logprob under the unscaled softmax."""
    need_vocab(logits)
    z = logits.to(acc_dtype(logits.dtype))
    if temperature == 0.0:
        tokens = z.argmax(-1)
    elif is_plain(z.shape[1], top_k, top_p, min_p):
        z = z / temperature
        u = row_uniform53(seed, row_counters(z.shape[0], counters, z.device))
        tokens = inverse_cdf(plain_mass(z), u)
    else:
        z = z / temperature
        keep = sampling_mask(z, top_k, top_p, min_p)
        g = gumbel_noise(z.shape[0], z.shape[1], seed, z.device, counters).to(z.dtype)
        tokens = torch.where(keep, z + g, float("-inf")).argmax(-1)
    logprob = z.gather(1, tokens[:, None]).squeeze(1) - z.logsumexp(-1)
    return tokens, logprob.to(torch.float32)


def _fake(logits, temperature, top_k, top_p, min_p, seed, counters=None):
    b = logits.shape[0]
    return logits.new_empty(b, dtype=torch.int64), logits.new_empty(b, dtype=torch.float32)


define("sample(Tensor logits, float temperature, int top_k, float top_p, float min_p, int seed, "
       "Tensor? counters=None) -> (Tensor, Tensor)", sample_reference, fake=_fake)


def sample(logits: Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
           seed: int, counters: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(tokens int64 [B], logprob fp32 [B]). Draws by the inverse CDF at one Philox uniform a row (keyed by `seed`)
    where top-k / top-p / min-p are off, else by Gumbel-max (Philox noise of every column) among the tokens they
    allow; logprob is under the temperature-scaled FULL softmax. temperature 0 is greedy, its logprob under the
    unscaled softmax. `counters` (int64 [B, 2]) gives each row its own random stream, e.g. (sequence id, decode
    step), so a row's draw does not depend on its slot in the batch; without it row b's stream is (b, 0).

    Valid ranges (not checked here; the caller's sampling parameters check them): temperature >= 0,
    top_k >= 0 (0 = off), top_p in (0, 1] (1 = off), min_p in [0, 1) (0 = off)."""
    need_dim("sample", "logits", logits, 2, "[B, V]")
    need_vocab(logits)
    if counters is not None:
        need_dim("sample", "counters", counters, 2, "[B, 2]")
        need_long("sample", "counters", counters)
        if counters.shape != (logits.shape[0], 2):
            fail("sample", f"counters must be [B={logits.shape[0]}, 2], got {tuple(counters.shape)}")
    return torch.ops.fw.sample(logits, float(temperature), int(top_k), float(top_p), float(min_p), int(seed),
                               counters)
