"""The rollout's ODE shortcuts (rollout.ode_tail / ode_head): seconds per image, transformer evaluations per
image and the reward of the final images, lever off against on, same prompts and seeds.

Loads a config's model and reward (default: the quickstart's shapes-small recipe, diffrl/configs/shapes_quick.yaml),
samples the validation prompts' ids with the config's own sampling (the algorithm's SDE window and noise level, as
a training rollout samples) once per variant after one warm-up pass, and scores the images with the config's reward.
Every variant uses the same seeds, so a sample's SDE noise is the same in all of them: the per-image reward and pixel
differences from "off" are paired.

    python benchmarks/ode_shortcut.py --out benchmarks/results/ode_shortcut_shapes_cpu.json     # CPU, ~1 min
    python benchmarks/ode_shortcut.py rollout.num_inference_steps=10 \\
        "algorithm.window={kind: random_start, size: 2, start_range: [0, 5]}" --variants off,dpm2m:3,ab2:2

Variants are `off` or `SOLVER:K` for the tail (`head=SOLVER:K` for the head, `SOLVER:K+head=SOLVER:K` both).

`--solver-error START` measures instead how far each tail solver lands from the exact ODE: every sample's window is
put at [START, START + size), the stored latent at the window's end is integrated to sigma 0 by each solver on its
sub-schedule, and the result is compared with a 96-step AB2 solve on a uniform sigma grid (its 48-step solve is
reported as a check of the reference): relative RMS latent error, for Euler on the full schedule (the lever off) and
each solver at K = 2, 3 and the tail's own steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (also puts the repository root on sys.path)

from diffrl.algorithms.ode import grid_indices, integrate  # noqa: E402
from diffrl.configs.rollout import OdeShortcut  # noqa: E402
from diffrl.configs.schema import load_experiment  # noqa: E402
from diffrl.engines.reward.multi import MultiReward  # noqa: E402
from diffrl.engines.rollout import RolloutEngine  # noqa: E402
from diffrl.engines.step.plan import validation_batch  # noqa: E402
from diffrl.flows.build import load_prompts, resolve_model_path  # noqa: E402
from diffrl.models.base import SampleShape, load_adapter  # noqa: E402


def _shortcut(text: str) -> OdeShortcut:
    solver, _, k = text.partition(":")
    if not k.isdigit():
        raise ValueError(f"a shortcut is SOLVER:K (dpm2m:3); got {text!r}")
    return OdeShortcut(solver, int(k))


def parse_variant(text: str) -> tuple[OdeShortcut, OdeShortcut]:
    """`off`, `dpm2m:3`, `head=ab2:2` or `dpm2m:3+head=ab2:2` -> (tail, head)."""
    tail, head = OdeShortcut(), OdeShortcut()
    for part in filter(None, text.split("+")):
        if part == "off":
            continue
        if part.startswith("head="):
            head = _shortcut(part[len("head=") :])
        else:
            tail = _shortcut(part)
    return tail, head


def run_variant(engine: RolloutEngine, reward: MultiReward, batch: dict, sampling, variant: str) -> dict:
    """One timed pass of the whole batch with this variant: seconds, evaluations and rewards per image."""
    tail, head = parse_variant(variant)
    cfg = dataclasses.replace(sampling, ode_tail=tail, ode_head=head)
    before, started = engine.evaluations, time.perf_counter()
    traj = engine.generate(cfg=cfg, **batch)
    seconds = time.perf_counter() - started
    scored = reward(traj.images, batch["prompts"], batch["metadata"])
    images = len(batch["prompts"])
    accuracy = scored.info.get("geneval_lite/accuracy")
    return {
        "variant": variant,
        "seconds_per_image": seconds / images,
        "evaluations_per_image": (engine.evaluations - before) / images,
        "reward_mean": float(scored.scores[scored.valid].mean()),
        "accuracy_mean": None if accuracy is None else sum(map(float, accuracy)) / len(accuracy),
        "_scores": scored.scores,
        "_images": traj.images,
        "_latents": traj.latents,
    }


def compare(row: dict, off: dict) -> None:
    """Paired differences from the lever-off pass (in place), then drop the tensors."""
    row["reward_abs_diff_mean"] = float((row["_scores"] - off["_scores"]).abs().nanmean())
    row["pixel_abs_diff_mean"] = float((row["_images"].float() - off["_images"].float()).abs().mean())
    row["window_latents_equal"] = bool(torch.equal(row["_latents"], off["_latents"]))


def solver_errors(engine: RolloutEngine, batch: dict, sampling, start: int) -> dict:
    """Relative RMS error of each tail solver against a fine reference solve, from the window end at START + size."""
    size, n = sampling.window.size, sampling.num_inference_steps
    cfg = dataclasses.replace(
        sampling, window=dataclasses.replace(sampling.window, kind="random_start", start_range=(start, start + 1))
    )
    traj = engine.generate(cfg=cfg, **batch)
    lo, x = start + size, traj.latents[:, -1]  # every sample's latent at sigmas[start + size]
    if n - lo < 2:
        raise ValueError(f"--solver-error {start}: the window ends at step {lo} of {n}; no tail to compare")
    adapter, shape = engine.adapter, SampleShape(cfg.height, cfg.width, cfg.num_frames)
    enc, neg, _ = engine.encode(batch["prompts"], cfg, batch.get("metadata"))
    sigmas = [float(v) for v in adapter.sigmas(n, shape)]

    def velocity(y: torch.Tensor, sigma: float) -> torch.Tensor:
        sigma_b = torch.full((y.shape[0],), sigma, device=y.device)
        with adapter.attention_context():
            return adapter.velocity(y, sigma_b, enc, neg, guidance_scale=engine.guidance(cfg), shape=shape)

    with torch.no_grad():
        fine = [sigmas[lo] * (1 - k / 96) for k in range(97)]
        reference, _ = integrate(velocity, x, fine, solver="ab2")
        half, _ = integrate(velocity, x, fine[::2], solver="ab2")
        scale = reference.pow(2).mean().sqrt()
        rows = {"reference_48_vs_96_steps": float((half - reference).pow(2).mean().sqrt() / scale)}
        runs = [("euler", n - lo)] + [(s, k) for s in ("euler", "dpm2m", "ab2") for k in (2, 3, n - lo) if k <= n - lo]
        for solver, k in dict.fromkeys(runs):
            indices = grid_indices(lo, n, k)
            y, _ = integrate(velocity, x, [sigmas[i] for i in indices], solver=solver)
            rows[f"{solver}:{k} {indices}"] = float((y - reference).pow(2).mean().sqrt() / scale)
    return {"tail_from_step": lo, "sigmas": sigmas, "relative_rms_error": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="shapes_quick")
    parser.add_argument("--prompts", type=int, default=96, help="validation prompts (one image each)")
    parser.add_argument("--variants", default="off,euler:2,dpm2m:2,dpm2m:3,ab2:2,ab2:3")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per variant (the fastest is kept)")
    parser.add_argument("--solver-error", type=int, default=None, metavar="START", help="see the module docstring")
    parser.add_argument("--out", default=None)
    args, overrides = parser.parse_known_args(argv)
    variants = args.variants.split(",")
    if variants[0] != "off":
        raise ValueError("--variants must start with off (the others are compared with it)")
    cfg = load_experiment(args.config, overrides)
    device, dtype = cfg.model.device_and_dtype()
    adapter = load_adapter(resolve_model_path(cfg.model.path, seed=cfg.model.tiny_seed), device=device, dtype=dtype)
    engine = RolloutEngine(adapter, progress=False)
    reward = MultiReward(cfg.reward)
    records = load_prompts(cfg.data.val or cfg.data.train, cfg.data, seed=cfg.run.seed + 10_000)
    batch = validation_batch([records[i] for i in range(min(args.prompts, len(records)))], cfg.run.seed)
    sampling = cfg.sampling
    if args.solver_error is not None:
        result = {"config": args.config, "overrides": overrides, "images": len(batch["prompts"])}
        result.update(solver_errors(engine, batch, sampling, args.solver_error))
        if args.out:
            common.write_json(args.out, result)
        print(json.dumps(result, indent=1))
        return result
    engine.generate(cfg=sampling, **batch)  # warm-up: prompt encodings, allocator
    rows = []
    for variant in variants:
        runs = [run_variant(engine, reward, batch, sampling, variant) for _ in range(args.repeats)]
        rows.append(min(runs, key=lambda r: r["seconds_per_image"]))
    for row in rows:
        compare(row, rows[0])
    for row in rows:
        for key in [k for k in row if k.startswith("_")]:
            del row[key]
    result = {
        "config": args.config,
        "overrides": overrides,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "images": len(batch["prompts"]),
        "num_inference_steps": sampling.num_inference_steps,
        "window": dataclasses.asdict(sampling.window),
        "batch_size": sampling.batch_size,
        "command": " ".join(["python", "benchmarks/ode_shortcut.py", *(argv or sys.argv[1:])]),
        "variants": rows,
    }
    if args.out:
        common.write_json(args.out, result)
    print(f"{'variant':<22}{'s/image':>9}{'evals':>7}{'reward':>8}{'acc':>7}{'|dR|':>7}{'|dpx|':>7}")
    for r in rows:
        acc = r["accuracy_mean"]
        print(
            f"{r['variant']:<22}{r['seconds_per_image']:>9.4f}{r['evaluations_per_image']:>7.2f}{r['reward_mean']:>8.4f}"
            f"{(acc if acc is not None else float('nan')):>7.3f}{r['reward_abs_diff_mean']:>7.4f}"
            f"{r['pixel_abs_diff_mean']:>7.2f}"
        )
    return result


if __name__ == "__main__":
    main()
