"""Prompt datasets (parquet / jsonl / txt), OCR and GenEval-style generators, and the sampler.

A PromptRecord's uid is its group id in the trajectory table: an explicit `uid`/`id` column, or
a stable hash of (row index, prompt text) so a repeated prompt still gets distinct uids.

A row of an autoregressive run may play audio clips: an `audios` column (a list of 16-bit PCM WAV paths, relative to
the prompt file's folder or absolute, local) goes to metadata["audios"] as absolute paths. Each file's header is
checked when the file loads (it exists, is a PCM WAV, 16 bits a sample); the samples are read when the rollout
encodes the prompt (diffrl/models/wav.py, audio.py).

A row of an editing or image-to-video model's run names its input image: an `image` column (a path, relative to the
prompt file's folder or absolute, local; a first/last-frame video model's row a `last_image` too), checked to be a
readable image when the file loads and kept in metadata["image"] (["last_image"]) as an absolute path: by reference
into the trajectory rows, never inlined.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from diffrl.engines.store import fs
from diffrl.models.wav import wav_info

_FORMATS = (".parquet", ".jsonl", ".json", ".txt")


@dataclass(frozen=True)
class PromptRecord:
    uid: str
    prompt: str
    ground_truth: str | None = None
    metadata: dict = field(default_factory=dict)


def prompt_uid(index: int, prompt: str) -> str:
    """Stable uid of the prompt at row `index` (same on every machine and Python version)."""
    return hashlib.sha1(f"{index}\x00{prompt}".encode()).hexdigest()[:16]


class PromptDataset:
    """An indexable list of PromptRecords."""

    def __init__(self, records: list[PromptRecord], *, source: str = "<memory>"):
        if not records:
            raise ValueError(f"{source}: the prompt dataset is empty")
        uids = [r.uid for r in records]
        if len(set(uids)) != len(uids):
            dup = next(u for u in uids if uids.count(u) > 1)
            raise ValueError(f"{source}: uid {dup!r} appears more than once; uids must be unique")
        self.records = records
        self.source = source

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    @classmethod
    def load(cls, path: str, *, storage_options: dict | None = None, prompt_column: str = "prompt") -> "PromptDataset":
        """Load a .parquet, .jsonl (.json) or .txt (one prompt per line) file, local or remote.

        Columns besides the prompt: `ground_truth` (optional), `uid` or `id` (optional explicit
        uid), `metadata` (a dict or a JSON string of one) and any others, which go to metadata.
        """
        path = str(path)
        suffix = next((s for s in _FORMATS if path.lower().endswith(s)), None)
        if suffix is None:
            raise ValueError(f"{path}: unsupported prompt file type; expected one of {', '.join(_FORMATS)}")
        if not fs.exists(path, storage_options):
            raise ValueError(f"{path}: prompt file does not exist")
        with fs.open(path, "rb", storage_options) as f:
            raw = f.read()
        if suffix == ".txt":
            prompts = [line.strip() for line in _text(raw, path).splitlines()]
            rows = [{prompt_column: p} for p in prompts if p]
        elif suffix == ".parquet":
            rows = pq.read_table(io.BytesIO(raw)).to_pylist()
        else:
            rows = _json_lines(raw, path)
        if not rows:
            raise ValueError(f"{path}: the prompt file is empty")
        return cls([_record(row, i, path, prompt_column) for i, row in enumerate(rows)], source=path)


def _text(raw: bytes, path: str) -> str:
    """A prompt file's text: UTF-8, else a ValueError naming the file and where its bytes stop being UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}, offset {e.start}: {e.reason}); "
            "save the prompt file as UTF-8"
        ) from None


def _json_lines(raw: bytes, path: str) -> list[dict]:
    rows = []
    for n, line in enumerate(_text(raw, path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {n} is not valid JSON ({e})") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {n} is not a JSON object")
        rows.append(row)
    return rows


def _record(row: dict, index: int, path: str, prompt_column: str) -> PromptRecord:
    if prompt_column not in row:
        raise ValueError(
            f"{path}: row {index} has no {prompt_column!r} column (columns: {sorted(row)}); "
            "pass prompt_column= to name the prompt column"
        )
    prompt = row[prompt_column]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{path}: row {index}: {prompt_column!r} must be a non-empty string, got {prompt!r}")
    rest = {k: v for k, v in row.items() if k != prompt_column}
    explicit = rest.pop("uid", None)
    if explicit is None:
        explicit = rest.pop("id", None)
    truth = rest.pop("ground_truth", None)
    metadata = rest.pop("metadata", None) or {}
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: row {index}: metadata is not a JSON object ({e})") from e
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: row {index}: metadata must be a dict, got {type(metadata).__name__}")
    # Non-string ground truths (numbers, lists) keep their value as JSON text.
    truth = truth if truth is None or isinstance(truth, str) else json.dumps(truth)
    uid = str(explicit) if explicit is not None else prompt_uid(index, prompt)
    metadata = {**rest, **metadata}
    if "audios" in metadata:
        metadata["audios"] = _audio_paths(metadata["audios"], index, path)
    for key in ("image", "last_image"):  # an editing or image-to-video model's input image, a video's last frame
        if key in metadata:
            metadata[key] = _image_path(metadata[key], index, path)
    return PromptRecord(uid=uid, prompt=prompt, ground_truth=truth, metadata=metadata)


def _audio_paths(audios, index: int, path: str) -> list[str]:
    """Row `index`'s audio clips as absolute paths (relative ones from the prompt file's folder), each a readable
    16-bit PCM WAV by its header; a ValueError naming the file, the row and the clip otherwise."""
    if not isinstance(audios, list) or not all(isinstance(a, str) and a for a in audios):
        raise ValueError(f"{path}: row {index}: audios must be a list of WAV file paths, got {audios!r}")
    remote = "://" in path
    resolved = []
    for audio in audios:
        if not os.path.isabs(audio):
            if remote:
                raise ValueError(
                    f"{path}: row {index}: audio {audio!r} is relative to a remote prompt file; audio clips are read "
                    "from local files: give absolute paths"
                )
            audio = os.path.join(os.path.dirname(os.path.abspath(path)), audio)
        try:
            wav_info(audio)
        except ValueError as e:
            raise ValueError(f"{path}: row {index}: {e}") from None
        resolved.append(os.path.normpath(audio))
    return resolved


def _image_path(image, index: int, path: str) -> str:
    """Row `index`'s input image (an editing model's) as an absolute path (a relative one from the prompt file's
    folder) to a file PIL reads as an image; a ValueError naming the file, the row and the image otherwise."""
    if not isinstance(image, str) or not image:
        raise ValueError(f"{path}: row {index}: image must be the path of an image file, got {image!r}")
    if not os.path.isabs(image):
        if "://" in path:
            raise ValueError(
                f"{path}: row {index}: image {image!r} is relative to a remote prompt file; input images are read "
                "from local files: give absolute paths"
            )
        image = os.path.join(os.path.dirname(os.path.abspath(path)), image)
    try:
        with Image.open(image) as opened:
            opened.verify()
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: row {index}: image {image!r} is not a readable image file ({e})") from None
    return os.path.normpath(image)


class PromptSampler:
    """Deterministic per-step batches: `batch` distinct prompts per step, every prompt once per
    epoch (the last partial batch of an epoch is dropped), a fresh permutation per epoch from
    seed + epoch, rank r of N taking the r-th contiguous slice. A pure function of (seed, step):
    resuming needs no saved state.
    """

    def __init__(self, dataset: PromptDataset, *, batch: int, seed: int, rank: int = 0, world_size: int = 1):
        if batch < 1 or batch > len(dataset):
            raise ValueError(f"PromptSampler: batch must be in [1, {len(dataset)}] (the dataset size), got {batch}")
        if world_size < 1 or batch % world_size:
            raise ValueError(f"PromptSampler: batch={batch} must be divisible by world_size={world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"PromptSampler: rank must be in [0, {world_size}), got {rank}")
        self.dataset, self.batch, self.seed, self.rank, self.world_size = dataset, batch, seed, rank, world_size
        self.steps_per_epoch = len(dataset) // batch

    def indices(self, step: int) -> list[int]:
        """Dataset indices of this rank's prompts at `step`."""
        if step < 0:
            raise ValueError(f"PromptSampler.sample: step must be >= 0, got {step}")
        epoch, offset = divmod(step, self.steps_per_epoch)
        perm = np.random.default_rng(self.seed + epoch).permutation(len(self.dataset))
        per_rank = self.batch // self.world_size
        start = offset * self.batch + self.rank * per_rank
        return perm[start : start + per_rank].tolist()

    def sample(self, step: int) -> list[PromptRecord]:
        """This rank's PromptRecords for `step`."""
        return [self.dataset[i] for i in self.indices(step)]


# --------------------------------------------------------------------------------- generators
_OCR_TEMPLATES = [
    'A wooden sign at a forest trailhead that reads "{text}"',
    'A neon sign glowing above a late-night diner, spelling "{text}"',
    'A hand-written note on a fridge door saying "{text}"',
    'A vintage movie poster with the title "{text}" in bold letters',
    'A coffee cup with "{text}" printed on its sleeve',
    'A chalkboard menu outside a cafe with "{text}" written across the top',
    'A T-shirt on a hanger with the slogan "{text}"',
    'A street banner between two lamp posts announcing "{text}"',
    'A birthday cake with "{text}" piped in blue icing',
    'A book cover on a wooden table titled "{text}"',
]
_OCR_WORDS = [
    "Hidden Trail",
    "Open Late",
    "Good Morning",
    "Fresh Bread",
    "Stay Curious",
    "Blue Harbor",
    "Night Market",
    "Happy Birthday",
    "Quiet Zone",
    "Summer Sale",
    "Moon River",
    "Lost Keys",
    "North Star",
    "Free Hugs",
    "Green Valley",
    "Road Closed",
    "Silver Lake",
    "Jazz Night",
    "Home Sweet Home",
    "Dream Big",
    "Wild Bloom",
    "Exit Only",
    "Red Rocket",
    "Paper Planes",
]
_CLASSES = [
    "cat",
    "dog",
    "bicycle",
    "apple",
    "chair",
    "cup",
    "car",
    "bird",
    "clock",
    "umbrella",
    "book",
    "vase",
    "bench",
    "horse",
    "laptop",
    "banana",
    "teddy bear",
    "kite",
]
_COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
_NUMBERS = {2: "two", 3: "three", 4: "four"}
_RELATIONS = ["left of", "right of", "above", "below"]


def ocr_prompts(n: int, seed: int = 0) -> PromptDataset:
    """n OCR prompts (templates x words); the target text is in double quotes and is the ground truth."""
    rng = random.Random(seed)
    pairs = [(t, w) for t in _OCR_TEMPLATES for w in _OCR_WORDS]
    records = []
    for i in range(n):
        template, text = rng.choice(pairs)
        prompt = template.format(text=text)
        records.append(
            PromptRecord(uid=prompt_uid(i, prompt), prompt=prompt, ground_truth=text, metadata={"task": "ocr"})
        )
    return PromptDataset(records, source=f"ocr_prompts(n={n}, seed={seed})")


def _an(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _plural(word: str) -> str:
    return word + ("es" if word.endswith(("s", "ch", "sh", "x")) else "s")


def _compositional(rng: random.Random) -> tuple[str, dict]:
    """One GenEval-style prompt and its target, in the GenEval metadata format."""
    tag = rng.choice(["single_object", "two_object", "counting", "colors", "position", "color_attr"])
    a, b = rng.sample(_CLASSES, 2)
    ca, cb = rng.sample(_COLORS, 2)
    if tag == "single_object":
        return f"a photo of {_an(a)}", {"tag": tag, "include": [{"class": a, "count": 1}]}
    if tag == "two_object":
        return (
            f"a photo of {_an(a)} and {_an(b)}",
            {"tag": tag, "include": [{"class": a, "count": 1}, {"class": b, "count": 1}]},
        )
    if tag == "counting":
        k = rng.choice(sorted(_NUMBERS))
        return (
            f"a photo of {_NUMBERS[k]} {_plural(a)}",
            {"tag": tag, "include": [{"class": a, "count": k}], "exclude": [{"class": a, "count": k + 1}]},
        )
    if tag == "colors":
        return f"a photo of {_an(ca)} {a}", {"tag": tag, "include": [{"class": a, "count": 1, "color": ca}]}
    if tag == "position":
        rel = rng.choice(_RELATIONS)
        return (
            f"a photo of {_an(b)} {rel} {_an(a)}",
            {"tag": tag, "include": [{"class": a, "count": 1}, {"class": b, "count": 1, "position": [rel, 0]}]},
        )
    return (
        f"a photo of {_an(ca)} {a} and {_an(cb)} {b}",
        {"tag": tag, "include": [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}]},
    )


def compositional_prompts(n: int, seed: int = 0) -> PromptDataset:
    """n GenEval-style prompts (objects, counts, colours, positions); metadata holds the target in
    GenEval's format: tag, include/exclude lists of {class, count, color?, position?: [relation, index]}."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        prompt, target = _compositional(rng)
        records.append(PromptRecord(uid=prompt_uid(i, prompt), prompt=prompt, ground_truth=None, metadata=target))
    return PromptDataset(records, source=f"compositional_prompts(n={n}, seed={seed})")
