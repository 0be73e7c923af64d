"""fsspec helpers so local paths and object-store URIs (s3://, gs://, memory://) work the same.

Checkpoints, run.json and artifacts go through these; Lance tables take the same URIs and
`storage_options` directly. One set of options serves both: for s3:// the object_store keys Lance
reads (`aws_endpoint`, `aws_access_key_id`, `aws_secret_access_key`, `aws_region`, `allow_http`,
`aws_session_token`) are translated to s3fs's (`s3fs_options`); any other key goes to the fsspec
filesystem unchanged (s3fs `client_kwargs`, gcsfs `token`, ...).

The run's files are opened in many places (checkpoints, latest.json, run.json, stored_rows.json),
so the run root's options are given once, by `use_options`: a URI under that root opened without
options of its own gets them.
"""

from __future__ import annotations

import builtins
import json
import os
import posixpath
import shutil
from typing import IO, Any, Iterable

import fsspec
from fsspec.core import url_to_fs


def _split_scheme(uri: str) -> tuple[str, str]:
    """("s3://", "bucket/key") for a URI, ("", path) for a local path."""
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        return scheme + "://", rest
    return "", uri


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a local path or URI with "/" (keeps the scheme).

    >>> join("s3://bucket/runs", "exp", "trajectories.lance")
    's3://bucket/runs/exp/trajectories.lance'
    """
    scheme, rest = _split_scheme(str(uri))
    for part in parts:
        if "://" in part:
            raise ValueError(f"fs.join: part {part!r} is a URI; only relative parts can be joined")
    return scheme + posixpath.join(rest, *[str(p).strip("/") for p in parts if p])


def parent(uri: str) -> str:
    """The directory holding `uri` (same scheme)."""
    scheme, rest = _split_scheme(str(uri))
    return scheme + posixpath.dirname(rest.rstrip("/"))


def basename(uri: str) -> str:
    """The last path component of `uri`."""
    return posixpath.basename(_split_scheme(str(uri))[1].rstrip("/"))


# Lance's object_store keys and the s3fs arguments they become (a key in client_kwargs goes to botocore's client)
_S3FS_KEYS = {"aws_access_key_id": "key", "aws_secret_access_key": "secret", "aws_session_token": "token"}
_S3FS_CLIENT_KEYS = {"aws_endpoint": "endpoint_url", "aws_endpoint_url": "endpoint_url", "aws_region": "region_name"}
_LANCE_ONLY = {"allow_http"}  # s3fs takes http from the endpoint's scheme
_OPTIONS: dict[str, dict] = {}  # root URI -> its storage_options (use_options)


def is_uri(path: str) -> bool:
    """Whether `path` is an fsspec URI (s3://, memory://, ...) rather than a local path."""
    return "://" in str(path)


def use_options(root: str, storage_options: dict | None) -> None:
    """Open every URI under `root` that is given no options of its own with `storage_options` (a run's root and
    run.storage_options: the run's files are opened in many places); a local root needs none."""
    if is_uri(root) and storage_options:
        _OPTIONS[str(root).rstrip("/")] = dict(storage_options)


def longest_root(roots: Iterable[str], uri: str) -> str | None:
    """The longest of `roots` that is `uri` or a folder holding it (None for none).

    >>> longest_root(["s3://b/runs", "s3://b/runs/a"], "s3://b/runs/a/t.lance"), longest_root(["s3://b/r"], "s3://b/rx")
    ('s3://b/runs/a', None)
    """
    uri = str(uri)
    holding = [root for root in roots if uri == root or uri.startswith(root + "/")]
    return max(holding, key=len) if holding else None


def options_for(uri: str) -> dict:
    """The storage_options `use_options` gave the longest root holding `uri` ({} for none)."""
    root = longest_root(_OPTIONS, uri)
    return dict(_OPTIONS[root]) if root is not None else {}


def s3fs_options(storage_options: dict) -> dict:
    """s3fs's arguments for `storage_options` written with Lance's object_store keys (as Lance takes them, strings
    included: "true"); s3fs's own keys pass unchanged.

    >>> s3fs_options({"aws_endpoint": "http://127.0.0.1:9000", "aws_access_key_id": "a", "allow_http": "true"})
    {'key': 'a', 'client_kwargs': {'endpoint_url': 'http://127.0.0.1:9000'}}
    """
    out: dict = {}
    client = dict(storage_options.get("client_kwargs") or {})
    for name, value in storage_options.items():
        if name in _S3FS_KEYS:
            out[_S3FS_KEYS[name]] = value
        elif name in _S3FS_CLIENT_KEYS:
            client[_S3FS_CLIENT_KEYS[name]] = value
        elif name not in _LANCE_ONLY and name != "client_kwargs":
            out[name] = value
    if client:
        out["client_kwargs"] = client
    return out


def fsspec_options(uri: str, storage_options: dict | None = None) -> dict:
    """The fsspec filesystem arguments for `uri`: `storage_options` (or those `use_options` gave its root), in
    s3fs's keys for s3://."""
    options = options_for(uri) if storage_options is None else dict(storage_options)
    return s3fs_options(options) if str(uri).startswith(("s3://", "s3a://")) else options


def filesystem(uri: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for `uri` and the path inside it."""
    return url_to_fs(str(uri), **fsspec_options(uri, storage_options))


def exists(uri: str, storage_options: dict | None = None) -> bool:
    """Whether a file or directory exists at `uri`."""
    fs, path = filesystem(uri, storage_options)
    return fs.exists(path)


def makedirs(uri: str, storage_options: dict | None = None, exist_ok: bool = True) -> None:
    """Create the directory `uri` and its parents (a no-op on stores without directories)."""
    fs, path = filesystem(uri, storage_options)
    fs.makedirs(path, exist_ok=exist_ok)


def open(uri: str, mode: str = "rb", storage_options: dict | None = None, **kwargs: Any) -> IO:  # noqa: A001
    """Open a file for reading or writing; parent directories are created for writes."""
    fs, path = filesystem(uri, storage_options)
    if any(m in mode for m in "wax"):
        fs.makedirs(posixpath.dirname(path) or ".", exist_ok=True)
    return fs.open(path, mode, **kwargs)


def listdir(uri: str, storage_options: dict | None = None) -> list[str]:
    """Names (not paths) of the entries directly under the directory `uri`, sorted."""
    fs, path = filesystem(uri, storage_options)
    return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))


def remove(uri: str, storage_options: dict | None = None, recursive: bool = False) -> None:
    """Delete a file (or a directory tree with recursive=True)."""
    fs, path = filesystem(uri, storage_options)
    fs.rm(path, recursive=recursive)


def remove_tree(uri: str) -> None:
    """Delete the folder `uri` and all it holds; nothing when it does not exist (shutil.rmtree(ignore_errors))."""
    fs, path = filesystem(uri)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def isdir(uri: str) -> bool:
    """Whether `uri` is a folder (on an object store: a prefix holding objects)."""
    fs, path = filesystem(uri)
    return fs.isdir(path)


def move(src: str, dst: str) -> None:
    """Move the file or folder `src` to `dst` (same filesystem): a rename locally, a copy and a delete on an object
    store (not atomic there: nothing may rely on it for a commit)."""
    if not is_uri(src):
        os.replace(src, dst)
        return
    fs, path = filesystem(src)
    fs.mv(path, filesystem(dst)[1], recursive=True)


def snapshot(src: str, dst: str) -> None:
    """Copy the folder `src` to the local folder `dst` so that removing `src` afterwards leaves `dst` whole: hard links
    on the same local disk (no bytes copied), else a copy; from an object store a download. FileNotFoundError when
    a file of `src` goes while it is taken."""
    if is_uri(src):
        fs, path = filesystem(src)
        fs.get(path.rstrip("/") + "/", dst.rstrip("/") + "/", recursive=True)
        return
    for folder, _, files in os.walk(src):
        target = os.path.join(dst, os.path.relpath(folder, src))
        os.makedirs(target, exist_ok=True)
        for name in files:
            try:
                os.link(os.path.join(folder, name), os.path.join(target, name))
            except FileNotFoundError:
                raise
            except OSError:  # another disk, or links not allowed there
                shutil.copy2(os.path.join(folder, name), os.path.join(target, name))


def write_json(uri: str, value: Any, *, indent: int | None = None) -> None:
    """Write `value` as the JSON file `uri` in one piece (write_text)."""
    write_text(uri, json.dumps(value, indent=indent))


def write_text(uri: str, data: str) -> None:
    """Write the text file `uri` in one piece: locally through a .tmp file, flushed to the disk, and a rename (the
    rename flushed too: a power cut leaves the old file or the new one, never an empty one); on an object store one
    PUT, which readers see whole or not at all."""
    if is_uri(uri):
        with open(uri, "w") as f:
            f.write(data)
        return
    folder = os.path.dirname(uri) or "."
    os.makedirs(folder, exist_ok=True)
    with builtins.open(uri + ".tmp", "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(uri + ".tmp", uri)
    sync_dir(folder)


def sync_tree(uri: str) -> None:
    """Flush every file under the local folder `uri` and the folder itself to the disk, so that what a commit
    (a rename, a pointer) names next survives a power cut; nothing to do on an object store, where a PUT is durable
    when it returns."""
    if is_uri(uri):
        return
    for folder, _, files in os.walk(uri):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        sync_dir(folder)


def sync_dir(folder: str) -> None:
    """Flush the local folder's entries (a rename into it, a new file) to the disk; nothing on an object store."""
    if is_uri(folder):
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(uri: str) -> Any:
    """The value of the JSON file `uri`."""
    with open(uri, "r") as f:
        return json.load(f)
