"""clip_score, pickscore and aesthetic on a tiny random CLIP saved to a local folder, checked
against a hand computation with the same transformers model."""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

from diffrl.engines.reward.base import build_reward

PROMPTS = ["a red cat", "a photo of the blue dog"]


def _images(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (2, 40, 48, 3), dtype=np.uint8)


def _hand_embeddings(folder: str, images: np.ndarray, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, float]:
    model = CLIPModel.from_pretrained(folder).eval()
    pixels = AutoImageProcessor.from_pretrained(folder)(images=list(images), return_tensors="pt")["pixel_values"]
    tokens = AutoTokenizer.from_pretrained(folder)(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        image = model.get_image_features(pixel_values=pixels).pooler_output
        text = model.get_text_features(**tokens).pooler_output
    return (
        image / image.norm(dim=-1, keepdim=True),
        text / text.norm(dim=-1, keepdim=True),
        model.logit_scale.exp().item(),
    )


def test_clip_score_is_the_cosine_similarity(tiny_clip_folder):
    images = _images()
    image, text, _ = _hand_embeddings(tiny_clip_folder, images, PROMPTS)
    reward = build_reward("clip_score", {"model_path": tiny_clip_folder, "batch_size": 1, "scale": 2.5})
    out = reward(images, PROMPTS, [{}, {}])
    torch.testing.assert_close(out.scores, 2.5 * (image * text).sum(-1), rtol=1e-5, atol=1e-5)
    assert out.valid.all()


def test_pickscore_is_the_scaled_logit(tiny_clip_folder):
    images = _images(1)
    image, text, logit_scale = _hand_embeddings(tiny_clip_folder, images, PROMPTS)
    out = build_reward("pickscore", {"model_path": tiny_clip_folder})(images, PROMPTS, [{}, {}])
    torch.testing.assert_close(out.scores, logit_scale * (image * text).sum(-1) / 26.0, rtol=1e-5, atol=1e-5)


def test_video_scores_average_every_fourth_frame(tiny_clip_folder):
    images = _images(2)
    reward = build_reward("clip_score", {"model_path": tiny_clip_folder})
    frames = reward(images, [PROMPTS[0]] * 2, [{}, {}]).scores
    video = np.stack([images[0], images[1], images[1], images[1], images[1]])  # frames 0 and 4 scored
    out = reward(video[None], [PROMPTS[0]], [{}])
    assert out.scores[0].item() == pytest.approx(frames.mean().item(), rel=1e-5)


def test_aesthetic_head_on_the_image_embedding(tiny_clip_folder, tmp_path):
    torch.manual_seed(0)
    head = {
        "layers.0.weight": torch.randn(8, 16),
        "layers.0.bias": torch.randn(8),
        "layers.2.weight": torch.randn(1, 8),
        "layers.2.bias": torch.randn(1),
    }
    save_file(head, str(tmp_path / "head.safetensors"))
    images = _images(3)
    image, _, _ = _hand_embeddings(tiny_clip_folder, images, PROMPTS)
    expected = (image @ head["layers.0.weight"].T + head["layers.0.bias"]) @ head["layers.2.weight"].T + head[
        "layers.2.bias"
    ]
    reward = build_reward(
        "aesthetic", {"model_path": tiny_clip_folder, "head_path": str(tmp_path / "head.safetensors")}
    )
    out = reward(images, ["", ""], [{}, {}])
    torch.testing.assert_close(out.scores, expected[:, 0], rtol=1e-5, atol=1e-5)
    save_file(
        {"layers.0.weight": torch.randn(1, 7), "layers.0.bias": torch.randn(1)}, str(tmp_path / "bad.safetensors")
    )
    with pytest.raises(ValueError, match=r"layer 0 has weight \(1, 7\), expected \(\*, 16\)"):
        build_reward("aesthetic", {"model_path": tiny_clip_folder, "head_path": str(tmp_path / "bad.safetensors")})


def test_missing_folders_fail_at_build_time(tmp_path, tiny_clip_folder):
    missing = str(tmp_path / "no_such_model")
    for name in ("clip_score", "pickscore", "aesthetic"):
        with pytest.raises(ValueError, match="not an existing folder|does not exist"):
            build_reward(name, {"model_path": missing})
    # a folder without the processor files is caught at build time too
    (tmp_path / "weights_only").mkdir()
    (tmp_path / "weights_only" / "config.json").write_text(Path(tiny_clip_folder, "config.json").read_text())
    with pytest.raises(ValueError, match="lacks preprocessor_config.json"):
        build_reward("clip_score", {"model_path": str(tmp_path / "weights_only")})


def test_open_clip_format_needs_the_package_or_is_loaded(tmp_path):
    try:
        import open_clip  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install open_clip_torch"):
            build_reward(
                "clip_score", {"model_path": str(tmp_path), "format": "open_clip", "open_clip_model": "ViT-B-32"}
            )
    else:
        with pytest.raises(ValueError, match="lacks open_clip_model.safetensors"):
            build_reward(
                "clip_score", {"model_path": str(tmp_path), "format": "open_clip", "open_clip_model": "ViT-B-32"}
            )
    with pytest.raises(ValueError, match="needs option 'open_clip_model'"):
        build_reward("clip_score", {"model_path": str(tmp_path), "format": "open_clip"})
