"""A rollout actor killed mid-RL is replaced: the run loses no step and the new engine has the policy.

The default tiny config has one rollout actor, so after the kill nothing produces groups
until the replacement is up; the trainer waits, then every step runs once, in order.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import ray

from rlray.controller import run
from tests.ray.conftest import tiny_config


def rl_records(run_dir: str) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["stage"] == "rl"]


def test_killed_rollout_actor_is_replaced(ray_cluster, tmp_path) -> None:
    c = tiny_config(tmp_path, rl={"steps": 8}, async_={"max_off_policy_steps": 0})  # every batch on-policy
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(summary=run(c)), daemon=True)
    thread.start()
    deadline = time.time() + 900
    while len(rl_records(c.run.dir)) < 3 and thread.is_alive() and time.time() < deadline:
        time.sleep(0.2)
    assert len(rl_records(c.run.dir)) >= 3, "RL never reached step 3"
    ray.kill(ray.get_actor("rollout-0"), no_restart=True)
    killed_after = len(rl_records(c.run.dir))
    thread.join(timeout=900)
    assert not thread.is_alive() and "summary" in out

    rl = rl_records(c.run.dir)
    assert [r["step"] for r in rl] == list(range(8))
    assert rl[-1]["rollout_restarts"] == 1 and rl[killed_after - 1]["rollout_restarts"] == 0
    # On-policy, inference and trainer logprobs agree to float error only when the engine has
    # exactly the trainer's weights: so does the replacement's, from its first batch on.
    after = [r["mismatch_kl"] for r in rl[killed_after:]]
    print(f"mismatch KL before the kill {[r['mismatch_kl'] for r in rl[:killed_after]]}, after {after}")
    assert all(r["lag_max"] == 0 for r in rl)
    assert max(after) < 1e-5
    assert out["summary"]["rl_end_reward"] > 0.0


def test_rollout_actor_lost_in_a_weight_sync_is_replaced(ray_cluster, tmp_path, monkeypatch) -> None:
    """The actor dies after the health check that precedes a sync: the broadcast itself fails."""
    from rlray.controller import Controller

    c = tiny_config(tmp_path, rl={"steps": 5}, async_={"max_off_policy_steps": 0})
    c.stages = ["rl"]
    real_sync = Controller.sync
    killed: list[int] = []

    def sync_losing_an_actor(self, version: int) -> dict:
        if not (self.rl_running and version == 2 and not killed):
            return real_sync(self, version)
        killed.append(version)
        victim = self.h.rollouts[0]
        ray.kill(victim, no_restart=True)
        while True:  # dead before the broadcast starts
            try:
                ray.get(victim.stats.remote(), timeout=10)
            except ray.exceptions.RayActorError:
                break
        self._heal = lambda: None  # the health check already passed
        try:
            return real_sync(self, version)
        finally:
            del self._heal

    monkeypatch.setattr(Controller, "sync", sync_losing_an_actor)
    summary = run(c)
    rl = rl_records(c.run.dir)
    assert killed == [2]
    assert [r["step"] for r in rl] == list(range(5)) and rl[-1]["rollout_restarts"] == 1
    assert max(r["mismatch_kl"] for r in rl[2:]) < 1e-5
    assert summary["rl_end_reward"] > 0.0
