"""How diffrl starts a vLLM server (`VllmServerOptions`, also `diffrl serve-judge`'s) and the `rollout.vllm` options of
an autoregressive run (`VllmRolloutOptions`), with the run config's cross-field checks on them. The server process
itself is diffrl/engines/vllm_server.py."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


@dataclass
class VllmServerOptions:
    """How a vLLM server is started (names as vLLM's own command-line flags where one exists).

    port 0 picks a free loopback port. dtype: "auto" (the model's), "float32" (CPU tests: log-probs that match the
    fp32 trainer), "bfloat16". enforce_eager: no CUDA graphs / torch.compile (faster start, slower decode; sets
    TORCHDYNAMO_DISABLE=1 for the server, so vLLM's remaining compiled helpers run eagerly too).
    kv_cache_gib: VLLM_CPU_KVCACHE_SPACE on CPUs. gpu_memory_utilization: the share of a GPU vLLM takes (GPUs), in
    (0, 1]. enable_lora / max_lora_rank / max_loras: LoRA serving, with adapters loaded at run time
    (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 is set for the server). dev_mode: VLLM_SERVER_DEV_MODE=1 (the
    `/collective_rpc` endpoint full-weight reloads use, and `/sleep` / `/wake_up`): loopback only.
    enable_sleep_mode: `--enable-sleep-mode` (GPUs: `/sleep` moves the weights to host memory and frees the KV cache).
    logprobs_mode: `processed_logprobs` returns the log-probs of the distribution sampled from (after temperature,
    and top-p when < 1), the ones diffrl's rollout records. load_format: "auto" reads the folder's weights, "dummy"
    makes random ones (a config-only folder). extra_args: any other vLLM flags, verbatim, after diffrl's own.
    """

    host: str = "127.0.0.1"  # the address the server binds
    port: int = 0  # 0: a free loopback port
    served_model_name: str = ""  # the name requests use; empty: the model folder's name
    dtype: str = "auto"
    max_model_len: int = 2048  # context length (prompt + response tokens)
    max_num_seqs: int = 64  # sequences a server step batches at most
    max_num_batched_tokens: int = 2048  # tokens a server step batches at most
    enforce_eager: bool = True
    seed: int = 0  # the server's sampling seed
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.5
    enable_sleep_mode: bool = False
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 2
    dev_mode: bool = False
    logprobs_mode: str = "processed_logprobs"
    load_format: str = "auto"
    start_timeout_s: float = 600.0  # seconds the server has to answer GET /health
    request_timeout_s: float = 120.0  # seconds each HTTP call to the server may take, answer included
    max_answer_mib: float = 256.0  # the largest answer read from the server; a larger one is refused unread
    stop_timeout_s: float = 30.0  # seconds between SIGTERM and SIGKILL when stopping it
    extra_args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)  # more environment variables for the server process

    def __post_init__(self) -> None:
        if min(self.start_timeout_s, self.request_timeout_s, self.stop_timeout_s, self.max_answer_mib) <= 0:
            raise ValueError(
                "start_timeout_s, request_timeout_s, stop_timeout_s and max_answer_mib must be > 0; got "
                f"{self.start_timeout_s}, {self.request_timeout_s}, {self.stop_timeout_s}, {self.max_answer_mib}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535] (0: a free one); got {self.port}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}; got {self.dtype!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}; got {self.logprobs_mode!r}")
        if not 0 < self.gpu_memory_utilization <= 1 or not self.kv_cache_gib > 0:
            raise ValueError(
                "gpu_memory_utilization must be in (0, 1] and kv_cache_gib > 0; got "
                f"{self.gpu_memory_utilization}, {self.kv_cache_gib}"
            )
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_lora_rank", "max_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        self.extra_args = tuple(str(a) for a in self.extra_args)


WEIGHT_SYNC = ("lora", "full")


@dataclass
class VllmRolloutOptions(VllmServerOptions):
    """The server's options (VllmServerOptions) plus: weight_sync "lora" (PEFT adapter per version, loaded at run
    time) or "full" (merged weights reloaded in place); concurrency: completion requests in flight; keep_versions:
    adapters / weight folders kept and loaded in the server; sleep_for_update: the server sleeps (level 1: weights to
    host memory, KV cache freed) from the end of each rollout to the next weight load, so the trainer's update has
    the GPU it shares with the server (GPUs only; implies enable_sleep_mode and dev_mode); offload_trainer: the
    trainer's weights and optimizer state go to host memory while the server is awake (from each weight load to the
    end of the rollout), so the server's KV cache can take their memory (implies sleep_for_update);
    weights_in_memory: each version's weights are written to a tmpfs (/dev/shm) when it has room for them, not under
    the run folder."""

    weight_sync: str = "lora"  # lora (the adapter of each version, loaded at run time) | full (merged weights reloaded)
    concurrency: int = 16  # completion requests in flight
    keep_versions: int = 2  # adapters / weight folders kept on disk and loaded in the server
    sleep_for_update: bool = False  # the server sleeps from each rollout's end to the next weight load (GPUs)
    offload_trainer: bool = False  # the trainer's state on the host while the server is awake (GPUs)
    weights_in_memory: bool = True  # each version's weights on a tmpfs (/dev/shm) when it has room, not on disk

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_sync not in WEIGHT_SYNC:
            raise ValueError(f"rollout.vllm.weight_sync must be one of {list(WEIGHT_SYNC)}; got {self.weight_sync!r}")
        if self.concurrency < 1 or self.keep_versions < 1:
            raise ValueError("rollout.vllm.concurrency and keep_versions must be >= 1")
        if self.weight_sync == "full" and self.enable_lora:
            # vLLM 0.24 wraps every linear layer of a LoRA-enabled model (`...gate_up_proj.base_layer.weight`), and
            # reload_weights then finds no parameter for the checkpoint's names (KeyError, measured on Qwen3)
            raise ValueError("rollout.vllm.weight_sync=full needs enable_lora=false (vLLM cannot reload LoRA-wrapped)")
        self.enable_lora = self.weight_sync == "lora"
        self.sleep_for_update = self.sleep_for_update or self.offload_trainer
        self.dev_mode = self.dev_mode or self.weight_sync == "full" or self.sleep_for_update
        self.enable_sleep_mode = self.enable_sleep_mode or self.sleep_for_update


def check_rollout_options(
    options: VllmRolloutOptions, *, lora: bool, lora_rank: int, max_new_tokens: int, random_weights: bool
) -> None:
    """ValueError for `rollout.vllm` options that cannot serve the run's policy (the run config's cross-field checks:
    train.lora / lora_rank, rollout.max_new_tokens, a `random:` model path)."""
    if options.weight_sync == "lora" and not lora:
        raise ValueError(
            "rollout.vllm.weight_sync 'lora' loads the trainer's LoRA adapter, but train.lora is false: a full "
            "fine-tune syncs full weights (rollout.vllm.weight_sync: full)"
        )
    if options.weight_sync == "lora" and options.max_lora_rank < lora_rank:
        raise ValueError(
            f"rollout.vllm.max_lora_rank ({options.max_lora_rank}) must be >= train.lora_rank ({lora_rank}): the "
            "server allocates adapters of at most that rank"
        )
    if options.max_model_len <= max_new_tokens:
        raise ValueError(
            f"rollout.vllm.max_model_len ({options.max_model_len}) must exceed rollout.max_new_tokens "
            f"({max_new_tokens}): it holds the prompt and the response"
        )
    if random_weights and options.load_format != "dummy":
        raise ValueError(
            "model.path is random:<folder> (no weights on disk): the server makes its own random weights with "
            "rollout.vllm.load_format: dummy (its log-probs then differ from the trainer's: rollout_corr/* is no "
            "numerics figure)"
        )
