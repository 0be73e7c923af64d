"""The vLLM rollout engine of the autoregressive family: the TokenRolloutEngine protocol (diffrl/engines/rollout/
tokens.py) served by a vLLM OpenAI-compatible server in its own process and virtualenv (diffrl/engines/vllm_server.py).

Request mapping (one request per run of consecutive rows that share a prompt: text, images and clips):
    prompt            text prompts: `POST /v1/completions` with the prompt's token ids, rendered and tokenized exactly
                      as CausalLMPolicy.encode does
    messages          prompts with images: `POST /v1/chat/completions`, one user turn of the images (base64 data URLs
                      read from the rows' files: the server opens no path and fetches no URL) and the text; the server
                      renders it with the policy's own template (CausalLMPolicy.chat_template, `--chat-template`,
                      content format `openai`) and its processor expands each image's placeholder; the answer's
                      `prompt_token_ids` must equal the trainer's encode ids (else VllmServerError), so the stored
                      prompt_ids and image_paths are what the trainer replays
    n                 the rows in the run; vLLM seeds child k of a request with `seed + k`
                      (vllm/v1/engine/parallel_sampling.py), so the run's draws follow from its first row's seed,
                      as the in-process engine's call is seeded by its first row's (`seeds` are stored as given)
    max_tokens, temperature, top_p, stop, seed     from TokenSampling (temperature 0 = greedy)
    logprobs (0; chat: true with top_logprobs 0), return_token_ids: true, include_stop_str_in_output: true
    model             `policy-v<version>` (the LoRA adapter of that version) or the base model's name
Response: choices[k].token_ids (the response's own ids, its end token included) and
choices[k].logprobs.token_logprobs (chat: logprobs.content[i].logprob); the server runs with
`--logprobs-mode processed_logprobs`, the log-probs of the
distribution sampled from: log softmax(logits / temperature) as diffrl's replay computes them, with top-p < 1 the
renormalised truncated distribution (a gap the old-log-prob recompute and `rollout_corr/*` see), and for greedy
decoding the untempered log-probs. Texts are decoded here with the policy's tokenizer (special tokens skipped), as
the in-process engine does.

Weights: `update_weights(version)` writes the trainer's weights of that version (diffrl/engines/rollout/
vllm_weights.py: a PEFT LoRA folder, or the full merged weights) and loads them into the server before it returns;
`generate(..., policy_version=v)` refuses a version the server does not hold. The folders live in memory (a tmpfs,
`/dev/shm`) when it has room (`weights_in_memory`), else under the run folder. The engine is not the trainer's
module (no `adapter` attribute), so the trainer recomputes old log-probs and reports the rollout/trainer gap.
With `sleep_for_update` (a GPU shared with the trainer) the server sleeps once no rollout is in flight and wakes for
the next weight load or rollout, after the trainer's cached GPU memory is given back; with `offload_trainer` the
trainer's weights and optimizer state go to host memory before each wake and come back after each sleep, so the
server's KV cache can take the memory they held.

Per step (`take_metrics`): vllm/kv_cache_tokens and vllm/kv_cache_sequences (the KV cache's size in tokens, and in
sequences of max_model_len), vllm/running_{max,mean}, vllm/waiting_max and vllm/kv_cache_usage_max (the server's
own gauges, read from its `/metrics` while the rollout runs), rollout/generated_tokens, rollout/tokens_per_s,
timing_s/wake and timing_s/sleep (the server's), timing_s/offload (the trainer's moves both ways; the move to the host
is also inside timing_s/wake, which it splits in two).

A Qwen3-Omni Thinker is served in the whole-model form vLLM 0.24 loads (diffrl/engines/rollout/vllm_folder.py), with
full weight sync only (vLLM's Thinker takes no LoRA adapters); its image rows' log-probs differ from the trainer's
replay by vLLM 0.24's M-RoPE positions of image tokens (one token later than transformers'), which the old-log-prob
recompute and `rollout_corr/*` see. Audio clips are not sent (a ValueError): the vLLM venv has neither of the audio
decoders vLLM's chat API needs (soundfile, PyAV).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import mimetypes
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from diffrl.configs.vllm import VllmRolloutOptions
from diffrl.engines.rollout.tokens import TokenSampling
from diffrl.engines.rollout.vllm_folder import is_thinker, save_thinker, served_folder
from diffrl.engines.rollout.vllm_weights import MEMORY_ROOT, save_full, save_lora
from diffrl.engines.token_trajectories import TokenTrajectories
from diffrl.engines.vllm_server import VllmServer, VllmServerError, parse_prometheus
from diffrl.models.causal_lm.policy import CausalLMPolicy, TokenPrompt

logger = logging.getLogger(__name__)
AUDIO_REFUSAL = (
    "the vLLM rollout engine takes no audio yet (diffrl's vLLM venv has no audio decoder, soundfile or PyAV, for "
    "vLLM's chat API); use rollout.engine=transformers"
)

GAUGE_EVERY_S = 0.5  # how often the server's running/waiting gauges are read during a rollout


class VllmTokenEngine:
    """Samples with a vLLM server of the policy's model folder; takes the trainer's weights by version."""

    def __init__(
        self,
        policy: CausalLMPolicy,
        options: VllmRolloutOptions,
        *,
        weights_dir: str,
        python: str,
        log_dir: str | None = None,
        trainer_offload=None,
    ):
        """weights_dir: where each version's weights are written (a tmpfs folder keeps them off the disk); log_dir:
        where the server's own files go (its log, the folder it serves, a chat template; default weights_dir);
        trainer_offload: the trainer's HostOffload
        (diffrl/engines/train/offload.py), moved to host memory while the server is awake."""
        if not policy.source or not os.path.isfile(os.path.join(policy.source, "config.json")):
            raise ValueError("the vLLM engine serves the policy's model folder: load it with from_pretrained(path)")
        self.thinker = is_thinker(policy.source)
        if self.thinker and options.weight_sync == "lora":
            raise ValueError(
                "rollout.vllm.weight_sync 'lora': vLLM 0.24 serves no LoRA adapters for the Qwen3-Omni Thinker (its "
                "module does not support LoRA); use rollout.vllm.weight_sync: full"
            )
        self.trainer_policy = policy  # the trainer's module: exported on update_weights, never sampled here
        self.weights_dir = weights_dir
        log_dir = log_dir or weights_dir  # the server's own files: its log, the folder it serves, a chat template
        os.makedirs(log_dir, exist_ok=True)
        os.makedirs(weights_dir, exist_ok=True)
        folder = served_folder(policy.source, os.path.join(log_dir, "served"))
        extra = list(options.extra_args)
        self.media = policy.image_processor is not None or policy.feature_extractor is not None
        if self.media:
            # prompts with images go through the chat API: this template renders them as the trainer's encode does
            template = os.path.join(log_dir, "chat_template.jinja")
            with open(template, "w") as f:
                f.write(policy.chat_template())
            extra += ["--chat-template", template, "--chat-template-content-format", "openai"]
        name = options.served_model_name or os.path.basename(os.path.normpath(policy.source))
        self.options = options = dataclasses.replace(options, extra_args=tuple(extra), served_model_name=name)
        self.server = VllmServer(folder, options, python=python, log_path=os.path.join(log_dir, "vllm-server.log"))
        self.trainer_offload = trainer_offload
        self.policy_version = 0
        self.model_name = ""  # set by start(): the base model (version 0) or policy-v<version>
        self.loaded: list[int] = []
        self.last_sync_s = 0.0
        self.last_wake_s = 0.0  # of the last update_weights: the wake (and trainer offload) it waited for
        self.asleep = False
        self.kv_cache_tokens = 0
        self._in_flight = 0  # rollouts running now (the server sleeps only when none is)
        self._sleep_lock = threading.Lock()
        self._stats: dict[str, list[float]] = {}

    def start(self) -> VllmTokenEngine:
        """Start the server (the trainer's state on the host meanwhile, with offload_trainer: vLLM sizes its KV cache
        from the memory free when it starts) and read its KV cache size; with sleep_for_update it then sleeps until
        the first rollout or weight load, and the trainer's state comes back."""
        if self.trainer_offload is not None:
            self._record("timing_s/offload", self.trainer_offload.to_host())
        try:
            self.server.start()
        finally:
            if self.trainer_offload is not None and not self.options.sleep_for_update:
                self._record("timing_s/offload", self.trainer_offload.to_device())
        self.model_name = self.server.name
        self.kv_cache_tokens = self._read_kv_cache_tokens()
        if self.options.sleep_for_update:
            with self._sleep_lock:
                self._sleep()
        return self

    def close(self) -> None:
        self.server.stop()
        if self.weights_dir.startswith(MEMORY_ROOT):
            shutil.rmtree(self.weights_dir, ignore_errors=True)  # memory is no place to leave them

    # ---- sleep (sleep_for_update: the server's GPU memory is the trainer's during the update) -----------------
    def _wake(self) -> float:
        """Wake the server if it sleeps; returns the seconds it took. With offload_trainer: the server's weights come
        back first (its host copy is freed), then the trainer's state goes to the host, then the server's KV cache
        is allocated in the memory the trainer left: host memory holds one copy of the weights at a time, the
        device never both with a KV cache. The trainer's cached GPU memory is given back before each allocation."""
        if not self.asleep:
            return 0.0
        started = time.perf_counter()
        timeout_s = max(600.0, self.options.request_timeout_s)
        if self.trainer_offload is not None:
            self._empty_cache()
            self.server.request("POST", "/wake_up?tags=weights", timeout_s=timeout_s)
            self._record("timing_s/offload", self.trainer_offload.to_host())
            self._empty_cache()
            self.server.request("POST", "/wake_up?tags=kv_cache", timeout_s=timeout_s)
        else:
            self._empty_cache()
            self.server.request("POST", "/wake_up", timeout_s=timeout_s)
        self.asleep = False
        seconds = time.perf_counter() - started
        self._record("timing_s/wake", seconds)
        return seconds

    @staticmethod
    def _empty_cache() -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _sleep(self) -> None:
        """Level 1: the weights to host memory, the KV cache freed (the base weights never change under LoRA); then
        the trainer's state back on its device (also when the server could not sleep: the update needs it)."""
        started = time.perf_counter()
        try:
            self.server.request("POST", "/sleep?level=1", timeout_s=max(600.0, self.options.request_timeout_s))
            self.asleep = True
            self._record("timing_s/sleep", time.perf_counter() - started)
        finally:
            if self.trainer_offload is not None:
                self._record("timing_s/offload", self.trainer_offload.to_device())

    # ---- per-step metrics ------------------------------------------------------------------------------------
    def _record(self, name: str, value: float) -> None:
        self._stats.setdefault(name, []).append(float(value))

    def take_metrics(self) -> dict[str, float]:
        """What the engine measured since the last call (module docstring), then forgotten."""
        stats, self._stats = self._stats, {}
        out = {name: sum(values) for name, values in stats.items() if name.startswith(("timing_s/", "rollout/"))}
        for gauge in ("running", "waiting", "kv_cache_usage"):
            values = stats.get(f"vllm/{gauge}", [])
            if values:
                out[f"vllm/{gauge}_max"] = max(values)
                if gauge == "running":
                    out["vllm/running_mean"] = sum(values) / len(values)
        seconds, tokens = out.pop("rollout/seconds", 0.0), out.get("rollout/generated_tokens", 0.0)
        if seconds > 0 and tokens:
            out["rollout/tokens_per_s"] = tokens / seconds
        if self.kv_cache_tokens:
            out["vllm/kv_cache_tokens"] = float(self.kv_cache_tokens)
            out["vllm/kv_cache_sequences"] = float(self.kv_cache_tokens // self.options.max_model_len)
        return out

    def _server_gauges(self) -> dict[tuple[str, tuple], float]:
        """The server's Prometheus samples now; {} when /metrics cannot be read (the rollout goes on without)."""
        try:
            return parse_prometheus(self.server.request("GET", "/metrics", timeout_s=10.0).text)
        except VllmServerError as e:
            logger.debug("vLLM /metrics unreadable: %s", e)
            return {}

    def _poll_gauges(self, done: threading.Event) -> None:
        """Read the server's gauges every GAUGE_EVERY_S until `done` (beside the reading at each answer)."""
        while not done.wait(GAUGE_EVERY_S):
            self._sample_gauges()

    def _read_kv_cache_tokens(self) -> int:
        """num_gpu_blocks x block_size of the server's cache config (its `vllm:cache_config_info` labels); 0 when
        the server does not say."""
        for (name, labels), _ in self._server_gauges().items():
            if name == "vllm:cache_config_info":
                info = dict(labels)
                try:
                    return int(info["num_gpu_blocks"]) * int(info["block_size"])
                except (KeyError, ValueError):
                    return 0
        return 0

    def _sample_gauges(self) -> None:
        """One reading of the server's running / waiting sequences and KV cache use (summed over its engines)."""
        totals = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0, "vllm:kv_cache_usage_perc": 0.0}
        found = False
        for (name, _), value in self._server_gauges().items():
            if name in totals:
                totals[name] += value
                found = True
        if found:
            self._record("vllm/running", totals["vllm:num_requests_running"])
            self._record("vllm/waiting", totals["vllm:num_requests_waiting"])
            self._record("vllm/kv_cache_usage", totals["vllm:kv_cache_usage_perc"])

    # ---- weights ---------------------------------------------------------------------------------------------
    def update_weights(self, version: int) -> None:
        """Load the trainer's current weights into the server as policy `version` (blocking). They are written first,
        while the trainer's state is on its device, then the server wakes (offloading the trainer) and loads them.
        last_sync_s: the seconds of the whole call less last_wake_s, the wake it waited for."""
        started = time.perf_counter()
        folder = os.path.join(self.weights_dir, f"v{version}")
        model = self.trainer_policy.model
        if self.options.weight_sync == "lora":
            save_lora(model, folder, self.trainer_policy.source)
        elif self.thinker:
            save_thinker(model, folder)
        else:
            save_full(model, folder, self.trainer_policy.source)
        with self._sleep_lock:
            self.last_wake_s = self._wake()
        if self.options.weight_sync == "lora":
            name = f"policy-v{version}"
            body = {"lora_name": name, "lora_path": os.path.abspath(folder)}
            self.server.request("POST", "/v1/load_lora_adapter", json=body)
            self.model_name = name
        else:
            body = {"method": "reload_weights", "kwargs": {"weights_path": os.path.abspath(folder)}}
            self.server.request("POST", "/collective_rpc", json=body)
            if self.media:
                # the reload empties the workers' encoder outputs, not the scheduler's record of them (the next image
                # request then fails, "Encoder cache miss"), and those of the old towers are stale anyway
                self.server.request("POST", "/reset_encoder_cache")
            self.model_name = self.server.name  # the reloaded base weights; no adapter
        self.policy_version = version
        self.loaded.append(version)
        self._forget_old()
        self.last_sync_s = time.perf_counter() - started - self.last_wake_s

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
        if any(m.get("audios") for m in metadata):
            raise ValueError(AUDIO_REFUSAL)
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
        started, done = time.perf_counter(), threading.Event()
        poller = threading.Thread(target=self._poll_gauges, args=(done,), name="vllm-gauges", daemon=True)
        poller.start()
        try:
            traj = self._sample(prompts, group_ids, sample_index, seeds, cfg, policy_version, metadata, on_batch)
        finally:
            done.set()
            poller.join(timeout=15.0)
        self._record("rollout/seconds", time.perf_counter() - started)
        self._record("rollout/generated_tokens", float(sum(len(r) for r in traj.response_ids)))
        return traj

    def _sample(self, prompts, group_ids, sample_index, seeds, cfg, policy_version, metadata, on_batch):
        rows = [
            TokenPrompt(p, tuple(m.get("images") or ()), tuple(m.get("audios") or ()))
            for p, m in zip(prompts, metadata)
        ]
        ids = self._prompt_ids(rows)
        batches = [(s, min(s + cfg.batch_size, len(rows))) for s in range(0, len(rows), cfg.batch_size)]
        responses: list[list[int]] = [[] for _ in rows]
        log_probs: list[list[float]] = [[] for _ in rows]
        texts: list[str] = [""] * len(rows)
        with ThreadPoolExecutor(max_workers=self.options.concurrency) as pool:
            futures = [
                [self._submit(pool, ids, rows, seeds, run, cfg) for run in _runs(rows, a, b)] for a, b in batches
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
            image_paths=[r.images for r in rows],
            prompt_ids=[torch.tensor(ids[r], dtype=torch.long) for r in rows],
            response_ids=[torch.tensor(r, dtype=torch.long) for r in responses],
            log_probs=[torch.tensor(lp, dtype=torch.float32) for lp in log_probs],
            responses=texts,
            metadata=list(metadata),
            policy_version=policy_version,
            audio_paths=[r.audios for r in rows],
        )

    def _prompt_ids(self, rows: list[TokenPrompt]) -> dict[TokenPrompt, list[int]]:
        """Each distinct prompt's token ids, rendered as the in-process engine renders it (CausalLMPolicy.encode: an
        image's tokens expanded as its processor gives them)."""
        out = {}
        for prompt in dict.fromkeys(rows):
            encoded = self.trainer_policy.encode([prompt])
            out[prompt] = encoded.input_ids[0][encoded.attention_mask[0].bool()].tolist()
        return out

    def _submit(self, pool, ids, rows, seeds, run, cfg) -> tuple[tuple[int, int], Future]:
        prompt = rows[run[0]]
        body = {
            "model": self.model_name,
            "n": run[1] - run[0],
            "max_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "stop": list(cfg.stop),
            "include_stop_str_in_output": True,
            "seed": int(seeds[run[0]]) % (2**63 - 1),
            "return_token_ids": True,
        }
        if not prompt.images:
            body.update(prompt=ids[prompt], logprobs=0)
            return run, pool.submit(self._complete, "/v1/completions", body, None)
        # the chat API is vLLM's only one that takes images with the prompt; the trainer's template renders the turn
        # (chat_template above) and the answer's prompt_token_ids must be the trainer's prompt ids
        content = [{"type": "image_url", "image_url": {"url": _data_url(path)}} for path in prompt.images]
        body.update(
            messages=[{"role": "user", "content": [*content, {"type": "text", "text": prompt.text}]}],
            logprobs=True,
            top_logprobs=0,
        )
        return run, pool.submit(self._complete, "/v1/chat/completions", body, ids[prompt])

    def _complete(self, path: str, body: dict, prompt_ids: list[int] | None) -> list[tuple[list[int], list[float]]]:
        """(response ids, log-probs) of each choice, in index order; for a chat request, a VllmServerError unless
        the server's prompt ids are `prompt_ids` (what the trainer replays)."""
        answer = self.server.request("POST", path, json=body).json()
        self._sample_gauges()  # the other requests in flight are running now: how many sequences the server holds
        if prompt_ids is not None and answer.get("prompt_token_ids") != prompt_ids:
            raise VllmServerError(
                f"vLLM's prompt ids differ from the trainer's (the trainer would replay another prompt):\n"
                f"vLLM    {answer.get('prompt_token_ids')}\ntrainer {prompt_ids}"
            )
        choices = sorted(answer.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != body["n"]:
            raise VllmServerError(f"asked for {body['n']} completions, got {len(choices)}: {str(answer)[:500]}")
        out = []
        for choice in choices:
            tokens, lps = choice.get("token_ids"), _token_log_probs(choice.get("logprobs") or {})
            if tokens is None or lps is None or len(tokens) != len(lps):
                raise VllmServerError(f"a completion without token_ids and one log-prob per token: {str(choice)[:500]}")
            out.append((list(tokens), lps))
        return out


def _token_log_probs(logprobs: dict) -> list[float] | None:
    """The sampled tokens' log-probs of a choice: `token_logprobs` (completions) or `content[i].logprob` (chat)."""
    if "token_logprobs" in logprobs:
        return [float(x) for x in logprobs["token_logprobs"]]
    if "content" in logprobs and logprobs["content"] is not None:
        return [float(entry["logprob"]) for entry in logprobs["content"]]
    return None


def _data_url(path: str) -> str:
    """The image file as a base64 data URL: the server reads no file and fetches no URL a dataset row names."""
    kind = mimetypes.guess_type(path)[0] or "application/octet-stream"
    if not kind.startswith("image/"):
        raise ValueError(f"{path}: not an image file by its name ({kind}); images are sent as image/* data URLs")
    with open(path, "rb") as f:
        return f"data:{kind};base64,{base64.b64encode(f.read()).decode('ascii')}"


def _runs(rows: list[TokenPrompt], start: int, stop: int) -> list[tuple[int, int]]:
    """[start, stop) split into runs of consecutive rows with the same prompt (text, images and clips)."""
    runs, first = [], start
    for row in range(start + 1, stop + 1):
        if row == stop or rows[row] != rows[first]:
            runs.append((first, row))
            first = row
    return runs
