"""GRPO on Janus-Pro's image tokens through the step core, engines only: images/s and image tokens/s of the CFG rollout
and of the update, samples/GPU/s of the RL step, peak GPU memory. Not run on a GPU yet.

The engines-only loop of benchmarks/omni_rl.py: `build_engines(cfg, durable=False)` and the step core's `run_step`
(generate -> score -> advantages -> update_actor -> sync_weights), no store, no MLflow, on the recipe of
tests/configs/janus_shapes_grpo.yaml.
The policy is built from a config-only folder written here (`model.path: random:<folder>`): Janus-Pro-1B or -7B's
shapes with random weights made in memory on the device, so no checkpoint is needed. The sizes are those of the
released transformers-format configs (deepseek-community/Janus-Pro-1B / -7B) as far as they could be read
without the hub: language model Llama 1B (hidden 2048, 24 layers, 16 heads, MLP 5632) or 7B (4096, 30, 32, 11008),
vocabulary 102400, SigLIP-L vision tower at 384 px, VQ-VAE with a 16384-entry codebook, 576 image tokens per image;
check them against a real config.json before quoting the figures. The tokenizer is diffrl's tiny BPE with Janus'
specials (prompt lengths therefore differ from the real tokenizer's; image tokens are what costs).

    python -m benchmarks.janus_rl                       # GPU: Janus-Pro-7B shapes, bf16, LoRA r32, 8 prompts x 8
    python -m benchmarks.janus_rl --size 1b --prompts 16
    python -m benchmarks.janus_rl --smoke               # CPU: tiny:janus's config, 2 steps (numbers meaningless)

Per step: timing_s/generate and /update_actor, image tokens (samples x 576), rollout and update image tokens/s,
samples/GPU/s, the rollout/trainer log-prob gap (same numerics in one process: < 1e-3 expected in bf16). The first
step is warm-up and left out of the means. Writes benchmarks/results/janus_rl_<device>[_<tag>].json after each step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from benchmarks.common import record_steps
from benchmarks.omni_rl import keep_token_metrics, summary
from diffrl.configs.schema import load_experiment
from diffrl.flows.build import build_engines
from diffrl.models.janus.tiny import build_janus, janus_tokenizer, tiny_janus_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = {  # Llama language models of Janus-Pro (hidden, layers, heads, MLP)
    "1b": {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 5632},
    "7b": {"hidden_size": 4096, "num_hidden_layers": 30, "num_attention_heads": 32, "intermediate_size": 11008},
}


def write_config_folder(out: str, size: str) -> str:
    """A config-only Janus folder (config.json, generation config, tokenizer; no weights) at Janus-Pro's `size`
    ("1b", "7b"), or the tiny model's whole folder ("tiny", with its weights: `random:` refuses a folder with weights,
    so the smoke run loads the tiny config's random weights from a copy without them)."""
    if size == "tiny":
        build_janus(out, 0)
        os.remove(os.path.join(out, "model.safetensors"))
        return out
    tokenizer = janus_tokenizer()
    config = tiny_janus_config(tokenizer)
    hidden = TEXT[size]["hidden_size"]
    text = config.text_config
    for key, value in {
        **TEXT[size],
        "vocab_size": 102400,
        "num_key_value_heads": TEXT[size]["num_attention_heads"],
    }.items():
        setattr(text, key, value)
    text.head_dim = hidden // text.num_attention_heads
    text.max_position_embeddings = 16384
    vision = config.vision_config
    for key, value in {
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "image_size": 384,
        "patch_size": 16,
        "mlp_ratio": 4.0,
        "projection_dim": hidden,
        "num_image_tokens": 576,
    }.items():
        setattr(vision, key, value)
    vq = config.vq_config
    for key, value in {
        "num_embeddings": 16384,
        "latent_channels": 256,
        "base_channels": 128,
        "num_res_blocks": 2,
        "channel_multiplier": [1, 1, 2, 2, 4],
        "projection_dim": hidden,
        "image_token_embed_dim": hidden,
        "num_patches": 24,
    }.items():
        setattr(vq, key, value)
    os.makedirs(out, exist_ok=True)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        guidance_scale=5.0,
        generation_kwargs={"boi_token_id": tokenizer.convert_tokens_to_ids("<begin_of_image>")},
    ).save_pretrained(out)
    return out


def recipe(folder: str, args: argparse.Namespace, image_tokens: int) -> list[str]:
    """tests/configs/janus_shapes_grpo.yaml at the benchmark's size (overrides)."""
    gpu = args.device != "cpu"
    samples = args.prompts * args.group
    return [
        f"model.path=random:{folder}",
        f"model.device={args.device}",
        f"model.dtype={'bf16' if gpu else 'fp32'}",
        f"run.name=janus-rl-{args.tag or 'bench'}",
        f"run.steps={args.steps}",
        f"rollout.group_size={args.group}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.chunk_size={samples}",
        f"rollout.batch_size={samples}",
        f"rollout.max_new_tokens={image_tokens}",
        "train.lora=true",
        "train.lora_rank=32",
        "train.lora_alpha=64",
        f"train.gradient_checkpointing={'true' if gpu else 'false'}",
        f"train.mini_batch_prompts={args.prompts}",
        f"train.micro_batch_size={args.micro_batch}",
        "data.num_val_prompts=0",
        "data.num_generated=256",
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny:janus's config, 2 steps of 2 x 2 images")
    parser.add_argument("--device", default=None, help="cuda (default) or cpu (--smoke)")
    parser.add_argument("--size", default="7b", choices=sorted(TEXT))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (x --group images)")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8, help="images per forward/backward of the update")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/janus_rl_<device>.json)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
        args.steps, args.prompts, args.group, args.micro_batch = 2, 2, 2, 4
    args.device = args.device or "cuda"
    out = args.out or os.path.join(
        REPO, "benchmarks", "results", f"janus_rl_{args.device.split(':')[0]}{'_' + args.tag if args.tag else ''}.json"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config_folder(os.path.join(tmp, "janus"), "tiny" if args.smoke else args.size)
        image_tokens = 16 if args.smoke else 576
        config = os.path.join(REPO, "tests", "configs", "janus_shapes_grpo.yaml")
        cfg = load_experiment(config, recipe(folder, args, image_tokens) + [f"run.root={tmp}/runs"])
        started = time.perf_counter()
        engines = build_engines(cfg, durable=False)
        result = {
            "recipe": vars(args),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "parameters": sum(p.numel() for p in engines.adapter.model.parameters()),
            "trainable_parameters": sum(p.numel() for p in engines.trainer.params),
            "build_s": time.perf_counter() - started,
            "torch": torch.__version__,
            "steps": [],
        }
        try:
            record_steps(engines, cfg, result, out, keep_token_metrics, summary)
        finally:
            engines.memory.close()
    return result


if __name__ == "__main__":
    main()
