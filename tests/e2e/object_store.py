"""An S3-compatible object store on loopback for tests: moto's server mode, with one empty bucket.

moto stands in for S3 (nothing on the CI machine reaches a real one). It keeps the objects in its own process, so
every process of a test (Ray nodes and actors too) reaches the same bucket through its endpoint. It does not honour
`If-None-Match` on PUT: a run writing from several processes needs diffrl's commit lock there
(diffrl/engines/store/commits.py).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from typing import Iterator

import s3fs

BUCKET = "diffrl-runs"
SECRET = "moto-secret-key"


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 at a free port, with the empty bucket BUCKET; yields its endpoint URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):  # it listens within a few seconds
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        s3(endpoint).mkdir(BUCKET)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


def s3(endpoint: str) -> s3fs.S3FileSystem:
    """An s3fs filesystem on the server (no cached listings: a test reads what the run wrote since)."""
    return s3fs.S3FileSystem(
        key="moto", secret=SECRET, client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True
    )


def storage_options(endpoint: str) -> dict[str, str]:
    """run.storage_options in Lance's object_store keys, as docs/operations.md shows them."""
    return {
        "aws_endpoint": endpoint,
        "aws_access_key_id": "moto",
        "aws_secret_access_key": SECRET,
        "aws_region": "us-east-1",
        "allow_http": "true",
    }


def run_overrides(endpoint: str, name: str) -> list[str]:
    """The overrides that put run `name` in the bucket: run.root, run.name and run.storage_options."""
    options = json.dumps(storage_options(endpoint))
    return [f"run.root=s3://{BUCKET}/runs", f"run.name={name}", f"run.storage_options={options}"]
