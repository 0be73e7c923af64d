#!/bin/bash
# The "as users run it" check in one device call: `diffrl train` on a recipe's YAML (real size, random weights
# built in memory from a folder of configs) against benchmarks/rl_step.py on the same levers, then rl_step's
# steady-state step under the profiler (device time by kernel kind and stage: benchmarks/kernel_profile.py) and two
# steps with every synchronising CUDA call recorded (what makes the host wait: benchmarks/sync_points.py).
# Both at rl_step's --quick size (one prompt x one group a step) with the rule reward jpeg_compressibility.
#   bash benchmarks/users_vs_engine_gpu.sh qwen_image /tmp/out     # or sd35m
# On the GPU machine with the offline bundle on PYTHONPATH (docs/performance.md says how). Writes
# train_e2e_<recipe>_users_h200.json, <recipe>_users_h200.json (rl_step) and the logs to OUT.
set -u
ARCH=${1:?qwen_image or sd35m}; OUT=${2:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case $ARCH in
  qwen_image) CONFIG=qwen_image_ocr_lora; RECIPE=qwen_image_ocr_lora; ROWS=16; MB=4 ;;
  sd35m) CONFIG=sd35m_flow_grpo_ocr; RECIPE=sd35m_flow_grpo; ROWS=24; MB=24 ;;
  *) echo "unknown recipe $ARCH"; exit 2 ;;
esac
T0=$SECONDS
python3 -m diffrl.flows.cli random-model "$ARCH" "/tmp/$ARCH" --configs-only > "$OUT/random_model.log" 2>&1 || exit 1
# the product: the recipe's YAML as shipped, at one prompt a step (its levers: compile, TF32, bf16 LoRA compute, cuDNN
# attention, its micro-batch; Qwen-Image's ODE tail and sorted rows)
timeout 330 python3 -m benchmarks.train_e2e --config $CONFIG --steps 4 --warmup 2 --timeout 320 --flow-only \
  --keep "/tmp/e2e_$ARCH" model.path=random:/tmp/$ARCH rollout.prompts_per_step=1 train.mini_batch_prompts=1 \
  rollout.chunk_size=$ROWS "reward.components=[{name: jpeg_compressibility}]" data.num_val_prompts=0 \
  --out "$OUT/train_e2e_${ARCH}_users_h200.json" > "$OUT/flow.log" 2>&1
echo "flow done rc=$? at $((SECONDS - T0)) s"; tail -n 4 "$OUT/flow.log"
# the engines' benchmark on the YAML's levers (SD3.5-M: the micro-batch rl_step's probe picks on an H200, 24; the YAML
# keeps 12, which an 80 GB H100 holds), then the profiled steady-state step
timeout $((590 - (SECONDS - T0))) python3 -m benchmarks.rl_step --recipe $RECIPE --quick --sdpa cudnn --compile \
  --micro-batch $MB --checkpointing 0 --warmup 2 --steps 2 --tf32 --lora-compute base --variants "" --profile --sync-points \
  --out "$OUT/${RECIPE}_users_h200.json" > "$OUT/rl_step.log" 2>&1
echo "rl_step done rc=$? at $((SECONDS - T0)) s"; tail -n 30 "$OUT/rl_step.log"
