"""The supervised warm start of the autoregressive quickstart: a tiny Qwen3-Omni Thinker taught, briefly, to answer
questions about the shapes scenes (diffrl/shapes/questions.py), so that RL has something to sharpen.

    python -m diffrl.shapes.pretrain.thinker --out diffrl/models/reference/shapes-thinker --steps 150

What it builds: `Qwen3OmniMoeThinkerForConditionalGeneration` at tiny size (diffrl/models/causal_lm/tiny_thinker.py: MoE
text model of `--hidden-size`, vision and audio towers) with a byte-level BPE tokenizer trained in memory on the
task's words, random weights from `--seed`. Then `--steps` AdamW steps of teacher-forced cross-entropy on the answer
and its end token (`<answer><|im_end|>`) of `--batch` questions each, drawn from `--num-train` questions of the text
variant (the scene told in words, seed TRAIN_SEED: neither the RL runs' seeds nor the held-out one). Stopped early
on purpose: the shipped model answers about 60 % of the held-out questions, so RL has room to show. Greedy held-out
accuracy (the held-out set of omni_quick's validation) before and after goes to OUT/pretrain_summary.json with the
settings and the wall time. Weights are saved as safetensors, in fp16 by default (0.5 MB; `--save-dtype fp32`: 1 MB).

Legend: B questions of a batch, T answer tokens (right-padded).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict, dataclass

import torch

from diffrl.models.causal_lm.policy import CausalLMPolicy, SamplingParams, TokenPrompt
from diffrl.models.causal_lm.tiny_thinker import save_thinker_folder, tiny_thinker
from diffrl.shapes.questions import HELDOUT_SEED, HELDOUT_SIZE, answer_vocabulary, scene_questions

SAVE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
TRAIN_SEED = 7_001  # the warm start's questions (RL runs draw theirs with run.seed, validation with HELDOUT_SEED)
END = "<|im_end|>"


@dataclass
class PretrainConfig:
    steps: int = 150
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0
    hidden_size: int = 64
    num_train: int = 4000
    save_dtype: str = "fp16"  # the shipped weights: fp16 gave the same held-out answers as fp32 (0.5 MB, not 1 MB)

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "hidden_size", "num_train"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0; got {self.lr}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"save_dtype must be one of {list(SAVE_DTYPES)}; got {self.save_dtype!r}")


def answer_batch(policy: CausalLMPolicy, answers: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T), mask (B, T)) of `<answer><|im_end|>`, right-padded: the response the model should give."""
    rows = [policy.tokenizer(a + END, add_special_tokens=False)["input_ids"] for a in answers]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1.0
    return ids, mask


@torch.no_grad()
def greedy_accuracy(policy: CausalLMPolicy, records: list, batch: int = 64) -> dict[str, float]:
    """Exact-match accuracy of greedy answers (stripped text), overall and per question type."""
    right: dict[str, list[bool]] = {}
    policy.model.eval()
    for start in range(0, len(records), batch):
        part = records[start : start + batch]
        prompts = [TokenPrompt(r.prompt, tuple(r.metadata.get("images") or ())) for r in part]
        out = policy.sample(prompts, SamplingParams(max_tokens=4, temperature=0.0))
        texts = policy.tokenizer.batch_decode(
            [out.response_ids[i, :n] for i, n in enumerate(out.lengths.tolist())], skip_special_tokens=True
        )
        for r, text in zip(part, texts):
            right.setdefault(r.metadata["question_type"], []).append(text.strip() == r.ground_truth)
    every = [ok for oks in right.values() for ok in oks]
    return {"accuracy": sum(every) / len(every), **{k: sum(v) / len(v) for k, v in sorted(right.items())}}


def pretrain(cfg: PretrainConfig, out_dir: str) -> dict:
    """Build, train and save the warm-start Thinker into `out_dir`; returns the summary it writes there."""
    started = time.time()
    model, tokenizer, processor = tiny_thinker(
        cfg.seed, extra_texts=answer_vocabulary() * 20, hidden_size=cfg.hidden_size
    )
    policy = CausalLMPolicy(model, tokenizer, processor)
    train = scene_questions(cfg.num_train, TRAIN_SEED, None).records
    heldout = scene_questions(HELDOUT_SIZE, HELDOUT_SEED, None).records
    before = greedy_accuracy(policy, heldout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    model.train()
    for _ in range(cfg.steps):
        records = [train[rng.randrange(len(train))] for _ in range(cfg.batch)]
        ids, mask = answer_batch(policy, [r.ground_truth for r in records])
        inputs = policy.encode([TokenPrompt(r.prompt) for r in records])
        loss = -(policy.log_probs(inputs, ids) * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval().to(SAVE_DTYPES[cfg.save_dtype])
    save_thinker_folder(out_dir, model, tokenizer, processor)
    reloaded = CausalLMPolicy.from_pretrained(out_dir)  # what ships is what is measured (loaded as runs load it: fp32)
    summary = {
        "config": asdict(cfg),
        "train_seed": TRAIN_SEED,
        "heldout": {"seed": HELDOUT_SEED, "size": HELDOUT_SIZE},
        "greedy_accuracy_before": before,
        "greedy_accuracy_after": greedy_accuracy(reloaded, heldout),
        "final_loss": float(loss.detach()),
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": time.time() - started,
        "torch": torch.__version__,
    }
    with open(os.path.join(out_dir, "pretrain_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the model folder to write")
    for f in PretrainConfig.__dataclass_fields__.values():
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    torch.manual_seed(args["seed"])
    summary = pretrain(PretrainConfig(**args), out)
    print(json.dumps({k: summary[k] for k in ("greedy_accuracy_before", "greedy_accuracy_after", "seconds")}))
    return summary


if __name__ == "__main__":
    main()
