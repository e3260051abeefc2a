"""Trainer-rank recovery: a lost trainer rank costs the steps since the newest checkpoint, not the run.

Contract: `lost_trainers(trainers)` names the trainer ranks that died or do not answer on their control
thread within `HEALTH_S` (a rank blocked in a collective still answers there). `recreate(config,
handles, incarnation, pad_id)` kills every trainer rank and the buffer (whose queue holds groups of
policy versions that are gone) and spawns them again (`trainer-i.<incarnation>`, in the trainer
placement group's bundles; Ray re-places a bundle whose node is gone when the cluster has room) with
a fresh trainer process group, swapping them into `handles` in place, so the fleet, the teacher pool
and the checkpoints see the new ranks. `recover(controller, step, lost, error)` is the whole
recovery of a run whose RL step `step` lost trainer ranks `lost`: one console line, the rollout loops
halted, `recreate`, the weight group re-formed, the newest intact checkpoint loaded (its digest checked)
and the buffer's tickets regranted from it, the engines synced and the loops restarted; it returns
the step to go on from, or raises a one-line RuntimeError past `trainer.max_restarts` or with no
checkpoint to recover from.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError

from rlray.actors.rollout import one_line
from rlray.config import Config
from rlray.orchestration import cluster
from rlray.orchestration.calls import HEALTH_S, errors

if TYPE_CHECKING:
    from rlray.orchestration.controller import Controller


def lost_trainers(trainers: list[Any]) -> dict[int, str]:
    refs = [t.pid.options(concurrency_group=cluster.CONTROL).remote() for t in trainers]
    failed = errors(refs, HEALTH_S)
    return {i: ("its process died" if isinstance(e, RayActorError) else f"it does not answer ({one_line(e, 160)})")
            for i, e in failed.items()}


def recreate(c: Config, h: cluster.Handles, incarnation: int, pad_id: int) -> None:
    for actor in [*h.trainers, h.buffer]:
        ray.kill(actor, no_restart=True)
    trainers, master_ref = cluster.spawn_trainers(c, h.trainer_pg, incarnation)
    master = ray.get(master_ref)
    ray.get([t.setup.remote(master) for t in trainers])
    h.trainers[:] = trainers
    h.master = master
    h.buffer = cluster.spawn_buffer(c, pad_id, incarnation)


def recover(ctl: Controller, step: int, lost: dict[int, str], error: BaseException) -> int:
    """Re-create the trainer group from the newest intact checkpoint; the step to go on from."""
    t = ctl.c.trainer
    what = "; ".join(f"trainer-{i} was lost during RL step {step + 1} ({why})" for i, why in sorted(lost.items()))
    if ctl.trainer_restarts >= t.max_restarts:
        raise RuntimeError(f"{what}. trainer.max_restarts={t.max_restarts} allows no more recoveries "
                           f"({ctl.trainer_restarts} used): raise it, or fix the cause and resume the run from its "
                           "last checkpoint (same run.dir)") from error
    if not ctl.checkpointing:
        raise RuntimeError(f"{what}, and the run keeps no checkpoint to recover from: set checkpoint.every or "
                           "checkpoint.every_s") from error
    t0, trained = time.perf_counter(), ctl.version
    ctl.trainer_restarts += 1
    ctl.fleet.halt()
    recreate(ctl.c, ctl.h, ctl.trainer_restarts, ctl.tokenizer.pad_token_id)
    if ctl.teachers:
        ctl.teachers.attach()
    ctl.fleet.open()
    found = ctl.checkpoints.newest()
    if found is None:
        raise RuntimeError(f"{what}, and no checkpoint of this run is committed yet to recover from") from error
    ray.get([r.set_stage.remote(t.lr, 0, "rl") for r in ctl.h.trainers])
    found, digest = ctl.checkpoints.load(found)
    ctl.version = found["version"]
    ray.get(ctl.h.buffer.load_state.remote({**found["buffer"], "step": found["step"]}))
    ctl.sync(ctl.version)
    ctl.fleet.start()
    ctl.summary.update(trainer_restarts=ctl.trainer_restarts,
                       recovered_weights=[*ctl.summary.get("recovered_weights", []), digest])
    print(f"{what}; trainer group re-created in {time.perf_counter() - t0:.1f}s from checkpoint step {found['step']}: "
          f"{trained - found['version']} trained steps lost ({ctl.trainer_restarts} of trainer.max_restarts="
          f"{t.max_restarts} used)", flush=True)
    return found["step"]

