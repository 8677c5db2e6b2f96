// Row kernels of the fused linear + logprob, for every GPU and dtype that logprob_sm90.cu does not take (which
// does the same chunk work on the GEMM's accumulators), the merge for both, and the backward from kept logits.
// The host (bindings.cpp) walks the [N, V] logits in tiles of n rows x vc vocabulary columns: it computes a fp32
// tile z = hidden_rows @ weight_cols.T / temperature with cuBLAS (row i of the tile is contiguous, vc floats), then:
// forward: a warp per chunk of kLogprobChunk columns of a row computes that chunk's logsumexp partial with the
// entropy term (and the target's logit when the chunk holds it), optionally keeping the chunk in fp16 for the
// backward; after the row tile's last vocabulary tile one warp per row merges its partials into the outputs;
// backward: dz written in the GEMM dtype for the two gradient GEMMs, from the saved lse and entropy and either a
// recomputed fp32 tile or the kept fp16 logits.
// Partial state (m, s, a) and the per-element maths: logprob_math.cuh.
// Exponentials are ex2.approx (one MUFU op, 2 ulp) of an FFMA. With expf and a NaN test per element the forward
// row kernel ran at 60% of the SMs' throughput and 58% of DRAM bandwidth (ncu, H200); this form took it from
// 4.67 to 4.20 ms a call of the benchmark (docs/PERFORMANCE.md, run 6).
#include "logprob_math.cuh"

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
// Reading the 4,096 x 8,192 fp32 tile (H200 profiles, docs/PERFORMANCE.md runs 7-8): run 7's kernel, a
// 256-thread block a row with per-thread running maxima, 2.4 TB/s; a block a row holding the whole tile row in
// registers (two block reductions) 2.1 TB/s, 2.3 counting its fp16 stores; this kernel 2.6 TB/s, 3.1 with them.
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
    kernel<<<blocks, kChunkWarps * 32, 0, stream>>>(z, n, vc, v0, targets, parts, static_cast<__half*>(z16), z16_ld,
                                                    z16_vec);
  };
  if (save)
    vec4 ? launch(logprob_chunk_fwd_kernel<4, true>) : launch(logprob_chunk_fwd_kernel<1, true>);
  else
    vec4 ? launch(logprob_chunk_fwd_kernel<4, false>) : launch(logprob_chunk_fwd_kernel<1, false>);
  return cudaGetLastError();
}

cudaError_t logprob_merge(LogprobParts parts, int64_t n, int64_t V, const int64_t* targets, float* logprob,
                          float* entropy, float* lse, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  logprob_merge_kernel<<<(unsigned)((n + 7) / 8), 256, 0, stream>>>(parts, n, V, targets, logprob, entropy, lse);
  return cudaGetLastError();
}

cudaError_t logprob_tile_bwd(DType dt, const float* z, SavedLogits saved, int64_t n, int64_t vc, int64_t v0,
                             const int64_t* targets, const float* lse, const float* entropy,
                             const float* grad_logprob, const float* grad_entropy, void* g, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    auto launch = [&](auto kernel, auto zp, int64_t ld, const float* off) {
      kernel<<<(unsigned)n, kThreads, 0, stream>>>(zp, ld, off, saved.off_ld, vc, v0, targets, lse, entropy,
                                                   grad_logprob, grad_entropy, (T*)g);
    };
    // 16 bytes a load and a store where aligned (g's rows are vc elements of T)
    if (saved.z16) {
      const __half* zh = static_cast<const __half*>(saved.z16);
      bool vec8 = false;  // 8 fp16 in, 8 T out: 16-byte accesses when T is 16-bit (the only kind that keeps logits)
      if constexpr (sizeof(T) == 2) vec8 = vc % 8 == 0 && saved.ld % 8 == 0 && aligned16(zh) && aligned16(g);
      if constexpr (sizeof(T) == 2)
        if (vec8) launch(logprob_tile_bwd_kernel<__half, T, 8>, zh, saved.ld, saved.off);
      if (!vec8) launch(logprob_tile_bwd_kernel<__half, T, 1>, zh, saved.ld, saved.off);
    } else if (vc % 4 == 0 && aligned16(z) && aligned16(g)) {
      launch(logprob_tile_bwd_kernel<float, T, 4>, z, vc, nullptr);
    } else {
      launch(logprob_tile_bwd_kernel<float, T, 1>, z, vc, nullptr);
    }
    return cudaGetLastError();
  });
}

}  // namespace fw
