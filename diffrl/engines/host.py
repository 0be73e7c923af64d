"""The body of one named detached Ray actor of a run, an engine replica (diffrl/engines/cluster.py places them): it
builds the engines of the local run once, joins the replicas' process group when it is one of several, and runs stage
functions on them.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from diffrl.engines.actors import actor_threads
from diffrl.engines.commit_lock import serialise_commits
from diffrl.engines.handle import Engines, comparable, config_changes

_BUILDS = 0  # engine builds in this process (an actor process: 1 while it stays warm)


class EngineHost:
    """The body of one named detached actor: builds the engines once, then runs stage functions.

    `build(config, actor)` is passed by reference (flows.build.build_engines), so this module stays
    free of model code; Ray ships functions of importable modules by name, never their bytecode.
    """

    def __init__(self, build: Callable, config: Any, actor: str, run_uid: str = "", rank: int = 0, world: int = 1):
        self.actor, self.rank, self.world = actor, rank, world
        self._pending = (build, config, run_uid)
        self.engines: Engines | None = None
        self.created = time.time()
        self.threads = 1
        self._set_threads(config)
        if world == 1:
            self._build()
        # A data-parallel trainer rank builds in `join`, once every rank knows where rank 0 listens.

    def _set_threads(self, config: Any) -> None:
        """torch's CPU threads in this actor (cluster.actor_threads), for the build and every stage after it."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        cpus = next((n["Resources"].get("CPU", 1.0) for n in ray.nodes() if n["NodeID"] == node), 1.0)
        self.threads = actor_threads(config, cpus)
        os.environ["OMP_NUM_THREADS"] = str(self.threads)  # for what reads it later (child processes, numexpr)
        self._use_threads()

    def _use_threads(self) -> None:
        """Apply the actor's thread count in the calling thread: the actor answers calls on a pool of threads, and
        torch's count is per thread (a thread started after it was set inherits it, one started before does not)."""
        import torch

        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def _build(self) -> None:
        global _BUILDS
        build, config, run_uid = self._pending
        serialise_commits(config)  # before the store opens: the replicas share the run's tables
        self.engines = build(config, "engine")
        self.engines.run_uid = run_uid
        self._attached = False
        _BUILDS += 1

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: this node's address and a free port for the torch.distributed store."""
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, address: str, port: int) -> None:
        """Join the replicas' process group (NCCL on GPUs, gloo on CPUs), then build: the trainer shards its model
        with FSDP2 over the group. A warm (already built) rank does nothing."""
        if self.engines is not None:
            return
        self._use_threads()
        import datetime

        import torch
        import torch.distributed as dist

        config = self._pending[1]
        os.environ.update(
            MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0"
        )
        backend = "nccl" if torch.cuda.is_available() and config.model.device != "cpu" else "gloo"
        dist.init_process_group(
            backend,
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=config.cluster.actor_timeout_s),
        )
        self._build()

    def attach(self, config: Any, run_uid: str) -> dict:
        """A later flow run of the same run name: same model and training setup, fresh run settings."""
        if comparable(self.engines.config) != comparable(config):
            raise ValueError(
                f"the warm actors of run {config.run.name!r} were built from another config "
                f"({config_changes(self.engines.config, config)} differ); remove them with "
                f"`diffrl cluster stop {config.run.name}` or use another run.name"
            )
        if self._attached:  # a later flow run: the step's memory starts afresh (what it held ended with that run)
            self.engines.memory.drain()
            self.engines.memory.reset()
        self._attached = True
        self.engines.config = config
        self.engines.run_uid = run_uid
        self._set_threads(config)  # cluster.actor_threads may change between flow runs
        return self.describe()

    def run(self, fn: Callable, *args: Any) -> Any:
        self._use_threads()
        return fn(self.engines, *args)

    def describe(self) -> dict:
        """What `diffrl cluster status` shows: role, process, devices and what the actor holds."""
        import ray
        import torch

        self._use_threads()
        e = self.engines
        if e is None:
            return {
                "actor": self.actor,
                "pid": os.getpid(),
                "holds": [],
                "rank": self.rank,
                "error": "not built: waiting for the other replicas to join",
            }
        holds = [name for name in ("adapter", "rollout", "trainer", "reward", "store") if getattr(e, name) is not None]
        return {
            "actor": self.actor,
            "rank": self.rank,
            "world": self.world,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "threads": torch.get_num_threads(),
            "device": str(getattr(e.adapter, "device", "cpu")),
            "holds": holds,
            "model": e.model_path if e.adapter is not None else "",
            "builds": _BUILDS,
            "policy_version": e.policy_version if e.adapter is not None else None,
            "created": self.created,
            "config": e.config,
            "run_uid": e.run_uid,
        }
