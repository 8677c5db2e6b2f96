// Decode attention (one new query token per row) over a KV cache, GQA-aware and split along the context
// (flash-decoding): block (b, kv head g, split) reads each K/V row of its context slice once for all R
// query heads of g; LPP lanes share a row (16-byte loads: 16 lanes for a bf16 row of 128), so a warp
// takes 32/LPP rows per step, U steps in flight; online softmax per query head; partial (max, sum,
// unnormalised output) per split go to a workspace that a second kernel combines.
#include "common.cuh"

namespace fw {
namespace {

constexpr int kWarps = 4;

// E elements per lane (16 bytes, or D/32 when a row needs more), LPP lanes per K/V row, PPW rows per warp step.
template <typename T, int D> struct DecodeShape {
  static constexpr int kVec = 16 / sizeof(T);
  static constexpr int E = (D / 32 > kVec) ? D / 32 : kVec;
  static constexpr int LPP = D / E;
  static constexpr int PPW = 32 / LPP;
  static constexpr int kSlots = kWarps * PPW;
};

template <typename T, int D, int R>
__global__ void __launch_bounds__(kWarps * 32)
decode_split_kernel(const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
                    const int64_t* __restrict__ lengths, DecodeWorkspace ws, int Hq, int Hk, int S, int64_t sb,
                    int64_t sh, int64_t ss, int splits, float scale) {
  using Sh = DecodeShape<T, D>;
  constexpr int E = Sh::E, LPP = Sh::LPP, kSlots = Sh::kSlots;
  constexpr int U = R <= 2 ? 2 : 1;  // rows per slot per step; the next step's rows load during this one's math
  __shared__ float sm_m[kSlots][R], sm_l[kSlots][R];
  __shared__ float sm_acc[kSlots][R][D];
  const int bg = blockIdx.x, b = bg / Hk, g = bg - b * Hk, split = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % LPP, slot = warp * Sh::PPW + lane / LPP;
  const int64_t len = min((int64_t)S, lengths[b]);
  const int chunk = (S + splits - 1) / splits;
  const int64_t s_begin = (int64_t)split * chunk;
  const int64_t s_end = min(len, s_begin + chunk);
  const float qscale = scale * 1.4426950408889634f;  // scores in base 2: exp2f is one MUFU op

  float qf[R][E], acc[R][E], m[R], l[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    Vec<T, E> qv = load_vec<T, E>(q + ((int64_t)b * Hq + g * R + r) * D + sub * E);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      qf[r][e] = to_f(qv.v[e]) * qscale;
      acc[r][e] = 0.f;
    }
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  const T* kb = kc + b * sb + g * sh + sub * E;
  const T* vb = vc + b * sb + g * sh + sub * E;
  constexpr int64_t kStep = (int64_t)kSlots * U;
  // step p0 covers rows p0 + u*kSlots + slot; the loop condition is uniform across the warp
  Vec<T, E> kv[U], vv[U], kn[U], vn[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t p = s_begin + (int64_t)u * kSlots + slot;
    if (p < s_end) {
      kv[u] = load_vec<T, E>(kb + p * ss);
      vv[u] = load_vec<T, E>(vb + p * ss);
    }
  }
  for (int64_t p0 = s_begin; p0 < s_end; p0 += kStep) {
#pragma unroll
    for (int u = 0; u < U; ++u) {  // prefetch the next step
      const int64_t p = p0 + kStep + (int64_t)u * kSlots + slot;
      if (p < s_end) {
        kn[u] = load_vec<T, E>(kb + p * ss);
        vn[u] = load_vec<T, E>(vb + p * ss);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t p = p0 + (int64_t)u * kSlots + slot;
      const bool valid = p < s_end;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float dot = 0.f;
        if (valid) {
#pragma unroll
          for (int e = 0; e < E; ++e) dot += qf[r][e] * to_f(kv[u].v[e]);
        }
#pragma unroll
        for (int o = LPP / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (valid) {
          const float m_new = fmaxf(m[r], dot), c = exp2f(m[r] - m_new), w = exp2f(dot - m_new);
          l[r] = l[r] * c + w;
#pragma unroll
          for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * c + w * to_f(vv[u].v[e]);
          m[r] = m_new;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      kv[u] = kn[u];
      vv[u] = vn[u];
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (sub == 0) {
      sm_m[slot][r] = m[r];
      sm_l[slot][r] = l[r];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[slot][r][sub * E + e] = acc[r][e];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < R * D; idx += blockDim.x) {
    const int r = idx / D, d = idx - r * D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kSlots; ++w) M = fmaxf(M, sm_m[w][r]);
    float O = 0.f, L = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kSlots; ++w) {
        const float c = exp2f(sm_m[w][r] - M);
        O += sm_acc[w][r][d] * c;
        L += sm_l[w][r] * c;
      }
    }
    const int64_t hq = (int64_t)b * Hq + g * R + r;
    ws.o[(hq * splits + split) * D + d] = O;
    if (d == 0) {
      ws.m[hq * splits + split] = M;
      ws.l[hq * splits + split] = L;
    }
  }
}

template <typename T>
__global__ void decode_combine_kernel(DecodeWorkspace ws, T* __restrict__ out, int splits, int D) {
  const int64_t hq = blockIdx.x;
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, ws.m[hq * splits + s]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float O = 0.f, L = 0.f;
    if (M != -INFINITY) {
      for (int s = 0; s < splits; ++s) {
        const float c = exp2f(ws.m[hq * splits + s] - M);  // maxima in base 2
        O += ws.o[(hq * splits + s) * D + d] * c;
        L += ws.l[hq * splits + s] * c;
      }
    }
    out[hq * D + d] = from_f<T>(L > 0.f ? O / L : 0.f);
  }
}

template <typename T, int D>
cudaError_t launch_d(const void* q, const void* k, const void* v, const int64_t* lengths, void* out,
                     DecodeWorkspace ws, int B, int Hq, int Hk, int S, int64_t sb, int64_t sh, int64_t ss,
                     int splits, float scale, cudaStream_t stream) {
  const dim3 grid((unsigned)(B * Hk), (unsigned)splits);
  const int R = Hq / Hk;
#define FW_DECODE_CASE(RR)                                                                                 \
  case RR:                                                                                                 \
    decode_split_kernel<T, D, RR><<<grid, kWarps * 32, 0, stream>>>((const T*)q, (const T*)k, (const T*)v, \
                                                                    lengths, ws, Hq, Hk, S, sb, sh, ss,    \
                                                                    splits, scale);                        \
    break;
  switch (R) {
    FW_DECODE_CASE(1)
    FW_DECODE_CASE(2)
    FW_DECODE_CASE(4)
    FW_DECODE_CASE(8)
    default: return cudaErrorInvalidValue;
  }
#undef FW_DECODE_CASE
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  decode_combine_kernel<T><<<(unsigned)(B * Hq), D < 128 ? D : 128, 0, stream>>>(ws, (T*)out, splits, D);
  return cudaGetLastError();
}

}  // namespace

int decode_attention_splits(int B, int Hk, int S, int sm_count) {
  // about 8 blocks per SM (a block of 4 warps holds ~100 registers a thread: ~4 resident per SM, so two
  // waves), each split keeping at least 32 positions (two steps of its 16 rows in flight)
  const int base = B * Hk > 0 ? B * Hk : 1;
  int splits = (8 * sm_count + base - 1) / base;
  const int most = (S + 31) / 32;
  if (splits > most) splits = most;
  if (splits > 64) splits = 64;
  return splits < 1 ? 1 : splits;
}

cudaError_t decode_attention(DType dt, const void* q, const void* k, const void* v, const int64_t* lengths,
                             void* out, DecodeWorkspace ws, int B, int Hq, int Hk, int S, int D, int64_t sb,
                             int64_t sh, int64_t ss, int splits, float scale, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    switch (D) {
      case 64: return launch_d<T, 64>(q, k, v, lengths, out, ws, B, Hq, Hk, S, sb, sh, ss, splits, scale, stream);
      case 128: return launch_d<T, 128>(q, k, v, lengths, out, ws, B, Hq, Hk, S, sb, sh, ss, splits, scale, stream);
      case 256: return launch_d<T, 256>(q, k, v, lengths, out, ws, B, Hq, Hk, S, sb, sh, ss, splits, scale, stream);
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // namespace fw
