"""Prompt datasets (txt / jsonl / parquet, the flow_grpo reference files), generators, sampler."""

import json
import os
import re
import wave

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffrl.engines.store.prompts import PromptDataset, PromptSampler, compositional_prompts, ocr_prompts

REFERENCE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "shared", "data", "flow_grpo")
needs_reference = pytest.mark.skipif(
    not os.path.isdir(REFERENCE), reason=f"reference prompt sets not found at {REFERENCE}"
)


@needs_reference
def test_reference_ocr_and_pickscore_txt():
    ocr = PromptDataset.load(os.path.join(REFERENCE, "ocr_test.txt"))
    assert len(ocr) == 1018  # 1017 newline-terminated lines + a last line without one
    assert ocr[0].prompt.startswith("A high-fashion runway") and ocr[0].ground_truth is None
    assert len({r.uid for r in ocr.records}) == len(ocr)
    assert len(PromptDataset.load(os.path.join(REFERENCE, "pickscore_test.txt"))) == 2048


@needs_reference
def test_reference_geneval_jsonl_keeps_structured_metadata():
    ds = PromptDataset.load(os.path.join(REFERENCE, "geneval_test_metadata.jsonl"))
    assert len(ds) == 2212
    first = ds[0]
    assert first.prompt == "a photo of two wine glasses"
    assert first.metadata == {
        "tag": "counting",
        "include": [{"class": "wine glass", "count": 2}],
        "exclude": [{"class": "wine glass", "count": 3}],
    }


def test_jsonl_and_parquet_columns(tmp_path):
    rows = [
        {"prompt": "a cat", "ground_truth": "cat", "id": 7, "source": "x", "metadata": {"k": 1}},
        {"prompt": "a dog", "ground_truth": 3, "id": 8, "source": "y", "metadata": '{"k": 2}'},
    ]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ds = PromptDataset.load(str(jsonl))
    assert [r.uid for r in ds.records] == ["7", "8"]
    assert ds[1].ground_truth == "3" and ds[1].metadata == {"source": "y", "k": 2}
    pq.write_table(pa.table({"text": ["a cat", "a cat"], "ground_truth": ["c", None]}), tmp_path / "p.parquet")
    pds = PromptDataset.load(str(tmp_path / "p.parquet"), prompt_column="text")
    assert pds[0].uid != pds[1].uid and pds[1].ground_truth is None  # repeated prompt, distinct uids
    again = PromptDataset.load(str(tmp_path / "p.parquet"), prompt_column="text")
    assert again[0] == pds[0]  # uids are stable across loads


def test_bad_files_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="missing.txt: prompt file does not exist"):
        PromptDataset.load(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="empty.txt: the prompt file is empty"):
        PromptDataset.load(str(tmp_path / "empty.txt"))
    (tmp_path / "noprompt.jsonl").write_text('{"caption": "a cat"}\n')
    with pytest.raises(ValueError, match="noprompt.jsonl: row 0 has no 'prompt' column"):
        PromptDataset.load(str(tmp_path / "noprompt.jsonl"))
    pq.write_table(pa.table({"caption": ["a"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="p.parquet: row 0 has no 'prompt'"):
        PromptDataset.load(str(tmp_path / "p.parquet"))
    with pytest.raises(ValueError, match="unsupported prompt file type"):
        PromptDataset.load(str(tmp_path / "p.csv"))


def test_memory_uri(tmp_path):
    from diffrl.engines.store import fs

    with fs.open("memory://prompts/test.txt", "wb") as f:
        f.write(b"first prompt\nsecond prompt\n")
    loaded = PromptDataset.load("memory://prompts/test.txt")
    assert [r.prompt for r in loaded.records] == ["first prompt", "second prompt"]


def test_ocr_generator():
    ds = ocr_prompts(50, seed=3)
    assert len(ds) == 50 and ocr_prompts(50, seed=3).records == ds.records
    for r in ds.records:
        assert re.findall(r'"([^"]+)"', r.prompt) == [r.ground_truth]
    assert ocr_prompts(50, seed=4).records != ds.records


def test_compositional_generator_targets_match_prompts():
    ds = compositional_prompts(300, seed=0)
    assert compositional_prompts(300, seed=0).records == ds.records
    tags = {r.metadata["tag"] for r in ds.records}
    assert tags == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    for r in ds.records:
        for obj in r.metadata["include"]:
            assert obj["class"] in r.prompt and obj["count"] >= 1
            if "color" in obj:
                assert f"{obj['color']} {obj['class']}" in r.prompt
            if "position" in obj:
                assert obj["position"][0] in r.prompt


def test_sampler_epochs_shards_and_resume():
    ds = ocr_prompts(10, seed=0)
    sampler = PromptSampler(ds, batch=4, seed=1)
    assert sampler.steps_per_epoch == 2
    epoch0 = sampler.indices(0) + sampler.indices(1)
    assert len(set(epoch0)) == 8  # without replacement within an epoch
    assert sampler.indices(2) + sampler.indices(3) != epoch0  # reshuffled
    assert PromptSampler(ds, batch=4, seed=1).sample(5) == sampler.sample(5)  # pure function of (seed, step)
    ranks = [PromptSampler(ds, batch=4, seed=1, rank=r, world_size=2).indices(3) for r in range(2)]
    assert ranks[0] + ranks[1] == sampler.indices(3)
    with pytest.raises(ValueError, match="divisible by world_size=3"):
        PromptSampler(ds, batch=4, seed=1, world_size=3)
    with pytest.raises(ValueError, match="batch must be in"):
        PromptSampler(ds, batch=11, seed=1)


def test_audio_clips_resolve_from_the_prompt_file_and_bad_ones_name_the_row(tmp_path, sine_wav):
    """`audios`: WAV paths relative to the prompt file's folder (or absolute) become absolute paths in metadata; a
    missing, non-WAV or 8-bit file, or a value that is not a list of paths, is an error naming the row and the file."""
    clip = sine_wav("clip.wav", 440)  # tmp_path/clip.wav
    os.makedirs(tmp_path / "sets" / "sounds")
    os.replace(clip, tmp_path / "sets" / "sounds" / "clip.wav")
    rows = [
        {"prompt": "what do you hear?", "audios": ["sounds/clip.wav"], "ground_truth": "a tone"},
        {"prompt": "and here?", "audios": [str(tmp_path / "sets" / "sounds" / "clip.wav")] * 2},
        {"prompt": "no audio"},
    ]
    path = tmp_path / "sets" / "questions.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    ds = PromptDataset.load(str(path))
    absolute = str(tmp_path / "sets" / "sounds" / "clip.wav")
    assert ds[0].metadata == {"audios": [absolute]} and ds[1].metadata == {"audios": [absolute, absolute]}
    assert ds[2].metadata == {}

    text = tmp_path / "sets" / "sounds" / "notes.wav"
    text.write_text("not audio")
    with wave.open(str(tmp_path / "sets" / "sounds" / "u8.wav"), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(1)
        f.setframerate(16000)
        f.writeframes(bytes(100))
    for audios, message in [
        (["sounds/gone.wav"], "gone.wav: audio file does not exist"),
        (["sounds/notes.wav"], "notes.wav: not a PCM WAV file"),
        (["sounds/u8.wav"], "u8.wav: 8-bit samples"),
        ("sounds/clip.wav", "audios must be a list of WAV file paths"),
    ]:
        path.write_text(json.dumps(rows[2]) + "\n" + json.dumps({"prompt": "bad", "audios": audios}))
        with pytest.raises(ValueError, match=f"questions.jsonl: row 1: .*{re.escape(message)}"):
            PromptDataset.load(str(path))
