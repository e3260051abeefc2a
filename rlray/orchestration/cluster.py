"""The only module that knows Ray resources: connect, placement groups, spawn actors.

Contract: `connect(cfg, verbose, python_path)` joins `cluster.address` / `RAY_ADDRESS` or starts a
local Ray (dashboard on loopback, logical CPUs declared so fractional bundles fit; the actors' output
on the console only when `verbose`, always in Ray's session logs; `collect_logs(dest)` copies this
job's worker logs on this node into the run folder). The code reaches every node through the job's
runtime_env (`code_env`): rlray and the modules of `env.python_path` as `py_modules`, so actors on
nodes without this checkout import the driver's copy.
`check_resources(gpus, cpus)` compares a plan with the connected cluster.
`spawn(config)` creates one placement group for the trainer ranks and one for the
rollout actors (bundle sizes from the config, on nodes with `*.node_labels`), or with
`cluster.colocate` one whose bundles each hold a trainer rank and an engine worker
(rlray.config.colocation; on GPUs Ray's fractional GPUs split each bundle's GPU), then the named actors `trainer-i`
(with `CONTROL` and `CHECKPOINT` concurrency groups beside the default one),
`rollout-i` and `buffer` from the plain classes, and has trainer rank 0 serve the trainer group's
store (`Handles.master`); `spawn_rollout` (re)creates one rollout
actor in its bundle (`rollout_site`); with verifiers v1 envs it hands the actor `v1_spawner(env)`, with which
the actor starts its v1 env actor (`spawn_v1_env`: its node, the v1 interpreter as `py_executable`). An elastic pool (`rollout.max_actors`, `elastic(config)`) gives every
engine a placement group of its own (`rlray-rollout-<slot>`, `Handles.engine_pgs`): `request_engine_pg`
asks for one more without waiting (a demand an autoscaler sees), `placed` says whether it is, `release_pg`
gives one back, `node_alive` says whether an engine's node is still in the cluster. With a distillation teacher (`teacher.name`), `spawn` also creates the
`rlray-teacher` placement group and the actors `teacher-i` (rlray.actors.teacher), and `spawn_teacher`
(re)creates one in its bundle. `free_address(pg, bundle)` returns
(ip, port) free on the node of that bundle. `teardown(handles)` kills them all.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlray.actors.buffer import BufferActor
from rlray.actors.rollout import RolloutActor
from rlray.actors.teacher import TeacherActor
from rlray.actors.trainer import TrainerActor
from rlray.config import ClusterConfig, Colocation, Config, EnvConfig, backend, weight_backend
from rlray.config.colocation import TRAINER_GPU_SHARE
from rlray.envs import v1

PACKAGE = Path(__file__).resolve().parents[1]  # rlray/
REPO = str(PACKAGE.parent)
# Trainer calls that must never queue behind a collective in flight (closing the weight group):
# `handle.method.options(concurrency_group=CONTROL).remote()` runs them on a thread of their own.
CONTROL = "control"
# A trainer's `finish_save` (waiting for a checkpoint's background write) beside its training calls.
CHECKPOINT = "checkpoint"


SHIPPED = "RLRAY_SHIPPED_CODE"  # set in every actor whose env modules came with the runtime_env


def code_env(python_path: Sequence[str] = (), benchmarks: bool = False) -> dict[str, Any]:
    """The runtime_env that ships rlray and each module (a .py file or a package folder) found in
    the `python_path` folders to every node; PYTHONPATH keeps this checkout for whatever else the
    driver imports from it (a node without it skips the missing folder); every RLRAY_* variable of the
    driver's environment reaches every actor. rlray/bench stays behind
    (a run's code is the run's) unless `benchmarks` (their own Ray actors need it)."""
    modules = [str(PACKAGE)]
    for folder in map(Path, python_path):
        modules += [str(m) for m in sorted(folder.iterdir()) if m.suffix == ".py" or (m / "__init__.py").is_file()]
    env_vars = {**{k: v for k, v in os.environ.items() if k.startswith("RLRAY_")},  # the driver's rlray settings
                "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
                "TOKENIZERS_PARALLELISM": "false", SHIPPED: os.pathsep.join(python_path)}
    # Ray applies excludes within each py_modules folder, as gitignore patterns from its root
    return {"py_modules": modules, "env_vars": env_vars, **({} if benchmarks else {"excludes": ["/bench/"]})}


def connect(cfg: ClusterConfig, verbose: bool = False, python_path: Sequence[str] = (),
            benchmarks: bool = False) -> None:
    """Join or start Ray with `code_env(python_path, benchmarks)`. The actors' output (vLLM's INFO
    lines included) goes to Ray's session logs (`collect_logs` copies them into the run folder); with
    `verbose` to the console too."""
    if ray.is_initialized():
        return
    env = code_env(python_path, benchmarks)
    logging.getLogger("ray._private.runtime_env.packaging").setLevel(logging.WARNING)  # a line per module shipped
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        context = ray.init(address=address, runtime_env=env, log_to_driver=verbose)
    else:
        import torch

        gpus = torch.cuda.device_count() if cfg.num_gpus is None else cfg.num_gpus  # checked <= torch's by plan
        context = ray.init(address="local", num_cpus=cfg.num_cpus, num_gpus=gpus, include_dashboard=True,
                           dashboard_host=cfg.dashboard_host, _node_ip_address="127.0.0.1", runtime_env=env,
                           log_to_driver=verbose)
    _SESSION_LOGS[0] = Path(context.address_info["session_dir"]) / "logs"


# This node's session logs. /tmp/ray/session_latest is whichever Ray session started last on the
# machine (another run's, or a test's local cluster); `connect` records the session it joined.
_SESSION_LOGS = [Path("/tmp/ray/session_latest/logs")]


def collect_logs(dest: Path) -> int:
    """Copy this job's worker logs (every actor's stdout and stderr) on this node into `dest`;
    returns how many files. Actors on other nodes keep theirs in those nodes' session logs."""
    job = ray.get_runtime_context().get_job_id()
    logs = _SESSION_LOGS[0]
    files = sorted(logs.glob(f"worker-*-{job}-*.*")) if logs.is_dir() else []
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, dest / f.name)
    return len(files)


def check_resources(gpus: float, cpus: float) -> str:
    """The connected cluster must hold the run's bundles; returns a line saying what it has."""
    have = ray.cluster_resources()
    have_gpus, have_cpus = have.get("GPU", 0.0), have.get("CPU", 0.0)
    if gpus > have_gpus or cpus > have_cpus:
        raise ValueError(f"the Ray cluster has {have_gpus:g} GPUs and {have_cpus:g} CPUs but the run needs "
                         f"{gpus:g} GPUs and {cpus:g} CPUs; add nodes or shrink trainer.num_ranks / "
                         "rollout.num_actors")
    kinds = sorted(k.removeprefix("accelerator_type:") for k in have if k.startswith("accelerator_type:"))
    return f"cluster: {have_gpus:g} GPUs ({', '.join(kinds) or 'type unknown'}), {have_cpus:g} CPUs: enough"


@ray.remote(num_cpus=0)
def _node_free_address() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def free_address(pg: PlacementGroup, bundle: int) -> tuple[str, int]:
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
    return ray.get(_node_free_address.options(scheduling_strategy=strategy).remote())


class BufferClient:
    """Awaitable calls on the buffer actor, for the rollout loop of rollout actor `actor`."""

    def __init__(self, handle: Any, actor: int) -> None:
        self.handle, self.actor = handle, actor

    def reserve(self, version: int, want: int) -> Any:
        return self.handle.reserve.remote(version, want, self.actor)

    def put(self, groups: list) -> Any:
        return self.handle.put.remote(groups, self.actor)

    def cancel(self, tickets: list[int]) -> Any:
        return self.handle.cancel.remote(tickets, self.actor)


class TeacherClient:
    """An awaitable `score` on a teacher actor, for the buffer (rlray.actors.buffer.BufferActor.set_teachers)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def score(self, sequences: list) -> Any:
        return self.handle.score.remote(sequences)


@dataclass
class Handles:
    trainers: list[Any]
    rollouts: list[Any]
    buffer: Any
    master: str  # the trainer group's store, "host:port" (every rank's `setup(master)`)
    groups: list[PlacementGroup] = field(default_factory=list)
    teachers: list[Any] = field(default_factory=list)  # algo.loss=opd: the teacher actors
    teacher_pg: PlacementGroup | None = None
    engine_pgs: dict[int, PlacementGroup] = field(default_factory=dict)  # elastic pool: slot -> its engine's group

    @property
    def trainer_pg(self) -> PlacementGroup:
        return self.groups[0]

    @property
    def rollout_pg(self) -> PlacementGroup:
        return self.groups[-1]  # colocated: the one group


def _pg(name: str, bundles: list[dict[str, float]], labels: dict[str, str], key: str,
        timeout_s: float = 600) -> PlacementGroup:
    n = len(bundles)
    pg = placement_group(bundles, strategy="PACK", name=name,
                         bundle_label_selector=[dict(labels) for _ in range(n)] if labels else None)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        where = f" on nodes labelled {dict(labels)} ({key})" if labels else ""
        shape = f"{n} x {bundles[0]}" if all(b == bundles[0] for b in bundles) else str(bundles)
        raise RuntimeError(f"placement group {name} ({shape}{where}) not placed in {timeout_s:g} s: "
                           f"the cluster has {ray.available_resources()} free") from None
    return pg


def _bundles(n: int, cpus: float, gpus: float) -> list[dict[str, float]]:
    return [{"CPU": cpus, **({"GPU": gpus} if gpus else {})} for _ in range(n)]


def _groups(c: Config) -> list[PlacementGroup]:
    """[trainer's, rollout's] placement groups; colocated, one holding both ([it, it]); an elastic pool:
    [trainer's] (its engines have one each)."""
    t, r = c.trainer, c.rollout
    if c.cluster.colocate:
        pg = _pg("rlray-colocated", Colocation(c).bundles(), t.node_labels, "trainer.node_labels")
        return [pg, pg]
    trainer = _pg("rlray-trainer", _bundles(t.num_ranks, t.cpus_per_rank, t.gpus_per_rank), t.node_labels,
                  "trainer.node_labels")
    if elastic(c):
        return [trainer]
    return [trainer, _pg("rlray-rollout", _bundles(r.num_actors, r.cpus_per_actor, r.gpus_per_actor),
                         r.node_labels, "rollout.node_labels")]


def elastic(c: Config) -> bool:
    """Whether the rollout pool follows the cluster (rollout.max_actors set)."""
    return c.rollout.max_actors is not None


def _engine_bundle(c: Config) -> list[dict[str, float]]:
    return _bundles(1, c.rollout.cpus_per_actor, c.rollout.gpus_per_actor)


def request_engine_pg(c: Config, slot: int) -> PlacementGroup:
    """Ask for engine `slot`'s placement group without waiting for it (an autoscaler sees the demand)."""
    labels = c.rollout.node_labels
    return placement_group(_engine_bundle(c), strategy="PACK", name=f"rlray-rollout-{slot}",
                           bundle_label_selector=[dict(labels)] if labels else None)


def placed(pg: PlacementGroup) -> bool:
    """Whether Ray has placed `pg`, from the GCS's table. (`pg.wait(timeout_seconds=0)` races its own RPC's reply:
    it said False for a placed group in 19% of calls on a loaded 2-core machine, and an elastic pool then never
    saw its bundle placed.)"""
    return placement_group_table(pg).get("state") == "CREATED"


def release_pg(pg: PlacementGroup) -> None:
    remove_placement_group(pg)


def node_alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def node_label(node_id: str) -> str:
    """A node as a person finds it in the dashboard: its id's first 8 characters and its address."""
    ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "address unknown")
    return f"{node_id[:8]} ({ip})"


def rollout_site(c: Config, h: Handles, slot: int) -> tuple[PlacementGroup, int]:
    """The placement group and bundle of rollout actor `slot` (elastic: its own group's only bundle)."""
    return (h.engine_pgs[slot], 0) if elastic(c) else (h.rollout_pg, slot)


def spawn(c: Config, pad_id: int) -> Handles:
    r = c.rollout
    groups = _groups(c)
    trainers, master = spawn_trainers(c, groups[0])
    h = Handles(trainers, [], spawn_buffer(c, pad_id), "", groups[:1] if c.cluster.colocate else groups)
    if elastic(c):
        h.engine_pgs = {i: _pg(f"rlray-rollout-{i}", _engine_bundle(c), r.node_labels, "rollout.node_labels")
                        for i in range(r.num_actors)}
    h.rollouts = [spawn_rollout(c, i, *rollout_site(c, h, i)) for i in range(r.num_actors)]
    if c.teacher.enabled:
        te = c.teacher
        h.teacher_pg = _pg("rlray-teacher", _bundles(te.num_actors, te.cpus_per_actor, te.gpus_per_actor),
                           te.node_labels, "teacher.node_labels")
        h.teachers = [spawn_teacher(c, i, h.teacher_pg) for i in range(te.num_actors)]
    # only now: rank 0 answers once its process has imported torch, and the engines' start is the longer one
    try:
        h.master = ray.get(master)
    except BaseException:  # a rank that cannot start: nothing spawned here is left behind
        teardown(h)
        raise
    return h


def spawn_trainers(c: Config, pg: PlacementGroup, incarnation: int = 0) -> tuple[list[Any], ray.ObjectRef]:
    """The trainer ranks `trainer-i` (`trainer-i.<incarnation>` when re-created) in bundles 0.. of `pg`, and
    a reference to the trainer group's store that rank 0 serves ("host:port", every rank's `setup(master)`)."""
    t, r = c.trainer, c.rollout
    host, _ = free_address(pg, 0)  # rank 0's node; its store picks the port (TrainerActor.serve_group)
    gpus = t.gpus_per_rank * (TRAINER_GPU_SHARE if c.cluster.colocate else 1.0)
    trainers = [
        ray.remote(concurrency_groups={CONTROL: 1, CHECKPOINT: 1})(TrainerActor).options(
            name=actor_name("trainer", i, incarnation), num_cpus=t.cpus_per_rank, num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(i, t.num_ranks, f"{host}:0", c.model, t, c.algo, backend(c), r.temperature, r.dtype)
        for i in range(t.num_ranks)
    ]
    return trainers, trainers[0].serve_group.remote()


def spawn_buffer(c: Config, pad_id: int, incarnation: int = 0) -> Any:
    t = c.trainer
    return ray.remote(BufferActor).options(name=actor_name("buffer", None, incarnation), num_cpus=0).remote(
        c.algo, c.rl.batch_size // c.rollout.group_size, c.async_.max_off_policy_steps, t.num_ranks,
        t.micro_batch_tokens, pad_id, t.packing, t.cp)


def spawn_teacher(c: Config, index: int, pg: PlacementGroup, incarnation: int = 0) -> Any:
    """Teacher actor `index` in bundle `index` of `pg`, named `teacher-<index>[.<incarnation>]`."""
    te = c.teacher
    return ray.remote(TeacherActor).options(
        name=actor_name("teacher", index, incarnation), num_cpus=te.cpus_per_actor,
        num_gpus=te.gpus_per_actor, max_concurrency=1000,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
    ).remote(index, te, c.run.seed + 1000 * incarnation)


def actor_name(role: str, index: int | None = None, incarnation: int = 0) -> str:
    """`<role>-<index>` (`<role>` alone without an index), and `.<incarnation>` after it for a replacement."""
    return role + (f"-{index}" if index is not None else "") + (f".{incarnation}" if incarnation else "")


def rollout_name(index: int, incarnation: int = 0) -> str:
    return actor_name("rollout", index, incarnation)


def spawn_rollout(c: Config, index: int, pg: PlacementGroup, bundle: int, incarnation: int = 0) -> Any:
    """Rollout actor `index` in bundle `bundle` of `pg` (colocated: its engine's first bundle), named
    `rollout_name(index, incarnation)`, with `rollout_env(c, index)`. Colocated on GPUs the actor takes no GPU:
    vLLM's Ray workers take each bundle's engine share, so the actor's placement group is captured for the
    tasks it starts."""
    r, colocated = c.rollout, c.cluster.colocate
    env = rollout_env(c, index)
    gpus = 0.0 if env else r.gpus_per_actor
    if colocated:
        bundle = Colocation(c).first_bundle(index)
    return ray.remote(RolloutActor).options(
        name=rollout_name(index, incarnation), num_cpus=r.cpus_per_actor, num_gpus=gpus, max_concurrency=1000,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle,
                                                             placement_group_capture_child_tasks=bool(env)),
        **({"runtime_env": {"env_vars": env}} if env else {}),
    ).remote(index, r.num_actors, c.model, r, c.env, c.run.seed + 1000 * incarnation, c.run.seed, weight_backend(c),
             c.trainer.lora.rank, colocated, v1_spawner(c.env, actor_name("v1env", index, incarnation)))


def rollout_env(c: Config, index: int) -> dict[str, str]:
    """The environment variables rollout actor `index` starts with (its engine's processes inherit them):
    colocated on GPUs, where vLLM's Ray workers sit (one per trainer bundle, each a GPU share) and
    VLLM_ALLOW_INSECURE_SERIALIZATION=1, without which vLLM's msgpack RPC refuses the ipc handover's
    CUDA IPC handles (the type objects `reduce_tensor` returns); vLLM reads it once, at the engine's start."""
    if not (c.cluster.colocate and c.rollout.gpus_per_actor):
        return {}
    return {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, Colocation(c).engine_bundles(index))),
            "VLLM_RAY_PER_WORKER_GPUS": str(1.0 - TRAINER_GPU_SHARE),
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def v1_spawner(env: EnvConfig, name: str | None = None) -> Any:
    """What a rollout actor calls to start its v1 env actor (named `name`), or None without v1 envs."""
    if not v1.specs(env):
        return None
    return functools.partial(spawn_v1_env, python=v1.python(env), python_path=list(env.python_path), name=name)


def spawn_v1_env(specs: dict[str, dict], tokenizer: str, chat_template: str, tool_format: str | None = None, *,
                 python: str, python_path: list[str], name: str | None = None) -> Any:
    """Called inside a rollout actor: its v1 env actor (rlray.envs.v1_worker), on its node, run by the v1
    interpreter `python` (runtime_env `py_executable`), owned by the rollout actor (it dies with it) and
    restarted by Ray when its process dies. `v1env-<i>` beside `rollout-<i>`."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlray.envs.v1_worker import V1EnvActor

    node = ray.get_runtime_context().get_node_id()
    return ray.remote(V1EnvActor).options(
        name=name, num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=1000,
        runtime_env={"py_executable": python},
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(specs, python_path, tokenizer, chat_template, tool_format)


def teardown(h: Handles) -> None:
    for actor in [*h.rollouts, *h.teachers, *h.trainers, h.buffer]:
        ray.kill(actor, no_restart=True)
    for pg in [*h.groups, *([h.teacher_pg] if h.teacher_pg else []), *h.engine_pgs.values()]:
        remove_placement_group(pg)


def _node_id(_actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def nodes_of(actors: list[Any], timeout: float) -> list[str]:
    """The Ray node id of each actor (Ray's `__ray_call__`: a function run inside the actor)."""
    return ray.get([a.__ray_call__.remote(_node_id) for a in actors], timeout=timeout)
