"""RolloutFleet: the rollout actors, their weight group, weight syncs, RL loops and replacement.

Contract:
- `RolloutFleet(config, handles)` owns `handles.rollouts` (replacements are swapped in
  there, so `cluster.teardown(handles)` kills the current ones) and the weight group: `open()`
  forms it through vLLM's weight-transfer protocol (trainer rank 0 + every engine worker, as
  many ranks per engine as it has workers), handing trainer rank 0 a `FleetClient` over the
  rollout actors; `close(indices)` makes the trainer and rollout actors `indices` leave it.
- `sync(version)` loads the trainer's current weights into every engine, labelled `version`:
  the trainer ranks' `broadcast_weights(version)`, rank 0 driving the engines.
  A rollout actor is lost when it died as a Ray actor, or its engine can serve no more
  (`rollout.EngineFailed`: the engine died, or failed `rollout.max_failed_groups` groups in a
  row; its RL loop ends with that error). Actors found lost before the broadcast or during it
  are replaced and the broadcast repeated, until every engine holds `version`; a broadcast that
  fails with no receiver lost raises, naming the version. A sync never hangs: it has a deadline
  (`weights.sync_timeout_s`) and the engines are watched while it runs; every wait on an actor
  has a timeout, and the trainers leave the weight group on their control thread
  (`cluster.CONTROL`), never queued behind a broadcast in flight. On gloo, shm and m2n (over gloo or
  NCCL) an engine lost mid-sync, or one that has not finished by the deadline or not taken an m2n batch
  within weights.group_timeout_s, is killed and replaced; on nccl and ipc
  the run stops with one line naming it (vLLM's NCCL group cannot be abandoned; its ipc engine
  leaves the other trainer ranks in a barrier).
- `start()` starts every actor's RL loop (they put groups into the buffer); `heal(version)`
  replaces actors whose loop ended early and returns whether it did; `stop(version)` ends the
  loops; `halt()` ends them and empties the weight group without replacing anyone (a lost trainer rank:
  rlray.orchestration.recovery). `evaluate(version, ...)` runs `RolloutActor.evaluate` on every actor, replacing lost ones
  and running it again. `version` is the trainer's policy version: what a replacement loads.
- Replacing actors: kill them, return their buffer tickets, spawn each again in its bundle
  (`cluster.spawn_rollout`), re-form the weight group, load the trainer's weights everywhere
  (a survivor whose load broke with the group is replaced too), then resume their RL loops
  if RL runs. At most `rollout.max_restarts` replacements in all; past that a RuntimeError of
  one line names the actors, why they were lost, and the fix.
- `sleep()` / `wake(tags)` (cluster.colocate with async.max_off_policy_steps=0): the engines release
  the devices while the trainer trains and take them back for the sync and the next batch.
- `last_errors()`: each actor's last failed group, for messages of a starved trainer.
- Elastic pool (rollout.max_actors; rlray.orchestration.elastic): a lost actor whose node is gone is
  dropped, not replaced, and costs no restart; an engine started on a node that joined is added at the
  next `sync` (at `heal`, while the pool is below rollout.num_actors). Either re-forms the weight group
  and syncs every engine fully. Actors keep their slot (`rollout-<slot>`, their buffer tickets) while
  positions in `handles.rollouts` shift. `pool_stats()`: engines, joins and leaves; `pool_line()` the same
  in words for a starved step.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from rlray.actors.rollout import one_line
from rlray.config import Colocation, Config, weight_backend
from rlray.config import backend as collective_backend
from rlray.orchestration import cluster
from rlray.orchestration.calls import HEALTH_S, FleetClient, errors, loss_cause
from rlray.orchestration.elastic import Growth, node_gone
from rlray.weightsync.links import LinkTimeout
from rlray.weightsync.transport import TrainerSpec

POLL_S = 0.5  # a sync in flight looks at the engines this often


def _cause(error: RayError) -> BaseException:
    return getattr(error, "cause", None) or error


def _late(error: RayError) -> bool:
    """Whether a trainer's sync failed because its m2n messages were not taken within their deadline."""
    return isinstance(_cause(error), LinkTimeout)


def _sync_metrics(ranks: list[dict[str, float]]) -> dict[str, float]:
    """A sync's metrics from every trainer rank's: the bytes all of them sent (only rank 0 sends a broadcast)."""
    sent, nbytes = ranks[0], sum(r["sync_bytes"] for r in ranks)
    return {"sync_seconds": sent["sync_seconds"], "sync_mb": nbytes / 1e6, "sync_changed_frac": sent["changed_frac"],
            "sync_gb_per_s": nbytes / max(sent["sync_seconds"], 1e-9) / 1e9,
            "sync_mb_busiest": max(r["sync_bytes"] for r in ranks) / 1e6}


class RolloutFleet:
    def __init__(self, c: Config, handles: cluster.Handles) -> None:
        self.c = c
        self.h = handles
        self.restarts = 0  # rollout actors replaced so far
        n = len(handles.rollouts)
        self.slots = list(range(n))  # each actor's slot: its name and its buffer tickets
        self.incarnations = [0] * n
        self.nodes: list[str | None] = [None] * n  # each actor's Ray node (`open`)
        self.loops: list[Any] = []  # each actor's RL loop while RL runs (None while it is replaced)
        self.running = False  # RL loops on (start .. stop / halt)
        self.epoch = 0  # RL loops started: each actor's `run` and `stop` name the one they mean
        self.growth = Growth(c, handles) if cluster.elastic(c) else None
        self.joins = self.leaves = 0
        self.went: dict[tuple[int, int], bool] = {}  # (slot, incarnation) -> whether it went with its node

    def names(self) -> list[str]:
        return [cluster.rollout_name(s, n) for s, n in zip(self.slots, self.incarnations)]

    def pool_stats(self) -> dict[str, int]:
        if self.growth is None:
            return {}
        return {"rollout_actors": len(self.h.rollouts), "rollout_joins": self.joins, "rollout_leaves": self.leaves}

    def pool_line(self) -> str:
        if self.growth is None:
            return ""
        r = self.c.rollout
        return (f"; rollout pool of {len(self.h.rollouts)} (rollout.num_actors={r.num_actors} .. "
                f"rollout.max_actors={r.max_actors}; {self.joins} joined, {self.leaves} left)")

    # ---- weight group -----------------------------------------------------------------
    def open(self) -> int:
        """Form the weight group (trainer rank 0 + every engine's workers); returns its size."""
        w = self.c.weights
        if not self.h.rollouts:  # an elastic pool that lost every engine: the group waits for one to join
            return 1
        self.nodes = list(cluster.nodes_of(self.h.rollouts, w.sync_timeout_s))
        host, port = cluster.free_address(self.h.trainer_pg, 0)
        backend = weight_backend(self.c)
        if backend in ("gloo", "nccl", "m2n"):  # trainer rank 0 picks the port as it binds (one chosen
            port = 0  # here could be taken)
        workers = ray.get([r.workers.remote() for r in self.h.rollouts], timeout=w.sync_timeout_s)
        senders = len(self.h.trainers) if backend == "m2n" else 1  # m2n: every trainer rank sends
        world = senders + sum(workers)
        spec = TrainerSpec(backend, host, port, world, w.bucket_mb and w.bucket_mb << 20,
                           w.group_timeout_s, w.delta, w.full_every, Colocation(self.c).stride, sum(workers),
                           senders, tuple(workers), collective_backend(self.c))
        client = FleetClient(list(self.h.rollouts), workers, w.sync_timeout_s)
        ray.get([t.init_weight_group.remote(spec, client) for t in self.h.trainers],
                timeout=w.group_timeout_s + w.sync_timeout_s)
        return world

    def close(self, indices: list[int]) -> None:
        """The trainer and rollout actors `indices` leave the weight group."""
        ray.get(self._close_trainers() + [self.h.rollouts[i].shutdown_weight_transfer_engine.remote() for i in indices],
                timeout=self.c.weights.sync_timeout_s)

    def _close_trainers(self) -> list[Any]:
        """Each trainer rank leaves the weight group, on its control thread: never behind a broadcast in flight."""
        return [t.close_weight_group.options(concurrency_group=cluster.CONTROL).remote() for t in self.h.trainers]

    # ---- weight sync ------------------------------------------------------------------
    def sync(self, version: int) -> dict[str, float]:
        """Every engine gets the trainer's weights as `version`: sync seconds and GB/s."""
        return self._restore(self._ended(), version, self._joiner())

    def _joiner(self) -> tuple[int, Any, str] | None:
        if self.growth is None:
            return None
        self.growth.step(len(self.h.rollouts))
        return self.growth.take()

    def _restore(self, lost: dict[int, str], version: int, joiner: tuple[int, Any, str] | None = None) -> dict[str, float]:
        """Drop or replace the `lost` actors (position: why) and add `joiner`, then broadcast until no
        receiver is lost."""
        fresh: set[int] = set()  # slots whose RL loop (re)starts after the broadcast
        if joiner is not None:
            fresh.add(self._admit(*joiner))
        while True:
            if lost:
                fresh.update(self._change(lost))
            if not self.h.rollouts:
                return {}
            values, lost = self._broadcast(version)
            if not lost:
                break
        for i, slot in enumerate(self.slots):
            if self.running and slot in fresh:
                self.loops[i] = self._loop(i)
        return values

    def _broadcast(self, version: int) -> tuple[dict[str, float], dict[int, str]]:
        """One sync of the trainer's weights: (its metrics, {}) or ({}, the actors to replace).

        The sync runs under a deadline (`weights.sync_timeout_s`) while the engines are watched: a send
        that fails, an engine lost meanwhile or the deadline passing breaks it off (`_abandon`)."""
        sends = [t.broadcast_weights.remote(version) for t in self.h.trainers]
        deadline, lost = time.monotonic() + self.c.weights.sync_timeout_s, {}
        while True:
            ready, _ = ray.wait(sends, num_returns=len(sends), timeout=POLL_S)
            failed = list(errors(ready, 0).values())
            if len(ready) == len(sends) and not failed:
                return _sync_metrics(ray.get(sends)), {}
            if failed or time.monotonic() > deadline:
                break
            lost = self._dead()
            if lost:
                break
        return {}, self._abandon(version, sends, lost, failed)

    def _dead(self) -> dict[int, str]:
        """The actors that died or whose engine can serve no more (one that does not answer is not counted)."""
        refs = [r.stats.remote() for r in self.h.rollouts]
        failed = errors(refs, HEALTH_S)
        lost = {i: cause for i, err in failed.items() if (cause := loss_cause(err)) is not None}
        return lost | {i: s["failure"] for i, ref in enumerate(refs) if i not in failed
                       and (s := ray.get(ref))["failure"] is not None}

    def _abandon(self, version: int, sends: list[Any], lost: dict[int, str], failed: list[RayError]) -> dict[int, str]:
        """A sync broke off: the actors to replace before it is repeated, or a one-line RuntimeError.

        On nccl the run stops: vLLM's NCCL communicator has no timeout, so a broadcast hung on trainer rank
        0's GPU cannot be abandoned inside that process. On gloo the lost engines are killed (which fails
        rank 0's broadcast to them), the trainers' sends end within the group timeout, the group is closed
        and every engine whose load broke off with it is replaced too. m2n (gloo or NCCL) closes the trainers' ends first:
        NCCL fails no send to a dead engine, and a batch's wait on a closed end raises at once (rlray.weightsync.links);
        a silent engine is found by the batch's own deadline, weights.group_timeout_s."""
        w = self.c.weights
        # A trainer's own death; not a task error whose cause is an engine's death (Ray makes those both)
        trainer_died = next((e for e in failed if isinstance(e, RayActorError) and not isinstance(e, RayTaskError)),
                            None)
        if trainer_died is not None:
            raise RuntimeError(f"a trainer rank died during the weight sync to policy version {version} "
                               f"({one_line(trainer_died)}); resume the run from its last checkpoint (same run.dir)")
        lost = lost or self._dead()
        late = next((e for e in failed if _late(e)), None)
        if not lost and (late or not failed):  # a deadline passed: the engines that have not finished are stuck
            lost = self._unfinished(version, late)
        if weight_backend(self.c) in ("nccl", "ipc"):
            raise RuntimeError(self._stuck(version, lost, failed))
        self._gone(lost)  # asked before the kill, which would make every one of them look dead on a live node
        for i in lost:
            ray.kill(self.h.rollouts[i], no_restart=True)  # gloo: rank 0's broadcast to it fails instead of waiting
        if weight_backend(self.c) == "m2n":  # over NCCL a send to the dead never fails: abort the ends, waits end now
            ray.get(self._close_trainers(), timeout=w.sync_timeout_s)
        ray.wait(sends, num_returns=len(sends), timeout=w.group_timeout_s)
        ray.get(self._close_trainers(), timeout=w.sync_timeout_s)
        found, stats = self._lost_in_sync(version, w.group_timeout_s)
        lost = found | lost  # what broke the sync off, over what was found after
        if not lost:
            raise self._sync_error(version, failed[0] if failed else None)
        broke = "its weight load broke when the weight group lost " + ", ".join(self.names()[i] for i in sorted(lost))
        return lost | {i: broke for i, s in stats.items() if i not in lost and s["version"] != version}

    def _unfinished(self, version: int, late: RayError | None = None) -> dict[int, str]:
        """Past the sync's deadline, or a batch's (`late`: a trainer's m2n messages to a silent engine): the actors
        that do not answer or have not loaded `version`."""
        refs = [r.stats.remote() for r in self.h.rollouts]
        failed = errors(refs, HEALTH_S)
        why = (f"it did not finish the weight sync within weights.sync_timeout_s={self.c.weights.sync_timeout_s:g}s"
               if late is None else f"it did not take the weight sync's messages ({one_line(_cause(late))})")
        return {i: why for i, ref in enumerate(refs) if i in failed or ray.get(ref)["version"] != version}

    def _stuck(self, version: int, lost: dict[int, str], failed: list[RayError]) -> str:
        names = self.names()
        what = ("; ".join(f"{names[i]} was lost ({why})" for i, why in sorted(lost.items())) if lost else
                f"the weight sync did not finish within weights.sync_timeout_s={self.c.weights.sync_timeout_s:g}s"
                + (f" ({one_line(getattr(failed[0], 'cause', None) or failed[0])})" if failed else ""))
        why = ("vLLM's NCCL weight group has no timeout, so trainer rank 0's broadcast cannot be abandoned"
               if weight_backend(self.c) == "nccl" else
               "vLLM's ipc engine leaves the other trainer ranks waiting in its barrier")
        return (f"{what} during the weight sync to policy version {version}; {why} and the run stops: resume it "
                "from its last checkpoint (same run.dir)")

    def _lost_in_sync(self, version: int, timeout: float) -> tuple[dict[int, str], dict[int, dict[str, Any]]]:
        """After a broken sync, once every survivor's load has ended (a load still blocked in the broadcast
        ends once rank 0's end is closed): the actors that died or whose engine failed, and every answer."""
        deadline = time.monotonic() + timeout
        while True:
            refs = [r.stats.remote() for r in self.h.rollouts]
            failed = errors(refs, max(1.0, deadline - time.monotonic()))
            stats = {i: ray.get(ref) for i, ref in enumerate(refs) if i not in failed}
            if time.monotonic() > deadline or not any(s["loading"] and s["version"] != version
                                                      and s["failure"] is None for s in stats.values()):
                break
            time.sleep(0.2)
        lost = {i: cause for i, err in failed.items() if (cause := loss_cause(err)) is not None}
        return lost | {i: s["failure"] for i, s in stats.items() if s["failure"] is not None}, stats

    def _sync_error(self, version: int, error: RayError | None) -> RuntimeError:
        if error is None:
            return RuntimeError(f"the weight sync to policy version {version} did not finish within "
                                f"weights.sync_timeout_s={self.c.weights.sync_timeout_s:g}s and no rollout actor was "
                                "lost; raise weights.sync_timeout_s if the model is large, or check the actors' logs")
        return RuntimeError(f"the weight sync to policy version {version} failed with no rollout actor lost: "
                            f"{one_line(getattr(error, 'cause', None) or error)}")

    # ---- colocated turns ----------------------------------------------------------------
    def sleep(self) -> None:
        """Colocated engines make room for the trainer: vLLM's sleep mode at rollout.sleep_level on GPUs,
        generation paused on CPUs (level 0: vLLM has no sleep mode there). A lost engine is left to `heal`."""
        level = self.c.rollout.sleep_level if self.c.trainer.gpus_per_rank > 0 else 0
        self._each(lambda r: r.sleep.remote(level))

    def wake(self, tags: list[str] | None = None) -> None:
        """Wake what `sleep` released (`tags`: vLLM's "weights" or "kv_cache" only; None: everything)."""
        self._each(lambda r: r.wake_up.remote(tags))

    def _each(self, call: Any) -> None:
        failed = errors([call(r) for r in self.h.rollouts], self.c.weights.sync_timeout_s)
        for e in failed.values():
            if loss_cause(e) is None:
                raise e

    # ---- RL loops ---------------------------------------------------------------------
    def _loop(self, i: int) -> Any:
        return self.h.rollouts[i].run.remote(cluster.BufferClient(self.h.buffer, self.slots[i]), self.epoch)

    def start(self) -> None:
        self.running, self.epoch = True, self.epoch + 1
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
            return loss_cause(e) or f"its RL loop crashed ({one_line(getattr(e, 'cause', None) or e)})"
        return "its RL loop returned before it was stopped"

    def heal(self, version: int) -> bool:
        """Replace the actors whose RL loop ended early (loading policy `version`), and below
        rollout.num_actors add an engine that joined; whether any of that happened."""
        lost = self._ended()
        joiner = None
        if self.growth is not None:
            self.growth.step(len(self.h.rollouts))
            joiner = self.growth.take() if len(self.h.rollouts) < self.c.rollout.num_actors else None
        if lost or joiner:
            self._restore(lost, version, joiner)
        return bool(lost or joiner)

    def stop(self, version: int) -> None:
        """End the RL loops; an actor whose loop ended lost is replaced (with policy `version`)."""
        stops = [r.stop.remote(self.epoch) for r in self.h.rollouts]
        ray.wait(stops, num_returns=len(stops), timeout=self.c.weights.sync_timeout_s)
        failed = errors(self.loops, self.c.weights.sync_timeout_s)
        self.loops, self.running = [], False
        lost = {i: loss_cause(e) or f"its RL loop did not stop ({one_line(e)})" for i, e in failed.items()}
        if lost:
            self._restore(lost, version)

    def halt(self) -> None:
        """End the RL loops and have every rollout actor leave the weight group, replacing none: the trainer
        side is gone (rlray.orchestration.recovery) and the group is re-formed with its successor."""
        timeout = self.c.weights.sync_timeout_s
        errors([r.stop.remote(self.epoch) for r in self.h.rollouts] + [ref for ref in self.loops if ref is not None], timeout)
        self.loops, self.running = [], False
        errors([r.shutdown_weight_transfer_engine.remote() for r in self.h.rollouts], timeout)

    def last_errors(self) -> dict[str, str | None]:
        """Each actor's engine failure or last failed group, else its failed rollouts and the last one's error (or
        that it did not answer within 10 s)."""
        refs = [r.stats.remote() for r in self.h.rollouts]
        failed = errors(refs, 10.0)
        stats = [{} if i in failed else ray.get(ref) for i, ref in enumerate(refs)]
        return {name: (f"did not answer ({one_line(failed[i])})" if i in failed
                       else stats[i]["failure"] or stats[i]["last_error"] or _rollouts_failed(stats[i]))
                for i, name in enumerate(self.names())}

    # ---- evaluation -------------------------------------------------------------------
    def evaluate(self, version: int, *args: Any) -> list[dict[str, Any]]:
        """`RolloutActor.evaluate(*args)` on every actor, their records concatenated."""
        while True:
            n = len(self.h.rollouts)
            refs = [r.evaluate.remote(*args, part=i, parts=n) for i, r in enumerate(self.h.rollouts)]
            failed = errors(refs, None)
            lost = {i: cause for i, e in failed.items() if (cause := loss_cause(e)) is not None}
            for i, e in failed.items():
                if i not in lost:
                    raise e
            if not lost:
                return [rec for out in ray.get(refs) for rec in out]
            self._restore(lost, version)

    # ---- membership ---------------------------------------------------------------------
    def _change(self, lost: dict[int, str]) -> set[int]:
        """Drop the `lost` actors whose node is gone (elastic pool), replace the others; the slots to restart."""
        gone = self._gone(lost)
        kept = {i: why for i, why in lost.items() if i not in gone}
        fresh = {self.slots[i] for i in kept}
        if kept:
            self._replace(kept)
        if gone:
            self._drop(gone)
        return fresh

    def _gone(self, lost: dict[int, str]) -> dict[int, str]:
        """Elastic pool: those of the `lost` actors that went with their node (asked once per actor)."""
        if self.growth is None:
            return {}
        for i in lost:
            key = (self.slots[i], self.incarnations[i])
            if key not in self.went:
                self.went[key] = node_gone(self.h.rollouts[i], self.nodes[i])
        return {i: f"its node {cluster.node_label(self.nodes[i] or '')} is gone" for i in lost
                if self.went[(self.slots[i], self.incarnations[i])]}

    def _forget(self, i: int) -> None:
        """Kill actor `i`, return its tickets to the buffer and read its RL loop's error."""
        ray.kill(self.h.rollouts[i], no_restart=True)
        ray.get(self.h.buffer.forget.remote(self.slots[i]))
        if self.loops and self.loops[i] is not None:
            errors([self.loops[i]], HEALTH_S)  # its error, read: Ray prints a traceback for one never read
            self.loops[i] = None

    def _drop(self, gone: dict[int, str]) -> None:
        """Elastic pool: the actors `gone` leave it (no replacement, no restart used); the group is re-formed."""
        assert self.growth is not None
        names = self.names()
        for i in sorted(gone, reverse=True):
            self._forget(i)
            self.growth.release(self.slots[i])
            for column in [self.h.rollouts, self.slots, self.incarnations, self.nodes] + ([self.loops] if self.loops else []):
                del column[i]
        self.leaves += len(gone)
        self.close(list(range(len(self.h.rollouts))))
        self.open()
        for i, why in sorted(gone.items()):
            print(f"{names[i]} left the rollout pool: {why}{self.pool_line()}", flush=True)

    def _admit(self, slot: int, actor: Any, node: str) -> int:
        """Elastic pool: rollout actor `slot`, started on `node`, joins; the group is re-formed. Returns `slot`."""
        self.close(list(range(len(self.h.rollouts))))
        self.h.rollouts.append(actor)
        self.slots.append(slot)
        self.incarnations.append(0)
        self.nodes.append(node)
        if self.running:
            self.loops.append(None)
        self.joins += 1
        self.open()
        print(f"{cluster.rollout_name(slot)} joined the rollout pool on node {cluster.node_label(node)}{self.pool_line()}", flush=True)
        return slot

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
            self._forget(i)
        self.close([i for i in range(len(self.h.rollouts)) if i not in lost])
        for i in lost:
            self.incarnations[i] = self.restarts
            self.h.rollouts[i] = cluster.spawn_rollout(c, self.slots[i], *cluster.rollout_site(c, self.h, self.slots[i]),
                                                       self.restarts)
        timeout = self.c.rl.batch_timeout_s
        try:  # a bundle whose node is gone waits for Ray to place it again, which needs room somewhere
            ray.get([self.h.rollouts[i].start.remote() for i in lost], timeout=timeout)
        except GetTimeoutError:
            raise RuntimeError(f"{', '.join(self.names()[i] for i in sorted(lost))} did not start within "
                               f"rl.batch_timeout_s={timeout:g}s (no room for its bundle since its node left?); "
                               "add a node, or set rollout.max_actors to let the pool shrink") from None
        self.open()
        print(f"{', '.join(self.names()[i] for i in sorted(lost))} started in {time.perf_counter() - t0:.1f}s "
              f"({self.restarts} of rollout.max_restarts={c.rollout.max_restarts} used)", flush=True)


def _rollouts_failed(stats: dict[str, Any]) -> str | None:
    if not stats.get("failed_rollouts"):
        return None
    return f"no failed group, {stats['failed_rollouts']} failed rollouts, the last: {stats['last_rollout_error']}"
