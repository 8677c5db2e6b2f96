// Qwen3's QK-norm and RoPE read straight from the fused qkv projection's output, forward and backward.
//
// Forward: blocks of 4 warps, a warp per head. A token's heads go to one block, or where the tokens are too few
// to fill the device (decode steps) to a column of blocks (gridDim.y), so that a warp walks one head or a few instead
// of a quarter of them one after the other. q and k heads are RMS-normalised (the sum of squares reduced over
// the warp), rounded to the input's dtype as rms_norm's output is, and rotated by angle = float(position) * inv_freq
// in fp32 as csrc/rope.cu does; v heads are copied. The destinations are either the training outputs q, k, v
// [N, H, D] (qk_norm_rope) or, for the rollout, q and the paged KV pools at (block, offset) (qk_norm_rope_write).
// A lane holds P = D / 64 consecutive elements of each half of a head, so both elements of every rotated pair
// (i, i + D/2) are in the lane and each half moves as one vector a lane. The pools hold the input's dtype, or
// float8_e4m3 (an fp8 KV cache): each k and v element is the one a 16-bit or float32 pool would hold, rounded to
// nearest e4m3 and saturated at +-448, as torch's x.clamp(-448, 448).to(torch.float8_e4m3fn) rounds it.
//
// Backward: the gradients of q and k are rotated back (the rotation is orthogonal: its transpose is the inverse),
// then go through the norm's backward with rstd recomputed from qkv by the forward's own reduction; the gradient of
// v is copied. All three land in one d(qkv) buffer, so the split of qkv needs no cat in its backward. The blocks
// (one wave) loop over tokens and keep the two weights' gradient terms in registers; sum_partial_rows adds the
// blocks' partial rows in a fixed order, so the weight gradients are the same from run to run.
#include <cuda_fp8.h>

#include <algorithm>

#include "common.cuh"
#include "torch_utils.h"

namespace fw {

// Where k and v go: base + token * s0 + head * s1 (+ d) when `blocks` is null, else base + blocks[token] * s0 +
// offsets[token] * s2 + head * s1, in elements of the input's dtype, or of float8_e4m3 when `fp8`.
struct KVDest {
  void* k;
  void* v;
  const int64_t* blocks;
  const int64_t* offsets;
  int64_t s0, s1, s2;
  bool fp8 = false;
};
// qkv [N, (Hq + 2 Hk) D] with row stride `qkv_stride`; q_out [N, Hq, D].
cudaError_t qk_norm_rope_fwd(DType dt, DType wdt, const void* qkv, int64_t qkv_stride, const int64_t* positions,
                             const float* inv_freq, const void* q_weight, const void* k_weight, void* q_out,
                             KVDest kv, int64_t tokens, int Hq, int Hk, int D, float eps, cudaStream_t stream);
// grad_q [N, Hq, D], grad_k and grad_v [N, Hk, D] contiguous; grad_qkv [N, (Hq + 2 Hk) D] contiguous; grad_qw and
// grad_kw [D] in the weights' dtype; partial [qk_norm_rope_bwd_max_blocks(), 2 D] float32 scratch.
cudaError_t qk_norm_rope_bwd(DType dt, DType wdt, const void* grad_q, const void* grad_k, const void* grad_v,
                             const void* qkv, int64_t qkv_stride, const int64_t* positions, const float* inv_freq,
                             const void* q_weight, const void* k_weight, void* grad_qkv, void* grad_qw, void* grad_kw,
                             float* partial, int64_t tokens, int Hq, int Hk, int D, float eps, cudaStream_t stream);
int qk_norm_rope_bwd_max_blocks();

}  // namespace fw

namespace fw {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// The angles of a token's pairs lane * P + p, p < P.
template <int P>
__device__ __forceinline__ void token_angles(float pos, const float* inv_freq, int first, float (&c)[P],
                                             float (&s)[P]) {
#pragma unroll
  for (int p = 0; p < P; ++p) sincosf(pos * inv_freq[first + p], &s[p], &c[p]);
}

template <typename T, int P>
__device__ __forceinline__ void load_halves(const T* head, int first, float (&a)[P], float (&b)[P]) {
  const auto va = load_vec<T, P>(head + first), vb = load_vec<T, P>(head + 32 * P + first);
#pragma unroll
  for (int p = 0; p < P; ++p) {
    a[p] = to_f(va.v[p]);
    b[p] = to_f(vb.v[p]);
  }
}

// P elements of T (already in T's rounding) into a k or v destination of element type KV: T, or __nv_fp8_e4m3
// (rounded to nearest, saturating: the T value rounded again, as the reference rounds the stored T value).
template <typename KV, typename T, int P> __device__ __forceinline__ void store_kv(KV* dst, const Vec<T, P>& x) {
  if constexpr (std::is_same_v<KV, T>) {
    store_vec(dst, x);
  } else {
    static_assert(std::is_same_v<KV, __nv_fp8_e4m3>, "k and v are stored as T or float8_e4m3");
    Vec<__nv_fp8_storage_t, P> o;
    if constexpr (P % 2 == 0) {
#pragma unroll
      for (int j = 0; j < P; j += 2)   // one cvt.rn.satfinite.e4m3x2.f32 a pair on sm_89+; element j in the low byte
        *reinterpret_cast<__nv_fp8x2_storage_t*>(&o.v[j]) =
            __nv_cvt_float2_to_fp8x2(make_float2(to_f(x.v[j]), to_f(x.v[j + 1])), __NV_SATFINITE, __NV_E4M3);
    } else {
#pragma unroll
      for (int j = 0; j < P; ++j) o.v[j] = __nv_cvt_float_to_fp8(to_f(x.v[j]), __NV_SATFINITE, __NV_E4M3);
    }
    store_vec(reinterpret_cast<__nv_fp8_storage_t*>(dst), o);
  }
}

// P: elements of each half of a head a lane holds (D = 64 P); KV: the pools' element type (T or __nv_fp8_e4m3).
template <typename T, typename W, typename KV, int P>
__global__ void __launch_bounds__(kThreads)
qk_norm_rope_kernel(const T* __restrict__ qkv, int64_t qkv_stride, const int64_t* __restrict__ positions,
                    const float* __restrict__ inv_freq, const W* __restrict__ qw, const W* __restrict__ kw,
                    T* __restrict__ q_out, KVDest kv, int Hq, int Hk, float eps, unsigned trigger_from) {
  pdl_begin(trigger_from);
  constexpr int D = 64 * P, HALF = 32 * P;
  const int64_t tok = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, first = lane * P;
  float c[P], s[P];
  token_angles<P>((float)positions[tok], inv_freq, first, c, s);
  const T* row = qkv + tok * qkv_stride;
  const int64_t at = kv.blocks ? kv.blocks[tok] * kv.s0 + kv.offsets[tok] * kv.s2 : tok * kv.s0;
  for (int head = blockIdx.y * kWarps + warp; head < Hq + 2 * Hk; head += kWarps * gridDim.y) {
    const T* src = row + (int64_t)head * D;
    if (head >= Hq + Hk) {   // v: copied as it is
      KV* dst = (KV*)kv.v + at + (int64_t)(head - Hq - Hk) * kv.s1;
      store_kv(dst + first, load_vec<T, P>(src + first));
      store_kv(dst + HALF + first, load_vec<T, P>(src + HALF + first));
      continue;
    }
    const bool is_q = head < Hq;
    const W* w = is_q ? qw : kw;
    float x1[P], x2[P];
    load_halves<T, P>(src, first, x1, x2);
    float ss = 0.f;
#pragma unroll
    for (int p = 0; p < P; ++p) ss += x1[p] * x1[p] + x2[p] * x2[p];
    const float r = rsqrtf(warp_sum(ss) / D + eps);
    float y1[P], y2[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      // the norm's output rounded to T, as rms_norm returns it, then rotated
      const float n1 = to_f(from_f<T>(x1[p] * r * to_f(w[first + p])));
      const float n2 = to_f(from_f<T>(x2[p] * r * to_f(w[HALF + first + p])));
      y1[p] = n1 * c[p] - n2 * s[p];
      y2[p] = n2 * c[p] + n1 * s[p];
    }
    const Vec<T, P> o1 = vec_from_f<T, P>(y1), o2 = vec_from_f<T, P>(y2);
    if (is_q || std::is_same_v<KV, T>) {   // a pool of T: one store path for q and k
      T* dst = is_q ? q_out + (tok * Hq + head) * D : (T*)kv.k + at + (int64_t)(head - Hq) * kv.s1;
      store_vec(dst + first, o1);
      store_vec(dst + HALF + first, o2);
    } else {
      KV* dst = (KV*)kv.k + at + (int64_t)(head - Hq) * kv.s1;
      store_kv(dst + first, o1);
      store_kv(dst + HALF + first, o2);
    }
  }
}

template <typename T, typename W, int P>
__global__ void __launch_bounds__(kThreads)
qk_norm_rope_bwd_kernel(const T* __restrict__ gq, const T* __restrict__ gk, const T* __restrict__ gv,
                        const T* __restrict__ qkv, int64_t qkv_stride, const int64_t* __restrict__ positions,
                        const float* __restrict__ inv_freq, const W* __restrict__ qw, const W* __restrict__ kw,
                        T* __restrict__ gqkv, float* __restrict__ partial, int64_t tokens, int Hq, int Hk, float eps,
                        unsigned trigger_from) {
  pdl_begin(trigger_from);
  constexpr int D = 64 * P, HALF = 32 * P;
  __shared__ float sums[kWarps][2 * D];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, first = lane * P;
  const int width = (Hq + 2 * Hk) * D;
  float aq1[P], aq2[P], ak1[P], ak2[P];   // this lane's terms of grad_qw and grad_kw
#pragma unroll
  for (int p = 0; p < P; ++p) aq1[p] = aq2[p] = ak1[p] = ak2[p] = 0.f;
  for (int64_t tok = blockIdx.x; tok < tokens; tok += gridDim.x) {
    float c[P], s[P];
    token_angles<P>((float)positions[tok], inv_freq, first, c, s);
    T* out = gqkv + tok * width;
    for (int head = warp; head < Hq + 2 * Hk; head += kWarps) {
      if (head >= Hq + Hk) {
        const T* src = gv + (tok * Hk + head - Hq - Hk) * D;
        store_vec(out + (int64_t)head * D + first, load_vec<T, P>(src + first));
        store_vec(out + (int64_t)head * D + HALF + first, load_vec<T, P>(src + HALF + first));
        continue;
      }
      const bool is_q = head < Hq;
      const W* w = is_q ? qw : kw;
      float g1[P], g2[P], x1[P], x2[P];
      load_halves<T, P>(is_q ? gq + (tok * Hq + head) * D : gk + (tok * Hk + head - Hq) * D, first, g1, g2);
      load_halves<T, P>(qkv + tok * qkv_stride + (int64_t)head * D, first, x1, x2);
      float ss = 0.f;
#pragma unroll
      for (int p = 0; p < P; ++p) ss += x1[p] * x1[p] + x2[p] * x2[p];
      const float r = rsqrtf(warp_sum(ss) / D + eps);   // the forward's rstd, by the same reduction
      float dot = 0.f;
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const float n1 = g1[p] * c[p] + g2[p] * s[p];   // the inverse rotation
        const float n2 = g2[p] * c[p] - g1[p] * s[p];
        g1[p] = n1 * to_f(w[first + p]);
        g2[p] = n2 * to_f(w[HALF + first + p]);
        dot += g1[p] * x1[p] + g2[p] * x2[p];
        if (is_q) {
          aq1[p] += n1 * x1[p] * r;
          aq2[p] += n2 * x2[p] * r;
        } else {
          ak1[p] += n1 * x1[p] * r;
          ak2[p] += n2 * x2[p] * r;
        }
      }
      const float k3 = r * r * r * warp_sum(dot) / D;
      float d1[P], d2[P];
#pragma unroll
      for (int p = 0; p < P; ++p) {
        d1[p] = r * g1[p] - x1[p] * k3;
        d2[p] = r * g2[p] - x2[p] * k3;
      }
      store_vec(out + (int64_t)head * D + first, vec_from_f<T, P>(d1));
      store_vec(out + (int64_t)head * D + HALF + first, vec_from_f<T, P>(d2));
    }
  }
#pragma unroll
  for (int p = 0; p < P; ++p) {
    sums[warp][first + p] = aq1[p];
    sums[warp][HALF + first + p] = aq2[p];
    sums[warp][D + first + p] = ak1[p];
    sums[warp][D + HALF + first + p] = ak2[p];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * D; i += kThreads) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) t += sums[w][i];
    partial[(int64_t)blockIdx.x * 2 * D + i] = t;
  }
}

// f(std::integral_constant<int, P>) for D = 64 P in 64, 128, 256.
template <typename F> cudaError_t with_p(int D, F&& f) {
  switch (D) {
    case 64: return f(std::integral_constant<int, 1>{});
    case 128: return f(std::integral_constant<int, 2>{});
    case 256: return f(std::integral_constant<int, 4>{});
  }
  return cudaErrorInvalidValue;
}

// f(T{}, W{}, P) for the element type, the weights' type (float32 or T) and the head size, or an error.
template <typename F> cudaError_t dispatch_types(DType dt, DType wdt, int D, F&& f) {
  if (wdt != DType::F32 && wdt != dt) return cudaErrorInvalidValue;
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    return with_p(D, [&](auto p) {
      return wdt == DType::F32 ? f(T{}, float{}, p) : f(T{}, T{}, p);
    });
  });
}

}  // namespace

cudaError_t qk_norm_rope_fwd(DType dt, DType wdt, const void* qkv, int64_t qkv_stride, const int64_t* positions,
                             const float* inv_freq, const void* q_weight, const void* k_weight, void* q_out,
                             KVDest kv, int64_t tokens, int Hq, int Hk, int D, float eps, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  return dispatch_types(dt, wdt, D, [&](auto tv, auto wv, auto p) {
    using T = decltype(tv);
    using W = decltype(wv);
    auto launch = [&](auto* kv_type) {
      using KV = std::remove_pointer_t<decltype(kv_type)>;
      auto kernel = qk_norm_rope_kernel<T, W, KV, decltype(p)::value>;
      // blocks enough for one full wave where the tokens allow it, at most a warp per head
      int dev = 0;
      const int64_t wave =
          cleared(cudaGetDevice(&dev)) == cudaSuccess ? wave_blocks(dev, (const void*)kernel, kThreads, 0) : 0;
      const int64_t groups = (Hq + 2 * Hk + kWarps - 1) / kWarps;
      const unsigned y = (unsigned)std::clamp<int64_t>((wave + tokens - 1) / tokens, 1, groups);
      return launch_kernel(kernel, dim3((unsigned)tokens, y), kThreads, 0, stream, (const T*)qkv, qkv_stride,
                           positions, inv_freq, (const W*)q_weight, (const W*)k_weight, (T*)q_out, kv, Hq, Hk, eps);
    };
    return kv.fp8 ? launch((__nv_fp8_e4m3*)nullptr) : launch((T*)nullptr);
  });
}

// The backward's blocks: at most one wave, at most 2048 / kThreads resident a multiprocessor.
int qk_norm_rope_bwd_max_blocks() {
  int dev = 0;
  const int sms =
      cleared(cudaGetDevice(&dev)) == cudaSuccess ? device_attribute<cudaDevAttrMultiProcessorCount>(dev) : 0;
  return (sms > 0 ? sms : 132) * (2048 / kThreads);
}

cudaError_t qk_norm_rope_bwd(DType dt, DType wdt, const void* grad_q, const void* grad_k, const void* grad_v,
                             const void* qkv, int64_t qkv_stride, const int64_t* positions, const float* inv_freq,
                             const void* q_weight, const void* k_weight, void* grad_qkv, void* grad_qw, void* grad_kw,
                             float* partial, int64_t tokens, int Hq, int Hk, int D, float eps, cudaStream_t stream) {
  return dispatch_types(dt, wdt, D, [&](auto tv, auto wv, auto p) {
    using T = decltype(tv);
    using W = decltype(wv);
    auto kernel = qk_norm_rope_bwd_kernel<T, W, decltype(p)::value>;
    const int64_t wave = (int64_t)qk_norm_rope_bwd_max_blocks() / (2048 / kThreads) *
                         resident_blocks((const void*)kernel, kThreads, 0);
    const int blocks = (int)std::min<int64_t>(tokens, wave);
    if (blocks > 0) {
      const cudaError_t e = launch_kernel(kernel, (unsigned)blocks, kThreads, 0, stream, (const T*)grad_q,
                                          (const T*)grad_k, (const T*)grad_v, (const T*)qkv, qkv_stride, positions,
                                          inv_freq, (const W*)q_weight, (const W*)k_weight, (T*)grad_qkv, partial,
                                          tokens, Hq, Hk, eps);
      if (e != cudaSuccess) return e;
    }
    return sum_partial_rows(partial, (W*)grad_qw, (W*)grad_kw, D, std::max(blocks, 0), 2 * D, stream);
  });
}

}  // namespace fw

namespace {

constexpr const char* kHeadDims = "a head_dim of 64, 128 or 256";

// The kernels move P = D / 64 elements a lane as one vector: `t` when its data pointer is aligned to P elements,
// else an aligned copy.
Tensor aligned(const Tensor& t, int64_t D) {
  const bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % (D / 64 * t.element_size()) == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// qkv with unit column stride and a row stride of whole vectors (rows may be strided), aligned.
Tensor qkv_rows(const Tensor& qkv, int64_t D) {
  return aligned(qkv.stride(1) == 1 && qkv.stride(0) % (D / 64) == 0 ? qkv : qkv.contiguous(), D);
}

struct Heads {
  int64_t N, Hq, Hk, D;
};

Heads check_qkv(const Tensor& qkv, const Tensor& positions, const Tensor& q_weight, const Tensor& k_weight,
                int64_t Hk, const char* op) {
  check_cuda(qkv, op, "qkv");
  TORCH_CHECK(qkv.dim() == 2, "fw::", op, ": qkv must be [N, (Hq + 2 Hk) * D]");
  const int64_t D = q_weight.numel();
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "fw::", op, ": the CUDA kernel takes ", kHeadDims, ", got ", D);
  TORCH_CHECK(k_weight.numel() == D && k_weight.scalar_type() == q_weight.scalar_type(), "fw::", op,
              ": q_weight and k_weight must have one size and dtype");
  const auto dt = dtype_of(qkv, op, "qkv"), wdt = dtype_of(q_weight, op, "q_weight");
  TORCH_CHECK(wdt == fw::DType::F32 || wdt == dt, "fw::", op, ": the norm weights must be float32 or qkv's dtype");
  TORCH_CHECK(qkv.size(1) % D == 0 && qkv.size(1) / D > 2 * Hk, "fw::", op, ": qkv's width ", qkv.size(1),
              " is not (Hq + 2 Hk) * D with Hq > 0");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == qkv.size(0) && positions.scalar_type() == at::kLong,
              "fw::", op, ": positions must be int64 [N]");
  for (const Tensor* t : {&positions, &q_weight, &k_weight})
    TORCH_CHECK(t->device() == qkv.device(), "fw::", op, ": every tensor must be on qkv's device");
  return {qkv.size(0), qkv.size(1) / D - 2 * Hk, Hk, D};
}

std::tuple<Tensor, Tensor, Tensor> qk_norm_rope(const Tensor& qkv, const Tensor& positions, const Tensor& q_weight,
                                                const Tensor& k_weight, double eps, double theta, int64_t num_kv_heads) {
  const char* op = "qk_norm_rope";
  const Heads h = check_qkv(qkv, positions, q_weight, k_weight, num_kv_heads, op);
  c10::cuda::CUDAGuard guard(qkv.device());
  auto x = qkv_rows(qkv, h.D);
  auto pos = positions.contiguous(), qw = q_weight.contiguous(), kw = k_weight.contiguous();
  auto q = at::empty({h.N, h.Hq, h.D}, qkv.options());
  auto k = at::empty({h.N, h.Hk, h.D}, qkv.options()), v = at::empty({h.N, h.Hk, h.D}, qkv.options());
  auto inv = fw::rope_inv_freq(h.D, theta, qkv.device());
  const fw::KVDest dest{k.data_ptr(), v.data_ptr(), nullptr, nullptr, h.Hk * h.D, h.D, 0};
  check_launch(fw::qk_norm_rope_fwd(dtype_of(x, op, "qkv"), dtype_of(qw, op, "q_weight"), x.data_ptr(), x.stride(0),
                                    pos.data_ptr<int64_t>(), inv.data_ptr<float>(), qw.data_ptr(), kw.data_ptr(),
                                    q.data_ptr(), dest, h.N, (int)h.Hq, (int)h.Hk, (int)h.D, (float)eps,
                                    at::cuda::getCurrentCUDAStream()),
               op);
  return {q, k, v};
}

std::tuple<Tensor, Tensor, Tensor> qk_norm_rope_backward(const Tensor& grad_q, const Tensor& grad_k,
                                                         const Tensor& grad_v, const Tensor& qkv,
                                                         const Tensor& positions, const Tensor& q_weight,
                                                         const Tensor& k_weight, double eps, double theta) {
  const char* op = "qk_norm_rope_backward";
  TORCH_CHECK(grad_k.dim() == 3, "fw::", op, ": grad_k must be [N, Hk, D]");
  const Heads h = check_qkv(qkv, positions, q_weight, k_weight, grad_k.size(1), op);
  c10::cuda::CUDAGuard guard(qkv.device());
  for (const Tensor* g : {&grad_q, &grad_k, &grad_v})
    TORCH_CHECK(g->scalar_type() == qkv.scalar_type() && g->device() == qkv.device(), "fw::", op,
                ": the gradients must be in qkv's dtype, on its device");
  TORCH_CHECK(grad_q.sizes() == at::IntArrayRef({h.N, h.Hq, h.D}) && grad_v.sizes() == grad_k.sizes() &&
                  grad_k.sizes() == at::IntArrayRef({h.N, h.Hk, h.D}),
              "fw::", op, ": expected grad_q [N, Hq, D], grad_k and grad_v [N, Hk, D] for qkv ", qkv.sizes());
  auto x = qkv_rows(qkv, h.D);
  auto gq = aligned(grad_q.contiguous(), h.D);
  auto gk = aligned(grad_k.contiguous(), h.D);
  auto gv = aligned(grad_v.contiguous(), h.D);
  auto pos = positions.contiguous(), qw = q_weight.contiguous(), kw = k_weight.contiguous();
  auto gx = at::empty({h.N, qkv.size(1)}, qkv.options());
  auto gqw = at::empty_like(qw), gkw = at::empty_like(kw);
  auto partial = at::empty({std::min<int64_t>(std::max<int64_t>(h.N, 1), fw::qk_norm_rope_bwd_max_blocks()), 2 * h.D},
                           qkv.options().dtype(at::kFloat));
  auto inv = fw::rope_inv_freq(h.D, theta, qkv.device());
  check_launch(fw::qk_norm_rope_bwd(dtype_of(x, op, "qkv"), dtype_of(qw, op, "q_weight"), gq.data_ptr(),
                                    gk.data_ptr(), gv.data_ptr(), x.data_ptr(), x.stride(0), pos.data_ptr<int64_t>(),
                                    inv.data_ptr<float>(), qw.data_ptr(), kw.data_ptr(), gx.data_ptr(), gqw.data_ptr(),
                                    gkw.data_ptr(), partial.data_ptr<float>(), h.N, (int)h.Hq, (int)h.Hk, (int)h.D,
                                    (float)eps, at::cuda::getCurrentCUDAStream()),
               op);
  return {gx, gqw, gkw};
}

// The pools are written in place (the schema's Tensor(a!) and Tensor(b!)).
Tensor qk_norm_rope_write(const Tensor& qkv, const Tensor& positions, const Tensor& q_weight, const Tensor& k_weight,
                          double eps, double theta, const Tensor& k_pool, const Tensor& v_pool,
                          const Tensor& write_blocks, const Tensor& write_offsets) {
  const char* op = "qk_norm_rope_write";
  TORCH_CHECK(k_pool.dim() == 4, "fw::", op, ": the pools must be [num_blocks, Hk, block_size, D]");
  const Heads h = check_qkv(qkv, positions, q_weight, k_weight, k_pool.size(1), op);
  c10::cuda::CUDAGuard guard(qkv.device());
  const bool fp8 = k_pool.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((fp8 || k_pool.scalar_type() == qkv.scalar_type()) && v_pool.scalar_type() == k_pool.scalar_type(),
              "fw::", op, ": the pools must both be qkv's dtype (", qkv.scalar_type(), ") or float8_e4m3fn, got ",
              k_pool.scalar_type(), " and ", v_pool.scalar_type());
  for (const Tensor* t : {&k_pool, &v_pool, &write_blocks, &write_offsets})
    TORCH_CHECK(t->device() == qkv.device(), "fw::", op, ": every tensor must be on qkv's device");
  for (const Tensor* t : {&write_blocks, &write_offsets})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == h.N && t->scalar_type() == at::kLong, "fw::", op,
                ": write_blocks and write_offsets must be int64 [N]");
  TORCH_CHECK(k_pool.size(3) == h.D, "fw::", op, ": the pools' head_dim differs from the norm weights'");
  // a lane stores P = D / 64 pool elements as one vector (P * element_size bytes): strides in whole vectors
  TORCH_CHECK(k_pool.strides() == v_pool.strides() && k_pool.stride(3) == 1 &&
                  k_pool.stride(1) % (h.D / 64) == 0 && k_pool.stride(2) % (h.D / 64) == 0 &&
                  k_pool.stride(0) % (h.D / 64) == 0,
              "fw::", op, ": the pools must share strides, with a contiguous last dim");
  for (const Tensor* t : {&k_pool, &v_pool})
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % (h.D / 64 * t->element_size()) == 0, "fw::", op,
                ": the pools' data must be aligned to ", h.D / 64, " elements");
  auto x = qkv_rows(qkv, h.D);
  auto pos = positions.contiguous(), blk = write_blocks.contiguous(), off = write_offsets.contiguous();
  auto qw = q_weight.contiguous(), kw = k_weight.contiguous();
  auto q = at::empty({h.N, h.Hq, h.D}, qkv.options());
  auto inv = fw::rope_inv_freq(h.D, theta, qkv.device());
  const fw::KVDest dest{k_pool.data_ptr(), v_pool.data_ptr(), blk.data_ptr<int64_t>(), off.data_ptr<int64_t>(),
                        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), fp8};
  check_launch(fw::qk_norm_rope_fwd(dtype_of(x, op, "qkv"), dtype_of(qw, op, "q_weight"), x.data_ptr(), x.stride(0),
                                    pos.data_ptr<int64_t>(), inv.data_ptr<float>(), qw.data_ptr(), kw.data_ptr(),
                                    q.data_ptr(), dest, h.N, (int)h.Hq, (int)h.Hk, (int)h.D, (float)eps,
                                    at::cuda::getCurrentCUDAStream()),
               op);
  return q;
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) {
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("qk_norm_rope_backward", &qk_norm_rope_backward);
  m.impl("qk_norm_rope_write", &qk_norm_rope_write);
}
