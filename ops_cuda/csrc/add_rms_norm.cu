// Residual add + RMSNorm in one pass (inference): h = residual + x, rounded to residual's dtype as torch's add
// rounds it, then y = h * rsqrt(mean(h^2) + eps) * w from the rounded h, as rms_norm reads it, rounded once to
// y's dtype. One block per row; each thread keeps its elements of h in registers between the two halves.
#include "common.cuh"
#include "torch_utils.h"

namespace fw {

// x [rows, D] (X), residual [rows, D] (R), weight [D] (W); h [rows, D] in R, y [rows, D] in Y.
cudaError_t add_rms_norm_fwd(DType xdt, DType rdt, DType wdt, DType ydt, const void* x, const void* residual,
                             const void* w, void* h, void* y, int64_t rows, int D, float eps, cudaStream_t stream);

}  // namespace fw

namespace fw {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPerThread = 16;   // D up to 4096

template <typename X, typename R, typename W, typename Y>
__global__ void __launch_bounds__(kThreads)
add_rms_norm_kernel(const X* __restrict__ x, const R* __restrict__ residual, const W* __restrict__ w,
                    R* __restrict__ h, Y* __restrict__ y, int D, float eps, unsigned trigger_from) {
  pdl_begin(trigger_from);
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const X* xr = x + row * D;
  const R* rr = residual + row * D;
  float v[kMaxPerThread];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int i = threadIdx.x + j * kThreads;
    v[j] = 0.f;
    if (i < D) {
      const R sum = from_f<R>(to_f(rr[i]) + to_f(xr[i]));
      h[row * D + i] = sum;
      v[j] = to_f(sum);
      ss += v[j] * v[j];
    }
  }
  const float r = rsqrtf(block_sum(ss, red) / D + eps);
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < D) y[row * D + i] = from_f<Y>(v[j] * r * to_f(w[i]));
  }
}

// One of two types by a runtime test: f(Tag<A>) or f(Tag<B>).
template <typename T> struct Tag { using type = T; };
template <typename A, typename B, typename F> cudaError_t either(bool first, F&& f) {
  return first ? f(Tag<A>{}) : f(Tag<B>{});
}

}  // namespace

// The dtypes the model's forwards meet: x in X; the residual, and so h, in X or float32; the weight in X or float32;
// y in X or in the residual's dtype.
cudaError_t add_rms_norm_fwd(DType xdt, DType rdt, DType wdt, DType ydt, const void* x, const void* residual,
                             const void* w, void* h, void* y, int64_t rows, int D, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const bool supported = D <= kThreads * kMaxPerThread && (rdt == xdt || rdt == DType::F32) &&
                         (wdt == xdt || wdt == DType::F32) && (ydt == xdt || ydt == rdt);
  if (!supported) return cudaErrorInvalidValue;
  return dispatch(xdt, [&](auto xv) {
    using X = decltype(xv);
    return either<X, float>(rdt == xdt, [&](auto rt) {
      using R = typename decltype(rt)::type;
      return either<X, float>(wdt == xdt, [&](auto wt) {
        using W = typename decltype(wt)::type;
        return either<X, R>(ydt == xdt, [&](auto yt) {
          using Y = typename decltype(yt)::type;
          return launch_kernel(add_rms_norm_kernel<X, R, W, Y>, (unsigned)rows, kThreads, 0, stream, (const X*)x,
                               (const R*)residual, (const W*)w, (R*)h, (Y*)y, D, eps);
        });
      });
    });
  });
}

}  // namespace fw

namespace {

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps,
                                        std::optional<at::ScalarType> out_dtype) {
  check_cuda(x, "add_rms_norm", "x");
  c10::cuda::CUDAGuard guard(x.device());
  const auto xdt = dtype_of(x, "add_rms_norm", "x"), rdt = dtype_of(residual, "add_rms_norm", "residual");
  const auto wdt = dtype_of(weight, "add_rms_norm", "weight");
  TORCH_CHECK(residual.device() == x.device() && weight.device() == x.device(),
              "fw::add_rms_norm: x, residual and weight must be on one device");
  TORCH_CHECK(x.sizes() == residual.sizes(), "fw::add_rms_norm: x and residual shapes differ");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D, "fw::add_rms_norm: weight must have x.shape[-1] elements");
  TORCH_CHECK(D <= 4096, "fw::add_rms_norm: the CUDA kernel takes rows of up to 4096 elements, got ", D);
  TORCH_CHECK((rdt == xdt || rdt == fw::DType::F32) && (wdt == xdt || wdt == fw::DType::F32),
              "fw::add_rms_norm: the residual and the weight must be in x's dtype or float32");
  auto xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  auto h = at::empty(residual.sizes(), residual.options().memory_format(at::MemoryFormat::Contiguous));
  auto y = at::empty_like(h, h.options().dtype(out_dtype.value_or(residual.scalar_type())));
  const auto ydt = dtype_of(y, "add_rms_norm", "out_dtype");
  TORCH_CHECK(ydt == xdt || ydt == rdt, "fw::add_rms_norm: out_dtype must be x's or the residual's dtype");
  check_launch(fw::add_rms_norm_fwd(xdt, rdt, wdt, ydt, xc.data_ptr(), rc.data_ptr(), wc.data_ptr(), h.data_ptr(),
                                    y.data_ptr(), x.numel() / std::max<int64_t>(D, 1), (int)D, (float)eps,
                                    at::cuda::getCurrentCUDAStream()),
               "add_rms_norm");
  return {h, y};
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) {
  m.impl("add_rms_norm", &add_rms_norm);
}
