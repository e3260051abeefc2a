"""The elastic rollout pool (rollout.max_actors): engines joining as the cluster can place them, and the
test of whether a lost engine left with its node.

Contract: `Growth(config, handles)`. `step(size)`, called as often as the driver likes, looks every
`rollout.scale_every_s` whether the pool (`size` engines) plus the engine starting is below
`rollout.max_actors`; if so it keeps one engine bundle asked for (`cluster.request_engine_pg`, a
placement group left pending: the demand an autoscaler acts on) and, once Ray places it, spawns
rollout actor `rollout-<slot>` in it (slots count up from `rollout.num_actors`, never reused) and
starts its engine in the background. `take()` returns (slot, actor, node) once that engine is up, for the fleet
to add at its next weight sync; an engine that fails to start is killed, its bundle given back and
the reason printed in one line. `release(slot)` gives back the placement group of a slot that left.
`node_gone(actor, node)` says whether a lost actor went with its node: Ray has declared the node dead,
or the actor stays unreachable (`ActorUnavailableError`: its raylet is gone) until it does, within
`NODE_GRACE_S`; an actor that answers, or died on a live node, was not.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayError

from rlray.actors.rollout import one_line
from rlray.config import Config
from rlray.orchestration import cluster

NODE_GRACE_S = 60.0  # Ray declares a node whose raylet is gone dead within ~15 s (5 missed health checks of 3 s)
ASK_S = 2.0  # a lost actor that Ray cannot reach is asked again this often


def node_gone(actor: Any, node: str | None) -> bool:
    deadline = time.monotonic() + NODE_GRACE_S
    while node is not None and cluster.node_alive(node):
        if time.monotonic() > deadline:
            return False
        try:
            ray.get(actor.stats.remote(), timeout=ASK_S)
            return False
        except ActorUnavailableError:
            time.sleep(ASK_S / 4)
        except RayError:
            return False
    return True


class Growth:
    def __init__(self, c: Config, h: cluster.Handles) -> None:
        self.c, self.h = c, h
        self.next_slot = c.rollout.num_actors
        self.checked = time.monotonic()
        self.pending: tuple[int, Any] | None = None  # (slot, its placement group), asked for, not placed yet
        self.starting: tuple[int, Any, Any] | None = None  # (slot, actor, its start() reference)
        self.ready: tuple[int, Any, str] | None = None  # (slot, actor, node): up, waiting for the next sync

    def step(self, size: int) -> None:
        self._started()
        r = self.c.rollout
        if time.monotonic() - self.checked < r.scale_every_s:
            return
        self.checked = time.monotonic()
        if self.pending is None:
            if size + (self.starting is not None) + (self.ready is not None) < (r.max_actors or 0):
                slot, self.next_slot = self.next_slot, self.next_slot + 1
                self.h.engine_pgs[slot] = pg = cluster.request_engine_pg(self.c, slot)
                self.pending = (slot, pg)
            return
        slot, pg = self.pending
        if self.starting is None and self.ready is None and cluster.placed(pg):
            self.pending = None
            actor = cluster.spawn_rollout(self.c, slot, pg, 0)
            self.starting = (slot, actor, actor.start.remote())
            print(f"a node has room for another engine: {cluster.rollout_name(slot)} starting "
                  f"(rollout pool of {size}, rollout.max_actors={r.max_actors})", flush=True)

    def _started(self) -> None:
        if self.starting is None:
            return
        slot, actor, ref = self.starting
        if not ray.wait([ref], timeout=0)[0]:
            return
        self.starting = None
        try:
            ray.get(ref)
            self.ready = (slot, actor, cluster.nodes_of([actor], self.c.weights.sync_timeout_s)[0])
        except RayError as e:
            ray.kill(actor, no_restart=True)
            self.release(slot)
            print(f"{cluster.rollout_name(slot)} did not start ({one_line(getattr(e, 'cause', None) or e)}); "
                  f"its bundle is given back and asked for again", flush=True)

    def take(self) -> tuple[int, Any, str] | None:
        ready, self.ready = self.ready, None
        return ready

    def release(self, slot: int) -> None:
        pg = self.h.engine_pgs.pop(slot, None)
        if pg is not None:
            cluster.release_pg(pg)
