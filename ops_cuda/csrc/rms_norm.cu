// RMSNorm forward and backward, fp32 accumulation, 16-byte accesses when aligned.
// A row is handled by a group of LANES threads (LANES = 4..256, a power of two) holding NV vectors of VEC
// elements each in registers, so a row is read once.
// Aligned rows of up to 32 x 4 vectors (hidden 1024, QK-norm's 128) take the rows kernels. Forward: groups of at
// most a warp, a few rows in flight per thread, no persistence, x loaded evict-first when the output fits in L2.
// Backward: at most one wave of blocks looping over rows, grad_weight terms added into a shared-memory slice per
// row group and summed over the groups in a fixed order.
// Longer rows take the persistent kernels (one wave, a grid-stride loop over rows, groups of 64 threads or more),
// which load each thread's slice of the weight into registers once and keep the next row's loads in flight while
// the current row is reduced (software prefetch); their backward keeps grad_weight partial sums per thread in
// registers (each thread owns fixed columns) and the row groups of a block add them into one partial row with
// shared-memory atomics (so the last bits of grad_weight may vary from run to run there).
// Groups wider than a warp reduce through shared memory, double-buffered so one barrier per row suffices.
// Either backward leaves a partial row per block, which a second small kernel sums column-wise in a fixed order
// straight into the weight's dtype.
// Rows too long for registers (or unaligned) take the NV == 0 path: VEC-wide loops over the row, twice.
// Launch shapes come from the sweeps of `bash benchmarks/ops/sweep.sh rms`: 2 vectors a thread beat 1 and 4 in
// the persistent kernels; prefetching 2 rows ahead (more registers, fewer resident warps) is slower.
#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "common.cuh"
#include "torch_utils.h"

namespace fw {

// x [rows, D] -> y [rows, D]; weight [D] of wdtype (x's dtype or F32).
// The grid is one wave of resident blocks (sm_count SMs) looping over the rows; l2_bytes (the device's L2)
// decides whether the rows kernel loads x evict-first.
cudaError_t rms_norm_fwd(DType dt, DType wdt, const void* x, const void* w, void* y, int64_t rows, int D,
                         float eps, int sm_count, int64_t l2_bytes, cudaStream_t stream);
// gx [rows, D] (x's dtype), gw [D] (wdt); gw_partial [max_blocks, D] fp32 scratch: one partial row per block of
// the main kernel (one wave of resident blocks), summed by a second kernel.
int rms_norm_bwd_max_blocks(int sm_count);
cudaError_t rms_norm_bwd(DType dt, DType wdt, const void* grad, const void* x, const void* w, void* gx,
                         void* gw, float* gw_partial, int max_blocks, int64_t rows, int D, float eps,
                         int sm_count, cudaStream_t stream);

}  // namespace fw

namespace fw {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <int N> using Int = std::integral_constant<int, N>;

// (a, b) summed over the LANES threads of this thread's row group; every thread of the block must call it the
// same number of times (groups wider than a warp meet at a barrier). `red` is [2][kWarps], `parity` alternates.
template <int LANES>
__device__ __forceinline__ float2 group_sum2(float a, float b, float2 (*red)[kWarps], int parity) {
  constexpr int kWidth = LANES < 32 ? LANES : 32;
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  if constexpr (LANES > 32) {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) red[parity][warp] = make_float2(a, b);
    __syncthreads();
    constexpr int kPer = LANES / 32;
    const int first = (warp / kPer) * kPer;
    a = 0.f;
    b = 0.f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const float2 v = red[parity][first + k];
      a += v.x;
      b += v.y;
    }
  }
  return make_float2(a, b);
}

// Resident blocks of `kernel` per SM, in blocks of kThreads (at least 1).
template <typename K> int resident_per_sm(K kernel, size_t smem) {
  return resident_blocks((const void*)kernel, kThreads, smem);
}

// One wave of resident blocks, or fewer when `rows` need fewer blocks of `rows_per_block` rows; at least one.
int64_t persistent_blocks(int per_sm, int sm_count, int64_t rows, int rows_per_block) {
  const int64_t wave = (int64_t)sm_count * per_sm, need = (rows + rows_per_block - 1) / rows_per_block;
  return need < wave ? (need > 0 ? need : 1) : wave;
}

// The thread's slice of a row in registers: NV vectors, vector n at element (n * LANES + sub) * VEC.
// kFull: D == LANES * NV * VEC, so no vector lies past the end of the row.
template <typename T, int VEC, int LANES, int NV> struct RowSlice {
  Vec<T, VEC> v[NV];
  // kOnce: evict-first loads with the L2 policy pol (load_vec_evict_first)
  template <bool kFull = false, bool kOnce = false>
  __device__ __forceinline__ void load(const T* row, int sub, int D, bool active, uint64_t pol = 0) {
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int i = (n * LANES + sub) * VEC;
      if (active && (kFull || i < D))
        v[n] = kOnce ? load_vec_evict_first<T, VEC>(row + i, pol) : load_vec<T, VEC>(row + i);
      else v[n] = Vec<T, VEC>{};  // an inactive row's sums are never used, but are defined
    }
  }
};

// VEC weights from w (16-byte aligned) in their dtype, read in 16-byte pieces.
template <typename W, int VEC> __device__ __forceinline__ Vec<W, VEC> load_weight_vec(const W* w) {
  constexpr int P = (16 / (int)sizeof(W)) < VEC ? 16 / (int)sizeof(W) : VEC;
  Vec<W, VEC> out;
#pragma unroll
  for (int j0 = 0; j0 < VEC; j0 += P) {
    const Vec<W, P> piece = load_vec<W, P>(w + j0);
#pragma unroll
    for (int j = 0; j < P; ++j) out.v[j0 + j] = piece.v[j];
  }
  return out;
}

// The thread's slice of the weight, as floats, read in 16-byte pieces (w is 16-byte aligned, D % VEC == 0). (Not
// written with load_weight_vec: with fp32 weights that gave the persistent kernels up to 2 more registers.)
template <typename W, int VEC, int LANES, int NV>
__device__ __forceinline__ void load_weight(float (&wf)[NV][VEC], const W* w, int sub, int D) {
  constexpr int P = (16 / (int)sizeof(W)) < VEC ? 16 / (int)sizeof(W) : VEC;
#pragma unroll
  for (int n = 0; n < NV; ++n) {
    const int i = (n * LANES + sub) * VEC;
#pragma unroll
    for (int j0 = 0; j0 < VEC; j0 += P) {
      Vec<W, P> piece{};
      if (i < D) piece = load_vec<W, P>(w + i + j0);
#pragma unroll
      for (int j = 0; j < P; ++j) wf[n][j0 + j] = to_f(piece.v[j]);
    }
  }
}

// Rows whose loads are in flight ahead of the row being reduced.
constexpr int PF = 1;

// NV > 0: the row lives in registers (D <= LANES * VEC * NV), and the loads of the next PF rows are in flight
// while a row is reduced; NV == 0: loop over the row twice.
template <typename T, typename W, int VEC, int LANES, int NV>
__global__ void __launch_bounds__(kThreads)
rms_norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ w, T* __restrict__ y, int64_t rows, int D,
                    float eps, unsigned trigger_from) {
  pdl_begin(trigger_from);
  __shared__ float2 red[2][kWarps];
  constexpr int kGroups = kThreads / LANES;
  const int sub = threadIdx.x % LANES;
  const int64_t stride = (int64_t)gridDim.x * kGroups;
  const int64_t first = (int64_t)blockIdx.x * kGroups + threadIdx.x / LANES;
  const int64_t iters = (rows + stride - 1) / stride;  // the same for every thread: barriers stay uniform
  if constexpr (NV > 0) {
    float wf[NV][VEC];
    load_weight<W, VEC, LANES, NV>(wf, w, sub, D);
    RowSlice<T, VEC, LANES, NV> xs[PF + 1];  // xs[0]: this iteration's row; xs[k]: k rows ahead, in flight
#pragma unroll
    for (int k = 0; k < PF; ++k) {
      const int64_t r = first + k * stride;
      xs[k].load(x + r * D, sub, D, k < iters && r < rows);
    }
    for (int64_t it = 0; it < iters; ++it) {
      const int64_t row = first + it * stride, ahead = row + PF * stride;
      xs[PF].load(x + ahead * D, sub, D, it + PF < iters && ahead < rows);
      const RowSlice<T, VEC, LANES, NV>& cur = xs[0];
      float ss = 0.f;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        if ((n * LANES + sub) * VEC < D)
#pragma unroll
          for (int j = 0; j < VEC; ++j) ss += to_f(cur.v[n].v[j]) * to_f(cur.v[n].v[j]);
      }
      const float r = rsqrtf(group_sum2<LANES>(ss, 0.f, red, it & 1).x / D + eps);
      if (row < rows) {
#pragma unroll
        for (int n = 0; n < NV; ++n) {
          const int i = (n * LANES + sub) * VEC;
          if (i < D) {
            float o[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) o[j] = to_f(cur.v[n].v[j]) * r * wf[n][j];
            store_vec<T, VEC>(y + row * D + i, vec_from_f<T, VEC>(o));
          }
        }
      }
#pragma unroll
      for (int k = 0; k < PF; ++k) xs[k] = xs[k + 1];
    }
  } else {
    for (int64_t it = 0; it < iters; ++it) {
      const int64_t row = first + it * stride;
      const bool active = row < rows;
      const T* xr = x + (active ? row : 0) * D;
      float ss = 0.f;
      if (active)
        for (int i = sub * VEC; i < D; i += LANES * VEC) {
          Vec<T, VEC> v = load_vec<T, VEC>(xr + i);
#pragma unroll
          for (int j = 0; j < VEC; ++j) ss += to_f(v.v[j]) * to_f(v.v[j]);
        }
      const float r = rsqrtf(group_sum2<LANES>(ss, 0.f, red, it & 1).x / D + eps);
      if (active)
        for (int i = sub * VEC; i < D; i += LANES * VEC) {  // the second read of the row hits L1/L2
          Vec<T, VEC> v = load_vec<T, VEC>(xr + i);
          float o[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] = to_f(v.v[j]) * r * to_f(w[i + j]);
          store_vec<T, VEC>(y + row * D + i, vec_from_f<T, VEC>(o));
        }
    }
  }
}

// Rows of at most 32 x 4 vectors (the forward's usual case: hidden 1024 and QK-norm's 128 in bf16): a group of
// LANES <= 32 threads per row, so a row reduces with shuffles only (no shared memory, no barrier), and RPT rows
// per group whose loads are all issued before the first reduction; blocks of 64 threads (32 or 128 for sweeps),
// each taking blockDim / LANES * RPT rows, no persistence (the shape of the Triton kernel that
// torch.compile generates for this maths). FULL (rows of exactly LANES * NV vectors: hidden 1024, QK-norm) drops
// the end-of-row tests, so the code is straight-line and the compiler can issue the weight loads together.
constexpr int kRowThreads = 128;  // the largest block of the rows kernel

// Resident blocks of kRowThreads per SM the rows kernel asks the compiler for: 16 (32 registers, full occupancy,
// as in torch.compile's kernel for QK-norm) for the FULL instances with one vector a row, at most 2 rows a thread
// and a weight no wider than x; else 8 (64 registers, half occupancy or more). Other instances spill at 32
// (nvcc -Xptxas -v). QK-norm's instance is as fast with a looser cap (`python -m benchmarks.ops.bench_ops --only
// rms_norm`).
template <typename T, typename W, int NV, int RPT, bool FULL> constexpr int rows_min_blocks() {
  return FULL && NV == 1 && RPT <= 2 && sizeof(W) <= sizeof(T) ? 16 : 8;
}

template <typename T, typename W, int VEC, int LANES, int NV, int RPT, bool FULL, bool ONCE, bool LEAN>
__global__ void __launch_bounds__(kRowThreads, rows_min_blocks<T, W, NV, RPT, FULL>())
rms_norm_fwd_rows_kernel(const T* __restrict__ x, const W* __restrict__ w, T* __restrict__ y, int64_t rows, int D,
                         float eps, unsigned trigger_from) {
  pdl_begin(trigger_from);
  // FULL: the mean divides by the row length as a compile-time constant (a power of two at Qwen3's shapes: an exact
  // multiplication).
  const int Dm = FULL ? LANES * NV * VEC : D;
  // LEAN (FULL rows that fill every block, fewer than 2^31 elements, eps >= FLT_MIN; see launch_fwd_rows): 32-bit
  // offsets and no end-of-rows tests, as in the Triton kernel torch.compile specialises to the row count. Its row
  // offsets use the constant too; the other instances' 64-bit ones keep the runtime D, because with the constant
  // nvcc 13 split QK-norm's 16-byte stores into four 4-byte ones (sm_90a SASS).
  using Idx = std::conditional_t<LEAN, int, int64_t>;
  const Idx Do = LEAN ? Dm : D;  // the row stride
  const int groups = blockDim.x / LANES;
  const int sub = threadIdx.x % LANES;
  const Idx first = (Idx)blockIdx.x * groups * RPT + threadIdx.x / LANES;  // rows first + k * groups
  const uint64_t pol = ONCE ? l2_evict_first_policy() : 0;
  RowSlice<T, VEC, LANES, NV> xs[RPT];
#pragma unroll
  for (int k = 0; k < RPT; ++k) {
    const Idx r = first + (Idx)k * groups;
    // rows past the end read the last row instead (rows > 0), so every load is unconditional: zero-filled
    // (predicated) vectors kept each element in a register of its own (nvcc 13 SASS); their results are not stored
    xs[k].template load<FULL, ONCE>(x + (LEAN || r < (Idx)rows ? r : (Idx)(rows - 1)) * Do, sub, D, true, pol);
  }
  // one vector of the weight a thread (NV 1: QK-norm's rows) is held for all its rows in the weight's dtype (fewer
  // registers than as floats), read after the rows' loads are issued; longer rows read it per row below
  Vec<W, VEC> wv{};
  if constexpr (NV == 1)
    if (FULL || sub * VEC < D) wv = load_weight_vec<W, VEC>(w + sub * VEC);
#pragma unroll
  for (int k = 0; k < RPT; ++k) {
    const Idx row = first + (Idx)k * groups;
    float ss = 0.f;
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      if (FULL || (n * LANES + sub) * VEC < D)
#pragma unroll
        for (int j = 0; j < VEC; ++j) ss += to_f(xs[k].v[n].v[j]) * to_f(xs[k].v[n].v[j]);
    }
    const float ms = group_sum2<LANES>(ss, 0.f, nullptr, 0).x / Dm + eps;
    // LEAN: ms >= eps >= FLT_MIN is never subnormal, so the flush-to-zero rsqrt gives rsqrtf's value without its
    // subnormal scaling (3 instructions a row)
    const float r = LEAN ? rsqrt_approx_ftz(ms) : rsqrtf(ms);
    if (!LEAN && row >= (Idx)rows) continue;
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int i = (n * LANES + sub) * VEC;
      if (FULL || i < D) {
        // longer rows (NV > 1) read the weight here, once per row, from L1 (one row's worth, shared by all rows):
        // held in registers for the whole kernel it made the hidden-1024 instance spill at its 64 registers
        float wf[1][VEC];
        if constexpr (NV == 1) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) wf[0][j] = to_f(wv.v[j]);
        } else {
          load_weight<W, VEC, 1, 1>(wf, w + i, 0, VEC);
        }
        float o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = to_f(xs[k].v[n].v[j]) * r * wf[0][j];
        store_vec<T, VEC>(y + row * Do + i, vec_from_f<T, VEC>(o));
      }
    }
  }
}

// Resident blocks per SM the persistent backward asks the compiler for, by NV: registers capped so that more warps keep loads
// in flight (NV 1: 4 blocks of 256 threads, 64 registers; capping NV 2 at 80 registers spills).
constexpr int kBwdMinBlocks[5] = {1, 4, 1, 1, 1};

// The persistent backward, for rows longer than the rows kernel takes (and unaligned ones): groups of 64 threads
// or more (NV > 0), which meet at a barrier per row and so keep the next row's loads in flight (PF rows ahead).
// gx = r*g*w - x*r^3*mean(g*w*x); grad_weight partial of the block += g*x*r.
template <typename T, typename W, int VEC, int LANES, int NV>
__global__ void __launch_bounds__(kThreads, kBwdMinBlocks[NV])
rms_norm_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ x, const W* __restrict__ w,
                    T* __restrict__ gx, float* __restrict__ gw_partial, int64_t rows, int D, float eps,
                    unsigned trigger_from) {
  pdl_begin(trigger_from);
  extern __shared__ float gw_acc[];  // [D]: the row groups of the block add their partials here
  __shared__ float2 red[2][kWarps];
  constexpr int kGroups = kThreads / LANES;
  for (int i = threadIdx.x; i < D; i += blockDim.x) gw_acc[i] = 0.f;
  __syncthreads();
  const int sub = threadIdx.x % LANES;
  const int64_t stride = (int64_t)gridDim.x * kGroups;
  const int64_t first = (int64_t)blockIdx.x * kGroups + threadIdx.x / LANES;
  const int64_t iters = (rows + stride - 1) / stride;
  if constexpr (NV > 0) {
    float wf[NV][VEC], acc[NV][VEC];
    load_weight<W, VEC, LANES, NV>(wf, w, sub, D);
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[n][j] = 0.f;
    RowSlice<T, VEC, LANES, NV> xs[PF + 1], gs[PF + 1];  // [0]: this iteration's row; [k]: k rows ahead
#pragma unroll
    for (int k = 0; k < PF; ++k) {
      const bool valid = k < iters && first + k * stride < rows;
      xs[k].load(x + (first + k * stride) * D, sub, D, valid);
      gs[k].load(grad + (first + k * stride) * D, sub, D, valid);
    }
    for (int64_t it = 0; it < iters; ++it) {
      const int64_t row = first + it * stride, ahead = row + PF * stride;
      const bool more = it + PF < iters && ahead < rows;
      xs[PF].load(x + ahead * D, sub, D, more);
      gs[PF].load(grad + ahead * D, sub, D, more);
      const RowSlice<T, VEC, LANES, NV>&xc = xs[0], &gc = gs[0];
      float ss = 0.f, dot = 0.f;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        if ((n * LANES + sub) * VEC < D)
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float xf = to_f(xc.v[n].v[j]);
            ss += xf * xf;
            dot += to_f(gc.v[n].v[j]) * wf[n][j] * xf;
          }
      }
      const float2 s = group_sum2<LANES>(ss, dot, red, it & 1);
      if (row < rows) {
        const float r = rsqrtf(s.x / D + eps), c = r * r * r * s.y / D;
#pragma unroll
        for (int n = 0; n < NV; ++n) {
          const int i = (n * LANES + sub) * VEC;
          if (i < D) {
            float o[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
              const float xf = to_f(xc.v[n].v[j]), gf = to_f(gc.v[n].v[j]);
              o[j] = r * gf * wf[n][j] - xf * c;
              acc[n][j] += gf * xf * r;
            }
            store_vec<T, VEC>(gx + row * D + i, vec_from_f<T, VEC>(o));
          }
        }
      }
#pragma unroll
      for (int k = 0; k < PF; ++k) {
        xs[k] = xs[k + 1];
        gs[k] = gs[k + 1];
      }
    }
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int i = (n * LANES + sub) * VEC;
      if (i < D)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if constexpr (kGroups == 1) gw_acc[i + j] = acc[n][j];  // this thread owns the column
          else atomicAdd(&gw_acc[i + j], acc[n][j]);
        }
    }
  } else {
    for (int64_t it = 0; it < iters; ++it) {
      const int64_t row = first + it * stride;
      const bool active = row < rows;
      const T* xr = x + (active ? row : 0) * D;
      const T* gr = grad + (active ? row : 0) * D;
      float ss = 0.f, dot = 0.f;
      if (active)
        for (int i = sub * VEC; i < D; i += LANES * VEC) {
          Vec<T, VEC> xv = load_vec<T, VEC>(xr + i), gv = load_vec<T, VEC>(gr + i);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float xf = to_f(xv.v[j]);
            ss += xf * xf;
            dot += to_f(gv.v[j]) * to_f(w[i + j]) * xf;
          }
        }
      const float2 s = group_sum2<LANES>(ss, dot, red, it & 1);
      if (!active) continue;
      const float r = rsqrtf(s.x / D + eps), c = r * r * r * s.y / D;
      for (int i = sub * VEC; i < D; i += LANES * VEC) {
        Vec<T, VEC> xv = load_vec<T, VEC>(xr + i), gv = load_vec<T, VEC>(gr + i);
        float o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xf = to_f(xv.v[j]), gf = to_f(gv.v[j]);
          o[j] = r * gf * to_f(w[i + j]) - xf * c;
          atomicAdd(&gw_acc[i + j], gf * xf * r);
        }
        store_vec<T, VEC>(gx + row * D + i, vec_from_f<T, VEC>(o));
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < D; i += blockDim.x) gw_partial[(int64_t)blockIdx.x * D + i] = gw_acc[i];
}

// Backward for aligned rows of at most 128 vectors (hidden 1024 and QK-norm's 128 in bf16). The persistent kernel
// above holds the weight and the grad_weight sums in registers (many registers, low occupancy at hidden 1024). Here
// the weight is read from L1 where it is used, and each group of LANES threads adds its grad_weight terms into its
// own slice of shared memory, laid out lane-contiguous in float4s (no atomics; no bank conflicts for groups of 8
// lanes or more, up to 2-way for the 4-lane groups of rows of a few vectors); the block sums its groups'
// slices in a fixed order at the end, so grad_weight is the same from run to run. Groups of at most a warp reduce
// with shuffles, wider ones meet at a barrier per row. Keeping the next row's loads in flight, as the persistent
// kernel does, is no better here, so the kernel does not (`bash benchmarks/ops/sweep.sh rms`).
// Resident blocks asked of the compiler, by NV: the tightest register caps that compile without spills for sm_90,
// 5 / 4 / 3 blocks of 256 threads for 1 / 2 / 4 vectors (48 / 64 / 80 registers; bf16 x with an fp32 weight
// spills 8 bytes at 4 vectors, where 2 blocks would leave too few warps).
constexpr int kBwdRowsMinBlocks[5] = {1, 5, 4, 1, 3};

template <typename T, typename W, int VEC, int LANES, int NV>
__global__ void __launch_bounds__(kThreads, kBwdRowsMinBlocks[NV])
rms_norm_bwd_rows_kernel(const T* __restrict__ grad, const T* __restrict__ x, const W* __restrict__ w,
                         T* __restrict__ gx, float* __restrict__ gw_partial, int64_t rows, int D, float eps,
                         unsigned trigger_from) {
  pdl_begin(trigger_from);
  static_assert(LANES * NV <= 128 && VEC % 4 == 0, "rows kernel: rows of at most 128 vectors, whole float4s");
  constexpr int kGroups = kThreads / LANES, Q = VEC / 4, kSlice = NV * Q * LANES;  // float4s a group
  extern __shared__ float4 slices[];  // [group][NV * Q][LANES]
  __shared__ float2 red[2][kWarps];
  const int sub = threadIdx.x % LANES, group = threadIdx.x / LANES;
  float4* mine = slices + group * kSlice + sub;  // this thread's float4 k at mine[k * LANES]: only it touches them
#pragma unroll
  for (int k = 0; k < NV * Q; ++k) mine[k * LANES] = make_float4(0.f, 0.f, 0.f, 0.f);
  const int64_t stride = (int64_t)gridDim.x * kGroups, first = (int64_t)blockIdx.x * kGroups + group;
  const int64_t iters = (rows + stride - 1) / stride;  // the same for every thread: shuffles and barriers uniform
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t row = first + it * stride;
    const bool active = row < rows;
    RowSlice<T, VEC, LANES, NV> xc, gc;
    xc.load(x + (active ? row : 0) * D, sub, D, active);
    gc.load(grad + (active ? row : 0) * D, sub, D, active);
    float ss = 0.f, dot = 0.f;
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int i = (n * LANES + sub) * VEC;
      if (i < D) {
        float wf[1][VEC];
        load_weight<W, VEC, 1, 1>(wf, w + i, 0, VEC);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xf = to_f(xc.v[n].v[j]);
          ss += xf * xf;
          dot += to_f(gc.v[n].v[j]) * wf[0][j] * xf;
        }
      }
    }
    const float2 s = group_sum2<LANES>(ss, dot, red, it & 1);
    if (active) {
      const float r = rsqrtf(s.x / D + eps), c = r * r * r * s.y / D;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int i = (n * LANES + sub) * VEC;
        if (i < D) {
          float wf[1][VEC], o[VEC], t[VEC];
          load_weight<W, VEC, 1, 1>(wf, w + i, 0, VEC);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float xf = to_f(xc.v[n].v[j]), gf = to_f(gc.v[n].v[j]);
            o[j] = r * gf * wf[0][j] - xf * c;
            t[j] = gf * xf * r;
          }
          store_vec<T, VEC>(gx + row * D + i, vec_from_f<T, VEC>(o));
#pragma unroll
          for (int h = 0; h < Q; ++h) {
            float4 acc = mine[(n * Q + h) * LANES];
            acc.x += t[4 * h];
            acc.y += t[4 * h + 1];
            acc.z += t[4 * h + 2];
            acc.w += t[4 * h + 3];
            mine[(n * Q + h) * LANES] = acc;
          }
        }
      }
    }
  }
  __syncthreads();
  const float* all = reinterpret_cast<const float*>(slices);
  for (int col = threadIdx.x; col < D; col += kThreads) {
    const int v = col / VEC, e = col % VEC;
    const int at = (((v / LANES) * Q + e / 4) * LANES + v % LANES) * 4 + e % 4;  // float index in a slice
    float t = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) t += all[g * kSlice * 4 + at];
    gw_partial[(int64_t)blockIdx.x * D + col] = t;
  }
}

// The persistent kernels' launch shape: picks LANES (threads per row, 64..256) and NV (vectors per thread, 1, 2 or
// 4) for a row of `vecs` vectors and calls launch(Int<LANES>, Int<NV>): LANES grows from 64 until each thread holds
// at most `pref` vectors (or 256 threads); rows longer than 256 * 4 vectors get NV = 0 (the looping path). Fewer
// vectors per thread mean fewer registers but wider groups. (Rows of up to 128 vectors take the rows kernels.)
template <typename L> cudaError_t by_shape(int vecs, int pref, L&& launch) {
  int lanes = 64;
  while (lanes < 256 && lanes * pref < vecs) lanes *= 2;
  const int nv = (vecs + lanes - 1) / lanes;
  auto with_nv = [&](auto lanes_c) -> cudaError_t {
    if (nv <= 1) return launch(lanes_c, Int<1>{});
    if (nv <= 2) return launch(lanes_c, Int<2>{});
    if (nv <= 4) return launch(lanes_c, Int<4>{});
    return launch(Int<256>{}, Int<0>{});
  };
  switch (lanes) {
    case 64: return with_nv(Int<64>{});
    case 128: return with_nv(Int<128>{});
    default: return with_nv(Int<256>{});
  }
}

// Vectors a thread of the rows kernel has in flight, as RPT = this / NV rows (at least 1, at most 4 / NV): 2 is
// the fastest for QK-norm (hidden 1024 runs its 4 vectors of one row in every case). FW_RMS_ROWS_VECS overrides it
// for sweeps (`bash benchmarks/ops/sweep.sh rms`).
int rows_kernel_vecs() {
  static const int v = int_from_env("FW_RMS_ROWS_VECS", 2);
  return v;
}

// Threads per block of the rows kernel: 64, the smallest block as fast as any at hidden 1024 and QK-norm.
// FW_RMS_ROWS_THREADS = 32, 64 or 128 overrides it (`bash benchmarks/ops/sweep.sh rms`).
int rows_block_threads() {
  static const int forced = int_from_env("FW_RMS_ROWS_THREADS", 64);
  return forced == 32 || forced == 128 ? forced : 64;
}

// The rows kernel's FULL instances for rows that fill its groups exactly; FW_RMS_ROWS_FULL = 0 turns them off (A/B).
bool rows_full() {
  static const bool v = int_from_env("FW_RMS_ROWS_FULL", 1) != 0;
  return v;
}

// The rows kernel's LEAN instances (32-bit offsets, no end-of-rows tests, flush-to-zero rsqrt) where they apply;
// FW_RMS_ROWS_LEAN = 0 turns them off (A/B).
bool rows_lean() {
  static const bool v = int_from_env("FW_RMS_ROWS_LEAN", 1) != 0;
  return v;
}

// Whether the rows kernel loads x evict-first (ONCE), as torch.compile's kernel does: when the output fits in L2,
// so that it can stay there for the next op (and for the next replay of a benchmark); an output larger than L2
// gains nothing and keeps plain loads. FW_RMS_LOAD_ONCE = 0 / 1 forces them off / on (A/B:
// `bash benchmarks/ops/sweep.sh rms`).
bool rows_load_once(int64_t out_bytes, int64_t l2_bytes) {
  static const int forced = int_from_env("FW_RMS_LOAD_ONCE", -1);
  return forced >= 0 ? forced != 0 : out_bytes <= l2_bytes;
}

template <typename T, typename W, int VEC>
cudaError_t launch_fwd_rows(const void* x, const void* w, void* y, int64_t rows, int D, float eps, int64_t l2_bytes,
                            cudaStream_t s) {
  const int vecs = D / VEC, nv = vecs <= 32 ? 1 : vecs <= 64 ? 2 : 4;
  const int want = std::min(rows_kernel_vecs() / nv, 4 / nv);  // NV * RPT <= 4 vectors a thread
  const int rpt = want >= 4 ? 4 : want >= 2 ? 2 : 1;
  auto go = [&](auto lanes, auto nv_c, auto rpt_c) -> cudaError_t {
    constexpr int LANES = decltype(lanes)::value, NV = decltype(nv_c)::value, RPT = decltype(rpt_c)::value;
    if constexpr (NV * RPT > 4) {  // never picked (rpt <= 4 / nv above): more would spill at 64 registers
      return cudaErrorInvalidValue;
    } else {
      const bool full = D == LANES * NV * VEC && rows_full();
      const bool once = rows_load_once(rows * D * (int64_t)sizeof(T), l2_bytes);
      const int threads = rows_block_threads();
      const int64_t per_block = (int64_t)threads / LANES * RPT;
      const bool lean = full && rows % per_block == 0 && rows * D <= INT32_MAX && eps >= FLT_MIN && rows_lean();
      auto kernel = lean ? (once ? rms_norm_fwd_rows_kernel<T, W, VEC, LANES, NV, RPT, true, true, true>
                                 : rms_norm_fwd_rows_kernel<T, W, VEC, LANES, NV, RPT, true, false, true>)
                  : full ? (once ? rms_norm_fwd_rows_kernel<T, W, VEC, LANES, NV, RPT, true, true, false>
                                 : rms_norm_fwd_rows_kernel<T, W, VEC, LANES, NV, RPT, true, false, false>)
                         : (once ? rms_norm_fwd_rows_kernel<T, W, VEC, LANES, NV, RPT, false, true, false>
                                 : rms_norm_fwd_rows_kernel<T, W, VEC, LANES, NV, RPT, false, false, false>);
      const int64_t blocks = (rows + per_block - 1) / per_block;
      if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
      return launch_kernel(kernel, (unsigned)blocks, threads, 0, s, (const T*)x, (const W*)w, (T*)y, rows, D, eps);
    }
  };
  auto with_rpt = [&](auto lanes, auto nv_c) -> cudaError_t {
    switch (rpt) {
      case 1: return go(lanes, nv_c, Int<1>{});
      case 2: return go(lanes, nv_c, Int<2>{});
      default: return go(lanes, nv_c, Int<4>{});
    }
  };
  if (nv == 4) return with_rpt(Int<32>{}, Int<4>{});
  if (nv == 2) return with_rpt(Int<32>{}, Int<2>{});
  if (vecs <= 4) return with_rpt(Int<4>{}, Int<1>{});
  if (vecs <= 8) return with_rpt(Int<8>{}, Int<1>{});
  if (vecs <= 16) return with_rpt(Int<16>{}, Int<1>{});
  return with_rpt(Int<32>{}, Int<1>{});
}

template <typename T, typename W>
cudaError_t launch_fwd(const void* x, const void* w, void* y, int64_t rows, int D, float eps, int sm_count,
                       int64_t l2_bytes, cudaStream_t s) {
  constexpr int V16 = 16 / sizeof(T);
  static const int pref = int_from_env("FW_RMS_FWD_PREF", 2);
  if (rows == 0) return cudaSuccess;
  auto go = [&](auto vec, auto lanes, auto nv) -> cudaError_t {
    constexpr int VEC = decltype(vec)::value, LANES = decltype(lanes)::value, NV = decltype(nv)::value;
    auto kernel = rms_norm_fwd_kernel<T, W, VEC, LANES, NV>;
    // queried once per kernel instance: the decode loop calls this ~100 times a step and is host-bound
    static const int per_sm = resident_per_sm(kernel, 0);
    const int64_t blocks = persistent_blocks(per_sm, sm_count, rows, kThreads / LANES);
    return launch_kernel(kernel, (unsigned)blocks, kThreads, 0, s, (const T*)x, (const W*)w, (T*)y, rows, D, eps);
  };
  const bool vec = D % V16 == 0 && aligned16(x) && aligned16(y) && aligned16(w);
  if (vec && D / V16 <= 32 * 4) return launch_fwd_rows<T, W, V16>(x, w, y, rows, D, eps, l2_bytes, s);
  // longer rows: the persistent kernel with groups of 64 threads or more
  if (vec) return by_shape(D / V16, pref, [&](auto lanes, auto nv) { return go(Int<V16>{}, lanes, nv); });
  return go(Int<1>{}, Int<256>{}, Int<0>{});
}

// Vectors a thread of the backward rows kernel aims to hold (its groups grow from 4 lanes until they do, up to
// 128): 2, as fast as any at hidden 1024 and QK-norm. FW_RMS_BWD_ROWS overrides it for sweeps; 0 sends every
// shape to the persistent kernel (A/B runs; `bash benchmarks/ops/sweep.sh rms`).
int bwd_rows_pref() {
  static const int v = int_from_env("FW_RMS_BWD_ROWS", 2);
  return v;
}

// The backward rows kernel's grid gives each row group about this many rows (at least one block, at most one
// wave): fewer blocks, so fewer partial rows to sum, when rows are few. 1, 2, 4 and 8 are about the same at
// hidden 1024 and QK-norm.
constexpr int kBwdRowsMin = 4;

// grad_weight = the column sums of the `blocks` partial rows, in the weight's dtype.
template <typename W> cudaError_t launch_gw(const float* part, int64_t blocks, int D, void* gw, cudaStream_t s) {
  return sum_partial_rows(part, (W*)gw, (W*)nullptr, D, (int)blocks, D, s);
}

template <typename T, typename W, int VEC>
cudaError_t launch_bwd_rows(const void* g, const void* x, const void* w, void* gx, void* gw, float* part,
                            int max_blocks, int64_t rows, int D, float eps, int sm_count, cudaStream_t s) {
  const int vecs = D / VEC, pref = bwd_rows_pref();
  int lanes = 4;
  while (lanes < 128 && (lanes * pref < vecs || lanes * 4 < vecs)) lanes *= 2;
  const int nv = (vecs + lanes - 1) / lanes;  // lanes * nv <= 128: vecs <= 128
  auto go = [&](auto lanes_c, auto nv_c) -> cudaError_t {
    constexpr int LANES = decltype(lanes_c)::value, NV = decltype(nv_c)::value;
    if constexpr (LANES * NV > 128) {  // never picked: no such instance
      return cudaErrorInvalidValue;
    } else {
      auto kernel = rms_norm_bwd_rows_kernel<T, W, VEC, LANES, NV>;
      constexpr size_t smem = (size_t)kThreads * NV * VEC * sizeof(float);  // every group's slice: 32 KB at most
      static const int per_sm = resident_per_sm(kernel, smem);
      int64_t blocks = persistent_blocks(per_sm, sm_count, (rows + kBwdRowsMin - 1) / kBwdRowsMin, kThreads / LANES);
      blocks = blocks < max_blocks ? blocks : max_blocks;
      const cudaError_t e = launch_kernel(kernel, (unsigned)blocks, kThreads, smem, s, (const T*)g, (const T*)x,
                                          (const W*)w, (T*)gx, part, rows, D, eps);
      return e != cudaSuccess ? e : launch_gw<W>(part, blocks, D, gw, s);
    }
  };
  auto with_nv = [&](auto lanes_c) -> cudaError_t {
    if (nv <= 1) return go(lanes_c, Int<1>{});
    if (nv <= 2) return go(lanes_c, Int<2>{});
    return go(lanes_c, Int<4>{});
  };
  switch (lanes) {
    case 4: return with_nv(Int<4>{});
    case 8: return with_nv(Int<8>{});
    case 16: return with_nv(Int<16>{});
    case 32: return with_nv(Int<32>{});
    case 64: return with_nv(Int<64>{});
    default: return with_nv(Int<128>{});
  }
}

template <typename T, typename W>
cudaError_t launch_bwd(const void* g, const void* x, const void* w, void* gx, void* gw, float* part, int max_blocks,
                       int64_t rows, int D, float eps, int sm_count, cudaStream_t s) {
  constexpr int V16 = 16 / sizeof(T);
  static const int pref = int_from_env("FW_RMS_BWD_PREF", 2);
  const size_t smem = (size_t)D * sizeof(float);
  const bool vec = D % V16 == 0 && aligned16(x) && aligned16(g) && aligned16(gx) && aligned16(w);
  if (vec && D / V16 <= 32 * 4 && bwd_rows_pref() > 0)
    return launch_bwd_rows<T, W, V16>(g, x, w, gx, gw, part, max_blocks, rows, D, eps, sm_count, s);
  auto go = [&](auto vec_c, auto lanes, auto nv) -> cudaError_t {
    constexpr int VEC = decltype(vec_c)::value, LANES = decltype(lanes)::value, NV = decltype(nv)::value;
    auto kernel = rms_norm_bwd_kernel<T, W, VEC, LANES, NV>;
    if (smem + sizeof(float2) * 2 * kWarps > 48 * 1024) {  // dynamic + the static reduction buffer
      cudaError_t e = cleared(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      if (e != cudaSuccess) return e;
    }
    // one wave of resident blocks, each taking at least 8 rows (fewer partial rows for the caller to sum)
    int64_t blocks = persistent_blocks(resident_per_sm(kernel, smem), sm_count, (rows + 7) / 8, kThreads / LANES);
    blocks = blocks < max_blocks ? blocks : max_blocks;
    const cudaError_t e = launch_kernel(kernel, (unsigned)blocks, kThreads, smem, s, (const T*)g, (const T*)x,
                                        (const W*)w, (T*)gx, part, rows, D, eps);
    return e != cudaSuccess ? e : launch_gw<W>(part, blocks, D, gw, s);
  };
  if (vec) return by_shape(D / V16, pref, [&](auto lanes, auto nv) { return go(Int<V16>{}, lanes, nv); });
  return go(Int<1>{}, Int<256>{}, Int<0>{});
}

}  // namespace

cudaError_t rms_norm_fwd(DType dt, DType wdt, const void* x, const void* w, void* y, int64_t rows, int D,
                         float eps, int sm_count, int64_t l2_bytes, cudaStream_t stream) {
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    if (wdt == DType::F32) return launch_fwd<T, float>(x, w, y, rows, D, eps, sm_count, l2_bytes, stream);
    if (wdt != dt) return cudaErrorInvalidValue;
    return launch_fwd<T, T>(x, w, y, rows, D, eps, sm_count, l2_bytes, stream);
  });
}

int rms_norm_bwd_max_blocks(int sm_count) { return sm_count * (2048 / kThreads); }

cudaError_t rms_norm_bwd(DType dt, DType wdt, const void* grad, const void* x, const void* w, void* gx,
                         void* gw, float* gw_partial, int max_blocks, int64_t rows, int D, float eps,
                         int sm_count, cudaStream_t stream) {
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    if (wdt == DType::F32)
      return launch_bwd<T, float>(grad, x, w, gx, gw, gw_partial, max_blocks, rows, D, eps, sm_count, stream);
    if (wdt != dt) return cudaErrorInvalidValue;
    return launch_bwd<T, T>(grad, x, w, gx, gw, gw_partial, max_blocks, rows, D, eps, sm_count, stream);
  });
}

}  // namespace fw

namespace {

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

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_backward", &rms_norm_backward);
}
