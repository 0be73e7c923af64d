"""The tiny-model cache (diffrl/models/tiny.py) when two processes of one torch.distributed group ask for the
same model at once, as the engine replicas of a run do: one complete folder, byte for byte what build_tiny writes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diffrl.models.tiny import build_tiny, cached_tiny, missing_parts

WORKER = os.path.join(os.path.dirname(__file__), "tiny_cache_worker.py")


def _files(folder) -> dict[str, bytes]:
    """Every file under folder by relative path, with its bytes."""
    found = {}
    for sub, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(sub, name), "rb") as f:
                found[os.path.relpath(os.path.join(sub, name), folder)] = f.read()
    return found


@pytest.mark.slow  # ~15-35 s: three processes import torch, transformers and diffusers
def test_two_ranks_asking_for_the_same_tiny_model_at_once_share_one_complete_folder(tmp_path):
    root = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(rank), str(tmp_path / "store"), str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    build_tiny("sd3", str(tmp_path / "sd3"))  # the reference, built here while the ranks build theirs
    paths = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        paths.append(out.strip().splitlines()[-1])

    # rank 1 built (in a child process: transformers writes nothing on a non-zero rank), rank 0 waited for it
    assert paths == [str(root / "sd3-seed0")] * 2
    assert sorted(os.listdir(root)) == ["sd3-seed0", "sd3-seed0.lock"]  # no temporary folder left
    assert missing_parts(str(root / "sd3-seed0")) == []
    reference, ours = _files(tmp_path / "sd3"), _files(root / "sd3-seed0")
    assert sorted(ours) == sorted(reference)
    weights = [name for name in reference if name.endswith(".safetensors")]
    assert len(weights) == 5  # three text encoders, the transformer, the VAE
    for name in weights:  # seeded: the same bytes as a build in this process
        assert ours[name] == reference[name], name
    assert cached_tiny("sd3", str(root)) == str(root / "sd3-seed0")  # found, not built again


def test_missing_parts_names_the_empty_parts_of_a_pipeline_folder(tmp_path):
    """What the cache refuses to keep: replica 1's save left the text encoders' folders empty."""
    build_tiny("sd3", str(tmp_path))
    assert missing_parts(str(tmp_path)) == []
    for name in ("text_encoder", "text_encoder_3"):
        for file in os.listdir(tmp_path / name):
            os.remove(tmp_path / name / file)
    os.remove(tmp_path / "transformer" / "diffusion_pytorch_model.safetensors")
    assert missing_parts(str(tmp_path)) == [
        "text_encoder",
        "text_encoder_3",
        os.path.join("transformer", "model weights"),
    ]
