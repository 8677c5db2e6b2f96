// The per-row maths of decode attention, shared by the ring kernel (decode_attention.cu) and the streaming kernel
// for Hopper (decode_sm90.cu): online softmax in base 2 over K/V rows that LPP lanes share (E elements a lane).
#pragma once
#include "common.cuh"

namespace fw {

// One step of U rows a lane for RP query heads: scores q.k (q pre-scaled by scale * log2 e), reduced over the LPP
// lanes of a row; rows where valid(u) is false weigh 0. load_k(u) / load_v(u) give this lane's E elements of row
// u's K and V as Vec<T, E>; load_v must give zeros for an invalid row (0 * v stays 0 only for a finite v).
template <typename T, int RP, int E, int LPP, int U, typename LoadK, typename LoadV, typename Valid>
__device__ __forceinline__ void decode_step(const float (&qf)[RP][E], float (&acc)[RP][E], float (&m)[RP],
                                            float (&l)[RP], LoadK&& load_k, LoadV&& load_v, Valid&& valid) {
  float dot[U][RP];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const Vec<T, E> kv = load_k(u);
#pragma unroll
    for (int r = 0; r < RP; ++r) {
      float d = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) d += qf[r][e] * to_f(kv.v[e]);
      dot[u][r] = d;
    }
  }
#pragma unroll
  for (int o = LPP / 2; o > 0; o >>= 1) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < RP; ++r) dot[u][r] += __shfl_xor_sync(0xffffffffu, dot[u][r], o);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool ok = valid(u);
#pragma unroll
    for (int r = 0; r < RP; ++r) dot[u][r] = ok ? dot[u][r] : -INFINITY;
  }
#pragma unroll
  for (int r = 0; r < RP; ++r) {
    float mx = m[r];
#pragma unroll
    for (int u = 0; u < U; ++u) mx = fmaxf(mx, dot[u][r]);
    const float ms = mx == -INFINITY ? 0.f : mx;  // a slot with no row yet: keep exp2 away from inf - inf
    const float c = exp2f(m[r] - ms);
    l[r] *= c;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[r][e] *= c;
    m[r] = mx;
#pragma unroll
    for (int u = 0; u < U; ++u) dot[u][r] = exp2f(dot[u][r] - ms);  // weight; 0 for an invalid row
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const Vec<T, E> vv = load_v(u);
#pragma unroll
    for (int r = 0; r < RP; ++r) {
      l[r] += dot[u][r];
#pragma unroll
      for (int e = 0; e < E; ++e) acc[r][e] += dot[u][r] * to_f(vv.v[e]);
    }
  }
}

// Merges the 32 / LPP row slots of a warp (lanes sub, sub + LPP, ...): afterwards every lane holds its warp's
// (m, l, acc) for its E elements.
template <int RP, int E, int LPP>
__device__ __forceinline__ void decode_merge_slots(float (&acc)[RP][E], float (&m)[RP], float (&l)[RP]) {
#pragma unroll
  for (int o = LPP; o < 32; o <<= 1) {
#pragma unroll
    for (int r = 0; r < RP; ++r) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[r], o), lo = __shfl_xor_sync(0xffffffffu, l[r], o);
      const float mx = fmaxf(m[r], mo), ms = mx == -INFINITY ? 0.f : mx;
      const float ca = exp2f(m[r] - ms), cb = exp2f(mo - ms);
      l[r] = l[r] * ca + lo * cb;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * ca + __shfl_xor_sync(0xffffffffu, acc[r][e], o) * cb;
      m[r] = mx;
    }
  }
}

// The warps' merged states, as decode_merge_slots left them, combined through shared memory (red: W * RP * (DP + 2)
// floats, W warps): for query head r < nr and element d < D, (M, L, O) of the whole block. The caller synchronises the W
// warps between write_red and the reads, and before red is written again.
template <int W, int RP, int E, int LPP, int DP>
__device__ __forceinline__ void decode_write_red(float* red, int warp, int lane, const float (&acc)[RP][E],
                                                 const float (&m)[RP], const float (&l)[RP]) {
  float *red_m = red, *red_l = red + W * RP, *red_acc = red + 2 * W * RP;
  if (lane < LPP) {
#pragma unroll
    for (int r = 0; r < RP; ++r) {
      if (lane == 0) {
        red_m[warp * RP + r] = m[r];
        red_l[warp * RP + r] = l[r];
      }
#pragma unroll
      for (int e = 0; e < E; ++e) red_acc[(warp * RP + r) * DP + lane * E + e] = acc[r][e];
    }
  }
}
template <int W, int RP, int DP>
__device__ __forceinline__ void decode_read_red(const float* red, int r, int d, float& M, float& L, float& O) {
  const float *red_m = red, *red_l = red + W * RP, *red_acc = red + 2 * W * RP;
  M = -INFINITY;
#pragma unroll
  for (int w = 0; w < W; ++w) M = fmaxf(M, red_m[w * RP + r]);
  const float Ms = M == -INFINITY ? 0.f : M;
  O = 0.f;
  L = 0.f;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    const float c = exp2f(red_m[w * RP + r] - Ms);
    O += red_acc[(w * RP + r) * DP + d] * c;
    L += red_l[w * RP + r] * c;
  }
}

}  // namespace fw
