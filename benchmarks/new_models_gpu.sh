#!/bin/bash
# One RL step of each late-2026 model at real size on one GPU, through `diffrl train` (benchmarks/train_e2e.py
# --flow-only: Prefect, Lance, MLflow, checkpoints). Weights are random, built in memory from the published configs
# (`diffrl random-model ARCH DIR --configs-only`, `model.path=random:DIR`); each recipe as shipped at one prompt a
# step, its GPU-only reward (OCR, PickScore) replaced by the jpeg_compressibility rule reward. Results
# (train_e2e_<model>_<device>.json) and logs go to $1 (default /tmp/results); the models to run follow it
# (default: all, in this order).
#   bash benchmarks/new_models_gpu.sh /tmp/results [flux2_klein qwen_image21 ltx2 wan22_i2v flux2_dev]
set -u
OUT=${1:-/tmp/results}
shift || true
MODELS=${*:-flux2_klein qwen_image21 ltx2 wan22_i2v flux2_dev}
mkdir -p "$OUT" /tmp/new-models
DEV=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
echo "device $DEV" >> "$OUT/progress.txt"
JPEG="reward.components=[{name: jpeg_compressibility}]"
COMMON=(rollout.prompts_per_step=1 train.mini_batch_prompts=1 data.num_val_prompts=0)
# On a card under 100 GiB (an 80 GB H100) the larger models keep their text encoders in host memory and recompute
# activations in the update
GIB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
SMALL=()
[ "$GIB" -lt 100 ] && SMALL=(model.offload_text_encoder=true train.gradient_checkpointing=true)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

# run NAME ARCH CONFIG STEPS OVERRIDE...: build the configs folder, then `diffrl train` STEPS steps (the first left
# out of the medians)
run() {
    local name=$1 arch=$2 config=$3 steps=$4
    shift 4
    local folder=/tmp/new-models/$arch
    [ -d "$folder" ] || python3 -m diffrl.flows.cli random-model "$arch" "$folder" --configs-only \
        > "$OUT/${name}_configs.log" 2>&1
    python3 -m benchmarks.train_e2e --config "$config" --flow-only --steps "$steps" --warmup 1 --timeout 1500 \
        --keep "/tmp/new-models/run-$name" --out "$OUT/train_e2e_${name}_$DEV.json" \
        model.path="random:$folder" "${COMMON[@]}" "$@" > "$OUT/$name.log" 2>&1
    echo "$name done $? at ${SECONDS}s" >> "$OUT/progress.txt"
}

for model in $MODELS; do
    case $model in
    # FLUX.2-klein base 9B, 384x384, 8 steps, CFG 4: 16 images a step
    flux2_klein) run flux2_klein flux2_klein flux2_klein_flow_grpo 3 "$JPEG" ;;
    # Qwen-Image-2.1, 512x512, 10 steps, no CFG: 16 images a step
    qwen_image21) run qwen_image21 qwen_image21 qwen_image21_flow_grpo 3 "$JPEG" "${SMALL[@]}" ;;
    # LTX-2 video with audio, 512x768, 121 frames, 24 steps: 2 videos a step; av_sync kept
    ltx2) run ltx2 ltx2 ltx2_flow_grpo 2 rollout.group_size=2 "${SMALL[@]}" \
        "reward.components=[{name: jpeg_compressibility}, {name: av_sync, weight: 0.5}]" ;;
    # Wan2.2 I2V A14B, 480x480, 5 frames, 8 steps, CFG 3.5, first frames from the shapes editing prompts: 4 videos
    wan22_i2v) run wan22_i2v wan22_i2v_a14b wan22_i2v_flow_grpo 2 rollout.group_size=4 "$JPEG" "${SMALL[@]}" ;;
    # FLUX.2-dev 32B, its defaults 1024x1024 and 50 steps, guidance 4 (distilled), the text encoder (Mistral-Small
    # 24B) in host memory between encodings: 2 images a step
    flux2_dev) run flux2_dev flux2_dev flux2_klein_flow_grpo 2 model.offload_text_encoder=true \
        rollout.height=1024 rollout.width=1024 rollout.num_inference_steps=50 rollout.group_size=2 \
        rollout.batch_size=1 train.micro_batch_size=1 train.gradient_checkpointing=true "$JPEG" ;;
    *) echo "unknown model $model (flux2_klein qwen_image21 ltx2 wan22_i2v flux2_dev)" >> "$OUT/progress.txt" ;;
    esac
done
echo "all done at ${SECONDS}s" >> "$OUT/progress.txt"
