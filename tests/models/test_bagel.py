"""BAGEL on the tiny offline folder: parity of the ODE rollout with an independent reading of the reference sampler
(tests/models/bagel_reference.py), replay = rollout log-prob, LoRA on the generation expert only, the layout."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from bagel_reference import ReferenceBagel
from safetensors.torch import load_file

from diffrl.configs.rollout import SamplingConfig
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout import RolloutEngine
from diffrl.engines.train.setup import add_lora
from diffrl.models.bagel import layout
from diffrl.models.base import SampleShape, detect_architecture, load_adapter
from diffrl.models.kind import folder_kind, model_kind

PROMPTS = ["a red cube on a table", "a cat"]
SHAPE = SampleShape(64, 64)


@pytest.fixture(scope="module")
def folder(tiny_model):
    return tiny_model("bagel")


@pytest.fixture(scope="module")
def adapter(folder):
    return load_adapter(folder, device="cpu", dtype=torch.float32)


def sampling(**overrides) -> SamplingConfig:
    base = dict(num_inference_steps=6, height=64, width=64, guidance_scale=4.0, noise_level=0.7, batch_size=4)
    return SamplingConfig(**{**base, **overrides})


def test_ode_rollout_equals_reference_sampler(folder, adapter):
    """Noise level 0, two prompts of different lengths in one batch, 6 steps: the first 5 inside the CFG interval
    (0.4, 1], the last (t = 0.375) outside it. The stored latents of every step within 1e-4 of the fp64 reference,
    the images within 1/255."""
    with open(os.path.join(folder, layout.LLM_CONFIG)) as f:
        llm = json.load(f)
    ref = ReferenceBagel(folder, llm, adapter.pipe.token_ids, adapter.pipe.tokenizer)
    sig = adapter.sigmas(6, SHAPE)
    assert (sig[:-2] > 0.4).all() and 0 < sig[-2] < 0.4  # the interval boundary is crossed
    seeds = [5, 6]
    traj = RolloutEngine(adapter, progress=False).generate(PROMPTS, ["a", "b"], [0, 1], seeds, sampling(noise_level=0))
    assert traj.window_size == 5  # steps 0..4 stored (x_0 .. x_5); the last ODE step lands in the image
    for i, (prompt, seed) in enumerate(zip(PROMPTS, seeds)):
        noise = torch.randn(16, 16, generator=torch.Generator().manual_seed(seed))  # (4 x 4 tokens, 2x2x4)
        xs = ref.generate(prompt, noise, 4, 4, num_timesteps=7, cfg_text_scale=4.0, interval=(0.4, 1.0)).float()
        start = int(traj.window_starts[i])
        torch.testing.assert_close(traj.latents[i], xs[start : start + 6], rtol=0, atol=1e-4)
        pixels = adapter.decode(xs[-1:], SHAPE)[0]
        assert (pixels.int() - traj.images[i].int()).abs().max() <= 1


def test_batched_velocity_equals_one_sample_at_a_time(adapter):
    """Cond and uncond rows, prompts padded to a common length, per-sample t: the same as one forward each."""
    enc = adapter.encode_prompt(PROMPTS)
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(s) for s in (1, 2)])
    sigma = torch.tensor([0.9, 0.3])  # one inside the CFG interval, one outside
    with torch.no_grad():
        both = adapter.velocity(x, sigma, enc, None, guidance_scale=4.0, shape=SHAPE)
        for i, prompt in enumerate(PROMPTS):
            one = adapter.velocity(
                x[i : i + 1], sigma[i : i + 1], adapter.encode_prompt([prompt]), None, guidance_scale=4.0, shape=SHAPE
            )
            torch.testing.assert_close(both[i : i + 1], one, rtol=0, atol=1e-5)


def test_sigmas_follow_bagel_shift(adapter):
    t = torch.linspace(1, 0, 11)
    torch.testing.assert_close(adapter.sigmas(10, SHAPE), 3 * t / (1 + 2 * t))
    with pytest.raises(ValueError, match="multiple of 16"):
        adapter.check_shape(SampleShape(72, 64))


def test_replay_log_prob_equals_rollout_log_prob(adapter):
    engine = RolloutEngine(adapter, progress=False)
    cfg = sampling(num_inference_steps=3)
    traj = engine.generate(PROMPTS, ["a", "b"], [0, 1], [3, 4], cfg)
    assert (traj.log_probs != 0).all()
    for j in range(traj.window_size):
        replayed = engine.replay(traj, j, cfg)
        assert replayed.log_prob.requires_grad
        torch.testing.assert_close(replayed.log_prob.detach(), traj.log_probs[:, j], rtol=0, atol=1e-6)


def test_a_sample_does_not_depend_on_its_batch(adapter):
    """The SDE rollout of a prompt and seed alone equals its row in a batch with another prompt (padded text)."""
    engine = RolloutEngine(adapter, progress=False)
    cfg = sampling(num_inference_steps=3)
    both = engine.generate(PROMPTS, ["a", "b"], [0, 1], [3, 4], cfg)
    alone = engine.generate(PROMPTS[1:], ["b"], [1], [4], cfg)
    torch.testing.assert_close(both.latents[1:], alone.latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(both.log_probs[1:], alone.log_probs, rtol=0, atol=1e-5)


def test_lora_gradients_reach_only_the_generation_expert(folder):
    adapter = load_adapter(folder, device="cpu", dtype=torch.float32)
    add_lora(adapter.transformer, TrainConfig(lora=True, lora_rank=4, lora_alpha=8), adapter.default_lora_targets)
    trainable = {n: p for n, p in adapter.transformer.named_parameters() if p.requires_grad}
    assert trainable and all("moe_gen" in n and "lora_" in n for n in trainable)
    for p in trainable.values():  # move B off zero so A gets a gradient too
        torch.nn.init.normal_(p, std=0.1)
    enc = adapter.encode_prompt(PROMPTS)
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(s) for s in (1, 2)])
    v = adapter.velocity(x, torch.tensor([0.8, 0.8]), enc, None, guidance_scale=4.0, shape=SHAPE)
    v.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in trainable.values())
    frozen = [n for n, p in adapter.transformer.named_parameters() if not p.requires_grad and p.grad is not None]
    assert frozen == []


def test_layout_detection_and_errors(folder, tmp_path):
    assert folder_kind(folder) == "diffusion" and model_kind("tiny:bagel") == "diffusion"
    assert detect_architecture(folder) == "bagel"
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    os.remove(broken / layout.AE)
    with pytest.raises(ValueError, match="ae.safetensors"):
        load_adapter(str(broken))
    configs = tmp_path / "configs"
    shutil.copytree(folder, configs)
    with pytest.raises(ValueError, match="configs only"):
        load_adapter(f"random:{configs}")


def test_configs_only_folder_builds_random_weights(tmp_path):
    """`random:<folder>` of llm_config.json + tokenizer: the MoT and the FLUX VAE of BAGEL's load_ae, random, seeded."""
    from diffrl.models.bagel.realsize import write_config_folder

    folder = write_config_folder(str(tmp_path / "configs"), size="tiny")
    first = load_adapter(f"random:{folder}")
    assert first.pipe.vae.config.latent_channels == 16 and first.transformer.config.max_latent_size == 64
    state = layout.random_mot(folder, device=torch.device("cpu"), dtype=torch.float32).state_dict()
    assert all(torch.equal(v, state[k]) for k, v in first.transformer.state_dict().items())
    enc = first.encode_prompt(["a cat"])
    x = first.prepare_latents(SHAPE, [torch.Generator().manual_seed(0)])
    with torch.no_grad():
        v = first.velocity(x, torch.tensor([0.9]), enc, None, guidance_scale=4.0, shape=SHAPE)
    assert v.shape == (1, 16, 64) and torch.isfinite(v).all()


def test_vae_layout_round_trip(folder):
    """ae.safetensors in BFL's names goes through diffusers' converter back to the same AutoencoderKL tensors."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    bfl = load_file(os.path.join(folder, layout.AE))
    assert "decoder.mid.attn_1.q.weight" in bfl and "encoder.down.3.block.0.conv1.weight" in bfl
    vae = layout.vae_from_params(layout.ae_params(bfl))
    converted = convert_ldm_vae_checkpoint(bfl, vae.config)
    assert set(converted) == set(vae.state_dict())
    back = layout.diffusers_vae_to_bfl(converted, levels=4)
    assert set(back) == set(bfl) and all(torch.equal(back[k], bfl[k]) for k in bfl)


def test_cli_tiny_model_and_sample_write_the_engines_image(folder, adapter, tmp_path, capsys):
    """`diffrl tiny-model bagel DIR` is deterministic; `diffrl sample DIR` writes the rollout's image at noise 0."""
    import argparse

    import numpy as np
    from PIL import Image

    from diffrl.flows.commands import sample, tiny_model

    parser = argparse.ArgumentParser(prog="diffrl")
    subparsers = parser.add_subparsers(dest="command", required=True)
    sample.add_parser(subparsers)
    tiny_model.add_parser(subparsers)
    out_dir = tmp_path / "tiny"
    assert tiny_model.run(parser.parse_args(["tiny-model", "bagel", str(out_dir)])) == 0
    for name in (layout.EMA, layout.AE):
        mine, shipped = load_file(os.path.join(out_dir, name)), load_file(os.path.join(folder, name))
        assert set(mine) == set(shipped) and all(torch.equal(mine[k], shipped[k]) for k in mine)
    png = tmp_path / "cube.png"
    argv = ["sample", str(out_dir), "--prompt", PROMPTS[0], "--steps", "4", "--height", "64", "--width", "64"]
    assert sample.run(parser.parse_args([*argv, "--seed", "7", "--noise-level", "0", "--out", str(png)])) == 0
    capsys.readouterr()
    cfg = sampling(num_inference_steps=4, noise_level=0.0)
    traj = RolloutEngine(adapter, progress=False).generate([PROMPTS[0]], ["s"], [0], [7], cfg)
    assert np.array_equal(np.asarray(Image.open(png)), traj.images[0].numpy())
