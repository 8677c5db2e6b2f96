// CUDA implementations of the fw operators (schemas are defined in ops_cuda/library.py): argument checks,
// output allocation, the cuBLAS GEMMs of the fused linear + logprob, and the kernel launches (kernels.h)
// on the current stream, each launch's error checked.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels.h"

namespace {

using at::Tensor;

fw::DType dtype_of(const Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return fw::DType::F32;
    case at::kBFloat16: return fw::DType::BF16;
    case at::kHalf: return fw::DType::F16;
    default:
      TORCH_CHECK(false, "fw::", op, ": `", name, "` has dtype ", t.scalar_type(),
                  "; the CUDA kernels take float32, bfloat16 or float16");
  }
}

void check_launch(cudaError_t e, const char* op) {
  TORCH_CHECK(e == cudaSuccess, "fw::", op, ": kernel launch failed: ", cudaGetErrorString(e));
}

void check_cuda(const Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), "fw::", op, ": `", name, "` must be a CUDA tensor, got ", t.device());
}

int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// weight in x's dtype, or float32 (kept: the kernels read it as float).
std::pair<Tensor, fw::DType> weight_for(const Tensor& weight, const Tensor& x, fw::DType dt) {
  if (weight.scalar_type() == x.scalar_type()) return {weight.contiguous(), dt};
  if (weight.scalar_type() == at::kFloat) return {weight.contiguous(), fw::DType::F32};
  return {weight.to(x.scalar_type()).contiguous(), dt};
}

// ------------------------------------------------------------------ rms_norm
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_cuda(x, "rms_norm", "x");
  c10::cuda::CUDAGuard guard(x.device());
  const auto dt = dtype_of(x, "rms_norm", "x");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D, "fw::rms_norm: weight has ", weight.numel(), " elements, expected ", D);
  auto xc = x.contiguous();
  auto [w, wdt] = weight_for(weight, x, dt);
  auto y = at::empty(x.sizes(), xc.options());
  const int64_t rows = D ? xc.numel() / D : 0;
  check_launch(fw::rms_norm_fwd(dt, wdt, xc.data_ptr(), w.data_ptr(), y.data_ptr(), rows, (int)D, (float)eps,
                                at::cuda::getCurrentCUDAStream()),
               "rms_norm");
  return y;
}

std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight, double eps) {
  check_cuda(x, "rms_norm_backward", "x");
  c10::cuda::CUDAGuard guard(x.device());
  const auto dt = dtype_of(x, "rms_norm_backward", "x");
  const int64_t D = x.size(-1);
  auto xc = x.contiguous();
  auto gc = grad.to(x.scalar_type()).contiguous();
  auto [w, wdt] = weight_for(weight, x, dt);
  const int64_t rows = D ? xc.numel() / D : 0;
  auto gx = at::empty(x.sizes(), xc.options());
  const int sms = sm_count(), max_blocks = fw::rms_norm_bwd_max_blocks(sms);
  auto part = at::empty({max_blocks, D}, xc.options().dtype(at::kFloat));
  int blocks = 0;
  check_launch(fw::rms_norm_bwd(dt, wdt, gc.data_ptr(), xc.data_ptr(), w.data_ptr(), gx.data_ptr(),
                                part.data_ptr<float>(), max_blocks, &blocks, rows, (int)D, (float)eps, sms,
                                at::cuda::getCurrentCUDAStream()),
               "rms_norm_backward");
  return {gx, part.narrow(0, 0, blocks).sum(0).to(weight.scalar_type())};
}

// ------------------------------------------------------------------ rope
// inv_freq computed by the same ATen CPU ops as transformers (1 / theta ** (arange(0, D, 2) / D) in fp32),
// cached on each device.
Tensor inv_freq_for(int64_t D, double theta, const at::Device& device) {
  static std::mutex mu;
  static std::map<std::tuple<int, int64_t, double>, Tensor> cache;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple((int)device.index(), D, theta);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  auto e = at::arange(0, D, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat).div(D);
  auto inv = at::reciprocal(at::pow(theta, e)).to(device);
  cache.emplace(key, inv);
  return inv;
}

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
  auto inv = inv_freq_for(D, theta, q.device());
  check_launch(fw::rope_fwd(dt, qc.data_ptr(), kc.data_ptr(), qo.data_ptr(), ko.data_ptr(), pos.data_ptr<int64_t>(),
                            inv.data_ptr<float>(), st, B * T, (int)Hq, (int)Hk, (int)D, inverse,
                            at::cuda::getCurrentCUDAStream()),
               "rope");
  return {qo, ko};
}

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

// ------------------------------------------------------------------ linear + logprob
// The fp32 logits tile: 1 GiB (1765 rows at vocab 151,936). Larger than the CPU reference's: fewer passes of the
// fp32 grad_W accumulator (V x d) and fuller GEMMs; still a few percent of the unfused [N, V] memory.
constexpr int64_t kTileBytes = int64_t(1) << 30;

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CUDA_R_32F;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: TORCH_CHECK(false, "fw::linear_logprob: unsupported dtype ", t);
  }
}

// Column-major cublasGemmEx with fp32 compute (no TF32: logprobs feed importance ratios).
void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha, const void* A,
          cudaDataType_t a_t, int64_t lda, const void* B, cudaDataType_t b_t, int64_t ldb, float beta, void* C,
          cudaDataType_t c_t, int64_t ldc) {
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  cublasMath_t prev;
  TORCH_CUDABLAS_CHECK(cublasGetMathMode(handle, &prev));
  TORCH_CUDABLAS_CHECK(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));
  const cublasStatus_t st = cublasGemmEx(handle, ta, tb, (int)m, (int)n, (int)k, &alpha, A, a_t, (int)lda, B, b_t,
                                         (int)ldb, &beta, C, c_t, (int)ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  TORCH_CUDABLAS_CHECK(cublasSetMathMode(handle, prev));
  TORCH_CUDABLAS_CHECK(st);
}

struct LinearArgs {
  Tensor h, w;
  int64_t N, d, V, chunk;
};

LinearArgs linear_args(const Tensor& hidden, const Tensor& weight, const Tensor& targets, const char* op) {
  check_cuda(hidden, op, "hidden");
  dtype_of(hidden, op, "hidden");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1), "fw::", op,
              ": expected hidden [N, d] and weight [V, d]");
  TORCH_CHECK(targets.numel() == hidden.size(0), "fw::", op, ": targets must have N = ", hidden.size(0), " elements");
  LinearArgs a;
  a.h = hidden.contiguous();
  a.w = (weight.scalar_type() == hidden.scalar_type() ? weight : weight.to(hidden.scalar_type())).contiguous();
  a.N = hidden.size(0);
  a.d = hidden.size(1);
  a.V = weight.size(0);
  a.chunk = std::max<int64_t>(1, std::min<int64_t>(a.N, kTileBytes / (4 * std::max<int64_t>(a.V, 1))));
  return a;
}

std::tuple<Tensor, Tensor, Tensor> linear_logprob(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                                  double temperature) {
  c10::cuda::CUDAGuard guard(hidden.device());
  auto a = linear_args(hidden, weight, targets, "linear_logprob");
  auto t = targets.to(at::kLong).contiguous();
  auto opts = a.h.options().dtype(at::kFloat);
  auto lp = at::empty({a.N}, opts), ent = at::empty({a.N}, opts), lse = at::empty({a.N}, opts);
  if (a.N == 0) return {lp, ent, lse};
  auto tile = at::empty({a.chunk, a.V}, opts);
  const auto ht = cuda_type(a.h.scalar_type());
  auto stream = at::cuda::getCurrentCUDAStream();
  const char* hp = static_cast<const char*>(a.h.data_ptr());
  for (int64_t s = 0; s < a.N; s += a.chunk) {
    const int64_t n = std::min(a.chunk, a.N - s);
    // z^T [V, n] (column-major) = W [V, d] . h_chunk^T, scaled by 1/temperature
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, a.V, n, a.d, (float)(1.0 / temperature), a.w.data_ptr(), ht, a.d,
         hp + s * a.d * a.h.element_size(), ht, a.d, 0.f, tile.data_ptr(), CUDA_R_32F, a.V);
    check_launch(fw::logprob_rows_fwd(tile.data_ptr<float>(), t.data_ptr<int64_t>() + s, lp.data_ptr<float>() + s,
                                      ent.data_ptr<float>() + s, lse.data_ptr<float>() + s, n, a.V, stream),
                 "linear_logprob");
  }
  return {lp, ent, lse};
}

std::tuple<Tensor, Tensor> linear_logprob_backward(const Tensor& grad_logprob, const Tensor& grad_entropy,
                                                   const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                                   const Tensor& lse, const Tensor& entropy, double temperature) {
  c10::cuda::CUDAGuard guard(hidden.device());
  auto a = linear_args(hidden, weight, targets, "linear_logprob_backward");
  const auto dt = dtype_of(a.h, "linear_logprob_backward", "hidden");
  auto t = targets.to(at::kLong).contiguous();
  auto glp = grad_logprob.to(at::kFloat).contiguous(), gent = grad_entropy.to(at::kFloat).contiguous();
  auto l = lse.to(at::kFloat).contiguous(), H = entropy.to(at::kFloat).contiguous();
  auto gh = at::empty({a.N, a.d}, a.h.options());
  auto gw = at::zeros({a.V, a.d}, a.h.options().dtype(at::kFloat));
  if (a.N == 0) return {gh, gw.to(weight.scalar_type())};
  auto opts = a.h.options().dtype(at::kFloat);
  auto tile = at::empty({a.chunk, a.V}, opts);
  auto gtile = at::empty({a.chunk, a.V}, a.h.options());
  const auto ht = cuda_type(a.h.scalar_type());
  const float inv_t = (float)(1.0 / temperature);
  auto stream = at::cuda::getCurrentCUDAStream();
  const size_t es = a.h.element_size();
  const char* hp = static_cast<const char*>(a.h.data_ptr());
  char* ghp = static_cast<char*>(gh.data_ptr());
  for (int64_t s = 0; s < a.N; s += a.chunk) {
    const int64_t n = std::min(a.chunk, a.N - s);
    const void* hs = hp + s * a.d * es;
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, a.V, n, a.d, inv_t, a.w.data_ptr(), ht, a.d, hs, ht, a.d, 0.f, tile.data_ptr(),
         CUDA_R_32F, a.V);
    check_launch(fw::logprob_rows_bwd(dt, tile.data_ptr<float>(), t.data_ptr<int64_t>() + s, l.data_ptr<float>() + s,
                                      H.data_ptr<float>() + s, glp.data_ptr<float>() + s,
                                      gent.data_ptr<float>() + s, gtile.data_ptr(), n, a.V, stream),
                 "linear_logprob_backward");
    // grad_h^T [d, n] = W^T [d, V] . g^T [V, n]   (dz/dlogits = 1/temperature)
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, a.d, n, a.V, inv_t, a.w.data_ptr(), ht, a.d, gtile.data_ptr(), ht, a.V, 0.f,
         ghp + s * a.d * es, ht, a.d);
    // grad_W^T [d, V] += h_chunk^T [d, n] . g [n, V]
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, a.d, a.V, n, inv_t, hs, ht, a.d, gtile.data_ptr(), ht, a.V, 1.f, gw.data_ptr(),
         CUDA_R_32F, a.d);
  }
  return {gh, gw.to(weight.scalar_type())};
}

// ------------------------------------------------------------------ decode attention
Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                        double scale) {
  check_cuda(q, "decode_attention", "q");
  c10::cuda::CUDAGuard guard(q.device());
  const auto dt = dtype_of(q, "decode_attention", "q");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "fw::decode_attention: q, k_cache and v_cache must share a dtype");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "fw::decode_attention: the CUDA kernel takes head_dim 64, 128 or 256, got ",
              D);
  const int64_t R = Hq / Hk;
  TORCH_CHECK(Hq % Hk == 0 && (R == 1 || R == 2 || R == 4 || R == 8),
              "fw::decode_attention: the CUDA kernel takes Hq / Hk in {1, 2, 4, 8}, got ", Hq, " / ", Hk);
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "fw::decode_attention: k_cache and v_cache strides differ");
  auto kc = k_cache.stride(3) == 1 ? k_cache : k_cache.contiguous();
  auto vc = v_cache.stride(3) == 1 && kc.strides() == v_cache.strides() ? v_cache : v_cache.contiguous();
  if (kc.strides() != vc.strides()) kc = kc.contiguous();
  const int64_t E = std::max<int64_t>(16 / kc.element_size(), D / 32);  // elements per lane (decode_attention.cu)
  const bool aligned = kc.stride(0) % E == 0 && kc.stride(1) % E == 0 && kc.stride(2) % E == 0 &&
                       reinterpret_cast<uintptr_t>(kc.data_ptr()) % (E * kc.element_size()) == 0 &&
                       reinterpret_cast<uintptr_t>(vc.data_ptr()) % (E * vc.element_size()) == 0;
  if (!aligned) {
    kc = kc.contiguous();
    vc = vc.contiguous();
  }
  auto qc = q.contiguous();
  auto len = lengths.to(at::kLong).contiguous();
  auto out = at::empty({B, Hq, D}, q.options());
  if (B == 0) return out;
  const int splits = fw::decode_attention_splits((int)B, (int)Hk, (int)S, sm_count());
  const int64_t parts = B * Hq * splits;
  auto ws = at::empty({parts * D + 2 * parts}, q.options().dtype(at::kFloat));
  float* base = ws.data_ptr<float>();
  fw::DecodeWorkspace w{base, base + parts * D, base + parts * D + parts};
  check_launch(fw::decode_attention(dt, qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), len.data_ptr<int64_t>(),
                                    out.data_ptr(), w, (int)B, (int)Hq, (int)Hk, (int)S, (int)D, kc.stride(0),
                                    kc.stride(1), kc.stride(2), splits, (float)scale, at::cuda::getCurrentCUDAStream()),
               "decode_attention");
  return out;
}

// ------------------------------------------------------------------ sampler
std::tuple<Tensor, Tensor> sample(const Tensor& logits, double temperature, int64_t top_k, double top_p,
                                  double min_p, int64_t seed) {
  check_cuda(logits, "sample", "logits");
  c10::cuda::CUDAGuard guard(logits.device());
  const auto dt = dtype_of(logits, "sample", "logits");
  TORCH_CHECK(logits.dim() == 2, "fw::sample: logits must be [B, V]");
  auto x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  auto tokens = at::empty({B}, x.options().dtype(at::kLong));
  auto lp = at::empty({B}, x.options().dtype(at::kFloat));
  const bool use_min_p = min_p > 0.0;
  const float log_min_p = use_min_p ? (float)std::log(min_p) : 0.f;
  if (B == 0) return {tokens, lp};
  const int P = fw::sample_split_parts((int)B, V, sm_count());
  auto part_f = at::empty({B * P * 3}, x.options().dtype(at::kFloat));
  auto part_i = at::empty({B * P}, x.options().dtype(at::kLong));
  fw::SampleSplitWorkspace ws{P, part_f.data_ptr<float>(), part_i.data_ptr<int64_t>()};
  check_launch(fw::sample(dt, x.data_ptr(), x.stride(0), tokens.data_ptr<int64_t>(), lp.data_ptr<float>(), (int)B, V,
                          (float)temperature, top_k, (float)top_p, log_min_p, use_min_p, (uint64_t)seed, ws,
                          at::cuda::getCurrentCUDAStream()),
               "sample");
  return {tokens, lp};
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("rope", &rope);
  m.impl("swiglu", &swiglu);
  m.impl("swiglu_backward", &swiglu_backward);
  m.impl("linear_logprob", &linear_logprob);
  m.impl("linear_logprob_backward", &linear_logprob_backward);
  m.impl("decode_attention", &decode_attention);
  m.impl("sample", &sample);
}
