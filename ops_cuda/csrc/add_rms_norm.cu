// Residual add + RMSNorm in one pass: h = residual + x, rounded to residual's dtype as torch's add rounds it, then
// y = h * rsqrt(mean(h^2) + eps) * w from the rounded h, as rms_norm reads it, rounded once to y's dtype. One block
// per row; each thread keeps its elements of h in registers between the two halves.
// The backward takes the gradients of both outputs: grad_residual = grad_h + (the norm's gradient from grad_y, with
// the forward's rstd recomputed from h by the same reduction), in the residual's dtype, and grad_x = the same values
// in x's dtype: one pass instead of a cast of grad_y, the norm's backward, the add of the two gradients and a cast.
// Its blocks (one wave) loop over rows and keep their columns' grad_weight terms in registers; a second kernel sums
// the blocks' partial rows in a fixed order (sum_partial_rows), so grad_weight is the same from run to run.
#include "common.cuh"
#include "torch_utils.h"

namespace fw {

// x [rows, D] (X), residual [rows, D] (R), weight [D] (W); h [rows, D] in R, y [rows, D] in Y.
cudaError_t add_rms_norm_fwd(DType xdt, DType rdt, DType wdt, DType ydt, const void* x, const void* residual,
                             const void* w, void* h, void* y, int64_t rows, int D, float eps, cudaStream_t stream);
// grad_h, h, grad_residual in R; grad_y in Y; grad_x in X; grad_w [D] in W; partial [max_blocks, D] float32 scratch.
cudaError_t add_rms_norm_bwd(DType xdt, DType rdt, DType wdt, DType ydt, const void* grad_h, const void* grad_y,
                             const void* h, const void* w, void* grad_x, void* grad_residual, void* grad_w,
                             float* partial, int64_t rows, int D, float eps, cudaStream_t stream);
int add_rms_norm_bwd_max_blocks();

}  // namespace fw

namespace fw {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPerThread = 16;   // D up to 4096

// EPT: elements of a row a thread holds (the smallest power of two with kThreads * EPT >= D): registers for the
// row's D elements only, so more blocks stay resident.
template <typename X, typename R, typename W, typename Y, int EPT>
__global__ void __launch_bounds__(kThreads)
add_rms_norm_kernel(const X* __restrict__ x, const R* __restrict__ residual, const W* __restrict__ w,
                    R* __restrict__ h, Y* __restrict__ y, int D, float eps, unsigned trigger_from) {
  pdl_begin(trigger_from);
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const X* xr = x + row * D;
  const R* rr = residual + row * D;
  float v[EPT];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < EPT; ++j) {
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
  for (int j = 0; j < EPT; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < D) y[row * D + i] = from_f<Y>(v[j] * r * to_f(w[i]));
  }
}

template <typename X, typename R, typename W, typename Y, int EPT>
__global__ void __launch_bounds__(kThreads)
add_rms_norm_bwd_kernel(const R* __restrict__ grad_h, const Y* __restrict__ grad_y, const R* __restrict__ h,
                        const W* __restrict__ w, X* __restrict__ grad_x, R* __restrict__ grad_r,
                        float* __restrict__ partial, int64_t rows, int D, float eps, unsigned trigger_from) {
  pdl_begin(trigger_from);
  __shared__ float red[32];
  float gw_acc[EPT];
#pragma unroll
  for (int j = 0; j < EPT; ++j) gw_acc[j] = 0.f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    float v[EPT], g[EPT];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      const int i = threadIdx.x + j * kThreads;
      v[j] = g[j] = 0.f;
      if (i < D) {
        v[j] = to_f(h[row * D + i]);
        g[j] = to_f(grad_y[row * D + i]);
        ss += v[j] * v[j];
      }
    }
    // the forward's rstd: the same values summed by the same block reduction
    const float r = rsqrtf(block_sum(ss, red) / D + eps);
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      const int i = threadIdx.x + j * kThreads;
      if (i < D) dot += g[j] * to_f(w[i]) * v[j];
    }
    const float c = r * r * r * block_sum(dot, red) / D;
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      const int i = threadIdx.x + j * kThreads;
      if (i < D) {
        const float gx = r * g[j] * to_f(w[i]) - v[j] * c;
        const float total = to_f(grad_h[row * D + i]) + gx;
        grad_r[row * D + i] = from_f<R>(total);
        grad_x[row * D + i] = from_f<X>(total);
        gw_acc[j] += g[j] * v[j] * r;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < EPT; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < D) partial[(int64_t)blockIdx.x * D + i] = gw_acc[j];
  }
}

// f(std::integral_constant<int, EPT>) with the smallest EPT in 1, 2, 4, 8, 16 that covers D (D <= kThreads * 16).
template <typename F> cudaError_t with_ept(int D, F&& f) {
  if (D <= kThreads) return f(std::integral_constant<int, 1>{});
  if (D <= 2 * kThreads) return f(std::integral_constant<int, 2>{});
  if (D <= 4 * kThreads) return f(std::integral_constant<int, 4>{});
  if (D <= 8 * kThreads) return f(std::integral_constant<int, 8>{});
  return f(std::integral_constant<int, 16>{});
}

// One of two types by a runtime test: f(Tag<A>) or f(Tag<B>).
template <typename T> struct Tag { using type = T; };
template <typename A, typename B, typename F> cudaError_t either(bool first, F&& f) {
  return first ? f(Tag<A>{}) : f(Tag<B>{});
}

}  // namespace

// The dtypes the model's forwards meet: x in X; the residual, and so h, in X or float32; the weight in X or float32;
// y in X or in the residual's dtype. f(X{}, R{}, W{}, Y{}, EPT) for those of the arguments, or an error.
template <typename F> cudaError_t dispatch_types(DType xdt, DType rdt, DType wdt, DType ydt, int D, F&& f) {
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
          return with_ept(D, [&](auto ept) { return f(X{}, R{}, W{}, Y{}, ept); });
        });
      });
    });
  });
}

cudaError_t add_rms_norm_fwd(DType xdt, DType rdt, DType wdt, DType ydt, const void* x, const void* residual,
                             const void* w, void* h, void* y, int64_t rows, int D, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch_types(xdt, rdt, wdt, ydt, D, [&](auto xv, auto rv, auto wv, auto yv, auto ept) {
    using X = decltype(xv);
    using R = decltype(rv);
    using W = decltype(wv);
    using Y = decltype(yv);
    return launch_kernel(add_rms_norm_kernel<X, R, W, Y, decltype(ept)::value>, (unsigned)rows, kThreads, 0, stream,
                         (const X*)x, (const R*)residual, (const W*)w, (R*)h, (Y*)y, D, eps);
  });
}

// The backward's blocks: at most one wave, at most 2048 / kThreads resident a multiprocessor.
int add_rms_norm_bwd_max_blocks() {
  int dev = 0;
  const int sms =
      cleared(cudaGetDevice(&dev)) == cudaSuccess ? device_attribute<cudaDevAttrMultiProcessorCount>(dev) : 0;
  return (sms > 0 ? sms : 132) * (2048 / kThreads);
}

cudaError_t add_rms_norm_bwd(DType xdt, DType rdt, DType wdt, DType ydt, const void* grad_h, const void* grad_y,
                             const void* h, const void* w, void* grad_x, void* grad_residual, void* grad_w,
                             float* partial, int64_t rows, int D, float eps, cudaStream_t stream) {
  return dispatch_types(xdt, rdt, wdt, ydt, D, [&](auto xv, auto rv, auto wv, auto yv, auto ept) {
    using X = decltype(xv);
    using R = decltype(rv);
    using W = decltype(wv);
    using Y = decltype(yv);
    auto kernel = add_rms_norm_bwd_kernel<X, R, W, Y, decltype(ept)::value>;
    const int64_t wave = (int64_t)add_rms_norm_bwd_max_blocks() / (2048 / kThreads) *
                         resident_blocks((const void*)kernel, kThreads, 0);
    const int blocks = (int)std::min<int64_t>(std::max<int64_t>(rows, 1), wave);
    if (rows > 0) {
      const cudaError_t e = launch_kernel(kernel, (unsigned)blocks, kThreads, 0, stream, (const R*)grad_h,
                                          (const Y*)grad_y, (const R*)h, (const W*)w, (X*)grad_x, (R*)grad_residual,
                                          partial, rows, D, eps);
      if (e != cudaSuccess) return e;
    }
    return sum_partial_rows(partial, (W*)grad_w, (W*)nullptr, D, rows > 0 ? blocks : 0, D, stream);
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

std::tuple<Tensor, Tensor, Tensor> add_rms_norm_backward(const Tensor& grad_h, const Tensor& grad_y, const Tensor& h,
                                                         const Tensor& weight, double eps, at::ScalarType x_dtype) {
  check_cuda(h, "add_rms_norm_backward", "h");
  c10::cuda::CUDAGuard guard(h.device());
  const auto rdt = dtype_of(h, "add_rms_norm_backward", "h"), wdt = dtype_of(weight, "add_rms_norm_backward", "weight");
  const auto ydt = dtype_of(grad_y, "add_rms_norm_backward", "grad_y");
  auto gx = at::empty(h.sizes(), h.options().dtype(x_dtype).memory_format(at::MemoryFormat::Contiguous));
  const auto xdt = dtype_of(gx, "add_rms_norm_backward", "x_dtype");
  TORCH_CHECK(grad_h.sizes() == h.sizes() && grad_y.sizes() == h.sizes() && grad_h.scalar_type() == h.scalar_type(),
              "fw::add_rms_norm_backward: grad_h (h's dtype) and grad_y must have h's shape");
  TORCH_CHECK(grad_h.device() == h.device() && grad_y.device() == h.device() && weight.device() == h.device(),
              "fw::add_rms_norm_backward: all tensors must be on one device");
  const int64_t D = h.size(-1);
  TORCH_CHECK(weight.numel() == D && D <= 4096, "fw::add_rms_norm_backward: weight must have h.shape[-1] <= 4096 "
              "elements");
  auto ghc = grad_h.contiguous(), gyc = grad_y.contiguous(), hc = h.contiguous(), wc = weight.contiguous();
  auto gr = at::empty_like(hc);
  auto gw = at::empty_like(wc);
  const int64_t rows = h.numel() / std::max<int64_t>(D, 1);
  auto partial = at::empty({std::min<int64_t>(std::max<int64_t>(rows, 1), fw::add_rms_norm_bwd_max_blocks()), D},
                           h.options().dtype(at::kFloat));
  check_launch(fw::add_rms_norm_bwd(xdt, rdt, wdt, ydt, ghc.data_ptr(), gyc.data_ptr(), hc.data_ptr(), wc.data_ptr(),
                                    gx.data_ptr(), gr.data_ptr(), gw.data_ptr(), partial.data_ptr<float>(), rows,
                                    (int)D, (float)eps, at::cuda::getCurrentCUDAStream()),
               "add_rms_norm_backward");
  return {gx, gr, gw};
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("add_rms_norm_backward", &add_rms_norm_backward);
}
