// The per-element maths of the fused linear + logprob, shared by the row kernels over cuBLAS tiles (logprob.cu)
// and the Hopper kernel that does it on the GEMM's accumulators (logprob_sm90.cu), so both give the same values
// from the same logits.
// Partial state of a logsumexp: m (max), s = sum 2^((z-m) log2 e), a = sum 2^(..) (z-m) log2 e, so that
// lse = m + ln s and entropy = ln s - ln 2 * a/s, with no cancellation against m.
#pragma once
#include "common.cuh"

namespace fw {

constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float ex2(float x) {  // 2^x; -inf and x < -126 give 0, NaN stays NaN
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// max that returns NaN when either side is NaN (fmaxf returns the other side, which hid an all-NaN chunk).
__device__ __forceinline__ float max_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// A kept logit: z minus its chunk's max m in fp16's range; one below it is stored as -65504 (its exponential is
// 0 either way, and the entropy term then stays 0 * finite).
__device__ __forceinline__ float kept_logit(float z, float m) {
  const float y = z - m;
  return y < -65504.f ? -65504.f : y;
}

// One logit's terms of s and a against the shift mk = m log2 e: (z - m) log2 e is floored at -200 so that a
// column past the end (z = -inf) adds 0 * -200 to a, not NaN.
__device__ __forceinline__ void lse_add(float z, float mk, float& s, float& a) {
  const float d = max_nan(fmaf(z, kLog2e, -mk), -200.f), e = ex2(d);
  s += e;
  a = fmaf(e, d, a);
}

// d(loss)/dz of one logit z (before the 1/temperature the caller applies): glp (onehot - p) - gH p (log p + H)
// with log p = z + c and p = 2^(z log2 e + ck), c = -lse (plus the kept logits' chunk offset), ck = c log2 e;
// the caller adds glp at the target's column. A -inf logit (p = 0, log p = -inf) gets 0, the limit of p log p,
// where the product would be NaN.
__device__ __forceinline__ float dlogit(float z, float c, float ck, float glp, float gH, float H) {
  const float logp = z + c, p = ex2(fmaf(z, kLog2e, ck));
  return p == 0.f ? 0.f : -glp * p - gH * p * (logp + H);
}

}  // namespace fw
