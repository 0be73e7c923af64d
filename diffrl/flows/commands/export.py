"""`diffrl export [CONFIG] [overrides] --out DIR [--step K] [--merge]`: a run's checkpoint as plain diffusers files.

    diffrl export quickstart --out exported/              # the quickstart run's latest checkpoint, LoRA only
    diffrl export my.yaml run.name=r1 --out r1/ --step 40 --merge

The run is found as `diffrl train` finds it (the config's run.root and run.name); the base model recorded in the
export is the config's model.path, resolved (`reference:<name>` and `tiny:<arch>` become the local folder).
Exit codes: 0 written, 2 bad input (one-line error on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export",
        help="write a run's checkpoint as a diffusers LoRA (or a merged pipeline) with its base model recorded",
        description="Export a checkpoint of a run (default: its latest) so that plain diffusers loads it: "
        "`pipe.load_lora_weights(OUT)` for a LoRA run, `DiffusionPipeline.from_pretrained(OUT/pipeline)` with "
        "--merge (always written for full fine-tuning). CONFIG and overrides name the run as for `diffrl train`.",
        epilog="example: diffrl export quickstart --out exported/ --merge",
    )
    parser.add_argument("config", nargs="?", default=None, help="config name or YAML path (default: quickstart)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides naming the run, e.g. run.name=my-run")
    parser.add_argument("--out", required=True, help="folder to write (created)")
    parser.add_argument(
        "--step", type=int, default=None, help="the checkpoint of step K, checkpoints/step_K (default: the latest)"
    )
    parser.add_argument("--merge", action="store_true", help="also write the pipeline with the LoRA merged in")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from diffrl.configs.schema import load_experiment
    from diffrl.engines.numbering import step_index
    from diffrl.engines.step.update import checkpoint_dir, latest_checkpoint
    from diffrl.engines.train.export import export_checkpoint
    from diffrl.flows.commands.train import split_config_args
    from diffrl.flows.provenance import base_model
    from diffrl.flows.run_format import check_run_format

    config, overrides = split_config_args(args)  # `diffrl export run.name=x --out y`: no CONFIG given
    try:
        cfg = load_experiment(config, overrides)
        check_run_format(cfg.run_dir, cfg.run.name)
        step = step_index(args.step) if args.step is not None else latest_checkpoint(cfg.run_dir)
        if step is None:
            raise ValueError(f"run {cfg.run.name!r} has no checkpoint yet under {cfg.run_dir}/checkpoints")
        checkpoint = checkpoint_dir(cfg.run_dir, step)
        if not os.path.isdir(checkpoint):
            kept = sorted(os.listdir(os.path.join(cfg.run_dir, "checkpoints")))
            raise ValueError(f"no checkpoint {checkpoint!r}; the run keeps: {kept}")
        done = export_checkpoint(checkpoint, args.out, base_model=base_model(cfg), merge=args.merge, say=_say)
    except (ValueError, FileNotFoundError) as e:
        print(f"diffrl export: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    _say(f"exported step {done.step} of run {cfg.run.name!r} to {args.out}")
    return EXIT_OK


def _say(message: str) -> None:
    print(f"[diffrl] {message}", flush=True)
