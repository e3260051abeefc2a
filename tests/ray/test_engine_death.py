"""A rollout actor is replaced whichever way it is lost mid-RL, and the run loses no step: its
vLLM engine dies (what an OOM or a CUDA fault does: the EngineCore process is gone, the actor
lives on), the actor itself is killed between steps (seen by the health check while the trainer
waits for its batch), or right before a weight sync (the broadcast itself fails); between syncs
too. Once `rollout.max_restarts` is used up the run stops with one line saying why. A trainer
starved of its batch fails after `rl.batch_timeout_s` with a line naming what it waited for.

Deaths are caused from the controller's own thread as it logs an RL step (or inside the sync),
so each lands mid-RL at a known step: an engine through its EngineCore process, a child of the
rollout actor's process; an actor with `ray.kill`.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import ray

from rlray.config import Config
from rlray.controller import Controller, run
from rlray.metrics import Metrics
from tests.ray.conftest import tiny_config


def rl_records(run_dir: str) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["stage"] == "rl"]


def kill_actor(actor: Any) -> float:
    """`ray.kill` a rollout actor (a handle or its name) and return once Ray reports it dead
    (the time of the kill)."""
    actor = ray.get_actor(actor) if isinstance(actor, str) else actor
    ray.kill(actor, no_restart=True)
    killed = time.monotonic()
    while True:
        try:
            ray.get(actor.stats.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return killed


def kill_engine(actor_name: str, timeout: float = 60) -> float:
    """SIGKILL rollout actor `actor_name`'s EngineCore process and wait until the actor knows its
    engine is gone; returns the time of the kill (time.monotonic())."""
    actor = ray.get_actor(actor_name)
    pid = ray.get(actor.pid.remote(), timeout=timeout)
    cores = [p for p in psutil.Process(pid).children() if p.name() == "VLLM::EngineCore"]
    assert len(cores) == 1, f"{actor_name} (pid {pid}) has EngineCore children {cores}"
    cores[0].kill()
    killed = deadline = time.monotonic()
    deadline += timeout
    while ray.get(actor.stats.remote(), timeout=timeout)["failure"] is None:
        assert time.monotonic() < deadline, f"{actor_name} did not notice its engine's death"
        time.sleep(0.05)
    return killed


def kill_at(monkeypatch: pytest.MonkeyPatch, kills: dict[int, tuple[str, str]]) -> list[float]:
    """Once RL step `step` is logged, kill what `kills[step]` names: ("engine" | "actor", actor name);
    returns the kill times."""
    real_log, times = Metrics.log, []

    def log(self: Metrics, stage: str, at: int, values: dict, total: int | None = None) -> None:
        real_log(self, stage, at, values, total)
        if stage == "rl" and at in kills:
            what, name = kills[at]
            times.append(kill_engine(name) if what == "engine" else kill_actor(name))

    monkeypatch.setattr(Metrics, "log", log)
    return times


def kill_in_sync(monkeypatch: pytest.MonkeyPatch, version: int) -> list[int]:
    """Kill the rollout actor inside the sync to `version`, after its health check passed."""
    from rlray.fleet import RolloutFleet

    real_sync, lost = RolloutFleet.sync, []

    def sync_losing_an_actor(self: RolloutFleet, v: int) -> dict:
        if not (self.loops and v == version and not lost):
            return real_sync(self, v)
        lost.append(v)
        kill_actor(self.h.rollouts[0])
        self._ended = dict  # type: ignore[method-assign]  # the health check already passed
        try:
            return real_sync(self, v)
        finally:
            del self._ended

    monkeypatch.setattr(RolloutFleet, "sync", sync_losing_an_actor)
    return lost


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


def test_lost_rollout_actors_are_replaced_until_max_restarts(ray_cluster, tmp_path, monkeypatch) -> None:
    """One sync per step, on-policy. The engine dies after step 0, the actor is killed after
    step 3 and inside the sync after step 5: each is replaced and no step is lost or repeated.
    The fourth loss, with rollout.max_restarts=3 used up, stops the run with one line."""
    c = tiny_config(tmp_path, rl={"steps": 12}, rollout={"max_restarts": 3}, async_={"max_off_policy_steps": 0})
    c.stages = ["rl"]
    kills = kill_at(monkeypatch, {0: ("engine", "rollout-0"), 3: ("actor", "rollout-0.1"),
                                  8: ("engine", "rollout-0.3")})
    lost_in_sync = kill_in_sync(monkeypatch, 6)
    thread, out = start(c)
    thread.join(timeout=900)
    assert not thread.is_alive(), "the run did not stop after the fourth loss"
    assert len(kills) == 3 and lost_in_sync == [6] and isinstance(out.get("error"), RuntimeError), out
    assert out["raised_at"] - kills[-1] < 60
    message = str(out["error"])
    assert "\n" not in message
    assert message.startswith("rollout-0.3 was lost: its vLLM engine died (EngineDeadError: "), message
    assert "rollout.max_restarts=3 allows no more replacements (3 used)" in message

    rl = rl_records(c.run.dir)
    assert [r["step"] for r in rl] == list(range(9))  # step 9 never completes
    restarts = [r["rollout_restarts"] for r in rl]  # logged after the step's sync
    assert restarts[0] == 0 and restarts[1] in (0, 1) and restarts[2:4] == [1, 1], restarts
    assert restarts[4] in (1, 2) and restarts[5:] == [3, 3, 3, 3], restarts
    # On-policy, inference and trainer logprobs agree to float error only when the engine
    # holds exactly the trainer's weights: so do the replacements', from their first batch on.
    assert all(r["lag_max"] == 0 for r in rl)
    assert max(r["mismatch_kl"] for r in rl) < 1e-5


def test_dead_engine_between_syncs_is_replaced(ray_cluster, tmp_path, monkeypatch) -> None:
    """One sync every 4 steps: the engine dies after step 0 while the trainer needs three more
    batches before the next sync; the actor is replaced before that sync and every step runs
    once, in order."""
    c = tiny_config(tmp_path, rl={"steps": 6, "sync_every": 4}, async_={"max_off_policy_steps": 3})
    c.stages = ["rl"]
    kills = kill_at(monkeypatch, {0: ("engine", "rollout-0")})
    thread, out = start(c)
    thread.join(timeout=900)
    assert not thread.is_alive() and "summary" in out, out.get("error")
    assert len(kills) == 1
    rl = rl_records(c.run.dir)
    assert [r["step"] for r in rl] == list(range(c.rl.steps))
    assert [r["rollout_restarts"] for r in rl][3:] == [1, 1, 1]  # replaced before step 3's sync
    assert all(r["lag_max"] <= 3 for r in rl)


def test_a_starved_step_fails_naming_what_it_waited_for(ray_cluster, tmp_path) -> None:
    c = tiny_config(tmp_path, rl={"batch_timeout_s": 1.5})
    ctl = Controller(c)
    ctl._fleet = SimpleNamespace(heal=lambda version: False,  # type: ignore[assignment]
                                 last_errors=lambda: {"rollout-0": "ValueError: no", "rollout-1": None})
    ctl._h = SimpleNamespace(buffer=SimpleNamespace(queued=SimpleNamespace(  # type: ignore[assignment]
        remote=lambda step: ray.put(1))))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        ctl._wait([ray.ObjectRef.from_random()], 7)  # never ready
    assert 1.5 <= time.monotonic() - t0 < 10
    assert str(caught.value) == ("RL step 7 waited rl.batch_timeout_s=1.5s for its batch: 1 of 4 groups queued; "
                                 "last errors: rollout-0: ValueError: no; rollout-1: none. "
                                 "Raise rl.batch_timeout_s if rollouts are just slow")
    ctl.metrics.close()
