"""RolloutFleet: the rollout actors, their weight group, weight syncs, RL loops and replacement.

Contract:
- `RolloutFleet(config, handles, plan)` owns `handles.rollouts` (replacements are swapped in
  there, so `cluster.teardown(handles)` kills the current ones) and the weight group: `open()`
  forms it (trainer ranks + every engine worker; engine i's workers are ranks 1 + i*tp ...),
  `close(indices)` makes the trainer and rollout actors `indices` leave it.
- `sync(version)` loads the trainer's current weights into every engine, labelled `version`.
  A rollout actor is lost when it died as a Ray actor, or its engine can serve no more
  (`rollout.EngineFailed`: the engine died, or failed `rollout.max_failed_groups` groups in a
  row; its RL loop ends with that error). Actors found lost before the broadcast or during it
  are replaced and the broadcast repeated, until every engine holds `version`; a broadcast that
  fails with no receiver lost raises, naming the version.
- `start()` starts every actor's RL loop (they put groups into the buffer); `heal(version)`
  replaces actors whose loop ended early and returns whether it did; `stop(version)` ends the
  loops. `evaluate(version, ...)` runs `RolloutActor.evaluate` on every actor, replacing lost ones
  and running it again. `version` is the trainer's policy version: what a replacement loads.
- Replacing actors: kill them, return their buffer tickets, spawn each again in its bundle
  (`cluster.spawn_rollout`), re-form the weight group, load the trainer's weights everywhere
  (a survivor whose load broke with the group is replaced too), then resume their RL loops
  if RL runs. At most `rollout.max_restarts` replacements in all; past that a RuntimeError of
  one line names the actors, why they were lost, and the fix.
- `last_errors()`: each actor's last failed group, for messages of a starved trainer.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from rlray import cluster
from rlray.config import Config
from rlray.rollout import EngineFailed
from rlray.weights import Bucket


def _one_line(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())[:300]


def loss_cause(error: BaseException) -> str | None:
    """Why a call's `error` means its rollout actor is lost, or None when it does not."""
    if isinstance(error, RayActorError):
        return "it died (its Ray actor process is gone)"
    cause = getattr(error, "cause", None)  # a RayTaskError carries the actor's own exception
    return str(cause) if isinstance(cause, EngineFailed) else None


def errors(refs: list[Any], timeout: float | None) -> dict[int, RayError]:
    """The error of each of `refs` whose task raised (or did not finish within `timeout` s; None: wait)."""
    failed = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except RayError as e:
            failed[i] = e
    return failed


class RolloutFleet:
    def __init__(self, c: Config, handles: cluster.Handles, plan: list[Bucket]) -> None:
        self.c = c
        self.h = handles
        self.plan = plan  # the weight buckets, from trainer rank 0
        self.restarts = 0  # rollout actors replaced so far
        self.incarnations = [0] * len(handles.rollouts)
        self.loops: list[Any] = []  # each actor's RL loop while RL runs (None while it is replaced)

    def names(self) -> list[str]:
        return [cluster.rollout_name(i, n) for i, n in enumerate(self.incarnations)]

    # ---- weight group -----------------------------------------------------------------
    def open(self) -> int:
        """Form the weight group; returns its size."""
        host, port = cluster.free_address(self.h.trainer_pg, 0)
        tp = self.c.rollout.tensor_parallel_size
        world = 1 + len(self.h.rollouts) * tp
        args = (cluster.backend(self.c), self.c.weights.timeout_s, self.plan)
        ray.get([t.init_weight_group.remote(host, port, world, *args) for t in self.h.trainers]
                + [r.init_weight_group.remote(host, port, 1 + i * tp, world, *args)
                   for i, r in enumerate(self.h.rollouts)])
        return world

    def close(self, indices: list[int]) -> None:
        """The trainer and rollout actors `indices` leave the weight group."""
        ray.get([self.h.trainers[0].close_weight_group.remote()]
                + [self.h.rollouts[i].close_weight_group.remote() for i in indices])

    # ---- weight sync ------------------------------------------------------------------
    def sync(self, version: int) -> dict[str, float]:
        """Every engine gets the trainer's weights as `version`: sync seconds and GB/s."""
        return self._restore(self._ended(), version)

    def _restore(self, lost: dict[int, str], version: int) -> dict[str, float]:
        """Replace the `lost` actors (index: why), then broadcast until no receiver is lost."""
        replaced: set[int] = set()
        while True:
            if lost:
                self._replace(lost)
                replaced.update(lost)
            values, lost = self._broadcast(version)
            if not lost:
                break
        for i in sorted(replaced):
            if self.loops:
                self.loops[i] = self._loop(i)
        return values

    def _broadcast(self, version: int) -> tuple[dict[str, float], dict[int, str]]:
        """One broadcast of the trainer's weights: (its metrics, {}) or ({}, the actors to replace)."""
        timeout = self.c.weights.timeout_s
        sends = [t.broadcast_weights.remote() for t in self.h.trainers]
        pulls = [r.update_weights.remote(version) for r in self.h.rollouts]
        try:
            out = ray.get(sends + pulls, timeout=timeout)
        except RayError as e:
            # A lost receiver fails the broadcast; closing the sender's end releases the others.
            ray.wait(sends, num_returns=len(sends), timeout=timeout)
            ray.get(self.h.trainers[0].close_weight_group.remote())
            failed = errors(pulls, timeout)
            lost = {i: cause for i, err in failed.items() if (cause := loss_cause(err)) is not None}
            if not lost:
                raise self._sync_error(version, e) from e
            broke = "its weight load broke when the weight group lost " + ", ".join(self.names()[i] for i in lost)
            return {}, {i: lost.get(i, broke) for i in failed}
        sent = out[0]
        return ({"sync_seconds": max(o.get("sync_seconds", o.get("load_seconds", 0.0)) for o in out),
                 "sync_gb_per_s": sent["sync_bytes"] / max(sent["sync_seconds"], 1e-9) / 1e9}, {})

    def _sync_error(self, version: int, error: RayError) -> RuntimeError:
        if isinstance(error, GetTimeoutError):
            return RuntimeError(f"the weight sync to policy version {version} did not finish within "
                                f"weights.timeout_s={self.c.weights.timeout_s}s and no rollout actor was lost; "
                                "raise weights.timeout_s if the model is large, or check the actors' logs")
        return RuntimeError(f"the weight sync to policy version {version} failed with no rollout actor lost: "
                            f"{_one_line(getattr(error, 'cause', None) or error)}")

    # ---- RL loops ---------------------------------------------------------------------
    def _loop(self, i: int) -> Any:
        return self.h.rollouts[i].run.remote(cluster.BufferClient(self.h.buffer, i))

    def start(self) -> None:
        self.loops = [self._loop(i) for i in range(len(self.h.rollouts))]

    def _ended(self) -> dict[int, str]:
        """The actors whose RL loop ended early, and why."""
        live = {i: ref for i, ref in enumerate(self.loops) if ref is not None}
        ready, _ = ray.wait(list(live.values()), num_returns=len(live), timeout=0) if live else ([], [])
        return {i: self._why_ended(ref) for i, ref in live.items() if ref in ready}

    @staticmethod
    def _why_ended(ref: Any) -> str:
        try:
            ray.get(ref, timeout=0)
        except RayError as e:
            return loss_cause(e) or f"its RL loop crashed ({_one_line(getattr(e, 'cause', None) or e)})"
        return "its RL loop returned before it was stopped"

    def heal(self, version: int) -> bool:
        """Replace the actors whose RL loop ended early (loading policy `version`); whether any was."""
        lost = self._ended()
        if lost:
            self._restore(lost, version)
        return bool(lost)

    def stop(self, version: int) -> None:
        """End the RL loops; an actor whose loop ended lost is replaced (with policy `version`)."""
        stops = [r.stop.remote() for r in self.h.rollouts]
        ray.wait(stops, num_returns=len(stops), timeout=self.c.weights.timeout_s)
        failed = errors(self.loops, self.c.weights.timeout_s)
        self.loops = []
        lost = {i: loss_cause(e) or f"its RL loop did not stop ({_one_line(e)})" for i, e in failed.items()}
        if lost:
            self._restore(lost, version)

    def last_errors(self) -> dict[str, str | None]:
        """Each actor's engine failure or last failed group (or that it did not answer within 10 s)."""
        refs = [r.stats.remote() for r in self.h.rollouts]
        failed = errors(refs, 10.0)
        stats = [{} if i in failed else ray.get(ref) for i, ref in enumerate(refs)]
        return {name: (f"did not answer ({_one_line(failed[i])})" if i in failed
                       else stats[i]["failure"] or stats[i]["last_error"])
                for i, name in enumerate(self.names())}

    # ---- evaluation -------------------------------------------------------------------
    def evaluate(self, version: int, *args: Any) -> list[dict[str, Any]]:
        """`RolloutActor.evaluate(*args)` on every actor, their records concatenated."""
        while True:
            refs = [r.evaluate.remote(*args) for r in self.h.rollouts]
            failed = errors(refs, None)
            lost = {i: cause for i, e in failed.items() if (cause := loss_cause(e)) is not None}
            for i, e in failed.items():
                if i not in lost:
                    raise e
            if not lost:
                return [rec for out in ray.get(refs) for rec in out]
            self._restore(lost, version)

    # ---- replacement ------------------------------------------------------------------
    def _replace(self, lost: dict[int, str]) -> None:
        """Kill actors `lost`, spawn them again in their bundles and re-form the weight group."""
        c, names = self.c, self.names()
        what = "; ".join(f"{names[i]} was lost: {why}" for i, why in sorted(lost.items()))
        if self.restarts + len(lost) > c.rollout.max_restarts:
            raise RuntimeError(f"{what}. rollout.max_restarts={c.rollout.max_restarts} allows no more "
                               f"replacements ({self.restarts} used): raise it, or fix the cause (the actor's "
                               "log above) and resume the run from its last checkpoint")
        t0 = time.perf_counter()
        print(f"{what}; replacing it", flush=True)
        self.restarts += len(lost)
        for i in lost:
            ray.kill(self.h.rollouts[i], no_restart=True)
            ray.get(self.h.buffer.forget.remote(i))
            if self.loops:
                self.loops[i] = None
        self.close([i for i in range(len(self.h.rollouts)) if i not in lost])
        for i in lost:
            self.incarnations[i] = self.restarts
            self.h.rollouts[i] = cluster.spawn_rollout(c, i, self.h.rollout_pg, self.restarts)
        ray.get([self.h.rollouts[i].start.remote() for i in lost])
        self.open()
        print(f"{', '.join(self.names()[i] for i in sorted(lost))} started in {time.perf_counter() - t0:.1f}s "
              f"({self.restarts} of rollout.max_restarts={c.rollout.max_restarts} used)", flush=True)
