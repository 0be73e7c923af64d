"""`diffrl export`: a trained run's checkpoint loads in plain diffusers, with its base model recorded."""

from __future__ import annotations

import ast
import json
import os
import re

import numpy as np
import torch
from diffusers import StableDiffusion3Pipeline
from e2e_settings import TINY
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from diffrl.flows.cli import main
from diffrl.flows.train import train

RUN = TINY + ["run.steps=1", "run.checkpoint_every=1"]
# the quickstart's own model (shipped, stored in float16) at its size, trained one step as RUN is
SHIPPED_RUN = RUN + [
    "model.path=reference:shapes-small",
    "data.train=generator:shapes",
    "rollout.height=64",
    "rollout.width=64",
]
DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "training.md")


def _transformer_out(pipe, seed: int = 0) -> torch.Tensor:
    """The transformer's velocity on fixed random inputs (the shapes of the tiny SD3)."""
    t = pipe.transformer
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, t.config.in_channels, 8, 8, generator=g)
    text = torch.randn(1, 6, t.config.joint_attention_dim, generator=g)
    pooled = torch.randn(1, t.config.pooled_projection_dim, generator=g)
    with torch.no_grad():
        return t(latents, encoder_hidden_states=text, pooled_projections=pooled, timestep=torch.tensor([500.0]))[0]


def test_export_writes_a_lora_and_a_merged_pipeline_and_refuses_a_damaged_checkpoint(workdir, capsys):
    """The LoRA and merged pipeline load in plain diffusers; the same checkpoint, damaged afterwards, is named and
    not exported (the export checks it against its checksums.json, as resuming does). One training run for both."""
    train(config=None, overrides=RUN)
    out = str(workdir / "exported")
    assert main(["export", *RUN, "--out", out, "--merge"]) == 0

    record = json.load(open(os.path.join(out, "diffrl_export.json")))
    base = record["base_model"]
    assert record["step"] == 1 and record["lora"] and os.path.isfile(os.path.join(base, "model_index.json"))
    lora_file = os.path.join(out, "pytorch_lora_weights.safetensors")
    with safe_open(lora_file, "pt") as f:
        config = json.loads(f.metadata()["lora_adapter_metadata"])
    assert config["transformer.base_model_name_or_path"] == base  # null in the checkpoint itself
    # the tensors are the checkpoint's own
    checkpoint_lora = "runs/quickstart/checkpoints/step_1/lora/pytorch_lora_weights.safetensors"
    trained = load_file(checkpoint_lora)
    exported = load_file(lora_file)
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)

    # plain diffusers, no diffrl: the base model named in the file, the LoRA loaded, and the merged pipeline agree
    base_pipe = StableDiffusion3Pipeline.from_pretrained(config["transformer.base_model_name_or_path"])
    before = _transformer_out(base_pipe)
    base_pipe.load_lora_weights(out)
    with_lora = _transformer_out(base_pipe)
    merged = _transformer_out(StableDiffusion3Pipeline.from_pretrained(os.path.join(out, "pipeline")))
    torch.testing.assert_close(merged, with_lora, rtol=1e-4, atol=1e-5)
    assert (with_lora - before).abs().max() > 1e-6  # the trained LoRA changes the output

    with open(checkpoint_lora, "r+b") as f:  # same size, other bytes
        f.seek(os.path.getsize(checkpoint_lora) - 64)
        f.write(b"\xff" * 64)
    capsys.readouterr()
    damaged = workdir / "damaged"
    assert main(["export", *RUN, "--out", str(damaged)]) == 2
    err = capsys.readouterr().err
    assert "pytorch_lora_weights.safetensors does not match its checksum" in err
    assert not (damaged / "pytorch_lora_weights.safetensors").exists()


def test_export_without_a_checkpoint_is_a_one_line_error(workdir, capsys):
    assert main(["export", *TINY, "run.name=never-trained", "--out", str(workdir / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diffrl export: error:") and "has no checkpoint yet" in err and "\n" not in err


def test_export_of_full_fine_tuning_writes_the_trained_pipeline(workdir):
    run = RUN + ["train.lora=false", "train.lr=1e-3"]
    train(config=None, overrides=run)
    out = str(workdir / "full")
    assert main(["export", *run, "--out", out]) == 0  # no LoRA: the pipeline is always written
    record = json.load(open(os.path.join(out, "diffrl_export.json")))
    assert not record["lora"] and record["lora_file"] is None
    base = StableDiffusion3Pipeline.from_pretrained(record["base_model"])
    trained = StableDiffusion3Pipeline.from_pretrained(os.path.join(out, "pipeline"))
    assert (_transformer_out(trained) - _transformer_out(base)).abs().max() > 1e-6
    # the exported transformer is the checkpoint's: loading the run's DCP shards into the base gives the same weights
    import torch.distributed.checkpoint as dcp

    target = {"model": base.transformer.state_dict()}
    dcp.load(target, checkpoint_id="runs/quickstart/checkpoints/step_1/dcp")
    for name, tensor in trained.transformer.state_dict().items():
        assert torch.equal(tensor, target["model"][name]), name


def _docs_snippet() -> str:
    """The Python block of docs/training.md's section on `diffrl export`, as a user copies it."""
    text = open(DOCS).read()
    section = text[text.index("### Exporting a checkpoint for plain diffusers") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _sample_args(snippet: str) -> list[str]:
    """The snippet's `pipe(...)` call and seed as `diffrl sample` flags (so the comparison follows the docs)."""
    calls = [n for n in ast.walk(ast.parse(snippet)) if isinstance(n, ast.Call)]
    call = next(c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "pipe")
    seed = next(c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "manual_seed")
    kw = {k.arg: k.value.value for k in call.keywords if isinstance(k.value, ast.Constant)}
    return [
        "--prompt", call.args[0].value, "--steps", str(kw["num_inference_steps"]),
        "--guidance-scale", str(kw["guidance_scale"]), "--height", str(kw["height"]), "--width", str(kw["width"]),
        "--seed", str(seed.args[0].value),
    ]  # fmt: skip


def test_the_documented_diffusers_snippet_draws_what_diffrl_sample_draws(workdir, capsys):
    """docs/training.md's snippet, run as written on the export of the shipped model, loads every component in one
    dtype and draws the image `diffrl sample` draws from the same checkpoint (merged by `diffrl export --merge`)."""
    train(config=None, overrides=SHIPPED_RUN)
    assert main(["export", *SHIPPED_RUN, "--out", "exported/", "--merge"]) == 0
    base = json.load(open("exported/diffrl_export.json"))["base_model"]
    assert os.path.isfile(os.path.join(base, "model_index.json"))  # a folder diffusers loads, not reference:<name>

    snippet = _docs_snippet()
    scope: dict = {}
    exec(compile(snippet, DOCS, "exec"), scope)  # noqa: S102 - the docs' own code, as a user runs it
    pipe = scope["pipe"]
    dtypes = {n: m.dtype for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    assert set(dtypes.values()) == {torch.float32}, dtypes
    documented = np.asarray(scope["image"].convert("RGB")).astype(int)

    assert main(["sample", "exported/pipeline", *_sample_args(snippet), "--out", "diffrl.png"]) == 0
    sampled = np.asarray(Image.open("diffrl.png").convert("RGB")).astype(int)
    # The LoRA applied on the fly (snippet) and merged into the weights (export --merge) differ only by float
    # rounding, as do diffrl's sampler and the pipeline (tests/flows/test_sample_command.py): at most one level of 255.
    assert documented.shape == sampled.shape == (64, 64, 3)
    assert np.abs(documented - sampled).max() <= 1
