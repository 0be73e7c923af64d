"""Where the engines of a run live.

Embedded default (`cluster.mode: local`): the run's `Engines` (diffrl/engines/handle.py), in-process objects in this
registry, found by run name, so a Prefect task only carries (run, step, chunk) and runs its stage function on the warm
engines here.

Ray mode (`cluster.mode: ray`): the engines are named, detached Ray actors in the "diffrl"
namespace, created once per run name and found again by later flow runs (warm models across steps
and across runs). Each actor is one engine replica holding what the local run holds (model, rollout,
trainer, reward pool, store and the step's memory with its background writer and run-ahead worker) and
runs stage functions on them; callers wait at most `cluster.actor_timeout_s`, so a dead or stuck actor
fails the caller with the actor's error instead of hanging. Both kinds of handle are an `EngineHandle`: the same
`run(role, fn, *args)` and `run_one(role, index, fn, *args)`. The actor body is diffrl/engines/host.py.

    <run>/engine, <run>/engine-1 ... <run>/engine-{N-1} with cluster.gpus: N (one GPU each; the trainers are
    one FSDP2 group: LoRA replicated, the rollout on the trainer's module, or in an asynchronous run on its own
    behaviour copy beside it; full fine-tuning sharded, the rollout on an unsharded copy in the same actor)

A role names which replicas run a call: "trainer" every one at once (a collective stage), "rollout" and "reward"
the first (validation, logged examples) unless `run_one` picks one.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import TYPE_CHECKING, Any, Callable

from diffrl.engines.actors import NAMESPACE, actor_name, actor_names
from diffrl.engines.handle import EngineHandle, comparable, config_changes

if TYPE_CHECKING:
    from diffrl.configs.schema import ExperimentConfig
    from diffrl.engines.store.trajectories import TrajectoryStore

_LOCK = threading.Lock()
_ENGINES: dict[str, EngineHandle] = {}

ROLES = ("rollout", "trainer", "reward")
# Environment the Ray side needs from the driver (tasks report to the same Prefect server).
FORWARDED_ENV = (
    "PREFECT_API_URL",
    "PREFECT_API_KEY",
    "PREFECT_LOGGING_LEVEL",
    "DIFFRL_CACHE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "DIFFRL_INJECT_FAULT",  # fault drills reach the stages in the actors (set when the actors start)
)


class ReplicaLost(RuntimeError):
    """An engine replica's process died mid-call (its node went away, it was killed, the host ran out of memory): the
    replicas' process group is broken, so the run stops; the message names the replica, its node and the stage."""


def put(run_name: str, engines: EngineHandle) -> None:
    """Register the engines (or the Ray handle) of a run in this process (replacing any previous ones)."""
    with _LOCK:
        _ENGINES[run_name] = engines


def registered(run_name: str) -> EngineHandle | None:
    """The engines registered under `run_name` in this process, or None."""
    with _LOCK:
        return _ENGINES.get(run_name)


def get(run_name: str) -> EngineHandle:
    """The engines of a run: registered in this process, else (inside a Ray worker) its named actors."""
    with _LOCK:
        if run_name in _ENGINES:
            return _ENGINES[run_name]
    if _in_ray_worker():
        return RayEngines.find(run_name)
    raise RuntimeError(
        f"no engines for run {run_name!r} in this process: run it with `diffrl train` "
        f"(known runs here: {sorted(_ENGINES)})"
    )


def drop(run_name: str) -> None:
    with _LOCK:
        _ENGINES.pop(run_name, None)


def _in_ray_worker() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


# ---- ray mode ------------------------------------------------------------------------------------


def gpus_seen(config: ExperimentConfig) -> int:
    """`cluster.gpus: auto`: the GPUs of the connected Ray cluster."""
    import ray

    total = int(ray.cluster_resources().get("GPU", 0))
    if total < 1:
        raise ValueError(
            "cluster.gpus: auto found no GPUs on the Ray cluster: start Ray with GPUs (`ray start --head "
            "--num-gpus N`) or set cluster.gpus to a number"
        )
    return total


def forwarded_env() -> dict[str, str]:
    """The driver's settings the Ray workers and actors need (runtime_env env_vars): FORWARDED_ENV, every NCCL_*
    (the network the replicas' process group uses between nodes: NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) and the
    driver's PYTHONPATH, made absolute, before the node's own: a user's `module:function` reward imports in the
    replicas as in the driver (docs/rewards.md)."""
    env = {k: v for k, v in os.environ.items() if k in FORWARDED_ENV or k.startswith("NCCL_")}
    paths = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, "${PYTHONPATH}"])  # Ray puts the node's own in place of ${...}
    return env


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` (None: RAY_ADDRESS or a local `ray start --head`)."""
    import ray

    from diffrl.engines.ray_exposure import warn_if_exposed

    if ray.is_initialized():
        return
    on_main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if on_main else None
    ray.init(
        address=address or os.environ.get("RAY_ADDRESS") or "auto",
        namespace=NAMESPACE,
        runtime_env={"env_vars": forwarded_env()},
        log_to_driver=False,
    )
    if callable(sigterm):
        # ray.init replaces the process's SIGTERM handler with its own sys.exit(15): `diffrl train`'s (which stops the
        # run's actors, releases its lock and prints one line: diffrl/flows/interrupts.py) must stay
        signal.signal(signal.SIGTERM, sigterm)
    warn_if_exposed()  # a cluster open to the network without a token: say so (diffrl/engines/ray_exposure.py)


def _resources(config: ExperimentConfig, actors: list[str]) -> dict[str, float]:
    """GPUs each replica asks for: 1 when the cluster has GPUs and the model is not on CPU."""
    import ray

    has_gpus = ray.cluster_resources().get("GPU", 0) >= 1 and config.model.device != "cpu"
    return {a: 1.0 if has_gpus else 0.0 for a in actors}


def _placement_group(run_name: str, gpus: dict[str, float], timeout_s: float):
    """One detached placement group per run reserving the model holders' GPUs (None without GPUs)."""
    import ray
    from ray.util.placement_group import get_placement_group, placement_group

    bundles = [{"GPU": g} for g in gpus.values() if g > 0]
    if not bundles:
        return None
    name = actor_name(run_name, "gpus")
    try:
        pg = get_placement_group(name)
    except ValueError:
        # PACK: the replicas on as few nodes as fit (NVLink within a node); the rest spread over the others
        pg = placement_group(bundles, strategy="PACK", name=name, lifetime="detached")
    if not pg.wait(timeout_seconds=timeout_s):
        raise RuntimeError(
            f"run {run_name!r}: the Ray cluster cannot place {bundles} within {timeout_s:.0f} s "
            f"(cluster resources: {ray.cluster_resources()})"
        )
    return pg


class RayEngines:
    """A run's engines living in named detached Ray actors (its engine replicas): the handle the flow holds.

    `config`, `val_prompts` and `run_uid` are copies; `store` is this process's own view of the run's
    trajectory table (reads for resume checks); models never leave their actors.
    """

    memory = None  # the step's memory lives in each replica (diffrl/engines/step/memory.py), not in this handle

    def __init__(
        self,
        run_name: str,
        config: ExperimentConfig,
        actors: dict[str, Any],
        run_uid: str = "",
        store: TrajectoryStore | None = None,
        val_prompts: list | None = None,
    ):
        self.run_name, self.config, self.actors, self.run_uid = run_name, config, actors, run_uid
        self.store, self.val_prompts = store, val_prompts or []
        self.nodes: dict[str, str] = {}  # actor -> the address of its node (from its attach), for error messages

    @classmethod
    def find(cls, run_name: str) -> "RayEngines":
        """The live actors of `run_name` (from any process connected to the cluster)."""
        import ray

        found = {}
        try:
            first = ray.get_actor(actor_name(run_name, "engine"), namespace=NAMESPACE)
        except ValueError:
            raise RuntimeError(
                f"run {run_name!r} has no actors on this Ray cluster (namespace {NAMESPACE!r}): "
                f"start it with `diffrl train ... cluster.mode=ray run.name={run_name}`"
            ) from None
        info = ray.get(first.describe.remote(), timeout=60)  # the config the actors were built from
        for actor in actor_names(info["config"]):
            try:
                found[actor] = ray.get_actor(actor_name(run_name, actor), namespace=NAMESPACE)
            except ValueError:
                continue
        return cls(run_name, info["config"], found, info["run_uid"])

    def set_run_uid(self, uid: str) -> None:
        """Key the run's task caches by `uid` here and in every replica."""
        self.run_uid = uid
        for name, actor in self.actors.items():
            self.nodes[name] = _node(self.wait(actor.attach.remote(self.config, uid), f"{name}.attach"))

    def members(self) -> list[Any]:
        """Every engine replica, rank order."""
        names = actor_names(self.config)
        missing = [a for a in names if a not in self.actors]
        if missing:
            raise RuntimeError(
                f"run {self.run_name!r}: actors {[actor_name(self.run_name, a) for a in missing]} are not alive "
                f"(they died or were stopped); `diffrl cluster stop {self.run_name}` and rerun `diffrl train` to "
                "start fresh actors from the last checkpoint"
            )
        return [self.actors[a] for a in names]

    def ranks(self, role: str) -> list[Any]:
        """The replicas that run a call of `role`: every one for "trainer" (rank 0 first), else the first."""
        assert role in ROLES, role
        members = self.members()
        return members if role == "trainer" else members[:1]

    def run_one(self, role: str, index: int, fn: Callable, *args: Any) -> Any:
        """`fn(engines, *args)` inside engine replica `index` (modulo their number): its share of a stage, or one
        rank's part of a collective stage (which then needs a call on every rank at once)."""
        actors = self.members()
        return self.wait(actors[index % len(actors)].run.remote(fn, *args), _what(fn, args))

    def run(self, role: str, fn: Callable, *args: Any) -> Any:
        """`fn(engines, *args)` on the replicas of `role` (every rank for "trainer": rank 0's result is returned); an
        error (or a timeout) of any of them fails the caller."""
        refs = [actor.run.remote(fn, *args) for actor in self.ranks(role)]
        return self.wait(refs, _what(fn, args))[0]

    def wait(self, ref: Any, what: str) -> Any:
        """ray.get of one ref or a list of them, within cluster.actor_timeout_s."""
        import ray

        timeout = self.config.cluster.actor_timeout_s
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError as e:
            for r in ref if isinstance(ref, list) else [ref]:
                ray.cancel(r, force=False)
            raise TimeoutError(
                f"run {self.run_name!r}: actor call {what} did not answer within "
                f"cluster.actor_timeout_s={timeout:g} s (stuck or overloaded actor; "
                f"`diffrl cluster status` shows the actors)"
            ) from e
        except ray.exceptions.RayActorError as e:
            raise self._lost(e, what) from e

    def _lost(self, error: Any, what: str) -> ReplicaLost:
        """The one-line error of a replica that died during `what`: which replica, on which node."""
        dead = next((n for n, a in self.actors.items() if a._actor_id.hex() == error.actor_id), "a replica")
        node = self.nodes.get(dead, "an unknown node")
        return ReplicaLost(
            f"run {self.run_name!r}: engine replica {actor_name(self.run_name, dead)} on node {node} died while the "
            f"run waited for its {what}; its other replicas are stopped (their process group is broken). Once the node "
            "is back, rerun the same command: it resumes from the last checkpoint, every committed row kept"
        )

    def describe(self) -> list[dict]:
        import ray

        return (
            [self.wait(a.describe.remote(), f"{name}.describe") for name, a in self.actors.items()]
            if ray.is_initialized()
            else []
        )


def _node(info: dict) -> str:
    """A replica's node as messages name it: its address and Ray node id ("10.0.0.2 (Ray node 1e606f3d)")."""
    return f"{info['node_ip']} (Ray node {info['node'][:8]})"


def _what(fn: Callable, args: tuple) -> str:
    """A stage call for messages: "generate of step 3" (a stage's first argument is its step index)."""
    from diffrl.engines.numbering import step_number

    if args and isinstance(args[0], int) and not isinstance(args[0], bool) and args[0] >= 0:
        return f"{_name(fn)} of step {step_number(args[0])}"
    return _name(fn)


def _name(fn: Callable) -> str:
    """A stage function's name for messages (a stage is a partial of the step core's `_here`: its stage name)."""
    if isinstance(fn, functools.partial):
        return str(fn.args[0]) if fn.args else _name(fn.func)
    return getattr(fn, "__name__", repr(fn))


def _check_warm(config: ExperimentConfig) -> None:
    """ValueError (one line, before any actor starts) when the run already has warm replicas built from another
    config: another number of GPUs, model or training setup."""
    import ray

    first = actor_name(config.run.name, "engine")
    if first not in _run_actor_names(config.run.name):
        return
    try:
        info = ray.get(ray.get_actor(first, namespace=NAMESPACE).describe.remote(), timeout=60)
    except (ValueError, ray.exceptions.RayError):
        return  # gone or not answering: start_actors reports it in its own words
    if "config" in info and comparable(info["config"]) != comparable(config):
        name = config.run.name
        raise ValueError(
            f"run {name!r} has warm engine replicas built from another config ({config_changes(info['config'], config)}"
            f"): `diffrl cluster stop {name}`, then rerun: it resumes from its last checkpoint with fresh replicas"
        )


def _run_actor_names(run_name: str | None = None) -> list[str]:
    """The names of diffrl's named actors on the connected cluster: one run's, or every run's."""
    import ray

    return [
        e["name"]
        for e in ray.util.list_named_actors(all_namespaces=True)
        if e["namespace"] == NAMESPACE and (run_name is None or e["name"].rsplit("/", 1)[0] == run_name)
    ]


def start_actors(config: ExperimentConfig, build: Callable, run_uid: str = "") -> RayEngines:
    """Create-or-get the run's named detached engine replicas on the connected cluster (model built once per actor)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    run_name, timeout = config.run.name, config.cluster.actor_timeout_s
    from diffrl.engines.commit_lock import serialise_commits
    from diffrl.engines.host import EngineHost

    _check_warm(config)
    serialise_commits(config)  # several writers of one run's tables on an object store: one commit at a time
    names = actor_names(config)
    gpus = _resources(config, names)
    pg = _placement_group(run_name, gpus, timeout)
    host = ray.remote(EngineHost)
    actors, bundle = {}, 0
    env = {"env_vars": forwarded_env()}
    for rank, actor in enumerate(names):
        options = dict(
            name=actor_name(run_name, actor),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            num_gpus=gpus[actor],
            runtime_env=env,
            max_restarts=0,
            # the flow's stage calls reach a replica at once (a chunk's score while the next chunk generates, a
            # settle beside a stuck stage); the replica's engines take concurrent stage calls, as in one process
            max_concurrency=16,
        )
        if gpus[actor] > 0:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
            bundle += 1
        actors[actor] = host.options(**options).remote(build, config, actor, run_uid, rank, len(names))
    handle = RayEngines(run_name, config, actors, run_uid)
    if len(names) > 1:  # engine replicas: one process group, rank 0's address
        ranks = handle.members()
        address, port = handle.wait(ranks[0].rendezvous.remote(), "replica rendezvous")
        handle.wait([r.join.remote(address, port) for r in ranks], "engine replicas (process group and build)")
    # a warm actor from an earlier flow run answers `attach`; a new one answers once its build is done
    for name, actor in actors.items():
        handle.nodes[name] = _node(handle.wait(actor.attach.remote(config, run_uid), f"{name} (build/attach)"))
    return handle


def list_actors(run_name: str | None = None) -> list[dict]:
    """diffrl's live actors on the connected cluster (all runs, or one run's), each with its description."""
    import ray

    out = []
    for name in _run_actor_names(run_name or None):
        handle = ray.get_actor(name, namespace=NAMESPACE)
        try:
            info = ray.get(handle.describe.remote(), timeout=30)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
            info = {"error": f"{type(e).__name__}: {e}"}
        info.pop("config", None)
        out.append({"name": name, "actor_id": handle._actor_id.hex(), **info})
    return sorted(out, key=lambda a: a["name"])


def stop_actors(run_name: str) -> list[str]:
    """Kill the run's actors and free its placement group; returns the names removed."""
    import ray
    from ray.util.placement_group import get_placement_group, remove_placement_group

    removed = []
    for name in _run_actor_names(run_name):
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue
        ray.kill(handle, no_restart=True)
        removed.append(name)
    removed.sort()  # list_named_actors has no fixed order
    try:
        remove_placement_group(get_placement_group(actor_name(run_name, "gpus")))
        removed.append(actor_name(run_name, "gpus"))
    except ValueError:
        pass
    drop(run_name)
    return removed
