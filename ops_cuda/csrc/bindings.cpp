// CUDA implementations of the fw operators (schemas are defined in ops_cuda/library.py): argument checks,
// output allocation, the fused linear + logprob's tiling around its GEMMs (gemm.cpp), and the kernel launches
// (kernels.h) on the current stream, each launch's error checked.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "gemm.h"
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
int64_t l2_bytes() { return at::cuda::getCurrentDeviceProperties()->l2CacheSize; }

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
                                sm_count(), l2_bytes(), at::cuda::getCurrentCUDAStream()),
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
  auto gw = at::empty({D}, w.options());  // in the kernels' weight dtype (x's, or float32)
  if (rows == 0) return {gx, gw.zero_().to(weight.scalar_type())};
  check_launch(fw::rms_norm_bwd(dt, wdt, gc.data_ptr(), xc.data_ptr(), w.data_ptr(), gx.data_ptr(), gw.data_ptr(),
                                part.data_ptr<float>(), max_blocks, rows, (int)D, (float)eps, sms,
                                at::cuda::getCurrentCUDAStream()),
               "rms_norm_backward");
  return {gx, gw.to(weight.scalar_type())};
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
// The logits are walked in fp32 tiles of kTileRows rows x kTileCols vocabulary columns (logprob.cu); both are
// overridable with FW_LOGPROB_TILE="rows,cols" (ops_cuda/bench/sweep.sh). The backward walks vocabulary tiles
// outside and row tiles inside, so a tile's grad_weight rows are finished (accumulated in a [cols, d] fp32
// buffer) before the next tile starts, and grad_hidden accumulates in fp32 across vocabulary tiles.
// H200 sweep at N 16,384, V 151,936 (fwd+bwd): 4096 x 8192 takes 42.9 ms and 0.60 GiB; whole-vocabulary row
// chunks of 1 GiB (the previous layout) 42.1 ms and 2.40 GiB; smaller tiles were slower (up to 49.6 ms).
// On Hopper the forward needs no tile (logprob_sm90.cu) and the backward's tile is the 16-bit dz alone, so it
// takes twice the rows (kSm90TileRows). Sweep, recomputing (docs/PERFORMANCE.md run 12): 8192 x 8192 34.3 ms and
// 0.54 GiB; 4096 x 8192 35.6 ms and 0.48; 4096 x 16384 34.9 and 0.57; 8192 x 16384 34.1 and 0.70.
// The columns of a tile are a multiple of kLogprobChunk (the forward's partials are per chunk). With kept logits
// the backward reads each tile's fp16 logits where it would recompute them.
constexpr int64_t kTileRows = 4096, kSm90TileRows = 8192, kTileCols = 8192;

std::pair<int64_t, int64_t> tile_shape(bool sm90) {
  static const std::pair<int64_t, int64_t> shape = [] {
    long long r = 0, c = 0;
    const char* v = getenv("FW_LOGPROB_TILE");
    if (v && *v) {
      TORCH_CHECK(sscanf(v, "%lld,%lld", &r, &c) == 2 && r > 0 && c > 0 && c % fw::kLogprobChunk == 0,
                  "FW_LOGPROB_TILE must be rows,cols with cols a multiple of ", fw::kLogprobChunk, ", got '", v, "'");
      return std::make_pair<int64_t, int64_t>(r, c);
    }
    return std::make_pair<int64_t, int64_t>(0, 0);  // the defaults below
  }();
  if (shape.first) return shape;
  return std::make_pair(sm90 ? kSm90TileRows : kTileRows, kTileCols);
}

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CUDA_R_32F;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: TORCH_CHECK(false, "fw::linear_logprob: unsupported dtype ", t);
  }
}

struct LinearArgs {
  Tensor h, w;
  fw::DType dt;
  int64_t N, d, V, rows, cols;  // rows x cols: the logits tile
  bool sm90;                    // the Hopper kernel (logprob_sm90.cu) computes the logits, not cuBLAS tiles
};

LinearArgs linear_args(const Tensor& hidden, const Tensor& weight, const Tensor& targets, const char* op) {
  check_cuda(hidden, op, "hidden");
  const fw::DType dt = dtype_of(hidden, op, "hidden");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1), "fw::", op,
              ": expected hidden [N, d] and weight [V, d]");
  TORCH_CHECK(targets.numel() == hidden.size(0), "fw::", op, ": targets must have N = ", hidden.size(0), " elements");
  LinearArgs a;
  a.dt = dt;
  a.h = hidden.contiguous();
  a.w = (weight.scalar_type() == hidden.scalar_type() ? weight : weight.to(hidden.scalar_type())).contiguous();
  a.N = hidden.size(0);
  a.d = hidden.size(1);
  a.V = weight.size(0);
  const auto* p = at::cuda::getCurrentDeviceProperties();
  a.sm90 = fw::linear_logprob_sm90_supported(a.dt, p->major, p->minor, a.d, a.h.data_ptr(), a.w.data_ptr());
  a.rows = std::max<int64_t>(1, std::min(a.N, tile_shape(a.sm90).first));
  a.cols = std::max<int64_t>(1, std::min(a.V, tile_shape(a.sm90).second));
  return a;
}

// Chunks of kLogprobChunk columns in a row of V: the forward's partials a row, and the kept logits' offsets.
int64_t logprob_chunks(int64_t V) { return (V + fw::kLogprobChunk - 1) / fw::kLogprobChunk; }

// Whether the forward keeps the logits for the backward: asked for and 16-bit operands (ops_cuda.reference).
bool saves_logits(const LinearArgs& a, int64_t save_chunk) {
  if (save_chunk <= 0 || a.h.scalar_type() == at::kFloat) return false;
  TORCH_CHECK(save_chunk == fw::kLogprobChunk, "fw::linear_logprob: save_chunk must be ", fw::kLogprobChunk,
              " on CUDA (the chunk of the forward kernel), got ", save_chunk);
  return true;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> linear_logprob(const Tensor& hidden, const Tensor& weight,
                                                                  const Tensor& targets, double temperature,
                                                                  int64_t save_chunk) {
  c10::cuda::CUDAGuard guard(hidden.device());
  auto a = linear_args(hidden, weight, targets, "linear_logprob");
  auto t = targets.to(at::kLong).contiguous();
  auto opts = a.h.options().dtype(at::kFloat);
  auto lp = at::empty({a.N}, opts), ent = at::empty({a.N}, opts), lse = at::empty({a.N}, opts);
  const bool save = saves_logits(a, save_chunk);
  const int64_t P = logprob_chunks(a.V);
  auto saved = at::empty(save ? std::vector<int64_t>{a.N, a.V} : std::vector<int64_t>{0}, opts.dtype(at::kHalf));
  auto offsets = at::empty(save ? std::vector<int64_t>{a.N, P} : std::vector<int64_t>{0}, opts);
  if (a.N == 0) return {lp, ent, lse, saved, offsets};
  auto stream = at::cuda::getCurrentCUDAStream();
  const size_t es = a.h.element_size();
  const char* hp = static_cast<const char*>(a.h.data_ptr());
  const char* wp = static_cast<const char*>(a.w.data_ptr());
  // Hopper: the logits never leave the GEMM's accumulators; elsewhere fp32 tiles from cuBLAS for the row kernels
  auto tile = a.sm90 ? Tensor() : at::empty({a.rows * a.cols}, opts);
  // The row tile's chunk partials (m, s, a) and target logits; m goes straight into offsets when keeping logits.
  auto parts = at::empty({(save ? 2 : 3) * a.rows * P + a.rows}, opts);
  float* pp = parts.data_ptr<float>();
  const auto ht = cuda_type(a.h.scalar_type());
  for (int64_t n0 = 0; n0 < a.N; n0 += a.rows) {
    const int64_t n = std::min(a.rows, a.N - n0);
    float* m = save ? offsets.data_ptr<float>() + n0 * P : pp + 2 * a.rows * P;
    const fw::LogprobParts parts_of_tile{m, pp, pp + a.rows * P, P, pp + (save ? 2 : 3) * a.rows * P};
    if (a.sm90) {  // one launch for the row tile's whole vocabulary
      void* z16 = save ? static_cast<void*>(static_cast<at::Half*>(saved.data_ptr()) + n0 * a.V) : nullptr;
      check_launch(fw::linear_logprob_sm90_fwd(a.dt, hp + n0 * a.d * es, wp, n, a.V, a.d, (float)(1.0 / temperature),
                                               t.data_ptr<int64_t>() + n0, parts_of_tile, z16, a.V, sm_count(),
                                               stream),
                   "linear_logprob");
    }
    for (int64_t v0 = 0; !a.sm90 && v0 < a.V; v0 += a.cols) {
      const int64_t vc = std::min(a.cols, a.V - v0);
      // z^T [vc, n] (column-major) = W[v0:v0+vc] . h[n0:n0+n]^T, scaled by 1/temperature
      fw::gemm(CUBLAS_OP_T, CUBLAS_OP_N, vc, n, a.d, (float)(1.0 / temperature), wp + v0 * a.d * es, ht, a.d,
               hp + n0 * a.d * es, ht, a.d, 0.f, tile.data_ptr(), CUDA_R_32F, vc);
      void* z16 = save ? static_cast<void*>(static_cast<at::Half*>(saved.data_ptr()) + n0 * a.V + v0) : nullptr;
      check_launch(fw::logprob_chunks_fwd(tile.data_ptr<float>(), n, vc, v0, t.data_ptr<int64_t>() + n0,
                                          parts_of_tile, z16, a.V, stream),
                   "linear_logprob");
    }
    check_launch(fw::logprob_merge(parts_of_tile, n, a.V, t.data_ptr<int64_t>() + n0, lp.data_ptr<float>() + n0,
                                   ent.data_ptr<float>() + n0, lse.data_ptr<float>() + n0, stream),
                 "linear_logprob");
  }
  return {lp, ent, lse, saved, offsets};
}

// With the forward's kept logits (saved non-empty) the backward runs two GEMMs a tile instead of three.
std::tuple<Tensor, Tensor> linear_logprob_backward(const Tensor& grad_logprob, const Tensor& grad_entropy,
                                                   const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                                   const Tensor& lse, const Tensor& entropy, const Tensor& saved,
                                                   const Tensor& offsets, double temperature, int64_t save_chunk) {
  c10::cuda::CUDAGuard guard(hidden.device());
  auto a = linear_args(hidden, weight, targets, "linear_logprob_backward");
  const auto dt = a.dt;
  auto t = targets.to(at::kLong).contiguous();
  auto glp = grad_logprob.to(at::kFloat).contiguous(), gent = grad_entropy.to(at::kFloat).contiguous();
  auto l = lse.to(at::kFloat).contiguous(), H = entropy.to(at::kFloat).contiguous();
  auto gw = at::empty({a.V, a.d}, weight.options());
  if (a.N == 0) return {at::zeros({a.N, a.d}, a.h.options()), gw.zero_()};
  const bool use_saved = saved.numel() > 0;
  const int64_t chunks = use_saved ? logprob_chunks(a.V) : 0;
  if (use_saved) {
    TORCH_CHECK(saves_logits(a, save_chunk) && saved.scalar_type() == at::kHalf && saved.is_contiguous() &&
                    saved.dim() == 2 && saved.size(0) == a.N && saved.size(1) == a.V &&
                    offsets.scalar_type() == at::kFloat && offsets.is_contiguous() && offsets.dim() == 2 &&
                    offsets.size(0) == a.N && offsets.size(1) == chunks,
                "fw::linear_logprob_backward: saved must be the float16 [N, V] and offsets the float32 [N, ",
                "ceil(V / save_chunk)] that linear_logprob returned for 16-bit operands and this save_chunk");
    check_cuda(saved, "linear_logprob_backward", "saved");
    check_cuda(offsets, "linear_logprob_backward", "offsets");
    TORCH_CHECK(saved.device() == hidden.device() && offsets.device() == hidden.device(),
                "fw::linear_logprob_backward: saved and offsets must be on hidden's device");
  }
  const bool one_col_tile = a.cols >= a.V, one_row_tile = a.rows >= a.N;
  // grad_h: written straight in hidden's dtype when one GEMM covers the vocabulary, else fp32 across tiles.
  auto gh = at::empty({a.N, a.d}, one_col_tile ? a.h.options() : a.h.options().dtype(at::kFloat));
  // grad_W rows of a vocabulary tile: straight into gw when one GEMM covers the rows (and dtypes agree).
  const bool gw_direct = one_row_tile && weight.scalar_type() == a.h.scalar_type();
  Tensor gw_acc = gw_direct ? Tensor() : at::empty({a.cols, a.d}, a.h.options().dtype(at::kFloat));
  auto opts = a.h.options().dtype(at::kFloat);
  // recomputed logits: on Hopper the sm90 kernel writes the tile's dz itself, elsewhere a cuBLAS fp32 tile
  const bool sm90 = !use_saved && a.sm90;
  auto tile = use_saved || sm90 ? Tensor() : at::empty({a.rows * a.cols}, opts);
  auto gtile = at::empty({a.rows * a.cols}, a.h.options());
  const auto ht = cuda_type(a.h.scalar_type()), gh_t = cuda_type(gh.scalar_type());
  const auto gw_t = gw_direct ? ht : CUDA_R_32F;
  const float inv_t = (float)(1.0 / temperature);
  auto stream = at::cuda::getCurrentCUDAStream();
  const size_t es = a.h.element_size();
  const char* hp = static_cast<const char*>(a.h.data_ptr());
  const char* wp = static_cast<const char*>(a.w.data_ptr());
  char* ghp = static_cast<char*>(gh.data_ptr());
  for (int64_t v0 = 0; v0 < a.V; v0 += a.cols) {
    const int64_t vc = std::min(a.cols, a.V - v0);
    const void* ws = wp + v0 * a.d * es;
    void* gw_out =
        gw_direct ? static_cast<void*>(static_cast<char*>(gw.data_ptr()) + v0 * a.d * es) : gw_acc.data_ptr();
    for (int64_t n0 = 0; n0 < a.N; n0 += a.rows) {
      const int64_t n = std::min(a.rows, a.N - n0);
      const void* hs = hp + n0 * a.d * es;
      fw::SavedLogits sv{nullptr, a.V, nullptr, chunks};
      if (sm90) {
        check_launch(fw::linear_logprob_sm90_bwd(dt, hs, ws, n, vc, a.d, v0, inv_t, t.data_ptr<int64_t>() + n0,
                                                 l.data_ptr<float>() + n0, H.data_ptr<float>() + n0,
                                                 glp.data_ptr<float>() + n0, gent.data_ptr<float>() + n0,
                                                 gtile.data_ptr(), sm_count(), stream),
                     "linear_logprob_backward");
      } else if (use_saved) {
        sv.z16 = saved.const_data_ptr<at::Half>() + n0 * a.V + v0;
        sv.off = offsets.const_data_ptr<float>() + n0 * chunks + v0 / fw::kLogprobChunk;
      } else {
        fw::gemm(CUBLAS_OP_T, CUBLAS_OP_N, vc, n, a.d, inv_t, ws, ht, a.d, hs, ht, a.d, 0.f, tile.data_ptr(),
                 CUDA_R_32F, vc);
      }
      if (!sm90)
        check_launch(fw::logprob_tile_bwd(dt, use_saved ? nullptr : tile.data_ptr<float>(), sv, n, vc, v0,
                                          t.data_ptr<int64_t>() + n0, l.data_ptr<float>() + n0,
                                          H.data_ptr<float>() + n0, glp.data_ptr<float>() + n0,
                                          gent.data_ptr<float>() + n0, gtile.data_ptr(), stream),
                     "linear_logprob_backward");
      // grad_h^T [d, n] (+)= W_tile^T [d, vc] . g^T [vc, n]   (dz/dlogits = 1/temperature)
      fw::gemm(CUBLAS_OP_N, CUBLAS_OP_N, a.d, n, vc, inv_t, ws, ht, a.d, gtile.data_ptr(), ht, vc,
               v0 == 0 ? 0.f : 1.f, ghp + n0 * a.d * gh.element_size(), gh_t, a.d);
      // grad_W_tile^T [d, vc] (+)= h_rows^T [d, n] . g [n, vc]
      fw::gemm(CUBLAS_OP_N, CUBLAS_OP_T, a.d, vc, n, inv_t, hs, ht, a.d, gtile.data_ptr(), ht, vc,
               n0 == 0 ? 0.f : 1.f, gw_out, gw_t, a.d);
    }
    if (!gw_direct) gw.narrow(0, v0, vc).copy_(gw_acc.narrow(0, 0, vc));
  }
  return {one_col_tile ? gh : gh.to(a.h.scalar_type()), gw};
}

// ------------------------------------------------------------------ decode attention
// Split counters: one int per (b, kv head, head group), zero between launches because the last block of
// each group resets its own. One zeroed buffer per device is kept (never freed: graphs captured earlier
// hold its address) and grown outside captures; a capture that needs more than it has gets its own zeroed
// buffer (the memset becomes part of the graph). The shared buffer assumes decode calls on one device do
// not run concurrently on two streams.
int* decode_counters(int64_t n, const Tensor& like, cudaStream_t stream, Tensor& local) {
  static std::mutex mu;
  // leaked on purpose: no tensor destructor may run at exit, after the CUDA runtime is gone
  static auto* bufs = new std::map<int, Tensor>();
  static auto* retired = new std::vector<Tensor>();
  std::lock_guard<std::mutex> lock(mu);
  Tensor& buf = (*bufs)[like.get_device()];
  if (buf.defined() && buf.numel() >= n) return buf.data_ptr<int>();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) {
    local = at::zeros({n}, like.options().dtype(at::kInt));
    return local.data_ptr<int>();
  }
  if (buf.defined()) retired->push_back(buf);
  buf = at::zeros({std::max<int64_t>(n, 4096)}, like.options().dtype(at::kInt));
  return buf.data_ptr<int>();
}

Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                        double scale) {
  check_cuda(q, "decode_attention", "q");
  c10::cuda::CUDAGuard guard(q.device());
  const auto dt = dtype_of(q, "decode_attention", "q");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "fw::decode_attention: q, k_cache and v_cache must share a dtype");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(D > 0 && D <= 256 && D % 8 == 0,
              "fw::decode_attention: the CUDA kernel takes a head_dim that is a multiple of 8 up to 256, got ", D);
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0, "fw::decode_attention: Hq must be a multiple of Hk, got ", Hq, " / ", Hk);
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "fw::decode_attention: k_cache and v_cache strides differ");
  auto kc = k_cache.stride(3) == 1 ? k_cache : k_cache.contiguous();
  auto vc = v_cache.stride(3) == 1 && kc.strides() == v_cache.strides() ? v_cache : v_cache.contiguous();
  if (kc.strides() != vc.strides()) kc = kc.contiguous();
  // the kernel copies 16-byte chunks of a row (decode_attention.cu)
  const int64_t vec = 16 / kc.element_size();
  const bool aligned = kc.stride(0) % vec == 0 && kc.stride(1) % vec == 0 && kc.stride(2) % vec == 0 &&
                       reinterpret_cast<uintptr_t>(kc.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(vc.data_ptr()) % 16 == 0;
  if (!aligned) {  // clone: contiguous() would return an already contiguous but misaligned view as is
    kc = kc.clone(at::MemoryFormat::Contiguous);
    vc = vc.clone(at::MemoryFormat::Contiguous);
  }
  auto qc = q.contiguous();
  if (reinterpret_cast<uintptr_t>(qc.data_ptr()) % 16 != 0) qc = qc.clone(at::MemoryFormat::Contiguous);
  auto len = lengths.to(at::kLong).contiguous();
  auto out = at::empty({B, Hq, D}, q.options());
  if (B == 0 || Hq == 0) return out;  // nothing to attend (and no blocks to split over)
  const fw::DecodePlan plan = fw::decode_attention_plan(dt, (int)B, (int)Hq, (int)Hk, (int)S, (int)D, sm_count());
  const int splits = plan.splits;
  auto stream = at::cuda::getCurrentCUDAStream();
  fw::DecodeWorkspace w{nullptr, nullptr, nullptr, nullptr};
  Tensor ws, local_counters;
  if (splits > 1) {
    const int64_t parts = B * Hq * splits;
    ws = at::empty({parts * D + 2 * parts}, q.options().dtype(at::kFloat));
    float* base = ws.data_ptr<float>();
    w = {base, base + parts * D, base + parts * D + parts,
         decode_counters(B * Hk * plan.groups, q, stream, local_counters)};
  }
  check_launch(fw::decode_attention(dt, qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), len.data_ptr<int64_t>(),
                                    out.data_ptr(), w, (int)B, (int)Hq, (int)Hk, (int)S, (int)D, kc.stride(0),
                                    kc.stride(1), kc.stride(2), plan, (float)scale, stream),
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
