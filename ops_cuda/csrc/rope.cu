// NeoX split-half RoPE of q and k in one launch: one block per token, cos/sin computed once per token
// into shared memory (angle = float(position) * inv_freq in fp32, as transformers computes it), then
// every head of q and k rotated with 16-byte accesses when aligned.
#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "common.cuh"
#include "torch_utils.h"

namespace fw {

// q [B, T, Hq, D], k [B, T, Hk, D] with element strides (b, t, h) and a contiguous last dim; outputs
// contiguous; positions [B*T] int64; inv_freq [D/2] fp32.
struct RopeStrides {
  int64_t T;
  int64_t q[3];
  int64_t k[3];
};
cudaError_t rope_fwd(DType dt, const void* q, const void* k, void* q_out, void* k_out, const int64_t* positions,
                     const float* inv_freq, RopeStrides strides, int64_t tokens, int Hq, int Hk, int D, bool inverse,
                     cudaStream_t stream);

}  // namespace fw

namespace fw {
namespace {

constexpr int kThreads = 128;

template <typename T, int VEC>
__device__ __forceinline__ void rotate_heads(const T* __restrict__ in, int64_t in_head_stride, T* __restrict__ out,
                                             int H, int D, const float* cs, const float* sn) {
  const int half = D / 2;
  const int per_head = half / VEC;
  for (int idx = threadIdx.x; idx < H * per_head; idx += blockDim.x) {
    const int h = idx / per_head, i = (idx - h * per_head) * VEC;
    const T* src = in + h * in_head_stride;
    T* dst = out + (int64_t)h * D;
    Vec<T, VEC> a = load_vec<T, VEC>(src + i), b = load_vec<T, VEC>(src + i + half);
    Vec<T, VEC> oa, ob;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x1 = to_f(a.v[j]), x2 = to_f(b.v[j]), c = cs[i + j], s = sn[i + j];
      oa.v[j] = from_f<T>(x1 * c - x2 * s);
      ob.v[j] = from_f<T>(x2 * c + x1 * s);
    }
    store_vec<T, VEC>(dst + i, oa);
    store_vec<T, VEC>(dst + i + half, ob);
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
rope_kernel(const T* __restrict__ q, const T* __restrict__ k, T* __restrict__ qo, T* __restrict__ ko,
            const int64_t* __restrict__ positions, const float* __restrict__ inv_freq, RopeStrides st, int Hq,
            int Hk, int D, float sign, unsigned trigger_from) {
  pdl_begin(trigger_from);
  extern __shared__ float trig[];  // cos [D/2], sin [D/2]
  const int64_t tok = blockIdx.x;
  const int half = D / 2;
  const float pos = (float)positions[tok];
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(pos * inv_freq[i], &s, &c);
    trig[i] = c;
    trig[half + i] = sign * s;
  }
  __syncthreads();
  const int64_t b = tok / st.T, t = tok - b * st.T;
  rotate_heads<T, VEC>(q + b * st.q[0] + t * st.q[1], st.q[2], qo + tok * Hq * D, Hq, D, trig, trig + half);
  rotate_heads<T, VEC>(k + b * st.k[0] + t * st.k[1], st.k[2], ko + tok * Hk * D, Hk, D, trig, trig + half);
}

}  // namespace

cudaError_t rope_fwd(DType dt, const void* q, const void* k, void* q_out, void* k_out, const int64_t* positions,
                     const float* inv_freq, RopeStrides st, int64_t tokens, int Hq, int Hk, int D, bool inverse,
                     cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    constexpr int V16 = 16 / sizeof(T);
    const size_t smem = (size_t)D * sizeof(float);
    const float sign = inverse ? -1.f : 1.f;
    bool vec = (D / 2) % V16 == 0 && aligned16(q) && aligned16(k) && aligned16(q_out) && aligned16(k_out);
    for (int i = 0; i < 3; ++i) vec = vec && st.q[i] % V16 == 0 && st.k[i] % V16 == 0;
    return launch_kernel(vec ? rope_kernel<T, V16> : rope_kernel<T, 1>, (unsigned)tokens, kThreads, smem, stream,
                         (const T*)q, (const T*)k, (T*)q_out, (T*)k_out, positions, inv_freq, st, Hq, Hk, D, sign);
  });
}

}  // namespace fw

namespace fw {
namespace {

// Inverse frequencies one fill launch carries as its argument.
constexpr int kFreqChunk = 64;
struct FreqChunk {
  float v[kFreqChunk];
};

__global__ void fill_inv_freq_kernel(float* __restrict__ out, int n, FreqChunk c) {
  if ((int)threadIdx.x < n) out[threadIdx.x] = c.v[threadIdx.x];
}

}  // namespace

// inv_freq computed by the same ATen CPU ops as transformers (1 / theta ** (arange(0, D, 2) / D) in fp32): the
// values themselves, bit for bit, whichever CPU kernels (vectorised pow or not) this machine runs; a device
// computation would round some of them otherwise. Outside CUDA-graph capture the values are copied to the device and
// cached there. Under capture, where a pageable copy is an error (it synchronises the capturing stream), they reach
// the device as kernel arguments, which the graph keeps and replays, in a buffer of the graph's memory pool, which is
// not cached: that pool goes with the graph. So a (device, D, theta) first met inside a capture works too.
at::Tensor rope_inv_freq(int64_t D, double theta, const at::Device& device) {
  static std::mutex mu;
  static std::map<std::tuple<int, int64_t, double>, Tensor> cache;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple((int)device.index(), D, theta);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  auto e = at::arange(0, D, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat).div(D);
  const auto inv = at::reciprocal(at::pow(theta, e)).contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index());
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status == cudaStreamCaptureStatusNone) {
    auto on_device = inv.to(device);
    cache.emplace(key, on_device);
    return on_device;
  }
  auto on_device = at::empty({inv.numel()}, at::TensorOptions().dtype(at::kFloat).device(device));
  const float* src = inv.data_ptr<float>();
  for (int64_t i0 = 0; i0 < inv.numel(); i0 += kFreqChunk) {
    const int n = (int)std::min<int64_t>(kFreqChunk, inv.numel() - i0);
    FreqChunk c{};
    std::copy(src + i0, src + i0 + n, c.v);
    check_launch(launch_plain(fill_inv_freq_kernel, 1, kFreqChunk, 0, stream, on_device.data_ptr<float>() + i0, n, c),
                 "rope");
  }
  return on_device;
}

}  // namespace fw

namespace {

// ------------------------------------------------------------------ rope

std::tuple<Tensor, Tensor> rope(const Tensor& q, const Tensor& k, const Tensor& positions, double theta,
                                bool inverse) {
  check_cuda(q, "rope", "q");
  c10::cuda::CUDAGuard guard(q.device());
  const auto dt = dtype_of(q, "rope", "q");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && positions.dim() == 2, "fw::rope: expected q [B,T,Hq,D], k [B,T,Hk,D], "
              "positions [B,T]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "fw::rope: q and k dtypes differ");
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), Hk = k.size(2), D = q.size(3);
  auto qc = q.stride(3) == 1 ? q : q.contiguous();
  auto kc = k.stride(3) == 1 ? k : k.contiguous();
  auto pos = positions.to(at::kLong).contiguous();
  auto qo = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  auto ko = at::empty(k.sizes(), k.options().memory_format(at::MemoryFormat::Contiguous));
  fw::RopeStrides st{T, {qc.stride(0), qc.stride(1), qc.stride(2)}, {kc.stride(0), kc.stride(1), kc.stride(2)}};
  auto inv = fw::rope_inv_freq(D, theta, q.device());
  check_launch(fw::rope_fwd(dt, qc.data_ptr(), kc.data_ptr(), qo.data_ptr(), ko.data_ptr(), pos.data_ptr<int64_t>(),
                            inv.data_ptr<float>(), st, B * T, (int)Hq, (int)Hk, (int)D, inverse,
                            at::cuda::getCurrentCUDAStream()),
               "rope");
  return {qo, ko};
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) {
  m.impl("rope", &rope);
}
