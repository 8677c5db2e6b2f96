// Host helpers shared by the host wrappers of csrc/<op>.cu (at::Tensor in, kernel launches out). Like the
// wrappers, they are local to each op's translation unit (an unnamed namespace); each .cu includes this once.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "common.cuh"

namespace fw {
// RoPE's inverse frequencies [D/2] in float32 on `device`, as transformers computes them (csrc/rope.cu).
at::Tensor rope_inv_freq(int64_t D, double theta, const at::Device& device);
}  // namespace fw

namespace {

using at::Tensor;

inline fw::DType dtype_of(const Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return fw::DType::F32;
    case at::kBFloat16: return fw::DType::BF16;
    case at::kHalf: return fw::DType::F16;
    default:
      TORCH_CHECK(false, "fw::", op, ": `", name, "` has dtype ", t.scalar_type(),
                  "; the CUDA kernels take float32, bfloat16 or float16");
  }
}

inline void check_launch(cudaError_t e, const char* op) {
  TORCH_CHECK(e == cudaSuccess, "fw::", op, ": kernel launch failed: ", cudaGetErrorString(e));
}

inline void check_cuda(const Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), "fw::", op, ": `", name, "` must be a CUDA tensor, got ", t.device());
}

inline int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }
inline int64_t l2_bytes() { return at::cuda::getCurrentDeviceProperties()->l2CacheSize; }

// `n` int counters that are zero when a kernel starts, for kernels whose last block to arrive resets the counters it
// used. One zeroed buffer per device is kept (never freed: graphs captured earlier hold its address) and grown
// outside captures; a capture that needs more than it has gets its own zeroed buffer in `local` (the memset becomes
// part of the graph). The shared buffer assumes that the op's calls on one device do not run concurrently on two
// streams. Each translation unit (op) has its own buffers.
inline int* zeroed_counters(int64_t n, const Tensor& like, cudaStream_t stream, Tensor& local) {
  static std::mutex mu;
  // leaked on purpose: no tensor destructor may run at exit, after the CUDA runtime is gone
  static auto* bufs = new std::map<int, Tensor>();
  static auto* retired = new std::vector<Tensor>();
  std::lock_guard<std::mutex> lock(mu);
  Tensor& buf = (*bufs)[like.get_device()];
  if (buf.defined() && buf.numel() >= n) return buf.data_ptr<int>();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) {
    local = at::zeros({n}, like.options().dtype(at::kInt));
    return local.data_ptr<int>();
  }
  if (buf.defined()) retired->push_back(buf);
  buf = at::zeros({std::max<int64_t>(n, 4096)}, like.options().dtype(at::kInt));
  return buf.data_ptr<int>();
}

}  // namespace
