// Device helpers shared by the fw kernels: dtype conversion, 16-byte vectors, reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

namespace fw {

// The element types of the kernels. Every launcher returns the launch's cudaError_t (the value its launch call
// returns: see cleared() below); its host wrapper (at the end of its csrc/<op>.cu) turns a failure into a
// TORCH_CHECK.
enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

// N elements of T moved as one access (16 bytes when N * sizeof(T) == 16).
template <typename T, int N> struct alignas(sizeof(T) * N) Vec {
  T v[N];
};
// N floats rounded to T, two at a time for 16-bit types (one cvt.rn.bf16x2 / f16x2 per pair instead of a cvt and
// a move per element: the memory-bound kernels are partly issue-bound).
template <typename T, int N> __device__ __forceinline__ Vec<T, N> vec_from_f(const float (&f)[N]) {
  Vec<T, N> o;
  if constexpr (N % 2 == 0 && std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (int j = 0; j < N; j += 2) *reinterpret_cast<__nv_bfloat162*>(&o.v[j]) = __floats2bfloat162_rn(f[j], f[j + 1]);
  } else if constexpr (N % 2 == 0 && std::is_same_v<T, __half>) {
#pragma unroll
    for (int j = 0; j < N; j += 2) *reinterpret_cast<__half2*>(&o.v[j]) = __floats2half2_rn(f[j], f[j + 1]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) o.v[j] = from_f<T>(f[j]);
  }
  return o;
}

template <typename T, int N> __device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}
// Loads of data read once: L1 evict-first with an L2 access policy that marks the lines evict-first (`pol`, from
// l2_evict_first_policy()). This is what Triton emits for eviction_policy='evict_first', which torch.compile puts
// on such loads: the lines read leave L2 first, so the ones just written (the output, read next by the following
// op) stay.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t p;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
template <typename T, int N> __device__ __forceinline__ Vec<T, N> load_vec_evict_first(const T* p, uint64_t pol) {
  static_assert(sizeof(T) * N == 16 || sizeof(T) * N == 8 || sizeof(T) * N == 4, "moves 4, 8 or 16 bytes");
  Vec<T, N> v;
  if constexpr (sizeof(T) * N == 16) {
    uint4 u;
    asm("ld.global.L1::evict_first.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p), "l"(pol));
    *reinterpret_cast<uint4*>(&v) = u;
  } else if constexpr (sizeof(T) * N == 8) {
    uint2 u;
    asm("ld.global.L1::evict_first.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;" : "=r"(u.x), "=r"(u.y) : "l"(p), "l"(pol));
    *reinterpret_cast<uint2*>(&v) = u;
  } else {
    unsigned u;
    asm("ld.global.L1::evict_first.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(u) : "l"(p), "l"(pol));
    *reinterpret_cast<unsigned*>(&v) = u;
  }
  return v;
}
template <typename T, int N> __device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// 16 bytes from global to shared memory without passing through registers (cp.async, sm_80+), in commit groups
// that cp_async_wait<N> waits for until at most N are in flight.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const int n = pred ? 16 : 0;  // 0: no global read, the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// d += a b for one m16n8k16 tile, 16-bit operands of type T, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// Two floats as a pair of T in one register, lo in the low half.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const float f[2] = {lo, hi};
  const Vec<T, 2> v = vec_from_f<T, 2>(f);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 1/sqrt(x) with subnormal x flushed to zero: rsqrtf's value for normal x, without the scaling rsqrtf (no
// --use_fast_math here) wraps around the approximation for subnormal ones.
__device__ __forceinline__ float rsqrt_approx_ftz(float x) {
  float r;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// Sum / max over a warp, every lane getting the result: floats, and the integer counts a warp agrees on.
template <typename V> __device__ __forceinline__ V warp_sum(V v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename V> __device__ __forceinline__ V warp_max(V v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const V w = __shfl_xor_sync(0xffffffffu, v, o);
    if constexpr (std::is_floating_point_v<V>)
      v = fmaxf(v, w);
    else
      v = max(v, w);
  }
  return v;
}

// A warp reduction `op` (warp_sum, warp_max) over the block; `smem` holds 32 values; `none` is the identity of
// the reduction; every thread gets the result.
template <typename V, typename Op> __device__ __forceinline__ V block_reduce(V v, V* smem, V none, Op op) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = op(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < warps ? smem[lane] : none;
  return op(v);
}
__device__ __forceinline__ float block_sum(float v, float* smem) {
  return block_reduce(v, smem, 0.f, [](float x) { return warp_sum(x); });
}
__device__ __forceinline__ float block_max(float v, float* smem) {
  return block_reduce(v, smem, -INFINITY, [](float x) { return warp_max(x); });
}

// dtype dispatch for launchers: F is called with a value of the element type (only its type matters).
template <typename F> cudaError_t dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: return f(float{});
    case DType::BF16: return f(__nv_bfloat16{});
    case DType::F16: return f(__half{});
  }
  return cudaErrorInvalidValue;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// CUDA errors. Besides returning its error, a runtime call that fails records it in the calling thread's last-error
// state, which stays until cudaGetLastError reads it (a sticky error, one that leaves the context unusable, stays
// for good). So fw code reads that state only to take out an error of its own, never to learn a launch's outcome:
// - every kernel launch goes through a call that returns the launch's own error (cudaLaunchKernelEx in
//   launch_kernel / launch_plain, cudaLaunchKernel), never through <<<>>> and cudaGetLastError, which would
//   report an error that an earlier failed call (torch's, a user's) left unread as this launch's failure;
// - every runtime call of ours that fails has its error taken out with cleared(), whether that error is returned,
//   raised or ignored for a fallback, so that none is left for a later reader to blame on its own call.
// An op that succeeds leaves the state as it found it; one whose call fails replaces an earlier unread error with
// its own (the state holds one error) and then clears it, on the failure path only. No extra host call on success.
inline cudaError_t cleared(cudaError_t e) {
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e;
}

// Lets kernel K launch with `bytes` of dynamic shared memory (more than 48 KB must be asked for), asking once per
// device (the attribute is not stream work).
template <auto K> cudaError_t allow_dynamic_smem(int bytes) {
  static bool asked[64] = {};
  int dev = 0;
  cudaError_t e = cleared(cudaGetDevice(&dev));
  if (e != cudaSuccess || (dev < 64 && asked[dev])) return e;
  e = cleared(cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  if (e == cudaSuccess && dev < 64) asked[dev] = true;
  return e;
}

// An integer from the environment, or `fallback` when unset or empty: the launch-shape overrides that the
// benchmark sweeps set (benchmarks/ops/sweep.sh, decode_splits.py).
inline int int_from_env(const char* name, int fallback) {
  const char* v = getenv(name);
  return v && *v ? atoi(v) : fallback;
}

// Programmatic dependent launch (PDL, sm_90). The rms_norm, rope and swiglu kernels are launched with programmatic
// stream serialization (launch_kernel() below), so the next such kernel in the stream is launched before this grid
// has completed: once every block of this grid has started and either let it (launch_dependents) or exited. Its
// blocks then become resident as this grid's last wave drains, and wait (griddepcontrol.wait) until this grid has
// completed and its writes are visible before they touch global memory. Only the blocks of the last wave let it:
// launch_dependents in every block slows grids of many short blocks such as QK-norm's, with or without PDL
// (`python -m benchmarks.ops.bench_ops --only rms_norm`, with FW_PDL=0 for the comparison). Both instructions
// compile to nothing below sm_90, and launch_kernel() asks for PDL only on compute capability 9.x, whose SASS has
// them.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The first statement of every kernel launched by launch_kernel(), whose last parameter is `trigger_from`: the
// linear index of the first block of the grid's last wave (launch_kernel() passes it).
__device__ __forceinline__ void pdl_begin(unsigned trigger_from) {
  grid_dependency_wait();
  if (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z) >= trigger_from) allow_dependents();
}

// Attribute A of device `dev`, asked once per device (0 where it cannot be asked).
template <cudaDeviceAttr A> int device_attribute(int dev) {
  static int known[64] = {};
  int v = dev < 64 ? known[dev] : 0;
  if (v == 0 && cleared(cudaDeviceGetAttribute(&v, A, dev)) != cudaSuccess) v = 0;
  if (dev < 64) known[dev] = v;
  return v;
}

// Blocks of `kernel` resident per SM with `threads` threads and `smem` bytes of dynamic shared memory (at least
// 1), asked once per kernel and block shape.
inline int resident_blocks(const void* kernel, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, size_t>, int> known;
  const std::lock_guard<std::mutex> lock(mu);
  int& n = known[{kernel, threads, smem}];
  if (n == 0 &&
      (cleared(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem)) != cudaSuccess || n < 1))
    n = 1;
  return n;
}

// Blocks of `kernel` one wave of device `dev` holds: its multiprocessors times resident_blocks (0 where the device
// cannot be asked).
inline int64_t wave_blocks(int dev, const void* kernel, int threads, size_t smem) {
  return (int64_t)device_attribute<cudaDevAttrMultiProcessorCount>(dev) * resident_blocks(kernel, threads, smem);
}

// kernel<<<grid, block, smem, stream>>>(args...) with the `n` launch attributes `attrs`, through cudaLaunchKernelEx:
// returns the launch's own error (the rule at cleared()).
template <typename... P, typename... A>
cudaError_t launch_with(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                        cudaLaunchAttribute* attrs, unsigned n, A&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  return cleared(cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...));
}
// kernel<<<grid, block, smem, stream>>>(args...), for kernels without PDL (no trigger_from parameter).
template <typename... P, typename... A>
cudaError_t launch_plain(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         A&&... args) {
  return launch_with(kernel, grid, block, smem, stream, nullptr, 0, std::forward<A>(args)...);
}

// kernel<<<grid, block, smem, stream>>>(args..., trigger_from), with PDL on Hopper (the kernel starts with
// pdl_begin(trigger_from)) and, where `cluster` is more than one block, thread block clusters of that shape (sm_90).
// Without PDL no block lets dependents launch. Returns the launch's error.
template <typename... P, typename... A>
cudaError_t launch_cluster_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                  dim3 cluster, A&&... args) {
  // PDL where the device has compute capability 9.x and FW_PDL is not 0 (read every call: the benchmark's A/B)
  int dev = 0;
  const bool pdl = cleared(cudaGetDevice(&dev)) == cudaSuccess &&
                   device_attribute<cudaDevAttrComputeCapabilityMajor>(dev) == 9 && int_from_env("FW_PDL", 1) != 0;
  unsigned trigger_from = UINT_MAX;
  const int64_t blocks = (int64_t)grid.x * grid.y * grid.z;
  if (pdl && blocks <= UINT_MAX) {
    const int threads = (int)(block.x * block.y * block.z);
    const int64_t wave = wave_blocks(dev, (const void*)kernel, threads, smem);
    trigger_from = blocks > wave ? (unsigned)(blocks - wave) : 0u;
  }
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n++].val.clusterDim.z = cluster.z;
  }
  return launch_with(kernel, grid, block, smem, stream, attr, n, std::forward<A>(args)..., trigger_from);
}
template <typename... P, typename... A>
cudaError_t launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A&&... args) {
  return launch_cluster_kernel(kernel, grid, block, smem, stream, dim3(1, 1, 1), std::forward<A>(args)...);
}

// The deterministic second half of a weight gradient whose blocks each left one float32 partial row: out[c] = the
// sum over rows b of partial[b * cols + c] in a fixed order. Thread (x, y) of a 32 x 8 block sums rows y, y + 8, ...
// of column blockIdx.x * 32 + x, then the 8 sums are added in y order: 8 independent chains of coalesced loads a
// column instead of one. Columns below `split` go to out0, the others to out1 (two weights' gradients in one launch).
template <typename W>
__global__ void __launch_bounds__(256)
sum_partial_rows_kernel(const float* __restrict__ partial, W* __restrict__ out0, W* __restrict__ out1, int split,
                        int rows, int cols, unsigned trigger_from) {
  pdl_begin(trigger_from);
  __shared__ float part[8][33];
  const int x = threadIdx.x & 31, y = threadIdx.x >> 5, c = blockIdx.x * 32 + x;
  float s = 0.f;
  if (c < cols)
    for (int b = y; b < rows; b += 8) s += partial[(int64_t)b * cols + c];
  part[y][x] = s;
  __syncthreads();
  if (y != 0 || c >= cols) return;
  float t = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) t += part[j][x];
  if (c < split)
    out0[c] = from_f<W>(t);
  else
    out1[c - split] = from_f<W>(t);
}

template <typename W>
cudaError_t sum_partial_rows(const float* partial, W* out0, W* out1, int split, int rows, int cols,
                             cudaStream_t stream) {
  return launch_kernel(sum_partial_rows_kernel<W>, (unsigned)((cols + 31) / 32), 256, 0, stream, partial, out0, out1,
                       split, rows, cols);
}

}  // namespace fw
