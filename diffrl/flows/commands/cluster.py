"""`diffrl cluster status` and `diffrl cluster stop RUN`: the warm Ray actors of diffrl runs.

Both connect to the cluster at --address (else RAY_ADDRESS, else a local `ray start --head`).
"""

from __future__ import annotations

import argparse
import time


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "cluster",
        help="list or remove the Ray actors of runs (cluster.mode=ray)",
        description="`diffrl cluster status [RUN]` lists diffrl's actors on the Ray cluster (devices, what they "
        "hold); `diffrl cluster stop RUN` removes a run's actors and frees its GPUs.",
    )
    sub = p.add_subparsers(dest="cluster_command", required=True)
    status = sub.add_parser("status", help="list diffrl's actors, their devices and what they hold")
    status.add_argument("run_name", nargs="?", default=None, help="only this run's actors")
    stop = sub.add_parser("stop", help="remove a run's actors and its placement group")
    stop.add_argument("run_name", help="the run.name whose actors to remove")
    for q in (status, stop):
        q.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or auto)")


def _connect(address: str | None) -> None:
    from diffrl.engines import cluster

    try:
        cluster.connect(address)
    except ConnectionError as e:
        raise ValueError(
            f"--address {address or 'auto'}: no Ray cluster reachable ({e}); start one with "
            "`ray start --head` or pass --address HOST:PORT"
        ) from e


def run(args: argparse.Namespace) -> int:
    from diffrl.engines import cluster

    _connect(args.address)
    if args.cluster_command == "status":
        actors = cluster.list_actors(args.run_name)
        if not actors:
            print("no diffrl actors on this cluster")
        for a in actors:
            if "error" in a:
                print(f"{a['name']:<32} UNRESPONSIVE {a['error']}")
                continue
            if "commit_lock" in a:  # the run's lock for commits to an object store (diffrl/engines/commit_lock.py)
                lock = a["commit_lock"]
                print(
                    f"{a['name']:<32} node {a['node'][:8]} pid {a['pid']:<7} commit lock: {lock['grants']} commits, "
                    f"held now {lock['held'] or 'none'}"
                )
                continue
            gpus = ",".join(a["gpus"]) or "-"
            print(
                f"{a['name']:<32} node {a['node'][:8]} pid {a['pid']:<7} gpus {gpus:<6} threads {a['threads']:<3} "
                f"device {a['device']:<7} "
                f"holds {'+'.join(a['holds']):<30} policy_version {a['policy_version']} "
                f"up {time.time() - a['created']:.0f} s {a['model']}"
            )
        return 0
    removed = cluster.stop_actors(args.run_name)
    if not removed:
        print(f"run {args.run_name!r} has no actors on this cluster")
    for name in removed:
        print(f"removed {name}")
    return 0
