"""fsspec helpers so local paths and object-store URIs (s3://, gs://, memory://) work the same.

Checkpoints and artifacts go through these; Lance tables take the same URIs and `storage_options`
directly. `storage_options` are passed to the fsspec filesystem unchanged (their keys are the
backend's own: s3fs `key`/`secret`/`client_kwargs`, gcsfs `token`, ...).
"""

from __future__ import annotations

import posixpath
from typing import IO, Any

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


def filesystem(uri: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for `uri` and the path inside it."""
    return url_to_fs(str(uri), **(storage_options or {}))


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
