// The fused linear + logprob on Hopper (sm_90a): the logits GEMM on the tensor cores (TMA loads, wgmma), with the
// row work of linear_logprob.cu's row kernels done on the accumulators, so that no fp32 logits tile goes through
// memory.
//
// A persistent kernel of one CTA an SM walks output tiles of BM rows (hidden) x BN columns (vocabulary), rows
// fastest, so the CTAs running at once share a few weight blocks through L2 and the hidden rows of the launch
// (16 MB at 8,192 rows of 1,024) stay there. Warp group 0 is the producer: one thread loads each BK-wide slice of the
// two operand tiles with TMA (128-byte swizzle) into a ring of kStages stages, ordered by full/empty mbarriers.
// Warp groups 1 and 2 each compute 64 rows x BN with wgmma m64n256k16 (fp32 accumulators: 128 registers a thread;
// the producer hands registers to them with setmaxnreg, 40 against 232, without which the kept-logits epilogue
// spills), then, on the accumulators:
//   forward: each (row, column block = chunk) leaves the logsumexp partial (m, s, a) and the target's logit,
//            which logprob_merge combines as it does the row kernels' partials; kept logits go out in fp16 as
//            z minus the chunk's m, as the row kernels keep them;
//   backward: d(loss)/dz, written in the operand dtype for the two gradient GEMMs.
// The arithmetic per logit is linear_logprob.cu's (ex2, lse_add, dlogit, ...), as in the row kernels.
// Included only by linear_logprob.cu, after the shared structs and maths it uses: a file of its own because
// this kernel alone is as long as the rest of the op.
// The wgmma fragment of a thread (warp w of its group, lane l): rows 16w + l/4 and 16w + l/4 + 8, columns
// 8j + 2(l%4) + {0, 1} for j < 32; register 4j + 2i + c holds (row half i, column c).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>


namespace fw {
namespace {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FW_SM90A 1
#endif

constexpr int BM = 128, BN = (int)kLogprobChunk, BK = 64, kStages = 4, kConsumers = 2;
constexpr int kFusedThreads = 128 * (kConsumers + 1);
constexpr int kABytes = BM * BK * 2, kBBytes = BN * BK * 2, kStageBytes = kABytes + kBBytes;
// the ring, its 2 x kStages barriers, and room to align the ring to 1024 bytes (the 128-byte swizzle's period)
constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8 + 1024;

struct FusedArgs {
  int n, vc, K;    // rows and columns of this launch, the reduction length (hidden size)
  int64_t v0;      // the vocabulary column of column 0 (targets are vocabulary columns)
  float inv_t;     // 1 / temperature
  const int64_t* targets;
  LogprobParts parts;  // forward: the partial of (row, column block) at row * parts.ld + block
  __half* z16;         // forward, kept logits: row r at z16 + r * z16_ld
  int64_t z16_ld;
  const float *lse, *entropy, *grad_logprob, *grad_entropy;  // backward
  void* g;                                                    // backward: [n, vc]
};

#ifdef FW_SM90A
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Until the phase of this parity has completed (a fresh barrier counts its phase "1" as completed).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// A BK x rows box at (column c0, row c1) of a row-major [rows, K] tensor into shared memory, counted on bar.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma (it sees the
// registers as ready when the wgmma instruction issues).
__device__ __forceinline__ void fence_acc(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Two adjacent columns of an output row at p, of which `left` (maybe fewer than 2) are inside the row: one 4-byte
// store when both are and `pairs` says p is 4-byte aligned, else one element at a time.
template <typename T> __device__ __forceinline__ void store_pair(T* p, const float (&v)[2], bool pairs, int left) {
  if (pairs && left >= 2) {
    store_vec<T, 2>(p, vec_from_f<T, 2>(v));
  } else {
    if (left >= 1) p[0] = from_f<T>(v[0]);
    if (left >= 2) p[1] = from_f<T>(v[1]);
  }
}
// Shared-memory matrix descriptor of a K-major tile with the 128-byte swizzle: 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  return (uint64_t)((smem_u32(p) & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 |
         (uint64_t)1 << 62;
}
#define FW_WGMMA_M64N256K16(NAME, TY)                                                           \
  __device__ __forceinline__ void NAME(float(&d)[128], uint64_t da, uint64_t db, int accumulate) { \
    asm volatile(                                                                               \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                            \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {"                              \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "  \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "  \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "  \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "  \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127 "  \
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"                                                      \
      :                                                                                         \
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),  \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),  \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),  \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),  \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),  \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),  \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),  \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])  \
      : "l"(da), "l"(db), "r"(accumulate));                                                     \
  }
FW_WGMMA_M64N256K16(wgmma_bf16, "bf16")
FW_WGMMA_M64N256K16(wgmma_f16, "f16")
#undef FW_WGMMA_M64N256K16
#endif  // FW_SM90A

template <typename T, bool kBwd, bool kSave>
__global__ void __launch_bounds__(kFusedThreads, 1)
linear_logprob_sm90_kernel(const __grid_constant__ CUtensorMap tm_h, const __grid_constant__ CUtensorMap tm_w,
                           FusedArgs a) {
#ifdef FW_SM90A
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  T* sa = reinterpret_cast<T*>(smem);                      // [kStages][BM][BK]
  T* sb = reinterpret_cast<T*>(smem + kStages * kABytes);  // [kStages][BN][BK]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int num_m = (a.n + BM - 1) / BM, tiles = num_m * ((a.vc + BN - 1) / BN), nk = (a.K + BK - 1) / BK;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer: one thread issues every load
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (t != 0) return;
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const int m0 = (tile % num_m) * BM, c0 = (tile / num_m) * BN;
      for (int kb = 0; kb < nk; ++kb) {
        mbar_wait(&empty[stage], phase ^ 1);
        mbar_expect_tx(&full[stage], kStageBytes);  // out-of-bounds parts of a box are zero-filled and counted
        tma_load(sa + stage * BM * BK, &tm_h, &full[stage], kb * BK, m0);
        tma_load(sb + stage * BN * BK, &tm_w, &full[stage], kb * BK, c0);
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int cw = wg - 1, warp = t / 32, lane = t % 32, q = lane & 3;
  int stage = 0;
  uint32_t phase = 0;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int m0 = (tile % num_m) * BM, c0 = (tile / num_m) * BN;
    for (int kb = 0; kb < nk; ++kb) {
      mbar_wait(&full[stage], phase);
      fence_acc(acc);
      wgmma_fence();
      const T* as = sa + stage * BM * BK + cw * 64 * BK;
      const T* bs = sb + stage * BN * BK;
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {  // 16 columns = 32 bytes further along the swizzled rows
        if constexpr (std::is_same_v<T, __half>)
          wgmma_f16(acc, smem_desc(as + kk * 16), smem_desc(bs + kk * 16), kb > 0 || kk > 0);
        else
          wgmma_bf16(acc, smem_desc(as + kk * 16), smem_desc(bs + kk * 16), kb > 0 || kk > 0);
      }
      wgmma_commit();
      wgmma_wait_all();
      fence_acc(acc);
      if (t == 0) mbar_arrive(&empty[stage]);  // this warp group is done reading the stage
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }

    const int r_base = m0 + cw * 64 + warp * 16 + (lane >> 2);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = r_base + 8 * i;
      if constexpr (!kBwd) {
        // the row's max over this thread's 64 columns, then over the 4 lanes that share the row
        const int64_t tg = r < a.n ? a.targets[r] - a.v0 - c0 : -1;  // the target's column in this tile, maybe none
        float mx = -INFINITY, tz = 0.f;
#pragma unroll
        for (int j = 0; j < 32; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int col = 8 * j + 2 * q + c;
            float& x = acc[4 * j + 2 * i + c];
            x = c0 + col < a.vc ? x * a.inv_t : -INFINITY;  // past the end: weight 0
            mx = max_nan(mx, x);
            if (col == tg) tz = x;
          }
        mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m = mx == -INFINITY ? 0.f : mx, mk = m * kLog2e;  // a block of -inf only: shift 0
        float s = 0.f, sa_ = 0.f;
#pragma unroll
        for (int j = 0; j < 32; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) lse_add(acc[4 * j + 2 * i + c], mk, s, sa_);
        if constexpr (kSave) {
          if (r < a.n) {
            __half* zr = a.z16 + (int64_t)r * a.z16_ld + a.v0 + c0;
            const bool pairs = (a.z16_ld & 1) == 0;  // 4-byte aligned pairs
#pragma unroll
            for (int j = 0; j < 32; ++j) {
              const int col = 8 * j + 2 * q;
              float y[2];
#pragma unroll
              for (int c = 0; c < 2; ++c) y[c] = kept_logit(acc[4 * j + 2 * i + c], m);
              store_pair(zr + col, y, pairs, a.vc - c0 - col);
            }
          }
        }
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
          s += __shfl_xor_sync(0xffffffffu, s, o);
          sa_ += __shfl_xor_sync(0xffffffffu, sa_, o);
        }
        if (r < a.n) {
          if (tg >= 0 && tg < BN && (int)(tg & 7) / 2 == q) a.parts.target_z[r] = tz;
          if (q == 0) {
            const int64_t p = (int64_t)r * a.parts.ld + (a.v0 + c0) / BN;
            a.parts.m[p] = m;
            a.parts.s[p] = s;
            a.parts.a[p] = sa_;
          }
        }
      } else {
        if (r >= a.n) continue;
        const int64_t target = a.targets[r], tg = target - a.v0 - c0;
        const float l = a.lse[r], H = a.entropy[r], gH = a.grad_entropy[r];
        const float glp = target < 0 ? 0.f : a.grad_logprob[r];
        const float ck = -l * kLog2e;
        T* gr = static_cast<T*>(a.g) + (int64_t)r * a.vc + c0;
        const bool pairs = (a.vc & 1) == 0;  // two adjacent columns in one 4-byte store
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int col = 8 * j + 2 * q;
          float o[2];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            o[c] = dlogit(acc[4 * j + 2 * i + c] * a.inv_t, -l, ck, glp, gH, H);
            if (col + c == tg) o[c] += glp;
          }
          store_pair(gr + col, o, pairs, a.vc - c0 - col);
        }
      }
    }
  }
#endif  // FW_SM90A
}

// cuTensorMapEncodeTiled from the driver, through the runtime (no link against libcuda); null if unavailable.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e =
        cleared(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A row-major [rows, K] 16-bit tensor as TMA boxes of BK columns x box_rows rows, swizzled for wgmma.
bool tensor_map(CUtensorMap* map, DType dt, const void* base, int64_t rows, int64_t K, int box_rows) {
  const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)K * 2};
  const cuuint32_t box[2] = {BK, (cuuint32_t)box_rows};
  const cuuint32_t elem[2] = {1, 1};
  const auto type = dt == DType::BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return tensor_map_encoder()(map, type, 2, const_cast<void*>(base), dims, strides, box, elem,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <bool kBwd, bool kSave>
cudaError_t launch(DType dt, const void* h, const void* w, FusedArgs a, int sm_count, cudaStream_t stream) {
  if (a.n == 0 || a.vc == 0) return cudaSuccess;
  CUtensorMap th, tw;
  if (!tensor_map(&th, dt, h, a.n, a.K, BM) || !tensor_map(&tw, dt, w, a.vc, a.K, BN)) return cudaErrorInvalidValue;
  const int64_t tiles = (int64_t)((a.n + BM - 1) / BM) * ((a.vc + BN - 1) / BN);
  const unsigned grid = (unsigned)(tiles < sm_count ? tiles : sm_count);
  return dispatch(dt, [&](auto x) -> cudaError_t {
    using T = decltype(x);
    if constexpr (std::is_same_v<T, float>) {
      return cudaErrorInvalidValue;
    } else {
      constexpr auto kernel = linear_logprob_sm90_kernel<T, kBwd, kSave>;
      const cudaError_t e = allow_dynamic_smem<kernel>(kSmemBytes);
      if (e != cudaSuccess) return e;
      return launch_plain(kernel, grid, kFusedThreads, kSmemBytes, stream, th, tw, a);
    }
  });
}

}  // namespace

bool linear_logprob_sm90_supported(DType dt, int cc_major, int cc_minor, int64_t K, const void* h, const void* w) {
  return cc_major == 9 && cc_minor == 0 && dt != DType::F32 && K > 0 && K % 8 == 0 && aligned16(h) &&
         aligned16(w) && int_from_env("FW_LOGPROB_SM90", 1) != 0 && tensor_map_encoder() != nullptr;
}

cudaError_t linear_logprob_sm90_fwd(DType dt, const void* h, const void* w, int64_t n, int64_t V, int64_t K,
                                    float inv_t, const int64_t* targets, LogprobParts parts, void* z16,
                                    int64_t z16_ld, int sm_count, cudaStream_t stream) {
  if (parts.ld != (V + kLogprobChunk - 1) / kLogprobChunk) return cudaErrorInvalidValue;
  FusedArgs a{(int)n, (int)V, (int)K, 0, inv_t, targets, parts, static_cast<__half*>(z16), z16_ld,
              nullptr, nullptr, nullptr, nullptr, nullptr};
  return z16 ? launch<false, true>(dt, h, w, a, sm_count, stream) : launch<false, false>(dt, h, w, a, sm_count, stream);
}

cudaError_t linear_logprob_sm90_bwd(DType dt, const void* h, const void* w, int64_t n, int64_t vc, int64_t K,
                                    int64_t v0, float inv_t, const int64_t* targets, const float* lse,
                                    const float* entropy, const float* grad_logprob, const float* grad_entropy,
                                    void* g, int sm_count, cudaStream_t stream) {
  FusedArgs a{(int)n, (int)vc, (int)K, v0, inv_t, targets, LogprobParts{}, nullptr, 0, lse, entropy, grad_logprob,
              grad_entropy, g};
  return launch<true, false>(dt, h, w, a, sm_count, stream);
}

}  // namespace fw
