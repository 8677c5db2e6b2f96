// QK-norm, RoPE and the paged KV write of new tokens in one launch (inference): one block per token, one warp per
// head. A lane holds the head's elements lane + 32 j, so both halves of each rotated pair (i, i + D/2) are in the
// lane. q and k heads are RMS-normalised (the sum of squares reduced over the warp), rounded to the input's dtype
// as rms_norm's output is, rotated by angle = float(position) * inv_freq in fp32 as csrc/rope.cu does, and q goes
// to the output, k to its pool; v heads are copied into theirs.
#include "common.cuh"
#include "torch_utils.h"

namespace fw {

// qkv [N, (Hq + 2 Hk) D] with row stride `qkv_stride`; q_out [N, Hq, D]; pools addressed as
// pool + block * s0 + head * s1 + offset * s2 + d.
struct PoolStrides {
  int64_t s0, s1, s2;
};
cudaError_t qk_norm_rope_write_fwd(DType dt, DType wdt, const void* qkv, int64_t qkv_stride, const int64_t* positions,
                                   const float* inv_freq, const void* q_weight, const void* k_weight, void* q_out,
                                   void* k_pool, void* v_pool, const int64_t* blocks, const int64_t* offsets,
                                   PoolStrides ps, int64_t tokens, int Hq, int Hk, int D, float eps,
                                   cudaStream_t stream);

}  // namespace fw

namespace fw {
namespace {

constexpr int kThreads = 128;

// E: elements a lane holds (D = 32 E).
template <typename T, typename W, int E>
__global__ void __launch_bounds__(kThreads)
qk_norm_rope_write_kernel(const T* __restrict__ qkv, int64_t qkv_stride, const int64_t* __restrict__ positions,
                          const float* __restrict__ inv_freq, const W* __restrict__ qw, const W* __restrict__ kw,
                          T* __restrict__ q_out, T* __restrict__ k_pool, T* __restrict__ v_pool,
                          const int64_t* __restrict__ blocks, const int64_t* __restrict__ offsets, PoolStrides ps,
                          int Hq, int Hk, float eps, unsigned trigger_from) {
  pdl_begin(trigger_from);
  constexpr int D = 32 * E, H = E / 2;
  const int64_t tok = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const float pos = (float)positions[tok];
  float c[H], s[H];
#pragma unroll
  for (int j = 0; j < H; ++j) sincosf(pos * inv_freq[lane + 32 * j], &s[j], &c[j]);
  const T* row = qkv + tok * qkv_stride;
  const int64_t at = blocks[tok] * ps.s0 + offsets[tok] * ps.s2;
  for (int head = warp; head < Hq + 2 * Hk; head += warps) {
    const T* src = row + (int64_t)head * D;
    if (head >= Hq + Hk) {   // v: copied as it is
      T* dst = v_pool + at + (int64_t)(head - Hq - Hk) * ps.s1;
#pragma unroll
      for (int j = 0; j < E; ++j) dst[lane + 32 * j] = src[lane + 32 * j];
      continue;
    }
    const bool is_q = head < Hq;
    const W* w = is_q ? qw : kw;
    float x[E];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      x[j] = to_f(src[lane + 32 * j]);
      ss += x[j] * x[j];
    }
    const float r = rsqrtf(warp_sum(ss) / D + eps);
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = to_f(from_f<T>(x[j] * r * to_f(w[lane + 32 * j])));
    T* dst = is_q ? q_out + (tok * Hq + head) * D : k_pool + at + (int64_t)(head - Hq) * ps.s1;
#pragma unroll
    for (int j = 0; j < H; ++j) {
      const float x1 = x[j], x2 = x[j + H];
      dst[lane + 32 * j] = from_f<T>(x1 * c[j] - x2 * s[j]);
      dst[lane + 32 * (j + H)] = from_f<T>(x2 * c[j] + x1 * s[j]);
    }
  }
}

template <typename T, typename W>
cudaError_t launch(const void* qkv, int64_t qkv_stride, const int64_t* positions, const float* inv_freq,
                   const void* q_weight, const void* k_weight, void* q_out, void* k_pool, void* v_pool,
                   const int64_t* blocks, const int64_t* offsets, PoolStrides ps, int64_t tokens, int Hq, int Hk,
                   int D, float eps, cudaStream_t stream) {
  auto go = [&](auto kernel) {
    return launch_kernel(kernel, (unsigned)tokens, kThreads, 0, stream, (const T*)qkv, qkv_stride, positions,
                         inv_freq, (const W*)q_weight, (const W*)k_weight, (T*)q_out, (T*)k_pool, (T*)v_pool, blocks,
                         offsets, ps, Hq, Hk, eps);
  };
  switch (D) {
    case 64: return go(qk_norm_rope_write_kernel<T, W, 2>);
    case 128: return go(qk_norm_rope_write_kernel<T, W, 4>);
    case 256: return go(qk_norm_rope_write_kernel<T, W, 8>);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t qk_norm_rope_write_fwd(DType dt, DType wdt, const void* qkv, int64_t qkv_stride, const int64_t* positions,
                                   const float* inv_freq, const void* q_weight, const void* k_weight, void* q_out,
                                   void* k_pool, void* v_pool, const int64_t* blocks, const int64_t* offsets,
                                   PoolStrides ps, int64_t tokens, int Hq, int Hk, int D, float eps,
                                   cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    if (wdt == DType::F32)
      return launch<T, float>(qkv, qkv_stride, positions, inv_freq, q_weight, k_weight, q_out, k_pool, v_pool,
                              blocks, offsets, ps, tokens, Hq, Hk, D, eps, stream);
    if (wdt != dt) return cudaErrorInvalidValue;
    return launch<T, T>(qkv, qkv_stride, positions, inv_freq, q_weight, k_weight, q_out, k_pool, v_pool, blocks,
                        offsets, ps, tokens, Hq, Hk, D, eps, stream);
  });
}

}  // namespace fw

namespace {

// The pools are written in place (the schema's Tensor(a!) and Tensor(b!)).
Tensor qk_norm_rope_write(const Tensor& qkv, const Tensor& positions, const Tensor& q_weight, const Tensor& k_weight,
                          double eps, double theta, const Tensor& k_pool, const Tensor& v_pool,
                          const Tensor& write_blocks, const Tensor& write_offsets) {
  const char* op = "qk_norm_rope_write";
  check_cuda(qkv, op, "qkv");
  c10::cuda::CUDAGuard guard(qkv.device());
  const auto dt = dtype_of(qkv, op, "qkv"), wdt = dtype_of(q_weight, op, "q_weight");
  TORCH_CHECK(k_weight.scalar_type() == q_weight.scalar_type(), "fw::qk_norm_rope_write: q_weight and k_weight dtypes "
              "differ");
  TORCH_CHECK(wdt == fw::DType::F32 || wdt == dt, "fw::qk_norm_rope_write: the norm weights must be float32 or "
              "qkv's dtype");
  TORCH_CHECK(k_pool.scalar_type() == qkv.scalar_type() && v_pool.scalar_type() == qkv.scalar_type(),
              "fw::qk_norm_rope_write: qkv and the pools must share a dtype");
  const int64_t N = qkv.size(0), Hk = k_pool.size(1), D = k_pool.size(3), Hq = qkv.size(1) / D - 2 * Hk;
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "fw::qk_norm_rope_write: the CUDA kernel takes a head_dim of 64, 128 "
              "or 256, got ", D);
  TORCH_CHECK(qkv.stride(1) == 1, "fw::qk_norm_rope_write: qkv rows must be contiguous");
  for (const Tensor* t : {&positions, &q_weight, &k_weight, &k_pool, &v_pool, &write_blocks, &write_offsets})
    TORCH_CHECK(t->device() == qkv.device(), "fw::qk_norm_rope_write: every tensor must be on qkv's device");
  TORCH_CHECK(k_pool.strides() == v_pool.strides() && k_pool.stride(3) == 1,
              "fw::qk_norm_rope_write: the pools must share strides, with a contiguous last dim");
  auto pos = positions.contiguous(), blk = write_blocks.contiguous(), off = write_offsets.contiguous();
  auto qw = q_weight.contiguous(), kw = k_weight.contiguous();
  auto q = at::empty({N, Hq, D}, qkv.options());
  auto inv = fw::rope_inv_freq(D, theta, qkv.device());
  check_launch(fw::qk_norm_rope_write_fwd(dt, wdt, qkv.data_ptr(), qkv.stride(0), pos.data_ptr<int64_t>(),
                                          inv.data_ptr<float>(), qw.data_ptr(), kw.data_ptr(), q.data_ptr(),
                                          k_pool.data_ptr(), v_pool.data_ptr(), blk.data_ptr<int64_t>(),
                                          off.data_ptr<int64_t>(),
                                          {k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)},
                                          N, (int)Hq, (int)Hk, (int)D, (float)eps, at::cuda::getCurrentCUDAStream()),
               op);
  return q;
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) {
  m.impl("qk_norm_rope_write", &qk_norm_rope_write);
}
