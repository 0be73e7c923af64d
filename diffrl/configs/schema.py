"""The typed schema one experiment YAML loads into: one dataclass per component, nested in one run
config. Components owned by an engine are that engine's own dataclass (TrainConfig, RewardConfig);
the algorithm is a named bundle from algorithms.catalog with explicit overrides.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from diffrl.algorithms.catalog import Algorithm, get_algorithm
from diffrl.configs.guard import GuardConfig
from diffrl.configs.loader import ConfigError, apply_overrides, build, coerce, parse_override, to_dict, yaml_problem
from diffrl.configs.reward import RewardComponent, RewardConfig
from diffrl.configs.rollout import OdeShortcut, RolloutWeights, SamplingConfig, TokenSampling
from diffrl.configs.train import TrainConfig
from diffrl.configs.vllm import VllmRolloutOptions, check_rollout_options
from diffrl.models.base import ATTENTION_BACKENDS
from diffrl.models.kind import RANDOM, data_kind, model_kind

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))
ROLLOUT_ENGINES = ("transformers", "vllm")
LOGGERS = ("mlflow", "tensorboard", "wandb")
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # what a logger needs beyond diffrl's dependencies


@dataclass
class ModelConfig:
    # Fields fixed on resume (diffrl/configs/changes.py): "data" ones give the stored rows
    # their meaning; "weights" ones also describe the trained weights, which run.init_from must match.
    FIXED_ON_RESUME: ClassVar[dict[str, str]] = {"path": "weights", "tiny_seed": "weights", "condition_area": "data"}

    path: str = "tiny:sd3"  # a model folder, reference:<name> (shipped), tiny:<arch> (built offline), or a Hub id
    dtype: str = "auto"  # auto (bf16 on cuda, fp32 on cpu) | fp32 | bf16 | fp16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    tiny_seed: int = 0  # seed of the random weights of a tiny:<arch> model
    attention: str = (
        "default"  # SDPA backend first tried on CUDA: default (PyTorch's) | cudnn | flash | efficient | math
    )
    compile: bool = (
        False  # torch.compile the denoiser's transformer blocks (faster sampling and training after a compile)
    )
    tf32: bool = True  # CUDA fp32 matmuls (e.g. fp32 LoRA branches over a bf16 base) on TF32 tensor cores
    # the text encoders wait in host memory and visit the GPU only to encode new prompts (their GPU memory goes to
    # the denoiser; each visit copies them over)
    offload_text_encoder: bool = False
    # editing models only: the pixel area input images are resized to (null: the model's own; Qwen-Image-Edit 1024²)
    condition_area: int | None = None
    # the teacher an on-policy distillation algorithm (diffusion_opd) distils: any name `path` takes, same architecture
    teacher: str | None = None
    # a diffusers LoRA .safetensors file fused into the teacher (`diffrl export` writes one); a relative path that is
    # not there names the file shipped with diffrl
    teacher_lora: str | None = None
    # the architecture's own sampling knobs, e.g. {guidance_scale_2: 3.0} (Wan2.2's low-noise expert) or
    # {audio_guidance_scale: 7.0, frame_rate: 24} (LTX-2); docs/models.md lists them per model
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.condition_area is not None and self.condition_area < 1:
            raise ValueError(f"model.condition_area must be a positive pixel count or null; got {self.condition_area}")
        if self.dtype not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"model.dtype must be one of auto, fp32, bf16, fp16; got {self.dtype!r}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"model.attention must be one of {', '.join(ATTENTION_BACKENDS)}; got {self.attention!r}")

    def device_and_dtype(self) -> tuple[torch.device, torch.dtype]:
        """The device ("auto": CUDA when available) and dtype ("auto": bf16 on CUDA, fp32 elsewhere)."""
        device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device
        )
        if self.dtype == "auto":
            return device, torch.bfloat16 if device.type == "cuda" else torch.float32
        return device, {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]


@dataclass
class RolloutConfig:
    """Sampling settings; the stochastic parts (sde_type, noise_level, window) come from the algorithm. An
    autoregressive model (an algorithm on tokens) reads group_size, prompts_per_step, chunk_size, batch_size and the
    token fields (max_new_tokens, temperature, top_p, stop); a diffusion model the others."""

    # how a sample is drawn and how a step's samples are grouped and chunked: the stored rows of a step mean this
    FIXED_ON_RESUME: ClassVar[dict[str, str]] = dict.fromkeys(
        "num_inference_steps height width num_frames duration guidance_scale negative_prompt max_sequence_length"
        " group_size prompts_per_step chunk_size same_noise_per_group ode_tail ode_head max_new_tokens temperature"
        " top_p stop".split(),
        "data",
    )

    num_inference_steps: int = 10  # denoising steps of a sample
    height: int = 512  # image height in pixels
    width: int = 512  # image width in pixels
    num_frames: int = 1  # video frames (video models; 1 for images)
    duration: float | None = None  # seconds of audio (audio-only models); null: the model's default
    guidance_scale: float | None = None  # the model's guidance knob (CFG or distilled); null: the adapter's default
    negative_prompt: str = ""  # used where the adapter needs a negative prompt at that guidance
    max_sequence_length: int | None = None  # text tokens of the prompt at most; null: the model's default
    batch_size: int = 8  # samples per transformer forward
    group_size: int = 16  # samples per prompt
    prompts_per_step: int = 32  # prompts per RL step (x group_size images)
    chunk_size: int = 64  # samples per generate chunk (scored while the next chunk generates)
    same_noise_per_group: bool = False  # a prompt's group shares its initial noise (DanceGRPO)
    # off by default: the deterministic steps after every window of a chunk has ended (ode_tail) or before the first
    # one starts (ode_head; changes the window's input) on fewer evaluations: {solver: dpm2m, evaluations: 2}
    ode_tail: OdeShortcut = field(default_factory=OdeShortcut)
    ode_head: OdeShortcut = field(
        default_factory=OdeShortcut
    )  # the same, for the deterministic steps before the first window
    # off by default: forward batches of the rows sorted by window start, so that a batch's loop (and its ode_tail)
    # ends at its own latest window end; each sample's math is unchanged (rounding aside)
    sort_by_window: bool = False
    # off by default: the rollout's forwards on a merged-LoRA or FP8 copy of the weights, for every forward or only
    # those without an in-window sample: {kind: lora | merged | fp8, steps: all | deterministic}
    weights: RolloutWeights = field(default_factory=RolloutWeights)
    # autoregressive policies: "transformers" samples in-process with the trainer's module; "vllm" with a vLLM server
    # started from diffrl's vLLM venv (rollout.vllm: its options and how weights reach it; docs/operations.md)
    engine: str = "transformers"
    vllm: VllmRolloutOptions = field(default_factory=VllmRolloutOptions)
    # autoregressive policies: how responses are sampled (validation decodes greedily)
    max_new_tokens: int = 32  # response tokens at most
    temperature: float = 1.0  # sampling temperature (validation decodes greedily)
    top_p: float = 1.0  # nucleus sampling, in (0, 1]
    stop: tuple[str, ...] = ()  # strings that end a response (besides the model's end token)

    def __post_init__(self) -> None:
        if self.engine not in ROLLOUT_ENGINES:
            raise ValueError(f"rollout.engine must be one of {list(ROLLOUT_ENGINES)}; got {self.engine!r}")
        for name in ("group_size", "prompts_per_step", "chunk_size", "batch_size", "num_inference_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_size % self.group_size and self.group_size % self.chunk_size:
            raise ValueError(
                f"rollout.chunk_size ({self.chunk_size}) must be a multiple or a divisor of "
                f"rollout.group_size ({self.group_size})"
            )
        if self.same_noise_per_group and self.chunk_size % self.group_size:
            # the engine shares the noise of a group's first sample in a call: keep groups whole
            raise ValueError(
                f"rollout.same_noise_per_group needs whole groups per chunk: rollout.chunk_size "
                f"({self.chunk_size}) must be a multiple of rollout.group_size ({self.group_size})"
            )
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"rollout.duration must be > 0 seconds or null (the model's default); got {self.duration}")
        if self.max_new_tokens < 1 or not self.temperature > 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                "rollout.max_new_tokens must be >= 1, rollout.temperature > 0 and rollout.top_p in (0, 1]; got "
                f"{self.max_new_tokens}, {self.temperature}, {self.top_p}"
            )

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def token_sampling(self) -> TokenSampling:
        """The token rollout's sampling settings."""
        return TokenSampling(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=tuple(self.stop),
            batch_size=self.batch_size,
        )

    def sampling(self, algorithm: Algorithm) -> SamplingConfig:
        """The engine's sampling config: these settings plus the algorithm's stochastic parts."""
        return SamplingConfig(
            num_inference_steps=self.num_inference_steps,
            height=self.height,
            width=self.width,
            num_frames=self.num_frames,
            duration=self.duration,
            guidance_scale=self.guidance_scale,
            negative_prompt=self.negative_prompt,
            noise_level=algorithm.noise_level,
            sde_type=algorithm.sde_type,
            window=algorithm.window,
            max_sequence_length=self.max_sequence_length,
            batch_size=self.batch_size,
            same_noise_per_group=self.same_noise_per_group,
            ode_tail=self.ode_tail,
            ode_head=self.ode_head,
            sort_by_window=self.sort_by_window,
            weights=self.weights,
        )


@dataclass
class DataConfig:
    # the prompts of step k are drawn from these: stored rows of a step hold them
    FIXED_ON_RESUME: ClassVar[dict[str, str]] = {"train": "data", "num_generated": "data", "sample_source": "data"}

    train: str = "generator:ocr"  # parquet / jsonl / txt path, or generator:ocr | compositional | shapes
    val: str | None = None  # same forms; None = a held-out slice of the train generator
    num_generated: int = 1000  # prompts a generator makes
    num_val_prompts: int = 8  # validation prompts: the first k of `val`
    # images per validation prompt (GenEval samples 4): more images average out the sampling noise of
    # val/accuracy; copy c of prompt i uses seed run.seed + 7 + i + c * num_val_prompts
    val_samples_per_prompt: int = 1
    storage_options: dict = field(default_factory=dict)  # fsspec options for reading train / val files
    # online: train on the run's own rollouts; offline: train from the dataset in `train`: a preference parquet
    # (prompt, chosen, rejected; algorithm dpo), VAE-encoded once (diffrl/engines/store/preference.py), or
    # (prompt, image) rows of a parquet or Lance table (algorithm sft; diffrl/engines/store/image_dataset.py)
    sample_source: str = "online"

    def __post_init__(self) -> None:
        if self.val_samples_per_prompt < 1:
            raise ValueError(f"data.val_samples_per_prompt must be >= 1, got {self.val_samples_per_prompt}")
        if self.sample_source not in ("online", "offline"):
            raise ValueError(f"data.sample_source must be 'online' or 'offline', got {self.sample_source!r}")


@dataclass
class AsyncConfig:
    """Asynchronous off-policy training (docs/training.md, "Asynchronous training")."""

    # a sample of policy version v trains at version <= v + max_staleness: 0 is the synchronous step; 1 lets the next
    # step's rollout run beside the update, on a copy of the LoRA adapter that each weight sync refreshes
    max_staleness: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (an integer), got {self.max_staleness!r}")

    @property
    def enabled(self) -> bool:
        """Whether samples of an older policy version may be trained (max_staleness > 0)."""
        return self.max_staleness > 0


@dataclass
class RunConfig:
    # seed: the prompt order and the noise of every step; experiment: where the run a resume continues is filed
    FIXED_ON_RESUME: ClassVar[dict[str, str]] = {"seed": "data", "experiment": "data"}

    name: str = "quickstart"  # the run's folder under root, the name it is logged under, its resume key
    experiment: str = "diffrl"  # the experiment the run is filed under (MLflow experiment, W&B project)
    root: str = "runs"  # runs/<name>/ holds trajectories.lance, checkpoints/, ...
    steps: int = 10  # RL steps (rollout, score, update) of the run
    seed: int = 0  # seeds the prompt order, the rollout noise and the validation samples
    checkpoint_every: int = 5  # kept checkpoints (a resume point is written after every step)
    validate_every: int = 0  # 0 = only before the first and after the last step
    log_images: int = 4  # rollout images (audio clips, for a model that makes audio) logged per step
    # where metrics, images and the config go, the same names in each: mlflow (mlflow.db), tensorboard (event files in
    # runs/<name>/tensorboard), wandb (offline files in runs/<name>/wandb); [] logs nowhere (docs/training.md)
    loggers: tuple[str, ...] = ("mlflow",)
    # latents (the bulk of a step, fp32) of the last k committed steps stay on disk, older ones are dropped
    # (rows, rewards, images always stay); -1 keeps every step's. Resume needs only the step in flight.
    keep_latents_steps: int = 2
    compact_every: int = 10  # every k steps merge the run's Lance fragments (reads slow with their count); 0 = never
    # record where the time goes: runs/<name>/trace/<pid>.json, a timeline of every thread for ui.perfetto.dev
    trace: bool = False
    # options of a remote root for Lance and fsspec; s3: Lance's keys (aws_endpoint, ...), translated for s3fs
    storage_options: dict = field(default_factory=dict)
    # a new run starts from the trained weights of another run's latest good checkpoint (a run name under root, or a
    # run folder), with a fresh optimizer at step 0; read only while the run has no checkpoint of its own
    init_from: str | None = None
    # YAML `async`: the rollout may run ahead of the update by a bounded number of policy versions
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    # image statistics of each step, probe prompts every k steps, and an early stop when they drift (docs/training.md)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        if self.init_from == "":
            raise ValueError("run.init_from must be a run name, a run folder or null; got ''")
        if self.name in ("", ".", "..") or any(c in self.name for c in "/\\\0"):
            # the run's folder is root/name: "." or ".." would put the run into root itself or above it
            raise ValueError(
                f"run.name must be a plain folder name (not '.' or '..', no '/' or '\\'), got {self.name!r}"
            )
        if self.steps < 1:
            raise ValueError(f"run.steps must be >= 1, got {self.steps}")
        if not 0 <= self.seed < 2**32:  # numpy's seeds are non-negative; 32 bits leave room for the per-sample offsets
            raise ValueError(f"run.seed must be an integer in [0, 2**32), got {self.seed}")
        unknown = [name for name in self.loggers if name not in LOGGERS]
        if unknown or len(set(self.loggers)) != len(self.loggers):
            raise ValueError(
                f"run.loggers must list each of {', '.join(LOGGERS)} at most once; got {list(self.loggers)}"
            )
        if self.compact_every < 0:
            raise ValueError(f"run.compact_every must be >= 0 (0 = never), got {self.compact_every}")
        if self.keep_latents_steps < -1:
            raise ValueError(
                f"run.keep_latents_steps must be >= 0 (steps whose latents stay) or -1 (keep every "
                f"step's), got {self.keep_latents_steps}"
            )


@dataclass
class ClusterConfig:
    """Where the engines live (docs/operations.md section 5).

    `local`: every engine in the `diffrl train` process. `ray`: `gpus: N` engine replicas, one GPU each, as Ray actors
    on one machine or many; each replica runs the local pipeline on its share of the step's chunks (rollout, rewards
    streamed while it samples, background writes, the next step's rollout run ahead) and the replicas' trainers are one
    FSDP2 group.
    """

    # Keys of earlier placements, refused with what replaces them (diffrl/configs/loader.py).
    RETIRED: ClassVar[dict[str, str]] = {
        "placement": "every GPU is an engine replica that samples and trains (cluster.gpus: N); there is no split "
        "rollout/trainer placement",
        "trainers": "the trainer is sharded over the engine replicas: set cluster.gpus: N",
        "reward_actors": "each engine replica scores its own chunks while it samples, as the local run does; a reward "
        "model on its own GPU runs as a vLLM judge server (docs/rewards.md)",
        "reward_gpus": "each engine replica scores its own chunks while it samples, as the local run does; a reward "
        "model on its own GPU runs as a vLLM judge server (docs/rewards.md)",
    }

    mode: str = "local"  # local | ray
    address: str | None = None  # ray cluster address (ray mode)
    actor_timeout_s: float = 600.0  # how long the driver waits for one actor call before it fails the stage
    gpus: int | str = 1  # engine replicas, one per GPU (ray mode): N, or "auto" (every GPU Ray sees)
    # CPU threads torch uses in each actor: N, or "auto" (the node's CPUs over the run's actors). Ray alone starts
    # every actor with OMP_NUM_THREADS=1: one thread for the CPU-side work (rewards, image conversion, CPU models).
    actor_threads: int | str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in ("local", "ray"):
            raise ValueError(f"cluster.mode must be 'local' or 'ray', got {self.mode!r}")
        if self.gpus != "auto" and (isinstance(self.gpus, (str, bool)) or self.gpus < 1):
            raise ValueError(f"cluster.gpus must be a number of GPUs >= 1 or 'auto', got {self.gpus!r}")
        if self.gpus != 1 and self.mode != "ray":
            raise ValueError(
                f"cluster.gpus: {self.gpus} runs engine replicas as Ray actors, which needs cluster.mode: ray "
                f"(got {self.mode!r})"
            )
        if self.actor_threads != "auto" and (
            isinstance(self.actor_threads, (str, bool))
            or int(self.actor_threads) != self.actor_threads
            or self.actor_threads < 1
        ):
            raise ValueError(
                f"cluster.actor_threads must be a number of threads >= 1 or 'auto', got {self.actor_threads!r}"
            )

    @property
    def replicas(self) -> int:
        """Engine replicas of the run (1 unless `gpus` asks for more); `gpus: auto` is resolved when Ray is joined."""
        if self.gpus == "auto":
            raise ValueError("cluster.gpus is 'auto': the number of replicas is known once the Ray cluster is joined")
        return int(self.gpus)

    @property
    def data_parallel(self) -> int:
        """Processes the trainer is sharded over: the replicas (1 while `gpus: auto` is not resolved yet)."""
        return 1 if self.gpus == "auto" else int(self.gpus)


@dataclass
class ExperimentConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: Algorithm = field(default_factory=lambda: get_algorithm("flow_grpo"))
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(
        default_factory=lambda: RewardConfig(components=[RewardComponent(name="jpeg_compressibility")])
    )
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        import torch

        from diffrl.algorithms.windows import sample_windows

        for name, value in _numbers(self, ""):  # inf or NaN anywhere (train.lr=inf made every weight NaN)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")

        check_model_kind(self)
        try:  # the algorithm's window must fit the number of denoising steps: fail now, not mid-run
            if self.algorithm.needs.data != "tokens":
                sample_windows(
                    self.algorithm.window, self.rollout.num_inference_steps, torch.zeros(1, dtype=torch.long), 0
                )
        except ValueError as e:
            raise ValueError(
                f"algorithm.window {self.algorithm.window.kind!r} does not fit "
                f"rollout.num_inference_steps={self.rollout.num_inference_steps}: {e}"
            ) from None
        online_rewards = self.data.sample_source == "online" and not self.algorithm.needs.supervised  # SFT: none
        if self.rollout.group_size < 2 and online_rewards:
            # every bundle's advantages are group-relative (r - the mean of its prompt's group): with one sample a
            # prompt, each is exactly 0 and the rewards teach nothing; pair algorithms have no pair to form
            why = (
                "trains on (chosen, rejected) pairs of one prompt's samples, and one sample makes no pair"
                if self.algorithm.needs.pairs
                else "normalises each reward within its prompt's group, so with one sample every advantage is 0 "
                "and the run would learn nothing from its rewards"
            )
            raise ValueError(f"rollout.group_size=1: algorithm {self.algorithm.name!r} {why}; use 2 or more")
        if self.algorithm.needs.teacher != (self.model.teacher is not None):
            raise ValueError(
                f"model.teacher must be set exactly when the algorithm distils a teacher (diffusion_opd); algorithm "
                f"{self.algorithm.name!r}, model.teacher {self.model.teacher!r}"
            )
        if self.model.teacher_lora is not None and self.model.teacher is None:
            raise ValueError("model.teacher_lora is fused into model.teacher: set model.teacher too")
        if self.algorithm.needs.reward_gate:  # the gate ranks reward components: they must exist, fail now
            self.algorithm.reward_gate({c.name: torch.zeros(1) for c in self.reward.components})
        check_final_samples(self)
        check_data_parallel(self)
        check_async(self)
        if self.algorithm.needs.data == "tokens" and self.rollout.engine == "vllm":
            check_rollout_options(
                self.rollout.vllm,
                lora=self.train.lora,
                lora_rank=self.train.lora_rank,
                max_new_tokens=self.rollout.max_new_tokens,
                random_weights=self.model.path.startswith(RANDOM),
            )
        if self.train.mini_batch_prompts > self.rollout.prompts_per_step:
            raise ValueError(
                f"train.mini_batch_prompts ({self.train.mini_batch_prompts}) exceeds "
                f"rollout.prompts_per_step ({self.rollout.prompts_per_step})"
            )

    @property
    def sampling(self) -> SamplingConfig | TokenSampling:
        """What the rollout samples with: the algorithm's SDE settings for a diffusion model, the token settings for
        an algorithm on tokens."""
        if self.algorithm.needs.data == "tokens":
            return self.rollout.token_sampling()
        return self.rollout.sampling(self.algorithm)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.run.root, self.run.name)

    @property
    def local_dir(self) -> str:
        """The run's folder on the driver's own disk, for what only its process reads (the run lock, Prefect's stage
        results, the trace): run_dir, or runs/<name> under the working directory when run.root is an fsspec URI."""
        return os.path.join("runs", self.run.name) if "://" in self.run.root else self.run_dir


def check_logger_packages(loggers: tuple[str, ...] | list[str]) -> None:
    """ValueError, one line, when a logger of run.loggers needs a package that is not installed (checked without
    importing it, so `diffrl train` says so before any work)."""
    import importlib.util

    for name in loggers:
        package = LOGGER_PACKAGES.get(name)
        try:
            found = package is None or importlib.util.find_spec(package) is not None
        except ValueError:  # sys.modules holds None for it: its import is blocked
            found = False
        if not found:
            raise ValueError(
                f"run.loggers: {name} needs the {package} package, which is not installed: pip install 'diffrl[{name}]'"
            )


def check_model_kind(cfg: ExperimentConfig) -> None:
    """ValueError when the algorithm trains the other model family than model.path is (known without loading it:
    tiny:, reference: and local folders; a Hub id is checked when it loads), naming the algorithms that fit."""
    from diffrl.algorithms.catalog import names_for

    kind, wanted = model_kind(cfg.model.path), data_kind(cfg.algorithm.needs.data)
    if kind is not None and kind != wanted:
        raise ValueError(
            f"algorithm {cfg.algorithm.name!r} trains {wanted} models, but model.path {cfg.model.path!r} is {kind}; "
            f"for it choose algorithm one of {names_for(kind == 'autoregressive')}"
        )


def check_data_parallel(cfg: ExperimentConfig) -> None:
    """ValueError for a step that cannot be shared evenly by the run's engine replicas, or an algorithm the replicas
    cannot run."""
    size = cfg.cluster.data_parallel
    if size == 1:
        return
    who = f"cluster.gpus: {size} replicas"
    mini = cfg.train.mini_batch_prompts * cfg.rollout.group_size
    if mini % size:
        raise ValueError(
            f"{who} each train an equal share of every mini-batch: train.mini_batch_prompts x rollout.group_size "
            f"({mini}) must be a multiple of {size}"
        )
    chunks = -(-cfg.rollout.samples_per_step // cfg.rollout.chunk_size)
    if chunks % size or cfg.rollout.samples_per_step % cfg.rollout.chunk_size:
        raise ValueError(
            f"{who} each generate an equal share of the step's chunks: the step's {cfg.rollout.samples_per_step} "
            f"samples come in {chunks} chunk(s) of rollout.chunk_size {cfg.rollout.chunk_size}; make the number of "
            f"whole chunks a multiple of {size} (e.g. rollout.chunk_size: "
            f"{max(1, cfg.rollout.samples_per_step // size)})"
        )
    if cfg.data.sample_source == "offline":
        raise ValueError(f"data.sample_source 'offline' reads its pairs in one process: {who} needs online rollouts")
    if cfg.algorithm.needs.samples_with_old_adapter:
        raise ValueError(
            f"algorithm {cfg.algorithm.name!r} samples with the trainer's old (EMA) adapter, which only a single "
            f"engine shares with its rollout: {who} is not supported for it yet (use cluster.gpus: 1)"
        )


def check_final_samples(cfg: ExperimentConfig) -> None:
    """ValueError for a rollout correction on an algorithm that trains on final samples (the direct-preference
    family): its loss reads no behaviour log-prob and has no importance ratio, so the correction would be ignored."""
    correction = cfg.train.rollout_correction
    if cfg.algorithm.needs.data == "final_samples" and correction != "off":
        raise ValueError(
            f"algorithm {cfg.algorithm.name!r} trains on final samples with no behaviour log-probs and no importance "
            f"ratio, so train.rollout_correction {correction!r} would be ignored; use train.rollout_correction: off "
            '(docs/algorithms.md, "Off-policy correction")'
        )


def check_async(cfg: ExperimentConfig) -> None:
    """ValueError, one line naming what works, for an asynchronous run (run.async.max_staleness > 0) this version does
    not run. It trains a LoRA adapter with a policy-gradient algorithm, which needs an explicit behaviour-policy
    correction (on denoising steps in one process or on engine replicas, cluster.mode: ray, each replica sampling with
    its own behaviour copy beside the trainer's frozen tensors in GPU memory; on tokens in one process, sampled
    in-process by transformers), or in one process with a direct-preference algorithm on the run's own final samples
    (dpo, diffusion_nft, awm, dgpo), whose loss has no importance ratio to correct (docs/algorithms.md, "Off-policy
    correction")."""
    staleness = cfg.run.async_.max_staleness
    if staleness == 0:
        return
    who = f"run.async.max_staleness: {staleness}"
    algo = cfg.algorithm
    if not _async_algorithm(algo):
        from diffrl.algorithms.catalog import algorithms

        works = sorted(name for name, a in algorithms().items() if _async_algorithm(a))
        pairs = "pairs of " if algo.needs.pairs else ""
        what = "distils a teacher" if algo.needs.teacher else f"trains on {pairs}{algo.needs.data}"
        raise ValueError(
            f"{who} runs the policy-gradient and direct-preference algorithms ({', '.join(works)}); algorithm "
            f"{algo.name!r} {what}, which is not "
            "supported asynchronously yet (use run.async.max_staleness: 0)"
        )
    if cfg.data.sample_source == "offline":
        raise ValueError(
            f"{who} samples the next step beside the update; data.sample_source 'offline' trains on a preference file "
            "and samples nothing, so there is no rollout to run asynchronously (use run.async.max_staleness: 0)"
        )
    if algo.needs.data == "tokens" and cfg.rollout.engine != "transformers":
        raise ValueError(
            f"{who} samples tokens in-process (rollout.engine: transformers); rollout.engine {cfg.rollout.engine!r} "
            "is not supported asynchronously yet: on one GPU the vLLM server sleeps during the update to free its "
            "memory, which serialises rollout and update; overlapping them needs the server on another device"
        )
    if cfg.cluster.mode != "local" and algo.needs.data != "denoising_steps":
        raise ValueError(
            f"{who} runs on engine replicas for the diffusion policy-gradient algorithms; algorithm {algo.name!r} "
            f"trains on {algo.needs.data}, which runs asynchronously in one process only (cluster.mode: local)"
        )
    if cfg.cluster.mode == "ray" and cfg.train.offload_optimizer:
        raise ValueError(
            f"{who} on engine replicas samples with the trainer's frozen tensors in GPU memory, which "
            "train.offload_optimizer moves to the host: set train.offload_optimizer: false"
        )
    if not cfg.train.lora:
        raise ValueError(
            f"{who} samples with its own copy of the LoRA tensors beside the shared base weights, which needs "
            "train.lora: true (full fine-tuning is not supported asynchronously yet)"
        )
    # a direct-preference loss has no ratio to correct: check_final_samples refused a correction for it already
    if algo.needs.data != "final_samples" and cfg.train.rollout_correction == "off":
        raise ValueError(
            f"{who} trains on samples of an older policy, which needs the behaviour-policy correction: set "
            'train.rollout_correction to tis or mask (docs/algorithms.md, "Off-policy correction")'
        )


def _async_algorithm(algorithm) -> bool:
    """Whether an asynchronous run trains `algorithm`: a policy-gradient one (old log-probs in a ratio), on denoising
    steps or on tokens, or a direct-preference one on final samples (no ratio: any sample with rewards trains)."""
    needs = algorithm.needs
    if needs.teacher:  # the teacher's denoiser is swapped into the pipeline the behaviour copy would sample beside
        return False
    if needs.data in ("denoising_steps", "final_samples"):
        return True
    return needs.data == "tokens" and needs.old_log_probs and not needs.pairs


def _numbers(node, path: str):
    """(dotted name, value) of every float in a config tree: dataclass fields, mappings (reward options), lists."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            yield from _numbers(getattr(node, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers(value, f"{path}.{key}")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _numbers(value, f"{path}[{i}]")
    elif isinstance(node, float):
        yield path, node


def _algorithm_from_mapping(data: dict, where: str) -> Algorithm:
    """`algorithm: {name: mix_grpo, clip_ratio: 1e-4, window: {...}}` -> the named bundle with overrides."""
    data = dict(data or {})
    name = data.pop("name", "flow_grpo")
    try:
        base = get_algorithm(name)
        overrides = {}
        fields = {f.name: f for f in dataclasses.fields(base)}  # the fields of this algorithm's class
        hints = typing.get_type_hints(type(base))
        for key, value in data.items():
            if key not in fields:
                get_algorithm(name, **{key: value})  # raises with the valid fields listed
            current = getattr(base, key)
            if dataclasses.is_dataclass(current) and isinstance(value, dict):
                overrides[key] = build(type(current), {**to_dict(current), **value}, where=f"{where}.{key}")
            elif hints[key] in (float, int, bool):
                # typed like every other section: YAML reads `1e-4` (no dot) as a string
                overrides[key] = coerce(value, hints[key], f"{where}.{key}")
            else:
                overrides[key] = value
        return get_algorithm(name, **overrides)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None


def config_path(name_or_path: str | None) -> str:
    """A shipped config name (quickstart, qwen_image_ocr_lora, ...) or a path to a YAML file."""
    if name_or_path is None:
        return os.path.join(CONFIG_DIR, "quickstart.yaml")
    if os.path.exists(name_or_path):
        return name_or_path
    shipped = os.path.join(CONFIG_DIR, name_or_path if name_or_path.endswith(".yaml") else f"{name_or_path}.yaml")
    if os.path.exists(shipped):
        return shipped
    names = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
    raise ConfigError(f"config {name_or_path!r} is neither a file nor a shipped config; shipped: {names}")


def _algorithm_name(section) -> str | None:
    return section if isinstance(section, str) else section.get("name") if isinstance(section, dict) else None


def _merge_sections(under: dict, over: dict) -> dict:
    """`over`'s keys on top of `under`'s: mappings merge key by key, anything else replaces. The algorithm
    section is a named bundle: a bare name, or a mapping naming another algorithm, replaces the base's whole
    section (none of the base algorithm's fields carry over); a mapping of fields edits the base's."""
    merged = dict(under)
    for key, value in over.items():
        if key == "algorithm" and _algorithm_name(value) not in (None, _algorithm_name(under.get(key))):
            merged[key] = value
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge_sections(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_sections(path: str, including: tuple[str, ...] = ()) -> dict:
    """The raw sections of one config file, merged over those of its `base:` config (a file next to it or a
    shipped config name), which may itself have a base."""
    import yaml

    path = os.path.abspath(path)
    if path in including:
        raise ConfigError(f"{including[-1]}: `base:` forms a cycle through {path}")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: `base:` must name a config file or a shipped config; got {base!r}")
    beside = os.path.join(os.path.dirname(path), base)
    base_path = beside if os.path.isfile(beside) else config_path(base)
    return _merge_sections(_read_sections(base_path, (*including, path)), raw)


def load_experiment(name_or_path: str | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load an experiment YAML (default: the quickstart), merged over its `base:` config if it names one, with
    dotted overrides, fully validated. `algorithm=NAME` (or a mapping) replaces the whole algorithm section;
    `algorithm.FIELD=VALUE` edits one field of it."""
    raw = _read_sections(config_path(name_or_path))
    algo_raw = raw.pop("algorithm", {}) or {}
    if isinstance(algo_raw, str):
        algo_raw = {"name": algo_raw}
    algo_over = [o for o in (overrides or []) if o.split("=", 1)[0].split(".")[0] == "algorithm"]
    raw = apply_overrides(raw, [o for o in (overrides or []) if o not in algo_over], ExperimentConfig)
    for text in algo_over:
        keys, value = parse_override(text)
        if len(keys) == 1:
            if not isinstance(value, (str, dict)) or not value:
                raise ConfigError(f"override {text!r}: `algorithm=` takes an algorithm name or a mapping of fields")
            algo_raw = {"name": value} if isinstance(value, str) else dict(value)
            continue
        node = algo_raw
        for k in keys[1:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    # the algorithm section is a named bundle plus overrides, built here; the loader takes the instance
    raw["algorithm"] = _algorithm_from_mapping(algo_raw, "algorithm")
    return build(ExperimentConfig, raw)
