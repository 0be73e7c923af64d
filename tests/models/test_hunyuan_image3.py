"""HunyuanImage-3.0 on the tiny offline folder: parity of the ODE rollout with an independent reading of the reference
sampler (tests/models/hunyuan_image3_reference.py), replay = rollout log-prob, LoRA gradients, the layout, the CLI,
the real-size parameter count."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hunyuan_image3_reference import ReferenceHunyuanImage3
from safetensors.torch import load_file, save_file

from diffrl.configs.rollout import SamplingConfig
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout import RolloutEngine
from diffrl.engines.train.setup import add_lora
from diffrl.models.base import SampleShape, detect_architecture, load_adapter
from diffrl.models.hunyuan_image3 import layout
from diffrl.models.kind import folder_kind, model_kind

PROMPTS = ["a red cube on a table", "a cat"]
SHAPE = SampleShape(64, 64)


@pytest.fixture(scope="module")
def folder(tiny_model):
    return tiny_model("hunyuan_image3")


@pytest.fixture(scope="module")
def adapter(folder):
    return load_adapter(folder, device="cpu", dtype=torch.float32)


def sampling(**overrides) -> SamplingConfig:
    base = dict(num_inference_steps=4, height=64, width=64, guidance_scale=5.0, noise_level=0.7, batch_size=4)
    return SamplingConfig(**{**base, **overrides})


def test_ode_rollout_equals_reference_sampler(folder, adapter):
    """Noise level 0, two prompts of different lengths in one batch, 4 steps, CFG 5: the stored latents of every
    step within 1e-4 of the fp64 reference (KV-cached prefix, dense top-k dispatch), the images within 1/255."""
    with open(os.path.join(folder, layout.CONFIG)) as f:
        config = json.load(f)
    ref = ReferenceHunyuanImage3(folder, config, adapter.pipe.tokenizer, adapter.pipe.token_ids)
    seeds = [5, 6]
    traj = RolloutEngine(adapter, progress=False).generate(PROMPTS, ["a", "b"], [0, 1], seeds, sampling(noise_level=0))
    assert traj.window_size == 3  # x_0 .. x_3 stored; the last ODE step lands in the image
    for i, (prompt, seed) in enumerate(zip(PROMPTS, seeds)):
        noise = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.bfloat16)[0]
        xs = ref.generate(prompt, noise.float(), steps=4, guidance_scale=5.0, ratio_index=16).float()
        start = int(traj.window_starts[i])
        torch.testing.assert_close(traj.latents[i], xs[start : start + 4], rtol=0, atol=1e-4)
        pixels = adapter.decode(xs[-1:], SHAPE)[0]
        assert (pixels.int() - traj.images[i].int()).abs().max() <= 1


def test_batched_velocity_equals_one_sample_at_a_time(adapter):
    """Cond and <cfg> rows, prompts padded to a common length, per-sample t: the same as one forward each."""
    enc = adapter.encode_prompt(PROMPTS)
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(s) for s in (1, 2)])
    sigma = torch.tensor([0.9, 0.3])
    with torch.no_grad():
        both = adapter.velocity(x, sigma, enc, None, guidance_scale=5.0, shape=SHAPE)
        for i, prompt in enumerate(PROMPTS):
            one = adapter.velocity(
                x[i : i + 1], sigma[i : i + 1], adapter.encode_prompt([prompt]), None, guidance_scale=5.0, shape=SHAPE
            )
            torch.testing.assert_close(both[i : i + 1], one, rtol=0, atol=1e-5)


def test_sigmas_buckets_and_noise(adapter):
    s = torch.linspace(1, 0, 11)
    torch.testing.assert_close(adapter.sigmas(10, SHAPE), 3 * s / (1 + 2 * s))
    assert layout.resolution_group(1024)[16] == (1024, 1024) and len(layout.resolution_group(1024)) == 33
    assert layout.resolution_group(1024)[0] == (512, 2048) and adapter._ratio_index(SampleShape(80, 48)) == 20
    with pytest.raises(ValueError, match="resolution buckets"):
        adapter.check_shape(SampleShape(64, 48))
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(3)])
    assert x.dtype == torch.float32 and torch.equal(x, x.bfloat16().float())  # drawn in bf16, as the reference


def test_replay_log_prob_equals_rollout_log_prob(adapter):
    engine = RolloutEngine(adapter, progress=False)
    cfg = sampling(num_inference_steps=3)
    traj = engine.generate(PROMPTS, ["a", "b"], [0, 1], [3, 4], cfg)
    assert (traj.log_probs != 0).all()
    for j in range(traj.window_size):
        replayed = engine.replay(traj, j, cfg)
        assert replayed.log_prob.requires_grad
        torch.testing.assert_close(replayed.log_prob.detach(), traj.log_probs[:, j], rtol=0, atol=1e-6)


def test_lora_gradients_reach_only_the_lora(folder):
    """LoRA on qkv/o and the expert and shared-expert projections: every adapter weight of attention and of the
    shared expert gets a gradient, nothing else is trainable and no frozen weight gets one."""
    adapter = load_adapter(folder, device="cpu", dtype=torch.float32)
    add_lora(adapter.transformer, TrainConfig(lora=True, lora_rank=4, lora_alpha=8), adapter.default_lora_targets)
    trainable = {n: p for n, p in adapter.transformer.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any(".experts.3." in n for n in trainable) and any("shared_mlp" in n for n in trainable)
    for p in trainable.values():  # move B off zero so A gets a gradient too
        torch.nn.init.normal_(p, std=0.1)
    enc = adapter.encode_prompt(PROMPTS)
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(s) for s in (1, 2)])
    v = adapter.velocity(x, torch.tensor([0.8, 0.8]), enc, None, guidance_scale=5.0, shape=SHAPE)
    v.square().mean().backward()
    always = {n: p for n, p in trainable.items() if ".experts." not in n}
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in always.values())
    assert any(p.grad is not None for n, p in trainable.items() if ".experts." in n)
    frozen = [n for n, p in adapter.transformer.named_parameters() if not p.requires_grad and p.grad is not None]
    assert frozen == []


def test_layout_detection_and_errors(folder, tmp_path):
    assert folder_kind(folder) == "diffusion" and model_kind("tiny:hunyuan_image3") == "diffusion"
    assert detect_architecture(folder) == "hunyuan_image3"
    extra = tmp_path / "extra"
    shutil.copytree(folder, extra)
    shard = str(extra / "model-00002-of-00002.safetensors")
    state = load_file(shard)
    save_file({**state, "mystery.weight": torch.zeros(1)}, shard)
    with pytest.raises(ValueError, match="unexpected.*mystery"):
        load_adapter(str(extra))
    os.remove(shard)
    with pytest.raises(ValueError, match="shards missing"):
        load_adapter(str(extra))
    with pytest.raises(ValueError, match="configs only"):
        load_adapter(f"random:{folder}")
    instruct = tmp_path / "instruct"
    shutil.copytree(folder, instruct)
    with open(instruct / layout.GENERATION_CONFIG, "w") as f:
        json.dump({"sequence_template": "instruct"}, f)
    with pytest.raises(ValueError, match="only the base model's 'pretrain'"):
        load_adapter(str(instruct))
    os.remove(instruct / layout.TOKENIZER)
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_adapter(str(instruct))


def test_configs_only_folder_and_real_size_count(tmp_path):
    """`random:<folder>` of config.json + tokenizer.json builds seeded random weights; the released config's
    parameter count on the meta device matches the published 80 B total / 13 B active."""
    from diffrl.models.hunyuan_image3.realsize import parameter_counts, write_config_folder

    folder = write_config_folder(str(tmp_path / "configs"), size="tiny")
    first = load_adapter(f"random:{folder}")
    enc = first.encode_prompt(["a cat"])
    x = first.prepare_latents(SHAPE, [torch.Generator().manual_seed(0)])
    with torch.no_grad():
        v = first.velocity(x, torch.tensor([0.9]), enc, None, guidance_scale=5.0, shape=SHAPE)
    assert v.shape == (1, 4, 4, 4) and torch.isfinite(v).all()
    counts = parameter_counts()
    assert 80e9 < counts["total"] < 82e9 and 12.5e9 < counts["active_without_embeddings"] < counts["active"] < 14e9


def test_cli_tiny_model_and_sample_write_the_engines_image(folder, adapter, tmp_path, capsys):
    """`diffrl tiny-model hunyuan_image3 DIR` is deterministic; `diffrl sample DIR` writes the rollout's image."""
    import argparse

    import numpy as np
    from PIL import Image

    from diffrl.flows.commands import sample, tiny_model

    parser = argparse.ArgumentParser(prog="diffrl")
    subparsers = parser.add_subparsers(dest="command", required=True)
    sample.add_parser(subparsers)
    tiny_model.add_parser(subparsers)
    out_dir = tmp_path / "tiny"
    assert tiny_model.run(parser.parse_args(["tiny-model", "hunyuan_image3", str(out_dir)])) == 0
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        mine, shipped = load_file(os.path.join(out_dir, name)), load_file(os.path.join(folder, name))
        assert set(mine) == set(shipped) and all(torch.equal(mine[k], shipped[k]) for k in mine)
    png = tmp_path / "cube.png"
    argv = ["sample", str(out_dir), "--prompt", PROMPTS[0], "--steps", "3", "--height", "64", "--width", "64"]
    assert sample.run(parser.parse_args([*argv, "--seed", "7", "--noise-level", "0", "--out", str(png)])) == 0
    capsys.readouterr()
    cfg = sampling(num_inference_steps=3, noise_level=0.0)
    traj = RolloutEngine(adapter, progress=False).generate([PROMPTS[0]], ["s"], [0], [7], cfg)
    assert np.array_equal(np.asarray(Image.open(png)), traj.images[0].numpy())


def test_cli_random_model_writes_the_released_configs(tmp_path, capsys):
    """`diffrl random-model hunyuan_image3 DIR --configs-only` writes the released config (no weights)."""
    import argparse

    from diffrl.flows.commands import random_model

    parser = argparse.ArgumentParser(prog="diffrl")
    random_model.add_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "hy80b"
    assert random_model.run(parser.parse_args(["random-model", "hunyuan_image3", str(out)])) == 2
    assert "only --configs-only" in capsys.readouterr().err
    assert random_model.run(parser.parse_args(["random-model", "hunyuan_image3", str(out), "--configs-only"])) == 0
    assert sorted(os.listdir(out)) == [layout.CONFIG, layout.GENERATION_CONFIG, layout.TOKENIZER]
    config = layout.read_config(str(out))
    assert (config.num_hidden_layers, config.num_experts, config.per_layer("moe_topk", 0)) == (32, 64, 8)
    layout.load_tokenizer(str(out), config)  # the offline tokenizer carries the 33 ratio tokens of base 1024
