// Row kernels of the fused linear + logprob. The host (bindings.cpp) walks the [N, V] logits in tiles of
// n rows x vc vocabulary columns: it computes a fp32 tile z = hidden_rows @ weight_cols.T / temperature with
// cuBLAS (row i of the tile is contiguous, vc floats), then these kernels take one row per block:
// forward: logsumexp with the entropy term over the tile, merged across the vocabulary tiles of a row through a
// per-row state (m, s, a) in global memory, the target's logit when it falls in the tile, at the last tile the
// outputs, and optionally the tile's logits kept in fp16 for the backward; backward: dz written in the GEMM dtype
// for the two gradient GEMMs, from the saved lse and entropy and either a recomputed fp32 tile or the kept fp16
// logits. State: m (max), s = sum 2^((z-m) log2 e), a = sum 2^(..) (z-m) log2 e, so that lse = m + ln s and
// entropy = ln s - ln 2 * a/s, with no cancellation against m.
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

// One row of a tile per block, in slices of kSlice columns that the block holds in registers (32 floats a
// thread, all loaded before any is used): the slice's max first (a block reduction), then the exponentials
// against it, so no running max is rescaled. Thread 0 loads the row's state before the slice loads, so that
// latency overlaps them, and merges each slice into it. SAVE: the tile (one slice) is also stored in fp16 as
// z - max, with that max, for the backward; a shifted logit below fp16's range is stored as -65504 (its
// exponential is 0 either way, and the entropy term then stays 0 * finite).
constexpr int kPerThread = 32;
constexpr int64_t kSlice = (int64_t)kThreads * kPerThread;
static_assert(kSlice == kLogprobSaveCols, "a tile that keeps its logits must be one slice");

template <int VEC, bool SAVE>
__global__ void __launch_bounds__(kThreads)
logprob_tile_fwd_kernel(const float* __restrict__ z, int64_t vc, int64_t v0, int64_t V,
                        const int64_t* __restrict__ targets, LogprobState st, SavedLogits sv,
                        float* __restrict__ logprob, float* __restrict__ entropy, float* __restrict__ lse) {
  constexpr int CH = kPerThread / VEC;
  __shared__ float s_max[kThreads / 32], s_sum[2][kThreads / 32], s_tz;
  const int64_t row = blockIdx.x;
  const float* zr = z + row * vc;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t tg = targets[row], tcol = tg - v0;  // the target's column in this tile (maybe outside it)
  Lse t{0.f, 0.f, 0.f};  // thread 0: the row's state; s == 0 means nothing seen yet
  float tz_before = 0.f;
  if (threadIdx.x == 0 && v0 > 0) {
    t = Lse{st.m[row], st.s[row], st.a[row]};
    if (tg >= 0 && tg < v0) tz_before = st.target_z[row];
  }
  for (int64_t c0 = 0; c0 < vc; c0 += kSlice) {
    float x[CH][VEC];
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int64_t i = c0 + ((int64_t)c * kThreads + threadIdx.x) * VEC;
      Vec<float, VEC> v;
      if (i < vc) v = load_vec<float, VEC>(zr + i);
#pragma unroll
      for (int j = 0; j < VEC; ++j) x[c][j] = i < vc ? v.v[j] : -INFINITY;  // past the end: weight 0
    }
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j) mx = max_nan(mx, x[c][j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) s_max[warp] = mx;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) mx = max_nan(mx, s_max[w]);
    const float m = mx == -INFINITY ? 0.f : mx, mk = m * kLog2e;  // a slice of -inf only: shift 0
    float s = 0.f, a = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int64_t i = c0 + ((int64_t)c * kThreads + threadIdx.x) * VEC;
      float sh[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        // (z - m) log2 e, floored at -200 so that a column past the end (z = -inf) adds 0 * -200 to a, not NaN
        const float d = max_nan(fmaf(x[c][j], kLog2e, -mk), -200.f), e = ex2(d);
        s += e;
        a = fmaf(e, d, a);
        const float y = x[c][j] - m;
        sh[j] = y < -65504.f ? -65504.f : y;
        if (i + j == tcol) {  // the target's logit: kept for the last tile (s_tz) and across tiles (state)
          s_tz = x[c][j];
          st.target_z[row] = x[c][j];
        }
      }
      if constexpr (SAVE)
        if (i < vc) store_vec<__half, VEC>(static_cast<__half*>(sv.z16) + row * sv.ld + i, vec_from_f<__half, VEC>(sh));
    }
    s = warp_sum(s);
    a = warp_sum(a);
    if (lane == 0) {
      s_sum[0][warp] = s;
      s_sum[1][warp] = a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float S = 0.f, A = 0.f;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) {
        S += s_sum[0][w];
        A += s_sum[1][w];
      }
      t = lse_merge(t, Lse{m, S, A});
      if constexpr (SAVE) sv.off[row * sv.off_ld] = m;
    }
  }
  if (threadIdx.x != 0) return;
  if (v0 + vc < V) {
    st.m[row] = t.m;
    st.s[row] = t.s;
    st.a[row] = t.a;
    return;
  }
  const float log_s = logf(t.s), l = t.m + log_s;
  lse[row] = l;
  entropy[row] = log_s - kLn2 * t.a / t.s;
  const float tz = tcol >= 0 && tcol < vc ? s_tz : tz_before;
  logprob[row] = tg < 0 ? 0.f : (tg >= V ? __int_as_float(0x7fc00000) : tz - l);
}

// g = glp * (onehot - p) - gH * p * (log p + H), p = exp(z - lse); an ignored target (< 0) has glp = 0.
// Row i of the tile: vc columns starting at global column v0, read from z + i * ld and shifted by off[i * off_ld]
// when off is set (the kept fp16 logits); g is [n, vc].
template <typename Z, typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
logprob_tile_bwd_kernel(const Z* __restrict__ z, int64_t ld, const float* __restrict__ off, int64_t off_ld,
                        int64_t vc, int64_t v0, const int64_t* __restrict__ targets, const float* __restrict__ lse,
                        const float* __restrict__ entropy, const float* __restrict__ grad_logprob,
                        const float* __restrict__ grad_entropy, T* __restrict__ g) {
  const int64_t row = blockIdx.x;
  const Z* zr = z + row * ld;
  T* gr = g + row * vc;
  const int64_t tg = targets[row] - v0;  // the target's column in this tile (maybe outside it)
  const float c = (off ? off[row * off_ld] : 0.f) - lse[row], ck = c * kLog2e, H = entropy[row];
  const float gH = grad_entropy[row], glp = targets[row] < 0 ? 0.f : grad_logprob[row];
  for (int64_t i = (int64_t)threadIdx.x * VEC; i < vc; i += (int64_t)kThreads * VEC) {
    const Vec<Z, VEC> v = load_vec<Z, VEC>(zr + i);
    float o[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x = to_f(v.v[j]), logp = x + c, p = ex2(fmaf(x, kLog2e, ck));
      o[j] = -glp * p - gH * p * (logp + H);
      if (i + j == tg) o[j] += glp;
    }
    store_vec<T, VEC>(gr + i, vec_from_f<T, VEC>(o));
  }
}

}  // namespace

cudaError_t logprob_tile_fwd(const float* z, int64_t n, int64_t vc, int64_t v0, int64_t V, const int64_t* targets,
                             LogprobState state, SavedLogits saved, float* logprob, float* entropy, float* lse,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool save = saved.z16 != nullptr;
  if (save && vc > kLogprobSaveCols) return cudaErrorInvalidValue;
  // 4 columns a load, and 4 fp16 (8 bytes) a store when keeping the logits
  const bool vec4 = vc % 4 == 0 && aligned16(z) &&
                    (!save || (saved.ld % 4 == 0 && (reinterpret_cast<uintptr_t>(saved.z16) & 7u) == 0));
  auto launch = [&](auto kernel) {
    kernel<<<(unsigned)n, kThreads, 0, stream>>>(z, vc, v0, V, targets, state, saved, logprob, entropy, lse);
  };
  if (save)
    vec4 ? launch(logprob_tile_fwd_kernel<4, true>) : launch(logprob_tile_fwd_kernel<1, true>);
  else
    vec4 ? launch(logprob_tile_fwd_kernel<4, false>) : launch(logprob_tile_fwd_kernel<1, false>);
  return cudaGetLastError();
}

cudaError_t logprob_tile_bwd(DType dt, const float* z, SavedLogits saved, int64_t n, int64_t vc, int64_t v0,
                             const int64_t* targets, const float* lse, const float* entropy,
                             const float* grad_logprob, const float* grad_entropy, void* g, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    auto launch = [&](auto kernel, auto zp, int64_t ld, const float* off) {
      kernel<<<(unsigned)n, kThreads, 0, stream>>>(zp, ld, off, saved.off_ld, vc, v0, targets, lse, entropy,
                                                   grad_logprob, grad_entropy, (T*)g);
    };
    // 16 bytes a load and a store where aligned (g's rows are vc elements of T)
    if (saved.z16) {
      const __half* zh = static_cast<const __half*>(saved.z16);
      bool vec8 = false;  // 8 fp16 in, 8 T out: 16-byte accesses when T is 16-bit (the only kind that keeps logits)
      if constexpr (sizeof(T) == 2) vec8 = vc % 8 == 0 && saved.ld % 8 == 0 && aligned16(zh) && aligned16(g);
      if constexpr (sizeof(T) == 2)
        if (vec8) launch(logprob_tile_bwd_kernel<__half, T, 8>, zh, saved.ld, saved.off);
      if (!vec8) launch(logprob_tile_bwd_kernel<__half, T, 1>, zh, saved.ld, saved.off);
    } else if (vc % 4 == 0 && aligned16(z) && aligned16(g)) {
      launch(logprob_tile_bwd_kernel<float, T, 4>, z, vc, nullptr);
    } else {
      launch(logprob_tile_bwd_kernel<float, T, 1>, z, vc, nullptr);
    }
    return cudaGetLastError();
  });
}

}  // namespace fw
