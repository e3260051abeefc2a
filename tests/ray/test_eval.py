"""Evaluation as a stage: an evaluation-only run (composed by Hydra like `python -m rlray.launch
stages=[eval] ...`) writes per-example results, and its pass@k equals a hand count."""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from rlray.orchestration.controller import run


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rlray.config import register, to_config
    from rlray.launch import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return to_config(hydra_compose("config", overrides=overrides))


def hand_pass_at_k(passed: list[bool], k: int) -> float:
    """The share of k-subsets of the samples that hold at least one passing sample."""
    subsets = list(combinations(passed, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_eval_only_run_writes_results_and_pass_at_k(ray_cluster, tmp_path) -> None:
    run_dir = tmp_path / "eval-run"
    c = compose([f"run.dir={run_dir}", "logging.wandb=disabled", "stages=[eval]", "model.num_layers=2",
                 "eval.num_examples=12", "eval.num_samples=4", "eval.pass_k=[1,2,4]", "eval.temperature=1.0",
                 "eval.max_tokens=6", "eval.pass_threshold=0.2"])
    summary = run(c)

    lines = (Path(run_dir) / "eval_results.jsonl").read_text().splitlines()
    results = [json.loads(x) for x in lines]
    assert [r["example"] for r in results] == list(range(12))
    assert all(r["tag"] == "eval" and r["env"] == "reverse_text" and r["prompt"].startswith("rev:") for r in results)
    assert all(len(r["completions"]) == len(r["rewards"]) == 4 and r["errors"] == [None] * 4 for r in results)
    passed = [[x >= 0.2 for x in r["rewards"]] for r in results]
    assert any(any(p) for p in passed), "no sample passed: the check below would be vacuous"

    logged = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = [x for x in logged if x["stage"] == "eval"][-1]
    for k in (1, 2, 4):
        expected = float(np.mean([hand_pass_at_k(p, k) for p in passed]))
        assert summary["eval"][f"pass@{k}"] == pytest.approx(expected)
        assert logged[f"pass@{k}"] == pytest.approx(expected)
    rewards = [x for r in results for x in r["rewards"]]
    assert summary["eval_reward"] == pytest.approx(float(np.mean(rewards)))
    assert summary["eval"]["num_samples"] == 48
