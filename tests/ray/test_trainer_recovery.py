"""A trainer rank SIGKILLed mid-RL: the controller re-creates the trainer group from the newest checkpoint
and the run completes every step (rlray.orchestration.recovery); past `trainer.max_restarts` the run stops
within a minute with one line.

The kill lands from the controller's own thread as it logs RL step 3 (the console's "step 4/6"), before the
checkpoint of step 4 is written: the save finds the rank gone, so the run goes back to the checkpoint of
step 2 and trains steps 2 and 3 again.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import ray

from rlray.orchestration import checkpoint
from rlray.orchestration.controller import run
from rlray.orchestration.metrics import Metrics
from tests.ray.conftest import named_actor_exists, tiny_config

STEPS = 6
LOSSES = ("dppo_tv",)  # the recovered run trains with it, as tests/ray/test_losses_e2e would in a run of its own


def kill_trainer_at(monkeypatch: pytest.MonkeyPatch, step: int, name: str = "trainer-1") -> list[float]:
    """SIGKILL trainer `name`'s process once RL step `step` is logged (the first time); returns the kill time."""
    real_log, killed = Metrics.log, []

    def log(self: Metrics, stage: str, at: int, values: dict, total: int | None = None) -> None:
        real_log(self, stage, at, values, total)
        if stage == "rl" and at == step and not killed:
            os.kill(ray.get(ray.get_actor(name).pid.remote()), signal.SIGKILL)
            killed.append(time.monotonic())

    monkeypatch.setattr(Metrics, "log", log)
    return killed


def test_a_killed_trainer_rank_is_recovered_from_the_checkpoint(ray_cluster, tmp_path, monkeypatch, capsys) -> None:
    c = tiny_config(tmp_path, "stages=[rl]", f"rl.steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=5",
                    f"algo.loss={LOSSES[0]}")
    assert c.algo.loss == LOSSES[0]
    kill_trainer_at(monkeypatch, 3)
    summary = run(c)
    out = capsys.readouterr().out
    assert "ckpt_rl_00000002 (" in out and "; committed when written)" in out, out  # checkpoint.async_save's default
    lines = [x for x in out.splitlines() if x.startswith("trainer-1 was lost during RL step 4 (its process died)")]
    assert len(lines) == 1 and "from checkpoint step 2: 2 trained steps lost (1 of trainer.max_restarts=2 used)" \
        in lines[0], out
    records = [json.loads(x) for x in (Path(c.run.dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["stage"] == "rl"]
    assert steps == [0, 1, 2, 3, 2, 3, 4, 5]  # after the recovery, each step once, in order
    after = [r for r in records if r["stage"] == "rl"][4:]
    assert [r["trainer_restarts"] for r in after] == [1, 1, 1, 1] and all(r["mismatch_kl"] < 1e-6 for r in after)
    rl = [r for r in records if r["stage"] == "rl"]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rl)
    meta = json.loads((Path(c.run.dir) / "checkpoints" / "ckpt_rl_00000002" / "meta.json").read_text())
    assert summary["recovered_weights"] == [meta["weights"]] and summary["trainer_restarts"] == 1
    assert "rl_end_reward" in summary


def test_past_max_restarts_a_lost_rank_stops_the_run_in_one_line(ray_cluster, tmp_path, monkeypatch) -> None:
    """Checkpoints by time only here (checkpoint.every_s: one after every step)."""
    c = tiny_config(tmp_path, "stages=[rl]", f"rl.steps={STEPS}", "checkpoint.every=0", "checkpoint.every_s=0.001",
                    "trainer.max_restarts=0")
    killed = kill_trainer_at(monkeypatch, 1, "trainer-0")
    with pytest.raises(RuntimeError) as info:
        run(c)
    stopped_after = time.monotonic() - killed[0]  # the rank's death seen by the next call to it, not a hang
    assert stopped_after < 60, f"the run stopped {stopped_after:.1f} s after trainer-0 was killed"
    message = str(info.value)
    assert "\n" not in message and message.startswith("trainer-0 was lost during RL step 2 (its process died)")
    assert "trainer.max_restarts=0 allows no more recoveries (0 used)" in message
    saved = [p.name for p in checkpoint.complete(Path(c.run.dir) / "checkpoints")]
    assert saved == ["ckpt_rl_00000000", "ckpt_rl_00000001"]  # RL start, then step 1 by checkpoint.every_s
    # (the save of step 2 found the rank gone: its staging folder stays until the next commit prunes it)


def test_a_rank_that_cannot_start_leaves_nothing_spawned_behind(ray_cluster, tmp_path) -> None:
    """cluster.spawn creates the engines' actors before it waits for rank 0 (their start is the longer one), so
    a trainer rank whose constructor fails must take them, and the placement groups, down with it."""
    from rlray.orchestration import cluster

    c = tiny_config(tmp_path)
    c.rollout.dtype = "no_such_dtype"  # the ranks' wire dtype: TrainerActor.__init__ raises on it
    with pytest.raises(ray.exceptions.ActorDiedError, match="TrainerActor.__init__"):
        cluster.spawn(c, pad_id=0)

    assert [n for n in ("trainer-0", "trainer-1", "rollout-0", "buffer") if named_actor_exists(n)] == []
    groups = {g["name"]: g["state"] for g in ray.util.placement_group_table().values() if g["name"].startswith("rlray-")}
    assert set(groups.values()) <= {"REMOVED"}, groups
