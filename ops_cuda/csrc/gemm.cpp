// The GEMMs of the fused linear + logprob (linear_logprob.cu), through cuBLASLt with the algorithm chosen per
// shape.
//
// cuBLASLt's heuristic does not always put first the fastest algorithm for the logits GEMM (K = 1,024, fp32 out):
// one of the next few can be faster (FW_GEMM_LOG=1 prints them; `FW_GEMM=heuristic python -m
// benchmarks.ops.bench_ops --only linear_logprob` against the default shows the difference).
// So, for a shape met outside CUDA-graph capture, the heuristic's first kCandidates algorithms without split-K
// each run once on the call's operands; those whose output has the same bits as the first's are timed
// (kTimedRuns runs on the caller's stream) and the fastest is kept for the process. The choice thus gave the
// heuristic's bits on the operands it was made with (bit-equality there is evidence, not a proof, for other
// operands). Under capture, or while the operands multiply to zero, the heuristic's first runs untimed; where
// cuBLASLt offers no algorithm without split-K, cublasGemmEx. For A/B runs and tests,
// FW_GEMM (read once a process) = heuristic keeps the heuristic's first, = ex takes cublasGemmEx; = tuned is the
// default. Tuning synchronises the stream and holds a scratch copy of C (two more when C is read) for its
// duration.
//
// Shapes come in families: each of m, n, k and the leading dimensions rounded up to three significant bits (the
// octave [2^p, 2^(p+1)) split into four), the rest of the key exact. Only the first shape of a family is tuned.
// A later one runs, untimed, the family's choice where the heuristic's first for it is the algorithm the family's
// choice matched bit for bit (and cuBLASLt's AlgoCheck accepts the choice for this shape), else the heuristic's
// first. SFT's loss rows (n or k of the logprob GEMMs) change at every step: tuning each new count would
// synchronise the stream dozens of times a step and never end.
//
// The choices by shape and the tuned families are each kept for at most FW_GEMM_CACHE (read once a process,
// default 1024) keys, the least recently used going first: a long run meets ever new shapes, and the maps must
// not grow with it. A lookup that finds a key makes it the most recent, so a shape in use is never tuned again.
#include "gemm.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

namespace fw {
namespace {

constexpr int kCandidates = 8, kTimedRuns = 5;

// What decides the algorithms cuBLASLt may offer and whether one runs: the device, shape, layout, types, whether
// C is read, operand alignment, the workspace size.
using GemmKey = std::tuple<int, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int, bool,
                           unsigned, unsigned, unsigned, size_t>;

unsigned alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  unsigned b = 16;
  while (b > 1 && a % b) b /= 2;
  return b;
}

struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  ~LtDescs() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

void make_descs(LtDescs& d, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
                cudaDataType_t a_t, int64_t lda, cudaDataType_t b_t, int64_t ldb, cudaDataType_t c_t, int64_t ldc) {
  // fp32 compute and scale type, no TF32 (logprobs feed importance ratios), as cublasGemmEx with default math
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const bool an = ta == CUBLAS_OP_N, bn = tb == CUBLAS_OP_N;
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, a_t, an ? m : k, an ? k : m, lda));
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, b_t, bn ? k : n, bn ? n : k, ldb));
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, c_t, m, n, ldc));
}

// The heuristic's first kCandidates algorithms with no split-K reduction (asked for, and checked).
std::vector<cublasLtMatmulAlgo_t> candidates(cublasLtHandle_t h, const LtDescs& d, size_t ws_bytes, unsigned al_a,
                                             unsigned al_b, unsigned al_c) {
  cublasLtMatmulPreference_t pref;
  TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = ws_bytes;
  uint32_t aa = al_a, ab = al_b, ac = al_c, reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof(aa));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof(ab));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof(ac));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof(ac));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction,
                                       sizeof(reduction));
  cublasLtMatmulHeuristicResult_t res[kCandidates];
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, d.op, d.a, d.b, d.c, d.c, pref, kCandidates, res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  std::vector<cublasLtMatmulAlgo_t> out;
  if (st != CUBLAS_STATUS_SUCCESS) return out;
  for (int i = 0; i < found; ++i) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
    int32_t splitk = 1;
    size_t w = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &w);
    if (splitk <= 1) out.push_back(res[i].algo);
  }
  return out;
}

void describe(const cublasLtMatmulAlgo_t& algo, char* buf, size_t n) {
  int32_t id = 0, stages = 0, swizzle = 0, cluster = 0;
  int32_t tile = 0;
  size_t w = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &w);
  snprintf(buf, n, "algo %d tile %d stages %d swizzle %d cluster %d", id, tile, stages, swizzle, cluster);
}

struct Choice {
  bool lt = true;  // false: cublasGemmEx
  cublasLtMatmulAlgo_t algo{};
};

// A tuned family: the heuristic's first algorithm on the shape it was tuned with, and the choice, which gave
// that algorithm's bits there.
struct Family {
  cublasLtMatmulAlgo_t first{};
  Choice tuned;
};

struct Tuned {
  size_t index;     // into the candidates
  bool conclusive;  // false: the operands could not tell candidates apart; tune again on a later call
};

// The fastest of `cand` among those whose output has the same bits as the reference: the first candidate that
// runs (cand[0], the heuristic's choice, unless it fails). C is m x n, column-major with leading dimension ldc.
// With beta == 0 the reference is computed into C (the call after tuning overwrites it with the same bits);
// otherwise C is left as it was and each candidate starts from a copy. Timed runs go to a scratch matrix, after
// one untimed run, so that the GPU is busy when the first event is queued. Inconclusive when the reference is
// all zeros (beta == 0) or equals C (beta != 0): operands that multiply to zero give every candidate the same
// bits, e.g. a first backward with zero gradients.
template <typename Run>
Tuned tune(const std::vector<cublasLtMatmulAlgo_t>& cand, Run& run, void* C, cudaDataType_t c_t, int64_t m,
           int64_t n, int64_t ldc, bool reads_c, cudaStream_t stream, bool log, const char* what) {
  const int64_t bytes = ((n - 1) * ldc + m) * (c_t == CUDA_R_32F ? 4 : 2);
  const auto opts = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, c10::cuda::current_device());
  const at::Tensor c = at::from_blob(C, {bytes}, opts);
  const at::Tensor init = reads_c ? c.clone() : at::Tensor();
  at::Tensor ref = reads_c ? c.clone() : c, out = at::empty({bytes}, opts);
  size_t first = 0;
  while (first < cand.size() && run(cand[first], ref.data_ptr()) != CUBLAS_STATUS_SUCCESS) {
    if (reads_c) ref.copy_(init);
    ++first;
  }
  if (first == cand.size()) return {0, true};  // none runs: the call reports cuBLASLt's error
  if (reads_c ? at::equal(ref, init) : !ref.any().item<bool>()) {
    if (log) fprintf(stderr, "fw gemm %s: inconclusive operands (a zero product), not tuned yet\n", what);
    return {first, false};
  }
  cudaEvent_t e0, e1;
  C10_CUDA_CHECK(cudaEventCreate(&e0));
  C10_CUDA_CHECK(cudaEventCreate(&e1));
  size_t best_i = first;
  float best = -1.f;
  for (size_t i = first; i < cand.size(); ++i) {
    bool same = true;
    if (i != first) {
      if (reads_c) out.copy_(init);
      if (run(cand[i], out.data_ptr()) != CUBLAS_STATUS_SUCCESS) continue;  // an algorithm that fails is skipped
      same = at::equal(out, ref);
    }
    float ms = -1.f;
    if (same) {
      TORCH_CUDABLAS_CHECK(run(cand[i], out.data_ptr()));  // untimed: the GPU is busy when e0 is queued
      C10_CUDA_CHECK(cudaEventRecord(e0, stream));
      for (int r = 0; r < kTimedRuns; ++r) TORCH_CUDABLAS_CHECK(run(cand[i], out.data_ptr()));
      C10_CUDA_CHECK(cudaEventRecord(e1, stream));
      C10_CUDA_CHECK(cudaEventSynchronize(e1));
      C10_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      ms /= kTimedRuns;
      if (best < 0.f || ms < best) best = ms, best_i = i;  // ties keep the heuristic's order
    }
    if (log) {
      char how[96];
      describe(cand[i], how, sizeof(how));
      fprintf(stderr, "fw gemm %s: candidate %zu (%s) %s %.4f ms\n", what, i, how,
              same ? "same bits" : "OTHER BITS, not timed", ms);
    }
  }
  C10_CUDA_CHECK(cudaEventDestroy(e0));
  C10_CUDA_CHECK(cudaEventDestroy(e1));
  if (log) fprintf(stderr, "fw gemm %s: chose candidate %zu\n", what, best_i);
  return {best_i, true};
}

// x rounded up to three significant bits: a family of shapes shares its tuning.
int64_t family_dim(int64_t x) {
  if (x <= 16) return x;
  int64_t p = 1;
  while (p <= x / 2) p *= 2;
  const int64_t step = p / 4;
  return (x + step - 1) / step * step;
}

// Whether two algorithms are one configuration (id, tile, stages, split-K, reduction, swizzle, custom option,
// inner and cluster shapes): the same arithmetic in the same order.
bool same_config(const cublasLtMatmulAlgo_t& x, const cublasLtMatmulAlgo_t& y) {
  static const cublasLtMatmulAlgoConfigAttributes_t attrs[] = {
      CUBLASLT_ALGO_CONFIG_ID,           CUBLASLT_ALGO_CONFIG_TILE_ID,       CUBLASLT_ALGO_CONFIG_STAGES_ID,
      CUBLASLT_ALGO_CONFIG_SPLITK_NUM,   CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
      CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
  for (const auto a : attrs) {
    size_t n = 0, w = 0;  // the attribute's size, which a read must give exactly
    if (cublasLtMatmulAlgoConfigGetAttribute(&x, a, nullptr, 0, &n) != CUBLAS_STATUS_SUCCESS || n > 8) return false;
    int64_t u = 0, v = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&x, a, &u, n, &w) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigGetAttribute(&y, a, &v, n, &w) != CUBLAS_STATUS_SUCCESS || u != v)
      return false;
  }
  return true;
}

// Whether cuBLASLt can run `algo` on the shape of `d` within the workspace.
bool accepts(cublasLtHandle_t h, const LtDescs& d, const cublasLtMatmulAlgo_t& algo, size_t ws_bytes) {
  cublasLtMatmulHeuristicResult_t res{};
  return cublasLtMatmulAlgoCheck(h, d.op, d.a, d.b, d.c, d.c, &algo, &res) == CUBLAS_STATUS_SUCCESS &&
         res.state == CUBLAS_STATUS_SUCCESS && res.workspaceSize <= ws_bytes;
}

// A map of at most `cap` keys that drops the least recently used key to make room; not thread-safe (the
// caller's mutex guards it).
template <typename K, typename V>
class LruMap {
 public:
  explicit LruMap(size_t cap) : cap_(cap) {}
  // The value of `key`, now the most recently used, or nullptr.
  const V* find(const K& key) {
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return &it->second->second;
  }
  // Adds `key` unless it is there (a value found first stays, as std::map::emplace keeps it); either way it
  // becomes the most recently used.
  void emplace(const K& key, const V& value) {
    if (find(key)) return;
    order_.emplace_front(key, value);
    index_.emplace(key, order_.begin());
    while (index_.size() > cap_) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
  }

 private:
  size_t cap_;
  std::list<std::pair<K, V>> order_;  // most recently used first
  std::map<K, typename std::list<std::pair<K, V>>::iterator> index_;
};

// FW_GEMM_CACHE: how many keys each of the choice maps keeps (default 1024).
size_t cache_capacity() {
  const char* v = getenv("FW_GEMM_CACHE");
  if (!v || !*v) return 1024;
  char* end = nullptr;
  errno = 0;
  const long long n = strtoll(v, &end, 10);
  TORCH_CHECK(errno == 0 && *end == '\0' && n >= 1, "FW_GEMM_CACHE must be a whole number of entries >= 1, got '",
              v, "'");
  return (size_t)n;
}

// Whether `s` is capturing; false where that cannot be asked, whose error is cleared (the rule at fw::cleared in
// common.cuh).
bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(s, &st);
  C10_CUDA_IGNORE_ERROR(e);
  return e == cudaSuccess && st != cudaStreamCaptureStatusNone;
}

}  // namespace

void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha, const void* A,
          cudaDataType_t a_t, int64_t lda, const void* B, cudaDataType_t b_t, int64_t ldb, float beta, void* C,
          cudaDataType_t c_t, int64_t ldc) {
  enum Mode { kTuned, kHeuristic, kEx };
  static const Mode mode = [] {
    const char* v = getenv("FW_GEMM");
    if (!v || !*v || strcmp(v, "tuned") == 0) return kTuned;
    if (strcmp(v, "heuristic") == 0) return kHeuristic;
    TORCH_CHECK(strcmp(v, "ex") == 0, "FW_GEMM must be tuned, heuristic or ex, got '", v, "'");
    return kEx;
  }();
  static const bool log = [] {
    const char* v = getenv("FW_GEMM_LOG");
    return v && strcmp(v, "1") == 0;
  }();
  auto gemm_ex = [&] {
    cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
    cublasMath_t prev;
    TORCH_CUDABLAS_CHECK(cublasGetMathMode(handle, &prev));
    TORCH_CUDABLAS_CHECK(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));
    const cublasStatus_t st = cublasGemmEx(handle, ta, tb, (int)m, (int)n, (int)k, &alpha, A, a_t, (int)lda, B, b_t,
                                           (int)ldb, &beta, C, c_t, (int)ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    TORCH_CUDABLAS_CHECK(cublasSetMathMode(handle, prev));
    TORCH_CUDABLAS_CHECK(st);
  };
  if (mode == kEx) {
    static const bool said = log && fprintf(stderr, "fw gemm: FW_GEMM=ex, every GEMM through cublasGemmEx\n") > 0;
    (void)said;
    return gemm_ex();
  }
  static const size_t cap = cache_capacity();
  static std::mutex mu;
  static LruMap<GemmKey, Choice> chosen(cap);    // by exact shape
  static LruMap<GemmKey, Family> families(cap);  // by family_key: the tuning of the family's first shape

  cublasLtHandle_t h = at::cuda::getCurrentCUDABlasLtHandle();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  void* ws = at::cuda::getCUDABlasLtWorkspace();
  const size_t ws_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  const unsigned al_a = alignment(A), al_b = alignment(B), al_c = alignment(C);
  const GemmKey key{(int)c10::cuda::current_device(), (int)ta, (int)tb, m, n, k, lda, ldb, ldc, (int)a_t, (int)b_t,
                    (int)c_t, beta != 0.f, al_a, al_b, al_c, ws_bytes};
  GemmKey family_key = key;
  std::get<3>(family_key) = family_dim(m), std::get<4>(family_key) = family_dim(n);
  std::get<5>(family_key) = family_dim(k), std::get<6>(family_key) = family_dim(lda);
  std::get<7>(family_key) = family_dim(ldb), std::get<8>(family_key) = family_dim(ldc);
  Choice choice;
  Family family;
  bool have = false, have_family = false;
  {
    std::lock_guard<std::mutex> g(mu);
    if (const Choice* c = chosen.find(key)) {
      choice = *c, have = true;
    } else if (const Family* f = families.find(family_key)) {
      family = *f, have_family = true;
    }
  }
  if (have && !choice.lt) return gemm_ex();
  LtDescs d;
  make_descs(d, ta, tb, m, n, k, a_t, lda, b_t, ldb, c_t, ldc);
  auto run = [&](const cublasLtMatmulAlgo_t& algo, void* out) {
    return cublasLtMatmul(h, d.op, &alpha, A, d.a, B, d.b, &beta, out, d.c, out, d.c, &algo, ws, ws_bytes, stream);
  };
  if (!have) {
    char what[96];  // the shape, for the log
    snprintf(what, sizeof(what), "%c%c m %lld n %lld k %lld beta %d", ta == CUBLAS_OP_N ? 'N' : 'T',
             tb == CUBLAS_OP_N ? 'N' : 'T', (long long)m, (long long)n, (long long)k, beta != 0.f);
    const auto cand = candidates(h, d, ws_bytes, al_a, al_b, al_c);
    if (cand.empty()) {  // small GEMMs such as 64 x 40 x 8192 can have no algorithm without split-K
      if (log) fprintf(stderr, "fw gemm %s: no cuBLASLt algorithm without split-K, cublasGemmEx\n", what);
      std::lock_guard<std::mutex> g(mu);
      chosen.emplace(key, Choice{false, {}});
      return gemm_ex();
    }
    choice = Choice{true, cand[0]};
    if (have_family) {
      const bool same = same_config(cand[0], family.first) && accepts(h, d, family.tuned.algo, ws_bytes);
      if (same) choice = family.tuned;
      if (log)
        fprintf(stderr, "fw gemm %s: %s, not timed\n", what,
                same ? "its family's choice" : "the heuristic's first (not its family's)");
      std::lock_guard<std::mutex> g(mu);
      chosen.emplace(key, choice);
    } else if (cand.size() == 1 || mode == kHeuristic) {
      if (log) fprintf(stderr, "fw gemm %s: the heuristic's first of %zu, not timed\n", what, cand.size());
      std::lock_guard<std::mutex> g(mu);
      chosen.emplace(key, choice);
    } else if (!capturing(stream)) {
      const Tuned t = tune(cand, run, C, c_t, m, n, ldc, beta != 0.f, stream, log, what);
      choice.algo = cand[t.index];
      if (t.conclusive) {
        std::lock_guard<std::mutex> g(mu);
        chosen.emplace(key, choice);
        families.emplace(family_key, Family{cand[0], choice});
      }
    }
  }
  TORCH_CUDABLAS_CHECK(run(choice.algo, C));
}

}  // namespace fw
