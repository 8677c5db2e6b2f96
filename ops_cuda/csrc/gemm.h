// Column-major GEMM with fp32 compute for the fused linear + logprob: C = alpha * op(A) . op(B) + beta * C,
// on the current stream (gemm.cpp).
#pragma once
#include <cublas_v2.h>

#include <cstdint>

namespace fw {
void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha, const void* A,
          cudaDataType_t a_t, int64_t lda, const void* B, cudaDataType_t b_t, int64_t ldb, float beta, void* C,
          cudaDataType_t c_t, int64_t ldc);
}  // namespace fw
