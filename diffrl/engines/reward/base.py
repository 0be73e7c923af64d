"""Reward contracts: the output type, the function protocol, the registry, option parsing.

Legend: B = batch, F = frames, H/W = height/width, C = audio channels, T = audio samples. Images arrive as uint8
(B, H, W, 3), videos as uint8 (B, F, H, W, 3), either as torch tensors or numpy arrays; the decoded text responses of
an autoregressive rollout arrive as a list of B str (answer.py's rewards take those). Audio arrives as an AudioBatch:
waveform float32 (B, C, T) in [-1, 1] (a (B, T) waveform is mono, C = 1) with its sample rate in Hz and, for a model
that makes video with its audio track, that video (B, F, H, W, 3) and its frames per second. An image or video reward
given an AudioBatch scores its video (to_uint8_numpy), so per-frame rewards work on video-with-audio unchanged.

Conventions every reward follows:
- `scores` is float32 (B,); `valid` is bool (B,). A sample a reward could not score (a malformed
  judge answer, an unreadable service reply) has valid False and score NaN: never a silent 0,
  and NaN makes any unmasked use loud.
- `info` maps a key to a per-sample list of length B (so batches concatenate by list extension).
- Heavy dependencies (transformers, rapidocr, open_clip) are imported inside the constructors, so
  importing the registry stays cheap.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import numpy as np
import torch

from diffrl import registry
from diffrl.configs.reward import is_user_reward

# Modules that register the built-in rewards; imported lazily on the first registry lookup.
_BUILTIN_MODULES = (
    "diffrl.engines.reward.jpeg",
    "diffrl.engines.reward.ocr",
    "diffrl.engines.reward.vlm_judge",
    "diffrl.engines.reward.clip_score",
    "diffrl.engines.reward.pickscore",
    "diffrl.engines.reward.aesthetic",
    "diffrl.engines.reward.http_scorer",
    "diffrl.engines.reward.answer",
    "diffrl.engines.reward.video",
    "diffrl.engines.reward.audio",
    "diffrl.engines.reward.av_sync",
)
registry.declare("reward", _BUILTIN_MODULES)


class RewardError(RuntimeError):
    """A reward function failed; carries the reward's name so a pool can report it."""

    def __init__(self, message: str, reward_name: str):
        super().__init__(message)
        self.reward_name = reward_name

    def __reduce__(self):  # keep it picklable across spawned worker processes
        return (type(self), (self.args[0], self.reward_name))


@dataclass
class RewardOutput:
    """Per-sample scores of one batch.

    scores: float32 (B,), NaN where not valid.  valid: bool (B,), False = excluded sample.
    info: per-sample lists of length B (recognised text, raw judge answers, component scores).
    """

    scores: torch.Tensor
    valid: torch.Tensor
    info: dict[str, list] = field(default_factory=dict)

    def __post_init__(self):
        assert self.scores.ndim == 1 and self.scores.shape == self.valid.shape, "scores/valid must be (B,)"
        assert self.valid.dtype == torch.bool, "valid must be bool"
        for key, values in self.info.items():
            assert len(values) == len(self.scores), f"info[{key!r}] must have one entry per sample"

    @classmethod
    def from_lists(cls, scores: list[float | None], info: dict[str, list] | None = None) -> "RewardOutput":
        """Builds an output from per-sample scores where None marks an excluded sample."""
        valid = torch.tensor([s is not None for s in scores], dtype=torch.bool)
        values = torch.tensor([math.nan if s is None else float(s) for s in scores], dtype=torch.float32)
        return cls(scores=values, valid=valid, info=dict(info or {}))


def concat_outputs(outputs: list[RewardOutput]) -> RewardOutput:
    """Concatenates batch outputs in order; an info key a batch lacks (a component that was down for that batch
    reports only its error) is None for its samples."""
    if not outputs:
        return RewardOutput(torch.zeros(0), torch.zeros(0, dtype=torch.bool), {})
    keys = list(dict.fromkeys(key for out in outputs for key in out.info))
    info: dict[str, list] = {k: [] for k in keys}
    for out in outputs:
        for k in keys:
            info[k].extend(out.info.get(k, [None] * len(out.scores)))
    return RewardOutput(
        scores=torch.cat([o.scores for o in outputs]),
        valid=torch.cat([o.valid for o in outputs]),
        info=info,
    )


def select_outputs(out: RewardOutput, index: list[int]) -> RewardOutput:
    """The samples `index` of an output, in that order (scores, valid and every per-sample info list)."""
    idx = torch.as_tensor(index, dtype=torch.long)
    info = {key: [values[i] for i in index] for key, values in out.info.items()}
    return RewardOutput(scores=out.scores[idx], valid=out.valid[idx], info=info)


@runtime_checkable
class RewardFunction(Protocol):
    """Scores a batch: images uint8 (B, H, W, 3), videos (B, F, H, W, 3) or text responses (a list of B str)."""

    name: str
    batch_size: int

    def __call__(
        self, images: torch.Tensor | np.ndarray | list[str], prompts: list[str], metadata: list[dict]
    ) -> RewardOutput: ...


@dataclass
class NoOptions:
    """Options of a reward that takes none."""


def register_reward(name: str, options: type = NoOptions) -> Callable:
    """Decorator registering `factory(options) -> RewardFunction` under `name`.

    `options` is the reward's own @dataclass; `build_reward` validates a dict into it.
    """
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"options of reward {name!r} must be a dataclass, got {options!r}")

    return registry.register("reward", name, options=options)


def reward_names() -> list[str]:
    """Sorted names of all registered rewards (built-ins included)."""
    return registry.names("reward")


def reward_options_type(name: str) -> type:
    """The options dataclass of reward `name` (ValueError listing the names if unknown)."""
    return registry.get("reward", name).meta["options"]


def build_reward(name: str, options: dict | None = None) -> RewardFunction:
    """Builds reward `name` from a dict of options, validated into that reward's dataclass.

    Everything that can be checked before the run (weight folders, API-key variables, option
    values) fails here, at start-up, not mid-run. A `module:function` name is a user's Python reward, imported
    here (diffrl/engines/reward/user.py); its options are the function's keyword arguments.
    """
    from diffrl.engines.reward.user import user_reward  # here: user.py imports this module

    if is_user_reward(name):
        return user_reward(name, options or {})
    options_type = reward_options_type(name)
    parsed = parse_options(options_type, options or {}, owner=f"reward {name!r}")
    return registry.get("reward", name).obj(parsed)


def parse_options(options_type: type, values: dict, owner: str) -> Any:
    """Validates `values` into the dataclass `options_type`.

    Unknown keys raise ValueError naming the key and listing the valid ones. String values are
    converted to the field's type (so CLI `key=value` overrides work).
    """
    if not isinstance(values, dict):
        raise ValueError(f"options of {owner} must be a mapping, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(options_type)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for {owner}; "
            f"valid options: {', '.join(fields) or '(none)'}"
        )
    hints = typing.get_type_hints(options_type)
    converted = {k: _convert(v, hints[k], k, owner) for k, v in values.items()}
    try:
        return options_type(**converted)
    except TypeError as e:  # a required field without a value
        raise ValueError(f"bad options for {owner}: {e}") from None


def _convert(value: Any, hint: Any, key: str, owner: str) -> Any:
    """Converts a string (from the CLI) to the annotated scalar type; leaves other values alone."""
    if not isinstance(value, str):
        return value
    target = hint
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value.lower() in ("none", "null"):
            return None
        target = args[0] if len(args) == 1 else str
    try:
        if target is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if target in (int, float):
            return target(value)
    except ValueError:
        raise ValueError(f"option {key!r} of {owner} must be a {target.__name__}, got {value!r}") from None
    return value


@dataclass
class AudioBatch:
    """Generated audio, with the video it accompanies when the model makes both.

    waveform: float32 (B, C, T) in [-1, 1]; a (B, T) waveform is taken as (B, 1, T). sample_rate: Hz.
    video: uint8 (B, F, H, W, 3) or None; fps: the video's frames per second (required with a video).
    Torch tensors are converted to numpy; slicing (`batch[a:b]`) slices both streams.
    """

    waveform: np.ndarray
    sample_rate: int
    video: np.ndarray | None = None
    fps: float | None = None

    def __post_init__(self):
        waveform = self.waveform
        if isinstance(waveform, torch.Tensor):
            waveform = waveform.detach().cpu().float().numpy()
        if not isinstance(waveform, np.ndarray) or not np.issubdtype(waveform.dtype, np.floating):
            raise ValueError(f"audio waveform must be a float array (B, C, T) or (B, T), got {type(waveform).__name__}")
        if waveform.ndim == 2:
            waveform = waveform[:, None, :]
        if waveform.ndim != 3:
            raise ValueError(f"audio waveform must be (B, C, T) or (B, T), got shape {tuple(waveform.shape)}")
        self.waveform = waveform.astype(np.float32, copy=False)
        if isinstance(self.sample_rate, bool) or not isinstance(self.sample_rate, int) or self.sample_rate <= 0:
            raise ValueError(f"audio sample_rate must be a positive int (Hz), got {self.sample_rate!r}")
        if self.video is None:
            return
        self.video = to_uint8_numpy(self.video)
        if self.video.ndim != 5 or len(self.video) != len(self.waveform):
            raise ValueError(
                f"the video of an audio batch must be (B, F, H, W, 3) with B = {len(self.waveform)}, "
                f"got shape {tuple(self.video.shape)}"
            )
        if self.fps is None or not self.fps > 0:
            raise ValueError(f"an audio batch with a video needs its fps > 0, got {self.fps!r}")

    def __len__(self) -> int:
        return len(self.waveform)

    def __getitem__(self, index: slice) -> "AudioBatch":
        if not isinstance(index, slice):  # an int would drop B and read the channels as the batch
            raise TypeError(f"an AudioBatch is sliced (batch[a:b]), not indexed by {type(index).__name__}")
        video = None if self.video is None else self.video[index]
        return AudioBatch(self.waveform[index], self.sample_rate, video, self.fps)


def to_uint8_numpy(images: torch.Tensor | np.ndarray | AudioBatch) -> np.ndarray:
    """Checks images (B, H, W, 3) / videos (B, F, H, W, 3) uint8 and returns a numpy view; an AudioBatch gives its
    video (TypeError when it has none: an image reward cannot score audio alone)."""
    if isinstance(images, AudioBatch):
        if images.video is None:
            raise TypeError("this reward scores images or videos; the batch is audio without video")
        return images.video
    if isinstance(images, torch.Tensor):
        images = images.detach().cpu().numpy()
    if not isinstance(images, np.ndarray):
        raise TypeError(f"images must be a torch.Tensor or np.ndarray, got {type(images).__name__}")
    if images.dtype != np.uint8:
        raise ValueError(f"images must be uint8, got {images.dtype}")
    if images.ndim not in (4, 5) or images.shape[-1] != 3:
        raise ValueError(f"images must be (B, H, W, 3) or (B, F, H, W, 3), got shape {tuple(images.shape)}")
    return images


def to_texts(responses: Any) -> list[str]:
    """Checks a batch of decoded text responses: a list (or tuple) of str."""
    if not isinstance(responses, (list, tuple)):
        raise TypeError(f"text responses must be a list of str, got {type(responses).__name__}")
    for index, response in enumerate(responses):
        if not isinstance(response, str):
            raise TypeError(f"text responses must be a list of str; response {index} is a {type(response).__name__}")
    return list(responses)


def to_samples(samples: Any) -> np.ndarray | list[str] | AudioBatch:
    """A batch as rewards take it: text responses when a list or tuple (to_texts), an AudioBatch as it is, else
    images/videos."""
    if isinstance(samples, AudioBatch):
        return samples
    return to_texts(samples) if isinstance(samples, (list, tuple)) else to_uint8_numpy(samples)


def to_audio(samples: Any, owner: str) -> AudioBatch:
    """The batch as an AudioBatch; TypeError naming the reward (`owner`) when it is images, videos or text."""
    if not isinstance(samples, AudioBatch):
        raise TypeError(f"{owner} scores audio (an AudioBatch); got {type(samples).__name__}")
    return samples


def sample_frames(sample: np.ndarray, frame_stride: int) -> list[np.ndarray]:
    """An image (H, W, 3) -> [image]; a video (F, H, W, 3) -> every `frame_stride`-th frame."""
    if sample.ndim == 3:
        return [sample]
    return list(sample[::frame_stride])


def iter_batches(n: int, batch_size: int) -> Iterator[slice]:
    """Slices covering range(n) in batches of `batch_size`."""
    for start in range(0, n, batch_size):
        yield slice(start, min(start + batch_size, n))


def check_folder(path: str | Path, option: str, owner: str, must_contain: tuple[str, ...] = ()) -> Path:
    """Start-up check of a local weight folder: it exists and holds the named files."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{owner}: option {option!r} = {str(path)!r} is not an existing folder")
    missing = [name for name in must_contain if not (folder / name).exists()]
    if missing:
        raise ValueError(f"{owner}: folder {str(folder)!r} ({option}) lacks {', '.join(missing)}")
    return folder


def check_positive(value: float, option: str, owner: str, allow_zero: bool = False) -> None:
    """ValueError unless value > 0 (or >= 0 with allow_zero)."""
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}: option {option!r} must be {bound}, got {value!r}")


def check_choice(value: str, option: str, owner: str, choices: tuple[str, ...]) -> None:
    """ValueError unless value is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{owner}: option {option!r} must be one of {', '.join(choices)}; got {value!r}")
