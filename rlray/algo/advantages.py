"""Per-group advantages.

Contract: `group_advantages(rewards, std_normalize, eps)` returns one advantage per
rollout of a group: reward minus the group mean, optionally divided by
(group std + eps). A group whose rewards are all equal gets all-zero advantages.
"""

from __future__ import annotations

import numpy as np


def group_advantages(rewards: np.ndarray, std_normalize: bool = True, eps: float = 1e-4) -> np.ndarray:
    rewards = np.asarray(rewards, dtype=np.float32)
    adv = rewards - rewards.mean()
    if std_normalize:
        adv = adv / (rewards.std() + eps)
    return adv.astype(np.float32)
