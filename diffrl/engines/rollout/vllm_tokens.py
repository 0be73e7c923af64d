"""The vLLM rollout engine of the autoregressive family: the TokenRolloutEngine protocol (diffrl/engines/rollout/
tokens.py) served by a vLLM OpenAI-compatible server in its own process and virtualenv (diffrl/engines/vllm_server.py).

Request mapping (one `POST /v1/completions` per run of consecutive rows that share a prompt):
    prompt            the prompt's token ids, rendered and tokenized exactly as CausalLMPolicy.encode does
    n                 the rows in the run; vLLM seeds child k of a request with `seed + k`
                      (vllm/v1/engine/parallel_sampling.py), so the run's draws follow from its first row's seed,
                      as the in-process engine's call is seeded by its first row's (`seeds` are stored as given)
    max_tokens, temperature, top_p, stop, seed     from TokenSampling (temperature 0 = greedy)
    logprobs: 0, return_token_ids: true, include_stop_str_in_output: true
    model             `policy-v<version>` (the LoRA adapter of that version) or the base model's name
Response: choices[k].token_ids (the response's own ids, its end token included) and
choices[k].logprobs.token_logprobs; the server runs with `--logprobs-mode processed_logprobs`, the log-probs of the
distribution sampled from: log softmax(logits / temperature) as diffrl's replay computes them, with top-p < 1 the
renormalised truncated distribution (a gap the old-log-prob recompute and `rollout_corr/*` see), and for greedy
decoding the untempered log-probs. Texts are decoded here with the policy's tokenizer (special tokens skipped), as
the in-process engine does.

Weights: `update_weights(version)` writes the trainer's weights of that version (diffrl/engines/rollout/
vllm_weights.py: a PEFT LoRA folder, or the full merged weights) and loads them into the server before it returns;
`generate(..., policy_version=v)` refuses a version the server does not hold. The engine is not the trainer's
module (no `adapter` attribute), so the trainer recomputes old log-probs and reports the rollout/trainer gap.
With `sleep_for_update` (a GPU shared with the trainer) the server sleeps once no rollout is in flight and wakes for
the next weight load or rollout, after the trainer's cached GPU memory is given back.
Images are not sent yet (`/v1/completions` takes token ids only): a prompt with images is a ValueError.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from diffrl.configs.vllm import VllmRolloutOptions
from diffrl.engines.rollout.tokens import TokenSampling
from diffrl.engines.rollout.vllm_weights import save_full, save_lora
from diffrl.engines.token_trajectories import TokenTrajectories
from diffrl.engines.vllm_server import VllmServer, VllmServerError
from diffrl.models.causal_lm.policy import CausalLMPolicy, TokenPrompt

logger = logging.getLogger(__name__)


class VllmTokenEngine:
    """Samples with a vLLM server of the policy's model folder; takes the trainer's weights by version."""

    def __init__(self, policy: CausalLMPolicy, options: VllmRolloutOptions, *, weights_dir: str, python: str):
        if not policy.source or not os.path.isfile(os.path.join(policy.source, "config.json")):
            raise ValueError("the vLLM engine serves the policy's model folder: load it with from_pretrained(path)")
        self.trainer_policy = policy  # the trainer's module: exported on update_weights, never sampled here
        self.options = options
        self.weights_dir = weights_dir
        self.server = VllmServer(
            policy.source, options, python=python, log_path=os.path.join(weights_dir, "vllm-server.log")
        )
        self.policy_version = 0
        self.model_name = ""  # set by start(): the base model (version 0) or policy-v<version>
        self.loaded: list[int] = []
        self.last_sync_s = 0.0
        self.asleep = False
        self._in_flight = 0  # rollouts running now (the server sleeps only when none is)
        self._sleep_lock = threading.Lock()
        os.makedirs(weights_dir, exist_ok=True)

    def start(self) -> VllmTokenEngine:
        self.server.start()
        self.model_name = self.server.name
        return self

    def close(self) -> None:
        self.server.stop()

    # ---- sleep (sleep_for_update: the server's GPU memory is the trainer's during the update) -----------------
    def _wake(self) -> None:
        """Wake the server if it sleeps; the trainer's cached GPU memory goes back to the device first (the server
        allocates its weights and KV cache again)."""
        if not self.asleep:
            return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.server.request("POST", "/wake_up", timeout_s=max(600.0, self.options.request_timeout_s))
        self.asleep = False

    def _sleep(self) -> None:
        """Level 1: the weights to host memory, the KV cache freed (the base weights never change under LoRA)."""
        self.server.request("POST", "/sleep?level=1", timeout_s=max(600.0, self.options.request_timeout_s))
        self.asleep = True

    # ---- weights ---------------------------------------------------------------------------------------------
    def update_weights(self, version: int) -> None:
        """Load the trainer's current weights into the server as policy `version` (blocking)."""
        started = time.perf_counter()
        with self._sleep_lock:
            self._wake()
        folder = os.path.join(self.weights_dir, f"v{version}")
        model = self.trainer_policy.model
        if self.options.weight_sync == "lora":
            save_lora(model, folder, self.trainer_policy.source)
            name = f"policy-v{version}"
            body = {"lora_name": name, "lora_path": os.path.abspath(folder)}
            self.server.request("POST", "/v1/load_lora_adapter", json=body)
            self.model_name = name
        else:
            save_full(model, folder, self.trainer_policy.source)
            body = {"method": "reload_weights", "kwargs": {"weights_path": os.path.abspath(folder)}}
            self.server.request("POST", "/collective_rpc", json=body)
            self.model_name = self.server.name  # the reloaded base weights; no adapter
        self.policy_version = version
        self.loaded.append(version)
        self._forget_old()
        self.last_sync_s = time.perf_counter() - started

    def _forget_old(self) -> None:
        """Unload adapters and delete weight folders beyond keep_versions."""
        while len(self.loaded) > self.options.keep_versions:
            old = self.loaded.pop(0)
            if self.options.weight_sync == "lora":
                self.server.request("POST", "/v1/unload_lora_adapter", json={"lora_name": f"policy-v{old}"})
            shutil.rmtree(os.path.join(self.weights_dir, f"v{old}"), ignore_errors=True)

    # ---- sampling --------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str],
        group_ids: list[str],
        sample_index: list[int],
        seeds: list[int],
        cfg: TokenSampling,
        *,
        step: int = 0,
        policy_version: int = 0,
        metadata: list[dict] | None = None,
        on_batch: Callable[[list[int], list[str]], None] | None = None,
    ) -> TokenTrajectories:
        """One response per row; requests of cfg.batch_size rows are in flight together (up to `concurrency`) and
        `on_batch(rows, responses)` gets each batch (its row indices and responses) in order as soon as it is
        complete."""
        metadata = metadata if metadata is not None else [{} for _ in prompts]
        if not len(prompts) == len(group_ids) == len(sample_index) == len(seeds) == len(metadata):
            raise ValueError("prompts, group_ids, sample_index, seeds and metadata must have one entry per sample")
        if policy_version != self.policy_version:
            raise ValueError(
                f"the vLLM server holds policy version {self.policy_version}, asked to sample version "
                f"{policy_version}: call update_weights({policy_version}) first (a rollout never mixes policies)"
            )
        if any(m.get("images") or m.get("audios") for m in metadata):
            raise ValueError("the vLLM rollout engine takes text prompts only; use rollout.engine=transformers")
        with self._sleep_lock:
            self._wake()
            self._in_flight += 1
        try:
            return self._generate(prompts, group_ids, sample_index, seeds, cfg, policy_version, metadata, on_batch)
        finally:
            with self._sleep_lock:
                self._in_flight -= 1
                if self.options.sleep_for_update and self._in_flight == 0:
                    self._sleep()

    def _generate(self, prompts, group_ids, sample_index, seeds, cfg, policy_version, metadata, on_batch):
        ids = self._prompt_ids(prompts)
        batches = [(s, min(s + cfg.batch_size, len(prompts))) for s in range(0, len(prompts), cfg.batch_size)]
        responses: list[list[int]] = [[] for _ in prompts]
        log_probs: list[list[float]] = [[] for _ in prompts]
        texts: list[str] = [""] * len(prompts)
        with ThreadPoolExecutor(max_workers=self.options.concurrency) as pool:
            futures = [
                [self._submit(pool, ids, prompts, seeds, run, cfg) for run in _runs(prompts, a, b)] for a, b in batches
            ]
            for (start, stop), batch in zip(batches, futures):
                for run, future in batch:
                    for row, (tokens, lps) in zip(range(*run), future.result()):
                        responses[row], log_probs[row] = tokens, lps
                decoded = self.trainer_policy.tokenizer.batch_decode(responses[start:stop], skip_special_tokens=True)
                texts[start:stop] = decoded
                if on_batch is not None:
                    on_batch(list(range(start, stop)), decoded)
        return TokenTrajectories(
            prompts=list(prompts),
            group_ids=list(group_ids),
            sample_index=torch.as_tensor(sample_index, dtype=torch.long),
            seeds=torch.as_tensor(seeds, dtype=torch.long),
            image_paths=[() for _ in prompts],
            prompt_ids=[torch.tensor(ids[p], dtype=torch.long) for p in prompts],
            response_ids=[torch.tensor(r, dtype=torch.long) for r in responses],
            log_probs=[torch.tensor(lp, dtype=torch.float32) for lp in log_probs],
            responses=texts,
            metadata=list(metadata),
            policy_version=policy_version,
        )

    def _prompt_ids(self, prompts: list[str]) -> dict[str, list[int]]:
        """Each distinct prompt's token ids, rendered as the in-process engine renders it (CausalLMPolicy.encode)."""
        out = {}
        for text in dict.fromkeys(prompts):
            encoded = self.trainer_policy.encode([TokenPrompt(text)])
            out[text] = encoded.input_ids[0][encoded.attention_mask[0].bool()].tolist()
        return out

    def _submit(self, pool, ids, prompts, seeds, run, cfg) -> tuple[tuple[int, int], Future]:
        body = {
            "model": self.model_name,
            "prompt": ids[prompts[run[0]]],
            "n": run[1] - run[0],
            "max_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "stop": list(cfg.stop),
            "include_stop_str_in_output": True,
            "seed": int(seeds[run[0]]) % (2**63 - 1),
            "logprobs": 0,
            "return_token_ids": True,
        }
        return run, pool.submit(self._complete, body)

    def _complete(self, body: dict) -> list[tuple[list[int], list[float]]]:
        """(response ids, log-probs) of each choice, in index order."""
        answer = self.server.request("POST", "/v1/completions", json=body).json()
        choices = sorted(answer.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != body["n"]:
            raise VllmServerError(f"asked for {body['n']} completions, got {len(choices)}: {str(answer)[:500]}")
        out = []
        for choice in choices:
            tokens, lps = choice.get("token_ids"), (choice.get("logprobs") or {}).get("token_logprobs")
            if tokens is None or lps is None or len(tokens) != len(lps):
                raise VllmServerError(f"a completion without token_ids and one log-prob per token: {str(choice)[:500]}")
            out.append((list(tokens), [float(x) for x in lps]))
        return out


def _runs(prompts: list[str], start: int, stop: int) -> list[tuple[int, int]]:
    """[start, stop) split into runs of consecutive rows with the same prompt."""
    runs, first = [], start
    for row in range(start + 1, stop + 1):
        if row == stop or prompts[row] != prompts[first]:
            runs.append((first, row))
            first = row
    return runs
