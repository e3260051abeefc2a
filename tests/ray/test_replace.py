"""A rollout actor killed mid-RL is replaced: the run loses no step and the new engine has the policy.

The tiny config has one rollout actor, so after a kill nothing produces groups until the
replacement is up; the trainer waits, then every step runs once, in order.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import ray

from rlray.controller import run
from tests.ray.conftest import tiny_config

LOSSES = ("grpo",)  # the default; this run also checks it as tests/ray/test_losses_e2e would


def rl_records(run_dir: str) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["stage"] == "rl"]


def test_killed_rollout_actors_are_replaced(ray_cluster, tmp_path, monkeypatch) -> None:
    """The only rollout actor is killed twice: between steps (seen by the health check while
    the trainer waits for its batch), then right before a sync (the broadcast itself fails)."""
    from rlray.fleet import RolloutFleet

    c = tiny_config(tmp_path, rl={"steps": 8}, async_={"max_off_policy_steps": 0})  # every batch on-policy
    c.stages = ["rl"]
    real_sync = RolloutFleet.sync
    lost_in_sync: list[int] = []

    def sync_losing_an_actor(self: RolloutFleet, version: int) -> dict:
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
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(summary=run(c)), daemon=True)
    thread.start()
    deadline = time.time() + 900
    while len(rl_records(c.run.dir)) < 3 and thread.is_alive() and time.time() < deadline:
        time.sleep(0.2)
    assert len(rl_records(c.run.dir)) == 3, "RL did not reach step 3"
    kill(ray.get_actor("rollout-0"))
    thread.join(timeout=900)
    assert not thread.is_alive() and "summary" in out

    rl = rl_records(c.run.dir)
    assert lost_in_sync == [6]
    assert [r["step"] for r in rl] == list(range(8))
    restarts = [r["rollout_restarts"] for r in rl]  # logged before each step's sync
    assert restarts[:3] == [0, 0, 0] and restarts[3] in (0, 1) and restarts[4:] == [1, 1, 2, 2]
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
    while True:
        try:
            ray.get(actor.stats.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
