"""Is the Ray cluster this process joined open to the network without authentication?

Whoever can reach a Ray cluster's ports can run code in it, unless it runs with token authentication
(`RAY_AUTH_MODE=token`, Ray >= 2.52). Ray 2.60 binds its GCS and raylet ports on all interfaces, whatever
`--node-ip-address` says (a single-machine `ray start --head` answers on the machine's LAN address too), so
"listening beyond loopback" is checked, not assumed: each of the cluster's ports on this host is tried on each of
this host's other addresses. A driver that joined without a token joined a cluster without authentication (a
cluster with it refuses such a driver), so the check runs only then.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

log = logging.getLogger("diffrl")

CONNECT_TIMEOUT_S = 0.5  # per (address, port): a local port answers in microseconds or not at all
_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def local_addresses() -> list[str]:
    """This host's addresses other than loopback (IPv4 and IPv6, link-local left out)."""
    try:
        import psutil  # a dependency of ray[default]

        found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family in _FAMILIES]
    except ImportError:
        found = [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)]
    addresses = []
    for address in found:
        ip = ipaddress.ip_address(address.split("%")[0])
        if not (ip.is_loopback or ip.is_link_local) and str(ip) not in addresses:
            addresses.append(str(ip))
    return addresses


def answers(host: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether a TCP connection to host:port is accepted."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def exposure(gcs_address: str, ports: list[int], addresses: list[str]) -> str | None:
    """Where a cluster whose GCS is at `gcs_address` (host:port) is reachable beyond loopback: its GCS address
    itself when that is not a loopback one, else the first of its local `ports` that answers on one of this host's
    other `addresses`; None when none does."""
    host, _, port = gcs_address.rpartition(":")
    host = host.strip("[]")
    if not _is_loopback(host):
        return f"its GCS listens on {gcs_address}"
    for address in addresses:
        for candidate in [int(port), *ports]:
            if answers(address, candidate):
                return f"port {candidate} answers on {address}"
    return None


def warn_if_exposed() -> str | None:
    """After `ray.init`: warn (and return the warning) when the cluster joined is reachable beyond loopback and
    this process joined it without an authentication token."""
    import ray
    from ray._raylet import AuthenticationMode, get_authentication_mode

    if get_authentication_mode() == AuthenticationMode.TOKEN:
        return None
    gcs_address = ray.get_runtime_context().gcs_address
    here = {"127.0.0.1", "::1", "localhost", *local_addresses()}
    ports = [int(n["NodeManagerPort"]) for n in ray.nodes() if n.get("Alive") and n["NodeManagerAddress"] in here]
    where = exposure(gcs_address, ports, local_addresses())
    if where is None:
        return None
    message = (
        f"the Ray cluster at {gcs_address} is reachable beyond loopback ({where}) and runs without "
        "authentication: anyone who can reach this machine can run code in it. Start it with token "
        "authentication (RAY_AUTH_MODE=token, in the environment of `ray start` and of diffrl; "
        "docs/operations.md section 5), or keep it where no one else can connect"
    )
    log.warning(message)
    return message
