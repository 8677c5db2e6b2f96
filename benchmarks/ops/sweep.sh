#!/usr/bin/env bash
# The launch-shape sweeps behind two kernels' defaults (GPU only; results and the rejected variants are in the
# git history of docs/PERFORMANCE.md). Each setting runs in its own process, since the overrides are read once
# per process; fw times only (CUDA-graph replay): compare the "fw ms" column.
#   FW_RMS_ROWS_VECS                   vectors in flight per thread in rms_norm's rows kernel (1, 2 or 4;
#                                      default 2; rms_norm.cu)
#   FW_RMS_ROWS_THREADS                its block size (32, 64 or 128; default 64)
#   FW_RMS_ROWS_FULL                   its instances without end-of-row tests for rows that fill the groups
#                                      (1 default, 0 off: an A/B)
#   FW_RMS_LOAD_ONCE                   0 / 1: the forward rows kernel's evict-first loads of x off / on (default:
#                                      on when the output fits in L2)
#   FW_RMS_BWD_ROWS                    vectors per thread the backward rows kernel aims at (rows of at most
#                                      128 vectors; 1, 2 or 4; default 2); 0 sends them to the persistent kernel
#   FW_RMS_BWD_PREF                    vectors per thread in the persistent backward (1, 2 or 4; default 2; rows
#                                      over 128 vectors, or all with FW_RMS_BWD_ROWS=0)
#   (FW_RMS_FWD_PREF does the same for the persistent forward, which only rows over 128 vectors take: not swept)
#   FW_LOGPROB_TILE=rows,cols          the fp32 logits tile of linear_logprob (default 8192,8192; cols a multiple
#                                      of 256; linear_logprob.cu)
# Usage: bash benchmarks/ops/sweep.sh [rms|logprob ...]   (default: both)
set -u
run() { echo "--- $*"; env "$@" python3 -m benchmarks.ops.bench_ops --fw-only --only "$ONLY" 2>&1 | grep -E "^  [a-z_]+ |peak memory" ; }
[ $# -eq 0 ] && set -- rms logprob
for what in "$@"; do
  case $what in
    rms) ONLY=rms_norm
         for v in 1 2 4; do run FW_RMS_ROWS_VECS=$v; done
         for t in 32 64 128; do run FW_RMS_ROWS_THREADS=$t; done
         for f in 0 1; do run FW_RMS_ROWS_FULL=$f; done
         for o in 0 1; do run FW_RMS_LOAD_ONCE=$o; done
         for v in 0 1 2 4; do run FW_RMS_BWD_ROWS=$v; done
         for p in 1 2 4; do run FW_RMS_BWD_ROWS=0 FW_RMS_BWD_PREF=$p; done ;;
    logprob) ONLY=linear_logprob
         for t in 4096,8192 2048,4096 1024,8192 2048,16384 8192,4096 16384,2048 1765,152576; do
           run FW_LOGPROB_TILE=$t; done ;;
    *) echo "unknown sweep: $what (rms, logprob)"; exit 2 ;;
  esac
done
