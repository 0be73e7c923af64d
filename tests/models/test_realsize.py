"""`diffrl random-model` (diffrl/models/realsize.py and each architecture's realsize.py): real-size configs against
published parameter counts, a scaled-down build through the same code path that loads and samples offline, the disk
check, the CLI."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from diffusers import DiffusionPipeline, QwenImagePipeline

from diffrl.engines.store.prompts import ocr_prompts
from diffrl.flows import cli
from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.qwen_image.realsize import QWEN25_VL_7B
from diffrl.models.realsize import DISK_MARGIN_BYTES, build_random, meta_counts, plan_for

# Published element counts (exact), matched within 1 %:
# - SD3.5-Medium transformer: 2,469,663,936 values in transformer/diffusion_pytorch_model.safetensors (a public
#   audit of a diffusers folder built on it) = 2,243,171,520 parameters + the 384x384x1536 positional table, a
#   persistent buffer; Stability AI's model card says 2.5 B. SD3 VAE: 83,819,683 (the same audit; also the
#   FLUX.1 16-channel AutoencoderKL's count).
# - stable-diffusion-3-medium-diffusers, measured per component (same three text encoders as 3.5-Medium):
#   text_encoder 123,650,304, text_encoder_2 694,659,840, text_encoder_3 4,762,310,656.
# - Qwen/Qwen-Image(-2512) transformer 20,430,401,088; Qwen/Qwen2.5-VL-7B-Instruct 8,292,166,656 (Hugging Face
#   numParameters; the vision tower is 676,550,144 of it); Qwen-Image VAE 126,892,531.
PUBLISHED = {
    ("sd35m", "transformer"): 2_469_663_936,
    ("sd35m", "vae"): 83_819_683,
    ("sd35m", "text_encoder"): 123_650_304,
    ("sd35m", "text_encoder_2"): 694_659_840,
    ("sd35m", "text_encoder_3"): 4_762_310_656,
    ("qwen_image", "transformer"): 20_430_401_088,
    ("qwen_image", "vae"): 126_892_531,
    ("qwen_image", "text_encoder"): 8_292_166_656,
}

# The `scale` hook at toy size: the widths the pipelines join still agree (as the tiny builders build them).
SCALES = {
    "sd35m": {
        "transformer": dict(
            sample_size=8,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=40,
            caption_projection_dim=32,
            pooled_projection_dim=32,
            pos_embed_max_size=16,
            dual_attention_layers=(0,),
        ),
        "vae": dict(block_out_channels=(4, 4, 8, 8), layers_per_block=1, norm_num_groups=2, sample_size=64),
        "text_encoder": dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, projection_dim=16
        ),
        "text_encoder_2": dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, projection_dim=16
        ),
        "text_encoder_3": dict(
            d_model=40, d_kv=8, d_ff=80, num_layers=2, num_heads=4, relative_attention_num_buckets=8
        ),
    },
    "qwen_image": {
        "transformer": dict(
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        ),
        "vae": dict(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            latents_mean=[0.1, -0.2, 0.05, 0.3],
            latents_std=[1.5, 0.8, 1.2, 2.0],
        ),
        "text_encoder": {
            "text_config": dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                rope_parameters=dict(mrope_section=[2, 3, 3]),
            ),
            "vision_config": dict(
                depth=1,
                hidden_size=16,
                intermediate_size=16,
                num_heads=2,
                out_hidden_size=32,
                fullatt_block_indexes=[0],
            ),
        },
    },
}
TINY_ARCH = {"sd35m": "sd3", "qwen_image": "qwen_image"}  # the tiny builder of the same pipeline
PROMPT = 'A storefront sign that reads "Hidden Trail"'


@pytest.mark.parametrize("arch", ["sd35m", "qwen_image"])
def test_meta_parameter_counts_match_published(arch):
    counts = meta_counts(plan_for(arch))
    assert set(counts) == {name for a, name in PUBLISHED if a == arch}
    for name, (_, stored) in counts.items():
        assert stored == pytest.approx(PUBLISHED[arch, name], rel=0.01), name


def test_tokenizer_ids_and_counts_are_realistic():
    sd3 = plan_for("sd35m").small
    assert max(len(sd3["tokenizer"]), len(sd3["tokenizer_2"])) < 49408 and len(sd3["tokenizer_3"]) < 32128
    plan = plan_for("qwen_image")
    qwen = plan.small["tokenizer"]
    assert len(qwen) < QWEN25_VL_7B["text_config"]["vocab_size"]
    with torch.device("meta"):
        config = plan.models["text_encoder"]().config
    # Qwen's specials at our ids (<|endoftext|> 0, <|im_end|> 2); the published vision tower and its ids.
    assert (config.text_config.bos_token_id, config.text_config.eos_token_id) == (0, 2)
    assert (config.vision_config.hidden_size, config.vision_config.depth, config.image_token_id) == (1280, 32, 151655)
    # The pipeline drops a fixed number of template tokens (34): our template prefix is exactly that long.
    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(qwen(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    # Qwen's 151k vocabulary reads a generator prompt in about one token per word: so does ours
    # (a byte-level BPE with a few hundred tokens would take about one token per character).
    prompts = [r.prompt for r in ocr_prompts(50, seed=1)]
    tokens, words = sum(len(qwen(p).input_ids) for p in prompts), sum(len(p.split()) for p in prompts)
    assert tokens <= 1.3 * words
    assert [qwen.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]


@pytest.mark.parametrize("arch", ["sd35m", "qwen_image"])
def test_scaled_build_loads_offline_and_samples(arch, tmp_path, tiny_model, capsys):
    out = build_random(arch, str(tmp_path / arch), device="cpu", dtype=torch.bfloat16, seed=0, scale=SCALES[arch])
    assert not os.path.exists(out + ".tmp") and "random-model: transformer" in capsys.readouterr().err
    with (
        open(os.path.join(out, "model_index.json")) as f,
        open(os.path.join(tiny_model(TINY_ARCH[arch]), "model_index.json")) as g,
    ):
        index, tiny_index = json.load(f), json.load(g)
    assert index == tiny_index  # the same pipeline class and component classes as the tiny builder's
    assert type(DiffusionPipeline.from_pretrained(out)).__name__ == index["_class_name"]

    adapter = load_adapter(out, dtype=torch.bfloat16)
    shape, steps, guidance = SampleShape(64, 64), 2, 4.0
    enc, neg = adapter.encode_prompt([PROMPT]), adapter.encode_prompt([" "])
    assert all(torch.isfinite(v.float()).all() for v in [*enc.values(), *neg.values()])
    x = adapter.prepare_latents(shape, [torch.Generator().manual_seed(7)])
    sigmas = adapter.sigmas(steps, shape)
    with torch.no_grad():
        for i in range(steps):
            v = adapter.velocity(x, sigmas[i].expand(1), enc, neg, guidance_scale=guidance, shape=shape)
            assert torch.isfinite(v).all()
            x = x + (sigmas[i + 1] - sigmas[i]) * v
    image = adapter.decode(x, shape)
    assert image.shape == (1, 64, 64, 3) and image.float().std() > 0


@pytest.mark.parametrize("arch", ["sd35m", "qwen_image"])
def test_configs_only_folder_builds_the_same_pipeline_in_memory(arch, tmp_path, capsys):
    """`--configs-only` + `model.path: random:<folder>`: no weight files on disk, the same modules (names, shapes,
    dtypes) as the folder with weights, the same weights in every process that builds it, and it samples."""
    written = load_adapter(
        build_random(arch, str(tmp_path / "full"), device="cpu", dtype=torch.bfloat16, scale=SCALES[arch]),
        dtype=torch.bfloat16,
    )
    folder = build_random(arch, str(tmp_path / "cfg"), device="cpu", scale=SCALES[arch], weights=False)
    assert "configs only" in capsys.readouterr().err
    files = [f for _, _, names in os.walk(folder) for f in names]
    assert not [f for f in files if f.endswith((".safetensors", ".bin"))] and "config.json" in files
    first, second = (load_adapter(f"random:{folder}", dtype=torch.bfloat16) for _ in range(2))
    assert first.source == f"random:{folder}"
    for name in [n for n, c in written.pipe.components.items() if isinstance(c, torch.nn.Module)]:
        want = {k: (v.shape, v.dtype) for k, v in getattr(written.pipe, name).state_dict().items()}
        got = getattr(first.pipe, name).state_dict()
        assert {k: (v.shape, v.dtype) for k, v in got.items()} == want, name
        again = getattr(second.pipe, name).state_dict()
        assert all(torch.equal(got[k], again[k]) for k in got), f"{name}: weights differ between two builds"
    shape = SampleShape(64, 64)
    enc, neg = first.encode_prompt([PROMPT]), first.encode_prompt([" "])
    x = first.prepare_latents(shape, [torch.Generator().manual_seed(7)])
    with torch.no_grad():
        v = first.velocity(x, first.sigmas(2, shape)[:1], enc, neg, guidance_scale=4.0, shape=shape)
    assert torch.isfinite(v).all() and v.float().std() > 0


def test_random_prefix_refuses_a_folder_with_weights(tmp_path):
    out = build_random("sd35m", str(tmp_path / "full"), device="cpu", dtype=torch.bfloat16, scale=SCALES["sd35m"])
    with pytest.raises(ValueError, match="holds weight files"):
        load_adapter(f"random:{out}")
    with pytest.raises(ValueError, match="is not a directory"):
        load_adapter(f"random:{tmp_path / 'missing'}")


def test_disk_check_refuses_before_writing(tmp_path, monkeypatch):
    free = 10**9
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2 * free, free, free))
    out = tmp_path / "sd35m"
    with pytest.raises(ValueError) as err:
        build_random("sd35m", str(out), device="cpu", dtype=torch.bfloat16)
    need = sum(stored for _, stored in meta_counts(plan_for("sd35m")).values()) * 2 + DISK_MARGIN_BYTES
    message = str(err.value)
    assert "not enough disk space" in message and f"{need:,} bytes" in message and f"{free:,} bytes" in message
    assert not os.path.exists(out) and not os.path.exists(f"{out}.tmp")


def test_existing_folders_are_refused(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        build_random("sd35m", str(tmp_path / "taken"), device="cpu")
    (tmp_path / "other.tmp").mkdir()  # not ours (no marker): never deleted
    with pytest.raises(ValueError, match="not an interrupted"):
        build_random("sd35m", str(tmp_path / "other"), device="cpu", scale=SCALES["sd35m"])
    assert (tmp_path / "other.tmp").is_dir()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["bogus"],
            "unknown architecture 'bogus'; choose one of sd35m, flux2_klein, flux2_klein_4b, flux2_dev, qwen_image, "
            "qwen_image21, wan22_a14b, wan22_i2v_a14b, ltx2, stable_audio3_medium, hunyuan_video15_480p",
        ),
        (["sd35m", "--dtype", "int8"], "--dtype must be one of bf16, fp16, fp32"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv, message, tmp_path, capsys):
    code = cli.main(["random-model", argv[0], str(tmp_path / "out"), *argv[1:]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and err.startswith("diffrl random-model: error: ") and message in err
    assert not os.path.exists(tmp_path / "out")
