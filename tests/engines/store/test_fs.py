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


def test_the_longest_root_holding_a_uri_wins_and_a_prefix_is_no_folder():
    roots = ["s3://b/runs", "s3://b/runs/a", "s3://b/r"]
    assert fs.longest_root(roots, "s3://b/runs/a/t.lance") == "s3://b/runs/a"
    assert fs.longest_root(roots, "s3://b/runs/ab") == "s3://b/runs"
    assert fs.longest_root(roots, "s3://b/runs") == "s3://b/runs"
    assert fs.longest_root(roots, "s3://b/rx/t.lance") is None


def test_a_checkpoint_is_on_the_disk_before_latest_json_names_it(tmp_path, monkeypatch):
    """A power cut must leave the previous checkpoint or the new one whole: every file of the staged folder, the
    folder holding the renamed step_<k> and latest.json itself are flushed (fsync) before the pointer is replaced.
    os.fsync and os.replace are recorded as they happen (the disk itself is not cut here)."""
    import os

    from diffrl.engines.step.update import _write_and_commit

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    run = tmp_path / "run"

    def write(staged):
        os.makedirs(staged)
        with open(os.path.join(staged, "trainable.safetensors"), "wb") as f:
            f.write(b"weights")

    final = _write_and_commit(str(run), 0, 1, {"loss": 1.0}, write, 0)
    checkpoints = str(run / "checkpoints")
    order = [e for e in events if e[1].startswith(checkpoints)]
    renamed = order.index(("replace", final))
    pointer = order.index(("replace", f"{checkpoints}/latest.json"))
    synced_before = {path for kind, path in order[:renamed] if kind == "fsync"}
    assert {f"{final}.tmp/trainable.safetensors", f"{final}.tmp/update_metrics.json"} <= synced_before, order
    assert ("fsync", checkpoints) in order[renamed:pointer]  # the rename into checkpoints/ is on the disk
    assert ("fsync", f"{checkpoints}/latest.json.tmp") in order[renamed:pointer]
    assert ("fsync", checkpoints) in order[pointer:]  # and so is the pointer's
