// RMSNorm forward and backward, fp32 accumulation, 16-byte accesses when aligned.
// A row is handled by LANES lanes of a warp (16 for a 128-wide bf16 head, 32 otherwise) so that per-head
// QK-norm keeps every lane busy; when a row fits in registers (NV vectors per lane) it is read once.
// The backward accumulates grad_weight per lane in registers across the rows a warp visits and adds them
// into a per-block shared row once, then one partial row per block goes out (summed by the caller).
#include <type_traits>

#include "common.cuh"

namespace fw {
namespace {

constexpr int kThreads = 256;

template <int LANES> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// NV > 0: the row lives in registers (D <= LANES * VEC * NV); NV == 0: loop over the row twice.
template <typename T, typename W, int VEC, int LANES, int NV>
__global__ void __launch_bounds__(kThreads)
rms_norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ w, T* __restrict__ y, int64_t rows, int D,
                    float eps) {
  constexpr int kRowsPerBlock = kThreads / LANES;
  const int sub = threadIdx.x % LANES;
  const int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / LANES;
  const bool active = row < rows;  // inactive lanes still join the shuffles
  const T* xr = x + (active ? row : 0) * D;
  T* yr = y + row * D;
  float ss = 0.f;
  if constexpr (NV > 0) {
    Vec<T, VEC> v[NV];
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int i = (n * LANES + sub) * VEC;
      if (i < D) {
        v[n] = load_vec<T, VEC>(xr + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) ss += to_f(v[n].v[j]) * to_f(v[n].v[j]);
      }
    }
    const float r = rsqrtf(group_sum<LANES>(ss) / D + eps);
    if (!active) return;
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int i = (n * LANES + sub) * VEC;
      if (i < D) {
        Vec<T, VEC> o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = from_f<T>(to_f(v[n].v[j]) * r * to_f(w[i + j]));
        store_vec<T, VEC>(yr + i, o);
      }
    }
  } else {
    for (int i = sub * VEC; i < D; i += LANES * VEC) {
      Vec<T, VEC> v = load_vec<T, VEC>(xr + i);
#pragma unroll
      for (int j = 0; j < VEC; ++j) ss += to_f(v.v[j]) * to_f(v.v[j]);
    }
    const float r = rsqrtf(group_sum<LANES>(ss) / D + eps);
    if (!active) return;
    for (int i = sub * VEC; i < D; i += LANES * VEC) {  // the second read of the row hits L1
      Vec<T, VEC> v = load_vec<T, VEC>(xr + i);
      Vec<T, VEC> o;
#pragma unroll
      for (int j = 0; j < VEC; ++j) o.v[j] = from_f<T>(to_f(v.v[j]) * r * to_f(w[i + j]));
      store_vec<T, VEC>(yr + i, o);
    }
  }
}

// gx = r*g*w - x*r^3*mean(g*w*x); grad_weight partial of the block += g*x*r.
template <typename T, typename W, int VEC, int LANES, int NV>
__global__ void __launch_bounds__(kThreads)
rms_norm_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ x, const W* __restrict__ w,
                    T* __restrict__ gx, float* __restrict__ gw_partial, int64_t rows, int D, float eps) {
  extern __shared__ float gw_acc[];
  constexpr int kRowsPerBlock = kThreads / LANES;
  for (int i = threadIdx.x; i < D; i += blockDim.x) gw_acc[i] = 0.f;
  __syncthreads();
  const int sub = threadIdx.x % LANES;
  const int64_t stride = (int64_t)gridDim.x * kRowsPerBlock;
  const int64_t first = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / LANES;
  // every group runs the same number of iterations (shuffles need the whole warp)
  const int64_t iters = (rows + stride - 1) / stride;
  if constexpr (NV > 0) {
    float acc[NV][VEC];
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[n][j] = 0.f;
    for (int64_t it = 0; it < iters; ++it) {
      const int64_t row = first + it * stride;
      const bool active = row < rows;
      const T* xr = x + (active ? row : 0) * D;
      const T* gr = grad + (active ? row : 0) * D;
      Vec<T, VEC> xv[NV], gv[NV];
      float ss = 0.f, dot = 0.f;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int i = (n * LANES + sub) * VEC;
        if (i < D) {
          xv[n] = load_vec<T, VEC>(xr + i);
          gv[n] = load_vec<T, VEC>(gr + i);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float xf = to_f(xv[n].v[j]);
            ss += xf * xf;
            dot += to_f(gv[n].v[j]) * to_f(w[i + j]) * xf;
          }
        }
      }
      ss = group_sum<LANES>(ss);
      dot = group_sum<LANES>(dot);
      if (!active) continue;
      const float r = rsqrtf(ss / D + eps), c = r * r * r * dot / D;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int i = (n * LANES + sub) * VEC;
        if (i < D) {
          Vec<T, VEC> o;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float xf = to_f(xv[n].v[j]), gf = to_f(gv[n].v[j]);
            o.v[j] = from_f<T>(r * gf * to_f(w[i + j]) - xf * c);
            acc[n][j] += gf * xf * r;
          }
          store_vec<T, VEC>(gx + row * D + i, o);
        }
      }
    }
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int i = (n * LANES + sub) * VEC;
      if (i < D)
#pragma unroll
        for (int j = 0; j < VEC; ++j) atomicAdd(&gw_acc[i + j], acc[n][j]);
    }
  } else {
    for (int64_t it = 0; it < iters; ++it) {
      const int64_t row = first + it * stride;
      const bool active = row < rows;
      const T* xr = x + (active ? row : 0) * D;
      const T* gr = grad + (active ? row : 0) * D;
      float ss = 0.f, dot = 0.f;
      for (int i = sub * VEC; i < D; i += LANES * VEC) {
        Vec<T, VEC> xv = load_vec<T, VEC>(xr + i), gv = load_vec<T, VEC>(gr + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xf = to_f(xv.v[j]);
          ss += xf * xf;
          dot += to_f(gv.v[j]) * to_f(w[i + j]) * xf;
        }
      }
      ss = group_sum<LANES>(ss);
      dot = group_sum<LANES>(dot);
      if (!active) continue;
      const float r = rsqrtf(ss / D + eps), c = r * r * r * dot / D;
      for (int i = sub * VEC; i < D; i += LANES * VEC) {
        Vec<T, VEC> xv = load_vec<T, VEC>(xr + i), gv = load_vec<T, VEC>(gr + i);
        Vec<T, VEC> o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xf = to_f(xv.v[j]), gf = to_f(gv.v[j]);
          o.v[j] = from_f<T>(r * gf * to_f(w[i + j]) - xf * c);
          atomicAdd(&gw_acc[i + j], gf * xf * r);
        }
        store_vec<T, VEC>(gx + row * D + i, o);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < D; i += blockDim.x) gw_partial[(int64_t)blockIdx.x * D + i] = gw_acc[i];
}

// Picks LANES and NV for a row of D elements moved VEC at a time, then launches F<VEC, LANES, NV>.
template <int VEC, int MAX_ELEMS, typename L> cudaError_t by_shape(int D, L&& launch) {
  const int vecs = D / VEC;
  if (vecs <= 16) return launch(std::integral_constant<int, 16>{}, std::integral_constant<int, 1>{});
  const int nv = (vecs + 31) / 32;
  if (nv == 1) return launch(std::integral_constant<int, 32>{}, std::integral_constant<int, 1>{});
  if (nv == 2) return launch(std::integral_constant<int, 32>{}, std::integral_constant<int, 2>{});
  if (nv <= 4) return launch(std::integral_constant<int, 32>{}, std::integral_constant<int, 4>{});
  if constexpr (8 * VEC <= MAX_ELEMS) {
    if (nv <= 8) return launch(std::integral_constant<int, 32>{}, std::integral_constant<int, 8>{});
  }
  if constexpr (16 * VEC <= MAX_ELEMS) {
    if (nv <= 16) return launch(std::integral_constant<int, 32>{}, std::integral_constant<int, 16>{});
  }
  return launch(std::integral_constant<int, 32>{}, std::integral_constant<int, 0>{});
}

template <typename T, typename W>
cudaError_t launch_fwd(const void* x, const void* w, void* y, int64_t rows, int D, float eps, cudaStream_t s) {
  constexpr int V16 = 16 / sizeof(T);
  if (rows == 0) return cudaSuccess;
  auto go = [&](auto vec, auto lanes, auto nv) -> cudaError_t {
    constexpr int VEC = decltype(vec)::value, LANES = decltype(lanes)::value, NV = decltype(nv)::value;
    const int64_t per_block = kThreads / LANES;
    rms_norm_fwd_kernel<T, W, VEC, LANES, NV><<<(unsigned)((rows + per_block - 1) / per_block), kThreads, 0, s>>>(
        (const T*)x, (const W*)w, (T*)y, rows, D, eps);
    return cudaGetLastError();
  };
  if (D % V16 == 0 && aligned16(x) && aligned16(y))
    return by_shape<V16, 128>(D, [&](auto lanes, auto nv) { return go(std::integral_constant<int, V16>{}, lanes, nv); });
  return go(std::integral_constant<int, 1>{}, std::integral_constant<int, 32>{}, std::integral_constant<int, 0>{});
}

template <typename T, typename W>
cudaError_t launch_bwd(const void* g, const void* x, const void* w, void* gx, float* part, int max_blocks,
                       int* blocks_used, int64_t rows, int D, float eps, int sm_count, cudaStream_t s) {
  constexpr int V16 = 16 / sizeof(T);
  const size_t smem = (size_t)D * sizeof(float);
  auto go = [&](auto vec, auto lanes, auto nv) -> cudaError_t {
    constexpr int VEC = decltype(vec)::value, LANES = decltype(lanes)::value, NV = decltype(nv)::value;
    auto kernel = rms_norm_bwd_kernel<T, W, VEC, LANES, NV>;
    if (smem > 48 * 1024) {
      cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
      if (e != cudaSuccess) return e;
    }
    // one wave of resident blocks (a second partial wave would idle most SMs), at least 8 rows per block
    int per_sm = 0;
    cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
    if (e != cudaSuccess) return e;
    int64_t blocks = (int64_t)sm_count * (per_sm > 0 ? per_sm : 1);
    blocks = blocks < max_blocks ? blocks : max_blocks;
    const int64_t need = (rows + 7) / 8;
    blocks = blocks < need ? blocks : (need > 0 ? need : 1);
    *blocks_used = (int)blocks;
    kernel<<<(unsigned)blocks, kThreads, smem, s>>>((const T*)g, (const T*)x, (const W*)w, (T*)gx, part, rows, D, eps);
    return cudaGetLastError();
  };
  if (D % V16 == 0 && aligned16(x) && aligned16(g) && aligned16(gx))  // registers: x, g, acc of 32 elements
    return by_shape<V16, 32>(D, [&](auto lanes, auto nv) { return go(std::integral_constant<int, V16>{}, lanes, nv); });
  return go(std::integral_constant<int, 1>{}, std::integral_constant<int, 32>{}, std::integral_constant<int, 0>{});
}

}  // namespace

cudaError_t rms_norm_fwd(DType dt, DType wdt, const void* x, const void* w, void* y, int64_t rows, int D,
                         float eps, cudaStream_t stream) {
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    if (wdt == DType::F32) return launch_fwd<T, float>(x, w, y, rows, D, eps, stream);
    if (wdt != dt) return cudaErrorInvalidValue;
    return launch_fwd<T, T>(x, w, y, rows, D, eps, stream);
  });
}

int rms_norm_bwd_max_blocks(int sm_count) { return sm_count * (2048 / kThreads); }

cudaError_t rms_norm_bwd(DType dt, DType wdt, const void* grad, const void* x, const void* w, void* gx,
                         float* gw_partial, int max_blocks, int* blocks_used, int64_t rows, int D, float eps,
                         int sm_count, cudaStream_t stream) {
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    if (wdt == DType::F32)
      return launch_bwd<T, float>(grad, x, w, gx, gw_partial, max_blocks, blocks_used, rows, D, eps, sm_count, stream);
    if (wdt != dt) return cudaErrorInvalidValue;
    return launch_bwd<T, T>(grad, x, w, gx, gw_partial, max_blocks, blocks_used, rows, D, eps, sm_count, stream);
  });
}

}  // namespace fw
