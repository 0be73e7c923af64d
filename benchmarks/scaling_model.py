"""Engine replicas on paper: images/s of three recipes at 1, 2, 8 and 64 GPUs (`cluster.gpus`), predicted from
measured one-GPU stage times (the replica path at one GPU, `benchmarks/replicas_1gpu.py`, for shapes and SD3.5-M;
`benchmarks/rl_step.py` for Qwen-Image) and the bytes each replica exchanges per step, so that multi-GPU runs
confirm or refute a stated number. Nothing here runs a model; the real-size LoRA sizes are counted with peft on the
published configs (meta device, no weights).

Strong scaling: the recipe's own global batch B (its prompts x group size), split over N replicas (b = B / N each).
Each replica runs the local pipeline (diffrl/engines/step/run.py): rewards scored while it samples, rows written
behind the stages, the next step run ahead of the flow's tasks. One step of one replica, in seconds:

    generate      b x g                              g: one GPU's rollout seconds per image (measured)
    reward        min(chunk, b) x r                  the last chunk's scoring; the others overlap the rollout
    exchange      (N-1)/N x B x L / link             the update's all-gather of the step's latents
    update        b x u + n_opt x 2(N-1)/N x G / link    u: one GPU's update seconds per image; G the fp32 LoRA
                                                     gradients all-reduced at each of the step's n_opt optimizer steps
                                                     (not overlapped with the backward: conservative)
    write         max(0, b x (L + P) / write_bw - update)    the background writer (latents L, image P bytes) works
                                                     while the GPU trains; only what outlasts the update shows
    orchestration max(0, (rounds + 5) x task_s - the rest)   the flow's Prefect tasks (a generate round per chunk of a
                                                     replica, score, advantages, update, sync, bookkeeping) run beside
                                                     the replicas' run-ahead; only what outlasts their step shows

Weight sync: 0 bytes (LoRA replicas sample with the trainer's module). images/s = B / (sum of the above).
Weak scaling (each replica keeps the recipe's whole batch, the global batch grows N-fold) is predicted beside it.

Asynchronous steps (`run.async.max_staleness: 1`): each replica's next rollout runs beside its update, on the same
GPU, with a behaviour copy of the LoRA. One step of one replica:

    rollout       generate + reward                  as above
    training      exchange + update + recompute      recompute = f_r x b x u: the old log-probs the correction
                                                     recomputes, a forward without gradients (f_r: --recompute)
    hidden        o x min(rollout, training)         o: the share of the shorter side the GPU runs beside the
                                                     longer (--overlap; 1: both at their solo speeds, so the step
                                                     is their max; 0: no faster than in turn, so their sum)
    sync          4 x LoRA parameters / copy_bw      the trained fp32 LoRA copied into the behaviour copy
    write, orchestration                             as above, against this step's busy time

seconds = rollout + training - hidden + sync + write + orchestration: a prediction from the inputs above and the
stated o and f_r, not a measurement (benchmarks/async_shapes.py measures o on one GPU).

    python -m benchmarks.scaling_model --out benchmarks/results/scaling_model.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from benchmarks import common
from diffrl.models.qwen_image.realsize import QWEN_IMAGE_TRANSFORMER
from diffrl.models.sd3.realsize import SD35M_TRANSFORMER

HERE = os.path.dirname(os.path.abspath(__file__))

RESULTS = os.path.join(HERE, "results")
REAL_SIZE = {"sd3": SD35M_TRANSFORMER, "qwen_image": QWEN_IMAGE_TRANSFORMER}  # the published transformer configs


def _result(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def lora_params(arch: str, rank: int) -> int:
    """Trainable parameters of the recipe's LoRA on the real-size denoiser (meta device) or the shipped shapes model."""
    import torch
    from diffusers import QwenImageTransformer2DModel, SD3Transformer2DModel

    from diffrl.configs.train import TrainConfig
    from diffrl.engines.train.setup import lora_config
    from diffrl.flows.build import resolve_model_path
    from diffrl.models.base import adapter_class, load_adapter

    if arch == "shapes":
        model = load_adapter(resolve_model_path("reference:shapes")).transformer
        targets = adapter_class("sd3").default_lora_targets
    else:
        cls, conf = {"sd3": SD3Transformer2DModel, "qwen_image": QwenImageTransformer2DModel}[arch], REAL_SIZE[arch]
        with torch.device("meta"):
            model = cls(**conf)
        targets = adapter_class(arch).default_lora_targets
    model.add_adapter(lora_config(TrainConfig(lora_rank=rank, lora_alpha=2 * rank), tuple(targets)))
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def _replica_path(name: str) -> dict[str, float]:
    """One GPU's seconds per image (g rollout, u update, r reward) through the replica path at N = 1, and the
    in-process run's images/s, from a `benchmarks/replicas_1gpu.py` result (medians over its rounds)."""
    result = _result(name)
    images = result["images_per_step"]
    rounds = [m for label, m in result["stage_medians_s"].items() if label.startswith("gpus1#")]

    def per_image(key: str) -> float:
        return statistics.median(m[key] for m in rounds) / images

    return dict(
        g=per_image("timing_s/generate"),
        u=per_image("timing_s/update_actor"),
        r=per_image("timing_s/reward"),
        one_gpu_local=images / result["seconds_per_step"]["colocated"],
    )


def recipes() -> dict[str, dict]:
    """Measured one-GPU seconds per image (g rollout, u update, r reward) and per-step sizes of each recipe."""
    qwen = _result("qwen_image_ocr_lora_h200.json")["stage_ms_per_image"]  # benchmarks/rl_step.py, compiled, bf16 LoRA
    latent_512 = 3 * 16 * 64 * 64 * 4  # fp32 latents of a 512x512 sample: 16 x 64 x 64, a 2-step window + x0
    return {
        "shapes_flow_grpo (H200)": dict(  # `diffrl train`, 512 images a step
            B=512, chunk=512, n_opt=1, arch="shapes", rank=32, L=134e6 / 512, P=64 * 64 * 3,
            **_replica_path("replicas_1gpu_h200.json"),
        ),
        "sd35m_flow_grpo_ocr (H200)": dict(  # `diffrl train` at one prompt x 24 images a step, compiled, bf16 LoRA
            B=48 * 24, chunk=96, n_opt=2, arch="sd3", rank=32, L=latent_512, P=512 * 512 * 3,
            **_replica_path("replicas_1gpu_sd35m_h200.json"),
        ),
        "qwen_image_ocr_lora (H200)": dict(
            B=32 * 16, chunk=64, n_opt=2, arch="qwen_image", rank=64, L=latent_512, P=512 * 512 * 3,
            g=qwen["rollout"] / 1e3, u=qwen["update"] / 1e3, r=qwen["reward"] / 1e3,
            one_gpu_local=_result("qwen_image_ocr_lora_h200.json")["images_per_gpu_s"],
        ),
    }  # fmt: skip


def step_seconds(rec: dict, n: int, link: float, task_s: float, write_bw: float, weak: bool) -> dict[str, float]:
    """The parts of one step at n replicas (link and write_bw in bytes/s); `weak`: each replica keeps the recipe's
    whole batch (the global batch grows n-fold) instead of its n-th."""
    b = rec["B"] if weak else rec["B"] / n
    total = b * n
    chunk = min(rec["chunk"], b)
    rounds = max(1, round(b / chunk))
    gradients = 4 * rec["lora_params"]  # fp32 gradient all-reduce
    parts = {
        "generate": b * rec["g"],
        "reward": chunk * rec["r"],
        "exchange": (n - 1) / n * total * rec["L"] / link,
        "update": b * rec["u"] + rec["n_opt"] * 2 * (n - 1) / n * gradients / link,
    }
    parts["write"] = max(0.0, b * (rec["L"] + rec["P"]) / write_bw - parts["update"])
    parts["orchestration"] = max(0.0, (rounds + 5) * task_s - sum(parts.values()))
    parts["seconds"] = sum(parts.values())
    parts["images_per_s"] = total / parts["seconds"]
    parts["bytes"] = {  # what one replica sends or receives per step
        "gradient_all_reduce": rec["n_opt"] * 2 * (n - 1) / n * gradients,
        "latents_received": (n - 1) / n * total * rec["L"],
        "rows_written": b * (rec["L"] + rec["P"]),
        "weight_sync": 0.0,
    }
    return parts


def async_step_seconds(
    rec: dict, n: int, link: float, task_s: float, write_bw: float, *, overlap: float, recompute: float, copy_bw: float
) -> dict[str, float]:
    """The parts of one asynchronous step (max_staleness 1) at n replicas, strong scaling (module docstring)."""
    parts = step_seconds(rec, n, link, task_s, write_bw, weak=False)
    b = rec["B"] / n
    rollout = parts["generate"] + parts["reward"]
    out = {k: parts[k] for k in ("generate", "reward", "exchange", "update")}
    out["recompute"] = recompute * b * rec["u"]
    training = out["exchange"] + out["update"] + out["recompute"]
    out["hidden"] = overlap * min(rollout, training)
    out["sync"] = 4 * rec["lora_params"] / copy_bw
    busy = rollout + training - out["hidden"] + out["sync"]
    out["write"] = max(0.0, b * (rec["L"] + rec["P"]) / write_bw - out["update"] - out["recompute"])
    rounds = max(1, round(b / min(rec["chunk"], b)))
    out["orchestration"] = max(0.0, (rounds + 5) * task_s - busy - out["write"])
    out["seconds"] = busy + out["write"] + out["orchestration"]
    out["images_per_s"] = rec["B"] / out["seconds"]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", default="300,20", help="GB/s between replicas, one column each")
    parser.add_argument("--task-s", type=float, default=0.087, help="seconds per Prefect task on the critical path")
    parser.add_argument("--write-gbps", type=float, default=0.6, help="GB/s of one replica's background row writes")
    parser.add_argument("--overlap", default="1,0.5", help="asynchronous steps: shares of the shorter stage hidden")
    # measured: the shapes update took 0.82-0.85 s with the recompute, 0.55-0.56 s without (async_shapes_h100*.json)
    parser.add_argument("--recompute", type=float, default=0.5, help="the old-log-prob recompute over the update")
    parser.add_argument("--copy-gbps", type=float, default=1000.0, help="GB/s of the LoRA copy into the behaviour copy")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out = {"assumptions": vars(args), "recipes": {}}
    for name, rec in recipes().items():
        rec["lora_params"] = lora_params(rec["arch"], rec["rank"])
        rows = {}
        for gbps in [float(x) for x in args.links.split(",")]:
            for weak in (False, True):
                for n in (1, 2, 8, 64):
                    parts = step_seconds(rec, n, gbps * 1e9, args.task_s, args.write_gbps * 1e9, weak)
                    rows[f"{gbps:g}GB/s {'weak' if weak else 'strong'} x{n}"] = parts
            for overlap in [float(x) for x in args.overlap.split(",")]:
                for n in (1, 2, 8, 64):
                    rows[f"{gbps:g}GB/s async overlap {overlap:g} x{n}"] = async_step_seconds(
                        rec,
                        n,
                        gbps * 1e9,
                        args.task_s,
                        args.write_gbps * 1e9,
                        overlap=overlap,
                        recompute=args.recompute,
                        copy_bw=args.copy_gbps * 1e9,
                    )
        out["recipes"][name] = {"inputs": rec, "predicted": rows}
        line = ", ".join(f"{k}: {v['images_per_s']:.1f}" for k, v in rows.items() if "strong" in k)
        print(f"{name}: one GPU measured {rec['one_gpu_local']:.2f} images/s; predicted images/s {line}")
        line = ", ".join(f"{k}: {v['images_per_s']:.1f}" for k, v in rows.items() if "async" in k)
        print(f"{name}: asynchronous, predicted images/s {line}")
    common.write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
