// SwiGLU on a fused gate_up [rows, 2I]: out = silu(gate) * up, and its backward; elementwise with
// 16-byte accesses when I is a multiple of the vector width. 2-D grid (x: vectors of a row, y: rows,
// grid-stride) so no thread divides 64-bit indices.
#include "common.cuh"
#include "torch_utils.h"

namespace fw {

// gate_up [rows, 2I] -> out [rows, I]; backward: grad [rows, I] -> grad_gate_up [rows, 2I].
cudaError_t swiglu_fwd(DType dt, const void* gate_up, void* out, int64_t rows, int64_t I, cudaStream_t stream);
cudaError_t swiglu_bwd(DType dt, const void* grad, const void* gate_up, void* grad_gate_up, int64_t rows,
                       int64_t I, cudaStream_t stream);

}  // namespace fw

namespace fw {
namespace {

constexpr int kThreads = 128;

// div.approx (2 ulp) instead of an IEEE division (the Triton kernel of torch.compile uses div.full, also
// approximate): fewer instructions in a kernel bound by memory and issue (`python -m benchmarks.ops.bench_ops
// --only swiglu`). A denominator past 2^126 (g < -87) gives 0, the limit.
__device__ __forceinline__ float sigmoid(float g) { return __fdividef(1.f, 1.f + expf(-g)); }

// kFlat: the grid has a block row per row (no loop).
template <typename T, int VEC, bool kFlat>
__global__ void __launch_bounds__(kThreads)
swiglu_fwd_kernel(const T* __restrict__ gu, T* __restrict__ out, int64_t rows, int64_t I,
                  unsigned trigger_from) {
  pdl_begin(trigger_from);
  const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  if (c >= I) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    Vec<T, VEC> g = load_vec<T, VEC>(gu + r * 2 * I + c), u = load_vec<T, VEC>(gu + r * 2 * I + I + c);
    float o[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float gf = to_f(g.v[j]);
      o[j] = gf * sigmoid(gf) * to_f(u.v[j]);
    }
    store_vec<T, VEC>(out + r * I + c, vec_from_f<T, VEC>(o));
    if constexpr (kFlat) break;
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
swiglu_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ gu, T* __restrict__ ggu, int64_t rows,
                  int64_t I, unsigned trigger_from) {
  pdl_begin(trigger_from);
  const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  if (c >= I) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    Vec<T, VEC> g = load_vec<T, VEC>(gu + r * 2 * I + c), u = load_vec<T, VEC>(gu + r * 2 * I + I + c);
    Vec<T, VEC> d = load_vec<T, VEC>(grad + r * I + c);
    float dg[VEC], du[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float gf = to_f(g.v[j]), uf = to_f(u.v[j]), df = to_f(d.v[j]);
      const float s = sigmoid(gf);
      dg[j] = df * uf * s * (1.f + gf * (1.f - s));
      du[j] = df * gf * s;
    }
    store_vec<T, VEC>(ggu + r * 2 * I + c, vec_from_f<T, VEC>(dg));
    store_vec<T, VEC>(ggu + r * 2 * I + I + c, vec_from_f<T, VEC>(du));
  }
}

// x: the vectors of a row; y: rows. `flat` (the forward): a block row per row (up to 65,535, then grid-stride), as
// a pointwise Triton kernel launches, no block loops: the loop-free grid is a little faster than looping blocks
// (and evict-first cache hints are no better; `python -m benchmarks.ops.bench_ops --only swiglu`). The backward
// keeps the loops.
dim3 grid_for(int64_t rows, int64_t vectors_per_row, bool flat) {
  const int64_t x = (vectors_per_row + kThreads - 1) / kThreads;
  int64_t y = flat ? rows : (132 * 64 + x - 1) / x;
  y = y < rows ? y : rows;
  y = y < 65535 ? y : 65535;
  return dim3((unsigned)x, (unsigned)(y > 0 ? y : 1));
}

}  // namespace

cudaError_t swiglu_fwd(DType dt, const void* gate_up, void* out, int64_t rows, int64_t I, cudaStream_t stream) {
  if (rows * I == 0) return cudaSuccess;
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    constexpr int V16 = 16 / sizeof(T);
    const bool vec = I % V16 == 0 && aligned16(gate_up) && aligned16(out);
    const dim3 grid = grid_for(rows, vec ? I / V16 : I, true);
    const bool flat = grid.y == rows;
    auto kernel = vec ? (flat ? swiglu_fwd_kernel<T, V16, true> : swiglu_fwd_kernel<T, V16, false>)
                      : (flat ? swiglu_fwd_kernel<T, 1, true> : swiglu_fwd_kernel<T, 1, false>);
    return launch_kernel(kernel, grid, kThreads, 0, stream, (const T*)gate_up, (T*)out, rows, I);
  });
}

cudaError_t swiglu_bwd(DType dt, const void* grad, const void* gate_up, void* grad_gate_up, int64_t rows,
                       int64_t I, cudaStream_t stream) {
  if (rows * I == 0) return cudaSuccess;
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    constexpr int V16 = 16 / sizeof(T);
    const bool vec = I % V16 == 0 && aligned16(grad) && aligned16(gate_up) && aligned16(grad_gate_up);
    return launch_kernel(vec ? swiglu_bwd_kernel<T, V16> : swiglu_bwd_kernel<T, 1>,
                         grid_for(rows, vec ? I / V16 : I, false), kThreads, 0, stream, (const T*)grad,
                         (const T*)gate_up, (T*)grad_gate_up, rows, I);
  });
}

}  // namespace fw

namespace {

// ------------------------------------------------------------------ swiglu
Tensor swiglu(const Tensor& gate_up) {
  check_cuda(gate_up, "swiglu", "gate_up");
  c10::cuda::CUDAGuard guard(gate_up.device());
  const auto dt = dtype_of(gate_up, "swiglu", "gate_up");
  auto gu = gate_up.contiguous();
  const int64_t I = gu.size(-1) / 2;
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gu.options());
  const int64_t rows = I ? gu.numel() / (2 * I) : 0;
  check_launch(fw::swiglu_fwd(dt, gu.data_ptr(), out.data_ptr(), rows, I, at::cuda::getCurrentCUDAStream()),
               "swiglu");
  return out;
}

Tensor swiglu_backward(const Tensor& grad, const Tensor& gate_up) {
  check_cuda(gate_up, "swiglu_backward", "gate_up");
  c10::cuda::CUDAGuard guard(gate_up.device());
  const auto dt = dtype_of(gate_up, "swiglu_backward", "gate_up");
  auto gu = gate_up.contiguous();
  auto g = grad.to(gu.scalar_type()).contiguous();
  const int64_t I = gu.size(-1) / 2;
  auto out = at::empty(gu.sizes(), gu.options());
  const int64_t rows = I ? gu.numel() / (2 * I) : 0;
  check_launch(fw::swiglu_bwd(dt, g.data_ptr(), gu.data_ptr(), out.data_ptr(), rows, I,
                              at::cuda::getCurrentCUDAStream()),
               "swiglu_backward");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) {
  m.impl("swiglu", &swiglu);
  m.impl("swiglu_backward", &swiglu_backward);
}
