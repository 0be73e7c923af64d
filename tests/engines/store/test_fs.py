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


@pytest.mark.parametrize("root", ["local", "memory://fs-json"])
def test_json_move_and_remove_tree(tmp_path, root):
    root = str(tmp_path) if root == "local" else root
    staged = fs.join(root, "checkpoints", "step_1.tmp")
    fs.write_json(fs.join(staged, "update_metrics.json"), {"loss": 1.5})
    fs.move(staged, fs.join(root, "checkpoints", "step_1"))
    assert fs.read_json(fs.join(root, "checkpoints", "step_1", "update_metrics.json")) == {"loss": 1.5}
    assert fs.isdir(fs.join(root, "checkpoints", "step_1")) and not fs.exists(staged)
    fs.remove_tree(fs.join(root, "checkpoints"))
    fs.remove_tree(fs.join(root, "checkpoints"))  # gone already: nothing
    assert not fs.exists(fs.join(root, "checkpoints", "step_1"))


def test_lance_keys_become_s3fs_arguments():
    lance = {
        "aws_endpoint": "http://127.0.0.1:9000",
        "aws_access_key_id": "AK",
        "aws_secret_access_key": "SK",
        "aws_session_token": "ST",
        "aws_region": "eu-west-1",
        "allow_http": "true",
        "anon": False,
    }
    assert fs.s3fs_options(lance) == {
        "key": "AK",
        "secret": "SK",
        "token": "ST",
        "anon": False,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
    }
    s3fs_keys = {"key": "AK", "client_kwargs": {"endpoint_url": "http://h:1"}}
    assert fs.s3fs_options(s3fs_keys) == s3fs_keys  # s3fs's own keys pass unchanged
    assert fs.fsspec_options("gs://b/x", {"token": "anon"}) == {"token": "anon"}  # only s3 is translated


def test_a_root_s_options_serve_every_uri_under_it():
    fs.use_options("s3://fs-test-bucket/runs", {"aws_access_key_id": "AK"})
    assert fs.fsspec_options("s3://fs-test-bucket/runs/x/checkpoints/latest.json") == {"key": "AK"}
    assert fs.fsspec_options("s3://fs-test-bucket/runs") == {"key": "AK"}
    assert fs.fsspec_options("s3://fs-test-bucket/runs2/x") == {}  # another root
    assert fs.fsspec_options("s3://fs-test-bucket/runs/x", {"key": "other"}) == {"key": "other"}  # given: used
    fs.use_options("/local/runs", {"aws_access_key_id": "AK"})  # a local root needs none
    assert fs.options_for("/local/runs/x") == {}
