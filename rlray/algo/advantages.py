"""Rewards to per-rollout advantages, computed per group; DAPO's overlong handling.

Contract:
- `group_advantages(rewards, std_normalize, eps, baseline)` returns one advantage per
  rollout of a group: reward minus a baseline, optionally divided by (group std + eps), the
  population std (ddof 0, numpy's default; verl and TRL divide by the sample std, ddof 1, so
  rlray's advantages are sqrt(G/(G-1)) times theirs: 1.069x at G=8, 1.41x at G=2).
  baseline "mean": the group mean (GRPO, Shao et al. 2024).
  baseline "rloo": the mean of the *other* rollouts (REINFORCE leave-one-out,
  Ahmadian et al. 2024), r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean); a group of
  one gets 0. A group whose rewards are all equal gets all-zero advantages.
- `overlong_penalty(lengths, max_tokens, buffer, factor)`: DAPO's soft overlong
  punishment (Yu et al. 2025, eq. 13), added to the reward before advantages:
      0                                 if L <= L_max - L_cache
      factor * (L_max - L_cache - L) / L_cache   if L_max - L_cache < L <= L_max
      -factor                           if L > L_max
- `compute_advantages(group, cfg)`: the above, as configured by `AlgoConfig`, over the
  group's valid rollouts only (`valid`: no error); a failed rollout's reward 0 never
  enters the mean or std, and its advantage is 0.
- `opd_advantages(group, cfg)` (algo.loss=opd, on-policy distillation): one array per rollout, per
  completion token t: log pi_teacher(y_t) - log mu(y_t) on model tokens (the negative of the per-token
  reverse-KL estimate; teacher and behaviour logprobs both at temperature 1), plus
  `opd_reward_coef` x the rollout's group advantage above; 0 on environment tokens and for failed rollouts.
  `teacher_kl(rollouts)` is the mean over model tokens of log mu - log pi_teacher (reverse KL, k1).
- `trains_on(rollout, cfg)`: 0.0 for a truncated completion (finish_reason "length")
  when `overlong_filter` is on (DAPO's overlong filtering masks its loss), else 1.0.
A completion's length is its number of model tokens (loss-mask ones).
"""

from __future__ import annotations

import numpy as np

from rlray.config import AlgoConfig
from rlray.types import Group, Rollout

BASELINES = ("mean", "rloo")


def group_advantages(rewards: np.ndarray, std_normalize: bool = True, eps: float = 1e-4,
                     baseline: str = "mean") -> np.ndarray:
    rewards = np.asarray(rewards, dtype=np.float64)
    n = len(rewards)
    if baseline == "mean":
        adv = rewards - rewards.mean()
    elif baseline == "rloo":
        adv = (rewards - rewards.mean()) * (n / (n - 1)) if n > 1 else np.zeros_like(rewards)
    else:
        raise ValueError(f"algo.baseline='{baseline}' is unknown; choose one of {list(BASELINES)}")
    if std_normalize:
        adv = adv / (rewards.std() + eps)
    return adv.astype(np.float32)


def overlong_penalty(lengths: np.ndarray, max_tokens: int, buffer: int, factor: float = 1.0) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.float64)
    if buffer <= 0:
        return np.zeros(len(lengths), np.float32)
    start = max_tokens - buffer
    penalty = np.clip((start - lengths) / buffer, -1.0, 0.0)
    return (factor * penalty).astype(np.float32)


def completion_length(r: Rollout) -> int:
    return int(np.asarray(r.loss_mask).sum())


def shaped_rewards(group: Group, cfg: AlgoConfig) -> np.ndarray:
    """The group's rewards plus the soft overlong penalty when `overlong_buffer > 0`."""
    rewards = group.rewards
    if cfg.overlong_buffer > 0:
        lengths = np.array([completion_length(r) for r in group.rollouts])
        rewards = rewards + overlong_penalty(lengths, _max_tokens(cfg), cfg.overlong_buffer, cfg.overlong_penalty)
    return rewards


def valid(group: Group) -> np.ndarray:
    """Which rollouts completed (no env, reward or token error): only they enter the baseline."""
    return np.array([r.error is None for r in group.rollouts], dtype=bool)


def compute_advantages(group: Group, cfg: AlgoConfig) -> np.ndarray:
    """Advantages of the group's valid rollouts against their own baseline; failed rollouts get 0."""
    ok = valid(group)
    adv = np.zeros(len(ok), np.float32)
    if ok.any():
        adv[ok] = group_advantages(shaped_rewards(group, cfg)[ok], cfg.std_normalize, cfg.std_eps, cfg.baseline)
    return adv


def opd_advantages(group: Group, cfg: AlgoConfig) -> list[np.ndarray]:
    base = compute_advantages(group, cfg) if cfg.opd_reward_coef else np.zeros(len(group.rollouts), np.float32)
    out = []
    for r, a in zip(group.rollouts, base):
        if r.error is not None or r.teacher_logprobs is None:
            out.append(np.zeros(len(r.completion_ids), np.float32))
            continue
        model = np.asarray(r.loss_mask) > 0
        gap = np.where(model, np.asarray(r.teacher_logprobs, np.float64) - np.asarray(r.logprobs, np.float64), 0.0)
        out.append((gap + cfg.opd_reward_coef * float(a) * model).astype(np.float32))
    return out


def teacher_kl(rollouts: list[Rollout]) -> float | None:
    """Mean over the scored rollouts' model tokens of log mu - log pi_teacher; None when none was scored."""
    gaps = [(np.asarray(r.logprobs, np.float64) - r.teacher_logprobs)[np.asarray(r.loss_mask) > 0]
            for r in rollouts if r.teacher_logprobs is not None and r.error is None]
    gaps = [g for g in gaps if len(g)]
    return float(np.concatenate(gaps).mean()) if gaps else None


def trains_on(r: Rollout, cfg: AlgoConfig) -> float:
    return 0.0 if cfg.overlong_filter and r.finish_reason == "length" else 1.0


def _max_tokens(cfg: AlgoConfig) -> int:
    if not isinstance(cfg.max_tokens, int) or cfg.max_tokens <= 0:
        raise ValueError(f"algo.max_tokens={cfg.max_tokens!r} must be a positive int "
                         "(it defaults to rollout.max_tokens when composed by Hydra)")
    return cfg.max_tokens
