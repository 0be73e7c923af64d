"""diffrl/engines/train/tensor_file.py: safetensors written piece by piece, read back by the safetensors library."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load

from diffrl.engines.train.tensor_file import DTYPES, write_tensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"{dtype}".replace("torch.", ""): torch.randn(3, 5, generator=g).to(dtype) for dtype in DTYPES}
    out["scalar"] = torch.tensor(7.5)  # 0-dim: AdamW's step count
    out["empty"] = torch.zeros(0, 4)
    out["strided"] = torch.arange(24.0).reshape(4, 6).t()  # not contiguous: written in row-major order
    out["bool_mask"] = torch.tensor([[True, False, True]])
    return out


def test_round_trip_through_the_safetensors_library():
    tensors, buffer = _tensors(), io.BytesIO()
    digest = write_tensors(buffer, tensors, metadata={"format": "pt", "step": 3})
    data = buffer.getvalue()
    assert digest == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    loaded = st_load(data)
    assert sorted(loaded) == sorted(tensors)
    for name, want in tensors.items():
        got = loaded[name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    assert int.from_bytes(data[:8], "little") % 8 == 0  # the data starts 8-byte aligned, as the library writes it


def test_metadata_is_read_back(tmp_path):
    path = tmp_path / "a.safetensors"
    with open(path, "wb") as f:
        write_tensors(f, {"w": torch.ones(2)}, metadata={"format": "pt"})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and torch.equal(f.get_tensor("w"), torch.ones(2))


def test_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="no safetensors name"):
        write_tensors(io.BytesIO(), {"c": torch.ones(2, dtype=torch.complex64)})
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU tensors"):
            write_tensors(io.BytesIO(), {"g": torch.ones(2, device="cuda")})
