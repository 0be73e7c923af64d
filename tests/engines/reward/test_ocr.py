"""The OCR reward with the real RapidOCR models (shipped in the rapidocr-onnxruntime wheel),
checked through the `score` command as the issue asks."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from diffrl.engines.reward.base import build_reward
from diffrl.flows.commands import score

PROMPT = 'A wooden trail marker with "Hidden Trail" carved into the wood'
REPO = Path(__file__).resolve().parents[3]


def render_text(text: str, size: int = 256) -> np.ndarray:
    """Black text on white with Pillow's built-in font (no system fonts needed)."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    ImageDraw.Draw(image).text(
        (size // 10, size // 2 - size // 20), text, fill=(0, 0, 0), font=ImageFont.load_default(size=size // 10)
    )
    return np.asarray(image)


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("ocr_images")
    rng = np.random.default_rng(0)
    arrays = {
        "text": render_text("Hidden Trail"),
        "blank": np.full((256, 256, 3), 255, dtype=np.uint8),
        "noise": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
    }
    paths = {}
    for name, array in arrays.items():
        paths[name] = str(folder / f"{name}.png")
        Image.fromarray(array).save(paths[name])
    return paths


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="diffrl")
    score.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_score_command_json_hidden_trail_blank_noise(image_files, capsys):
    args = _parse(
        [
            "score",
            "--reward",
            "ocr",
            "--prompt",
            PROMPT,
            "--json",
            image_files["text"],
            image_files["blank"],
            image_files["noise"],
        ]
    )
    assert score.run(args) == 0
    results = json.loads(capsys.readouterr().out)  # stdout holds only the JSON
    assert [r["image"] for r in results] == [image_files["text"], image_files["blank"], image_files["noise"]]
    text, blank, noise = (r["score"] for r in results)
    assert text >= 0.9
    assert blank <= 0.1
    assert noise <= 0.2


def test_score_command_ground_truth_and_bad_input(image_files, capsys):
    args = _parse(["score", "--reward", "ocr", "--ground-truth", "Hidden Trail", image_files["text"]])
    assert score.run(args) == 0
    value, path = capsys.readouterr().out.strip().split("\t")
    assert float(value) >= 0.9 and path == image_files["text"]
    # no quotes, no ground truth: bad input, exit 2, message on stderr
    assert score.run(_parse(["score", "--reward", "ocr", "--prompt", "a sign", image_files["text"]])) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "no target text" in captured.err
    assert score.run(_parse(["score", "--reward", "ocr", image_files["text"] + ".missing"])) == 2
    assert score.run(_parse(["score", "--reward", "nope", image_files["text"]])) == 2


def test_python_dash_m_prints_json_on_stdout_only(image_files):
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffrl.flows.commands.score",
            "--reward",
            "ocr",
            "--prompt",
            PROMPT,
            "--json",
            image_files["text"],
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)[0]["score"] >= 0.9


def test_video_averages_every_fourth_frame():
    reward = build_reward("ocr", {})
    text, blank = render_text("Hidden Trail"), np.full((256, 256, 3), 255, dtype=np.uint8)
    video = np.stack([text, text, text, text, blank])  # frames 0 and 4 are read
    out = reward(video[None], [PROMPT], [{}])
    assert out.valid.all()
    assert out.scores[0].item() == pytest.approx(0.5, abs=0.05)
    assert out.info["target"] == ["Hidden Trail"]
