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
#include <cstdlib>

#include "common.cuh"

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

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const int n = pred ? 16 : 0;  // 0: no global read, the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

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
};

// Resident blocks an SM must hold (the register cap, the tightest that compiles without spills for sm_90):
// enough warps to keep K/V bytes in flight.
template <typename T, int DP, int RP> constexpr int min_blocks() {
  return RP == 8 ? (DecodeShape<T, DP, RP>::E == 8 ? 2 : 3) : RP == 4 ? 4 : 8;
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
        const int64_t off = ok ? p * a.ss + sub * E : 0;
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
  const int64_t hq0 = (int64_t)b * a.Hq + (int64_t)g * a.R + r0;  // first query head of the group
  for (int idx = tid; idx < nr * D; idx += kThreads) {
    const int r = idx / D, d = idx - r * D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, red_m[w * RP + r]);
    const float Ms = M == -INFINITY ? 0.f : M;
    float O = 0.f, L = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float c = exp2f(red_m[w * RP + r] - Ms);
      O += red_acc[(w * RP + r) * DP + d] * c;
      L += red_l[w * RP + r] * c;
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

// RP: query heads per block; the head groups of a kv head are ceil(R / RP).
int heads_per_block(int R) { return (R == 1 || R == 2 || R == 4) ? R : R == 3 ? 4 : 8; }
int padded_dim(int D) { return D <= 64 ? 64 : D <= 128 ? 128 : 256; }

// A kernel instance, with the most shared memory per SM asked for once (L1 is not used: cp.async.cg goes to
// L2), so 8 blocks of ~25 KB fit. Not stream work, so a first call under graph capture is fine.
template <typename T, int DP, int RP, bool kFullD> const void* kernel() {
  static const bool carveout = [] {
    if (cudaFuncSetAttribute(decode_kernel<T, DP, RP, kFullD>, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared) != cudaSuccess)
      (void)cudaGetLastError();  // only a hint: the launch works without it
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

int decode_attention_groups(int Hq, int Hk) {
  const int R = Hq / Hk, RP = heads_per_block(R);
  return (R + RP - 1) / RP;
}

int decode_attention_splits(int B, int Hq, int Hk, int S, int sm_count) {
  if (B <= 0 || Hk <= 0 || S <= 0 || Hq % Hk != 0) return 1;
  // Splits only to reach about 3 blocks per SM: that many keep enough K/V copies in flight to saturate HBM,
  // and every further split adds partials to combine and a shorter pipeline per block. Measured on the H200
  // (python -m ops_cuda.bench.decode_splits: B x 8 kv heads, head_dim 128): B=64 is fastest with 512 blocks in
  // one split, B=16 with 4 to 8 splits, B=1 with 16; at least 64 positions a split, at most kMaxSplits.
  int most = (S + 63) / 64;
  most = most < 1 ? 1 : most > kMaxSplits ? kMaxSplits : most;
  const int forced = int_from_env("FW_DECODE_SPLITS", 0);  // a fixed split count, for sweeps (read per call)
  const int64_t base = (int64_t)B * Hk * decode_attention_groups(Hq, Hk), want = 3LL * sm_count;
  const int64_t s = forced > 0 ? forced : (want + base - 1) / base;
  return (int)(s < 1 ? 1 : s > most ? most : s);
}

cudaError_t decode_attention(DType dt, const void* q, const void* k, const void* v, const int64_t* lengths,
                             void* out, DecodeWorkspace ws, int B, int Hq, int Hk, int S, int D, int64_t sb,
                             int64_t sh, int64_t ss, int splits, float scale, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  if (Hk <= 0 || Hq % Hk != 0 || D <= 0 || D > 256 || D % 8 != 0 || splits < 1 || splits > kMaxSplits)
    return cudaErrorInvalidValue;
  const int R = Hq / Hk, RG = decode_attention_groups(Hq, Hk);
  DecodeArgs a{q, k, v, lengths, out, ws, Hq, Hk, R, RG, S, D, sb, sh, ss, splits, scale};
  const dim3 grid((unsigned)((int64_t)B * Hk * RG), (unsigned)splits);
  void* args[] = {&a};
  const void* f = kernel_for(dt, D, R);
  if (!f) return cudaErrorInvalidValue;
  return cudaLaunchKernel(f, grid, dim3(kThreads), args, 0, stream);
}

}  // namespace fw
