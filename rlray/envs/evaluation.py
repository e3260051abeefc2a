"""Evaluation metrics: the unbiased pass@k estimator and the summary of evaluation records.

Contract: `pass_at_k(n, c, k)` is Chen et al. (2021)'s estimator for n samples of which c are
correct; `summarize(records, pass_k, threshold)` gives mean reward over every sample, the
number of examples, samples and errors, and pass@k averaged over examples (a sample counts
as correct when its reward is at least `threshold`).
"""

from __future__ import annotations

from math import comb
from typing import Any

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c of them correct) is correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per example, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize(records: list[dict[str, Any]], pass_k: list[int], threshold: float) -> dict[str, float]:
    """Mean reward (over every sample) and pass@k (mean over examples) of evaluation records."""
    if not records:
        return {}
    rewards = [r for rec in records for r in rec["rewards"]]
    out = {"reward_mean": float(np.mean(rewards)), "num_examples": len(records), "num_samples": len(rewards),
           "errors": sum(e is not None for rec in records for e in rec["errors"])}
    for k in pass_k:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(len(rec["rewards"]), sum(x >= threshold for x in rec["rewards"]), k)
                                          for rec in records]))
    return out
