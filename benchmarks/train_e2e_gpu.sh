#!/bin/bash
# The issue-25 GPU measurements in one go (on the GPU machine, dependencies on PYTHONPATH): `diffrl train` against the
# engines-only loop on the shapes recipe and on SD3.5-Medium at real size (random weights written by
# `diffrl random-model`), each through benchmarks/train_e2e.py. Results and logs go to $1 (default /tmp/results).
#   bash benchmarks/train_e2e_gpu.sh /tmp/results
set -u
OUT=${1:-/tmp/results}
mkdir -p "$OUT"
DEV=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
echo "device $DEV" > "$OUT/progress.txt"
python3 -m benchmarks.train_e2e --config diffrl/configs/shapes_flow_grpo.yaml --steps 30 --keep /tmp/e2e_shapes \
    --out "$OUT/train_e2e_shapes_$DEV.json" > "$OUT/shapes.log" 2>&1
echo "shapes done $?" >> "$OUT/progress.txt"
python3 -m diffrl.flows.cli random-model sd35m /tmp/sd35m --device cuda > "$OUT/sd35m_write.log" 2>&1
echo "sd35m written $?" >> "$OUT/progress.txt"
# flow_grpo's SD3.5-M recipe (diffrl/configs/sd35m_flow_grpo_ocr.yaml: compile, bf16 LoRA compute) at rl_step.py --quick's
# size (one prompt x 24 images a step) and with its rule reward, so the figures sit next to rl_step.py's
python3 -m benchmarks.train_e2e --config sd35m_flow_grpo_ocr --steps 6 --warmup 2 --timeout 1500 --keep /tmp/e2e_sd35m \
    model.path=/tmp/sd35m rollout.prompts_per_step=1 train.mini_batch_prompts=1 rollout.chunk_size=24 \
    "reward.components=[{name: jpeg_compressibility}]" data.num_val_prompts=0 \
    --out "$OUT/train_e2e_sd35m_$DEV.json" > "$OUT/sd35m.log" 2>&1
echo "sd35m done $?" >> "$OUT/progress.txt"
