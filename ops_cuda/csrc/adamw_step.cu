// One AdamW step over many tensors in one launch per group of tensors: the step of torchao's AdamW8bit and _AdamW
// (the same arithmetic, the same state layout) without their compiled call per parameter.
//
// A warp owns a chunk of 256 elements of one tensor (lane l holds elements 32 j + l, j < 8: every load and store of
// the warp is coalesced). Moments are either plain tensors of the parameter's dtype, or 8-bit codes with one float32
// scale per 256-element block (torchao's OptimState8bit: value = qmap[code] * scale, with the block's absolute
// maximum as its scale), re-quantized from the updated float32 moments with torchao's rounding.
#include <algorithm>
#include <cmath>

#include "common.cuh"
#include "torch_utils.h"

namespace fw {
namespace {

constexpr int kChunk = 256;             // elements a warp steps; torchao's quantization block
constexpr int kPerLane = kChunk / 32;
constexpr int kWarps = 8;               // warps (chunks) a block
constexpr int kMaxTensors = 24;         // tensors a launch: their pointers travel as kernel parameters (< 4 KB)

struct TensorArgs {
  void* p;            // float32 or bfloat16
  const void* g;      // float32 or bfloat16
  void* m;            // plain: p's dtype; quantized: uint8 codes
  void* v;
  float* m_scale;     // quantized: a float32 per chunk; plain: unused
  float* v_scale;
  int64_t numel;
  int64_t chunk0;     // the launch's index of this tensor's first chunk
  int p_bf16, g_bf16, quantized;
};

struct Launch {
  TensorArgs t[kMaxTensors];
  int count;
  int64_t chunks;
};

// 1 - beta is rounded to float32 from its double, as torch rounds lerp's Python-float weight: 1 - float32(beta)
// would differ from it by up to 1e-5 relative.
struct Hyper {
  float lr, one_minus_beta1, one_minus_beta2, weight_decay, eps, bias_correction1, sqrt_bias_correction2;
  int stochastic_round;
  uint64_t seed;
};

__device__ __forceinline__ float load_as_f(const void* base, int64_t i, int bf16) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]) : static_cast<const float*>(base)[i];
}

// 32 random bits for element i of a launch (its chunks numbered across the launch's tensors, so no two elements
// share them): a counter-based hash (splitmix64's finalizer) of the seed and the element.
__device__ __forceinline__ uint32_t random_bits(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (uint32_t)((z ^ (z >> 31)) >> 32);
}

// float32 -> bfloat16 rounded away from zero with probability (low 16 bits) / 2^16, else towards zero: torchao's
// _fp32_to_bf16_sr, with our own random bits.
__device__ __forceinline__ __nv_bfloat16 bf16_stochastic(float x, uint32_t r) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t up = (r & 0xFFFFu) < (bits & 0xFFFFu) ? 0x10000u : 0u;
  return __ushort_as_bfloat16((unsigned short)(((bits & 0xFFFF0000u) + up) >> 16));
}

// The code of x (already divided by its block's scale) in the sorted 256-entry map: the largest code whose value is
// <= x (a branch-free binary search), then the next code up when x lies at or past the midpoint between the two;
// torchao's quantize_8bit_with_qmap.
__device__ __forceinline__ uint32_t quantize(float x, const float* qmap) {
  uint32_t c = x >= qmap[128] ? 128u : 0u;
#pragma unroll
  for (uint32_t step = 64; step >= 1; step >>= 1) c += x >= qmap[c + step] ? step : 0u;
  const uint32_t up = c < 255 ? c + 1 : 255;
  const float down_v = qmap[c], up_v = qmap[up];
  return (x - down_v) >= (up_v - down_v) * 0.5f ? up : c;
}

__global__ void __launch_bounds__(kWarps * 32)
adamw_step_kernel(const __grid_constant__ Launch L, const __grid_constant__ Hyper h, const float* __restrict__ qmap_s,
                  const float* __restrict__ qmap_u) {
  __shared__ float map_s[256], map_u[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) {
    map_s[i] = qmap_s ? qmap_s[i] : 0.f;
    map_u[i] = qmap_u ? qmap_u[i] : 0.f;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t chunk = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (chunk >= L.chunks) return;
  int k = 0;
  while (k + 1 < L.count && L.t[k + 1].chunk0 <= chunk) ++k;
  const TensorArgs& t = L.t[k];
  const int64_t local_chunk = chunk - t.chunk0;
  const int64_t first = local_chunk * kChunk;   // the chunk's first element in its tensor

  float m_old[kPerLane], v_old[kPerLane];
  if (t.quantized) {
    const float ms = t.m_scale[local_chunk], vs = t.v_scale[local_chunk];
    const uint8_t* mc = static_cast<const uint8_t*>(t.m) + first;
    const uint8_t* vc = static_cast<const uint8_t*>(t.v) + first;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      m_old[j] = map_s[mc[j * 32 + lane]] * ms;
      v_old[j] = map_u[vc[j * 32 + lane]] * vs;
    }
  }
  float m_new[kPerLane], v_new[kPerLane], m_abs = 0.f, v_abs = 0.f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t i = first + j * 32 + lane;
    if (i >= t.numel) {
      m_new[j] = v_new[j] = 0.f;
      continue;
    }
    if (!t.quantized) {
      m_old[j] = load_as_f(t.m, i, t.p_bf16);
      v_old[j] = load_as_f(t.v, i, t.p_bf16);
    }
    const float g = load_as_f(t.g, i, t.g_bf16);
    float p = load_as_f(t.p, i, t.p_bf16);
    p = p - h.lr * h.weight_decay * p;
    // lerp(a, b, w) = a + w (b - a) for w < 0.5, as torch computes it
    const float m = m_old[j] + h.one_minus_beta1 * (g - m_old[j]);
    const float v = v_old[j] + h.one_minus_beta2 * (g * g - v_old[j]);
    m_new[j] = m;
    v_new[j] = v;
    m_abs = fmaxf(m_abs, fabsf(m));
    v_abs = fmaxf(v_abs, fabsf(v));
    const float denom = sqrtf(v) / h.sqrt_bias_correction2 + h.eps;
    p = p - h.lr * (m / h.bias_correction1) / denom;
    if (t.p_bf16) {
      static_cast<__nv_bfloat16*>(t.p)[i] =
          h.stochastic_round ? bf16_stochastic(p, random_bits(h.seed, (uint64_t)(chunk * kChunk + j * 32 + lane)))
                             : __float2bfloat16_rn(p);
    } else {
      static_cast<float*>(t.p)[i] = p;
    }
    if (!t.quantized) {
      if (t.p_bf16) {
        static_cast<__nv_bfloat16*>(t.m)[i] = __float2bfloat16_rn(m);
        static_cast<__nv_bfloat16*>(t.v)[i] = __float2bfloat16_rn(v);
      } else {
        static_cast<float*>(t.m)[i] = m;
        static_cast<float*>(t.v)[i] = v;
      }
    }
  }
  if (!t.quantized) return;
  const float ms = fmaxf(warp_max(m_abs), 1e-12f), vs = fmaxf(warp_max(v_abs), 1e-12f);
  uint8_t* mc = static_cast<uint8_t*>(t.m) + first;
  uint8_t* vc = static_cast<uint8_t*>(t.v) + first;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    mc[j * 32 + lane] = (uint8_t)quantize(m_new[j] / ms, map_s);
    vc[j * 32 + lane] = (uint8_t)quantize(v_new[j] / vs, map_u);
  }
  if (lane == 0) {
    t.m_scale[local_chunk] = ms;
    t.v_scale[local_chunk] = vs;
  }
}

}  // namespace
}  // namespace fw

namespace {

void adamw_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_scales,
                at::TensorList exp_avg_sqs, at::TensorList exp_avg_sq_scales, const Tensor& qmap_signed,
                const Tensor& qmap_unsigned, double lr, double beta1, double beta2, double weight_decay, double eps,
                double bias_correction1, double bias_correction2, bool stochastic_round, int64_t seed) {
  const size_t n = params.size();
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(params[0].device());
  const bool any_quantized = std::any_of(exp_avg_scales.begin(), exp_avg_scales.end(),
                                         [](const Tensor& s) { return s.numel() > 0; });
  const float* qs = nullptr;
  const float* qu = nullptr;
  if (any_quantized) {
    TORCH_CHECK(qmap_signed.is_cuda() && qmap_signed.scalar_type() == at::kFloat && qmap_signed.numel() == 256 &&
                    qmap_unsigned.is_cuda() && qmap_unsigned.scalar_type() == at::kFloat &&
                    qmap_unsigned.numel() == 256 && qmap_signed.is_contiguous() && qmap_unsigned.is_contiguous(),
                "fw::adamw_step: the quantization maps must be contiguous float32 CUDA tensors of 256 values");
    qs = qmap_signed.data_ptr<float>();
    qu = qmap_unsigned.data_ptr<float>();
  }
  fw::Hyper h{(float)lr, (float)(1.0 - beta1), (float)(1.0 - beta2), (float)weight_decay, (float)eps,
              (float)bias_correction1, (float)std::sqrt(bias_correction2), stochastic_round ? 1 : 0, (uint64_t)seed};
  auto stream = at::cuda::getCurrentCUDAStream();
  fw::Launch L{};
  auto flush = [&]() {
    if (L.count == 0) return;
    const int64_t blocks = (L.chunks + fw::kWarps - 1) / fw::kWarps;
    TORCH_CHECK(blocks <= INT32_MAX, "fw::adamw_step: too many elements for one launch");
    check_launch(fw::launch_plain(fw::adamw_step_kernel, (unsigned)blocks, fw::kWarps * 32, 0, stream, L, h, qs, qu),
                 "adamw_step");
    L = fw::Launch{};
    h.seed += 0x632BE59BD9B4E019ull;   // each launch its own random bits
  };
  for (size_t i = 0; i < n; ++i) {
    const Tensor &p = params[i], &g = grads[i], &m = exp_avgs[i], &v = exp_avg_sqs[i];
    const Tensor &ms = exp_avg_scales[i], &vs = exp_avg_sq_scales[i];
    check_cuda(p, "adamw_step", "params");
    TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16,
                "fw::adamw_step: parameters must be float32 or bfloat16, got ", p.scalar_type());
    TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16,
                "fw::adamw_step: gradients must be float32 or bfloat16, got ", g.scalar_type());
    TORCH_CHECK(p.is_contiguous() && g.is_contiguous() && m.is_contiguous() && v.is_contiguous() &&
                    g.numel() == p.numel() && m.numel() == p.numel() && v.numel() == p.numel() &&
                    g.device() == p.device() && m.device() == p.device() && v.device() == p.device(),
                "fw::adamw_step: tensor ", i, ": parameter, gradient and moments must be contiguous, of one size, on "
                "one device");
    const bool quantized = ms.numel() > 0;
    if (quantized) {
      TORCH_CHECK(m.scalar_type() == at::kByte && v.scalar_type() == at::kByte && p.numel() % fw::kChunk == 0 &&
                      ms.scalar_type() == at::kFloat && vs.scalar_type() == at::kFloat && ms.is_contiguous() &&
                      vs.is_contiguous() && ms.numel() == p.numel() / fw::kChunk && vs.numel() == ms.numel() &&
                      ms.device() == p.device() && vs.device() == p.device(),
                  "fw::adamw_step: tensor ", i, ": 8-bit moments need uint8 codes, a multiple of ", fw::kChunk,
                  " elements and one float32 scale per block of ", fw::kChunk);
    } else {
      TORCH_CHECK(m.scalar_type() == p.scalar_type() && v.scalar_type() == p.scalar_type(),
                  "fw::adamw_step: tensor ", i, ": plain moments must have the parameter's dtype");
    }
    if (p.numel() == 0) continue;
    if (L.count == fw::kMaxTensors) flush();
    fw::TensorArgs& t = L.t[L.count++];
    t.p = p.data_ptr();
    t.g = g.data_ptr();
    t.m = m.data_ptr();
    t.v = v.data_ptr();
    t.m_scale = quantized ? ms.data_ptr<float>() : nullptr;
    t.v_scale = quantized ? vs.data_ptr<float>() : nullptr;
    t.numel = p.numel();
    t.chunk0 = L.chunks;
    t.p_bf16 = p.scalar_type() == at::kBFloat16;
    t.g_bf16 = g.scalar_type() == at::kBFloat16;
    t.quantized = quantized;
    L.chunks += (p.numel() + fw::kChunk - 1) / fw::kChunk;
  }
  flush();
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) { m.impl("adamw_step", &adamw_step); }
