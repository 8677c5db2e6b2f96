// merge_attention_states: folds a second part of one softmax attention into the first, in place, by the two parts'
// logsumexps. Row (n, h) of out [N, H, D] becomes (out * e^lse + other * e^other_lse) / (e^lse + e^other_lse) and
// lse[h, n] their logaddexp; a logsumexp of +-inf marks a part without keys, which adds nothing (flash writes +inf
// for a query without keys); a NaN logsumexp counts as a part with keys, so the NaN reaches the result.
// Memory-bound: each (n, h) row is read twice and written once; a row whose second part is empty is left as it is.
// A warp holds 32 / lanes rows; each lane moves VEC elements of a row at a time (16 bytes on the vector path).
#include <ATen/MemoryOverlap.h>

#include "common.cuh"
#include "torch_utils.h"

namespace fw {

// out, other [N, H, D] with element strides (so_n, so_h, 1) and (sx_n, sx_h, 1); lse, other_lse [H, N] float32
// with strides (sl_h, sl_n) and (sxl_h, sxl_n).
struct MergeArgs {
  void* out;
  float* lse;
  const void* other;
  const float* other_lse;
  int64_t N;
  int H, D;
  int64_t so_n, so_h, sx_n, sx_h, sl_h, sl_n, sxl_h, sxl_n;
};
cudaError_t merge_attention_states(DType dt, MergeArgs a, cudaStream_t stream);

}  // namespace fw

namespace fw {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ bool no_keys(float x) { return isinf(x); }

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) merge_kernel(MergeArgs a, int lanes, unsigned trigger_from) {
  pdl_begin(trigger_from);
  const int lane = threadIdx.x & (lanes - 1);
  const int64_t row = ((int64_t)blockIdx.x * kThreads + threadIdx.x) / lanes;
  if (row >= a.N * a.H) return;
  const int64_t n = row / a.H;
  const int h = (int)(row - n * a.H);
  const float la = a.lse[h * a.sl_h + n * a.sl_n], lb = a.other_lse[h * a.sxl_h + n * a.sxl_n];
  const bool none_a = no_keys(la), none_b = no_keys(lb);
  if (none_b && !none_a) return;  // nothing to add
  float wa = 0.f, wb = 0.f, merged = -INFINITY;
  if (!none_a && !none_b) {
    const float m = fmaxf(la, lb), ea = expf(la - m), eb = expf(lb - m), s = ea + eb;
    wa = ea / s;
    wb = eb / s;
    merged = m + logf(s);
  } else if (!none_b) {  // the first part has no keys: the second is the whole
    wb = 1.f;
    merged = lb;
  }
  T* o = static_cast<T*>(a.out) + n * a.so_n + h * a.so_h;
  const T* x = static_cast<const T*>(a.other) + n * a.sx_n + h * a.sx_h;
  for (int d = lane * VEC; d < a.D; d += lanes * VEC) {
    const Vec<T, VEC> va = load_vec<T, VEC>(o + d), vb = load_vec<T, VEC>(x + d);
    float r[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      r[j] = (wa == 0.f ? 0.f : to_f(va.v[j]) * wa) + (wb == 0.f ? 0.f : to_f(vb.v[j]) * wb);
    store_vec<T, VEC>(o + d, vec_from_f<T, VEC>(r));
  }
  if (lane == 0) a.lse[h * a.sl_h + n * a.sl_n] = merged;
}

}  // namespace

cudaError_t merge_attention_states(DType dt, MergeArgs a, cudaStream_t stream) {
  if (a.N * a.H == 0) return cudaSuccess;  // D == 0 still merges the logsumexps
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    constexpr int V16 = 16 / sizeof(T);
    const bool vec = a.D % V16 == 0 && a.so_n % V16 == 0 && a.so_h % V16 == 0 && a.sx_n % V16 == 0 &&
                     a.sx_h % V16 == 0 && aligned16(a.out) && aligned16(a.other);
    const int v = vec ? V16 : 1;
    int lanes = 1;  // the fewest lanes (a power of two up to 32) that cover a row in one pass, or 32 lanes looping
    while (lanes < 32 && lanes * v < a.D) lanes *= 2;
    const int64_t rows_per_block = kThreads / lanes;
    const int64_t blocks = (a.N * a.H + rows_per_block - 1) / rows_per_block;
    if (blocks > (int64_t)INT_MAX) return cudaErrorInvalidValue;
    return launch_kernel(vec ? merge_kernel<T, V16> : merge_kernel<T, 1>, (unsigned)blocks, kThreads, 0, stream, a,
                         lanes);
  });
}

}  // namespace fw

namespace {

void merge_attention_states(const Tensor& out, const Tensor& lse, const Tensor& other, const Tensor& other_lse) {
  const char* op = "merge_attention_states";
  check_cuda(out, op, "out");
  check_cuda(lse, op, "lse");
  check_cuda(other, op, "other");
  check_cuda(other_lse, op, "other_lse");
  TORCH_CHECK(lse.device() == out.device() && other.device() == out.device() && other_lse.device() == out.device(),
              "fw::", op, ": out, lse, other and other_lse must be on one device, got ", out.device(), ", ",
              lse.device(), ", ", other.device(), " and ", other_lse.device());
  TORCH_CHECK(out.dim() == 3 && other.sizes() == out.sizes(), "fw::", op, ": out ", out.sizes(), " and other ",
              other.sizes(), " must be the same [N, H, D]");
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == out.size(1) && lse.size(1) == out.size(0) &&
                  other_lse.sizes() == lse.sizes(),
              "fw::", op, ": lse ", lse.sizes(), " and other_lse ", other_lse.sizes(), " must be [H, N] of out ",
              out.sizes());
  TORCH_CHECK(other.scalar_type() == out.scalar_type(), "fw::", op, ": other has dtype ", other.scalar_type(),
              ", out ", out.scalar_type());
  TORCH_CHECK(lse.scalar_type() == at::kFloat && other_lse.scalar_type() == at::kFloat, "fw::", op,
              ": lse and other_lse must be float32 on CUDA, got ", lse.scalar_type(), " and ",
              other_lse.scalar_type());
  TORCH_CHECK(out.stride(2) == 1 && other.stride(2) == 1, "fw::", op,
              ": out and other need a contiguous last dimension");
  TORCH_CHECK(out.size(1) <= INT_MAX && out.size(2) <= INT_MAX, "fw::", op, ": H and D must fit an int, got ",
              out.sizes());
  // the kernel writes out and lse from many threads and reads other and other_lse while it does
  at::assert_no_internal_overlap(out);
  at::assert_no_internal_overlap(lse);
  at::assert_no_partial_overlap(out, other);
  at::assert_no_partial_overlap(lse, other_lse);
  const auto dt = dtype_of(out, op, "out");
  c10::cuda::CUDAGuard guard(out.device());
  fw::MergeArgs a{out.data_ptr(), lse.data_ptr<float>(), other.data_ptr(), other_lse.data_ptr<float>(),
                  out.size(0), (int)out.size(1), (int)out.size(2), out.stride(0), out.stride(1), other.stride(0),
                  other.stride(1), lse.stride(0), lse.stride(1), other_lse.stride(0), other_lse.stride(1)};
  check_launch(fw::merge_attention_states(dt, a, at::cuda::getCurrentCUDAStream()), op);
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) { m.impl("merge_attention_states", &merge_attention_states); }
