// Decode attention (one new query token per row) over a KV cache, GQA-aware and split along the context
// (flash-decoding), in one launch.
//
// Block (b, kv head g, head group, split) reads each K/V row of its context slice once for the RP query
// heads of its group. LPP lanes share a row (16-byte chunks: 16 lanes for a bf16 row of 128), so a warp
// takes 32/LPP rows per step and U rows per lane. K/V move through a per-thread ring of kStages stages in
// shared memory with cp.async: each thread reads back only the bytes it copied itself, so the main loop
// needs no barrier, and the bytes in flight (kStages - 1 steps) cost no registers. Online softmax in
// base 2 per query head. With one split the block writes the output; otherwise each split writes its
// partial (max, sum, unnormalised output) to the workspace and the last block of the group to arrive
// (a counter per group, which that block resets to 0 for the next launch) combines them.
//
// Generality: any GQA ratio (RP = 1/2/4/8 heads per block, ceil(R / RP) groups when R > 8 or R is not a
// power of two) and any head_dim that is a multiple of 8 up to 256 (padded to DP = 64/128/256; lanes past
// D copy zeros and write nothing).
//
// Three kernels: the tensor-core kernel for 16-bit caches with head_dim 64 or 128 at 2 or more query heads a kv
// head, where the ring kernel's maths on the CUDA cores bounded it (use_mma), and for every float8 cache (kv8); the
// ring kernel above for the rest.
// The tensor-core maths runs in decode_mma_kernel (a block per (row, kv head, head group, split)) or, on a paged
// cache with many rows, in a persistent kernel (decode_mma_kernel_persistent: co-resident one-warp workers that take
// (row, kv head, head group, chunk) items from a self-resetting counter, each streaming its tiles through one ring
// across items, the last chunk of a row to finish combining the row; use_persist). decode_kernel and
// decode_mma_kernel share the end of a block's work (decode_finish); each has its own split count
// (decode_attention_plan). With packs (rows of one GRPO group, whose prompt blocks are the same blocks), the
// tensor-core kernel reads a pack's shared positions once for up to 16 query heads of several rows
// (decode_mma_kernel<..., kPacked>).
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "common.cuh"
#include "torch_utils.h"

namespace fw {

// q [B, Hq, D] (16-byte aligned); caches addressed as base + b*sb + h*sh + s*ss + d (elements; base 16-byte
// aligned, strides multiples of 16 bytes); out [B, Hq, D]. Any Hq % Hk == 0, D a multiple of 8 up to 256.
// With plan.splits > 1: o/m/l hold the per-split partials and count one int per (b, kv head, head group)
// (B * Hk * plan.groups ints), zero before the launch and left zero after it. With plan.persist: o/m/l hold a
// partial per work item and query head of its group ([plan.slots, min(16, Hq / Hk)] of them) and count
// kDecodeCounterHead + B * Hk * plan.groups ints, zero before the launch and left zero after it.
struct DecodeWorkspace {
  float* o;    // [B, Hq, splits, D]
  float* m;    // [B, Hq, splits]
  float* l;    // [B, Hq, splits]
  int* count;  // [B, Hk, groups]
};
// The persistent kernel's own counters (its item counter and its warps done) ahead of its arrival counters.
constexpr int kDecodeCounterHead = 32;
// How one call runs, decided once (the overrides FW_DECODE_MMA, FW_DECODE_PERSIST, FW_DECODE_PACKS,
// FW_DECODE_SPLITS, FW_DECODE_CHUNK and FW_DECODE_ITEMS are read here, per call): the kernel, the head groups a kv
// head and the splits of the context, or the persistent kernel's grid and work items. The workspace is sized from it.
struct DecodePlan {
  bool mma;    // the tensor-core kernel, else the ring kernel
  int groups;  // query-head groups a kv head, a block each
  int splits;
  bool persist;  // mma as decode_mma_kernel_persistent (splits 1)
  int blocks;    // its grid: one-warp blocks, those co-resident at most; with packs, the tensor-core kernel's blocks
                 // a split (0: one a (row, kv head, head group))
  int slots;     // the work items its workspace holds
  int chunk;     // 16-position tiles a chunk when forced, else 0 (the kernel picks)
  int items;     // the work items a warp it aims for
  bool packs;    // the tensor-core kernel reads the call's packs
};
// A paged cache: position p of row b is at block table[b * stride + (p >> shift)], offset p & (2^shift - 1);
// a block starts sblk elements after the previous one. table null: the cache is contiguous per row (base + b*sb).
struct DecodeTable {
  const int64_t* table;
  int64_t stride;
  int shift;
  int64_t sblk;
};
// kv8: the caches hold float8_e4m3 values (read as exact float16 by the tensor-core kernel, which alone takes them).
// packed: the call comes with packs (see DecodeArgs), which the tensor-core kernel alone reads.
DecodePlan decode_attention_plan(DType dt, int B, int Hq, int Hk, int S, int D, int sm_count, bool paged,
                                 bool kv8 = false, bool packed = false);
cudaError_t decode_attention(DType dt, const void* q, const void* k, const void* v, const int64_t* lengths,
                             void* out, DecodeWorkspace ws, int B, int Hq, int Hk, int S, int D, int64_t sb,
                             int64_t sh, int64_t ss, DecodePlan plan, float scale, cudaStream_t stream,
                             DecodeTable table = {nullptr, 0, 0, 0}, bool kv8 = false,
                             const int64_t* packs = nullptr);

}  // namespace fw

namespace fw {
namespace {

constexpr int kWarps = 4, kThreads = kWarps * 32, kMaxSplits = 64;

// E elements per lane (16 bytes, or DP/32 when a row needs more), NV 16-byte chunks per lane, LPP lanes per
// K/V row, PPW rows per warp step, U rows per lane per step (2 where registers allow: one max/rescale per
// two rows), kStages ring stages (kStages - 1 steps in flight: 128 to 160 bytes a thread).
template <typename T, int DP, int RP> struct DecodeShape {
  static constexpr int kVec = 16 / sizeof(T);
  static constexpr int E = (DP / 32 > kVec) ? DP / 32 : kVec;
  static constexpr int NV = E / kVec;
  static constexpr int LPP = DP / E;
  static constexpr int PPW = 32 / LPP;
  static constexpr int kSlots = kWarps * PPW;
  static constexpr int U = (NV == 1 && RP <= 4) ? 2 : 1;
  static constexpr int kStages = (U == 1 && NV == 1) ? 6 : 3;  // a 24 KB ring in every case
  static constexpr int kStep = kSlots * U;
};


struct DecodeArgs {
  const void* q;
  const void* k;
  const void* v;
  const int64_t* lengths;
  void* out;
  DecodeWorkspace ws;
  int Hq, Hk, R, RG, S, D;
  int64_t sb, sh, ss;
  int splits;
  float scale;
  DecodeTable tbl;
  // Packs of rows that share the start of their contexts (the tensor-core kernel; null elsewhere): [B, 3] int64, row
  // b's (first row of its pack, the pack's rows, shared positions). A pack's rows are consecutive, and their first
  // `shared` positions (the same for all of them) are the same blocks of the pool. See decode_mma_kernel.
  const int64_t* packs;
  int B;  // the rows
};

// Element offset of K/V position p of row b from the row's base (b * sb + head * sh): through the block
// table for a paged cache. The table entry is read once per row copy and stays in L1/L2.
__device__ __forceinline__ int64_t row_offset(const DecodeArgs& a, int b, int64_t p) {
  if (a.tbl.table == nullptr) return p * a.ss;
  const int64_t blk = __ldg(a.tbl.table + (int64_t)b * a.tbl.stride + (p >> a.tbl.shift));
  return blk * a.tbl.sblk + (p & ((1LL << a.tbl.shift) - 1)) * a.ss;
}

// Resident blocks an SM must hold (the register cap, the tightest that compiles without spills for sm_90):
// enough warps to keep K/V bytes in flight.
template <typename T, int DP, int RP> constexpr int min_blocks() {
  return RP == 8 ? (DecodeShape<T, DP, RP>::E == 8 ? 2 : 3) : RP == 4 ? 4 : 8;
}

// The end of a block's work. The warps' states are in red, as [warp][head] maxima, [warp][head] sums and
// [warp][head][DP] unnormalised outputs, and the block is synchronised. With one split the block writes its heads'
// outputs, otherwise its partials; the last block of the group to arrive combines the splits (threadFenceReduction
// pattern). hq0: the group's first query head; nr: its heads; roff: red's row of its first head (a pack's tile holds
// several rows' heads). sm_scale and sm_last are the kernel's own shared
// variables: declared here instead, they change how the compiler schedules the ring kernel's main loop, which is
// then slower at large batches (`python -m benchmarks.ops.decode_splits`).
template <typename T, int RP, int DP, bool kPermuted = false>
__device__ __forceinline__ void decode_finish(const DecodeArgs& a, const float* red, float (&sm_scale)[RP][kMaxSplits],
                                              int& sm_last, int grp, int split, int64_t hq0, int nr, int D,
                                              int roff = 0) {
  const float* red_m = red + roff;
  const float* red_l = red + kWarps * RP + roff;
  const float* red_acc = red + 2 * kWarps * RP + roff * DP;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, splits = a.splits;
  for (int idx = tid; idx < nr * D; idx += kThreads) {
    // red's column c is output dimension d; kPermuted (a float8 cache's tensor-core kernel, D == DP): c = 8j + n holds
    // dimension n * DP / 8 + j (see is_f8), so red is read in order and the outputs are written permuted
    const int r = idx / D, c = idx - r * D, d = kPermuted ? (c & 7) * (DP / 8) + (c >> 3) : c;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, red_m[w * RP + r]);
    const float Ms = M == -INFINITY ? 0.f : M;
    float O = 0.f, L = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(red_m[w * RP + r] - Ms);
      O += red_acc[(w * RP + r) * DP + c] * f;
      L += red_l[w * RP + r] * f;
    }
    const int64_t hq = hq0 + r;
    if (splits == 1) {
      ((T*)a.out)[hq * D + d] = from_f<T>(L > 0.f ? O / L : 0.f);
    } else {
      a.ws.o[(hq * splits + split) * D + d] = O;
      if (d == 0) {
        a.ws.m[hq * splits + split] = M;
        a.ws.l[hq * splits + split] = L;
      }
    }
  }
  if (splits == 1) return;

  // last block of the group to arrive combines the splits (threadFenceReduction pattern)
  __threadfence();  // this block's partials are visible device-wide before its arrival is counted
  __syncthreads();
  if (tid == 0) {
    const int prev = atomicAdd(a.ws.count + grp, 1);
    sm_last = prev == splits - 1;
    if (sm_last) a.ws.count[grp] = 0;  // every split has arrived: ready for the next launch / graph replay
  }
  __syncthreads();
  if (!sm_last) return;
  __threadfence();
  // per head (one warp each): global max over splits, then scale_s = 2^(m_s - M) / L (0 for an empty row)
  for (int r = warp; r < nr; r += kWarps) {
    const int64_t base = (hq0 + r) * splits;
    const float m0 = lane < splits ? __ldcg(a.ws.m + base + lane) : -INFINITY;
    const float m1 = lane + 32 < splits ? __ldcg(a.ws.m + base + lane + 32) : -INFINITY;
    const float M = warp_max(fmaxf(m0, m1)), Ms = M == -INFINITY ? 0.f : M;
    const float c0 = exp2f(m0 - Ms), c1 = exp2f(m1 - Ms);
    const float l0 = lane < splits ? __ldcg(a.ws.l + base + lane) : 0.f;
    const float l1 = lane + 32 < splits ? __ldcg(a.ws.l + base + lane + 32) : 0.f;
    const float L = warp_sum(l0 * c0 + l1 * c1);
    const float inv = L > 0.f ? 1.f / L : 0.f;
    sm_scale[r][lane] = c0 * inv;
    sm_scale[r][lane + 32] = c1 * inv;
  }
  __syncthreads();
  for (int idx = tid; idx < nr * D; idx += kThreads) {
    const int r = idx / D, d = idx - r * D;
    const int64_t hq = hq0 + r;
    const float* po = a.ws.o + hq * splits * D + d;
    float O = 0.f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) O += __ldcg(po + (int64_t)s * D) * sm_scale[r][s];
    ((T*)a.out)[hq * D + d] = from_f<T>(O);
  }
}

template <typename T, int DP, int RP, bool kFullD>
__global__ void __launch_bounds__(kThreads, min_blocks<T, DP, RP>()) decode_kernel(DecodeArgs a) {
  using Sh = DecodeShape<T, DP, RP>;
  constexpr int E = Sh::E, NV = Sh::NV, LPP = Sh::LPP, PPW = Sh::PPW, kSlots = Sh::kSlots, U = Sh::U;
  constexpr int kStages = Sh::kStages;
  constexpr int kStep = Sh::kStep, kVec = Sh::kVec;
  constexpr int kRingBytes = kStages * U * 2 * NV * kThreads * 16;
  constexpr int kRedBytes = kWarps * RP * (DP + 2) * 4;
  __shared__ alignas(16) unsigned char smem[kRingBytes > kRedBytes ? kRingBytes : kRedBytes];
  __shared__ float sm_scale[RP][kMaxSplits];
  __shared__ int sm_last;
  uint4* ring = reinterpret_cast<uint4*>(smem);  // [stage][u][k/v][nv][thread]
  float* red_m = reinterpret_cast<float*>(smem);  // after the loop: [warp][RP] maxima, sums, [warp][RP][DP] acc
  float* red_l = red_m + kWarps * RP;
  float* red_acc = red_l + kWarps * RP;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane % LPP, slot = warp * PPW + lane / LPP;
  const int grp = blockIdx.x, split = blockIdx.y, splits = a.splits;
  const int bg = grp / a.RG, rg = grp - bg * a.RG, b = bg / a.Hk, g = bg - b * a.Hk;
  const int r0 = rg * RP, nr = min(RP, a.R - r0);
  const int D = kFullD ? DP : a.D;
  const bool lane_on = kFullD || sub * E < D;  // E divides D (both multiples of 8, E <= 8)
  const int64_t len = min((int64_t)a.S, a.lengths[b]);
  const int chunk = (a.S + splits - 1) / splits;
  const int64_t s_begin = (int64_t)split * chunk;
  const int64_t s_end = min(len, s_begin + chunk);
  const int steps = s_end > s_begin ? (int)((s_end - s_begin + kStep - 1) / kStep) : 0;
  const float qscale = a.scale * 1.4426950408889634f;  // scores in base 2: exp2f is one MUFU op

  const T* kb = (const T*)a.k + b * a.sb + g * a.sh;
  const T* vb = (const T*)a.v + b * a.sb + g * a.sh;
  // stage t: rows s_begin + t*kStep + u*kSlots + slot; rows past s_end (and lanes past D) copy zeros
  auto issue = [&](int t) {
    if (t < steps) {
      uint4* st = ring + (t % kStages) * (U * 2 * NV * kThreads) + tid;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t p = s_begin + (int64_t)t * kStep + u * kSlots + slot;
        const bool ok = lane_on && p < s_end;
        const int64_t off = ok ? row_offset(a, b, p) + sub * E : 0;
#pragma unroll
        for (int n = 0; n < NV; ++n) {
          cp_async16(st + ((u * 2 + 0) * NV + n) * kThreads, kb + off + n * kVec, ok);
          cp_async16(st + ((u * 2 + 1) * NV + n) * kThreads, vb + off + n * kVec, ok);
        }
      }
    }
    cp_async_commit();  // one group per stage, empty past the end, so the wait count stays fixed
  };
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) issue(t);

  float qf[RP][E], acc[RP][E], m[RP], l[RP];
  const T* qrow = (const T*)a.q + ((int64_t)b * a.Hq + (int64_t)g * a.R + r0) * D + sub * E;
#pragma unroll
  for (int r = 0; r < RP; ++r) {
    const bool on = lane_on && r < nr;
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      Vec<T, kVec> qv;
      if (on) qv = load_vec<T, kVec>(qrow + (int64_t)r * D + n * kVec);
#pragma unroll
      for (int e = 0; e < kVec; ++e) qf[r][n * kVec + e] = on ? to_f(qv.v[e]) * qscale : 0.f;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) acc[r][e] = 0.f;
    m[r] = -INFINITY;
    l[r] = 0.f;
  }

  for (int t = 0; t < steps; ++t) {
    cp_async_wait<kStages - 2>();  // this thread's copies of stage t have landed
    const uint4* st = ring + (t % kStages) * (U * 2 * NV * kThreads) + tid;
    const int64_t p0 = s_begin + (int64_t)t * kStep + slot;
    float dot[U][RP];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      Vec<T, E> kv;
#pragma unroll
      for (int n = 0; n < NV; ++n) reinterpret_cast<uint4*>(&kv)[n] = st[((u * 2 + 0) * NV + n) * kThreads];
#pragma unroll
      for (int r = 0; r < RP; ++r) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) d += qf[r][e] * to_f(kv.v[e]);
        dot[u][r] = d;
      }
    }
#pragma unroll
    for (int o = LPP / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int r = 0; r < RP; ++r) dot[u][r] += __shfl_xor_sync(0xffffffffu, dot[u][r], o);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool valid = p0 + u * kSlots < s_end;
#pragma unroll
      for (int r = 0; r < RP; ++r) dot[u][r] = valid ? dot[u][r] : -INFINITY;
    }
#pragma unroll
    for (int r = 0; r < RP; ++r) {
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, dot[u][r]);
      const float ms = mx == -INFINITY ? 0.f : mx;  // a slot with no row yet: keep exp2 away from inf - inf
      const float c = exp2f(m[r] - ms);
      l[r] *= c;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[r][e] *= c;
      m[r] = mx;
#pragma unroll
      for (int u = 0; u < U; ++u) dot[u][r] = exp2f(dot[u][r] - ms);  // weight; 0 for an invalid row
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      Vec<T, E> vv;  // zero-filled for invalid rows, so 0 * v stays 0
#pragma unroll
      for (int n = 0; n < NV; ++n) reinterpret_cast<uint4*>(&vv)[n] = st[((u * 2 + 1) * NV + n) * kThreads];
#pragma unroll
      for (int r = 0; r < RP; ++r) {
        l[r] += dot[u][r];
#pragma unroll
        for (int e = 0; e < E; ++e) acc[r][e] += dot[u][r] * to_f(vv.v[e]);
      }
    }
    issue(t + kStages - 1);  // refills the stage this thread read in step t - 1
  }
  cp_async_wait<0>();

  // merge the PPW slots of a warp (lanes sub, sub + LPP, ...), then the warps through shared memory
#pragma unroll
  for (int o = LPP; o < 32; o <<= 1) {
#pragma unroll
    for (int r = 0; r < RP; ++r) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[r], o), lo = __shfl_xor_sync(0xffffffffu, l[r], o);
      const float mx = fmaxf(m[r], mo), ms = mx == -INFINITY ? 0.f : mx;
      const float ca = exp2f(m[r] - ms), cb = exp2f(mo - ms);
      l[r] = l[r] * ca + lo * cb;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * ca + __shfl_xor_sync(0xffffffffu, acc[r][e], o) * cb;
      m[r] = mx;
    }
  }
  __syncthreads();  // every warp is done with the ring, which the reduction area overlays
  if (lane < LPP) {
#pragma unroll
    for (int r = 0; r < RP; ++r) {
      if (sub == 0) {
        red_m[warp * RP + r] = m[r];
        red_l[warp * RP + r] = l[r];
      }
#pragma unroll
      for (int e = 0; e < E; ++e) red_acc[(warp * RP + r) * DP + sub * E + e] = acc[r][e];
    }
  }
  __syncthreads();
  decode_finish<T, RP, DP>(a, red_m, sm_scale, sm_last, grp, split, (int64_t)b * a.Hq + (int64_t)g * a.R + r0, nr,
                           D);
}

// ------------------------------------------------------------------ tensor-core path
// With several query heads a kv head the ring kernel's per-row maths on the CUDA cores, not the K/V bytes, bounds it
// (`python -m benchmarks.ops.decode_splits --heads 32,8` shows it against torch.compile). This kernel takes up to
// kMmaHeads query heads of one kv head as the 16 rows of mma.sync m16n8k16 (FlashAttention-2's fragments): S = Q K^T
// over 16-row K tiles, the online softmax on the fragments in base 2, O += P V. Each warp streams its own K/V tiles
// (tiles warp, warp + kWarps, ...) through a private cp.async ring, so no barrier is needed until the end, where the
// warps' states meet in shared memory and decode_finish writes the outputs or split partials.
// The ring holds rows of DP elements with the 16-byte chunks of row r at chunk c ^ (r % 8), so ldmatrix's eight row
// reads of one chunk column fall in distinct banks.
constexpr int kMmaHeads = 16, kMmaStages = 3;

// A float8 cache (KV = __nv_fp8_e4m3): its tiles land as float8 and each lane converts the bytes of its own mma
// fragments to float16 in registers (e4m3 values are exact in float16; q is rounded to it), so the tile takes one
// shared-memory read and no staging copy. Its tiles are half the bytes, so its ring holds one stage more in less
// memory.
//
// The fragments read whole 16-byte runs of a row because the head dimension is permuted, which neither dot product
// sees as long as both of its operands share the permutation:
// - S = Q K^T: logical column kk of k-step s is physical dimension (kk % 8) / 2 * DP / 4 + 4 s + (kk / 8) * 2 + kk % 2,
//   so lane tq's B fragments over all the k-steps of one position are the DP / 4 bytes from tq * DP / 4, and q's A
//   fragments are read through the same map;
// - O = P V: logical output column n of n-tile j is physical dimension n * DP / 8 + j, so lane gq's B fragments of a
//   position are the DP / 8 bytes from gq * DP / 8; the outputs are written back through the same map.
template <typename KV> constexpr bool is_f8() { return std::is_same_v<KV, __nv_fp8_e4m3>; }
template <typename KV> constexpr int mma_stages() { return is_f8<KV>() ? kMmaStages + 1 : kMmaStages; }
// Blocks an SM holds: a float8 cache's smaller ring and registers leave room for a third.
template <typename KV> constexpr int mma_blocks() { return is_f8<KV>() ? 3 : 2; }
// A warp's ring of K/V tile pairs.
template <typename KV, int DP> constexpr int mma_warp_bytes() {
  return mma_stages<KV>() * 2 * 16 * DP * (int)sizeof(KV);
}
// the warps' rings, which the reduction area (decode_finish's layout) overlays after the loop
template <typename KV, int DP> constexpr int mma_smem_bytes() {
  return std::max(kWarps * mma_warp_bytes<KV, DP>(), kWarps * kMmaHeads * (DP + 2) * 4);
}

// Byte offsets of 16-byte chunk c of row r of a float8 ring tile (rows of DP bytes), swizzled so that the fragment
// reads of a quarter warp fall in distinct banks: K's lanes read chunks 2tq, 2tq + 1 of rows gq and gq + 8 (the
// chunk XORed with the row's parity), V's read chunk gq of rows 2tq (+1, +8, +9) (XORed with 2 (r / 2 % 4)). A row
// of 64 bytes needs no swizzle for K and leaves V's reads 2-way conflicted.
template <int DP> __device__ __forceinline__ int f8_k_at(int r, int c) {
  return r * DP + ((DP == 128 ? c ^ (r & 1) : c) << 4);
}
template <int DP> __device__ __forceinline__ int f8_v_at(int r, int c) {
  return r * DP + ((DP == 128 ? c ^ (((r >> 1) & 3) << 1) : c) << 4);
}
// Two float8_e4m3 values (the low or high 16 bits of w) as a float16 pair, exactly.
__device__ __forceinline__ uint32_t f8x2_to_half2(uint32_t w, bool high) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(high ? w >> 16 : w & 0xffffu), __NV_E4M3);
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}
// Bytes i and i + 1 of a, interleaved with those of b: {a_i, b_i, a_i+1, b_i+1} (i = 0 or 2).
__device__ __forceinline__ uint32_t interleave_bytes(uint32_t a, uint32_t b, int i) {
  return __byte_perm(a, b, i == 0 ? 0x5140 : 0x7362);
}
// A pair of 16-bit values of type T as a pair of type M (the same bits when they are one type).
template <typename T, typename M> __device__ __forceinline__ uint32_t as_pair(uint32_t v) {
  if constexpr (std::is_same_v<T, M>) {
    return v;
  } else {
    const Vec<T, 2> in = *reinterpret_cast<const Vec<T, 2>*>(&v);
    return pack2<M>(to_f(in.v[0]), to_f(in.v[1]));
  }
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Swizzled byte offset of 16-byte chunk c of row r of a ring tile of rows of DP 16-bit elements.
template <int DP> __device__ __forceinline__ int swz(int r, int c) { return r * DP * 2 + ((c ^ (r & 7)) << 4); }

// The online softmax of one 16-row tile's scores sc (S = Q K^T in the mma C fragments' layout: [n-tile][c]): scores
// of positions p0 + row at or past `end` masked, the running max / sum (m, l: this lane's rows only) updated, c2 the
// factors that rescale O. Returns P as the A operand of O += P V (the two score n-tiles are its two k halves).
// qscale: the softmax scale times log2(e) (scores in base 2). on: bit hh says whether query row gq + 8 hh reads the
// tile (a pack's block masks the rows of the pack's other rows on a row's own positions).
template <typename T>
__device__ __forceinline__ void tile_softmax(float (&sc)[2][4], int64_t p0, int64_t end, float qscale, float (&m)[2],
                                             float (&l)[2], float (&c2)[2], uint32_t (&pa)[4], unsigned on = 3u) {
  const int tq = threadIdx.x & 3;
  const int rows = (int)min(end - p0, (int64_t)16);  // the tile's valid rows
  // a quad (lanes 4gq..4gq+3) shares a head's rows
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float mx = m[hh];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool valid = h * 8 + 2 * tq + j < rows && (on >> hh & 1u);
        float& x = sc[h][2 * hh + j];
        x = valid ? x * qscale : -INFINITY;
        mx = fmaxf(mx, x);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float ms = mx == -INFINITY ? 0.f : mx;  // no valid row yet: keep exp2 away from inf - inf
    c2[hh] = exp2f(m[hh] - ms);
    m[hh] = mx;
    float sum = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float& x = sc[h][2 * hh + j];
        x = exp2f(x - ms);  // 0 for an invalid row
        sum += x;
      }
    }
    l[hh] = l[hh] * c2[hh] + sum;  // this lane's rows only; the quad's lanes are summed at the end
  }
  pa[0] = pack2<T>(sc[0][0], sc[0][1]);
  pa[1] = pack2<T>(sc[0][2], sc[0][3]);
  pa[2] = pack2<T>(sc[1][0], sc[1][1]);
  pa[3] = pack2<T>(sc[1][2], sc[1][3]);
}

// One 16-row K/V tile (K at ks, V at vs in shared memory, swizzled) into a warp's online-softmax state, in the mma
// fragments' layout: S = Q K^T, the online softmax (tile_softmax), O rescaled, O += P V.
template <typename T, int DP>
__device__ __forceinline__ void mma_tile(const uint32_t (&qa)[DP / 16][4], uint32_t ks, uint32_t vs, int64_t p0,
                                         int64_t end, float qscale, float (&o)[DP / 8][4], float (&m)[2],
                                         float (&l)[2], unsigned on = 3u) {
  constexpr int KS = DP / 16, NT = DP / 8;
  const int lane = threadIdx.x & 31, mt = lane >> 3, mr = lane & 7;
  // S = Q K^T: n-tile h holds K rows 8h..8h+7; x4 matrices (rows 0-7, chunk 2k), (0-7, 2k+1), (8-15, 2k),
  // (8-15, 2k+1)
  float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int k = 0; k < KS; ++k) {
    uint32_t kf[4];
    ldsm_x4(kf, ks + swz<DP>((mt >> 1) * 8 + mr, 2 * k + (mt & 1)));
    mma16816<T>(sc[0], qa[k], kf[0], kf[1]);
    mma16816<T>(sc[1], qa[k], kf[2], kf[3]);
  }
  float c2[2];
  uint32_t pa[4];
  tile_softmax<T>(sc, p0, end, qscale, m, l, c2, pa, on);
  // V^T fragments with ldmatrix.trans: x4 matrices (rows 0-7, chunk 2t), (8-15, 2t), (0-7, 2t+1), (8-15, 2t+1)
#pragma unroll
  for (int t = 0; t < NT / 2; ++t) {
    uint32_t vf[4];
    ldsm_x4_trans(vf, vs + swz<DP>((mt & 1) * 8 + mr, 2 * t + (mt >> 1)));
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      float (&on)[4] = o[2 * t + u];
      on[0] *= c2[0];
      on[1] *= c2[0];
      on[2] *= c2[1];
      on[3] *= c2[1];
      mma16816<T>(on, pa, vf[2 * u], vf[2 * u + 1]);
    }
  }
}

// mma_tile for a float8 tile pair (K at kt, V at vt: a warp's ring stage, laid out by f8_k_at / f8_v_at), with float16
// maths on fragments converted in registers, in the permuted head dimension (see is_f8). The warp skips O's rescale
// when no lane's running max moved (every factor is then exactly 1).
template <int DP>
__device__ __forceinline__ void mma_tile_f8(const uint32_t (&qa)[DP / 16][4], const unsigned char* kt,
                                            const unsigned char* vt, int64_t p0, int64_t end, float qscale,
                                            float (&o)[DP / 8][4], float (&m)[2], float (&l)[2], unsigned on = 3u) {
  constexpr int KS = DP / 16, NT = DP / 8, KW = DP / 16, VW = DP / 32;  // 32-bit words of a lane's K / V run
  const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  // K: rows gq and gq + 8, the DP / 4 bytes from tq * DP / 4 (chunks tq * DP / 64 ...)
  uint32_t kw[2][KW];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int c = 0; c < KW / 4; ++c) {
      const uint4 x = *reinterpret_cast<const uint4*>(kt + f8_k_at<DP>(gq + 8 * h, tq * (KW / 4) + c));
      kw[h][4 * c] = x.x;
      kw[h][4 * c + 1] = x.y;
      kw[h][4 * c + 2] = x.z;
      kw[h][4 * c + 3] = x.w;
    }
  }
  // V: rows 2tq, 2tq + 1, 2tq + 8, 2tq + 9, the DP / 8 bytes from gq * DP / 8
  uint32_t vw[4][VW];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int row = 2 * tq + (r & 1) + 8 * (r >> 1);
    if constexpr (VW == 4) {
      const uint4 x = *reinterpret_cast<const uint4*>(vt + f8_v_at<DP>(row, gq));
      vw[r][0] = x.x;
      vw[r][1] = x.y;
      vw[r][2] = x.z;
      vw[r][3] = x.w;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(vt + f8_v_at<DP>(row, gq >> 1) + 8 * (gq & 1));
      vw[r][0] = x.x;
      vw[r][1] = x.y;
    }
  }
  float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int k = 0; k < KS; ++k) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      mma16816<__half>(sc[h], qa[k], f8x2_to_half2(kw[h][k], false), f8x2_to_half2(kw[h][k], true));
  }
  float c2[2];
  uint32_t pa[4];
  tile_softmax<__half>(sc, p0, end, qscale, m, l, c2, pa, on);
  if (__any_sync(0xffffffffu, c2[0] != 1.f || c2[1] != 1.f)) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      o[n][0] *= c2[0];
      o[n][1] *= c2[0];
      o[n][2] *= c2[1];
      o[n][3] *= c2[1];
    }
  }
  // n-tile j = 4w + 2i + e takes byte 2i + e of word w of each row, the rows' pairs (2tq, 2tq + 1) and (2tq + 8, +9)
  // interleaved so that one conversion gives a B register
#pragma unroll
  for (int w = 0; w < VW; ++w) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t lo = interleave_bytes(vw[0][w], vw[1][w], 2 * i);
      const uint32_t hi = interleave_bytes(vw[2][w], vw[3][w], 2 * i);
#pragma unroll
      for (int e = 0; e < 2; ++e)
        mma16816<__half>(o[4 * w + 2 * i + e], pa, f8x2_to_half2(lo, e == 1), f8x2_to_half2(hi, e == 1));
    }
  }
}

// Block (b, kv head g, group of kMmaHeads query heads, split); thread (warp, lane) with gq = lane / 4, tq = lane % 4
// holds, in the mma fragments' layout, query heads gq and gq + 8 of the group: their scores for K rows 2tq, 2tq + 1
// of each 8-row half of a tile, and their outputs for columns 8n + 2tq, 8n + 2tq + 1.
//
// kPacked (a.packs): the tile's rows are the heads of up to kMmaHeads / nr rows of one pack, which share their first
// positions: tile row i is query head r0 + i % nr of row b + i / nr, b a multiple of kMmaHeads / nr rows into its pack
// (a tile leader). The item (b, g, head group) reads for rows b .. b + cnt - 1 a list of segments: the shared positions
// once, through b's table, for all of them, then each row's own positions through its own table, the other rows'
// scores masked. The splits divide the list's tiles, and each split writes a partial (or, alone, the output) for each
// of its rows. The grid is about the co-resident blocks a split, each taking items in turn and finding each item's
// leader by a scan of the packs.
template <typename T, typename KV, int DP, bool kPacked>
__global__ void __launch_bounds__(kThreads, mma_blocks<KV>()) decode_mma_kernel(DecodeArgs a) {
  // M: the tensor cores' type (float16 for a float8 cache); EC: cache elements a 16-byte chunk
  using M = std::conditional_t<is_f8<KV>(), __half, T>;
  constexpr int NS = mma_stages<KV>(), EC = 16 / (int)sizeof(KV);
  constexpr int CH = DP / EC, KS = DP / 16, NT = DP / 8;  // 16-byte chunks a row; k-steps of q.k; n-tiles of p.v
  constexpr int kTileBytes = 16 * DP * (int)sizeof(KV), kStageBytes = 2 * kTileBytes;  // 16 rows of K, then of V
  constexpr int kSegs = kPacked ? kMmaHeads + 1 : 1;
  constexpr unsigned kAll = 0xffffffffu;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float sm_scale[kMmaHeads][kMaxSplits];
  __shared__ int sm_last;
  // kPacked: segment k's positions [seg_p0, seg_end) of row seg_row, its tiles from seg_t0[k] in the block's list
  __shared__ int64_t seg_p0[kSegs], seg_end[kSegs];
  __shared__ int seg_row[kSegs], seg_t0[kSegs + 1];
  // kPacked: the leaders each warp found in the rows being scanned, and the row of the one sought
  __shared__ int sm_leads[kWarps], sm_row;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
  const int split = blockIdx.y, splits = a.splits, HR = a.Hk * a.RG;
  // rows whose heads one tile holds (the same for every head group, so that a row leads a tile in all of them)
  const int per_tile = kMmaHeads / min(kMmaHeads, a.R);
  const float qscale = a.scale * 1.4426950408889634f;  // scores in base 2
  // K/V addressed a tile at a time: one table entry a tile, the warp's next 32 entries read ahead into its lanes.
  // Tiles start on a multiple of 16 with packs and on a float8 cache (see below), so a tile lies in one block of 16
  // or more positions.
  const bool tiled = a.tbl.table == nullptr || (a.tbl.shift >= 4 && (kPacked || is_f8<KV>()));

  // kPacked: the row of the li-th pack tile leader (a pack's first row, then every per_tile-th), -1 past the last.
  // The scan moves forward over the rows, as li does from item to item.
  int scan_b0 = 0, scan_n0 = 0;
  auto leader = [&](int li) -> int {
    for (;;) {
      if (scan_b0 >= a.B) return -1;
      const int row = scan_b0 + tid;
      const bool lead = row < a.B && (row - __ldg(a.packs + 3 * (int64_t)row)) % per_tile == 0;
      const unsigned bal = __ballot_sync(kAll, lead);
      if (lane == 0) sm_leads[warp] = __popc(bal);
      __syncthreads();
      int before = scan_n0 + __popc(bal & ((1u << lane) - 1)), total = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const int n = sm_leads[w];
        total += n;
        before += w < warp ? n : 0;
      }
      if (lead && before == li) sm_row = row;
      __syncthreads();
      const bool here = li < scan_n0 + total;
      const int found = sm_row;
      __syncthreads();  // every thread has read sm_leads and sm_row before the next scan writes them
      if (here) return found;
      scan_b0 += kThreads;
      scan_n0 += total;
    }
  };

  // One item: (b, kv head g, head group rg), with packs b leading a tile of its pack's rows.
  auto item = [&](const int grp) {
    const int bg = grp / a.RG, rg = grp - bg * a.RG, b = bg / a.Hk, g = bg - b * a.Hk;
    const int r0 = rg * kMmaHeads, nr = min(kMmaHeads, a.R - r0);
    const int64_t len = min((int64_t)a.S, a.lengths[b]);
    int cnt = 1;  // rows whose heads the tile holds
    int64_t s_begin, s_end;  // kPacked: the split's tiles in the block's list; otherwise its positions
    if constexpr (kPacked) {
      const int64_t* pk = a.packs + 3 * (int64_t)b;
      cnt = (int)max((int64_t)1, min((int64_t)per_tile, pk[0] + pk[1] - b));
      // shared positions rounded down to a multiple of 16, so that every tile starts on one (the positions left out
      // are read by each row through its own table)
      const int64_t shared = max((int64_t)0, min(len, pk[2])) & ~(int64_t)15;
      if (warp == 0) {  // lane k: segment k, its tiles counted, then their prefix sum across the lanes
        int tiles = 0;
        if (lane <= cnt) {
          const int row = lane == 0 ? b : b + lane - 1;
          const int64_t n = lane == 0 ? len : min((int64_t)a.S, a.lengths[row]);
          const int64_t p0 = lane == 0 ? 0 : min(shared, n), e = lane == 0 ? shared : n;
          seg_p0[lane] = p0;
          seg_end[lane] = e;
          seg_row[lane] = row;
          tiles = e > p0 ? (int)((e - p0 + 15) / 16) : 0;
        }
        int sum = tiles;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int x = __shfl_up_sync(kAll, sum, o);
          if (lane >= o) sum += x;
        }
        if (lane <= cnt) seg_t0[lane + 1] = sum;
        if (lane == 0) seg_t0[0] = 0;
      }
      __syncthreads();
      const int total = seg_t0[cnt + 1], per = (total + splits - 1) / splits;
      s_begin = min((int64_t)total, (int64_t)split * per);
      s_end = min((int64_t)total, s_begin + per);
    } else {
      // a float8 cache's splits start on a multiple of 16, so that a tile lies in one block of 16 or more positions
      const int chunk = is_f8<KV>() ? ((a.S + splits - 1) / splits + 15) / 16 * 16 : (a.S + splits - 1) / splits;
      s_begin = (int64_t)split * chunk;
      s_end = min(len, s_begin + chunk);
    }
    const int tiles = s_end > s_begin ? (int)(kPacked ? s_end - s_begin : (s_end - s_begin + 15) / 16) : 0;
    const int my_tiles = tiles > warp ? (tiles - warp + kWarps - 1) / kWarps : 0;  // tiles warp, warp + kWarps, ...
    // This warp's i-th tile: its first position, the end of its segment, its row and segment. kPacked: found from a
    // cursor into the segments that only moves forward, as i does.
    struct Tile {
      int64_t p0, end;
      int row, seg;
    };
    auto tile_at = [&](int i, int& k) -> Tile {
      if constexpr (kPacked) {
        const int t = (int)s_begin + warp + i * kWarps;
        while (t >= seg_t0[k + 1]) ++k;
        return {seg_p0[k] + (int64_t)(t - seg_t0[k]) * 16, seg_end[k], seg_row[k], k};
      } else {
        return {s_begin + (int64_t)(warp + i * kWarps) * 16, s_end, b, 0};
      }
    };
    // tiled: lane j holds the table entry of the warp's tile win + j
    int64_t ent = 0;
    int win = 0, k_win = 0;
    auto window = [&](int from) {
      win = from;
      const int i = from + lane;
      if (a.tbl.table != nullptr && tiled && i < my_tiles) {
        const Tile t = tile_at(i, k_win);
        ent = __ldg(a.tbl.table + (int64_t)t.row * a.tbl.stride + (t.p0 >> a.tbl.shift));
      }
    };
    window(0);

    unsigned char* ring = smem + warp * mma_warp_bytes<KV, DP>();
    const uint32_t ring_s = (uint32_t)__cvta_generic_to_shared(ring);
    int k_issue = 0, k_use = 0;  // the segment cursors of the copies and of the maths
    // this warp's i-th tile into stage i % NS; rows past its segment's end are zero-filled
    auto issue = [&](int i) {
      if (i < my_tiles) {
        unsigned char* st = ring + (i % NS) * kStageBytes;
        const Tile t = tile_at(i, k_issue);
        const int64_t p0 = t.p0;
        const KV* kb = (const KV*)a.k + t.row * a.sb + g * a.sh;
        const KV* vb = (const KV*)a.v + t.row * a.sb + g * a.sh;
        if (tiled) {  // the tile's rows at ss strides from its first
          if (i - win == 32) window(i);
          const int64_t e = __shfl_sync(kAll, ent, (i - win) & 31);
          const int64_t tile = a.tbl.table == nullptr
                                   ? p0 * a.ss
                                   : e * a.tbl.sblk + (p0 & ((1LL << a.tbl.shift) - 1)) * a.ss;
          const KV *kt = kb + tile, *vt = vb + tile;
          const int rows = (int)min(t.end - p0, (int64_t)16);
#pragma unroll
          for (int j = 0; j < 16 * CH / 32; ++j) {
            const int idx = lane + 32 * j, r = idx / CH, c = idx - r * CH;
            const bool ok = r < rows;
            const int64_t off = ok ? r * a.ss + c * EC : 0;
            if constexpr (is_f8<KV>()) {
              cp_async16(st + f8_k_at<DP>(r, c), kt + off, ok);
              cp_async16(st + kTileBytes + f8_v_at<DP>(r, c), vt + off, ok);
            } else {
              cp_async16(st + swz<DP>(r, c), kt + off, ok);
              cp_async16(st + kTileBytes + swz<DP>(r, c), vt + off, ok);
            }
          }
        } else {  // each row through the table
#pragma unroll
          for (int j = 0; j < 16 * CH / 32; ++j) {
            const int idx = lane + 32 * j, r = idx / CH, c = idx - r * CH;
            const bool ok = p0 + r < t.end;
            const int64_t off = ok ? row_offset(a, t.row, p0 + r) + c * EC : 0;
            if constexpr (is_f8<KV>()) {
              cp_async16(st + f8_k_at<DP>(r, c), kb + off, ok);
              cp_async16(st + kTileBytes + f8_v_at<DP>(r, c), vb + off, ok);
            } else {
              cp_async16(st + swz<DP>(r, c), kb + off, ok);
              cp_async16(st + kTileBytes + swz<DP>(r, c), vb + off, ok);
            }
          }
        }
      }
      cp_async_commit();
    };
#pragma unroll
    for (int i = 0; i < NS - 1; ++i) issue(i);

    // q as the A operand: tile rows gq and gq + 8 (query heads r0 + gq, r0 + gq + 8 of row b, or of the pack's
    // rows), columns 16k + 2tq (+1) and + 8, which a float8 cache maps to physical dimensions tq * DP / 4 + 4k (+1)
    // and + 2 (see is_f8)
    const int rows_on = cnt * nr;
    uint32_t qa[KS][4];
    {
      const bool on0 = gq < rows_on, on1 = gq + 8 < rows_on;
      auto q_row = [&](int i) {
        return (const T*)a.q + ((int64_t)(b + i / nr) * a.Hq + (int64_t)g * a.R + r0 + i % nr) * DP;
      };
      const T* q0 = q_row(on0 ? gq : 0);
      const T* q1 = q_row(on1 ? gq + 8 : 0);
#pragma unroll
      for (int k = 0; k < KS; ++k) {
        const int c = is_f8<KV>() ? tq * (DP / 4) + 4 * k : 16 * k + 2 * tq, c8 = is_f8<KV>() ? c + 2 : c + 8;
        qa[k][0] = on0 ? as_pair<T, M>(*reinterpret_cast<const uint32_t*>(q0 + c)) : 0u;
        qa[k][1] = on1 ? as_pair<T, M>(*reinterpret_cast<const uint32_t*>(q1 + c)) : 0u;
        qa[k][2] = on0 ? as_pair<T, M>(*reinterpret_cast<const uint32_t*>(q0 + c8)) : 0u;
        qa[k][3] = on1 ? as_pair<T, M>(*reinterpret_cast<const uint32_t*>(q1 + c8)) : 0u;
      }
    }
    float o[NT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // [0]: head gq, [1]: head gq + 8
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    // kPacked: the segment (1 + the row of the tile) each of this lane's two tile rows reads besides the shared one
    const int seg0 = 1 + gq / nr, seg1 = 1 + (gq + 8) / nr;

    for (int i = 0; i < my_tiles; ++i) {
      cp_async_wait<NS - 2>();  // this lane's copies of tile i have landed
      __syncwarp();             // and every lane's
      const Tile t = tile_at(i, k_use);
      // the query rows the tile's scores count for: all of them in the shared segment, else its row's heads
      const unsigned on = !kPacked || t.seg == 0 ? 3u : (unsigned)(seg0 == t.seg) | (unsigned)(seg1 == t.seg) << 1;
      if constexpr (is_f8<KV>()) {
        const unsigned char* st = ring + (i % NS) * kStageBytes;
        mma_tile_f8<DP>(qa, st, st + kTileBytes, t.p0, t.end, qscale, o, m, l, on);
      } else {
        const uint32_t ks = ring_s + (i % NS) * kStageBytes;
        mma_tile<M, DP>(qa, ks, ks + kTileBytes, t.p0, t.end, qscale, o, m, l, on);
      }
      __syncwarp();  // every lane has read the stage before it is refilled
      issue(i + NS - 1);
    }
    cp_async_wait<0>();

    // the warps' states through shared memory, as decode_finish reads them
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      l[hh] += __shfl_xor_sync(kAll, l[hh], 1);
      l[hh] += __shfl_xor_sync(kAll, l[hh], 2);
    }
    __syncthreads();  // every warp is done with its ring, which the reduction area overlays
    float* red = reinterpret_cast<float*>(smem);
    float *red_m = red, *red_l = red + kWarps * kMmaHeads, *red_acc = red_l + kWarps * kMmaHeads;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = gq + 8 * hh;
      if (tq == 0) {
        red_m[warp * kMmaHeads + r] = m[hh];
        red_l[warp * kMmaHeads + r] = l[hh];
      }
      if (r < rows_on) {  // the rows past the tile's heads hold nothing decode_finish reads
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          red_acc[(warp * kMmaHeads + r) * DP + 8 * n + 2 * tq] = o[n][2 * hh];
          red_acc[(warp * kMmaHeads + r) * DP + 8 * n + 2 * tq + 1] = o[n][2 * hh + 1];
        }
      }
    }
    __syncthreads();
    // each row of the tile: its output, or its split's partial
    for (int i = 0; i < cnt; ++i)
      decode_finish<T, kMmaHeads, DP, is_f8<KV>()>(a, red, sm_scale, sm_last, grp + i * HR, split,
                                                    (int64_t)(b + i) * a.Hq + (int64_t)g * a.R + r0, nr, DP, i * nr);
  };

  if constexpr (!kPacked) {
    item(blockIdx.x);
  } else {
    // items (pack tile leader li, kv head, head group) numbered li * HR + ..., blockIdx.x, + gridDim.x, ...: a grid
    // of about the co-resident blocks instead of one block a row, most of which would find their row led by another
    for (int it = blockIdx.x;; it += gridDim.x) {
      const int b = leader(it / HR);
      if (b < 0) break;
      item(b * HR + it % HR);
      __syncthreads();  // the block's shared memory (ring, reduction, segments) is free for the next item
    }
  }
}

// ------------------------------------------------------------------ persistent tensor-core path
// decode_mma_kernel pays a fixed latency per block (lengths, table, first copies, a short pipeline, the block's
// reduction) and runs in waves; a grid of under one wave leaves the GPU short of bytes in flight. This kernel keeps
// only as many one-warp blocks as are co-resident, and each warp is a worker that takes work items from a global
// counter until none are left. An item is (row b, kv head g, head group, chunk): chunk c covers the context tiles
// [c * CT, (c + 1) * CT) of the row, and a row of length 0 has one fully masked tile (the item that writes its zeros).
// Every warp reads all the lengths first and picks the same CT: about kPItems items a warp over the actual tiles
// (the table's width often far exceeds the lengths), CT >= 2, and at most kPMaxChunks chunks a row, which bounds the
// combine (so a row's rounding depends on the batch's lengths, not on its own alone). Items are numbered row by
// row, so a row's chunks run at about the same time on different warps, and the mapping of an item to its row
// needs only a prefix sum that each lane holds for its share of the rows.
// A warp's K/V tiles (and q, with an item's first tile) stream through its private cp.async ring without a break at
// item boundaries: the producer half of the loop decodes the next item when it passes the end of the current one,
// and per-stage records tell the consumer half where items start and end. At an item's end a row of one chunk
// writes its output; otherwise the warp writes its partial (max, sum, unnormalised output) to the workspace slot of
// the item, and the last warp of the row's chunks to arrive (a counter per (b, g, head group), which it resets)
// combines them. The last warp to finish resets the item counter and the warps-done counter: the op is replayed in
// CUDA graphs with no host work in between.
constexpr int kPStages = 3, kPMaxChunks = 16, kPItems = 4;
constexpr int kPNone = 1, kPFirst = 2, kPLast = 4;  // a stage past the last item; an item's first / last tile

struct PersistArgs {
  DecodeArgs a;
  int B;
  int nrp;    // q rows a stage holds: the most heads of a group, min(kMmaHeads, R)
  int slots;  // work items the workspace holds
  int chunk;  // tiles a chunk when forced (FW_DECODE_CHUNK), else 0
  int items;  // the items a warp to aim for
};
// What the consumer needs of a stage; lane 0 writes it with the stage's copies.
struct alignas(16) PStage {
  int p0, len, flags, item;  // the tile's first position, the row's length, kP*, the item (its workspace slot)
  int hq0, nr, nc, first;    // the group's first query head (b * Hq + ...), its heads, its chunks, its chunk 0 item
  int grp, pad0, pad1, pad2;  // its arrival counter
};

// The warp's ring of K/V tiles, then one q slot a stage, then the stage records.
template <int DP> constexpr int persist_smem_bytes(int nrp) {
  return kPStages * (2 * 16 * DP * 2 + nrp * DP * 2 + (int)sizeof(PStage));
}

__device__ __forceinline__ int warp_incl_scan(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// Block = one warp. ws.count: [0] the item counter, [1] the warps done, from kDecodeCounterHead one arrival counter
// a (b, g, head group). ws.o/m/l: [slots, nrp] partials. Fragment layout as in decode_mma_kernel.
template <typename T, int DP>
__global__ void __launch_bounds__(32) decode_mma_kernel_persistent(PersistArgs pa) {
  constexpr int CH = DP / 8, KS = DP / 16, NT = DP / 8, E = DP / 32;
  constexpr int kTileBytes = 16 * DP * 2, kStageBytes = 2 * kTileBytes;
  constexpr unsigned kAll = 0xffffffffu;
  extern __shared__ __align__(128) unsigned char smem[];
  const DecodeArgs& a = pa.a;
  const int lane = threadIdx.x, gq = lane >> 2, tq = lane & 3, mt = lane >> 3, mr = lane & 7;
  const int W = gridDim.x, B = pa.B, HR = a.Hk * a.RG, nrp = pa.nrp;
  const int qslot = nrp * DP * 2;
  unsigned char* ring = smem;
  unsigned char* qring = smem + kPStages * kStageBytes;
  PStage* meta = reinterpret_cast<PStage*>(qring + kPStages * qslot);
  const uint32_t ring_s = (uint32_t)__cvta_generic_to_shared(ring), q_s = (uint32_t)__cvta_generic_to_shared(qring);
  int* const next_ctr = a.ws.count;
  int* const done_ctr = a.ws.count + 1;
  int* const grp_ctr = a.ws.count + kDecodeCounterHead;
  const float qscale = a.scale * 1.4426950408889634f;  // scores in base 2
  auto len_of = [&](int b) {
    const int64_t n = __ldg(a.lengths + b);
    return (int)(n < 0 ? 0 : n > a.S ? a.S : n);
  };
  auto tiles_of = [](int len) { return max(1, (len + 15) >> 4); };  // a row of length 0: one masked tile

  // The chunk size, from every row's tiles; then lane j's rows [j * k, j * k + k) and the items before them.
  const int k = (B + 31) / 32;
  int64_t tsum = 0;
  int tmax = 0;
  for (int t = 0; t < k; ++t) {
    const int b = lane * k + t;
    if (b < B) {
      const int n = tiles_of(len_of(b));
      tsum += n;
      tmax = max(tmax, n);
    }
  }
  tsum = warp_sum(tsum) * HR;
  tmax = warp_max(tmax);
  int ct = pa.chunk;
  if (ct <= 0) {
    const int64_t target = (int64_t)pa.items * W;
    ct = (int)std::max<int64_t>(2, (tsum + target - 1) / target);
  }
  ct = max(ct, (tmax + kPMaxChunks - 1) / kPMaxChunks);
  int pre, N;
  for (;;) {
    int n = 0;
    for (int t = 0; t < k; ++t) {
      const int b = lane * k + t;
      if (b < B) n += HR * ((tiles_of(len_of(b)) + ct - 1) / ct);
    }
    const int inc = warp_incl_scan(n);
    pre = inc - n;
    N = __shfl_sync(kAll, inc, 31);
    if (N <= pa.slots) break;
    ct *= 2;  // not taken at the sizes run_decode allows for; keeps the partials inside the workspace regardless
  }

  // ---- producer state: item `it` (none once it >= N), its tiles [t0, t1), the next one to issue t
  int it = blockIdx.x, t = 0, t0 = 0, t1 = 0, len = 0, hq0 = 0, nr = 0, nc = 1, first = 0, grp = 0, b = 0;
  int64_t kv = 0;   // the row's K/V base, b * sb + g * sh
  int64_t ent = 0;  // block-table entry of tile win + lane (paged caches of blocks of 16 positions or more)
  int win = 0;
  int nxt = 0;  // lane 0: the counter's answer for the item after this one, asked for when this one starts
  const bool tiled = a.tbl.table != nullptr && a.tbl.shift >= 4;  // a tile lies in one block
  auto window = [&](int from) {
    win = from;
    const int tt = from + lane;
    ent = tiled && tt < t1 && tt * 16 < len
              ? __ldg(a.tbl.table + (int64_t)b * a.tbl.stride + ((int64_t)tt * 16 >> a.tbl.shift))
              : 0;
  };
  // decodes item it (< N): its row by the lanes' prefix sums, then (g, head group, chunk) within the row
  auto start = [&]() {
    const int j = 31 - __clz(__ballot_sync(kAll, pre <= it));  // the last lane whose rows start at or before it
    int rem = it - __shfl_sync(kAll, pre, j);
    for (int base = 0;; base += 32) {
      const int r = j * k + base + lane;
      const int n = base + lane < k && r < B ? HR * ((tiles_of(len_of(r)) + ct - 1) / ct) : 0;
      const int inc = warp_incl_scan(n);
      const unsigned hit = __ballot_sync(kAll, inc > rem);
      if (hit) {
        const int s = __ffs(hit) - 1;
        b = j * k + base + s;
        rem -= __shfl_sync(kAll, inc - n, s);
        break;
      }
      rem -= __shfl_sync(kAll, inc, 31);
    }
    len = len_of(b);
    const int tiles = tiles_of(len);
    nc = (tiles + ct - 1) / ct;
    const int gl = rem / nc, c = rem - gl * nc, g = gl / a.RG, rg = gl - g * a.RG;
    t = t0 = c * ct;
    t1 = min(tiles, t0 + ct);
    first = it - c;
    grp = b * HR + gl;
    nr = min(kMmaHeads, a.R - rg * kMmaHeads);
    hq0 = b * a.Hq + g * a.R + rg * kMmaHeads;
    kv = (int64_t)b * a.sb + (int64_t)g * a.sh;
    window(t0);
    if (lane == 0) nxt = atomicAdd(next_ctr, 1);  // its answer is first needed at this item's end
  };
  if (it < N) start();
  // stage i into slot i % kPStages: tile t of the current item (q too at its first tile), then on to the next item
  auto issue = [&](int i) {
    const int s = i % kPStages;
    if (it >= N) {
      if (lane == 0) meta[s].flags = kPNone;
      cp_async_commit();
      return;
    }
    unsigned char* st = ring + s * kStageBytes;
    const int p0 = t * 16;
    if (t - win == 32) window(t);
    const int64_t e = __shfl_sync(kAll, ent, (t - win) & 31);
    const int64_t tile = a.tbl.table == nullptr ? (int64_t)p0 * a.ss
                                                : e * a.tbl.sblk + (int64_t)(p0 & ((1LL << a.tbl.shift) - 1)) * a.ss;
    const T* kb = (const T*)a.k + kv;
    const T* vb = (const T*)a.v + kv;
#pragma unroll
    for (int jj = 0; jj < 16 * CH / 32; ++jj) {
      const int idx = lane + 32 * jj, r = idx / CH, c = idx - r * CH;
      const bool ok = p0 + r < len;  // rows past the length are zero-filled
      int64_t off = 0;
      if (ok) off = (a.tbl.table == nullptr || tiled ? tile + r * a.ss : row_offset(a, b, p0 + r)) + c * 8;
      cp_async16(st + swz<DP>(r, c), kb + off, ok);
      cp_async16(st + kTileBytes + swz<DP>(r, c), vb + off, ok);
    }
    if (t == t0) {
      const T* qb = (const T*)a.q + (int64_t)hq0 * DP;
      unsigned char* qs = qring + s * qslot;
      for (int idx = lane; idx < nr * CH; idx += 32) {
        const int r = idx / CH, c = idx - r * CH;
        cp_async16(qs + swz<DP>(r, c), qb + (int64_t)r * DP + c * 8, true);
      }
    }
    if (lane == 0)
      meta[s] = PStage{p0, len, (t == t0 ? kPFirst : 0) | (t == t1 - 1 ? kPLast : 0), it, hq0, nr, nc, first, grp,
                       0, 0, 0};
    cp_async_commit();
    if (++t == t1) {
      it = W + __shfl_sync(kAll, nxt, 0);
      if (it < N) start();
    }
  };
#pragma unroll
  for (int i = 0; i < kPStages - 1; ++i) issue(i);

  // ---- consumer state: the item's q fragments and its heads' (m, l, o), as in decode_mma_kernel
  uint32_t qa[KS][4];
  float o[NT][4], m[2], l[2];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) qa[kk][0] = qa[kk][1] = qa[kk][2] = qa[kk][3] = 0u;
#pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  m[0] = m[1] = -INFINITY;
  l[0] = l[1] = 0.f;

  // the last warp of a group to arrive: out = sum_c 2^(m_c - M) o_c / sum_c 2^(m_c - M) l_c, head by head
  auto combine = [&](const PStage& rs) {
    for (int r = 0; r < rs.nr; ++r) {
      const int64_t h0 = (int64_t)rs.first * nrp + r;  // chunk c's partial of head r: slot h0 + c * nrp
      const bool on = lane < rs.nc;
      const float mc = on ? __ldcg(a.ws.m + h0 + (int64_t)lane * nrp) : -INFINITY;
      const float lc = on ? __ldcg(a.ws.l + h0 + (int64_t)lane * nrp) : 0.f;
      float ov[kPMaxChunks][E];
#pragma unroll
      for (int c = 0; c < kPMaxChunks; ++c) {  // every chunk's load in flight at once
        const float* p = a.ws.o + (h0 + (int64_t)c * nrp) * DP + lane * E;
        if constexpr (E == 4) {
          const float4 v = c < rs.nc ? __ldcg(reinterpret_cast<const float4*>(p)) : make_float4(0.f, 0.f, 0.f, 0.f);
          ov[c][0] = v.x, ov[c][1] = v.y, ov[c][2] = v.z, ov[c][3] = v.w;
        } else {
          const float2 v = c < rs.nc ? __ldcg(reinterpret_cast<const float2*>(p)) : make_float2(0.f, 0.f);
          ov[c][0] = v.x, ov[c][1] = v.y;
        }
      }
      const float M = warp_max(mc), Ms = M == -INFINITY ? 0.f : M;
      float w = exp2f(mc - Ms);  // 0 past the chunks
      const float L = warp_sum(lc * w);
      w *= L > 0.f ? 1.f / L : 0.f;
      float acc[E];
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] = 0.f;
#pragma unroll
      for (int c = 0; c < kPMaxChunks; ++c) {
        const float wc = __shfl_sync(kAll, w, c);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] += wc * ov[c][e];
      }
      store_vec<T, E>((T*)a.out + (int64_t)(rs.hq0 + r) * DP + lane * E, vec_from_f<T, E>(acc));
    }
  };
  // an item's end: its output (one chunk) or its partial, and the combine if this warp is the group's last
  auto finish = [&](const PStage& rs) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      l[hh] += __shfl_xor_sync(kAll, l[hh], 1);
      l[hh] += __shfl_xor_sync(kAll, l[hh], 2);
    }
    if (rs.nc == 1) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = gq + 8 * hh;
        if (r < rs.nr) {
          const float inv = l[hh] > 0.f ? 1.f / l[hh] : 0.f;  // 0: a row of length 0
          T* orow = (T*)a.out + (int64_t)(rs.hq0 + r) * DP + 2 * tq;
#pragma unroll
          for (int n = 0; n < NT; ++n)
            *reinterpret_cast<uint32_t*>(orow + 8 * n) = pack2<T>(o[n][2 * hh] * inv, o[n][2 * hh + 1] * inv);
        }
      }
      return;
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = gq + 8 * hh;
      if (r < rs.nr) {
        const int64_t slot = (int64_t)rs.item * nrp + r;
        float* po = a.ws.o + slot * DP + 2 * tq;
#pragma unroll
        for (int n = 0; n < NT; ++n)
          *reinterpret_cast<float2*>(po + 8 * n) = make_float2(o[n][2 * hh], o[n][2 * hh + 1]);
        if (tq == 0) {
          a.ws.m[slot] = m[hh];
          a.ws.l[slot] = l[hh];
        }
      }
    }
    __threadfence();  // this lane's partials are visible device-wide before lane 0 counts the arrival
    __syncwarp();
    int last = 0;
    if (lane == 0) {
      last = atomicAdd(grp_ctr + rs.grp, 1) == rs.nc - 1;
      if (last) grp_ctr[rs.grp] = 0;  // every chunk has arrived: ready for the next launch / graph replay
    }
    if (!__shfl_sync(kAll, last, 0)) return;
    __threadfence();
    combine(rs);
  };

  const int mrow = (mt & 1) * 8 + mr;  // the q row this lane addresses for ldmatrix
  for (int i = 0;; ++i) {
    cp_async_wait<kPStages - 2>();  // this lane's copies of stage i have landed
    __syncwarp();                   // and every lane's, and lane 0's record of it
    const int s = i % kPStages;
    const PStage rec = meta[s];
    if (rec.flags & kPNone) break;
    if (rec.flags & kPFirst) {
      // q as the A operand from the stage's q slot; rows past the group's heads are zeros (their smem is stale)
      const uint32_t qs = q_s + s * qslot;
      const int qr = mrow < rec.nr ? mrow : 0;
      const bool on0 = gq < rec.nr, on1 = gq + 8 < rec.nr;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        ldsm_x4(qa[kk], qs + swz<DP>(qr, 2 * kk + (mt >> 1)));
        qa[kk][0] = on0 ? qa[kk][0] : 0u;
        qa[kk][1] = on1 ? qa[kk][1] : 0u;
        qa[kk][2] = on0 ? qa[kk][2] : 0u;
        qa[kk][3] = on1 ? qa[kk][3] : 0u;
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
      m[0] = m[1] = -INFINITY;
      l[0] = l[1] = 0.f;
    }
    const uint32_t ks = ring_s + s * kStageBytes;
    mma_tile<T, DP>(qa, ks, ks + kTileBytes, rec.p0, rec.len, qscale, o, m, l);
    issue(i + kPStages - 1);  // into stage i - 1's slots, which every lane is past (the __syncwarp above)
    if (rec.flags & kPLast) finish(rec);
  }
  cp_async_wait<0>();

  // the last warp to finish resets the counters for the next launch / graph replay
  __threadfence();  // this warp's counter updates come before its arrival here
  if (lane == 0 && atomicAdd(done_ctr, 1) == W - 1) {
    __threadfence();
    atomicExch(next_ctr, 0);
    atomicExch(done_ctr, 0);
  }
}

// Whether the tensor-core kernel runs: 16-bit caches with head_dim 64 or 128, at 2 or more query heads a kv head.
// From 2 on it beats the ring kernel except at the smallest batches, where it is about even (`python -m
// benchmarks.ops.decode_splits --columns FW_DECODE_MMA=0 FW_DECODE_MMA=1` compares them). FW_DECODE_MMA (read per
// call): 0 never, 2 also at 1 head a kv head, for sweeps; any other value is the default.
bool use_mma(DType dt, int R, int D) {
  const int mode = int_from_env("FW_DECODE_MMA", 1);
  if (dt == DType::F32 || (D != 64 && D != 128) || mode == 0) return false;
  return mode == 2 || R >= 2;
}

// The kernel, allowed its dynamic shared memory; null if that fails.
template <typename T, typename KV, int DP, bool kPacked> const void* mma_kernel() {
  return allow_dynamic_smem<decode_mma_kernel<T, KV, DP, kPacked>>(mma_smem_bytes<KV, DP>()) == cudaSuccess
             ? (const void*)decode_mma_kernel<T, KV, DP, kPacked>
             : nullptr;
}
template <typename T, typename KV, bool kPacked> const void* mma_kernel_d(int D) {
  return D == 64 ? mma_kernel<T, KV, 64, kPacked>() : mma_kernel<T, KV, 128, kPacked>();
}
template <typename T> const void* mma_kernel_t(int D, bool kv8, bool packed) {
  if (kv8) return packed ? mma_kernel_d<T, __nv_fp8_e4m3, true>(D) : mma_kernel_d<T, __nv_fp8_e4m3, false>(D);
  return packed ? mma_kernel_d<T, T, true>(D) : mma_kernel_d<T, T, false>(D);
}
const void* mma_kernel_for(DType dt, int D, bool kv8, bool packed) {
  return dt == DType::BF16 ? mma_kernel_t<__nv_bfloat16>(D, kv8, packed) : mma_kernel_t<__half>(D, kv8, packed);
}
// its dynamic shared memory (a 16-bit cache's ring has the same bytes for bfloat16 and float16)
int mma_smem(int D, bool kv8) {
  return kv8 ? (D == 64 ? mma_smem_bytes<__nv_fp8_e4m3, 64>() : mma_smem_bytes<__nv_fp8_e4m3, 128>())
             : (D == 64 ? mma_smem_bytes<__half, 64>() : mma_smem_bytes<__half, 128>());
}

// Whether decode_mma_kernel_persistent runs where the tensor-core kernel does. Not by default: on contiguous caches,
// and where decode_mma_kernel splits the context over few rows, it is the slower one (`python -m
// benchmarks.ops.decode_splits --columns FW_DECODE_PERSIST=0 FW_DECODE_PERSIST=2 --gbps`), and on the engine's paged
// caches, where one launch of it can win, whole budgeted rollouts ran faster without it (`python -m benchmarks.rollout
// --kv-cache-gib 4` and `16` under FW_DECODE_PERSIST=0 and =1). FW_DECODE_PERSIST (read per call): 0 or unset never,
// 1 on paged caches with at least one (row, kv head, head group) per SM, 2 always.
bool use_persist(bool paged, int64_t groups, int sm_count) {
  const int mode = int_from_env("FW_DECODE_PERSIST", 0);
  return mode == 2 || (mode == 1 && paged && groups >= sm_count);
}

// The persistent kernel, allowed the dynamic shared memory of its largest q slots and the most shared memory per SM
// (its warps' rings set how many fit); null if that fails. Not stream work, so a first call under capture is fine.
template <typename T, int DP> const void* persist_kernel() {
  static const bool carveout = [] {
    // only a hint: the launch works without it
    (void)cleared(cudaFuncSetAttribute(decode_mma_kernel_persistent<T, DP>,
                                       cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    return true;
  }();
  (void)carveout;
  return allow_dynamic_smem<decode_mma_kernel_persistent<T, DP>>(persist_smem_bytes<DP>(kMmaHeads)) == cudaSuccess
             ? (const void*)decode_mma_kernel_persistent<T, DP>
             : nullptr;
}
const void* persist_kernel_for(DType dt, int D) {
  if (dt == DType::BF16) return D == 64 ? persist_kernel<__nv_bfloat16, 64>() : persist_kernel<__nv_bfloat16, 128>();
  return D == 64 ? persist_kernel<__half, 64>() : persist_kernel<__half, 128>();
}
int persist_smem(int D, int nrp) { return D == 64 ? persist_smem_bytes<64>(nrp) : persist_smem_bytes<128>(nrp); }

// RP: query heads per block; the head groups of a kv head are ceil(R / RP).
int heads_per_block(int R) { return (R == 1 || R == 2 || R == 4) ? R : R == 3 ? 4 : 8; }
int padded_dim(int D) { return D <= 64 ? 64 : D <= 128 ? 128 : 256; }

// A kernel instance, with the most shared memory per SM asked for once (L1 is not used: cp.async.cg goes to
// L2), so 8 blocks of ~25 KB fit. Not stream work, so a first call under graph capture is fine.
template <typename T, int DP, int RP, bool kFullD> const void* kernel() {
  static const bool carveout = [] {
    // only a hint: the launch works without it
    (void)cleared(cudaFuncSetAttribute(decode_kernel<T, DP, RP, kFullD>,
                                       cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    return true;
  }();
  (void)carveout;
  return (const void*)decode_kernel<T, DP, RP, kFullD>;
}
template <typename T, int DP, int RP> const void* kernel_d(bool full) {
  return full ? kernel<T, DP, RP, true>() : kernel<T, DP, RP, false>();
}
template <typename T, int DP> const void* kernel_r(int RP, bool full) {
  switch (RP) {
    case 1: return kernel_d<T, DP, 1>(full);
    case 2: return kernel_d<T, DP, 2>(full);
    case 4: return kernel_d<T, DP, 4>(full);
    default: return kernel_d<T, DP, 8>(full);
  }
}
const void* kernel_for(DType dt, int D, int R) {
  const void* f = nullptr;
  const int RP = heads_per_block(R), DP = padded_dim(D);
  dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    const bool full = D == DP;
    f = DP == 64 ? kernel_r<T, 64>(RP, full) : DP == 128 ? kernel_r<T, 128>(RP, full) : kernel_r<T, 256>(RP, full);
    return cudaSuccess;
  });
  return f;
}

}  // namespace

DecodePlan decode_attention_plan(DType dt, int B, int Hq, int Hk, int S, int D, int sm_count, bool paged,
                                 bool kv8, bool packed) {
  if (B <= 0 || Hq <= 0 || Hk <= 0 || S <= 0 || Hq % Hk != 0) return {false, 1, 1};
  const int R = Hq / Hk;
  // Packs are read on 16-bit caches where every pack's block (counted as if each pack filled its tiles) has an SM:
  // there, unsplit, the shared reads beat the persistent kernel; with fewer blocks, or split, or on a float8 cache,
  // they lose to the kernels that read each row's own positions (`python -m benchmarks.ops.paged_decode --group 8`).
  // FW_DECODE_PACKS (read per call): 0 never, 2 wherever the tensor-core kernel can, any other value the default.
  const int per_tile = kMmaHeads / std::min(kMmaHeads, R);
  const int64_t working = ((int64_t)B + per_tile - 1) / per_tile * Hk * ((R + kMmaHeads - 1) / kMmaHeads);
  const int pmode = packed ? int_from_env("FW_DECODE_PACKS", 1) : 0;
  const bool packs_read = pmode != 0 && dt != DType::F32 && (D == 64 || D == 128) &&
                          (pmode == 2 || (!kv8 && working >= sm_count));
  // a float8 cache, or packs: the tensor-core kernel (the wrapper checks a float8 cache's shapes)
  const bool mma = kv8 || use_mma(dt, R, D) || packs_read;
  const int RP = mma ? kMmaHeads : heads_per_block(R), groups = (R + RP - 1) / RP;
  // The ring kernel splits only to reach about 3 blocks per SM: that many keep enough K/V copies in flight to
  // saturate HBM, and every further split adds partials to combine and a shorter pipeline per block. The
  // tensor-core kernel's 4 warps each keep 2 tiles of 16 K/V rows in flight (3 ring stages), so it splits only to
  // reach about one block per SM, rounding down: more splits cost more than they hide. `python -m
  // benchmarks.ops.decode_splits` times every split count by batch. At least 64 positions a split, at most
  // kMaxSplits. With packs only the pack's blocks work (on a list of its rows' positions).
  int most = (int)std::min<int64_t>(kMaxSplits, ((int64_t)S * (packs_read ? per_tile : 1) + 63) / 64);
  most = most < 1 ? 1 : most;
  const int forced = int_from_env("FW_DECODE_SPLITS", 0);  // a fixed split count, for sweeps (read per call)
  const int64_t base = (int64_t)B * Hk * groups, blocks_working = packs_read ? working : base;
  const int64_t s = forced > 0 ? forced : mma ? sm_count / blocks_working : (3LL * sm_count + base - 1) / base;
  DecodePlan plan{mma, groups, (int)(s < 1 ? 1 : s > most ? most : s)};
  plan.packs = packs_read;
  if (packs_read) {
    // about the co-resident blocks a split, each taking the items (pack tile, kv head, head group) in turn: a block a
    // row would leave most blocks to find their row led by another one's, and hold resident slots doing so
    const void* pf = mma_kernel_for(dt, D, kv8, true);
    const int64_t resident = pf ? (int64_t)sm_count * resident_blocks(pf, kThreads, mma_smem(D, kv8)) : base;
    plan.blocks = (int)std::min<int64_t>(base, std::max<int64_t>(1, resident / plan.splits));
    return plan;
  }
  const void* f = mma && !kv8 && !packs_read && use_persist(paged, base, sm_count) && base * kPMaxChunks < (1 << 30)
                      ? persist_kernel_for(dt, D)
                      : nullptr;
  if (!f) return plan;
  // The persistent kernel: as many blocks as are co-resident, but no more than there can be items (chunks of at
  // least 2 tiles, or FW_DECODE_CHUNK, and at most kPMaxChunks a row). Its chunk size makes about `items` items a
  // warp (FW_DECODE_ITEMS, for sweeps), so at most items * blocks + one a (b, g, head group): the workspace slots.
  const int chunk = std::max(0, int_from_env("FW_DECODE_CHUNK", 0));
  const int items = std::max(1, int_from_env("FW_DECODE_ITEMS", kPItems));
  const int64_t tiles = (S + 15) / 16, lo = chunk > 0 ? chunk : 2;
  const int64_t upper = base * std::min<int64_t>(kPMaxChunks, (tiles + lo - 1) / lo);
  const int64_t resident = (int64_t)sm_count * resident_blocks(f, 32, persist_smem(D, std::min(kMmaHeads, R)));
  const int64_t blocks = std::min(resident, upper);
  const int64_t slots = chunk > 0 ? upper : std::min(upper, items * blocks + base);
  return {mma, groups, 1, true, (int)blocks, (int)slots, chunk, items};
}

cudaError_t decode_attention(DType dt, const void* q, const void* k, const void* v, const int64_t* lengths,
                             void* out, DecodeWorkspace ws, int B, int Hq, int Hk, int S, int D, int64_t sb,
                             int64_t sh, int64_t ss, DecodePlan plan, float scale, cudaStream_t stream,
                             DecodeTable table, bool kv8, const int64_t* packs) {
  if (B == 0 || Hq == 0) return cudaSuccess;
  const int splits = plan.splits, RG = plan.groups;
  if (!plan.packs) packs = nullptr;  // the plan's kernel reads every row's own positions
  if (Hk <= 0 || Hq % Hk != 0 || D <= 0 || D > 256 || D % 8 != 0 || splits < 1 || splits > kMaxSplits || RG < 1 ||
      (plan.mma && (dt == DType::F32 || (D != 64 && D != 128))) || (kv8 && (!plan.mma || plan.persist)))
    return cudaErrorInvalidValue;
  const int R = Hq / Hk;
  DecodeArgs a{q, k, v, lengths, out, ws, Hq, Hk, R, RG, S, D, sb, sh, ss, splits, scale, table, packs, B};
  if (plan.persist) {
    if (!plan.mma || splits != 1 || plan.blocks < 1 || plan.slots < 1 || plan.items < 1 || !ws.o || !ws.count)
      return cudaErrorInvalidValue;
    const int nrp = std::min(kMmaHeads, R);
    PersistArgs pa{a, B, nrp, plan.slots, plan.chunk, plan.items};
    void* pargs[] = {&pa};
    const void* pf = persist_kernel_for(dt, D);
    if (!pf) return cudaErrorInvalidValue;
    return cleared(cudaLaunchKernel(pf, dim3((unsigned)plan.blocks), dim3(32), pargs, persist_smem(D, nrp), stream));
  }
  const int64_t per_split = packs != nullptr && plan.blocks > 0 ? plan.blocks : (int64_t)B * Hk * RG;
  const dim3 grid((unsigned)per_split, (unsigned)splits);
  void* args[] = {&a};
  const void* f = nullptr;
  size_t smem = 0;
  if (plan.mma) {
    smem = mma_smem(D, kv8);
    f = mma_kernel_for(dt, D, kv8, packs != nullptr);
  } else {
    f = kernel_for(dt, D, R);
  }
  if (!f) return cudaErrorInvalidValue;
  return cleared(cudaLaunchKernel(f, grid, dim3(kThreads), args, smem, stream));
}

}  // namespace fw

namespace {

// ------------------------------------------------------------------ decode attention
Tensor run_decode(const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& lengths, int64_t S, int64_t sb,
                  int64_t sh, int64_t ss, fw::DecodeTable table, double scale, bool kv8 = false,
                  const int64_t* packs = nullptr);

Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                        double scale) {
  check_cuda(q, "decode_attention", "q");
  c10::cuda::CUDAGuard guard(q.device());
  (void)dtype_of(q, "decode_attention", "q");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "fw::decode_attention: q, k_cache and v_cache must share a dtype");
  const int64_t Hq = q.size(1), D = q.size(2), Hk = k_cache.size(1), S = k_cache.size(2);
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
  return run_decode(q, kc, vc, lengths, S, kc.stride(0), kc.stride(1), kc.stride(2), {nullptr, 0, 0, 0}, scale);
}

// The launch shared by the contiguous and the paged cache: q [B, Hq, D], K/V addressed as described at DecodeTable.
Tensor run_decode(const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& lengths, int64_t S, int64_t sb,
                  int64_t sh, int64_t ss, fw::DecodeTable table, double scale, bool kv8, const int64_t* packs) {
  const auto dt = dtype_of(q, "decode_attention", "q");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hk = kc.size(1);
  auto qc = q.contiguous();
  if (reinterpret_cast<uintptr_t>(qc.data_ptr()) % 16 != 0) qc = qc.clone(at::MemoryFormat::Contiguous);
  auto len = lengths.to(at::kLong).contiguous();
  auto out = at::empty({B, Hq, D}, q.options());
  if (B == 0 || Hq == 0) return out;  // nothing to attend (and no blocks to split over)
  const fw::DecodePlan plan = fw::decode_attention_plan(dt, (int)B, (int)Hq, (int)Hk, (int)S, (int)D, sm_count(),
                                                         table.table != nullptr, kv8, packs != nullptr);
  const int splits = plan.splits;
  auto stream = at::cuda::getCurrentCUDAStream();
  fw::DecodeWorkspace w{nullptr, nullptr, nullptr, nullptr};
  // Split counters: one int per (b, kv head, head group), reset by the last block of each group; for the persistent
  // kernel its item and warps-done counters (reset by its last warp) ahead of them.
  Tensor ws, local_counters;
  if (plan.persist) {
    const int64_t parts = (int64_t)plan.slots * std::min<int64_t>(16, Hq / Hk);
    ws = at::empty({parts * D + 2 * parts}, q.options().dtype(at::kFloat));
    float* base = ws.data_ptr<float>();
    w = {base, base + parts * D, base + parts * D + parts,
         zeroed_counters(fw::kDecodeCounterHead + B * Hk * plan.groups, q, stream, local_counters)};
  } else if (splits > 1) {
    const int64_t parts = B * Hq * splits;
    ws = at::empty({parts * D + 2 * parts}, q.options().dtype(at::kFloat));
    float* base = ws.data_ptr<float>();
    w = {base, base + parts * D, base + parts * D + parts,
         zeroed_counters(B * Hk * plan.groups, q, stream, local_counters)};
  }
  check_launch(fw::decode_attention(dt, qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), len.data_ptr<int64_t>(),
                                    out.data_ptr(), w, (int)B, (int)Hq, (int)Hk, (int)S, (int)D, sb, sh, ss, plan,
                                    (float)scale, stream, table, kv8, packs),
               "decode_attention");
  return out;
}

// Pools [num_blocks, Hk, block_size, D] (block_size a power of two), block_tables [B, M] int64: row b's position
// p is in block block_tables[b, p / block_size]. The pools are used in place (never copied): they must be
// contiguous in their last three dimensions and 16-byte aligned.
Tensor paged_decode_attention(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool, const Tensor& block_tables,
                              const Tensor& lengths, double scale, const std::optional<Tensor>& packs) {
  check_cuda(q, "paged_decode_attention", "q");
  c10::cuda::CUDAGuard guard(q.device());
  (void)dtype_of(q, "paged_decode_attention", "q");
  const bool kv8 = k_pool.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(v_pool.scalar_type() == k_pool.scalar_type() && (kv8 || k_pool.scalar_type() == q.scalar_type()),
              "fw::paged_decode_attention: k_pool and v_pool must be float8_e4m3fn or q's dtype, got ",
              k_pool.scalar_type(), " and ", v_pool.scalar_type(), " for q ", q.scalar_type());
  const int64_t D = q.size(2), Hq = q.size(1), Hk = k_pool.size(1), bs = k_pool.size(2);
  TORCH_CHECK(!kv8 || ((q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) && (D == 64 || D == 128) &&
                       Hk > 0 && Hq % Hk == 0 && Hq / Hk >= 2),
              "fw::paged_decode_attention: float8_e4m3fn pools take a bfloat16 or float16 q, head_dim 64 or 128 and 2 "
              "or more query heads a kv head; got ", q.scalar_type(), ", head_dim ", D, ", ", Hq, " / ", Hk, " heads");
  TORCH_CHECK(D > 0 && D <= 256 && D % 8 == 0,
              "fw::paged_decode_attention: the CUDA kernel takes a head_dim that is a multiple of 8 up to 256, got ", D);
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0, "fw::paged_decode_attention: Hq must be a multiple of Hk, got ", Hq, " / ", Hk);
  TORCH_CHECK(bs > 0 && (bs & (bs - 1)) == 0, "fw::paged_decode_attention: block_size must be a power of two, got ",
              bs);
  TORCH_CHECK(k_pool.strides() == v_pool.strides(), "fw::paged_decode_attention: k_pool and v_pool strides differ");
  TORCH_CHECK(k_pool.stride(3) == 1 && k_pool.stride(2) == D && k_pool.stride(1) == bs * D,
              "fw::paged_decode_attention: the pools must be contiguous within a block");
  const int64_t vec = 16 / k_pool.element_size();
  TORCH_CHECK(k_pool.stride(0) % vec == 0 && reinterpret_cast<uintptr_t>(k_pool.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(v_pool.data_ptr()) % 16 == 0,
              "fw::paged_decode_attention: the pools must be 16-byte aligned");
  TORCH_CHECK(block_tables.device() == q.device() && lengths.device() == q.device(),
              "fw::paged_decode_attention: block_tables and lengths must be on q's device");
  auto tables = block_tables.to(at::kLong).contiguous();
  Tensor pk;
  if (packs.has_value() && packs->numel() > 0) {
    TORCH_CHECK(packs->device() == q.device() && packs->scalar_type() == at::kLong && packs->dim() == 2 &&
                    packs->size(0) == q.size(0) && packs->size(1) == 3,
                "fw::paged_decode_attention: packs must be int64 [B, 3] on q's device, got ", packs->sizes());
    pk = packs->contiguous();
  }
  int shift = 0;
  while ((1LL << shift) < bs) ++shift;
  const fw::DecodeTable table{tables.data_ptr<int64_t>(), tables.size(1), shift, k_pool.stride(0)};
  return run_decode(q, k_pool, v_pool, lengths, tables.size(1) * bs, 0, k_pool.stride(1), k_pool.stride(2), table,
                    scale, kv8, pk.defined() ? pk.data_ptr<int64_t>() : nullptr);
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("paged_decode_attention", &paged_decode_attention);
}
