"""A rollout actor whose vLLM engine dies mid-RL (what an OOM or a CUDA fault does: the EngineCore
process is gone, the actor lives on) is replaced like a dead actor, between weight syncs too;
once `rollout.max_restarts` is used up the run stops with one line saying why. A trainer
starved of its batch fails after `rl.batch_timeout_s` with a line naming what it waited for.

The engine is killed through its EngineCore process, a child of the rollout actor's process,
from the controller's own thread as it logs an RL step, so the death lands mid-RL, between
two syncs, at a known step.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import ray

from rlray.config import Config
from rlray.controller import Controller, run
from rlray.metrics import Metrics
from tests.ray.conftest import tiny_config
from tests.ray.test_replace import rl_records


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


def kill_engines_at(monkeypatch: pytest.MonkeyPatch, kills: dict[int, str]) -> list[float]:
    """Kill the engine of actor `kills[step]` once RL step `step` is logged; returns the kill times."""
    real_log, times = Metrics.log, []

    def log(self: Metrics, stage: str, at: int, values: dict, total: int | None = None) -> None:
        real_log(self, stage, at, values, total)
        if stage == "rl" and at in kills:
            times.append(kill_engine(kills[at]))

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
    c = tiny_config(tmp_path, rl={"steps": 12, "sync_every": 4}, rollout={"max_restarts": 1},
                    async_={"max_off_policy_steps": 3})
    c.stages = ["rl"]
    kills = kill_engines_at(monkeypatch, {0: "rollout-0", 5: "rollout-0.1"})
    thread, out = start(c)
    thread.join(timeout=900)
    assert not thread.is_alive(), "the run did not stop after the second engine death"
    assert len(kills) == 2 and isinstance(out.get("error"), RuntimeError), out
    assert out["raised_at"] - kills[1] < 60
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
