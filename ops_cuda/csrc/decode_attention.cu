// Decode attention (one new query token per row) over a KV cache, GQA-aware and split along the context
// (flash-decoding): block (b, kv head g, split) reads each K/V row of its context slice once for all R
// query heads of g; a warp takes one position at a time (lane l holds elements [l*E, l*E+E) of the head
// dim), U positions in flight; online softmax per query head; partial (max, sum, unnormalised output)
// per split go to a workspace that a second kernel combines.
#include "common.cuh"

namespace fw {
namespace {

constexpr int kWarps = 4;
constexpr int kUnroll = 4;

template <typename T, int E, int R>
__global__ void __launch_bounds__(kWarps * 32)
decode_split_kernel(const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
                    const int64_t* __restrict__ lengths, DecodeWorkspace ws, int Hq, int Hk, int S, int64_t sb,
                    int64_t sh, int64_t ss, int splits, float scale) {
  constexpr int D = E * 32;
  __shared__ float sm_m[kWarps][R], sm_l[kWarps][R];
  __shared__ float sm_acc[kWarps][R][D];
  const int bg = blockIdx.x, b = bg / Hk, g = bg - b * Hk, split = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t len = min((int64_t)S, lengths[b]);
  const int chunk = (S + splits - 1) / splits;
  const int64_t s_begin = (int64_t)split * chunk;
  const int64_t s_end = min(len, s_begin + chunk);

  float qf[R][E], acc[R][E], m[R], l[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    Vec<T, E> qv = load_vec<T, E>(q + ((int64_t)b * Hq + g * R + r) * D + lane * E);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      qf[r][e] = to_f(qv.v[e]) * scale;
      acc[r][e] = 0.f;
    }
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  const T* kb = kc + b * sb + g * sh + lane * E;
  const T* vb = vc + b * sb + g * sh + lane * E;
  for (int64_t p0 = s_begin + warp * kUnroll; p0 < s_end; p0 += kWarps * kUnroll) {
    Vec<T, E> kv[kUnroll], vv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (p0 + u < s_end) {
        kv[u] = load_vec<T, E>(kb + (p0 + u) * ss);
        vv[u] = load_vec<T, E>(vb + (p0 + u) * ss);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (p0 + u >= s_end) break;  // warp-uniform
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) dot += qf[r][e] * to_f(kv[u].v[e]);
        dot = warp_sum(dot);
        const float m_new = fmaxf(m[r], dot), c = expf(m[r] - m_new), w = expf(dot - m_new);
        l[r] = l[r] * c + w;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * c + w * to_f(vv[u].v[e]);
        m[r] = m_new;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (lane == 0) {
      sm_m[warp][r] = m[r];
      sm_l[warp][r] = l[r];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][r][lane * E + e] = acc[r][e];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < R * D; idx += blockDim.x) {
    const int r = idx / D, d = idx - r * D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w][r]);
    float O = 0.f, L = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float c = expf(sm_m[w][r] - M);
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
        const float c = expf(ws.m[hq * splits + s] - M);
        O += ws.o[(hq * splits + s) * D + d] * c;
        L += ws.l[hq * splits + s] * c;
      }
    }
    out[hq * D + d] = from_f<T>(L > 0.f ? O / L : 0.f);
  }
}

template <typename T, int E>
cudaError_t launch_e(const void* q, const void* k, const void* v, const int64_t* lengths, void* out,
                     DecodeWorkspace ws, int B, int Hq, int Hk, int S, int64_t sb, int64_t sh, int64_t ss,
                     int splits, float scale, cudaStream_t stream) {
  const dim3 grid((unsigned)(B * Hk), (unsigned)splits);
  const int R = Hq / Hk;
#define FW_DECODE_CASE(RR)                                                                                 \
  case RR:                                                                                                 \
    decode_split_kernel<T, E, RR><<<grid, kWarps * 32, 0, stream>>>((const T*)q, (const T*)k, (const T*)v, \
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
  decode_combine_kernel<T><<<(unsigned)(B * Hq), E * 32, 0, stream>>>(ws, (T*)out, splits, E * 32);
  return cudaGetLastError();
}

}  // namespace

int decode_attention_splits(int B, int Hk, int S, int sm_count) {
  const int base = B * Hk > 0 ? B * Hk : 1;
  int splits = (2 * sm_count + base - 1) / base;
  const int most = (S + 63) / 64;  // at least 64 positions per split
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
      case 64: return launch_e<T, 2>(q, k, v, lengths, out, ws, B, Hq, Hk, S, sb, sh, ss, splits, scale, stream);
      case 128: return launch_e<T, 4>(q, k, v, lengths, out, ws, B, Hq, Hk, S, sb, sh, ss, splits, scale, stream);
      case 256: return launch_e<T, 8>(q, k, v, lengths, out, ws, B, Hq, Hk, S, sb, sh, ss, splits, scale, stream);
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // namespace fw
