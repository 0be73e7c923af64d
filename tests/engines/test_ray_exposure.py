"""Whether a cluster's ports answer beyond loopback (diffrl/engines/ray_exposure.py), on real sockets."""

from __future__ import annotations

import socket

import pytest

from diffrl.engines.ray_exposure import exposure, local_addresses


def _listening(host: str) -> socket.socket:
    server = socket.socket()
    server.bind((host, 0))
    server.listen()
    return server


def test_a_port_bound_to_all_interfaces_is_found_and_a_loopback_one_is_not():
    """What Ray 2.60 does with its GCS and raylet ports (all interfaces) is reported; a port bound to 127.0.0.1
    only is not; a GCS on a non-loopback address is reported without probing."""
    addresses = local_addresses()
    if not addresses:
        pytest.skip("this machine has no address but loopback (a private network namespace)")
    with _listening("0.0.0.0") as wide, _listening("127.0.0.1") as narrow:
        wide_port, narrow_port = wide.getsockname()[1], narrow.getsockname()[1]
        found = exposure(f"127.0.0.1:{narrow_port}", [wide_port], addresses)
        assert found == f"port {wide_port} answers on {addresses[0]}"
        assert exposure(f"127.0.0.1:{narrow_port}", [], addresses) is None
    assert exposure("10.1.2.3:6379", [], []) == "its GCS listens on 10.1.2.3:6379"
