"""The disk estimate `diffrl train` prints after a run's first step, against the closed form."""

from __future__ import annotations

from diffrl.configs.schema import load_experiment
from diffrl.engines.step.retention import describe_disk, disk_estimate


def test_disk_estimate_closed_form():
    # shapes_flow_grpo: 512 samples a step, FlowGRPO's all-but-last window of its 4 steps (3 steps, 4 stored
    # states), 64x64 images, 600 steps
    cfg = load_experiment("shapes_flow_grpo", [])
    latent = 4 * 64 * 64
    est = disk_estimate(cfg, latent)
    assert est["latents_per_step"] == 512 * 4 * latent * 4
    assert est["rows_per_step"] == 512 * (1024 + 64 * 64 * 3)
    held = 2 + 1 + 10  # kept steps, the step in flight, and those waiting for the next compaction
    assert est["latent_steps_held"] == held
    assert est["total"] == 600 * est["rows_per_step"] + held * est["latents_per_step"]
    # a compaction's merged copy of the latents waiting for it (compact_every steps' worth) beside the files it replaces
    assert est["peak"] == est["total"] + 10 * est["latents_per_step"]
    keep_all = disk_estimate(load_experiment("shapes_flow_grpo", ["run.keep_latents_steps=-1"]), latent)
    assert keep_all["total"] == 600 * (keep_all["rows_per_step"] + keep_all["latents_per_step"])
    line = describe_disk(cfg, latent)
    assert line.startswith("disk: about 5.8 GB for 600 steps (latents of the last 2 steps kept") and "free" in line
    assert "of rows and images at their raw size" in line and "up to 7.2 GB while a compaction" in line
    # images as the first step stored them (PNG), and a checkpoint written before the oldest kept one goes
    stored = disk_estimate(cfg, latent, checkpoint=1000, image_bytes=3000.0)
    assert stored["rows_per_step"] == 512 * (1024 + 3000)
    assert stored["total"] == 600 * stored["rows_per_step"] + held * stored["latents_per_step"] + 14 * 1000
    assert stored["peak"] == stored["total"] + 10 * stored["latents_per_step"] + 1000
    assert "of rows and images of 3.0 KB as stored" in describe_disk(cfg, latent, 1000, 3000.0)
    one = load_experiment("shapes_flow_grpo", ["run.steps=1", "run.keep_latents_steps=1", "run.checkpoint_every=1"])
    line = describe_disk(one, latent, checkpoint=1000)  # counts of one read as they are said
    assert "for 1 step (latents of the last 1 step kept" in line and "; 1 checkpoint of 1.0 KB kept" in line


def test_checkpoints_count_in_the_estimate(tmp_path):
    """The checkpoint size the estimate uses, against its closed form and a checkpoint the trainer writes after a
    step (AdamW's moments exist once it has stepped)."""
    import os

    from diffrl.engines.step.retention import checkpoint_bytes, checkpoints_held
    from diffrl.engines.step.run import DirectStages, run_step
    from diffrl.engines.train import checkpoint
    from diffrl.flows.build import build_engines

    cfg = load_experiment("shapes_quick", [f"run.root={tmp_path}/runs", "run.steps=1", "data.num_val_prompts=0"])
    engines = build_engines(cfg, durable=False)
    try:
        run_step(engines, 0, DirectStages(engines))
        trained = {id(p): p for g in engines.trainer.optimizer.param_groups for p in g["params"]}.values()
        lora = [p for n, p in engines.trainer.adapter.transformer.named_parameters() if "lora_" in n]
        size = checkpoint_bytes(engines)
        # every LoRA tensor (DiffusionNFT's frozen old adapter too), the trained ones again and their two moments
        assert size == sum(p.numel() * 4 for p in lora) + 3 * sum(p.numel() * 4 for p in trained)
        written = checkpoint.save(engines.trainer, str(tmp_path / "ck"), step=1)
        on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(written) for f in files)
        assert 0.98 * on_disk <= size <= on_disk, (size, on_disk)  # less only the JSON and RNG files
    finally:
        engines.memory.close()
    est = disk_estimate(cfg, 4 * 64 * 64, size)
    assert checkpoints_held(cfg) == 1 and est["checkpoints"] == size
    line = describe_disk(load_experiment("shapes_flow_grpo", []), 4 * 64 * 64, size)
    assert "14 checkpoints of" in line  # 600 steps: every 50th and the latest two
