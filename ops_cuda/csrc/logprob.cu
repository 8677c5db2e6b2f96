// Row kernels of the fused linear + logprob: the host (bindings.cpp) computes a fp32 logits tile
// z = hidden_chunk @ weight.T / temperature with cuBLAS, then these kernels take one row per block:
// forward: online logsumexp with the entropy term, the target's logprob; backward: dz written in the
// GEMM dtype for the two gradient GEMMs. State per thread: m (max), s = sum e^(z-m), a = sum e^(z-m)(z-m),
// so entropy = log s - a/s with no cancellation against m.
#include "common.cuh"

namespace fw {
namespace {

constexpr int kThreads = 512;

struct Lse {
  float m, s, a;
};

__device__ __forceinline__ void lse_add(Lse& st, float z) {
  if (st.s == 0.f) {
    st.m = z;
    st.s = 1.f;
    st.a = 0.f;
  } else if (z <= st.m) {
    const float d = z - st.m, e = expf(d);
    st.s += e;
    st.a += e * d;
  } else {
    const float d = st.m - z, sc = expf(d);  // rescale the running sums to the new max z
    st.a = sc * (st.a + st.s * d);
    st.s = st.s * sc + 1.f;
    st.m = z;
  }
}

__device__ __forceinline__ Lse lse_merge(Lse x, Lse y) {
  if (y.s == 0.f) return x;
  if (x.s == 0.f) return y;
  if (y.m > x.m) {
    Lse t = x;
    x = y;
    y = t;
  }
  const float d = y.m - x.m, sc = expf(d);
  return {x.m, x.s + y.s * sc, x.a + sc * (y.a + y.s * d)};
}

template <int VEC>
__global__ void __launch_bounds__(kThreads)
logprob_fwd_kernel(const float* __restrict__ z, const int64_t* __restrict__ targets, float* __restrict__ logprob,
                   float* __restrict__ entropy, float* __restrict__ lse, int64_t V) {
  __shared__ Lse parts[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* zr = z + row * V;
  Lse st{0.f, 0.f, 0.f};
  for (int64_t i = (int64_t)threadIdx.x * VEC; i < V; i += (int64_t)kThreads * VEC) {
    Vec<float, VEC> v = load_vec<float, VEC>(zr + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) lse_add(st, v.v[j]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Lse other{__shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.s, o),
              __shfl_xor_sync(0xffffffffu, st.a, o)};
    st = lse_merge(st, other);
  }
  if ((threadIdx.x & 31) == 0) parts[threadIdx.x >> 5] = st;
  __syncthreads();
  if (threadIdx.x == 0) {
    Lse t = parts[0];
    for (int w = 1; w < kThreads / 32; ++w) t = lse_merge(t, parts[w]);
    const float log_s = logf(t.s), l = t.m + log_s;
    lse[row] = l;
    entropy[row] = log_s - t.a / t.s;
    const int64_t tg = targets[row];
    logprob[row] = tg < 0 ? 0.f : (tg >= V ? __int_as_float(0x7fc00000) : zr[tg] - l);
  }
}

// g = glp * (onehot - p) - gH * p * (log p + H), p = exp(z - lse); an ignored target (< 0) has glp = 0.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
logprob_bwd_kernel(const float* __restrict__ z, const int64_t* __restrict__ targets, const float* __restrict__ lse,
                   const float* __restrict__ entropy, const float* __restrict__ grad_logprob,
                   const float* __restrict__ grad_entropy, T* __restrict__ g, int64_t V) {
  const int64_t row = blockIdx.x;
  const float* zr = z + row * V;
  T* gr = g + row * V;
  const int64_t tg = targets[row];
  const float l = lse[row], H = entropy[row], gH = grad_entropy[row];
  const float glp = tg < 0 ? 0.f : grad_logprob[row];
  for (int64_t i = (int64_t)threadIdx.x * VEC; i < V; i += (int64_t)kThreads * VEC) {
    Vec<float, VEC> v = load_vec<float, VEC>(zr + i);
    Vec<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float logp = v.v[j] - l, p = expf(logp);
      float d = -glp * p - gH * p * (logp + H);
      if (i + j == tg) d += glp;
      o.v[j] = from_f<T>(d);
    }
    store_vec<T, VEC>(gr + i, o);
  }
}

}  // namespace

cudaError_t logprob_rows_fwd(const float* z, const int64_t* targets, float* logprob, float* entropy, float* lse,
                             int64_t n, int64_t V, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (V % 4 == 0 && aligned16(z))
    logprob_fwd_kernel<4><<<(unsigned)n, kThreads, 0, stream>>>(z, targets, logprob, entropy, lse, V);
  else
    logprob_fwd_kernel<1><<<(unsigned)n, kThreads, 0, stream>>>(z, targets, logprob, entropy, lse, V);
  return cudaGetLastError();
}

cudaError_t logprob_rows_bwd(DType dt, const float* z, const int64_t* targets, const float* lse,
                             const float* entropy, const float* grad_logprob, const float* grad_entropy, void* g,
                             int64_t n, int64_t V, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    if (V % 4 == 0 && aligned16(z) && aligned16(g))
      logprob_bwd_kernel<T, 4><<<(unsigned)n, kThreads, 0, stream>>>(z, targets, lse, entropy, grad_logprob,
                                                                     grad_entropy, (T*)g, V);
    else
      logprob_bwd_kernel<T, 1><<<(unsigned)n, kThreads, 0, stream>>>(z, targets, lse, entropy, grad_logprob,
                                                                     grad_entropy, (T*)g, V);
    return cudaGetLastError();
  });
}

}  // namespace fw
