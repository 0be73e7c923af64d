"""fsspec helpers behave the same on local paths and memory://."""

import pytest

from diffrl.engines.store import fs


@pytest.mark.parametrize("root", ["local", "memory://fs-test"])
def test_write_read_list_remove(tmp_path, root):
    root = str(tmp_path) if root == "local" else root
    path = fs.join(root, "ckpt", "step_1", "model.bin")
    with fs.open(path, "wb") as f:
        f.write(b"weights")
    assert fs.exists(path) and fs.listdir(fs.join(root, "ckpt")) == ["step_1"]
    with fs.open(path, "rb") as f:
        assert f.read() == b"weights"
    fs.makedirs(fs.join(root, "other"))
    fs.remove(fs.join(root, "ckpt"), recursive=True)
    assert not fs.exists(path)


def test_join_keeps_scheme():
    assert fs.join("s3://bucket/runs", "exp", "trajectories.lance") == "s3://bucket/runs/exp/trajectories.lance"
    assert fs.parent("gs://b/runs/exp/trajectories.lance") == "gs://b/runs/exp"
    assert fs.basename("/x/y/trajectories.lance/") == "trajectories.lance"
    with pytest.raises(ValueError, match="is a URI"):
        fs.join("/a", "s3://b")
