// skinny_linear: out [M, N] = x [M, K] @ weight [N, K]^T for the few rows of a decode step (1 <= M <= 64), 16-bit
// operands, float32 accumulation. A decode step's projections onto the hidden state (`o`, `down`: N = hidden, K
// larger) have few output tiles, and cuBLAS reads their weights far below the copy rate there (`python -m
// benchmarks.ops.decode_gemm`). Here a block computes 64 columns over a slice of K (split-K), the splits of a tile
// forming one thread block cluster (sm_90): weights and x stream through a ring of shared-memory stages by
// cp.async, the tensor cores take them by ldmatrix, and the splits' float32 tiles are summed in rank order through
// distributed shared memory, so the result is deterministic and no partials go through global memory.
#include <cooperative_groups.h>

#include "common.cuh"
#include "torch_utils.h"

namespace fw {

struct SkinnyArgs {
  const void* x;    // [M, K]
  const void* w;    // [N, K]
  void* out;        // [M, N]
  int M, N, K, splits;
};

cudaError_t skinny_linear(DType dt, const SkinnyArgs& a, cudaStream_t stream);
int skinny_linear_splits(DType dt, int M, int N, int K, int sms);

}  // namespace fw

namespace fw {
namespace {

constexpr int kTileN = 64;   // columns of a block: 16 a warp, two n8 tiles
constexpr int kWarps = 4;
constexpr int kChunk = 64;   // elements of K a stage holds: 128 bytes a row, eight 16-byte pieces
constexpr int kStages = 4;   // kStages - 1 chunks in flight while one is multiplied
constexpr int kMaxSplits = 8;  // the portable cluster size

// Shared memory of one stage for MT m16 tiles of x: the weights' 64 rows, then x's 16 MT rows, 128 bytes each.
template <int MT> constexpr int stage_elems() { return (kTileN + 16 * MT) * kChunk; }
template <int MT> constexpr int smem_bytes() { return kStages * stage_elems<MT>() * 2; }
// The split tile's float32 sums, a padded row of 64 columns a row of x (inside the ring, once it is drained).
constexpr int kRedPitch = kTileN + 4;
static_assert(kRedPitch * 4 * 64 <= smem_bytes<4>(), "the float32 tile fits in the ring");

// Row r's 16-byte piece j of a stage lives at piece j ^ (r % 8) of its 128-byte row, so that the eight rows an
// ldmatrix phase reads fall in eight different bank groups.
__device__ __forceinline__ int swz(int r, int j) { return r * kChunk + ((j ^ (r & 7)) << 3); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// Block (tile, split): columns 64 tile .. + 63 over K chunks [split chunks / splits, (split + 1) chunks / splits).
// Warp w computes columns 64 tile + 16 w .. + 15 for the MT m16 tiles of x's rows (rows past M are zeros).
template <typename T, int MT>
__global__ void __launch_bounds__(kWarps * 32)
skinny_linear_kernel(SkinnyArgs a, unsigned trigger_from) {
  pdl_begin(trigger_from);
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* ring = reinterpret_cast<T*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tile = blockIdx.x, split = blockIdx.y;
  const int chunks = a.K / kChunk;
  const int c0 = (int)((int64_t)split * chunks / a.splits), c1 = (int)((int64_t)(split + 1) * chunks / a.splits);
  const int n = c1 - c0;
  const T* w = static_cast<const T*>(a.w) + (int64_t)tile * kTileN * a.K;
  const T* x = static_cast<const T*>(a.x);

  // chunk c into stage st: the weights' 64 rows x 8 pieces and x's 16 MT rows x 8 pieces over 128 threads
  auto load = [&](int st, int c) {
    T* base = ring + st * stage_elems<MT>();
    const int64_t k0 = (int64_t)c * kChunk;
#pragma unroll
    for (int i = tid; i < kTileN * 8; i += kWarps * 32) {
      const int r = i >> 3, j = i & 7;
      cp_async16(base + swz(r, j), w + r * (int64_t)a.K + k0 + 8 * j, true);
    }
#pragma unroll
    for (int i = tid; i < 16 * MT * 8; i += kWarps * 32) {
      const int r = i >> 3, j = i & 7;
      const bool in = r < a.M;
      cp_async16(base + swz(kTileN + r, j), x + (in ? r : 0) * (int64_t)a.K + k0 + 8 * j, in);
    }
  };

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < n) load(st, c0 + st);
    cp_async_commit();
  }
  float acc[MT][2][4] = {};
  // ldmatrix addresses: lane l gives row l % 8 of matrix l / 8
  const int q = lane >> 3, r8 = lane & 7;
  for (int i = 0; i < n; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // chunk i is in for every thread; the stage refilled next was read by all warps at i - 1
    if (i + kStages - 1 < n) load((i + kStages - 1) % kStages, c0 + i + kStages - 1);
    cp_async_commit();
    const T* base = ring + (i % kStages) * stage_elems<MT>();
#pragma unroll
    for (int s = 0; s < kChunk / 16; ++s) {
      uint32_t b[4];  // b[0], b[1]: the first n8 tile's k halves; b[2], b[3]: the second's
      ldmatrix_x4(b, base + swz(16 * warp + 8 * (q >> 1) + r8, 2 * s + (q & 1)));
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        uint32_t af[4];
        ldmatrix_x4(af, base + swz(kTileN + 16 * m + 8 * (q & 1) + r8, 2 * s + (q >> 1)));
        mma16816<T>(acc[m][0], af, b[0], b[1]);
        mma16816<T>(acc[m][1], af, b[2], b[3]);
      }
    }
  }

  // acc[m][j][2h], acc[m][j][2h + 1]: row 16 m + 8 h + g, columns 16 warp + 8 j + 2 t (+ 1) of the tile
  const int g = lane >> 2, t = lane & 3;
  if (a.splits == 1) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = 16 * m + 8 * h + g;
        if (row >= a.M) continue;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int64_t off = (int64_t)row * a.N + tile * kTileN + 16 * warp + 8 * j + 2 * t;
          *reinterpret_cast<uint32_t*>(static_cast<T*>(a.out) + off) = pack2<T>(acc[m][j][2 * h], acc[m][j][2 * h + 1]);
        }
      }
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cp_async_wait<0>();
  __syncthreads();  // the ring is drained and read: it holds the float32 tile now
  float* red = reinterpret_cast<float*>(smem_raw);
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        *reinterpret_cast<float2*>(red + (16 * m + 8 * h + g) * kRedPitch + 16 * warp + 8 * j + 2 * t) =
            make_float2(acc[m][j][2 * h], acc[m][j][2 * h + 1]);
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every split's tile is in its shared memory
  // split r writes rows r, r + splits, ...: four columns a thread, the splits' tiles summed in rank order. Every
  // rank's four columns are loaded before any is added, so that the remote reads overlap instead of queueing one
  // behind the other.
  for (int i = tid; i < a.M * (kTileN / 4); i += kWarps * 32) {
    const int row = split + a.splits * (i / (kTileN / 4));
    if (row >= a.M) break;
    const int col = 4 * (i % (kTileN / 4));
    float4 v[kMaxSplits];
#pragma unroll
    for (int rank = 0; rank < kMaxSplits; ++rank)
      if (rank < a.splits)
        v[rank] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(red, rank) + row * kRedPitch + col);
    float4 sum = v[0];
#pragma unroll
    for (int rank = 1; rank < kMaxSplits; ++rank)
      if (rank < a.splits) {
        sum.x += v[rank].x;
        sum.y += v[rank].y;
        sum.z += v[rank].z;
        sum.w += v[rank].w;
      }
    uint2 packed;
    packed.x = pack2<T>(sum.x, sum.y);
    packed.y = pack2<T>(sum.z, sum.w);
    *reinterpret_cast<uint2*>(static_cast<T*>(a.out) + (int64_t)row * a.N + tile * kTileN + col) = packed;
  }
  cluster.sync();  // no block leaves while another reads its shared memory
#else
  __trap();  // split K without the cluster reduction: the host never launches it (skinny_linear_splits)
#endif
}

// f(std::integral_constant<int, MT>) for the m16 tiles of M rows (1 to 64).
template <typename F> auto with_tiles(int M, F&& f) {
  switch ((M + 15) / 16) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}
template <typename T> void (*kernel_for(int M))(SkinnyArgs, unsigned) {
  return with_tiles(M, [](auto mt) { return skinny_linear_kernel<T, decltype(mt)::value>; });
}
int smem_for(int M) {
  return with_tiles(M, [](auto mt) { return smem_bytes<decltype(mt)::value>(); });
}
template <typename T> cudaError_t allow_smem(int M) {
  return with_tiles(M, [](auto mt) {
    constexpr int MT = decltype(mt)::value;
    return allow_dynamic_smem<skinny_linear_kernel<T, MT>>(smem_bytes<MT>());
  });
}

}  // namespace

// As many splits of K (a cluster of blocks a tile, at most 8) as fill the blocks resident at once, each of at least
// one chunk; one split on GPUs other than compute capability 9. FW_SKINNY_SPLITS overrides it (read per call: the
// benchmark's sweeps), within those limits.
int skinny_linear_splits(DType dt, int M, int N, int K, int sms) {
  int dev = 0;
  // the cluster reduction is compiled for sm_90 only: other GPUs run the compute_80 code, unsplit
  if (cleared(cudaGetDevice(&dev)) != cudaSuccess || device_attribute<cudaDevAttrComputeCapabilityMajor>(dev) != 9)
    return 1;
  const void* kernel = dt == DType::BF16  ? (const void*)kernel_for<__nv_bfloat16>(M)
                       : dt == DType::F16 ? (const void*)kernel_for<__half>(M)
                                          : nullptr;
  if (kernel == nullptr) return 1;  // no kernel: the launch refuses the dtype
  if ((dt == DType::BF16 ? allow_smem<__nv_bfloat16>(M) : allow_smem<__half>(M)) != cudaSuccess) return 1;
  const int tiles = N / kTileN, chunks = K / kChunk;
  int s = std::max(1, resident_blocks(kernel, kWarps * 32, smem_for(M)) * sms / tiles);
  s = int_from_env("FW_SKINNY_SPLITS", s);
  return std::max(1, std::min({s, chunks, kMaxSplits}));
}

cudaError_t skinny_linear(DType dt, const SkinnyArgs& a, cudaStream_t stream) {
  return dispatch(dt, [&](auto v) -> cudaError_t {
    using T = decltype(v);
    if constexpr (std::is_same_v<T, float>) {
      return cudaErrorInvalidValue;  // tensor cores take the 16-bit types only
    } else {
      const cudaError_t e = allow_smem<T>(a.M);
      if (e != cudaSuccess) return e;
      return launch_cluster_kernel(kernel_for<T>(a.M), dim3((unsigned)(a.N / kTileN), (unsigned)a.splits),
                                   kWarps * 32, smem_for(a.M), stream, dim3(1, (unsigned)a.splits, 1), a);
    }
  });
}

}  // namespace fw

namespace {

Tensor skinny_linear(const Tensor& x, const Tensor& weight) {
  const char* op = "skinny_linear";
  check_cuda(x, op, "x");
  check_cuda(weight, op, "weight");
  TORCH_CHECK(weight.device() == x.device(), "fw::", op, ": x and weight must be on one device, got ", x.device(),
              " and ", weight.device());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "fw::", op, ": x ", x.sizes(),
              " and weight ", weight.sizes(), " must be [M, K] and [N, K]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              "fw::", op, ": the CUDA kernel takes bfloat16 or float16 x and weight of one dtype, got ",
              x.scalar_type(), " and ", weight.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M >= 1 && M <= 64, "fw::", op, ": the CUDA kernel takes 1 to 64 rows, got ", M);
  TORCH_CHECK(K > 0 && N > 0 && K % 64 == 0 && N % 64 == 0 && K <= INT_MAX && N <= INT_MAX, "fw::", op,
              ": the CUDA kernel takes K and N that are positive multiples of 64, got K ", K, ", N ", N);
  c10::cuda::CUDAGuard guard(x.device());
  auto xc = x.contiguous(), wc = weight.contiguous();
  if (reinterpret_cast<uintptr_t>(xc.data_ptr()) % 16 != 0) xc = xc.clone(at::MemoryFormat::Contiguous);
  if (reinterpret_cast<uintptr_t>(wc.data_ptr()) % 16 != 0) wc = wc.clone(at::MemoryFormat::Contiguous);
  auto out = at::empty({M, N}, x.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto dt = dtype_of(x, op, "x");
  const int splits = fw::skinny_linear_splits(dt, (int)M, (int)N, (int)K, sm_count());
  fw::SkinnyArgs a{xc.data_ptr(), wc.data_ptr(), out.data_ptr(), (int)M, (int)N, (int)K, splits};
  check_launch(fw::skinny_linear(dt, a, stream), op);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) { m.impl("skinny_linear", &skinny_linear); }
