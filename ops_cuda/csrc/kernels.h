// Launchers of the fw CUDA kernels: plain CUDA entry points (raw pointers, the caller's stream), so the
// .cu files build without the torch headers; bindings.cpp adapts them to at::Tensor.
// Every launcher returns the launch's cudaError_t (cudaGetLastError after the launch).
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>

namespace fw {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };

// x [rows, D] -> y [rows, D]; weight [D] of wdtype (x's dtype or F32).
// The grid is one wave of resident blocks (sm_count SMs) looping over the rows; l2_bytes (the device's L2)
// decides whether the rows kernel loads x evict-first.
cudaError_t rms_norm_fwd(DType dt, DType wdt, const void* x, const void* w, void* y, int64_t rows, int D,
                         float eps, int sm_count, int64_t l2_bytes, cudaStream_t stream);
// gx [rows, D] (x's dtype), gw [D] (wdt); gw_partial [max_blocks, D] fp32 scratch: one partial row per block of
// the main kernel (one wave of resident blocks), summed by a second kernel.
int rms_norm_bwd_max_blocks(int sm_count);
cudaError_t rms_norm_bwd(DType dt, DType wdt, const void* grad, const void* x, const void* w, void* gx,
                         void* gw, float* gw_partial, int max_blocks, int64_t rows, int D, float eps,
                         int sm_count, cudaStream_t stream);

// q [B, T, Hq, D], k [B, T, Hk, D] with element strides (b, t, h) and a contiguous last dim; outputs
// contiguous; positions [B*T] int64; inv_freq [D/2] fp32.
struct RopeStrides {
  int64_t T;
  int64_t q[3];
  int64_t k[3];
};
cudaError_t rope_fwd(DType dt, const void* q, const void* k, void* q_out, void* k_out, const int64_t* positions,
                     const float* inv_freq, RopeStrides strides, int64_t tokens, int Hq, int Hk, int D, bool inverse,
                     cudaStream_t stream);

// gate_up [rows, 2I] -> out [rows, I]; backward: grad [rows, I] -> grad_gate_up [rows, 2I].
cudaError_t swiglu_fwd(DType dt, const void* gate_up, void* out, int64_t rows, int64_t I, cudaStream_t stream);
cudaError_t swiglu_bwd(DType dt, const void* grad, const void* gate_up, void* grad_gate_up, int64_t rows,
                       int64_t I, cudaStream_t stream);

// The fused linear + logprob walks the logits in fp32 tiles z [n, vc] (already divided by the temperature):
// rows n0.. of the batch, vocabulary columns v0 .. v0 + vc of V, v0 a multiple of kLogprobChunk; row i of a tile
// is contiguous (vc floats). Forward: each chunk of kLogprobChunk columns of a row leaves its logsumexp partial
// (m, s, a) in LogprobParts (row i, column v0 / kLogprobChunk + chunk; row stride ld = ceil(V / kLogprobChunk))
// and the chunk holding the target its logit in target_z[i]; logprob_merge then combines a row's partials into
// logprob, entropy and lse (pointers at the row tile's first row). Negative target: logprob 0; target >= V: NaN.
// Kept logits (z16 set): the tile also goes to z16 + i * z16_ld in fp16 as z minus its chunk's m, so parts.m
// doubles as the offsets that the backward adds back.
// 256: the column block of the Hopper kernel below, whose partials and kept-logit offsets must be the row
// kernels' too, so that both paths keep the same logits and the kept and recomputing forwards agree bit for bit.
constexpr int64_t kLogprobChunk = 256;
struct LogprobParts {
  float* m;
  float* s;
  float* a;
  int64_t ld;
  float* target_z;
};
cudaError_t logprob_chunks_fwd(const float* z, int64_t n, int64_t vc, int64_t v0, const int64_t* targets,
                               LogprobParts parts, void* z16, int64_t z16_ld, cudaStream_t stream);
cudaError_t logprob_merge(LogprobParts parts, int64_t n, int64_t V, const int64_t* targets, float* logprob,
                          float* entropy, float* lse, cudaStream_t stream);
// The kept logits as the backward reads them: row i of the tile at z16 + i * ld (fp16), the offset of its chunk
// of kLogprobChunk columns at off[i * off_ld + column / kLogprobChunk] (pointers at the tile's first row and
// column). z16 == nullptr: none.
struct SavedLogits {
  const void* z16;
  int64_t ld;
  const float* off;
  int64_t off_ld;
};
// d(loss)/dz for a tile, written in dtype dt into g [n, vc] (the 1/temperature is left to the caller), from the
// fp32 tile z (row stride vc) or, when saved.z16 is set, from the kept logits (z ignored).
cudaError_t logprob_tile_bwd(DType dt, const float* z, SavedLogits saved, int64_t n, int64_t vc, int64_t v0,
                             const int64_t* targets, const float* lse, const float* entropy,
                             const float* grad_logprob, const float* grad_entropy, void* g, cudaStream_t stream);

// The same on Hopper (sm_90a, logprob_sm90.cu), with the row work done on the GEMM's accumulators: hidden
// [n, K] and weight [vc, K] row-major 16-bit, 16-byte aligned, K a multiple of 8. The forward covers the whole
// vocabulary (V columns) in one launch and leaves the partials of every chunk as logprob_chunks_fwd does (parts.ld
// = ceil(V / kLogprobChunk)), with the kept logits in z16 (row stride z16_ld) when z16 is set; the backward writes
// d(loss)/dz of columns v0 .. v0 + vc into g [n, vc] as logprob_tile_bwd does.
// Whether that kernel runs here: compute capability 9.0, 16-bit operands, the shapes above, and not turned off
// with FW_LOGPROB_SM90=0 (read per call; the benchmark's and tests' A/B against the cuBLAS tiles).
bool linear_logprob_sm90_supported(DType dt, int cc_major, int cc_minor, int64_t K, const void* h, const void* w);
cudaError_t linear_logprob_sm90_fwd(DType dt, const void* h, const void* w, int64_t n, int64_t V, int64_t K,
                                    float inv_t, const int64_t* targets, LogprobParts parts, void* z16,
                                    int64_t z16_ld, int sm_count, cudaStream_t stream);
cudaError_t linear_logprob_sm90_bwd(DType dt, const void* h, const void* w, int64_t n, int64_t vc, int64_t K,
                                    int64_t v0, float inv_t, const int64_t* targets, const float* lse,
                                    const float* entropy, const float* grad_logprob, const float* grad_entropy,
                                    void* g, int sm_count, cudaStream_t stream);

// q [B, Hq, D] (16-byte aligned); caches addressed as base + b*sb + h*sh + s*ss + d (elements; base 16-byte
// aligned, strides multiples of 16 bytes); out [B, Hq, D]. Any Hq % Hk == 0, D a multiple of 8 up to 256.
// With plan.splits > 1: o/m/l hold the per-split partials and count one int per (b, kv head, head group)
// (B * Hk * plan.groups ints), zero before the launch and left zero after it.
struct DecodeWorkspace {
  float* o;    // [B, Hq, splits, D]
  float* m;    // [B, Hq, splits]
  float* l;    // [B, Hq, splits]
  int* count;  // [B, Hk, groups]
};
// How one call runs, decided once (the overrides FW_DECODE_MMA and FW_DECODE_SPLITS are read here, per call):
// the kernel, the head groups a kv head and the splits of the context. The workspace is sized from it.
struct DecodePlan {
  bool mma;    // the tensor-core kernel, else the ring kernel
  int groups;  // query-head groups a kv head, a block each
  int splits;
};
DecodePlan decode_attention_plan(DType dt, int B, int Hq, int Hk, int S, int D, int sm_count);
cudaError_t decode_attention(DType dt, const void* q, const void* k, const void* v, const int64_t* lengths,
                             void* out, DecodeWorkspace ws, int B, int Hq, int Hk, int S, int D, int64_t sb,
                             int64_t sh, int64_t ss, DecodePlan plan, float scale, cudaStream_t stream);

// logits [B, V] (row stride in elements) -> tokens int64 [B], logprob fp32 [B]. Plain sampling and greedy
// split each row over P blocks; the workspace holds 3 floats and 1 int64 per (row, part).
struct SampleSplitWorkspace {
  int P;
  float* part_f;     // [B, P, 3]
  int64_t* part_i;   // [B, P]
};
int sample_split_parts(int B, int64_t V, int sm_count);
cudaError_t sample(DType dt, const void* logits, int64_t row_stride, int64_t* tokens, float* logprob, int B,
                   int64_t V, float temperature, int64_t top_k, float top_p, float log_min_p, bool use_min_p,
                   uint64_t seed, SampleSplitWorkspace split_ws, cudaStream_t stream);

}  // namespace fw
