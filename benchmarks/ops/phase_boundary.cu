// What one dependent phase boundary costs on this GPU, three ways: a chain of kernels replayed from a CUDA graph,
// the same chain launched with programmatic dependent launch (PDL), and one persistent kernel whose phases meet at
// a grid-wide barrier. A fused decode layer replaces its kernels' boundaries with one of the latter two; this says
// what each costs before any work is counted (docs/PROFILES.md).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/ops/phase_boundary.cu -o /tmp/phase_boundary
//   /tmp/phase_boundary [phases=2000] [rounds=5]
//
// Each phase reads one float a thread of what the phase before wrote and writes its own (one block of 256 threads an
// SM), so every boundary is a true dependency; the medians of `rounds` timed replays are printed, in µs a phase.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

constexpr int kThreads = 256;

__global__ void phase_kernel(const float* __restrict__ in, float* __restrict__ out, int pdl) {
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");  // the phase before has finished and is visible
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const float v = in[(i + 7919) % (gridDim.x * blockDim.x)] + 1.f;  // another block's value
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  out[i] = v;
}

// Sense-reversing barrier over all blocks (all resident: one a SM, launched cooperatively).
__device__ void grid_barrier(unsigned* count, volatile unsigned* generation, unsigned blocks) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned g = *generation;
    __threadfence();
    if (atomicAdd(count, 1u) == blocks - 1) {
      *count = 0;
      __threadfence();
      atomicAdd(const_cast<unsigned*>(generation), 1u);
    } else {
      while (*generation == g) {
      }
    }
    __threadfence();
  }
  __syncthreads();
}

__global__ void persistent_kernel(float* a, float* b, int phases, unsigned* count, unsigned* generation) {
  const int n = gridDim.x * blockDim.x;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  for (int p = 0; p < phases; ++p) {
    const float* in = (p & 1) ? b : a;
    float* out = (p & 1) ? a : b;
    const float v = reinterpret_cast<const volatile float*>(in)[(i + 7919) % n] + 1.f;
    out[i] = v;
    grid_barrier(count, generation, gridDim.x);
  }
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int phases = argc > 1 ? std::atoi(argv[1]) : 2000;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 5;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int blocks = prop.multiProcessorCount, n = blocks * kThreads;
  float *a, *b;
  unsigned *count, *generation;
  CHECK(cudaMalloc(&a, n * sizeof(float)));
  CHECK(cudaMalloc(&b, n * sizeof(float)));
  CHECK(cudaMalloc(&count, sizeof(unsigned)));
  CHECK(cudaMalloc(&generation, sizeof(unsigned)));
  CHECK(cudaMemset(a, 0, n * sizeof(float)));
  CHECK(cudaMemset(count, 0, sizeof(unsigned)));
  CHECK(cudaMemset(generation, 0, sizeof(unsigned)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  std::printf("%s, %d SMs, %d phases of %d blocks x %d threads, median of %d rounds\n", prop.name, blocks, phases,
              blocks, kThreads, rounds);

  for (int pdl = 0; pdl < 2; ++pdl) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int p = 0; p < phases; ++p) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(blocks);
      cfg.blockDim = dim3(kThreads);
      cfg.stream = stream;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = attr;
      cfg.numAttrs = pdl;
      const float* in = (p & 1) ? b : a;
      float* out = (p & 1) ? a : b;
      CHECK(cudaLaunchKernelEx(&cfg, phase_kernel, in, out, pdl));
    }
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(cudaGraphLaunch(exec, stream));  // warm-up
    std::vector<float> us;
    for (int r = 0; r < rounds; ++r) {
      CHECK(cudaEventRecord(t0, stream));
      CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(t1, stream));
      CHECK(cudaEventSynchronize(t1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, t0, t1));
      us.push_back(ms * 1000.f / phases);
    }
    std::printf("kernels in a CUDA graph%s: %.2f us a phase\n", pdl ? ", programmatic dependent launch" : "",
                median(us));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
  }

  std::vector<float> us;
  int p_arg = phases & ~1;  // even: each launch ends in `a`, where the next begins
  CHECK(cudaMemset(a, 0, n * sizeof(float)));
  void* args[] = {&a, &b, &p_arg, &count, &generation};
  for (int r = 0; r <= rounds; ++r) {  // the first launch warms up
    CHECK(cudaEventRecord(t0, stream));
    CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(persistent_kernel), dim3(blocks), dim3(kThreads),
                                      args, 0, stream));
    CHECK(cudaEventRecord(t1, stream));
    CHECK(cudaEventSynchronize(t1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    if (r > 0) us.push_back(ms * 1000.f / p_arg);
  }
  std::printf("one persistent kernel, a grid barrier a phase: %.2f us a phase\n", median(us));
  std::vector<float> got(n);
  CHECK(cudaMemcpy(got.data(), a, n * sizeof(float), cudaMemcpyDeviceToHost));
  const float want = float(rounds + 1) * p_arg;  // each phase adds one to what the phase before wrote
  const bool ok = std::all_of(got.begin(), got.end(), [&](float v) { return v == want; });
  std::printf("persistent kernel's phases in order: %s (%.0f, want %.0f)\n", ok ? "yes" : "NO", got[0], want);
  return ok ? 0 : 1;
}
