"""The CPU twins of the MoE recipes on a local Ray cluster, in bf16 as the recipes run (engine and
trainer compute; the twin's fp32 overridden), synchronous (max_off_policy_steps=0) so every step's
rollouts come from the weights just synced: the mismatch gate. Each step's `mismatch_kl` must stay
under the recipe's own `rl.mismatch_kl_budget` with router replay on (the recipe's setting).
glm_moe: a tiny GLM-4.5-architecture MoE trained with expert parallelism over 2 trainer ranks (and
activation checkpointing) crashes, resumes from its EP-sharded checkpoint and finishes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlray.orchestration.controller import run
from tests.ray.conftest import Crash, crash_at_rl_step, tiny_config


def rl_records(run_dir: str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["stage"] == "rl"]


BF16 = ("trainer.param_dtype=bfloat16", "rollout.dtype=bfloat16", "async.max_off_policy_steps=0")


def assert_within_budget(c, rl: list[dict]) -> None:
    budget = c.rl.mismatch_kl_budget
    assert c.trainer.router_replay and budget is not None  # the recipe's own setting and budget
    for r in rl:
        assert r["mismatch_kl"] < budget, r  # the gate: fails when replay is off (see the README)
        assert r["mismatch_over_budget"] == 0 and 0.5 < r["router_agreement"] <= 1.0, r


def test_glm_moe_twin_trains_with_ep_checkpoints_and_resumes(ray_cluster, tmp_path, monkeypatch) -> None:
    c = tiny_config(tmp_path, "+recipe=glm_moe", "+twin=cpu", "rl.steps=6", "checkpoint.every=3",
                    "eval.num_examples=8", *BF16)
    assert (c.model.name, c.model.arch, c.trainer.ep, c.trainer.num_ranks) == ("tiny", "glm4_moe", 2, 2)
    assert c.trainer.activation_checkpointing and c.stages == ["rl"] and c.env.mix[0].id == "reverse_text"
    undo = crash_at_rl_step(monkeypatch, 4)
    with pytest.raises(Crash):
        run(c)
    undo()
    summary = run(c)

    rl = rl_records(c.run.dir)
    assert [r["step"] for r in rl] == [0, 1, 2, 3, 3, 4, 5]  # resumed from the step-3 checkpoint
    assert_within_budget(c, rl)
    for r in rl:
        assert r["lag_max"] == 0 and r["completion_tokens"] > 0
        assert r["moe_load_max_mean"] >= 1.0 and r["moe_load_max_mean_worst"] >= r["moe_load_max_mean"]
    assert any(r["grad_norm"] > 0 for r in rl) and any(r["reward_std"] > 0 for r in rl)  # it learns
    assert 0.0 <= summary["rl_end_reward"] <= 1.0


def test_qwen3_moe_twin_stays_within_its_mismatch_budget(ray_cluster, tmp_path) -> None:
    """Synced many-to-many (weights.transport=m2n): both trainer ranks send their own experts and shards."""
    c = tiny_config(tmp_path, "+recipe=qwen3_moe", "+twin=cpu", "rl.steps=3", "checkpoint.every=0",
                    "eval.num_examples=4", "weights.transport=m2n", *BF16)
    assert (c.model.arch, c.trainer.ep, c.trainer.num_ranks) == ("qwen3_moe", 2, 2)
    run(c)
    rl = rl_records(c.run.dir)
    assert_within_budget(c, rl)
    synced = [r for r in rl if "sync_mb" in r]
    assert synced and all(0 < r["sync_mb_busiest"] < 0.6 * r["sync_mb"] for r in synced), synced  # both ranks send


def test_a_connected_cluster_is_checked_against_the_plan(ray_cluster) -> None:
    from rlray.orchestration import cluster

    assert cluster.check_resources(0, 2).endswith("enough")
    with pytest.raises(ValueError, match="the Ray cluster has 0 GPUs and 8 CPUs but the run needs 40 GPUs"):
        cluster.check_resources(40, 256)
