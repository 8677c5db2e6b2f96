// Sampler: one block per row of logits. z = logits / temperature.
//  pass 1: max and logsumexp of z (the behaviour logprob is under this FULL softmax);
//  top-k with k <= kCand (the usual case): pass 1 also counts keys per quarter-octave bin, pass 2 gathers
//         the keys of the k-th largest key's bin and above into shared memory, which are sorted there;
//         tau_k, top-p (prefix sums of the sorted top-k mass), min-p and the draw then touch only them.
//         Too many keys in that bin (e.g. massive ties) falls back to the full-row path:
//  full-row path: top-k by radix select (4 passes of 8-bit digits over order-preserving keys) of the k-th
//         largest z; top-p: the mass of the top-k set, then a radix select on mass for the largest
//         threshold whose tail holds top_p of it; min-p: threshold max z + log(min_p);
//  the draw: Gumbel-max over z >= threshold with Philox4x32-10 noise keyed by the seed, counter
//  (col / 4, c1, c2, 0), word col % 4, where (c1, c2) is the row's counters pair or (row, 0) without
//  counters (the same stream as gumbel_noise in ops_cuda/sample.py).
// temperature 0: greedy (first maximum), logprob under the unscaled softmax.
// Without top-k / top-p / min-p (and for greedy) no threshold is needed: the row is split over several
// blocks (one pass, no noise) that write each part's max and sum of exp (and greedy's argmax). Greedy merges
// them in a small kernel; plain sampling draws by inverse CDF with one Philox uniform a row (counter
// (c1, c2, 1, 0), 53 bits, as row_uniform53 in ops_cuda/sample.py): the part whose running mass passes u times
// the row's mass, then the column within it, rescanning that part only. A NaN logit carries no mass in either
// pass, as -inf does (plain_mass in ops_cuda/sample.py), and makes the row's logprob NaN.
#include <cmath>

#include "common.cuh"
#include "torch_utils.h"

namespace fw {

// logits [B, V] (row stride in elements) -> tokens int64 [B], logprob fp32 [B]. Plain sampling and greedy
// split each row over P blocks; the workspace holds 4 floats and 1 int64 per (row, part).
struct SampleSplitWorkspace {
  int P;
  float* part_f;     // [B, P, 4]: max, sum of exp, greedy's best value, whether the part holds a NaN
  int64_t* part_i;   // [B, P]
};
int sample_split_parts(int B, int64_t V, int sm_count, bool draw);
cudaError_t sample(DType dt, const void* logits, int64_t row_stride, int64_t* tokens, float* logprob, int B,
                   int64_t V, float temperature, int64_t top_k, float top_p, float log_min_p, bool use_min_p,
                   uint64_t seed, const int64_t* counters, SampleSplitWorkspace split_ws, cudaStream_t stream);

}  // namespace fw

namespace fw {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ uint32_t ordered_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_to_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
  }
  return c;
}

__device__ __forceinline__ float gumbel(uint32_t x) {
  const float u = ((float)(x >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -logf(-logf(u));
}
struct ArgMax {
  float v;
  int64_t i;
};
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
  return a;
}

// A running max m and sum s of exp(z - m) over a set of z (-inf carries no mass), plus the best (value,
// index) pair of a second quantity: z itself for greedy, z + Gumbel noise for sampling.
struct RowStats {
  float m, s;
  ArgMax a;
};
__device__ __forceinline__ void stats_add(RowStats& st, float z) {
  if (z == -INFINITY) return;  // a banned token: no mass, never the max
  if (z > st.m) {
    st.s = st.s * expf(st.m - z) + 1.f;
    st.m = z;
  } else {
    st.s += expf(z - st.m);
  }
}
__device__ __forceinline__ RowStats merge(RowStats x, RowStats y) {
  const float M = fmaxf(x.m, y.m);
  RowStats r;
  r.s = (M == -INFINITY) ? 0.f : x.s * expf(x.m - M) + y.s * expf(y.m - M);
  r.m = M;
  r.a = better(x.a, y.a);
  return r;
}
// Merge over the warp; every lane gets the result (merge is commutative, so all lanes end with the same value).
__device__ __forceinline__ RowStats warp_reduce_stats(RowStats st) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    RowStats t;
    t.m = __shfl_xor_sync(0xffffffffu, st.m, o);
    t.s = __shfl_xor_sync(0xffffffffu, st.s, o);
    t.a.v = __shfl_xor_sync(0xffffffffu, st.a.v, o);
    t.a.i = __shfl_xor_sync(0xffffffffu, st.a.i, o);
    st = merge(st, t);
  }
  return st;
}


// Merge over the block (the one copy of this reduction: the row kernel, the split kernel, the candidate
// draw); `smem` holds 32 RowStats; every thread gets the result. `none` is the index of an empty ArgMax.
__device__ __forceinline__ RowStats block_reduce_stats(RowStats st, RowStats* smem, int64_t none) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  st = warp_reduce_stats(st);
  __syncthreads();  // smem may still be read by a previous call
  if (lane == 0) smem[warp] = st;
  __syncthreads();
  st = lane < warps ? smem[lane] : RowStats{-INFINITY, 0.f, {-INFINITY, none}};
  return warp_reduce_stats(st);
}

// Exclusive prefix sum over the threads of the block (in thread order); `smem` holds 32 U; *total gets the
// block total (every thread).
template <typename U>
__device__ __forceinline__ U block_exclusive_scan(U v, U* smem, U* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  U inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const U y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  U ex = __shfl_up_sync(0xffffffffu, inc, 1);
  if (lane == 0) ex = U(0);
  __syncthreads();  // smem may still be read by a previous call
  if (lane == 31) smem[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    U w = lane < warps ? smem[lane] : U(0);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const U y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < warps) smem[lane] = w;  // inclusive prefix of the warp totals
  }
  __syncthreads();
  *total = smem[warps - 1];
  return (warp ? smem[warp - 1] : U(0)) + ex;
}

// Calls f(i, float(x[i])) for every column i < V of a row: 16-byte loads, several in flight per thread
// (memory-level parallelism: one block streams a whole row), when the row start is 16-byte aligned; a
// scalar loop for the tail and for unaligned rows. U * N = 16 elements per step (more spills registers
// in the 1024-thread sampler with 2-byte types).
template <int NT, typename T, typename F>
__device__ __forceinline__ void for_row(const T* __restrict__ x, int64_t V, F&& f) {
  constexpr int N = 16 / sizeof(T), U = 16 / N;
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(x) & 15u) == 0) {
    const int64_t nvec = V / N;
    for (int64_t b = threadIdx.x; b < nvec; b += (int64_t)U * NT) {
      Vec<T, N> v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (b + u * NT < nvec) v[u] = load_vec<T, N>(x + (b + u * NT) * N);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (b + u * NT < nvec) {
#pragma unroll
          for (int j = 0; j < N; ++j) f((b + u * NT) * N + j, to_f(v[u].v[j]));
        }
    }
    done = nvec * N;
  }
  for (int64_t i = done + threadIdx.x; i < V; i += NT) f(i, to_f(x[i]));
}

// Candidate path (top-k set, k <= kCand): pass 1 also builds a histogram of the top kBinBits bits of the
// order-preserving keys (sign, exponent, 2 mantissa bits: quarter-octave bins, so the k-th largest key's
// bin usually holds few keys); a second pass gathers every key in that bin or above (n of them, all
// ties of the k-th included) into shared memory when n <= kCand; the rest (exact tau_k, top-p over the
// top-k set, min-p, the Gumbel draw) runs on those n only. A larger n takes the full-row path.
constexpr int kCand = 4 * kThreads;  // 4 sorted candidates per thread for the top-p prefix sum
constexpr int kBinBits = 11, kBins = 1 << kBinBits;
static_assert(kBins == 2 * kThreads, "the bin search gives each thread two bins");

// The full-row top-p adds token masses (exp(z - max) <= 1) in fixed point, in units of 2^-40: integer adds
// give the same sums in any order, so a draw does not depend on which thread's atomic lands first (float adds
// would). A row's whole mass stays under 2^64 units up to 2^24 columns; a token under 2^-40 adds nothing.
constexpr double kMassUnit = 1099511627776.0;  // 2^40
__device__ __forceinline__ unsigned long long fixed_mass(float m) {
  return __double2ull_rn((double)m * kMassUnit);
}

// sample_kernel's shared memory, in one place so that its size is checked: static shared memory cannot pass
// 48 KiB, and some toolkits do not say so at compile time. cand (8 bytes a candidate) and bins hold most of it.
struct SampleShared {
  RowStats red[32];
  float red_f[32];
  uint32_t red_u[32];
  uint32_t hist[256];
  unsigned long long hmass[256];  // top-p's mass per digit, in kMassUnit units
  unsigned long long sel_remaining, mass_total;
  uint32_t sel_prefix, sel_mask;
  uint32_t bins[kBins];
  unsigned long long cand[kCand];  // key << 32 | column
  uint32_t s_bin, s_n, s_fill, s_nk, s_idx;
};
static_assert(sizeof(SampleShared) <= 48 * 1024,
              "sample_kernel's static shared memory passes 48 KiB: lower kCand (or kThreads, which sets it and "
              "kBins), or move SampleShared to dynamic shared memory with cudaFuncAttributeMaxDynamicSharedMemorySize");

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
sample_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t* __restrict__ tokens,
              float* __restrict__ out_logprob, int64_t V, float temperature, int64_t top_k, float top_p,
              float log_min_p, bool use_min_p, uint32_t k0, uint32_t k1, const int64_t* __restrict__ counters) {
  __shared__ SampleShared sh;
  RowStats* red = sh.red;
  float* red_f = sh.red_f;
  uint32_t* red_u = sh.red_u;
  uint32_t* hist = sh.hist;
  unsigned long long* hmass = sh.hmass;
  uint32_t* bins = sh.bins;
  unsigned long long* cand = sh.cand;
  uint32_t &sel_prefix = sh.sel_prefix, &sel_mask = sh.sel_mask, &s_bin = sh.s_bin, &s_n = sh.s_n,
           &s_fill = sh.s_fill, &s_nk = sh.s_nk, &s_idx = sh.s_idx;
  unsigned long long &sel_remaining = sh.sel_remaining, &mass_total = sh.mass_total;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  const int t = threadIdx.x;
  const uint32_t c1 = counters ? (uint32_t)counters[2 * row] : (uint32_t)row;  // the row's noise stream
  const uint32_t c2 = counters ? (uint32_t)counters[2 * row + 1] : 0u;
  const bool greedy = temperature == 0.f;
  auto zat = [&](int64_t i) { return greedy ? to_f(x[i]) : to_f(x[i]) / temperature; };
  const bool cand_ok = !greedy && top_k > 0 && top_k <= kCand && top_k < V && V <= 0x7fffffff;

  if (cand_ok) {
    for (int i = t; i < kBins; i += kThreads) bins[i] = 0u;
    if (t == 0) s_fill = 0u;
    __syncthreads();
  }
  // pass 1: max and sum of exp (logsumexp), the argmax for greedy, the key histogram for the candidates
  RowStats st{-INFINITY, 0.f, {-INFINITY, V}};
  for_row<kThreads>(x, V, [&](int64_t i, float v) {
    const float z = greedy ? v : v / temperature;
    stats_add(st, z);
    if (greedy) st.a = better(st.a, ArgMax{z, i});  // only greedy uses the argmax
    if (cand_ok) atomicAdd(&bins[ordered_key(z) >> (32 - kBinBits)], 1u);
  });
  st = block_reduce_stats(st, red, V);
  const float zmax = st.m, lse = st.m + logf(st.s);
  if (greedy) {
    if (t == 0) {
      tokens[row] = st.a.i;
      out_logprob[row] = st.a.v - lse;
    }
    return;
  }

  if (cand_ok) {
    // the bin of the k-th largest key, counting from the top bin down: thread t holds bins
    // kBins-1-2t and kBins-2-2t, so an exclusive scan over threads counts the keys in higher bins
    const uint32_t k = (uint32_t)top_k;
    const uint32_t c_hi = bins[kBins - 1 - 2 * t], c_lo = bins[kBins - 2 - 2 * t];
    uint32_t all;
    const uint32_t above = block_exclusive_scan(c_hi + c_lo, red_u, &all);
    if (above < k && above + c_hi >= k) {
      s_bin = kBins - 1 - 2 * t;
      s_n = above + c_hi;
    } else if (above + c_hi < k && above + c_hi + c_lo >= k) {
      s_bin = kBins - 2 - 2 * t;
      s_n = above + c_hi + c_lo;
    }
    __syncthreads();
    const uint32_t n = s_n;
    if (n <= (uint32_t)kCand) {  // block-uniform
      const uint32_t lo = s_bin << (32 - kBinBits);
      // pass 2: gather; the keys are recomputed exactly as in pass 1, so exactly n of them are >= lo
      for_row<kThreads>(x, V, [&](int64_t i, float v) {
        const uint32_t key = ordered_key(v / temperature);
        if (key >= lo) {
          const uint32_t p = atomicAdd(&s_fill, 1u);
          if (p < (uint32_t)kCand) cand[p] = ((unsigned long long)key << 32) | (uint32_t)i;
        }
      });
      const uint32_t np2 = 1u << (32 - __clz((int)n - 1));  // n >= k >= 1; np2 <= kCand
      for (uint32_t p = n + t; p < np2; p += kThreads) cand[p] = 0ull;  // below every real key
      __syncthreads();
      // bitonic sort, descending (key first; ties in any order)
      for (uint32_t size = 2; size <= np2; size <<= 1) {
        for (uint32_t stride = size >> 1; stride > 0; stride >>= 1) {
          for (uint32_t q = t; q < np2 / 2; q += kThreads) {
            const uint32_t a = 2 * q - (q & (stride - 1)), b = a + stride;
            const unsigned long long xa = cand[a], xb = cand[b];
            if (((a & size) == 0) ? xa < xb : xa > xb) {
              cand[a] = xb;
              cand[b] = xa;
            }
          }
          __syncthreads();
        }
      }
      // tau_k = the k-th largest; nk = the top-k set with every tie of tau_k (the last position >= it)
      const uint32_t key_k = (uint32_t)(cand[k - 1] >> 32);
      for (uint32_t p = k - 1 + t; p < n; p += kThreads)
        if (p + 1 == n || (uint32_t)(cand[p + 1] >> 32) < key_k) {
          if ((uint32_t)(cand[p] >> 32) >= key_k) s_nk = p + 1;
        }
      __syncthreads();
      const uint32_t nk = s_nk;
      float tau = key_to_float(key_k);
      float zc[4];  // thread t holds sorted positions 4t .. 4t+3
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t p = 4 * t + j;
        zc[j] = p < nk ? key_to_float((uint32_t)(cand[p] >> 32)) : -INFINITY;
      }
      if (top_p < 1.f) {
        // the reference's top-p: cum = prefix sums of exp(z - zmax) in descending order over the top-k
        // set, need = top_p * its total, tau_p = z at the first position with cum >= need
        float c[4], local = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          local += zc[j] == -INFINITY ? 0.f : expf(zc[j] - zmax);
          c[j] = local;
        }
        if (t == 0) s_idx = nk - 1;  // rounding left need out of reach: keep the whole top-k set
        float total;
        const float base = block_exclusive_scan(local, red_f, &total);
        const float need = top_p * total;
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (4u * t + j < nk && base + c[j] >= need) atomicMin(&s_idx, 4u * t + j);
        __syncthreads();
        tau = fmaxf(tau, key_to_float((uint32_t)(cand[s_idx] >> 32)));
      }
      if (use_min_p) tau = fmaxf(tau, zmax + log_min_p);
      // Gumbel-max over the kept candidates, same Philox stream as the full-row draw
      RowStats pick{-INFINITY, 0.f, {-INFINITY, V}};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t p = 4 * t + j;
        if (p < nk && zc[j] >= tau) {
          const uint32_t col = (uint32_t)cand[p];
          const uint4 r = philox4x32_10(make_uint4(col >> 2, c1, c2, 0u), k0, k1);
          const uint32_t w = (col & 3u) == 0 ? r.x : ((col & 3u) == 1 ? r.y : ((col & 3u) == 2 ? r.z : r.w));
          pick.a = better(pick.a, ArgMax{zc[j] + gumbel(w), (int64_t)col});
        }
      }
      pick = block_reduce_stats(pick, red, V);
      if (t == 0) {
        const int64_t tok = pick.a.i < V ? pick.a.i : 0;
        tokens[row] = tok;
        out_logprob[row] = zat(tok) - lse;
      }
      return;
    }
  }

  // full-row path: radix selects over the whole row
  float tau = -INFINITY;
  if (top_k > 0 && top_k < V) {  // radix select of the k-th largest key, most significant digit first
    if (t == 0) {
      sel_prefix = 0u;
      sel_mask = 0u;
      sel_remaining = 0ull;
    }
    int64_t remaining = top_k;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = t; i < 256; i += kThreads) hist[i] = 0u;
      __syncthreads();
      const uint32_t prefix = sel_prefix, mask = sel_mask;
      for_row<kThreads>(x, V, [&](int64_t, float v) {
        const uint32_t key = ordered_key(v / temperature);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
      });
      __syncthreads();
      if (t == 0) {
        int64_t cum = 0;
        int d = 255;
        for (; d > 0; --d) {
          if (cum + hist[d] >= remaining) break;
          cum += hist[d];
        }
        remaining -= cum;
        sel_prefix = prefix | ((uint32_t)d << shift);
        sel_mask = mask | (255u << shift);
      }
      __syncthreads();
    }
    tau = key_to_float(sel_prefix);
  }
  if (top_p < 1.f) {
    if (t == 0) mass_total = 0ull;
    __syncthreads();
    unsigned long long part = 0ull;  // mass of the tokens top-k keeps, each term as the digit passes add it
    for_row<kThreads>(x, V, [&](int64_t, float v) {
      const float z = v / temperature;
      if (z >= tau) part += fixed_mass(expf(z - zmax));
    });
    atomicAdd(&mass_total, part);
    __syncthreads();
    if (t == 0) {
      sel_prefix = 0u;
      sel_mask = 0u;
      // at least one unit, so the digit search stops only at a digit that holds mass
      sel_remaining = max(1ull, __double2ull_rn((double)top_p * (double)mass_total));
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = t; i < 256; i += kThreads) hmass[i] = 0ull;
      __syncthreads();
      const uint32_t prefix = sel_prefix, mask = sel_mask;
      for_row<kThreads>(x, V, [&](int64_t, float v) {
        const float z = v / temperature;
        const uint32_t key = ordered_key(z);
        if (z >= tau && (key & mask) == prefix) atomicAdd(&hmass[(key >> shift) & 255u], fixed_mass(expf(z - zmax)));
      });
      __syncthreads();
      if (t == 0) {
        // The digits' masses sum exactly to what the prefix holds, which is at least sel_remaining (the row's
        // total at the first digit, the chosen digit's mass after it), so the search stops at some d >= 0.
        unsigned long long cum = 0ull;
        int d = 255;
        for (; d > 0; --d) {
          if (cum + hmass[d] >= sel_remaining) break;
          cum += hmass[d];
        }
        sel_remaining -= cum;
        sel_prefix = prefix | ((uint32_t)d << shift);
        sel_mask = mask | (255u << shift);
      }
      __syncthreads();
    }
    tau = fmaxf(tau, key_to_float(sel_prefix));
  }
  if (use_min_p) tau = fmaxf(tau, zmax + log_min_p);

  // last pass: Gumbel-max over the allowed tokens; each thread draws 4 consecutive columns per Philox call
  RowStats pick{-INFINITY, 0.f, {-INFINITY, V}};
  for (int64_t c4 = t; c4 * 4 < V; c4 += kThreads) {
    const uint4 r = philox4x32_10(make_uint4((uint32_t)c4, c1, c2, 0u), k0, k1);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t i = c4 * 4 + j;
      if (i < V) {
        const float z = zat(i);
        const uint32_t w = j == 0 ? r.x : (j == 1 ? r.y : (j == 2 ? r.z : r.w));
        if (z >= tau) pick.a = better(pick.a, ArgMax{z + gumbel(w), i});
      }
    }
  }
  pick = block_reduce_stats(pick, red, V);
  if (t == 0) {  // nothing picked only when the row is all NaN
    const int64_t tok = pick.a.i < V ? pick.a.i : 0;
    tokens[row] = tok;
    out_logprob[row] = zat(tok) - lse;
  }
}

// Plain sampling (no top-k / top-p / min-p) and greedy need no row-wide threshold, so a row is split over
// P blocks: each writes its part's max and sum of exp(z - max) (and greedy's argmax); sample_combine_kernel
// merges greedy's parts, sample_icdf_kernel draws from plain sampling's. A thread takes 8 columns at a time: one
// or two 16-byte loads where the row start is 16-byte aligned, one rescale of the running sum per 8 columns, the
// fast exp (its argument z - max is <= 0; its error, 2 + floor(1.173 |x|) ulp in CUDA's table, grows only as the
// term shrinks against the max's 1). z = x * (1 / T) is within an ulp of the x / T that the logprob and the
// reference (ops_cuda/sample.py) compute. A NaN logit adds no mass (col_mass) and is never the max; the part
// records that it saw one, which makes the row's logprob NaN.
constexpr int kSplitThreads = 256, kSplitCols = 8;

// Column z's mass against the running max m, the one definition of the split kernel and of the draw's rescan:
// exp(z - m), and none for -inf (a banned token, or a column past the end) or NaN, as plain_mass in
// ops_cuda/sample.py gives them none. A finite z gives the same bits as a plain __expf(z - m), and -inf the same
// 0, so rows without NaN sum as they would without the check.
__device__ __forceinline__ float col_mass(float z, float m) {
  return z == -INFINITY || isnan(z) ? 0.f : __expf(z - m);
}

// The 8 columns of group c0 (c0 a multiple of kSplitCols) as z = x * inv_t, -inf past c_end: the split kernel
// and the draw's rescan of one part read a column the same way, so they compute the same terms.
template <typename T>
__device__ __forceinline__ void load_group(const T* __restrict__ x, int64_t c0, int64_t c_end, bool aligned,
                                           float inv_t, float (&z)[kSplitCols]) {
  constexpr int N = 16 / sizeof(T), NV = kSplitCols / N;  // columns a 16-byte load, loads a group
  if (aligned && c0 + kSplitCols <= c_end) {
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const Vec<T, N> v = load_vec<T, N>(x + c0 + n * N);
#pragma unroll
      for (int j = 0; j < N; ++j) z[n * N + j] = to_f(v.v[j]) * inv_t;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kSplitCols; ++j) z[j] = c0 + j < c_end ? to_f(x[c0 + j]) * inv_t : -INFINITY;
  }
}

template <typename T>
__global__ void __launch_bounds__(kSplitThreads)
sample_split_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t V, float temperature,
                    int64_t cols_per_block, float* __restrict__ part_f, int64_t* __restrict__ part_i) {
  __shared__ RowStats red[32];
  const int64_t row = blockIdx.x, P = gridDim.y;  // rows on x: up to 2^31 - 1 of them
  const T* x = logits + row * row_stride;
  const bool greedy = temperature == 0.f, aligned = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  const float inv_t = greedy ? 1.f : 1.f / temperature;
  // cols_per_block is a multiple of kSplitCols, so every group lies in one block's columns
  const int64_t c_begin = blockIdx.y * cols_per_block, c_end = min(V, c_begin + cols_per_block);
  RowStats st{-INFINITY, 0.f, {-INFINITY, V}};
  bool has_nan = false;  // whether this thread's columns hold a NaN
  for (int64_t g = c_begin / kSplitCols + threadIdx.x; g * kSplitCols < c_end; g += kSplitThreads) {
    const int64_t c0 = g * kSplitCols;
    float z[kSplitCols];
    load_group(x, c0, c_end, aligned, inv_t, z);
    // -inf (a banned token, or a column past the end) and NaN carry no mass and are never picked; fmaxf
    // leaves NaN out of the max, which is NaN only when every column is
    float mx = z[0];
#pragma unroll
    for (int j = 1; j < kSplitCols; ++j) mx = fmaxf(mx, z[j]);
#pragma unroll
    for (int j = 0; j < kSplitCols; ++j) has_nan |= isnan(z[j]);
    if (!(mx > -INFINITY)) continue;  // every column -inf or NaN
    if (mx > st.m) {
      st.s *= __expf(st.m - mx);  // 0 while st.m is still -inf
      st.m = mx;
    }
#pragma unroll
    for (int j = 0; j < kSplitCols; ++j) st.s += col_mass(z[j], st.m);
    if (greedy) {
#pragma unroll
      for (int j = 0; j < kSplitCols; ++j)
        if (z[j] != -INFINITY) st.a = better(st.a, ArgMax{z[j], c0 + j});
    }
  }
  st = block_reduce_stats(st, red, V);
  has_nan = __syncthreads_or(has_nan);
  if (threadIdx.x == 0) {
    const int64_t k = row * P + blockIdx.y;
    part_f[4 * k] = st.m;
    part_f[4 * k + 1] = st.s;
    part_f[4 * k + 2] = st.a.v;
    part_f[4 * k + 3] = has_nan ? 1.f : 0.f;
    part_i[k] = st.a.i;
  }
}

template <typename T>
__global__ void sample_combine_kernel(const T* __restrict__ logits, int64_t row_stride, int B, int64_t V,
                                      float temperature, int P, const float* __restrict__ part_f,
                                      const int64_t* __restrict__ part_i, int64_t* __restrict__ tokens,
                                      float* __restrict__ out_logprob) {
  const int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= B) return;
  float M = -INFINITY, S = 0.f;
  bool has_nan = false;  // a NaN logit makes the full softmax, and so the logprob, NaN
  ArgMax b{-INFINITY, V};
  for (int p = 0; p < P; ++p) M = fmaxf(M, part_f[4 * (row * P + p)]);
  for (int p = 0; p < P; ++p) {
    const int64_t k = row * P + p;
    if (part_f[4 * k + 1] > 0.f) S += part_f[4 * k + 1] * expf(part_f[4 * k] - M);
    if (part_i[k] < V) b = better(b, ArgMax{part_f[4 * k + 2], part_i[k]});
    has_nan |= part_f[4 * k + 3] != 0.f;
  }
  const int64_t tok = b.i < V ? b.i : 0;
  const float x = to_f(logits[row * row_stride + tok]);
  tokens[row] = tok;
  out_logprob[row] = has_nan ? NAN : (temperature == 0.f ? x : x / temperature) - (M + logf(S));
}

// The draw of plain sampling, one block a row, after sample_split_kernel (P <= kSplitThreads parts: thread p
// holds part p). The parts' sums, rescaled to the row's max, are scanned in float64; the part whose running
// mass passes u x the row's mass is drawn from: the block rescans its columns in tiles of kSplitThreads x
// kSplitCols, a float64 block scan of the threads' sums a tile, for the first column whose running mass (in the
// part's own scale exp(z - m_p)) exceeds what is left of the target. The running sums are float64 so that a
// column's share of the draw is its own float32 mass however much precedes it: a float32 running sum would drop
// the mass of columns below its rounding step. Rounding between the two passes' orders can leave
// the target past the rescanned part's mass: its last column with mass is drawn then, as a target past the
// row's mass takes the last part with mass. A row without mass (all -inf or NaN, or a +inf, where exp(inf - inf)
// is NaN) draws column 0. The logprob is the full softmax's: NaN where the row holds a NaN, and against a
// logsumexp of +inf where it holds a +inf.
template <typename T>
__global__ void __launch_bounds__(kSplitThreads)
sample_icdf_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t V, float temperature, uint32_t k0,
                   uint32_t k1, const int64_t* __restrict__ counters, int P, int64_t cols_per_block,
                   const float* __restrict__ part_f, int64_t* __restrict__ tokens, float* __restrict__ out_logprob) {
  __shared__ float scan[32];
  __shared__ double dscan[32];
  __shared__ int s_part, s_last_part;
  __shared__ float s_mp;
  __shared__ double s_r;
  __shared__ unsigned long long s_tok, s_last;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  const int t = threadIdx.x;
  const float inv_t = 1.f / temperature;
  if (t == 0) {
    s_part = 0x7fffffff;
    s_last_part = -1;
    s_tok = ~0ull;
    s_last = 0ull;
  }
  const float* pf = part_f + 4 * row * P;
  const float mp = t < P ? pf[4 * t] : -INFINITY, sp = t < P ? pf[4 * t + 1] : 0.f;
  const bool has_nan = __syncthreads_or(t < P && pf[4 * t + 3] != 0.f);
  const float M = block_max(mp, scan);
  // a row whose max is +inf has no mass: its part's sum is NaN (exp(inf - inf)), the others' scale 0
  const double scale = sp > 0.f && M != INFINITY ? (double)expf(mp - M) : 0.0;
  const double wp = scale > 0.0 ? (double)sp * scale : 0.0;
  double S;
  const double before = block_exclusive_scan(wp, dscan, &S);
  const float lse = has_nan ? NAN : (M == INFINITY ? INFINITY : M + (float)log(S));
  const uint32_t c1 = counters ? (uint32_t)counters[2 * row] : (uint32_t)row;  // the row's stream
  const uint32_t c2 = counters ? (uint32_t)counters[2 * row + 1] : 0u;
  const uint4 w = philox4x32_10(make_uint4(c1, c2, 1u, 0u), k0, k1);
  const uint64_t bits = (((uint64_t)w.x << 21) | (w.y >> 11)) & ((1ull << 53) - 1);  // 32 + 21 bits
  const double target = ((double)bits + 0.5) * 0x1p-53 * S;
  if (wp > 0.0) {
    if (before <= target && target < before + wp) atomicMin(&s_part, t);
    atomicMax(&s_last_part, t);
  }
  __syncthreads();
  const int chosen = s_part != 0x7fffffff ? s_part : s_last_part;
  if (t == chosen) {
    s_mp = mp;
    s_r = (target - before) / scale;   // what is left of the target, in the part's scale
  }
  __syncthreads();
  const int part = chosen;
  int64_t tok = 0;
  if (part >= 0) {
    const bool aligned = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
    const float mp = s_mp;
    const double r = s_r;
    const int64_t c_begin = part * cols_per_block, c_end = min(V, c_begin + cols_per_block);
    double done = 0.0;   // the mass of the part's tiles before this one
    int64_t mine = -1;   // this thread's last column with mass, for the fallback
    for (int64_t base = c_begin; base < c_end; base += (int64_t)kSplitThreads * kSplitCols) {
      const int64_t c0 = base + (int64_t)t * kSplitCols;
      float e[kSplitCols], z[kSplitCols];
      double local = 0.0;
      load_group(x, c0, c_end, aligned, inv_t, z);
#pragma unroll
      for (int j = 0; j < kSplitCols; ++j) {
        e[j] = col_mass(z[j], mp);
        local += e[j];
        if (e[j] > 0.f) mine = c0 + j;
      }
      double tile;
      const double excl = block_exclusive_scan(local, dscan, &tile);
      const double rest = r - done;
      if (local > 0.0 && excl <= rest && rest < excl + local) {
        double run = 0.0;
#pragma unroll
        for (int j = 0; j < kSplitCols; ++j) {
          run += e[j];
          if (e[j] > 0.f && excl + run > rest) {
            atomicMin(&s_tok, (unsigned long long)(c0 + j));
            break;
          }
        }
      }
      __syncthreads();
      if (s_tok != ~0ull) break;  // block-uniform: read after the barrier
      done += tile;
    }
    if (s_tok == ~0ull) {  // block-uniform
      if (mine >= 0) atomicMax(&s_last, (unsigned long long)(mine + 1));
      __syncthreads();
    }
    tok = s_tok != ~0ull ? (int64_t)s_tok : (s_last > 0ull ? (int64_t)s_last - 1 : c_begin);
  }
  if (t == 0) {
    tokens[row] = tok;
    out_logprob[row] = to_f(x[tok]) / temperature - lse;
  }
}

}  // namespace

int sample_split_parts(int B, int64_t V, int sm_count, bool draw) {
  const int64_t most = (V + 4095) / 4096;  // at least 4096 columns per block
  // Plain sampling: parts of about 4096 columns, so that the draw rescans few columns a row. Greedy: a grid of
  // about 8 blocks per SM, fewer parts a row as rows grow.
  int64_t P = draw ? most : (8 * (int64_t)sm_count + B - 1) / B;
  if (P > most) P = most;
  if (draw && P > kSplitThreads) P = kSplitThreads;  // sample_icdf_kernel holds a part a thread
  if (P > 65535) P = 65535;
  return (int)(P < 1 ? 1 : P);
}

cudaError_t sample(DType dt, const void* logits, int64_t row_stride, int64_t* tokens, float* logprob, int B,
                   int64_t V, float temperature, int64_t top_k, float top_p, float log_min_p, bool use_min_p,
                   uint64_t seed, const int64_t* counters, SampleSplitWorkspace split_ws, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  const uint32_t k0 = (uint32_t)(seed & 0xffffffffu), k1 = (uint32_t)(seed >> 32);
  const bool plain = temperature == 0.f || ((top_k <= 0 || top_k >= V) && top_p >= 1.f && !use_min_p);
  if (plain && split_ws.part_f != nullptr) {
    return dispatch(dt, [&](auto t) -> cudaError_t {
      using T = decltype(t);
      // whole groups of kSplitCols columns a block
      const int64_t cols = ((V + split_ws.P - 1) / split_ws.P + kSplitCols - 1) / kSplitCols * kSplitCols;
      const cudaError_t e = launch_plain(sample_split_kernel<T>, dim3((unsigned)B, (unsigned)split_ws.P),
                                         kSplitThreads, 0, stream, (const T*)logits, row_stride, V, temperature, cols,
                                         split_ws.part_f, split_ws.part_i);
      if (e != cudaSuccess) return e;
      if (temperature == 0.f)
        return launch_plain(sample_combine_kernel<T>, (unsigned)((B + 127) / 128), 128, 0, stream, (const T*)logits,
                            row_stride, B, V, temperature, split_ws.P, split_ws.part_f, split_ws.part_i, tokens,
                            logprob);
      return launch_plain(sample_icdf_kernel<T>, (unsigned)B, kSplitThreads, 0, stream, (const T*)logits, row_stride,
                          V, temperature, k0, k1, counters, split_ws.P, cols, split_ws.part_f, tokens, logprob);
    });
  }
  return dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    return launch_plain(sample_kernel<T>, (unsigned)B, kThreads, 0, stream, (const T*)logits, row_stride, tokens,
                        logprob, V, temperature, top_k, top_p, log_min_p, use_min_p, k0, k1, counters);
  });
}

}  // namespace fw

namespace {

// ------------------------------------------------------------------ sampler
std::tuple<Tensor, Tensor> sample(const Tensor& logits, double temperature, int64_t top_k, double top_p,
                                  double min_p, int64_t seed, const std::optional<Tensor>& counters) {
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
  const int P = fw::sample_split_parts((int)B, V, sm_count(), temperature > 0.0);
  auto part_f = at::empty({B * P * 4}, x.options().dtype(at::kFloat));
  auto part_i = at::empty({B * P}, x.options().dtype(at::kLong));
  fw::SampleSplitWorkspace ws{P, part_f.data_ptr<float>(), part_i.data_ptr<int64_t>()};
  Tensor ctr;
  if (counters.has_value()) {
    TORCH_CHECK(counters->dim() == 2 && counters->size(0) == B && counters->size(1) == 2,
                "fw::sample: counters must be [B, 2]");
    TORCH_CHECK(counters->device() == x.device(), "fw::sample: counters must be on the logits' device");
    ctr = counters->to(at::kLong).contiguous();
  }
  check_launch(fw::sample(dt, x.data_ptr(), x.stride(0), tokens.data_ptr<int64_t>(), lp.data_ptr<float>(), (int)B, V,
                          (float)temperature, top_k, (float)top_p, log_min_p, use_min_p, (uint64_t)seed,
                          ctr.defined() ? ctr.data_ptr<int64_t>() : nullptr, ws,
                          at::cuda::getCurrentCUDAStream()),
               "sample");
  return {tokens, lp};
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) {
  m.impl("sample", &sample);
}
