"""An elastic rollout pool (rollout.num_actors=1, rollout.max_actors=2) on the session's Ray cluster: a
second node joins by `ray start --address` (its own CPUs), the pool grows to 2 engines (the new one
generates on the trainer's policy: mismatch_kl as with one engine), the node's raylet is SIGKILLed by
its process id (not `ray stop`, which would stop the head too), the pool shrinks to 1 without using a
restart, and the run completes every step once.

Each engine bundle takes just over half of the CPUs the head has left beside the trainer, so the head
holds one engine and only the new node can hold the second. The metrics hook runs on the driver's thread,
between steps: it waits there, each with a deadline and a message, only for what Ray does without the
driver (the node registered, the engine's placement group placed, the engine up, the node declared dead),
and lets steps pass while the driver acts (asking for the group, spawning the actor, admitting it at a sync,
handing it the tickets of its first group, dropping it). The run's length follows the events: rl.steps is
a cap, lowered to a few steps past the shrink once it happened, so no count of steps is assumed.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray

from rlray.orchestration import cluster
from rlray.orchestration.controller import run
from rlray.orchestration.metrics import Metrics
from tests.ray.conftest import named_actor_exists, tiny_config

CAP = 80  # RL steps at most; the run ends END_AFTER steps after the pool shrank
END_AFTER = 3


def wait_for(what: str, ok, timeout: float = 180, context=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"waited {timeout:g}s for {what}; {context()}"
        time.sleep(0.5)


def cluster_state() -> str:
    """The placement groups (a pending one left by an earlier test would take a new node first) and each node's
    free resources."""
    from ray._private import state

    groups = {g["name"] or pid[:8]: (g["state"], g["bundles"]) for pid, g in ray.util.placement_group_table().items()
              if g["state"] != "REMOVED"}
    free = {nid[:8]: {k: v for k, v in r.items() if k in ("CPU", "GPU")}
            for nid, r in state.state.available_resources_per_node().items()}
    return f"placement groups {groups}; free per node {free}"


def group_state(name: str) -> str | None:
    return next((g["state"] for g in ray.util.placement_group_table().values() if g["name"] == name
                 and g["state"] != "REMOVED"), None)


def alive_nodes() -> int:
    return sum(n["Alive"] for n in ray.nodes())


def engine_up(name: str) -> bool:
    try:
        return ray.get(ray.get_actor(name).stats.remote(), timeout=30)["started"]
    except (ValueError, ray.exceptions.GetTimeoutError):  # not spawned yet, or its worker still starting
        return False


def groups_of(name: str) -> int:
    return ray.get(ray.get_actor(name).stats.remote(), timeout=30)["groups"]


# The joining node's Ray processes (its raylet, its agents, the engine's worker) get the CPU ahead of this machine's
# other processes, as a node of its own CPUs would. Otherwise, on a loaded machine, Ray 2.60's raylet aborts: it
# waits a fixed 15 s for its dashboard agent's listen port (`NodeManager::WaitForDashboardAgentPorts`; the
# raylet is not given that port, so it always waits), and the agent, which imports every dashboard module
# first, took 31-66 s beside two busy processes. Not root: `nice` says so and starts the node unchanged.
OWN_MACHINE = ["nice", "-n", "-10"]


class SecondNode:
    """`ray start --address` of a node with `cpus` CPUs; `kill_raylet()` SIGKILLs its raylet by pid.

    It starts at `OWN_MACHINE`'s priority. `registered(before)` says whether it joined the `before` nodes, starting it
    again (at most `STARTS` times) when `ray start` exited first: a failed node start, not a pool that failed
    to grow."""

    STARTS = 3

    def __init__(self, cpus: float) -> None:
        self.cpus, self.starts = cpus, 0
        self._start()

    def _start(self) -> None:
        ray_cli = str(Path(sys.executable).parent / "ray")
        gcs = ray.get_runtime_context().gcs_address
        self.proc = subprocess.Popen([*OWN_MACHINE, ray_cli, "start", "--address", gcs, "--num-cpus", f"{self.cpus:g}",
                                      "--num-gpus", "0", "--node-ip-address", "127.0.0.1", "--block"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,  # its logs: Ray's session folder
                                     start_new_session=True)
        self.starts += 1

    def registered(self, before: int) -> bool:
        if self.proc.poll() is None:
            return alive_nodes() == before + 1
        assert self.starts < self.STARTS, f"`ray start` of the second node exited {self.starts} times ({self.proc.returncode})"
        print(f"`ray start` of the second node exited ({self.proc.returncode}) before it joined; starting it again")
        self._start()
        return False

    def kill_raylet(self) -> None:
        raylets = [p for p in psutil.Process(self.proc.pid).children(recursive=True) if p.name() == "raylet"]
        assert len(raylets) == 1, raylets
        raylets[0].kill()

    def close(self) -> None:
        for p in psutil.Process(self.proc.pid).children(recursive=True) + [psutil.Process(self.proc.pid)]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=30)


def test_the_pool_grows_with_a_joining_node_and_shrinks_when_its_raylet_dies(ray_cluster, tmp_path, monkeypatch,
                                                                               capsys) -> None:
    trainer_cpus = 2.0  # the tiny config's 2 ranks x 1 CPU
    print(f"at the start: {cluster_state()}")
    room = ray.available_resources()["CPU"] - trainer_cpus
    per_engine = room // 2 + 1
    assert per_engine <= room < 2 * per_engine, ray.available_resources()
    c = tiny_config(tmp_path, "stages=[rl]", f"rl.steps={CAP}", "rollout.num_actors=1", "rollout.max_actors=2",
                    "rollout.scale_every_s=0.1", f"rollout.cpus_per_actor={per_engine:g}", "eval.num_examples=8")
    nodes_before = alive_nodes()
    events: dict[str, int] = {}
    node: list[SecondNode] = []
    real_log = Metrics.log

    def log(self: Metrics, stage: str, at: int, values: dict, total: int | None = None) -> None:
        real_log(self, stage, at, values, total)
        if stage != "rl":
            return
        engines = values["rollout_actors"]
        if not node:
            node.append(SecondNode(per_engine))
            wait_for("the second node to register", lambda: node[0].registered(nodes_before), context=cluster_state)
        elif "placed" not in events and group_state("rlray-rollout-1") is not None:  # the driver asked for it
            wait_for("rlray-rollout-1 to be placed on the new node", lambda: group_state("rlray-rollout-1") == "CREATED",
                     120, cluster_state)
            events["placed"] = at
        elif "placed" in events and "up" not in events and named_actor_exists("rollout-1"):  # it starts without the driver
            wait_for("rollout-1's engine to start", lambda: engine_up("rollout-1"), 300, cluster_state)
            events["up"] = at
        elif "up" in events and "killed" not in events and engines == 2 and groups_of("rollout-1") > 0:
            # admitted at a sync and generating: its groups need tickets, which only the driver's next steps
            # hand out (rollout-0 may hold every ticket of this step), so steps pass until it has one
            node[0].kill_raylet()
            events["killed"] = at
            wait_for("Ray to declare the node dead", lambda: alive_nodes() == nodes_before, 120, cluster_state)
        elif "killed" in events and "left" not in events and engines == 1:  # dropped by the driver
            events["left"] = at
            c.rl.steps = at + 1 + END_AFTER  # the controller's loop reads it at every step

    monkeypatch.setattr(Metrics, "log", log)
    try:
        summary = run(c)
    finally:
        if node:
            node[0].close()
    out = capsys.readouterr().out
    records = [r for r in map(json.loads, (Path(c.run.dir) / "metrics.jsonl").read_text().splitlines())
               if r["stage"] == "rl"]
    assert "left" in events, f"the run ended before the pool grew and shrank: {events}; {cluster_state()}\n{out}"
    assert [r["step"] for r in records] == list(range(events["left"] + 1 + END_AFTER)) and "rl_end_reward" in summary
    engines = [r["rollout_actors"] for r in records]
    assert [k for k, _ in itertools.groupby(engines)] == [1, 2, 1], engines
    last = records[-1]
    assert (last["rollout_joins"], last["rollout_leaves"], last["rollout_restarts"]) == (1, 1, 0)
    # every batch, those holding rollout-1's groups included: its engine generated on the trainer's weights
    assert all(r["mismatch_kl"] < 1e-6 for r in records), [r["mismatch_kl"] for r in records]
    joined = [x for x in out.splitlines() if x.startswith("rollout-1 joined the rollout pool on node ")]
    left = [x for x in out.splitlines() if x.startswith("rollout-1 left the rollout pool: its node ")]
    assert len(joined) == 1 and len(left) == 1 and "rollout pool of 1 (" in left[0], out
    assert "Traceback" not in out


def test_a_placed_group_is_seen_placed_every_time(ray_cluster) -> None:
    """The pool's growth asks whether its engine's bundle is placed once per look; `pg.wait(0)` raced its own RPC
    and said no for a placed group in about 1 call of 5 under load, so the pool could look for ever."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 0.01}], name="rlray-test-placed")
    try:
        assert pg.wait(timeout_seconds=60)
        assert all(cluster.placed(pg) for _ in range(300))
        pending = placement_group([{"CPU": 10_000}], name="rlray-test-pending")
        assert not cluster.placed(pending)
        remove_placement_group(pending)
    finally:
        remove_placement_group(pg)


def test_elastic_keys_are_checked(tmp_path) -> None:
    from rlray.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.max_actors=1 is below rollout.num_actors=2"):
        tiny_config(tmp_path, "rollout.num_actors=2", "rollout.max_actors=1")
    with pytest.raises(ConfigError, match=r"rollout.max_actors with cluster.colocate=true"):
        tiny_config(tmp_path, "rollout.max_actors=2", "cluster.colocate=true", "async.max_off_policy_steps=0",
                    "weights.delta=false")
    c = tiny_config(tmp_path, "rollout.max_actors=3")
    assert cluster.elastic(c) and c.rollout.num_actors == 1
