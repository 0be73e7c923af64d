"""EmbeddingCache: exact round trip of any tensors (bf16 included), variable length, idempotent puts."""

import pytest
import torch

from diffrl.engines.store.embeddings import EmbeddingCache


def encoding(length: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "prompt_embeds": torch.randn(1, length, 8, generator=g).to(torch.bfloat16),
        "pooled_prompt_embeds": torch.randn(1, 8, generator=g),
        "prompt_embeds_mask": torch.ones(1, length, dtype=torch.int64),
    }


@pytest.mark.parametrize("uri", ["local", "memory://cache-test/embeddings.lance"])
def test_round_trip_and_idempotent(tmp_path, uri):
    uri = str(tmp_path / "embeddings.lance") if uri == "local" else uri
    cache = EmbeddingCache(uri)
    prompts = {"a cat": encoding(5, 0), 'it\'s a "dog"': encoding(9, 1)}
    assert cache.get("fp1", list(prompts)) == {}
    assert cache.put("fp1", prompts) == 2
    assert cache.put("fp1", {"a cat": encoding(5, 7)}) == 0  # already cached: no-op
    got = cache.get("fp1", ["a cat", "missing", 'it\'s a "dog"'])
    assert set(got) == set(prompts)
    for p, enc in prompts.items():
        for name, t in enc.items():
            assert got[p][name].dtype == t.dtype and torch.equal(got[p][name], t)
    assert cache.get("fp2", ["a cat"]) == {}  # another model's fingerprint
    assert len(cache) == 2


def test_reopen_and_bad_input(tmp_path):
    uri = str(tmp_path / "embeddings.lance")
    EmbeddingCache(uri).put("fp", {"x": encoding(3, 0)})
    assert torch.equal(EmbeddingCache(uri).get("fp", ["x"])["x"]["prompt_embeds"], encoding(3, 0)["prompt_embeds"])
    with pytest.raises(ValueError, match="batch dim 1"):
        EmbeddingCache(uri).put("fp", {"y": {"prompt_embeds": torch.zeros(2, 3)}})
