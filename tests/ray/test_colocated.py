"""A colocated run (`cluster.colocate=true`, taking turns: async.max_off_policy_steps=0) on the session's
Ray cluster: one placement group whose bundle 0 holds trainer-0 and rollout-0 and bundle 1 trainer-1
(Ray's placement-group table and each actor's own group; the dashboard in Chromium shows that group); every step's tokens
were sampled by the weights the trainer holds (mismatch KL ~0 in fp32: the handover through shared
memory loaded them exactly); and the engine, killed after step 1, is replaced in its bundle and the
run goes on with no step lost or repeated.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray

from rlray.orchestration.controller import run
from rlray.orchestration.metrics import Metrics
from tests.deploy import dashboard
from tests.ray.conftest import kill_engine, tiny_config
from tests.ray.test_replace import rl_records


def placement_group_of(name: str) -> str:
    def pg(_: Any) -> str:
        return ray.get_runtime_context().get_placement_group_id()

    return ray.get(ray.get_actor(name).__ray_call__.remote(pg), timeout=60)


def dashboard_token() -> str | None:
    """The token a local Ray cluster made for its dashboard (Ray 2.60 turns token auth on by default)."""
    path = Path.home() / ".ray" / "auth_token"
    return os.environ.get("RAY_AUTH_TOKEN") or (path.read_text().strip() if path.is_file() else None)


def test_a_colocated_run_takes_turns_hands_weights_over_and_replaces_a_dead_engine(ray_cluster, tmp_path,
                                                                                   monkeypatch) -> None:
    c = tiny_config(tmp_path, "cluster.colocate=true", rl={"steps": 6}, async_={"max_off_policy_steps": 0})
    c.stages = ["rl"]
    seen: dict[str, Any] = {}
    real_log = Metrics.log

    def log(self: Metrics, stage: str, at: int, values: dict, total: int | None = None) -> None:
        real_log(self, stage, at, values, total)
        if stage == "rl" and at == 0:
            seen["groups"] = {g["name"]: (pid, g["bundles"]) for pid, g in ray.util.placement_group_table().items()
                              if g["state"] == "CREATED" and g["name"].startswith("rlray-")}
            seen["actors"] = {placement_group_of(name) for name in ("trainer-0", "trainer-1", "rollout-0")}
            if not dashboard.chromium_available():
                seen["view"] = dashboard.look(f"http://{ray._private.worker.get_dashboard_url()}", dashboard_token(),
                                              tmp_path / "dashboard",
                                              timeout_s=120, expect_actors=("trainer-0", "rollout-0"),
                                              expect_placement_groups=("rlray-colocated",))
        if stage == "rl" and at == 1:
            kill_engine(ray.get_actor("rollout-0"))

    monkeypatch.setattr(Metrics, "log", log)
    summary = run(c)

    # one group; bundle 0 has room for trainer-0 and rollout-0 (1 CPU each), bundle 1 for trainer-1
    assert list(seen["groups"]) == ["rlray-colocated"], seen["groups"]
    group, bundles = seen["groups"]["rlray-colocated"]
    assert bundles == {0: {"CPU": 2.0}, 1: {"CPU": 1.0}} and seen["actors"] == {group}
    view = seen.get("view")
    if dashboard.chromium_available() is None:  # Debian's chromium: the CI image and this machine
        assert view is not None and view.placement_groups.get("rlray-colocated") == "CREATED", view
        live = {name for name, state in view.placement_groups.items() if state != "REMOVED"}  # earlier runs' stay listed
        assert not {"rlray-trainer", "rlray-rollout"} & live, view

    rl = rl_records(c.run.dir)
    assert [r["step"] for r in rl] == list(range(6))  # none lost or repeated
    assert rl[-1]["rollout_restarts"] == 1 and rl[0]["rollout_restarts"] == 0
    assert all(r["lag_max"] == 0 for r in rl)  # taking turns: every token from the trainer's current weights
    assert max(r["mismatch_kl"] for r in rl) < 1e-6  # ... which the engine held exactly, replacement included
    assert all(r["handover_seconds"] > 0 and r["sync_mb"] > 0 for r in rl)
    assert 0 <= summary["rl_end_reward"] <= 1

