// skinny_linear: out [M, N] = x [M, K] @ weight [N, K]^T for the few rows of a decode step (1 <= M <= 64), 16-bit
// operands, float32 accumulation. A decode step's projections onto the hidden state (`o`, `down`: N = hidden, K
// larger) have few output tiles, and cuBLAS reads their weights far below the copy rate there (`python -m
// benchmarks.ops.decode_gemm`). Here a block computes 64 columns over a slice of K (split-K): a wave of blocks
// whatever N is, every weight byte read once, by 16-byte loads marked evict-first in L1 and L2. The split blocks of a
// tile leave float32 partials; the last to arrive (a counter per tile, which it resets) adds them in split order and
// writes the tile, so the result is deterministic.
#include "common.cuh"
#include "torch_utils.h"

namespace fw {

struct SkinnyArgs {
  const void* x;    // [M, K]
  const void* w;    // [N, K]
  void* out;        // [M, N]
  float* partial;   // [splits, M, N] when splits > 1
  int* counters;    // [N / 64], zero at launch, when splits > 1
  int M, N, K, splits;
};

cudaError_t skinny_linear(DType dt, const SkinnyArgs& a, cudaStream_t stream);
int skinny_linear_splits(DType dt, int M, int N, int K, int sms);

}  // namespace fw

namespace fw {
namespace {

constexpr int kTileN = 64;  // columns of a block: one n8 tile a warp
constexpr int kWarps = 8;
constexpr int kChunk = 64;  // elements of K a lane quad loads at once: 16 a lane, the operands of 4 mma k-steps

// Block (tile, split): columns 64 tile .. 64 tile + 63, K chunks [split chunks / splits, (split + 1) chunks / splits).
// Warp w computes the n8 tile of columns 64 tile + 8 w .. + 7 over the block's K range for MT m16 tiles of rows.
// Lane (g = lane / 4, t = lane % 4) loads, per 64-element chunk of K at kc, the 16 elements kc + 16 t .. + 15 of
// weight row 64 tile + 8 w + g and of x rows g and g + 8 of each m tile. K-step s of the chunk takes elements
// 4 s .. 4 s + 3 of them as the k slots 2t, 2t + 1, 2t + 8, 2t + 9 of its A and B fragments: each k-step covers 16
// of the chunk's k values, the same ones in A and B, and the four k-steps cover all 64, which is all a dot product
// needs. Rows past M load row M - 1 and are not written.
template <typename T, int MT>
__global__ void __launch_bounds__(kWarps * 32)
skinny_linear_kernel(SkinnyArgs a, unsigned trigger_from) {
  pdl_begin(trigger_from);
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, split = blockIdx.y;
  const int chunks = a.K / kChunk;
  const int c0 = (int)((int64_t)split * chunks / a.splits), c1 = (int)((int64_t)(split + 1) * chunks / a.splits);
  const T* wrow = static_cast<const T*>(a.w) + (int64_t)(tile * kTileN + warp * 8 + g) * a.K + 16 * t;
  const T* xrow[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      xrow[m][h] = static_cast<const T*>(a.x) + (int64_t)min(16 * m + 8 * h + g, a.M - 1) * a.K + 16 * t;
  const uint64_t pol = l2_evict_first_policy();
  float acc[MT][4] = {};
  // the next chunk's weights are in flight while this chunk's products run
  Vec<T, 8> wv[2], wn[2];
  if (c0 < c1) {
    wv[0] = load_vec_evict_first<T, 8>(wrow + (int64_t)c0 * kChunk, pol);
    wv[1] = load_vec_evict_first<T, 8>(wrow + (int64_t)c0 * kChunk + 8, pol);
  }
  for (int c = c0; c < c1; ++c) {
    if (c + 1 < c1) {
      wn[0] = load_vec_evict_first<T, 8>(wrow + (int64_t)(c + 1) * kChunk, pol);
      wn[1] = load_vec_evict_first<T, 8>(wrow + (int64_t)(c + 1) * kChunk + 8, pol);
    }
    Vec<T, 8> xv[MT][2][2];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        xv[m][h][0] = load_vec<T, 8>(xrow[m][h] + (int64_t)c * kChunk);
        xv[m][h][1] = load_vec<T, 8>(xrow[m][h] + (int64_t)c * kChunk + 8);
      }
    const uint32_t* wu = reinterpret_cast<const uint32_t*>(wv);  // the lane's 16 weights as 8 pairs
#pragma unroll
    for (int s = 0; s < 4; ++s) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const uint32_t* r0 = reinterpret_cast<const uint32_t*>(xv[m][0]);
        const uint32_t* r1 = reinterpret_cast<const uint32_t*>(xv[m][1]);
        const uint32_t af[4] = {r0[2 * s], r1[2 * s], r0[2 * s + 1], r1[2 * s + 1]};
        mma16816<T>(acc[m], af, wu[2 * s], wu[2 * s + 1]);
      }
    }
    wv[0] = wn[0];
    wv[1] = wn[1];
  }

  // acc[m][2h], acc[m][2h + 1]: row 16 m + 8 h + g, columns col and col + 1; unsplit, the output, else a partial
  const int col = tile * kTileN + warp * 8 + 2 * t;
  const int64_t plane = (int64_t)a.M * a.N;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * m + 8 * h + g;
      if (row >= a.M) continue;
      const int64_t off = (int64_t)row * a.N + col;
      if (a.splits == 1)
        *reinterpret_cast<uint32_t*>(static_cast<T*>(a.out) + off) = pack2<T>(acc[m][2 * h], acc[m][2 * h + 1]);
      else
        *reinterpret_cast<float2*>(a.partial + split * plane + off) = make_float2(acc[m][2 * h], acc[m][2 * h + 1]);
    }
  if (a.splits == 1) return;
  __threadfence();  // this block's partials before its arrival
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(a.counters + tile, 1) == a.splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other splits' partials after their arrivals
  // four columns a thread, the splits' loads unrolled so that several are in flight at once
  for (int i = threadIdx.x; i < a.M * (kTileN / 4); i += blockDim.x) {
    const int64_t off = (int64_t)(i / (kTileN / 4)) * a.N + tile * kTileN + 4 * (i % (kTileN / 4));
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int sp = 0; sp < a.splits; ++sp) {  // in split order: the same sum at every launch
      const float4 v = __ldcg(reinterpret_cast<const float4*>(a.partial + sp * plane + off));
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    uint2 packed;
    packed.x = pack2<T>(sum.x, sum.y);
    packed.y = pack2<T>(sum.z, sum.w);
    *reinterpret_cast<uint2*>(static_cast<T*>(a.out) + off) = packed;
  }
  if (threadIdx.x == 0) a.counters[tile] = 0;  // for the next launch or graph replay
}

// The kernel for M rows (1 to 64): its m16 tiles.
template <typename T> void (*kernel_for(int M))(SkinnyArgs, unsigned) {
  switch ((M + 15) / 16) {
    case 1: return skinny_linear_kernel<T, 1>;
    case 2: return skinny_linear_kernel<T, 2>;
    case 3: return skinny_linear_kernel<T, 3>;
    default: return skinny_linear_kernel<T, 4>;
  }
}

}  // namespace

// As many blocks as are resident on the GPU at once (one wave), with the float32 partials (4 splits M N bytes,
// written and read once) at most half the weights' bytes (2 N K), and at least one chunk of K a split.
// FW_SKINNY_SPLITS overrides it (read per call: the benchmark's sweeps).
int skinny_linear_splits(DType dt, int M, int N, int K, int sms) {
  const void* kernel = dt == DType::BF16  ? (const void*)kernel_for<__nv_bfloat16>(M)
                       : dt == DType::F16 ? (const void*)kernel_for<__half>(M)
                                          : nullptr;
  if (kernel == nullptr) return 1;  // no kernel: the launch refuses the dtype
  const int tiles = N / kTileN, chunks = K / kChunk, rows = (M + 15) / 16 * 16;
  int s = std::max(1, resident_blocks(kernel, kWarps * 32, 0) * sms / tiles);
  s = std::min(s, std::max(1, K / (4 * rows)));
  s = int_from_env("FW_SKINNY_SPLITS", s);
  return std::max(1, std::min({s, chunks, 65535}));  // 65535: the grid's y limit
}

cudaError_t skinny_linear(DType dt, const SkinnyArgs& a, cudaStream_t stream) {
  return dispatch(dt, [&](auto v) -> cudaError_t {
    using T = decltype(v);
    if constexpr (std::is_same_v<T, float>) {
      return cudaErrorInvalidValue;  // tensor cores take the 16-bit types only
    } else {
      return launch_kernel(kernel_for<T>(a.M), dim3((unsigned)(a.N / kTileN), (unsigned)a.splits), kWarps * 32, 0,
                           stream, a);
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
  Tensor partial, local_counters;
  fw::SkinnyArgs a{xc.data_ptr(), wc.data_ptr(), out.data_ptr(), nullptr, nullptr, (int)M, (int)N, (int)K, splits};
  if (splits > 1) {
    partial = at::empty({splits, M, N}, x.options().dtype(at::kFloat));
    a.partial = partial.data_ptr<float>();
    a.counters = zeroed_counters(N / 64, x, stream, local_counters);
  }
  check_launch(fw::skinny_linear(dt, a, stream), op);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fw, CUDA, m) { m.impl("skinny_linear", &skinny_linear); }
