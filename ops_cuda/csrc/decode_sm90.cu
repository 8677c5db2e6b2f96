// Decode attention on Hopper for batches that fill the GPU: a persistent kernel that streams the K/V cache through
// shared memory with bulk copies, the cache's rows cut into equal shares for the blocks.
//
// Why: with a block per (row, kv head) the ring kernel (decode_attention.cu) runs 8 blocks an SM, each copying 16
// bytes a thread; at B=256 it reached 95-98% of torch.compile's cuDNN kernel, which runs 2 blocks an SM (docs/
// PERFORMANCE.md run 6's profile). Here each SM has one or two blocks, each with one thread copying whole chunks of
// rows (kRows rows of K and of V, 16 KB each) into a ring of stages.
//
// Work: the units (b, kv head g, head group rg) in order, each cut into chunks of kRows rows, counting only rows
// below b's length. Block j of G takes chunks [j C / G, (j + 1) C / G) of the C in all (stream-K), so every block
// moves the same bytes whatever the lengths. A unit whose chunks lie in one block is finished there. A unit shared
// by blocks leaves a partial (max, sum, unnormalised output) from each, in the block's slot 0 (its first unit) or 1
// (its last), and the last of them to finish combines them: a counter per unit, which that block resets to 0 for the
// next launch (as the ring kernel's split counters).
//
// Block: warp kConsumerWarps is the producer, whose lane 0 issues each chunk's two bulk copies (the rows are
// contiguous: the cache's row stride is head_dim) into the ring, ordered by full/empty mbarriers; the consumer warps
// read the rows as the ring kernel reads its own (16-byte lane shares of a row, decode_step).
//
// Runs for bf16/fp16 caches with head_dim 64, 128 or 256 in rows of head_dim elements, up to 4 query heads a kv head
// and B <= kMaxRows (decode_stream_grid says when); everything else takes the ring kernel.
#include "decode_attention.cuh"
#include "sm90.cuh"

namespace fw {
namespace {

constexpr int kConsumerWarps = 8, kStreamThreads = (kConsumerWarps + 1) * 32, kMaxStages = 8, kMaxRows = 1024;
// a stage: a chunk's K and V rows, then the query rows of its unit (copied with a unit's first chunk in the block)
constexpr int kRowBytes = 32 * 1024, kQBytes = 4 * 256 * 2, kStageBytes = kRowBytes + kQBytes;

// LPP lanes a row (16 bytes each), PPW rows a warp, kSlots rows a consumer sub-step; a chunk is 4 sub-steps, taken
// U = 2 at a time (2 rows a lane).
template <int DP, int RP> struct StreamShape {
  static constexpr int E = 8, LPP = DP / E, PPW = 32 / LPP, kSlots = kConsumerWarps * PPW, kRows = 4 * kSlots;
  static constexpr int U = 2;
  static_assert(2 * kRows * DP * 2 == kRowBytes && RP * DP * 2 <= kQBytes, "a chunk fills a stage");
};

struct StreamArgs {
  const void* q;
  const void* k;
  const void* v;
  const int64_t* lengths;
  void* out;
  DecodeWorkspace ws;  // o [G, 2, RP, DP], m and l [G, 2, RP], count one int per unit
  int B, Hq, Hk, R, RG, S;
  int64_t sb, sh;
  int stages;
  float scale;
};

// The block holding chunk x when C chunks are cut into G shares: the last j with j C / G <= x.
__device__ __forceinline__ int64_t share_of(int64_t x, int64_t C, int64_t G) { return ((x + 1) * G + C - 1) / C - 1; }

// Where chunk x lies: chunk ci of the cb chunks of unit h (of H) of row b.
struct Cursor {
  int b, h, ci, cb;
  int64_t x;
  __device__ __forceinline__ void next(const int* pref, int H, int B) {
    ++x;
    if (++ci < cb) return;
    ci = 0;
    if (++h < H) return;
    h = 0;
    do ++b; while (b < B && pref[b + 1] == pref[b]);  // rows of length 0 have no chunk
    if (b < B) cb = pref[b + 1] - pref[b];
  }
};

template <typename T, int DP, int RP>
__global__ void __launch_bounds__(kStreamThreads, 1) decode_stream_kernel(StreamArgs a) {
#ifdef FW_SM90
  using Sh = StreamShape<DP, RP>;
  constexpr int E = Sh::E, LPP = Sh::LPP, PPW = Sh::PPW, kSlots = Sh::kSlots, kRows = Sh::kRows, U = Sh::U;
  constexpr int W = kConsumerWarps;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem;  // [stage]: K [kRows][DP], V [kRows][DP], q [RP][DP]
  float* red = reinterpret_cast<float*>(smem + a.stages * kStageBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(red + W * RP * (DP + 2));
  uint64_t* empty = full + kMaxStages;
  int* len = reinterpret_cast<int*>(empty + kMaxStages);  // [B]: lengths within [0, S]
  int* pref = len + a.B;                                  // [B + 1]: chunks a unit in the rows before b
  int* misc = pref + a.B + 1;                             // [0]: the first row of the share, [1]: last to arrive

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int H = a.Hk * a.RG;
  for (int b = tid; b < a.B; b += blockDim.x) {
    const int64_t n = a.lengths[b];
    len[b] = (int)(n < 0 ? 0 : n > a.S ? a.S : n);
  }
  if (tid == 0) {
    for (int s = 0; s < a.stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], W);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (warp == 0) {  // pref: an inclusive scan of chunks a unit, 32 rows at a time
    int run = 0;
    for (int b0 = 0; b0 < a.B; b0 += 32) {
      const int b = b0 + lane;
      int x = b < a.B ? (len[b] + kRows - 1) / kRows : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
      }
      if (b < a.B) pref[b + 1] = run + x;
      run += __shfl_sync(0xffffffffu, x, 31);
    }
    if (lane == 0) pref[0] = 0;
  }
  __syncthreads();

  // rows of length 0 have no chunk: their outputs are zeros, written by block b % gridDim.x
  const int64_t C = (int64_t)H * pref[a.B], G = C < gridDim.x ? C : gridDim.x;
  for (int b = blockIdx.x; b < a.B; b += gridDim.x) {
    if (len[b] != 0) continue;
    T* o = (T*)a.out + (int64_t)b * a.Hq * DP;
    for (int i = tid; i < a.Hq * DP; i += blockDim.x) o[i] = from_f<T>(0.f);
  }
  if (blockIdx.x >= G) return;
  const int64_t x0 = blockIdx.x * C / G, x1 = (blockIdx.x + 1) * C / G;
  for (int b = tid; b < a.B; b += blockDim.x) {
    if ((int64_t)H * pref[b] <= x0 && x0 < (int64_t)H * pref[b + 1]) misc[0] = b;
  }
  __syncthreads();
  Cursor c;
  c.b = misc[0];
  c.cb = pref[c.b + 1] - pref[c.b];
  {
    const int64_t local = x0 - (int64_t)H * pref[c.b];
    c.h = (int)(local / c.cb);
    c.ci = (int)(local - (int64_t)c.h * c.cb);
    c.x = x0;
  }

  if (warp == W) {  // producer: lane 0 copies each chunk's K rows and V rows
    if (lane != 0) return;
    for (int k = 0; c.x < x1; ++k, c.next(pref, H, a.B)) {
      const int s = k % a.stages;
      mbar_wait(&empty[s], ((k / a.stages) & 1) ^ 1);
      const int rows = min(kRows, len[c.b] - c.ci * kRows);
      const uint32_t bytes = (uint32_t)(rows * DP * sizeof(T));
      const int g = c.h / a.RG, r0 = (c.h - g * a.RG) * RP;
      const int64_t off = (int64_t)c.b * a.sb + (int64_t)g * a.sh + (int64_t)c.ci * kRows * DP;
      T* st = reinterpret_cast<T*>(ring + s * kStageBytes);
      const bool first = c.ci == 0 || c.x == x0;  // the consumers start the unit with this chunk: its q rows too
      const uint32_t qbytes = first ? (uint32_t)(min(RP, a.R - r0) * DP * sizeof(T)) : 0u;
      mbar_expect_tx(&full[s], 2 * bytes + qbytes);
      bulk_load(st, (const T*)a.k + off, bytes, &full[s]);
      bulk_load(st + kRows * DP, (const T*)a.v + off, bytes, &full[s]);
      if (first)
        bulk_load(st + 2 * kRows * DP, (const T*)a.q + ((int64_t)c.b * a.Hq + (int64_t)g * a.R + r0) * DP, qbytes,
                  &full[s]);
    }
    return;
  }

  // consumers
  const int sub = lane % LPP, slot = warp * PPW + lane / LPP;
  const int nthreads = W * 32;
  const float qscale = a.scale * 1.4426950408889634f;  // scores in base 2
  float qf[RP][E], acc[RP][E], m[RP], l[RP];
  bool fresh = true;  // the next chunk starts a unit (or this block's part of one)
  int64_t seg0 = x0;  // the first chunk of this block's part of the current unit
  for (int k = 0; c.x < x1; ++k) {
    const int g = c.h / a.RG, r0 = (c.h - g * a.RG) * RP, nr = min(RP, a.R - r0);
    const int s = k % a.stages;
    mbar_wait(&full[s], (k / a.stages) & 1);
    const T* ks = reinterpret_cast<const T*>(ring + s * kStageBytes) + sub * E;
    const T* vs = ks + kRows * DP;
    if (fresh) {
      const T* qrow = vs + kRows * DP;  // the producer copied the unit's q rows with this chunk
#pragma unroll
      for (int r = 0; r < RP; ++r) {
        Vec<T, E> qv;
        if (r < nr) qv = load_vec<T, E>(qrow + r * DP);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          qf[r][e] = r < nr ? to_f(qv.v[e]) * qscale : 0.f;
          acc[r][e] = 0.f;
        }
        m[r] = -INFINITY;
        l[r] = 0.f;
      }
      fresh = false;
      seg0 = c.x;
    }
    const int rows = min(kRows, len[c.b] - c.ci * kRows);
#pragma unroll
    for (int i = 0; i < 4; i += U) {
      // rows past `rows` hold stale or uninitialised bytes: their scores are masked and their V read as zeros
      decode_step<T, RP, E, LPP, U>(
          qf, acc, m, l, [&](int u) { return load_vec<T, E>(ks + ((i + u) * kSlots + slot) * DP); },
          [&](int u) {
            Vec<T, E> x = load_vec<T, E>(vs + ((i + u) * kSlots + slot) * DP);
            if ((i + u) * kSlots + slot >= rows) *reinterpret_cast<uint4*>(&x) = make_uint4(0, 0, 0, 0);
            return x;
          },
          [&](int u) { return (i + u) * kSlots + slot < rows; });
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);

    const bool unit_end = c.ci == c.cb - 1 || c.x == x1 - 1;
    const int b = c.b, h = c.h, cb = c.cb;
    const int64_t u0 = c.x - c.ci;  // the unit's first chunk
    c.next(pref, H, a.B);
    if (!unit_end) continue;
    fresh = true;

    // this block's part of the unit: merge the warps, then write the output or a partial
    decode_merge_slots<RP, E, LPP>(acc, m, l);
    decode_write_red<W, RP, E, LPP, DP>(red, warp, lane, acc, m, l);
    asm volatile("bar.sync 1, %0;" ::"r"(nthreads) : "memory");
    const bool whole = seg0 == u0 && u0 + cb <= x1;
    const int64_t hq0 = (int64_t)b * a.Hq + (int64_t)g * a.R + r0;
    const int mine = (int)blockIdx.x * 2 + (seg0 == x0 ? 0 : 1);  // this block's slot
    for (int idx = tid; idx < nr * DP; idx += nthreads) {
      const int r = idx / DP, d = idx - r * DP;
      float M, L, O;
      decode_read_red<W, RP, DP>(red, r, d, M, L, O);
      if (whole) {
        ((T*)a.out)[(hq0 + r) * DP + d] = from_f<T>(L > 0.f ? O / L : 0.f);
      } else {
        a.ws.o[((int64_t)mine * RP + r) * DP + d] = O;
        if (d == 0) {
          a.ws.m[mine * RP + r] = M;
          a.ws.l[mine * RP + r] = L;
        }
      }
    }
    if (!whole) {
      const int64_t j0 = share_of(u0, C, G), j1 = share_of(u0 + cb - 1, C, G);
      const int unit = b * H + h;
      __threadfence();  // the partial is visible device-wide before its arrival is counted
      asm volatile("bar.sync 1, %0;" ::"r"(nthreads) : "memory");
      if (tid == 0) {
        const int prev = atomicAdd(a.ws.count + unit, 1);
        misc[1] = prev == (int)(j1 - j0);
        if (misc[1]) a.ws.count[unit] = 0;  // every part has arrived: ready for the next launch / graph replay
      }
      asm volatile("bar.sync 1, %0;" ::"r"(nthreads) : "memory");
      if (misc[1]) {
        __threadfence();
        // slot of block j0: 0 if the unit is where its share starts, else 1; every later block's: 0
        const int first = (int)j0 * 2 + (j0 * C / G == u0 ? 0 : 1);
        for (int idx = tid; idx < nr * DP; idx += nthreads) {
          const int r = idx / DP, d = idx - r * DP;
          float M = -INFINITY;
          for (int64_t j = j0; j <= j1; ++j) {
            const int p = j == j0 ? first : (int)j * 2;
            M = fmaxf(M, __ldcg(a.ws.m + p * RP + r));
          }
          const float Ms = M == -INFINITY ? 0.f : M;
          float L = 0.f, O = 0.f;
          for (int64_t j = j0; j <= j1; ++j) {
            const int p = j == j0 ? first : (int)j * 2;
            const float w = exp2f(__ldcg(a.ws.m + p * RP + r) - Ms);
            L += __ldcg(a.ws.l + p * RP + r) * w;
            O += __ldcg(a.ws.o + ((int64_t)p * RP + r) * DP + d) * w;
          }
          ((T*)a.out)[(hq0 + r) * DP + d] = from_f<T>(L > 0.f ? O / L : 0.f);
        }
      }
    }
    asm volatile("bar.sync 1, %0;" ::"r"(nthreads) : "memory");  // red and misc[1] are free for the next unit
  }
#endif  // FW_SM90
}

// A kernel instance, allowed the device's whole opt-in shared memory once per device (not stream work, so a first
// call under graph capture is fine).
template <typename T, int DP, int RP> const void* stream_kernel(int smem_optin) {
  static bool asked[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= 64) return nullptr;
  if (!asked[dev]) {
    if (cudaFuncSetAttribute(decode_stream_kernel<T, DP, RP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             smem_optin) != cudaSuccess)
      return nullptr;
    asked[dev] = true;
  }
  return (const void*)decode_stream_kernel<T, DP, RP>;
}
template <typename T, int DP> const void* stream_kernel_r(int RP, int smem_optin) {
  switch (RP) {
    case 1: return stream_kernel<T, DP, 1>(smem_optin);
    case 2: return stream_kernel<T, DP, 2>(smem_optin);
    case 4: return stream_kernel<T, DP, 4>(smem_optin);
    default: return nullptr;  // 8 heads a block would spill (decode_stream_grid sends them to the ring kernel)
  }
}

// Bytes of shared memory besides the ring: the warps' states, the barriers, and two int arrays over the rows.
int fixed_smem_for(int D, int RP, int B) {
  return kConsumerWarps * RP * (D + 2) * 4 + 2 * kMaxStages * 8 + (2 * B + 3) * 4;
}

}  // namespace

int decode_stream_grid(DType dt, int B, int Hq, int Hk, int S, int D, int64_t ss, int cc_major, int cc_minor,
                       int sm_count, int smem_optin) {
  const int mode = int_from_env("FW_DECODE_STREAM", -1);  // -1 auto, 0 off, 1 wherever it can run (tests, sweeps)
  if (mode == 0 || cc_major != 9 || cc_minor != 0 || dt == DType::F32 || B <= 0 || B > kMaxRows || Hk <= 0 ||
      Hq % Hk != 0 || (D != 64 && D != 128 && D != 256) || ss != D || S <= 0)
    return 0;
  const int RP = decode_attention_heads_per_block(Hq / Hk), rows = kRowBytes / (4 * D);  // kRows
  // more than 4 query heads a kv head: the state of 8 heads would not fit the registers of 288 threads
  if (RP > 4 || fixed_smem_for(D, RP, B) + 2 * kStageBytes > smem_optin) return 0;
  const int64_t chunks = (int64_t)B * Hk * decode_attention_groups(Hq, Hk) * ((S + rows - 1) / rows);
  // one block an SM: its ring takes most of the shared memory
  int64_t grid = int_from_env("FW_DECODE_STREAM_GRID", 0);  // a fixed grid, for tests and sweeps
  if (grid <= 0) grid = sm_count;
  // auto: only where each block has at least 8 chunks of a full cache to stream
  if (mode < 0 && chunks < 8 * grid) return 0;
  return (int)(grid < chunks ? grid : chunks);
}

int64_t decode_stream_parts(int grid, int Hq, int Hk) {
  return (int64_t)grid * 2 * decode_attention_heads_per_block(Hq / Hk);
}

cudaError_t decode_attention_stream(DType dt, const void* q, const void* k, const void* v, const int64_t* lengths,
                                    void* out, DecodeWorkspace ws, int B, int Hq, int Hk, int S, int D, int64_t sb,
                                    int64_t sh, int grid, int smem_optin, float scale, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  const int R = Hq / Hk, RP = decode_attention_heads_per_block(R), RG = decode_attention_groups(Hq, Hk);
  const int fixed = fixed_smem_for(D, RP, B);
  int stages = int_from_env("FW_DECODE_STREAM_STAGES", 6);
  stages = stages < 2 ? 2 : stages > kMaxStages ? kMaxStages : stages;
  while (stages > 2 && fixed + stages * kStageBytes > smem_optin) --stages;
  const int smem = fixed + stages * kStageBytes;
  if (grid <= 0 || smem > smem_optin) return cudaErrorInvalidValue;
  StreamArgs a{q, k, v, lengths, out, ws, B, Hq, Hk, R, RG, S, sb, sh, stages, scale};
  const void* f = nullptr;
  dispatch(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    if constexpr (!std::is_same_v<T, float>)
      f = D == 64    ? stream_kernel_r<T, 64>(RP, smem_optin)
          : D == 128 ? stream_kernel_r<T, 128>(RP, smem_optin)
                     : stream_kernel_r<T, 256>(RP, smem_optin);
    return cudaSuccess;
  });
  if (!f) return cudaErrorInvalidValue;
  void* args[] = {&a};
  return cudaLaunchKernel(f, dim3((unsigned)grid), dim3(kStreamThreads), args, (size_t)smem, stream);
}

}  // namespace fw
