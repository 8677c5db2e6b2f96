// Host helpers shared by the host wrappers of csrc/<op>.cu (at::Tensor in, kernel launches out). Like the
// wrappers, they are local to each op's translation unit (an unnamed namespace); each .cu includes this once.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

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

}  // namespace
