#!/usr/bin/env bash
# DDP evidence on a 2-GPU machine (docs/MULTI_GPU.md): SFT loss parity with 1 GPU on the same
# global batch, tokens/s scaling, save on 2 -> resume on 1 and 1 -> 2 with the data position checked, and
# GRPO on 1 vs 2 GPUs with a 2 -> 1 resume. Logs and a summary go to $OUT (default mgpu-logs).
#   bash benchmarks/multi_gpu.sh                       # nvidia-h200-x2: qwen3-0.6b, bf16, 2048 tokens
#   ACCEL=cpu PRESET=tiny PREC=32-true SEQ=96 ROWS=2 STEPS=4 GRPO_CFG=train.yaml PROMPTS=8 GSTEPS=4 \
#     bash benchmarks/multi_gpu.sh                     # the same flow on CPU (gloo), as a dry run
#   PARTS=grpo bash benchmarks/multi_gpu.sh            # one part only (sft, grpo; both by default). Each call
#                                                      # empties $RUNS: give a later call its own RUNS
set -u
OUT=${OUT:-mgpu-logs}; mkdir -p "$OUT"
# NVLink multicast stays off in every process: on a host whose GPUs are shared, a program that uses it can put
# them out of service. Lightning starts rank 1 with this environment, so exporting it here covers both ranks.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. "$(dirname "$0")/device_env.sh"
ACCEL=${ACCEL:-gpu} PRESET=${PRESET:-qwen3-0.6b} PREC=${PREC:-bf16-mixed} SEQ=${SEQ:-2048} ROWS=${ROWS:-8}
STEPS=${STEPS:-20} STRATEGY=${STRATEGY:-ddp} GRPO_CFG=${GRPO_CFG:-benchmarks/grpo_bench.yaml}
PROMPTS=${PROMPTS:-32} GSTEPS=${GSTEPS:-6} R=${RUNS:-/tmp/mgpu-runs} PARTS=${PARTS:-sft grpo}
for part in $PARTS; do
  case $part in sft|grpo) ;; *) echo "multi_gpu.sh: PARTS has '$part'; expected sft and/or grpo, separated by spaces" >&2; exit 2;; esac
done
rm -rf "$R"; mkdir -p "$R"
HALF=$((STEPS / 2)); GHALF=$((GSTEPS / 2))

fit() {  # fit NAME DEVICES ARGS...: one `fw fit`, its log in $OUT/NAME.log
  local name=$1 dev=$2; shift 2
  local strategy=auto; [ "$dev" -gt 1 ] && strategy=$STRATEGY
  local t0=$SECONDS
  python3 -m framework fit "$@" --trainer.accelerator="$ACCEL" --trainer.devices="$dev" --trainer.strategy="$strategy" \
    --trainer.precision="$PREC" --trainer.enable_progress_bar=false --logging.tensorboard=false >"$OUT/$name.log" 2>&1
  echo "=== $name (devices $dev): rc=$? in $((SECONDS - t0))s" | tee -a "$OUT/summary.log"
}
compare() {  # compare TITLE ARGS... (benchmarks/compare_runs.py)
  echo "--- $1" | tee -a "$OUT/summary.log"; shift
  python3 -m benchmarks.compare_runs "$@" | python3 -c "import json, sys; d = json.load(sys.stdin); d.pop('rel'); print(json.dumps(d))" \
    | tee -a "$OUT/summary.log"
}
state() {  # state RUN STEP: the checkpoint's recipe state (data position)
  python3 -c "import sys, torch; print(sys.argv[1], torch.load(sys.argv[1], weights_only=False)['fw_recipe'])" \
    "$1/checkpoints/$(printf 'step-%06d' "$2")/trainer_state.pt" | tee -a "$OUT/summary.log"
}
resume_from() {  # resume_from SRC STEP DST: DST holds only checkpoint STEP of SRC
  mkdir -p "$3/checkpoints" && cp -r "$1/checkpoints/$(printf 'step-%06d' "$2")" "$3/checkpoints/"
}
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null; git log -1 --format='commit %h %s'; } \
  | tee -a "$OUT/summary.log"

if [[ " $PARTS " == *" sft "* ]]; then
SFT=(--config recipes/sft.yaml --model.policy.preset="$PRESET" --data.max_seq_len="$SEQ" --trainer.max_steps="$STEPS"
     --trainer.log_every_n_steps=1 --checkpoint.every_n_steps="$HALF" --checkpoint.keep_last=null)
fit sft-1gpu 1 "${SFT[@]}" --data.batch_size="$ROWS" --run_dir="$R/sft-1gpu"
fit sft-2gpu-same-global 2 "${SFT[@]}" --data.batch_size=$((ROWS / 2)) --run_dir="$R/sft-2gpu-same-global"
fit sft-2gpu-same-per-gpu 2 "${SFT[@]}" --data.batch_size="$ROWS" --run_dir="$R/sft-2gpu-same-per-gpu"
compare "SFT parity: 1 GPU x $ROWS rows vs 2 x $((ROWS / 2)) (same global batch)" \
  "$R/sft-1gpu" "$R/sft-2gpu-same-global" --keys loss,grad_norm,tokens
compare "SFT scaling: 1 GPU x $ROWS rows vs 2 x $ROWS (efficiency = tokens/s ratio / 2)" \
  "$R/sft-1gpu" "$R/sft-2gpu-same-per-gpu" --keys "" --gpus-b-over-a 2
resume_from "$R/sft-2gpu-same-global" "$HALF" "$R/sft-resume-on-1"
fit sft-resume-2-to-1 1 "${SFT[@]}" --data.batch_size="$ROWS" --run_dir="$R/sft-resume-on-1" --resume last
resume_from "$R/sft-1gpu" "$HALF" "$R/sft-resume-on-2"
fit sft-resume-1-to-2 2 "${SFT[@]}" --data.batch_size=$((ROWS / 2)) --run_dir="$R/sft-resume-on-2" --resume last
compare "SFT save on 2 GPUs, resume on 1 (steps after $HALF)" "$R/sft-2gpu-same-global" "$R/sft-resume-on-1" --keys loss,tokens
compare "SFT save on 1 GPU, resume on 2 (steps after $HALF)" "$R/sft-1gpu" "$R/sft-resume-on-2" --keys loss,tokens
for run in sft-1gpu sft-2gpu-same-global sft-resume-on-1 sft-resume-on-2; do state "$R/$run" "$STEPS"; done
fi

if [[ " $PARTS " == *" grpo "* ]]; then

GRPO=(--config "$GRPO_CFG" --model.policy.preset="$PRESET" --trainer.max_steps="$GSTEPS" --trainer.log_every_n_steps=1
      --checkpoint.every_n_steps="$GHALF" --checkpoint.keep_last=null --checkpoint.verify=true)
fit grpo-1gpu 1 "${GRPO[@]}" --rollout.prompts_per_step="$PROMPTS" --run_dir="$R/grpo-1gpu"
fit grpo-2gpu 2 "${GRPO[@]}" --rollout.prompts_per_step=$((PROMPTS / 2)) --run_dir="$R/grpo-2gpu"
compare "GRPO: 1 GPU x $PROMPTS prompts vs 2 x $((PROMPTS / 2)) (strong scaling; values differ: other samples)" \
  "$R/grpo-1gpu" "$R/grpo-2gpu" --keys "" --gpus-b-over-a 2
resume_from "$R/grpo-2gpu" "$GHALF" "$R/grpo-resume-on-1"
fit grpo-resume-2-to-1 1 "${GRPO[@]}" --rollout.prompts_per_step="$PROMPTS" --run_dir="$R/grpo-resume-on-1" --resume last
for run in grpo-1gpu grpo-2gpu grpo-resume-on-1; do state "$R/$run" "$GSTEPS"; done
fi
echo "=== done; the runs are in $R" | tee -a "$OUT/summary.log"
