"""A rollout actor killed mid-RL is replaced: the run loses no step and the new engine has the policy.

The tiny config has one rollout actor, so after a kill nothing produces groups until the
replacement is up; the trainer waits, then every step runs once, in order.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import ray

from rlray.orchestration.controller import run
from rlray.orchestration.fleet import RolloutFleet
from tests.ray.conftest import kill_engine, tiny_config

LOSSES = ("grpo",)  # the default; this run also checks it as tests/ray/test_losses_e2e would


def rl_records(run_dir: str) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["stage"] == "rl"]


def loading(actor: ray.actor.ActorHandle) -> bool:
    """Whether `actor`'s `update_weights` is running (Ray's task events, reported about once a second):
    trainer rank 0 asks for it only once every engine's `start_weight_update` has returned."""
    from ray.util.state import list_tasks

    tasks = list_tasks(address=ray.get_runtime_context().gcs_address, raise_on_missing_output=False,
                       filters=[("actor_id", "=", actor._actor_id.hex()), ("state", "=", "RUNNING")])
    return any(t.name.endswith(".update_weights") for t in tasks)


def mid_sync(fleet: RolloutFleet, act: Callable[[ray.actor.ActorHandle], None], problems: list[str]) -> None:
    """Do `act` to rollout actor 0 while the sync that starts now is in its transfer; what went wrong on the way goes
    to `problems`. Trainer rank 1 is frozen first, so rank 0 waits in its first gather (broadcast) or the workers for
    rank 1's slices (m2n) while the engine, its load started, waits; `act` runs there, then rank 1 is thawed."""
    rank1 = psutil.Process(ray.get(fleet.h.trainers[1].pid.remote(), timeout=60))
    actor = fleet.h.rollouts[0]
    rank1.suspend()

    def run_it() -> None:
        try:
            deadline = time.monotonic() + 120
            while not loading(actor):  # start_weight_update finished: the load waits for the first bucket
                if time.monotonic() > deadline:
                    raise TimeoutError("rollout-0's update_weights was not running 120 s into the sync")
                time.sleep(0.1)
            act(actor)
        except Exception as e:
            problems.append(f"{type(e).__name__}: {e}")
        finally:
            rank1.resume()

    threading.Thread(target=run_it, daemon=True).start()


def kill_engine_mid_broadcast(fleet: RolloutFleet, problems: list[str]) -> None:
    """Kill the engine of rollout actor 0 mid-sync (`mid_sync`): rank 0's broadcast meets a peer that is gone, as an
    NCCL broadcast would (where it then hangs)."""
    mid_sync(fleet, kill_engine, problems)


def test_killed_rollout_actors_are_replaced(ray_cluster, tmp_path, monkeypatch) -> None:
    """The only rollout actor is lost three times: killed between steps (seen by the health check
    while the trainer waits for its batch), its engine killed in the middle of a weight sync's
    broadcast (the fleet's deadline path: the engine is replaced and the sync repeated), then the
    actor killed right before a sync (the broadcast itself fails). Every step runs once."""
    c = tiny_config(tmp_path, rl={"steps": 8}, async_={"max_off_policy_steps": 0})  # every batch on-policy
    c.stages = ["rl"]
    real_sync, real_broadcast = RolloutFleet.sync, RolloutFleet._broadcast
    lost_in_sync: list[int] = []
    killed_mid_sync: list[int] = []
    killed_after_sync: list[int] = []
    problems: list[str] = []

    def broadcast_losing_an_engine(self: RolloutFleet, version: int) -> tuple:
        if self.loops and version == 5 and not killed_mid_sync:
            killed_mid_sync.append(version)
            kill_engine_mid_broadcast(self, problems)
        return real_broadcast(self, version)

    def sync_losing_an_actor(self: RolloutFleet, version: int) -> dict:
        if self.loops and version == 3 and not killed_after_sync:  # the trainer then waits for its batch
            values = real_sync(self, version)
            killed_after_sync.append(version)
            kill(self.h.rollouts[0])
            return values
        if not (self.loops and version == 6 and not lost_in_sync):
            return real_sync(self, version)
        lost_in_sync.append(version)
        kill(self.h.rollouts[0])
        self._ended = dict  # type: ignore[method-assign]  # the health check already passed
        try:
            return real_sync(self, version)
        finally:
            del self._ended

    monkeypatch.setattr(RolloutFleet, "sync", sync_losing_an_actor)
    monkeypatch.setattr(RolloutFleet, "_broadcast", broadcast_losing_an_engine)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(summary=run(c)), daemon=True)
    thread.start()
    thread.join(timeout=900)
    assert not thread.is_alive() and "summary" in out

    rl = rl_records(c.run.dir)
    assert (killed_after_sync, killed_mid_sync, lost_in_sync) == ([3], [5], [6]) and not problems, problems
    assert [r["step"] for r in rl] == list(range(8))
    restarts = [r["rollout_restarts"] for r in rl]  # logged before each step's sync
    assert restarts[:3] == [0, 0, 0] and restarts[3] in (0, 1) and restarts[4:] == [1, 2, 3, 3]
    # On-policy, inference and trainer logprobs agree to float error only when the engine has
    # exactly the trainer's weights: so do the replacements', from their first batch on.
    assert all(r["lag_max"] == 0 for r in rl)
    assert max(r["mismatch_kl"] for r in rl) < 1e-5
    assert out["summary"]["rl_end_reward"] > 0.0
    assert c.algo.loss == LOSSES[0]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rl)


def kill(actor) -> None:  # type: ignore[no-untyped-def]
    """Kill `actor` and return once Ray reports it dead."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            ray.get(actor.stats.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:  # a loaded machine: ask again
            pass
        assert time.monotonic() < deadline, "Ray did not report the killed rollout actor dead within 120 s"


def freeze_engine_mid_broadcast(fleet: RolloutFleet, frozen: list[tuple[int, float]], problems: list[str]) -> None:
    """Stop (SIGSTOP) the EngineCore of rollout actor 0 mid-sync (`mid_sync`): a silent peer, as a hung GPU is;
    (pid, time) of the stop goes to `frozen`."""

    def stop(actor: ray.actor.ActorHandle) -> None:
        pid = ray.get(actor.pid.remote(), timeout=60)
        core = next(c for c in psutil.Process(pid).children() if c.name() == "VLLM::EngineCore")
        core.suspend()
        frozen.append((core.pid, time.monotonic()))

    mid_sync(fleet, stop, problems)


def test_m2n_over_nccl_replaces_an_engine_killed_or_silent_mid_sync(ray_cluster, tmp_path, monkeypatch) -> None:
    """weights.transport=m2n, 2 trainer ranks, the NCCL transport on its stand-in communicator (tests/fake_nccl.py:
    no failure propagates, a send waits for its receive). The engine is killed mid-sync (version 2: the ranks' sends
    to it never end, their batches time out and close every end), then its replacement's EngineCore stopped mid-sync
    (version 3: a silent peer; the trainers' batches raise `LinkTimeout` within weights.group_timeout_s + 5 s). Each
    time the engine is replaced and the sync repeated into the new one, which then scores as the trainer does
    (on-policy mismatch at float error)."""
    import rlray.orchestration.fleet as fleet_module

    monkeypatch.setattr(fleet_module, "collective_backend", lambda c: "nccl")  # the m2n links' transport
    timeout = 15
    c = tiny_config(tmp_path, rl={"steps": 4}, async_={"max_off_policy_steps": 0},
                    weights={"transport": "m2n", "group_timeout_s": timeout, "sync_timeout_s": 60})
    c.stages = ["rl"]
    assert c.trainer.num_ranks == 2
    real_broadcast, real_abandon = RolloutFleet._broadcast, RolloutFleet._abandon
    problems: list[str] = []
    frozen: list[tuple[int, float]] = []
    events: list[tuple[int, float, dict]] = []

    def broadcast_losing_an_engine(self: RolloutFleet, version: int) -> tuple:
        if self.loops and version == 2 and not events:
            kill_engine_mid_broadcast(self, problems)
        if self.loops and version == 3 and not frozen:
            freeze_engine_mid_broadcast(self, frozen, problems)
        return real_broadcast(self, version)

    def abandon(self: RolloutFleet, version: int, *args) -> dict[int, str]:
        seen = time.monotonic()
        try:
            lost = real_abandon(self, version, *args)
        finally:
            for pid, _ in frozen:  # the stopped process, its actor gone: no longer needed
                psutil.Process(pid).kill() if psutil.pid_exists(pid) else None
        events.append((version, seen, lost))
        return lost

    monkeypatch.setattr(RolloutFleet, "_broadcast", broadcast_losing_an_engine)
    monkeypatch.setattr(RolloutFleet, "_abandon", abandon)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(summary=run(c)), daemon=True)
    thread.start()
    thread.join(timeout=600)
    assert not thread.is_alive() and "summary" in out and not problems, problems
    assert [(v, sorted(lost)) for v, _, lost in events] == [(2, [0]), (3, [0])], events
    _, seen, lost = events[1]
    assert seen - frozen[0][1] < timeout + 5, (seen - frozen[0][1], events)
    assert "did not take the weight sync's messages (LinkTimeout: m2n messages with ranks [2] not done within 15s" \
        in lost[0], lost
    rl = rl_records(c.run.dir)
    assert [r["step"] for r in rl] == list(range(4)) and rl[-1]["rollout_restarts"] == 2
    assert all(r["lag_max"] == 0 for r in rl) and max(r["mismatch_kl"] for r in rl) < 1e-5
