"""A rollout actor whose vLLM engine dies mid-RL (what an OOM or a CUDA fault does: the EngineCore
process is gone, the actor lives on) is replaced like a dead actor, between weight syncs too;
once `rollout.max_restarts` is used up the run stops with one line saying why. A trainer
starved of its batch fails after `rl.batch_timeout_s` with a line naming what it waited for.

The engine is killed through its EngineCore process, a child of the rollout actor's process,
from the controller's own thread as it logs an RL step, so the death lands mid-RL, between
two syncs, at a known step.
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from rlray.config import Config
from rlray.orchestration.controller import Controller, run
from rlray.orchestration.fleet import RolloutFleet
from rlray.orchestration.metrics import Metrics
from tests.ray.conftest import ONE_RANK, kill_engine, tiny_config
from tests.ray.test_replace import rl_records


def kill_engines_at(monkeypatch: pytest.MonkeyPatch, kills: dict[int, str]) -> list[float]:
    """Kill the engine of actor `kills[step]` once RL step `step` is logged; returns the kill times."""
    real_log, times = Metrics.log, []

    def log(self: Metrics, stage: str, at: int, values: dict, total: int | None = None) -> None:
        real_log(self, stage, at, values, total)
        if stage == "rl" and at in kills:
            times.append(kill_engine(ray.get_actor(kills[at])))

    monkeypatch.setattr(Metrics, "log", log)
    return times


def start(c: Config) -> tuple[threading.Thread, dict[str, Any]]:
    """`run(c)` in a thread; its dict gets `summary`, or `error` and `raised_at` (time.monotonic())."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["summary"] = run(c)
        except Exception as e:
            out.update(error=e, raised_at=time.monotonic())

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def test_dead_engines_are_replaced_between_syncs_until_max_restarts(ray_cluster, tmp_path, monkeypatch) -> None:
    """One sync every 4 steps: the engine dies after step 0, while the trainer needs three more
    batches before the next sync; the actor is replaced before that sync and every step runs once,
    in order. The replacement's engine dies after step 5: with rollout.max_restarts=1 used up the
    run stops with one line."""
    c = tiny_config(tmp_path, ONE_RANK, rl={"steps": 12, "sync_every": 4}, rollout={"max_restarts": 1},
                    async_={"max_off_policy_steps": 3})
    c.stages = ["rl"]
    kills = kill_engines_at(monkeypatch, {0: "rollout-0", 5: "rollout-0.1"})
    thread, out = start(c)
    thread.join(timeout=1100)  # bounds a hang only: ~4 min unloaded, 15 min beside busy processes
    assert not thread.is_alive(), "the run did not stop after the second engine death"
    assert len(kills) == 2 and isinstance(out.get("error"), RuntimeError), out
    stopped_after = out["raised_at"] - kills[1]  # seen by the health check, not after rl.batch_timeout_s=600
    assert stopped_after < 60, f"the run stopped {stopped_after:.1f} s after the second engine death"
    message = str(out["error"])
    assert "\n" not in message
    assert message.startswith("rollout-0.1 was lost: its vLLM engine died (EngineDeadError: "), message
    assert "rollout.max_restarts=1 allows no more replacements (1 used)" in message

    rl = rl_records(c.run.dir)
    steps = [r["step"] for r in rl]
    assert steps == list(range(len(steps))) and 6 <= len(steps) < c.rl.steps, steps  # none lost or repeated
    assert [r["rollout_restarts"] for r in rl][3:6] == [1, 1, 1]  # replaced before step 3's sync
    assert all(r["lag_max"] <= 3 for r in rl)
    # Tokens sampled by the trainer's current version agree with the trainer's logprobs to float
    # error only when the engine holds exactly the trainer's weights: so does the replacement's.
    assert max(r["mismatch_kl"] for r in rl) < 1e-5


def test_a_starved_step_fails_naming_what_it_waited_for(ray_cluster, tmp_path) -> None:
    """An elastic pool that lost every engine (rollout.max_actors=2, one joined and both left) says so too."""
    c = tiny_config(tmp_path, rl={"batch_timeout_s": 1.5}, rollout={"max_actors": 2})
    ctl = Controller(c)
    pool = SimpleNamespace(growth=object(), h=SimpleNamespace(rollouts=[]), c=c, joins=1, leaves=2)
    ctl._fleet = SimpleNamespace(heal=lambda version: False,  # type: ignore[assignment]
                                 last_errors=lambda: {"rollout-0": "ValueError: no", "rollout-1": None},
                                 pool_line=lambda: RolloutFleet.pool_line(pool))  # type: ignore[arg-type]
    ctl._h = SimpleNamespace(buffer=SimpleNamespace(queued=SimpleNamespace(  # type: ignore[assignment]
        remote=lambda step: ray.put(1))))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        ctl._wait([ray.ObjectRef.from_random()], 7)  # never ready
    waited = time.monotonic() - t0
    assert 1.5 <= waited < 60, f"the starved step failed after {waited:.1f} s"  # the bound only catches a hang
    assert str(caught.value) == ("RL step 7 waited rl.batch_timeout_s=1.5s for its batch: 1 of 4 groups queued; "
                                 "last errors: rollout-0: ValueError: no; rollout-1: none; rollout pool of 0 "
                                 "(rollout.num_actors=1 .. rollout.max_actors=2; 1 joined, 2 left). "
                                 "Raise rl.batch_timeout_s if rollouts are just slow")
    ctl.metrics.close()


class HungTrainer:
    """A trainer rank whose broadcast never returns: a collective hung on a peer that is gone."""

    def __init__(self) -> None:
        self.closed = 0

    def broadcast_weights(self, version: int) -> None:
        time.sleep(3600)

    def close_weight_group(self) -> None:
        self.closed += 1

    def closes(self) -> int:
        return self.closed


class StubRollout:
    """A rollout actor's `stats` as the fleet reads them during a sync."""

    def __init__(self, failure: str | None, version: int) -> None:
        self.failure, self.version = failure, version

    async def stats(self) -> dict[str, Any]:
        return {"failure": self.failure, "version": self.version, "loading": True}


@pytest.fixture(scope="module")
def hung_trainer(ray_cluster) -> Any:
    """One trainer rank for the stub fleets; a broadcast to it hangs, and so does every later one,
    queued behind the first, as on a rank whose collective never returns."""
    from rlray.orchestration import cluster

    trainer = ray.remote(concurrency_groups={cluster.CONTROL: 1})(HungTrainer).remote()
    ray.get(trainer.closes.remote())
    yield trainer
    ray.kill(trainer)


def stub_fleet(trainer: Any, backend: str, rollouts: list[tuple[str | None, int]]) -> Any:
    from rlray.orchestration import cluster

    c = Config()
    c.cluster.backend = backend
    c.weights.sync_timeout_s, c.weights.group_timeout_s = 2.0, 1.0
    stubs = [ray.remote(StubRollout).remote(*r) for r in rollouts]
    ray.get([s.stats.remote() for s in stubs])  # started
    return RolloutFleet(c, cluster.Handles([trainer], stubs, buffer=None, master=""))


def closes(trainer: Any) -> int:
    return ray.get(trainer.closes.options(concurrency_group="control").remote(), timeout=10)


def test_an_engine_lost_mid_sync_on_nccl_stops_the_run_in_one_line(hung_trainer) -> None:
    """vLLM's NCCL group cannot be abandoned: the fleet names the engine and stops, without waiting
    for the hung broadcast or queueing a call behind it."""
    fleet = stub_fleet(hung_trainer, "nccl", [("its vLLM engine died (EngineDeadError: EngineCore died)", 0),
                                              (None, 0)])
    t0, before = time.monotonic(), closes(hung_trainer)
    with pytest.raises(RuntimeError) as caught:
        fleet.sync(1)
    took = time.monotonic() - t0
    assert took < 60, f"the sync stopped after {took:.1f} s"  # not after the hung broadcast's hour
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("rollout-0 was lost (its vLLM engine died (EngineDeadError: EngineCore died)) during "
                              "the weight sync to policy version 1; vLLM's NCCL weight group has no timeout"), message
    assert "rollout-1" not in message
    assert closes(hung_trainer) == before  # nothing was asked of the hung rank
    for a in fleet.h.rollouts:
        ray.kill(a)


def test_a_sync_past_its_deadline_never_queues_behind_the_hung_broadcast(hung_trainer) -> None:
    """gloo, nothing lost, the broadcast hung: the trainer leaves the group on its control thread
    and the sync fails with one line once weights.sync_timeout_s has passed."""
    fleet = stub_fleet(hung_trainer, "gloo", [(None, 1)])
    t0, before = time.monotonic(), closes(hung_trainer)
    with pytest.raises(RuntimeError, match=r"^the weight sync to policy version 1 did not finish within "
                                           r"weights.sync_timeout_s=2s and no rollout actor was lost"):
        fleet.sync(1)
    took = time.monotonic() - t0
    assert 2 <= took < 60, f"the sync failed after {took:.1f} s"  # not after the hung broadcast's hour
    assert closes(hung_trainer) == before + 1
    for a in fleet.h.rollouts:
        ray.kill(a)


def test_an_engine_that_has_not_loaded_by_the_deadline_is_replaced_on_gloo(hung_trainer) -> None:
    fleet = stub_fleet(hung_trainer, "gloo", [(None, 0), (None, 1)])
    values, lost = fleet._broadcast(1)
    assert values == {} and lost == {0: "it did not finish the weight sync within weights.sync_timeout_s=2s"}
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(fleet.h.rollouts[0].stats.remote(), timeout=10)  # killed, so that gloo releases rank 0
    for a in fleet.h.rollouts:
        ray.kill(a)


class DyingTrainer:
    def broadcast_weights(self, version: int) -> None:
        os._exit(1)

    def close_weight_group(self) -> None:
        pass


def test_a_trainer_rank_that_dies_mid_sync_stops_the_run_in_one_line(ray_cluster) -> None:
    from rlray.orchestration import cluster

    trainer = ray.remote(concurrency_groups={cluster.CONTROL: 1})(DyingTrainer).remote()
    fleet = stub_fleet(trainer, "gloo", [(None, 0)])
    with pytest.raises(RuntimeError, match=r"^a trainer rank died during the weight sync to policy version 1 \("):
        fleet.sync(1)
    for a in fleet.h.rollouts:
        ray.kill(a)
