"""RL on the shipped reference shapes model, engines driven directly: held-out accuracy per category
before and after training (the table of docs/reference-model.md).

It runs an experiment config's RL steps through the step core the `rl_step` flow runs (diffrl/engines/step/run.py
run_step: generate -> score -> advantages -> update_actor -> sync_weights, the same stage functions), with the
stages called directly instead of as Prefect tasks and no trajectory store or MLflow (the engines-only loop).
Evaluation is the flow's validation: ODE (noise level 0) samples of the fixed held-out prompts
(`data.val`, the first `data.num_val_prompts`), scored by the config's reward; strict accuracy per
GenEval category from `geneval_lite`'s info.

    python -m benchmarks.shapes_rl --config diffrl/configs/shapes_flow_grpo.yaml          # GPU
    python -m benchmarks.shapes_rl --config diffrl/configs/shapes_flow_grpo.yaml model.device=cpu run.steps=2 \
        rollout.prompts_per_step=2 train.mini_batch_prompts=2 data.num_val_prompts=8  # CPU smoke run
    ... algorithm.name=diffusion_nft algorithm.noise_level=0 --max-minutes 6 --tag nft   # a sweep entry
    ... --eval-also num_inference_steps=10 guidance_scale=1   # also held-out accuracy at other sampling settings
    ... --eval-only --eval-also guidance_scale=1 guidance_scale=2   # evaluate the model only, no RL

Direct-preference algorithms (dpo, diffusion_nft, awm) train as in the flow (the same stages).
Writes benchmarks/results/shapes_rl_<config>[_<tag>]_<device>.json
(per-step training reward, strict accuracy, timings and trainer metrics; a reward-curve PNG beside it) after
every validation, so a run stopped early keeps what it measured; "finished" says whether it ran to its end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import numpy as np
import torch

from benchmarks.common import write_json
from diffrl.configs.schema import ExperimentConfig, load_experiment
from diffrl.engines.reward.multi import MultiReward
from diffrl.engines.rollout import RolloutEngine
from diffrl.engines.step.plan import validation_rollout
from diffrl.engines.step.run import DirectStages, StepClock, add_perf, run_step
from diffrl.flows.build import build_engines
from diffrl.shapes.scenes import TAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Trainer metrics kept per step in the result (besides the step's train reward, strict accuracy and timings).
TRAIN_METRICS = (
    "actor/grad_norm",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/pg_loss",
    "actor/old_deviate",
    "actor/implicit_acc",
    "timing_s/update_actor",
    "timing_s/reward_wait",
    "timing_s/generate_wait",
)


def evaluate(rollout: RolloutEngine, reward: MultiReward, cfg: ExperimentConfig, records, **sampling) -> dict:
    """The flow's validation (tasks.common.validation_rollout: ODE, data.val_samples_per_prompt images per prompt),
    with strict accuracy per category; `sampling` overrides fields of the config's sampling (e.g.
    guidance_scale, num_inference_steps)."""
    if not records:
        return {"reward": float("nan"), "accuracy": float("nan")}
    traj = validation_rollout(rollout, cfg, records, **sampling)
    out = reward(traj.images, traj.prompts, traj.metadata)
    accuracy = np.asarray(out.info["geneval_lite/accuracy"], dtype=np.float64)
    tags = [m["tag"] for m in traj.metadata]
    result = {"reward": float(out.scores.mean()), "accuracy": float(accuracy.mean())}
    for tag in TAGS:
        chosen = [a for a, t in zip(accuracy, tags) if t == tag]
        if chosen:
            result[f"accuracy/{tag}"] = float(np.mean(chosen))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="experiment YAML (a shapes config)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as `diffrl train` takes them")
    parser.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop training after the step that crosses this wall time (then evaluate)",
    )
    parser.add_argument("--tag", default="", help="suffix of the result file name (sweeps)")
    parser.add_argument(
        "--eval-also",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE[,FIELD=VALUE]",
        help="also evaluate before and after training with these sampling settings, e.g. "
        "guidance_scale=1 num_inference_steps=10,guidance_scale=4.5",
    )
    parser.add_argument("--eval-only", action="store_true", help="evaluate the model (and --eval-also), no RL")
    args = parser.parse_args(argv)
    cfg = load_experiment(args.config, args.overrides)
    eval_also = _parse_eval_also(args.eval_also)
    if not cfg.model.path.startswith("reference:shapes") or cfg.data.train != "generator:shapes" or not cfg.data.val:
        raise SystemExit(
            "shapes_rl drives shapes configs: model.path reference:shapes[-early], data.train "
            "generator:shapes and a held-out data.val"
        )
    device, _ = cfg.model.device_and_dtype()
    torch.manual_seed(cfg.run.seed)
    engines = build_engines(cfg, durable=False)  # the flow's engines, without a trajectory store
    rollout, reward, val_records = engines.rollout, engines.reward, engines.val_prompts
    stages = DirectStages(engines)

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    name = os.path.splitext(os.path.basename(args.config))[0]
    slug = re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")
    path = os.path.join(args.out_dir, f"shapes_rl_{name}{'_' + args.tag if args.tag else ''}_{slug}.json")
    curve, step_seconds, train_metrics, history, other_sampling = [], [], [], [], {}

    def record(finished: bool) -> dict:
        """The result so far, written to `path` (atomically: a run stopped by a timeout or a crash keeps the
        record of its last validation, with "finished": false)."""
        result = {
            "config": name,
            "overrides": args.overrides,
            "device": device_name,
            "torch": torch.__version__,
            "finished": finished,
            "steps": len(curve),
            "samples_per_step": cfg.rollout.samples_per_step,
            "val_prompts": len(val_records),
            "val_samples_per_prompt": cfg.data.val_samples_per_prompt,
            "before": history[0],
            "after": history[-1],
            "history": history,
            "at_other_sampling": other_sampling,
            "train_reward_curve": curve,
            "train_metrics": train_metrics,
            "seconds_per_step_median": float(np.median(step_seconds)) if step_seconds else None,
            "seconds_total": time.perf_counter() - started,
            "tag": args.tag,
            "command": " ".join(
                [
                    "python",
                    "-m",
                    "benchmarks.shapes_rl",
                    "--config",
                    args.config,
                    *args.overrides,
                    *(["--max-minutes", str(args.max_minutes)] if args.max_minutes else []),
                    *(["--eval-also", *args.eval_also] if args.eval_also else []),
                    *(["--eval-only"] if args.eval_only else []),
                ]
            ),
        }
        write_json(path, result)
        return result

    started = time.perf_counter()
    history.append({"step": 0, **evaluate(rollout, reward, cfg, val_records)})
    record(finished=False)
    print(json.dumps(history[-1]), flush=True)
    other_sampling["before"] = _evaluate_also(rollout, reward, cfg, val_records, eval_also)
    clock = StepClock()
    for step in range(0 if args.eval_only else cfg.run.steps):
        metrics = run_step(engines, step, stages).metrics
        step_seconds.append(add_perf(metrics, clock.lap())["perf/time_per_step"])
        curve.append(metrics["critic/rewards/mean"])
        train_metrics.append(
            {
                "reward": curve[-1],
                "accuracy": metrics.get("reward/geneval_lite/accuracy", float("nan")),
                "rollout_s": metrics["timing_s/generate"],
                "reward_s": metrics["timing_s/reward"],
                **{k: v for k, v in metrics.items() if k in TRAIN_METRICS},
            }
        )
        print(
            f"step {step + 1}/{cfg.run.steps}  reward {curve[-1]:.3f}  "
            f"grad_norm {metrics.get('actor/grad_norm', float('nan')):.3f}"
            f"  {step_seconds[-1]:.2f} s",
            flush=True,
        )
        every = cfg.run.validate_every
        out_of_time = args.max_minutes is not None and time.perf_counter() - started > 60 * args.max_minutes
        if out_of_time:
            engines.memory.drain()  # a rollout prefetched for the next step must not run beside the evaluation
        if (every and (step + 1) % every == 0) or step + 1 == cfg.run.steps or out_of_time:
            with clock.excluded():
                history.append({"step": step + 1, **evaluate(rollout, reward, cfg, val_records)})
                record(finished=False)
                print(json.dumps(history[-1]), flush=True)
        if out_of_time:
            print(f"--max-minutes {args.max_minutes} reached after {step + 1} steps", flush=True)
            break

    if not args.eval_only:
        other_sampling["after"] = _evaluate_also(rollout, reward, cfg, val_records, eval_also)
    result = record(finished=True)
    _plot(curve, history, path[:-5] + ".png")
    print(f"before {history[0]['accuracy']:.3f} -> after {history[-1]['accuracy']:.3f}; wrote {path}", flush=True)
    return result


def _parse_eval_also(specs: list[str]) -> dict[str, dict]:
    """--eval-also's specs ("guidance_scale=1,num_inference_steps=10") as sampling fields, keyed by the spec."""
    parsed = {}
    for spec in specs:
        fields = {}
        for item in spec.split(","):
            key, sep, value = item.partition("=")
            try:
                if not sep or key not in ("guidance_scale", "num_inference_steps"):
                    raise ValueError(key)
                fields[key] = int(value) if key == "num_inference_steps" else float(value)
            except ValueError:
                raise SystemExit(
                    f"--eval-also takes guidance_scale=X and num_inference_steps=N, got {item!r}"
                ) from None
        parsed[spec] = fields
    return parsed


def _evaluate_also(rollout, reward, cfg, records, specs: dict[str, dict]) -> dict[str, dict]:
    """Held-out evaluation at each spec's sampling fields, keyed by the spec and printed as it goes."""
    results = {}
    for spec, fields in specs.items():
        results[spec] = evaluate(rollout, reward, cfg, records, **fields)
        print(json.dumps({"sampling": spec, **results[spec]}), flush=True)
    return results


def _plot(curve: list[float], history: list[dict], path: str) -> None:
    """The training-reward curve and the held-out accuracy, as a PNG (PIL only)."""
    from PIL import Image, ImageDraw

    w, h, pad = 480, 240, 30
    image = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle([pad, 10, w - 10, h - pad], outline="black")
    n = max(len(curve), 1)

    def xy(step: float, value: float) -> tuple[float, float]:
        return pad + (w - 10 - pad) * step / n, h - pad - (h - pad - 10) * value

    if len(curve) > 1:
        draw.line([xy(i + 1, v) for i, v in enumerate(curve)], fill=(30, 90, 200), width=2)
    if len(history) > 1:
        draw.line([xy(e["step"], e["accuracy"]) for e in history], fill=(200, 60, 30), width=2)
    draw.text((pad + 5, 12), "train reward (blue), held-out strict accuracy (red); y in [0, 1]", fill="black")
    draw.text((pad, h - pad + 5), f"0 .. {n} RL steps", fill="black")
    image.save(path)


if __name__ == "__main__":
    main()
