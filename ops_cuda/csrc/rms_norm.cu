// RMSNorm forward and backward: one warp per row, fp32 accumulation, 16-byte loads when aligned.
#include "common.cuh"

namespace fw {
namespace {

constexpr int kWarps = 8;  // rows per block

template <typename T, typename W, int VEC>
__global__ void __launch_bounds__(kWarps * 32)
rms_norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ w, T* __restrict__ y, int64_t rows, int D,
                    float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  const T* xr = x + row * D;
  T* yr = y + row * D;
  float ss = 0.f;
  for (int i = lane * VEC; i < D; i += 32 * VEC) {
    Vec<T, VEC> v = load_vec<T, VEC>(xr + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float f = to_f(v.v[j]);
      ss += f * f;
    }
  }
  const float r = rsqrtf(warp_sum(ss) / D + eps);
  for (int i = lane * VEC; i < D; i += 32 * VEC) {  // the second read of the row hits L1
    Vec<T, VEC> v = load_vec<T, VEC>(xr + i);
    Vec<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.v[j] = from_f<T>(to_f(v.v[j]) * r * to_f(w[i + j]));
    store_vec<T, VEC>(yr + i, o);
  }
}

// gx = r*g*w - x*r^3*mean(g*w*x); gw_partial[block] += g*x*r (shared-memory accumulation per block).
template <typename T, typename W, int VEC>
__global__ void __launch_bounds__(kWarps * 32)
rms_norm_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ x, const W* __restrict__ w,
                    T* __restrict__ gx, float* __restrict__ gw_partial, int64_t rows, int D, float eps) {
  extern __shared__ float gw_acc[];
  for (int i = threadIdx.x; i < D; i += blockDim.x) gw_acc[i] = 0.f;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warps_total = (int64_t)gridDim.x * kWarps;
  for (int64_t row = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5); row < rows; row += warps_total) {
    const T* xr = x + row * D;
    const T* gr = grad + row * D;
    float ss = 0.f, dot = 0.f;
    for (int i = lane * VEC; i < D; i += 32 * VEC) {
      Vec<T, VEC> xv = load_vec<T, VEC>(xr + i), gv = load_vec<T, VEC>(gr + i);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float xf = to_f(xv.v[j]);
        ss += xf * xf;
        dot += to_f(gv.v[j]) * to_f(w[i + j]) * xf;
      }
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    const float r = rsqrtf(ss / D + eps);
    const float c = r * r * r * dot / D;
    T* gxr = gx + row * D;
    for (int i = lane * VEC; i < D; i += 32 * VEC) {
      Vec<T, VEC> xv = load_vec<T, VEC>(xr + i), gv = load_vec<T, VEC>(gr + i);
      Vec<T, VEC> o;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float xf = to_f(xv.v[j]), gf = to_f(gv.v[j]);
        o.v[j] = from_f<T>(r * gf * to_f(w[i + j]) - xf * c);
        atomicAdd(&gw_acc[i + j], gf * xf * r);
      }
      store_vec<T, VEC>(gxr + i, o);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < D; i += blockDim.x) gw_partial[(int64_t)blockIdx.x * D + i] = gw_acc[i];
}

template <typename T, typename W>
cudaError_t launch_fwd(const void* x, const void* w, void* y, int64_t rows, int D, float eps, cudaStream_t s) {
  constexpr int V16 = 16 / sizeof(T);
  const dim3 grid((unsigned)((rows + kWarps - 1) / kWarps));
  if (rows == 0) return cudaSuccess;
  if (D % V16 == 0 && aligned16(x) && aligned16(y))
    rms_norm_fwd_kernel<T, W, V16><<<grid, kWarps * 32, 0, s>>>((const T*)x, (const W*)w, (T*)y, rows, D, eps);
  else
    rms_norm_fwd_kernel<T, W, 1><<<grid, kWarps * 32, 0, s>>>((const T*)x, (const W*)w, (T*)y, rows, D, eps);
  return cudaGetLastError();
}

template <typename T, typename W>
cudaError_t launch_bwd(const void* g, const void* x, const void* w, void* gx, float* part, int blocks,
                       int64_t rows, int D, float eps, cudaStream_t s) {
  constexpr int V16 = 16 / sizeof(T);
  const size_t smem = (size_t)D * sizeof(float);
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(rms_norm_bwd_kernel<T, W, 1>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    e = cudaFuncSetAttribute(rms_norm_bwd_kernel<T, W, V16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)smem);
    if (e != cudaSuccess) return e;
  }
  if (D % V16 == 0 && aligned16(x) && aligned16(g) && aligned16(gx))
    rms_norm_bwd_kernel<T, W, V16><<<blocks, kWarps * 32, smem, s>>>((const T*)g, (const T*)x, (const W*)w,
                                                                     (T*)gx, part, rows, D, eps);
  else
    rms_norm_bwd_kernel<T, W, 1><<<blocks, kWarps * 32, smem, s>>>((const T*)g, (const T*)x, (const W*)w,
                                                                   (T*)gx, part, rows, D, eps);
  return cudaGetLastError();
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

int rms_norm_bwd_blocks(int64_t rows, int sm_count) {
  const int64_t need = (rows + kWarps - 1) / kWarps;
  const int64_t cap = (int64_t)sm_count * 4;
  return (int)(need < cap ? (need > 0 ? need : 1) : cap);
}

cudaError_t rms_norm_bwd(DType dt, DType wdt, const void* grad, const void* x, const void* w, void* gx,
                         float* gw_partial, int blocks, int64_t rows, int D, float eps, cudaStream_t stream) {
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    if (wdt == DType::F32) return launch_bwd<T, float>(grad, x, w, gx, gw_partial, blocks, rows, D, eps, stream);
    if (wdt != dt) return cudaErrorInvalidValue;
    return launch_bwd<T, T>(grad, x, w, gx, gw_partial, blocks, rows, D, eps, stream);
  });
}

}  // namespace fw
