"""FSDP2 LoRA training throughput, scaling efficiency and peak memory per micro-batch (GPU benchmark).

Builds SD3.5-Medium-size and Qwen-Image-size transformers with random weights (the published configs of
diffrl/models/sd3/realsize.py and diffrl/models/qwen_image/realsize.py), sets them up through the trainer's own code
(engines.train.setup: LoRA via peft, dtype, FSDP2 fully_shard on the transformer blocks then the root, AdamW) and
times LoRA optimizer steps of one micro-batch each (forward + backward of a flow-matching-style loss on random
latents/text embeddings at 512x512 + clip + step). Text encoders and VAE are excluded.

Run (the lead, on nvidia-h200-x2):
    python -m benchmarks.trainer_fsdp --world 1 --out benchmarks/results/trainer_fsdp_1gpu.json
    torchrun --standalone --nproc_per_node 2 -m benchmarks.trainer_fsdp --world 2 \\
        --single benchmarks/results/trainer_fsdp_1gpu.json --out benchmarks/results/trainer_fsdp_h200x2.json
The 2-GPU run reads the 1-GPU JSON and records scaling efficiency = 2-GPU images/s / (2 x 1-GPU images/s).
Smoke test on CPU: python -m benchmarks.trainer_fsdp --tiny --device cpu --out /tmp/trainer_fsdp_tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from diffrl.configs.train import TrainConfig
from diffrl.engines.train.setup import build_optimizer, prepare_denoiser, shard, world
from diffrl.models.qwen_image.realsize import QWEN_IMAGE_TRANSFORMER
from diffrl.models.sd3.realsize import SD35M_TRANSFORMER

SD3_LORA = (
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
)
QWEN_LORA = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
TEXT_TOKENS = 256


class BenchAdapter:
    """The part of the ModelAdapter contract that engines.train.setup uses, around a bare transformer."""

    def __init__(self, transformer, targets, device):
        self.transformer, self.default_lora_targets, self.device = transformer, targets, device
        self.dtype = torch.float32
        self.arch = type(transformer).__name__

    def denoisers(self):
        return [self.transformer]

    def fsdp_wrap_units(self):
        return list(self.transformer.transformer_blocks)


def build(arch: str, tiny: bool, device: torch.device):
    """(transformer with random weights, LoRA targets, a function making a batch of inputs)."""
    from diffusers import QwenImageTransformer2DModel, SD3Transformer2DModel

    torch.manual_seed(0)
    if arch == "sd3":
        cfg = (
            dict(
                SD35M_TRANSFORMER,
                num_layers=2,
                num_attention_heads=2,
                attention_head_dim=16,
                caption_projection_dim=32,
                joint_attention_dim=32,
                pooled_projection_dim=16,
                pos_embed_max_size=32,
                dual_attention_layers=(0,),
            )
            if tiny
            else SD35M_TRANSFORMER
        )
        model = SD3Transformer2DModel(**cfg)
        side = 8 if tiny else 64  # latent side of a 512x512 image (VAE factor 8)

        def inputs(b):
            return dict(
                hidden_states=torch.randn(b, 16, side, side, device=device),
                encoder_hidden_states=torch.randn(b, TEXT_TOKENS, cfg["joint_attention_dim"], device=device),
                pooled_projections=torch.randn(b, cfg["pooled_projection_dim"], device=device),
                timestep=torch.full((b,), 500.0, device=device),
            )

        return model, SD3_LORA, inputs
    cfg = (
        dict(
            QWEN_IMAGE_TRANSFORMER,
            num_layers=2,
            num_attention_heads=2,
            attention_head_dim=32,
            joint_attention_dim=32,
            axes_dims_rope=(8, 12, 12),
        )
        if tiny
        else QWEN_IMAGE_TRANSFORMER
    )
    model = QwenImageTransformer2DModel(**cfg)
    side = 4 if tiny else 32  # packed 2x2 latent tokens of a 512x512 image

    def inputs(b):
        return dict(
            hidden_states=torch.randn(b, side * side, 64, device=device),
            encoder_hidden_states=torch.randn(b, TEXT_TOKENS, cfg["joint_attention_dim"], device=device),
            encoder_hidden_states_mask=torch.ones(b, TEXT_TOKENS, dtype=torch.long, device=device),
            timestep=torch.full((b,), 0.5, device=device),
            img_shapes=[(1, side, side)] * b,
        )

    return model, QWEN_LORA, inputs


def run_arch(arch: str, args, device: torch.device) -> dict:
    """Time `args.steps` LoRA optimizer steps of one micro-batch each, after `args.warmup` steps."""
    # Build directly on the device in the compute dtype: a 20 B model in fp32 on the host is slow and huge.
    dtype = TrainConfig(param_dtype=args.param_dtype).torch_param_dtype(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model, targets, inputs = build(arch, args.tiny, device)
    finally:
        torch.set_default_dtype(previous)
    adapter = BenchAdapter(model, targets, device)
    cfg = TrainConfig(
        lora_rank=args.rank,
        lora_alpha=args.rank,
        param_dtype=args.param_dtype,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    prepare_denoiser(adapter, cfg, device)
    if world()[1] > 1:
        shard(adapter, cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg)
    b = args.micro_batch
    batch = inputs(b)
    batch["hidden_states"] = batch["hidden_states"].to(adapter.dtype)
    batch["encoder_hidden_states"] = batch["encoder_hidden_states"].to(adapter.dtype)
    if "pooled_projections" in batch:
        batch["pooled_projections"] = batch["pooled_projections"].to(adapter.dtype)
    target = torch.randn_like(batch["hidden_states"], dtype=torch.float32)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        out = model(**batch).sample.float()
        loss = ((out - target) ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    per_step = sum(times) / len(times)
    n_params = sum(p.numel() for p in model.parameters())
    size = world()[1]
    return {
        "arch": arch,
        "params_total_local": n_params,
        "lora_params_local": sum(p.numel() for p in params),
        "micro_batch_per_gpu": b,
        "seconds_per_step": per_step,
        "images_per_s_total": b * size / per_step,
        "images_per_s_per_gpu": b / per_step,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny configs (CPU smoke test); numbers are meaningless")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--world", type=int, default=1, help="expected world size (checked against torchrun)")
    parser.add_argument("--archs", default="sd3,qwen_image")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--param-dtype", default="auto")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--single", help="JSON of the 1-GPU run, to compute scaling efficiency")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, size = world()
    if size != args.world:
        raise SystemExit(f"--world {args.world} but the process group has {size} ranks")
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = [run_arch(a, args, device) for a in args.archs.split(",")]
    if args.single:
        with open(args.single) as f:
            single = {r["arch"]: r for r in json.load(f)["results"]}
        for r in results:
            if r["arch"] in single:
                r["scaling_efficiency"] = r["images_per_s_total"] / (size * single[r["arch"]]["images_per_s_total"])
    if rank == 0:
        import diffusers

        record = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "world_size": size,
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "tiny": args.tiny,
            "command": " ".join(sys.argv),
            "results": results,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
        print(json.dumps(record, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
