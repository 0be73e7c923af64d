"""Where the engines of a run live.

Embedded default (`cluster.mode: local`): in-process objects in this registry, found by run name, so
a Prefect task only carries (run, step, chunk) and runs its stage function on the warm engines here.

Ray mode (`cluster.mode: ray`): the engines are named, detached Ray actors in the "diffrl"
namespace, created once per run name and found again by later flow runs (warm models across steps
and across runs). Each actor holds one role's engines (see ROLES) and runs stage functions on them;
callers wait at most `cluster.actor_timeout_s`, so a dead or stuck actor fails the caller with the
actor's error instead of hanging. Both kinds of handle expose the same `run(role, fn, *args)` and
`run_one(role, index, fn, *args)`. The actor body is diffrl/engines/host.py.

    colocated: <run>/engine  (adapter + rollout + trainer on the same GPUs: weights shared, no copy)
               <run>/engine-1 ... <run>/engine-{N-1} with cluster.gpus: N (replicas, one GPU each; the trainers
               are one FSDP2 group: LoRA replicated, the rollout on the trainer's module; full fine-tuning sharded,
               the rollout on an unsharded copy in the same actor)
               <run>/reward  (reward pool + store, on CPUs; <run>/reward-1 ... with cluster.reward_actors)
    split:     <run>/rollout (its own adapter copy, own GPU)   <run>/trainer (adapter + trainer, own GPU)
               <run>/trainer-1 ... with cluster.trainers: N (data-parallel trainer ranks)
               <run>/reward
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # annotations only: this module stays importable without the model stack
    from diffrl.configs.schema import ExperimentConfig
    from diffrl.engines.reward.multi import MultiReward
    from diffrl.engines.rollout.engine import RolloutEngine
    from diffrl.engines.step.memory import StepMemory
    from diffrl.engines.store.preference import PreferenceCache
    from diffrl.engines.store.prompts import PromptRecord, PromptSampler
    from diffrl.engines.store.trajectories import TrajectoryStore
    from diffrl.engines.train.trainer import PolicyTrainer
    from diffrl.models.base import ModelAdapter

_LOCK = threading.Lock()
_ENGINES: dict[str, Any] = {}

NAMESPACE = "diffrl"
# Which actor of a placement plays each role (a role is what a stage function needs).
ROLES = {
    "colocated": {"rollout": "engine", "trainer": "engine", "reward": "reward"},
    "split": {"rollout": "rollout", "trainer": "trainer", "reward": "reward"},
}
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


@dataclass
class Engines:
    """The warm state of one run (or of one actor's role): each stage function reads the fields it uses.

    A field is None where this process does not play the role (the reward actor has no model; engines built
    without a store for the benchmarks have no store). `run_uid` keys the run's Prefect task caches (set by the
    train flow); `model_path` is the resolved model folder; `preferences` is offline DPO's pair cache;
    `rollout_version` is the policy version a split rollout actor (which has no trainer) last received.
    """

    config: ExperimentConfig
    adapter: ModelAdapter | None
    rollout: RolloutEngine | None
    trainer: PolicyTrainer | None
    reward: MultiReward | None
    store: TrajectoryStore | None
    prompts: PromptSampler | None
    val_prompts: list[PromptRecord] = field(default_factory=list)
    memory: StepMemory | None = None  # the step in flight and the background writer (one process only)
    model_path: str = ""
    run_uid: str = ""
    preferences: PreferenceCache | None = None
    rollout_version: int = 0
    split = False  # one process: the rollout always samples with the trainer's adapter

    def run(self, role: str, fn: Callable, *args: Any) -> Any:
        """Run `fn(engines, *args)` here (every role lives in this process)."""
        return fn(self, *args)

    def run_one(self, role: str, index: int, fn: Callable, *args: Any) -> Any:
        """Run `fn(engines, *args)` here: this process is the only replica of every role."""
        return fn(self, *args)

    def set_run_uid(self, uid: str) -> None:
        """Key this run's task caches by `uid` (the tasks run in this process)."""
        self.run_uid = uid

    @property
    def policy_version(self) -> int:
        """The policy version the rollout samples with (split rollout actors have no trainer)."""
        if self.trainer is not None:
            return self.trainer.policy_version
        return self.rollout_version


def put(run_name: str, engines: Any) -> None:
    """Register the engines (or the Ray handle) of a run in this process (replacing any previous ones)."""
    with _LOCK:
        _ENGINES[run_name] = engines


def get(run_name: str) -> Any:
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


def actor_name(run_name: str, actor: str) -> str:
    return f"{run_name}/{actor}"


def dp_actors(config: Any) -> list[str]:
    """The data-parallel ranks of a run, rank order: its engine replicas ("engine", "engine-1", ... with
    cluster.gpus > 1) or its split trainer actors ("trainer", "trainer-1", ... with cluster.trainers > 1)."""
    first = ROLES[config.cluster.placement]["trainer"]
    return [first] + [f"{first}-{rank}" for rank in range(1, config.cluster.data_parallel)]


def reward_actors(config: Any) -> list[str]:
    """The reward actors of a run: "reward", then "reward-1" ... for cluster.reward_actors > 1."""
    return ["reward"] + [f"reward-{i}" for i in range(1, config.cluster.reward_actors)]


def actor_names(config: Any) -> list[str]:
    """Every actor of a run: its placement's roles, the data-parallel ranks and the reward actors."""
    return sorted(set(ROLES[config.cluster.placement].values()) | set(dp_actors(config)) | set(reward_actors(config)))


def actor_threads(config: Any, node_cpus: float) -> int:
    """CPU threads torch uses in one of the run's actors: cluster.actor_threads, or with "auto" the CPUs Ray counts
    on the actor's node shared by the run's actors (at least 1). Without it an actor keeps the one thread Ray gives
    every worker (OMP_NUM_THREADS=1) while local mode uses every core."""
    wanted = config.cluster.actor_threads
    if wanted != "auto":
        return int(wanted)
    return max(1, int(node_cpus) // len(actor_names(config)))


def role_of(actor: str) -> str:
    """The role an actor builds for ("trainer-1" builds what "trainer" builds, "engine-2" what "engine" does)."""
    return actor.split("-", 1)[0]


def gpus_seen(config: Any) -> int:
    """`cluster.gpus: auto`: the GPUs of the connected Ray cluster, less those the reward actors ask for."""
    import math

    import ray

    total = ray.cluster_resources().get("GPU", 0)
    left = int(total - math.ceil(config.cluster.reward_actors * config.cluster.reward_gpus))
    if left < 1:
        raise ValueError(
            f"cluster.gpus: auto found {total:g} GPUs on the Ray cluster ({config.cluster.reward_actors} reward "
            f"actors ask for {config.cluster.reward_gpus:g} each): start Ray with GPUs (`ray start --head "
            "--num-gpus N`) or set cluster.gpus to a number"
        )
    return left


def forwarded_env() -> dict[str, str]:
    """The driver's settings the Ray workers and actors need (runtime_env env_vars): FORWARDED_ENV and every NCCL_*
    (the network the replicas' process group uses between nodes: NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...)."""
    return {k: v for k, v in os.environ.items() if k in FORWARDED_ENV or k.startswith("NCCL_")}


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` (None: RAY_ADDRESS or a local `ray start --head`)."""
    import ray

    from diffrl.engines.ray_exposure import warn_if_exposed

    if ray.is_initialized():
        return
    ray.init(
        address=address or os.environ.get("RAY_ADDRESS") or "auto",
        namespace=NAMESPACE,
        runtime_env={"env_vars": forwarded_env()},
        log_to_driver=False,
    )
    warn_if_exposed()  # a cluster open to the network without a token: say so (diffrl/engines/ray_exposure.py)


def _resources(config: Any, actors: list[str]) -> dict[str, float]:
    """GPUs each actor asks for: 1 for a model holder when the cluster has GPUs and the model is not on CPU;
    cluster.reward_gpus for a reward actor."""
    import ray

    has_gpus = ray.cluster_resources().get("GPU", 0) >= 1 and config.model.device != "cpu"
    model = 1.0 if has_gpus else 0.0
    return {a: config.cluster.reward_gpus if role_of(a) == "reward" else model for a in actors}


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
        pg = placement_group(bundles, strategy="PACK", name=name, lifetime="detached")
    if not pg.wait(timeout_seconds=timeout_s):
        raise RuntimeError(
            f"run {run_name!r}: the Ray cluster cannot place {bundles} within {timeout_s:.0f} s "
            f"(cluster resources: {ray.cluster_resources()})"
        )
    return pg


class RayEngines:
    """A run's engines living in named detached Ray actors: the handle flows and Ray-run tasks hold.

    `config`, `val_prompts` and `run_uid` are copies; `store` is this process's own view of the run's
    trajectory table (reads for logging and retention); models never leave their actors.
    """

    memory = None  # the step core's hand-off lives in each actor (diffrl/engines/step/memory.py), not in this handle

    def __init__(
        self,
        run_name: str,
        config: Any,
        actors: dict[str, Any],
        run_uid: str = "",
        store: Any = None,
        val_prompts: list | None = None,
    ):
        self.run_name, self.config, self.actors, self.run_uid = run_name, config, actors, run_uid
        self.store, self.val_prompts = store, val_prompts or []
        self.split = config.cluster.placement == "split"

    @classmethod
    def find(cls, run_name: str) -> "RayEngines":
        """The live actors of `run_name` (from any process connected to the cluster)."""
        import ray

        def lookup(names: list[str]) -> dict[str, Any]:
            found = {}
            for actor in names:
                try:
                    found[actor] = ray.get_actor(actor_name(run_name, actor), namespace=NAMESPACE)
                except ValueError:
                    continue
            return found

        first = lookup(["reward"])
        if not first:
            raise RuntimeError(
                f"run {run_name!r} has no actors on this Ray cluster (namespace {NAMESPACE!r}): "
                f"start it with `diffrl train ... cluster.mode=ray run.name={run_name}`"
            )
        info = ray.get(first["reward"].describe.remote(), timeout=60)  # the config the actors were built from
        return cls(run_name, info["config"], lookup(actor_names(info["config"])), info["run_uid"])

    def set_run_uid(self, uid: str) -> None:
        """Key the run's task caches by `uid` here and in every actor (the Ray workers running tasks ask them)."""
        self.run_uid = uid
        for name, actor in self.actors.items():
            self.wait(actor.attach.remote(self.config, uid), f"{name}.attach")

    def actor_for(self, role: str) -> Any:
        actor = ROLES[self.config.cluster.placement][role]
        if actor not in self.actors:
            raise RuntimeError(
                f"run {self.run_name!r}: its {actor_name(self.run_name, actor)} actor is not alive "
                f"(it died or was stopped); `diffrl cluster stop {self.run_name}` and rerun "
                "`diffrl train` to start fresh actors from the last checkpoint"
            )
        return self.actors[actor]

    def members(self, role: str) -> list[Any]:
        """Every actor playing `role`, rank order: the data-parallel ranks for "trainer" (and for "rollout" with
        engine replicas), the reward actors for "reward"."""
        if role == "reward":
            names = reward_actors(self.config)
        elif role == "trainer" or (role == "rollout" and not self.split):
            names = dp_actors(self.config)
        else:
            return [self.actor_for(role)]
        missing = [a for a in names if a not in self.actors]
        if missing:
            raise RuntimeError(
                f"run {self.run_name!r}: actors {[actor_name(self.run_name, a) for a in missing]} are not alive "
                f"(they died or were stopped); `diffrl cluster stop {self.run_name}` and rerun `diffrl train` to "
                "start fresh actors from the last checkpoint"
            )
        return [self.actors[a] for a in names]

    def ranks(self, role: str) -> list[Any]:
        """The actors that run a call of `role`: every data-parallel rank for "trainer" (rank 0 first)."""
        return self.members("trainer") if role == "trainer" else [self.actor_for(role)]

    def run_one(self, role: str, index: int, fn: Callable, *args: Any) -> Any:
        """`fn(engines, *args)` inside the `index`-th actor playing `role` (modulo their number): one engine replica,
        one trainer rank (a collective stage then needs a call on every rank at once) or one reward actor."""
        actors = self.members(role)
        return self.wait(actors[index % len(actors)].run.remote(fn, *args), f"{role}[{index}] ({fn.__name__})")

    def run(self, role: str, fn: Callable, *args: Any) -> Any:
        """`fn(engines, *args)` inside the actor playing `role` -- on every trainer rank for "trainer", which
        returns rank 0's result; an error (or a timeout) of any of them fails the caller."""
        refs = [actor.run.remote(fn, *args) for actor in self.ranks(role)]
        return self.wait(refs, f"{role} ({getattr(fn, '__name__', fn)})")[0]

    def pipe(self, first: tuple[str, Callable], second: tuple[str, Callable], *args: Any) -> Any:
        """second_fn(engines2, first_fn(engines1, *args)): the intermediate goes actor to actor, not via here
        (from rank 0 when `first` runs on every trainer rank)."""
        refs = [actor.run.remote(first[1], *args) for actor in self.ranks(first[0])]
        out = self.actor_for(second[0]).run.remote(second[1], refs[0])
        return self.wait([out, *refs[1:]], f"{first[0]} -> {second[0]}")[0]

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
            raise RuntimeError(f"run {self.run_name!r}: the actor for {what} died: {e}") from e

    def describe(self) -> list[dict]:
        import ray

        return (
            [self.wait(a.describe.remote(), f"{name}.describe") for name, a in self.actors.items()]
            if ray.is_initialized()
            else []
        )


def start_actors(config: Any, build: Callable, run_uid: str = "") -> RayEngines:
    """Create-or-get the run's named detached actors on the connected cluster (model built once per actor)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    run_name, timeout = config.run.name, config.cluster.actor_timeout_s
    from diffrl.engines.host import EngineHost

    names = actor_names(config)
    dp_ranks = dp_actors(config) if config.cluster.data_parallel > 1 else []
    gpus = _resources(config, names)
    pg = _placement_group(run_name, gpus, timeout)
    host = ray.remote(EngineHost)
    actors, bundle = {}, 0
    env = {"env_vars": forwarded_env()}
    for actor in names:
        options = dict(
            name=actor_name(run_name, actor),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            num_gpus=gpus[actor],
            runtime_env=env,
            max_restarts=0,
        )
        if gpus[actor] > 0:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
            bundle += 1
        rank, world = (dp_ranks.index(actor), len(dp_ranks)) if actor in dp_ranks else (0, 1)
        actors[actor] = host.options(**options).remote(build, config, actor, run_uid, rank, world)
    handle = RayEngines(run_name, config, actors, run_uid)
    if dp_ranks:  # data-parallel replicas or trainers: one process group, rank 0's address
        ranks = handle.ranks("trainer")
        address, port = handle.wait(ranks[0].rendezvous.remote(), "trainer rendezvous")
        handle.wait([r.join.remote(address, port) for r in ranks], "data-parallel ranks (process group and build)")
    # a warm actor from an earlier flow run answers `attach`; a new one answers once its build is done
    for name, actor in actors.items():
        handle.wait(actor.attach.remote(config, run_uid), f"{name} (build/attach)")
    return handle


def list_actors(run_name: str | None = None) -> list[dict]:
    """diffrl's live actors on the connected cluster (all runs, or one run's), each with its description."""
    import ray

    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] != NAMESPACE or (run_name and name.rsplit("/", 1)[0] != run_name):
            continue
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
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] != NAMESPACE or name.rsplit("/", 1)[0] != run_name:
            continue
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
