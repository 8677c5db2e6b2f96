// The fused linear + logprob: its row kernels, for every GPU and dtype that the Hopper kernel
// (linear_logprob_sm90.cuh, which does the same chunk work on the GEMM's accumulators) does not take, the merge for
// both, the backward from kept logits, and the host wrappers with their cuBLAS tiling (gemm.cpp).
// The host walks the [N, V] logits in tiles of n rows x vc vocabulary columns: it computes a fp32
// tile z = hidden_rows @ weight_cols.T / temperature with cuBLAS (row i of the tile is contiguous, vc floats), then:
// forward: a warp per chunk of kLogprobChunk columns of a row computes that chunk's logsumexp partial with the
// entropy term (and the target's logit when the chunk holds it), optionally keeping the chunk in fp16 for the
// backward; after the row tile's last vocabulary tile one warp per row merges its partials into the outputs;
// backward: dz written in the GEMM dtype for the two gradient GEMMs, from the saved lse and entropy and either a
// recomputed fp32 tile or the kept fp16 logits.
// Exponentials are ex2.approx (one MUFU op, 2 ulp) of an FFMA: with expf and a NaN test per element the forward
// row kernel is bound by its arithmetic rather than by DRAM (`python -m benchmarks.ops.profile_ops linear_logprob`).
// The per-element maths below is shared by the row kernels over cuBLAS tiles and the Hopper kernel, so both give
// the same values from the same logits.
// Partial state of a logsumexp: m (max), s = sum 2^((z-m) log2 e), a = sum 2^(..) (z-m) log2 e, so that
// lse = m + ln s and entropy = ln s - ln 2 * a/s, with no cancellation against m.
#include <cstdio>
#include <cstdlib>
#include <tuple>
#include <vector>

#include "common.cuh"
#include "gemm.h"
#include "torch_utils.h"

namespace fw {

// The fused linear + logprob walks the logits in fp32 tiles z [n, vc] (already divided by the temperature):
// rows n0.. of the batch, vocabulary columns v0 .. v0 + vc of V, v0 a multiple of kLogprobChunk; row i of a tile
// is contiguous (vc floats). Forward: each chunk of kLogprobChunk columns of a row leaves its logsumexp partial
// (m, s, a) in LogprobParts (row i, column v0 / kLogprobChunk + chunk; row stride ld = ceil(V / kLogprobChunk))
// and the chunk holding the target its logit in target_z[i]; logprob_merge then combines a row's partials into
// logprob, entropy and lse (pointers at the row tile's first row). Negative target: logprob 0; target >= V: NaN.
// Kept logits (z16 set): the tile also goes to z16 + i * z16_ld in fp16 as z minus its chunk's m, so parts.m
// doubles as the offsets that the backward adds back.
// 256: the column block of the Hopper kernel below, whose partials and kept-logit offsets must be the row
// kernels' too, so that both paths keep the same logits and the kept and recomputing forwards agree bit for bit.
constexpr int64_t kLogprobChunk = 256;
struct LogprobParts {
  float* m;
  float* s;
  float* a;
  int64_t ld;
  float* target_z;
};
cudaError_t logprob_chunks_fwd(const float* z, int64_t n, int64_t vc, int64_t v0, const int64_t* targets,
                               LogprobParts parts, void* z16, int64_t z16_ld, cudaStream_t stream);
cudaError_t logprob_merge(LogprobParts parts, int64_t n, int64_t V, const int64_t* targets, float* logprob,
                          float* entropy, float* lse, cudaStream_t stream);
// The kept logits as the backward reads them: row i of the tile at z16 + i * ld (fp16), the offset of its chunk
// of kLogprobChunk columns at off[i * off_ld + column / kLogprobChunk] (pointers at the tile's first row and
// column). z16 == nullptr: none.
struct SavedLogits {
  const void* z16;
  int64_t ld;
  const float* off;
  int64_t off_ld;
};
// d(loss)/dz for a tile, written in dtype dt into g [n, vc] (the 1/temperature is left to the caller), from the
// fp32 tile z (row stride vc) or, when saved.z16 is set, from the kept logits (z ignored).
cudaError_t logprob_tile_bwd(DType dt, const float* z, SavedLogits saved, int64_t n, int64_t vc, int64_t v0,
                             const int64_t* targets, const float* lse, const float* entropy,
                             const float* grad_logprob, const float* grad_entropy, void* g, cudaStream_t stream);

// The same on Hopper (sm_90a, linear_logprob_sm90.cuh), with the row work done on the GEMM's accumulators: hidden
// [n, K] and weight [vc, K] row-major 16-bit, 16-byte aligned, K a multiple of 8. The forward covers the whole
// vocabulary (V columns) in one launch and leaves the partials of every chunk as logprob_chunks_fwd does (parts.ld
// = ceil(V / kLogprobChunk)), with the kept logits in z16 (row stride z16_ld) when z16 is set; the backward writes
// d(loss)/dz of columns v0 .. v0 + vc into g [n, vc] as logprob_tile_bwd does.
// Whether that kernel runs here: compute capability 9.0, 16-bit operands, the shapes above, and not turned off
// with FW_LOGPROB_SM90=0 (read per call; the benchmark's and tests' A/B against the cuBLAS tiles).
bool linear_logprob_sm90_supported(DType dt, int cc_major, int cc_minor, int64_t K, const void* h, const void* w);
cudaError_t linear_logprob_sm90_fwd(DType dt, const void* h, const void* w, int64_t n, int64_t V, int64_t K,
                                    float inv_t, const int64_t* targets, LogprobParts parts, void* z16,
                                    int64_t z16_ld, int sm_count, cudaStream_t stream);
cudaError_t linear_logprob_sm90_bwd(DType dt, const void* h, const void* w, int64_t n, int64_t vc, int64_t K,
                                    int64_t v0, float inv_t, const int64_t* targets, const float* lse,
                                    const float* entropy, const float* grad_logprob, const float* grad_entropy,
                                    void* g, int sm_count, cudaStream_t stream);

constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float ex2(float x) {  // 2^x; -inf and x < -126 give 0, NaN stays NaN
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// max that returns NaN when either side is NaN (fmaxf returns the other side, which hid an all-NaN chunk).
__device__ __forceinline__ float max_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// A kept logit: z minus its chunk's max m in fp16's range; one below it is stored as -65504 (its exponential is
// 0 either way, and the entropy term then stays 0 * finite).
__device__ __forceinline__ float kept_logit(float z, float m) {
  const float y = z - m;
  return y < -65504.f ? -65504.f : y;
}

// One logit's terms of s and a against the shift mk = m log2 e: (z - m) log2 e is floored at -200 so that a
// column past the end (z = -inf) adds 0 * -200 to a, not NaN.
__device__ __forceinline__ void lse_add(float z, float mk, float& s, float& a) {
  const float d = max_nan(fmaf(z, kLog2e, -mk), -200.f), e = ex2(d);
  s += e;
  a = fmaf(e, d, a);
}

// d(loss)/dz of one logit z (before the 1/temperature the caller applies): glp (onehot - p) - gH p (log p + H)
// with log p = z + c and p = 2^(z log2 e + ck), c = -lse (plus the kept logits' chunk offset), ck = c log2 e;
// the caller adds glp at the target's column. A -inf logit (p = 0, log p = -inf) gets 0, the limit of p log p,
// where the product would be NaN.
__device__ __forceinline__ float dlogit(float z, float c, float ck, float glp, float gH, float H) {
  const float logp = z + c, p = ex2(fmaf(z, kLog2e, ck));
  return p == 0.f ? 0.f : -glp * p - gH * p * (logp + H);
}

}  // namespace fw

namespace fw {
namespace {

constexpr int kThreads = 256;

struct Lse {
  float m, s, a;
};

__device__ __forceinline__ Lse lse_merge(Lse x, Lse y) {
  if (y.s == 0.f) return x;
  if (x.s == 0.f) return y;
  if (y.m > x.m) {
    Lse t = x;
    x = y;
    y = t;
  }
  const float d = (y.m - x.m) * kLog2e, sc = ex2(d);  // a NaN m or s makes s and a NaN, hence the outputs
  return {x.m, x.s + y.s * sc, x.a + sc * (y.a + y.s * d)};
}

// One warp per (row, chunk of kLogprobChunk columns), four independent warps a block (no block synchronisation,
// so the warps' load and arithmetic phases overlap): each lane loads its kLogprobChunk / 32 floats before using any,
// the warp takes the chunk's max with shuffles, then sums the exponentials against it, so no running max is
// rescaled.
// SAVE: the chunk also goes out in fp16 as z - max (kept_logit).
// Independent warps read the fp32 tile faster than a block a row, with per-thread running maxima or with the whole
// tile row in registers (`python -m benchmarks.ops.profile_ops linear_logprob_recomp` shows this kernel's time).
constexpr int kChunkWarps = 4;

template <int VEC, bool SAVE>
__global__ void __launch_bounds__(kChunkWarps * 32)
logprob_chunk_fwd_kernel(const float* __restrict__ z, int64_t n, int64_t vc, int64_t v0,
                         const int64_t* __restrict__ targets, LogprobParts parts, __half* __restrict__ z16,
                         int64_t z16_ld, bool z16_vec) {
  constexpr int CH = (int)kLogprobChunk / 32 / VEC;  // vectors a lane
  const int lane = threadIdx.x & 31;
  const int64_t per_row = (vc + kLogprobChunk - 1) / kLogprobChunk;
  const int64_t w = (int64_t)blockIdx.x * kChunkWarps + (threadIdx.x >> 5);
  if (w >= n * per_row) return;
  const int64_t row = w / per_row, c = w - row * per_row, c0 = c * kLogprobChunk;
  const float* zr = z + row * vc;
  float x[CH][VEC];
#pragma unroll
  for (int k = 0; k < CH; ++k) {
    const int64_t i = c0 + (k * 32 + lane) * VEC;
    Vec<float, VEC> v;
    if (i < vc) v = load_vec<float, VEC>(zr + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) x[k][j] = i < vc ? v.v[j] : -INFINITY;  // past the end: weight 0
  }
  float mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < CH; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) mx = max_nan(mx, x[k][j]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const float m = mx == -INFINITY ? 0.f : mx, mk = m * kLog2e;  // a chunk of -inf only: shift 0
  float s = 0.f, a = 0.f;
#pragma unroll
  for (int k = 0; k < CH; ++k) {
    float sh[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      lse_add(x[k][j], mk, s, a);
      sh[j] = kept_logit(x[k][j], m);
    }
    if constexpr (SAVE) {
      const int64_t i = c0 + (k * 32 + lane) * VEC;
      __half* out = z16 + row * z16_ld + i;
      if (i < vc && z16_vec) {
        store_vec<__half, VEC>(out, vec_from_f<__half, VEC>(sh));
      } else if (i < vc) {  // kept rows not 8-byte aligned (V not a multiple of 4): one fp16 at a time
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = __float2half_rn(sh[j]);
      }
    }
  }
  const int64_t tin = targets[row] - v0 - c0;  // the target's column in this chunk (maybe outside it)
  if (tin >= 0 && tin < kLogprobChunk) {       // the same for the whole warp
    const int tl = (int)tin - lane * VEC;
#pragma unroll
    for (int k = 0; k < CH; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (k * 32 * VEC + j == tl) parts.target_z[row] = x[k][j];
  }
  s = warp_sum(s);
  a = warp_sum(a);
  if (lane == 0) {
    const int64_t p = row * parts.ld + v0 / kLogprobChunk + c;
    parts.m[p] = m;
    parts.s[p] = s;
    parts.a[p] = a;
  }
}

// One warp per row: its ld partials merged (each lane a strided share, then the lanes), the outputs written.
__global__ void __launch_bounds__(256)
logprob_merge_kernel(LogprobParts parts, int64_t n, int64_t V, const int64_t* __restrict__ targets,
                     float* __restrict__ logprob, float* __restrict__ entropy, float* __restrict__ lse) {
  const int64_t row = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5);
  if (row >= n) return;
  const int lane = threadIdx.x & 31;
  Lse t{0.f, 0.f, 0.f};  // s == 0: nothing seen yet
  for (int64_t p = row * parts.ld + lane, end = (row + 1) * parts.ld; p < end; p += 32)
    t = lse_merge(t, Lse{parts.m[p], parts.s[p], parts.a[p]});
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Lse other{__shfl_xor_sync(0xffffffffu, t.m, o), __shfl_xor_sync(0xffffffffu, t.s, o),
              __shfl_xor_sync(0xffffffffu, t.a, o)};
    t = lse_merge(t, other);
  }
  if (lane != 0) return;
  const int64_t tg = targets[row];
  const float log_s = logf(t.s), l = t.m + log_s;
  lse[row] = l;
  entropy[row] = log_s - kLn2 * t.a / t.s;
  logprob[row] = tg < 0 ? 0.f : (tg >= V ? __int_as_float(0x7fc00000) : parts.target_z[row] - l);
}

// g = glp * (onehot - p) - gH * p * (log p + H), p = exp(z - lse); an ignored target (< 0) has glp = 0.
// Row i of the tile: vc columns starting at global column v0, read from z + i * ld and shifted by their chunk's
// off[i * off_ld + column / kLogprobChunk] when off is set (the kept fp16 logits); g is [n, vc].
template <typename Z, typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
logprob_tile_bwd_kernel(const Z* __restrict__ z, int64_t ld, const float* __restrict__ off, int64_t off_ld,
                        int64_t vc, int64_t v0, const int64_t* __restrict__ targets, const float* __restrict__ lse,
                        const float* __restrict__ entropy, const float* __restrict__ grad_logprob,
                        const float* __restrict__ grad_entropy, T* __restrict__ g) {
  const int64_t row = blockIdx.x;
  const Z* zr = z + row * ld;
  T* gr = g + row * vc;
  const int64_t tg = targets[row] - v0;  // the target's column in this tile (maybe outside it)
  const float l = lse[row], H = entropy[row];
  const float gH = grad_entropy[row], glp = targets[row] < 0 ? 0.f : grad_logprob[row];
  for (int64_t i = (int64_t)threadIdx.x * VEC; i < vc; i += (int64_t)kThreads * VEC) {
    // log p = z - lse, z = the kept value + its chunk's offset (a VEC-wide vector never straddles two chunks)
    const float c = (off ? off[row * off_ld + i / kLogprobChunk] : 0.f) - l, ck = c * kLog2e;
    const Vec<Z, VEC> v = load_vec<Z, VEC>(zr + i);
    float o[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      o[j] = dlogit(to_f(v.v[j]), c, ck, glp, gH, H);
      if (i + j == tg) o[j] += glp;
    }
    store_vec<T, VEC>(gr + i, vec_from_f<T, VEC>(o));
  }
}

}  // namespace

cudaError_t logprob_chunks_fwd(const float* z, int64_t n, int64_t vc, int64_t v0, const int64_t* targets,
                               LogprobParts parts, void* z16, int64_t z16_ld, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (v0 % kLogprobChunk) return cudaErrorInvalidValue;
  const bool save = z16 != nullptr;
  // 4 columns a load whether or not the logits are kept (the same sums, so the same outputs bit for bit), and
  // 4 fp16 (8 bytes) a store where the kept rows allow it
  const bool vec4 = vc % 4 == 0 && aligned16(z);
  const bool z16_vec = vec4 && z16_ld % 4 == 0 && (reinterpret_cast<uintptr_t>(z16) & 7u) == 0;
  const int64_t warps = n * ((vc + kLogprobChunk - 1) / kLogprobChunk);
  const unsigned blocks = (unsigned)((warps + kChunkWarps - 1) / kChunkWarps);
  auto launch = [&](auto kernel) {
    return launch_plain(kernel, blocks, kChunkWarps * 32, 0, stream, z, n, vc, v0, targets, parts,
                        static_cast<__half*>(z16), z16_ld, z16_vec);
  };
  if (save) return vec4 ? launch(logprob_chunk_fwd_kernel<4, true>) : launch(logprob_chunk_fwd_kernel<1, true>);
  return vec4 ? launch(logprob_chunk_fwd_kernel<4, false>) : launch(logprob_chunk_fwd_kernel<1, false>);
}

cudaError_t logprob_merge(LogprobParts parts, int64_t n, int64_t V, const int64_t* targets, float* logprob,
                          float* entropy, float* lse, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return launch_plain(logprob_merge_kernel, (unsigned)((n + 7) / 8), 256, 0, stream, parts, n, V, targets, logprob,
                      entropy, lse);
}

cudaError_t logprob_tile_bwd(DType dt, const float* z, SavedLogits saved, int64_t n, int64_t vc, int64_t v0,
                             const int64_t* targets, const float* lse, const float* entropy,
                             const float* grad_logprob, const float* grad_entropy, void* g, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    auto launch = [&](auto kernel, auto zp, int64_t ld, const float* off) {
      return launch_plain(kernel, (unsigned)n, kThreads, 0, stream, zp, ld, off, saved.off_ld, vc, v0, targets, lse,
                          entropy, grad_logprob, grad_entropy, (T*)g);
    };
    // 16 bytes a load and a store where aligned (g's rows are vc elements of T)
    if (saved.z16) {
      const __half* zh = static_cast<const __half*>(saved.z16);
      bool vec8 = false;  // 8 fp16 in, 8 T out: 16-byte accesses when T is 16-bit (the only kind that keeps logits)
      if constexpr (sizeof(T) == 2) vec8 = vc % 8 == 0 && saved.ld % 8 == 0 && aligned16(zh) && aligned16(g);
      if constexpr (sizeof(T) == 2)
        if (vec8) return launch(logprob_tile_bwd_kernel<__half, T, 8>, zh, saved.ld, saved.off);
      return launch(logprob_tile_bwd_kernel<__half, T, 1>, zh, saved.ld, saved.off);
    }
    if (vc % 4 == 0 && aligned16(z) && aligned16(g))
      return launch(logprob_tile_bwd_kernel<float, T, 4>, z, vc, nullptr);
    return launch(logprob_tile_bwd_kernel<float, T, 1>, z, vc, nullptr);
  });
}

}  // namespace fw

#include "linear_logprob_sm90.cuh"

namespace {

// ------------------------------------------------------------------ linear + logprob
// The logits are walked in fp32 tiles of kTileRows rows x kTileCols vocabulary columns; both are
// overridable with FW_LOGPROB_TILE="rows,cols" (benchmarks/ops/sweep.sh). The backward walks vocabulary tiles
// outside and row tiles inside, so a tile's grad_weight rows are finished (accumulated in a [cols, d] fp32
// buffer) before the next tile starts, and grad_hidden accumulates in fp32 across vocabulary tiles.
// The default tile is about as fast as whole-vocabulary row chunks in a fraction of their memory; smaller tiles
// are slower (`bash benchmarks/ops/sweep.sh logprob` times the alternatives).
// On Hopper the forward needs no tile (linear_logprob_sm90.cuh) and the backward's tile is the 16-bit dz alone,
// so it takes twice the rows (kSm90TileRows) for the same memory.
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
  bool sm90;                    // the Hopper kernel (linear_logprob_sm90.cuh) computes the logits, not cuBLAS tiles
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

// Whether the forward keeps the logits for the backward: asked for and 16-bit operands (as saves_logits in
// ops_cuda/linear_logprob.py).
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
                                                   const Tensor& offsets, double temperature, int64_t save_chunk,
                                                   bool weight_grad) {
  c10::cuda::CUDAGuard guard(hidden.device());
  auto a = linear_args(hidden, weight, targets, "linear_logprob_backward");
  const auto dt = a.dt;
  auto t = targets.to(at::kLong).contiguous();
  auto glp = grad_logprob.to(at::kFloat).contiguous(), gent = grad_entropy.to(at::kFloat).contiguous();
  auto l = lse.to(at::kFloat).contiguous(), H = entropy.to(at::kFloat).contiguous();
  // Without weight_grad (a frozen weight) grad_W is empty and its GEMM, buffer and copies are skipped.
  auto gw = weight_grad ? at::empty({a.V, a.d}, weight.options()) : at::empty({0}, weight.options());
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
  Tensor gw_acc = gw_direct || !weight_grad ? Tensor() : at::empty({a.cols, a.d}, a.h.options().dtype(at::kFloat));
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
    void* gw_out = !weight_grad ? nullptr
                   : gw_direct  ? static_cast<void*>(static_cast<char*>(gw.data_ptr()) + v0 * a.d * es)
                                : gw_acc.data_ptr();
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
      if (weight_grad)
        fw::gemm(CUBLAS_OP_N, CUBLAS_OP_T, a.d, vc, n, inv_t, hs, ht, a.d, gtile.data_ptr(), ht, vc,
                 n0 == 0 ? 0.f : 1.f, gw_out, gw_t, a.d);
    }
    if (weight_grad && !gw_direct) gw.narrow(0, v0, vc).copy_(gw_acc.narrow(0, 0, vc));
  }
  return {one_col_tile ? gh : gh.to(a.h.scalar_type()), gw};
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) {
  m.impl("linear_logprob", &linear_logprob);
  m.impl("linear_logprob_backward", &linear_logprob_backward);
}
