// Row kernels of the fused linear + logprob. The host (bindings.cpp) walks the [N, V] logits in tiles of
// n rows x vc vocabulary columns: it computes a fp32 tile z = hidden_rows @ weight_cols.T / temperature with
// cuBLAS (row i of the tile is contiguous, vc floats), then these kernels take one row per block:
// forward: online logsumexp with the entropy term, merged across the vocabulary tiles of a row through a
// per-row state (m, s, a) in global memory, the target's logit when it falls in the tile, and at the last
// tile the outputs; backward: dz written in the GEMM dtype for the two gradient GEMMs, from the saved lse
// and entropy. State: m (max), s = sum 2^((z-m) log2 e), a = sum 2^(..) (z-m) log2 e, so that
// lse = m + ln s and entropy = ln s - ln 2 * a/s, with no cancellation against m.
// Exponentials are ex2.approx (one MUFU op, 2 ulp) of an FFMA. With expf and a NaN test per element the forward
// row kernel ran at 60% of the SMs' throughput and 58% of DRAM bandwidth (ncu, H200); this form took it from
// 4.67 to 4.20 ms a call of the benchmark (docs/PERFORMANCE.md, run 6).
#include "common.cuh"

namespace fw {
namespace {

constexpr int kThreads = 256;
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

struct Lse {
  float m, s, a;
};

__device__ __forceinline__ Lse lse_merge(Lse x, Lse y) {
  if (y.s == 0.f) return x;
  if (x.s == 0.f) return y;
  if (y.m > x.m) {
    Lse t = x;
    x = y;
    y = t;
  }
  const float d = (y.m - x.m) * kLog2e, sc = ex2(d);  // a NaN m or s makes s and a NaN, hence the outputs
  return {x.m, x.s + y.s * sc, x.a + sc * (y.a + y.s * d)};
}

// One row of a tile per block: row i of z has vc columns (global columns v0 ..); `st` holds (m, s, a) and the
// target logit of every row of the row tile across its vocabulary tiles; the last tile (v0 + vc == V) writes
// logprob, entropy and lse. Each thread loads all CH vectors of a chunk before it reduces them (the
// exponentials of a chunk are independent), and moves its running (m, s, a) to the chunk's max once.
template <int VEC>
__global__ void __launch_bounds__(kThreads)
logprob_tile_fwd_kernel(const float* __restrict__ z, int64_t vc, int64_t v0, int64_t V,
                        const int64_t* __restrict__ targets, LogprobState st, float* __restrict__ logprob,
                        float* __restrict__ entropy, float* __restrict__ lse) {
  constexpr int CH = 16 / VEC;  // 64 bytes a thread in flight; a 128-byte variant took 64 registers, ran slower
  __shared__ Lse parts[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* zr = z + row * vc;
  float m = -INFINITY, s = 0.f, a = 0.f;  // s == 0: nothing seen yet; a NaN logit makes m NaN, then s and a
  for (int64_t i0 = (int64_t)threadIdx.x * VEC; i0 < vc; i0 += (int64_t)kThreads * VEC * CH) {
    float x[CH][VEC];
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int64_t i = i0 + (int64_t)c * kThreads * VEC;
      Vec<float, VEC> v;
      if (i < vc) v = load_vec<float, VEC>(zr + i);
#pragma unroll
      for (int j = 0; j < VEC; ++j) x[c][j] = i < vc ? v.v[j] : -INFINITY;  // past the end: weight 0
    }
    float cm = m;
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j) cm = max_nan(cm, x[c][j]);
    if (cm == -INFINITY) continue;  // only columns past the end so far
    if (s > 0.f) {                  // rescale the running sums to the new max (d = 0 when it did not move)
      const float d = (m - cm) * kLog2e, sc = ex2(d);
      a = sc * (a + s * d);
      s *= sc;
    }
    m = cm;
    const float mk = m * kLog2e;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        // (z - m) log2 e, floored at -200 so that a column past the end (z = -inf) adds 0 * -200 to a, not NaN
        const float d = max_nan(fmaf(x[c][j], kLog2e, -mk), -200.f), e = ex2(d);
        s += e;
        a = fmaf(e, d, a);
      }
    }
  }
  Lse acc{m, s, a};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Lse other{__shfl_xor_sync(0xffffffffu, acc.m, o), __shfl_xor_sync(0xffffffffu, acc.s, o),
              __shfl_xor_sync(0xffffffffu, acc.a, o)};
    acc = lse_merge(acc, other);
  }
  if ((threadIdx.x & 31) == 0) parts[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x != 0) return;
  Lse t = v0 == 0 ? Lse{0.f, 0.f, 0.f} : Lse{st.m[row], st.s[row], st.a[row]};
  for (int w = 0; w < kThreads / 32; ++w) t = lse_merge(t, parts[w]);
  const int64_t tg = targets[row];
  if (tg >= v0 && tg < v0 + vc) st.target_z[row] = zr[tg - v0];
  if (v0 + vc < V) {
    st.m[row] = t.m;
    st.s[row] = t.s;
    st.a[row] = t.a;
    return;
  }
  const float log_s = logf(t.s), l = t.m + log_s;
  lse[row] = l;
  entropy[row] = log_s - kLn2 * t.a / t.s;
  logprob[row] = tg < 0 ? 0.f : (tg >= V ? __int_as_float(0x7fc00000) : st.target_z[row] - l);
}

// g = glp * (onehot - p) - gH * p * (log p + H), p = exp(z - lse); an ignored target (< 0) has glp = 0.
// Row i of the tile: vc columns starting at global column v0; g has the same layout.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
logprob_tile_bwd_kernel(const float* __restrict__ z, int64_t vc, int64_t v0, const int64_t* __restrict__ targets,
                        const float* __restrict__ lse, const float* __restrict__ entropy,
                        const float* __restrict__ grad_logprob, const float* __restrict__ grad_entropy,
                        T* __restrict__ g) {
  const int64_t row = blockIdx.x;
  const float* zr = z + row * vc;
  T* gr = g + row * vc;
  const int64_t tg = targets[row] - v0;  // the target's column in this tile (maybe outside it)
  const float l = lse[row], lk = l * kLog2e, H = entropy[row], gH = grad_entropy[row];
  const float glp = targets[row] < 0 ? 0.f : grad_logprob[row];
  for (int64_t i = (int64_t)threadIdx.x * VEC; i < vc; i += (int64_t)kThreads * VEC) {
    Vec<float, VEC> v = load_vec<float, VEC>(zr + i);
    float o[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float logp = v.v[j] - l, p = ex2(fmaf(v.v[j], kLog2e, -lk));
      o[j] = -glp * p - gH * p * (logp + H);
      if (i + j == tg) o[j] += glp;
    }
    store_vec<T, VEC>(gr + i, vec_from_f<T, VEC>(o));
  }
}

}  // namespace

cudaError_t logprob_tile_fwd(const float* z, int64_t n, int64_t vc, int64_t v0, int64_t V, const int64_t* targets,
                             LogprobState state, float* logprob, float* entropy, float* lse, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (vc % 4 == 0 && aligned16(z))
    logprob_tile_fwd_kernel<4><<<(unsigned)n, kThreads, 0, stream>>>(z, vc, v0, V, targets, state, logprob, entropy,
                                                                     lse);
  else
    logprob_tile_fwd_kernel<1><<<(unsigned)n, kThreads, 0, stream>>>(z, vc, v0, V, targets, state, logprob, entropy,
                                                                     lse);
  return cudaGetLastError();
}

cudaError_t logprob_tile_bwd(DType dt, const float* z, int64_t n, int64_t vc, int64_t v0, const int64_t* targets,
                             const float* lse, const float* entropy, const float* grad_logprob,
                             const float* grad_entropy, void* g, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    if (vc % 4 == 0 && aligned16(z) && aligned16(g))
      logprob_tile_bwd_kernel<T, 4><<<(unsigned)n, kThreads, 0, stream>>>(z, vc, v0, targets, lse, entropy,
                                                                          grad_logprob, grad_entropy, (T*)g);
    else
      logprob_tile_bwd_kernel<T, 1><<<(unsigned)n, kThreads, 0, stream>>>(z, vc, v0, targets, lse, entropy,
                                                                          grad_logprob, grad_entropy, (T*)g);
    return cudaGetLastError();
  });
}

}  // namespace fw
