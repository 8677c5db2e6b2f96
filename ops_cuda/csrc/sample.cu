// Sampler: one block per row of logits. z = logits / temperature.
//  pass 1: max and logsumexp of z (the behaviour logprob is under this FULL softmax);
//  top-k: radix select (4 passes of 8-bit digits over order-preserving keys) of the k-th largest z;
//  top-p: the mass of the top-k set, then a radix select on mass for the largest threshold whose tail
//         holds top_p of it; min-p: threshold max z + log(min_p);
//  last pass: Gumbel-max over z >= threshold with Philox4x32-10 noise keyed by the seed, counter
//  (col / 4, row, 0, 0), word col % 4 (the same stream as ops_cuda/reference.py).
// temperature 0: greedy (first maximum), logprob under the unscaled softmax.
// Without top-k / top-p / min-p (and for greedy) no threshold is needed: the row is split over several
// blocks (one pass) and a small kernel combines them, which keeps the GPU busy at batch 1.
#include "common.cuh"

namespace fw {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ uint32_t ordered_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_to_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
  }
  return c;
}

__device__ __forceinline__ float gumbel(uint32_t x) {
  const float u = ((float)(x >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -logf(-logf(u));
}

struct ArgMax {
  float v;
  int64_t i;
};
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
  return a;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
sample_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t* __restrict__ tokens,
              float* __restrict__ out_logprob, int64_t V, float temperature, int64_t top_k, float top_p,
              float log_min_p, bool use_min_p, uint32_t k0, uint32_t k1) {
  __shared__ float red_f[kWarps], red_g[kWarps];
  __shared__ int64_t red_i[kWarps];
  __shared__ uint32_t hist[256];
  __shared__ float hmass[256];
  __shared__ uint32_t sel_prefix, sel_mask;
  __shared__ float sel_remaining;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool greedy = temperature == 0.f;
  auto zat = [&](int64_t i) { return greedy ? to_f(x[i]) : to_f(x[i]) / temperature; };

  // pass 1: running max + sum of exp (logsumexp), and the argmax for greedy
  float m = -INFINITY, s = 0.f;
  ArgMax best{-INFINITY, V};
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    const float z = zat(i);
    if (z == -INFINITY) {  // a banned token: no mass, never the max
    } else if (z > m) {
      s = s * expf(m - z) + 1.f;
      m = z;
    } else {
      s += expf(z - m);
    }
    best = better(best, ArgMax{z, i});
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    const float M = fmaxf(m, m2);
    s = (M == -INFINITY) ? 0.f : s * expf(m - M) + s2 * expf(m2 - M);
    m = M;
    best = better(best, ArgMax{__shfl_xor_sync(0xffffffffu, best.v, o), __shfl_xor_sync(0xffffffffu, best.i, o)});
  }
  if (lane == 0) {
    red_f[warp] = m;
    red_g[warp] = s;
    red_i[warp] = best.i;
  }
  __syncthreads();
  __shared__ float row_max, row_lse;
  __shared__ int64_t row_argmax;
  if (threadIdx.x == 0) {
    float M = -INFINITY;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, red_f[w]);
    float S = 0.f;
    ArgMax b{-INFINITY, V};
    for (int w = 0; w < kWarps; ++w) {
      if (red_g[w] > 0.f) S += red_g[w] * expf(red_f[w] - M);
      if (red_i[w] < V) b = better(b, ArgMax{red_f[w] == -INFINITY ? -INFINITY : zat(red_i[w]), red_i[w]});
    }
    row_max = M;
    row_lse = M + logf(S);
    row_argmax = b.i;
  }
  __syncthreads();
  const float zmax = row_max, lse = row_lse;
  if (greedy) {
    if (threadIdx.x == 0) {
      tokens[row] = row_argmax;
      out_logprob[row] = zat(row_argmax) - lse;
    }
    return;
  }

  float tau = -INFINITY;
  if (top_k > 0 && top_k < V) {  // radix select of the k-th largest key, most significant digit first
    if (threadIdx.x == 0) {
      sel_prefix = 0u;
      sel_mask = 0u;
      sel_remaining = 0.f;
    }
    int64_t remaining = top_k;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < 256; i += kThreads) hist[i] = 0u;
      __syncthreads();
      const uint32_t prefix = sel_prefix, mask = sel_mask;
      for (int64_t i = threadIdx.x; i < V; i += kThreads) {
        const uint32_t key = ordered_key(zat(i));
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        int64_t cum = 0;
        int d = 255;
        for (; d > 0; --d) {
          if (cum + hist[d] >= remaining) break;
          cum += hist[d];
        }
        remaining -= cum;
        sel_prefix = prefix | ((uint32_t)d << shift);
        sel_mask = mask | (255u << shift);
      }
      __syncthreads();
    }
    tau = key_to_float(sel_prefix);
  }
  if (top_p < 1.f) {
    float part = 0.f;  // mass of the tokens top-k keeps
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      const float z = zat(i);
      if (z >= tau) part += expf(z - zmax);
    }
    const float total = block_sum(part, red_f);
    if (threadIdx.x == 0) {
      sel_prefix = 0u;
      sel_mask = 0u;
      sel_remaining = top_p * total;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < 256; i += kThreads) hmass[i] = 0.f;
      __syncthreads();
      const uint32_t prefix = sel_prefix, mask = sel_mask;
      for (int64_t i = threadIdx.x; i < V; i += kThreads) {
        const float z = zat(i);
        const uint32_t key = ordered_key(z);
        if (z >= tau && (key & mask) == prefix) atomicAdd(&hmass[(key >> shift) & 255u], expf(z - zmax));
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        float cum = 0.f;
        int d = 255, last_nonzero = 255;
        for (; d >= 0; --d) {
          if (hmass[d] > 0.f) last_nonzero = d;
          if (cum + hmass[d] >= sel_remaining) break;
          cum += hmass[d];
        }
        if (d < 0) d = last_nonzero;  // rounding left the target just out of reach: take the smallest digit
        sel_remaining -= cum;
        sel_prefix = prefix | ((uint32_t)d << shift);
        sel_mask = mask | (255u << shift);
      }
      __syncthreads();
    }
    tau = fmaxf(tau, key_to_float(sel_prefix));
  }
  if (use_min_p) tau = fmaxf(tau, zmax + log_min_p);

  // last pass: Gumbel-max over the allowed tokens; each thread draws 4 consecutive columns per Philox call
  ArgMax pick{-INFINITY, V};
  for (int64_t c4 = threadIdx.x; c4 * 4 < V; c4 += kThreads) {
    const uint4 r = philox4x32_10(make_uint4((uint32_t)c4, (uint32_t)row, 0u, 0u), k0, k1);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t i = c4 * 4 + j;
      if (i < V) {
        const float z = zat(i);
        const uint32_t w = j == 0 ? r.x : (j == 1 ? r.y : (j == 2 ? r.z : r.w));
        if (z >= tau) pick = better(pick, ArgMax{z + gumbel(w), i});
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    pick = better(pick, ArgMax{__shfl_xor_sync(0xffffffffu, pick.v, o), __shfl_xor_sync(0xffffffffu, pick.i, o)});
  __syncthreads();
  if (lane == 0) {
    red_f[warp] = pick.v;
    red_i[warp] = pick.i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ArgMax b{-INFINITY, V};
    for (int w = 0; w < kWarps; ++w)
      if (red_i[w] < V) b = better(b, ArgMax{red_f[w], red_i[w]});
    const int64_t tok = b.i < V ? b.i : row_argmax;
    tokens[row] = tok;
    out_logprob[row] = zat(tok) - lse;
  }
}

// Plain sampling (no top-k / top-p / min-p) and greedy need no row-wide threshold, so a row is split over
// P blocks: each writes a partial (max, sum of exp, best z + g, its index); sample_combine_kernel merges.
constexpr int kSplitThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kSplitThreads)
sample_split_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t V, float temperature, uint32_t k0,
                    uint32_t k1, int64_t cols_per_block, float* __restrict__ part_f, int64_t* __restrict__ part_i) {
  __shared__ float red_m[kSplitThreads / 32], red_s[kSplitThreads / 32], red_v[kSplitThreads / 32];
  __shared__ int64_t red_i[kSplitThreads / 32];
  const int64_t row = blockIdx.x, P = gridDim.y;  // rows on x: up to 2^31 - 1 of them
  const T* x = logits + row * row_stride;
  const bool greedy = temperature == 0.f;
  const int64_t c_begin = blockIdx.y * cols_per_block, c_end = min(V, c_begin + cols_per_block);
  float m = -INFINITY, s = 0.f;
  ArgMax pick{-INFINITY, V};
  for (int64_t c4 = c_begin / 4 + threadIdx.x; c4 * 4 < c_end; c4 += kSplitThreads) {
    uint4 r = make_uint4(0u, 0u, 0u, 0u);
    if (!greedy) r = philox4x32_10(make_uint4((uint32_t)c4, (uint32_t)row, 0u, 0u), k0, k1);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t i = c4 * 4 + j;
      if (i < c_end) {
        const float z = greedy ? to_f(x[i]) : to_f(x[i]) / temperature;
        if (z == -INFINITY) continue;  // a banned token
        if (z > m) {
          s = s * expf(m - z) + 1.f;
          m = z;
        } else {
          s += expf(z - m);
        }
        const uint32_t w = j == 0 ? r.x : (j == 1 ? r.y : (j == 2 ? r.z : r.w));
        pick = better(pick, ArgMax{greedy ? z : z + gumbel(w), i});
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    const float M = fmaxf(m, m2);
    s = (M == -INFINITY) ? 0.f : s * expf(m - M) + s2 * expf(m2 - M);
    m = M;
    pick = better(pick, ArgMax{__shfl_xor_sync(0xffffffffu, pick.v, o), __shfl_xor_sync(0xffffffffu, pick.i, o)});
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    red_m[warp] = m;
    red_s[warp] = s;
    red_v[warp] = pick.v;
    red_i[warp] = pick.i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float M = -INFINITY, S = 0.f;
    ArgMax b{-INFINITY, V};
    for (int w = 0; w < kSplitThreads / 32; ++w) M = fmaxf(M, red_m[w]);
    for (int w = 0; w < kSplitThreads / 32; ++w) {
      if (red_s[w] > 0.f) S += red_s[w] * expf(red_m[w] - M);
      if (red_i[w] < V) b = better(b, ArgMax{red_v[w], red_i[w]});
    }
    const int64_t k = row * P + blockIdx.y;
    part_f[3 * k] = M;
    part_f[3 * k + 1] = S;
    part_f[3 * k + 2] = b.v;
    part_i[k] = b.i;
  }
}

template <typename T>
__global__ void sample_combine_kernel(const T* __restrict__ logits, int64_t row_stride, int B, int64_t V,
                                      float temperature, int P, const float* __restrict__ part_f,
                                      const int64_t* __restrict__ part_i, int64_t* __restrict__ tokens,
                                      float* __restrict__ out_logprob) {
  const int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= B) return;
  float M = -INFINITY, S = 0.f;
  ArgMax b{-INFINITY, V};
  for (int p = 0; p < P; ++p) M = fmaxf(M, part_f[3 * (row * P + p)]);
  for (int p = 0; p < P; ++p) {
    const int64_t k = row * P + p;
    if (part_f[3 * k + 1] > 0.f) S += part_f[3 * k + 1] * expf(part_f[3 * k] - M);
    if (part_i[k] < V) b = better(b, ArgMax{part_f[3 * k + 2], part_i[k]});
  }
  const int64_t tok = b.i < V ? b.i : 0;
  const float x = to_f(logits[row * row_stride + tok]);
  tokens[row] = tok;
  out_logprob[row] = (temperature == 0.f ? x : x / temperature) - (M + logf(S));
}

}  // namespace

int sample_split_parts(int B, int64_t V, int sm_count) {
  int64_t P = (2 * (int64_t)sm_count + B - 1) / B;
  const int64_t most = (V + 4095) / 4096;  // at least 4096 columns per block
  if (P > most) P = most;
  if (P > 65535) P = 65535;
  return (int)(P < 1 ? 1 : P);
}

cudaError_t sample(DType dt, const void* logits, int64_t row_stride, int64_t* tokens, float* logprob, int B,
                   int64_t V, float temperature, int64_t top_k, float top_p, float log_min_p, bool use_min_p,
                   uint64_t seed, SampleSplitWorkspace split_ws, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  const uint32_t k0 = (uint32_t)(seed & 0xffffffffu), k1 = (uint32_t)(seed >> 32);
  const bool plain = temperature == 0.f || ((top_k <= 0 || top_k >= V) && top_p >= 1.f && !use_min_p);
  if (plain && split_ws.part_f != nullptr) {
    return dispatch(dt, [&](auto t) -> cudaError_t {
      using T = decltype(t);
      const int64_t cols = ((V + split_ws.P - 1) / split_ws.P + 3) / 4 * 4;  // multiples of 4: one Philox call
      sample_split_kernel<T><<<dim3((unsigned)B, (unsigned)split_ws.P), kSplitThreads, 0, stream>>>(
          (const T*)logits, row_stride, V, temperature, k0, k1, cols, split_ws.part_f, split_ws.part_i);
      cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
      sample_combine_kernel<T><<<(unsigned)((B + 127) / 128), 128, 0, stream>>>(
          (const T*)logits, row_stride, B, V, temperature, split_ws.P, split_ws.part_f, split_ws.part_i, tokens,
          logprob);
      return cudaGetLastError();
    });
  }
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    sample_kernel<T><<<(unsigned)B, kThreads, 0, stream>>>((const T*)logits, row_stride, tokens, logprob, V,
                                                          temperature, top_k, top_p, log_min_p, use_min_p, k0, k1);
    return cudaGetLastError();
  });
}

}  // namespace fw
