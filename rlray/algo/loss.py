"""Policy-gradient losses over packed token tensors, chosen by name.

Contract: a loss takes the trainer's logprobs of the sampled tokens, the inference
engine's logprobs of the same tokens, per-token advantages and the loss mask (all
[B, T] float tensors) plus the algo config, and returns `(loss_sum, stats)`:
`loss_sum` is the *sum* of per-token losses over masked tokens (the caller divides
by the global number of loss tokens, so every rank's loss is normalised alike) and
`stats` holds sums over masked tokens for logging.

Since one optimizer step is taken per batch, the behaviour policy is the inference
policy: the importance ratio is r = exp(logp_train - logp_infer), per token.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlray.config import AlgoConfig

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AlgoConfig],
                  tuple[torch.Tensor, dict[str, torch.Tensor]]]


def mismatch_kl(logp_train: torch.Tensor, logp_infer: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over masked tokens of the k3 estimate of KL(infer || train): e^d - d - 1, d = train - infer."""
    d = (logp_train - logp_infer).detach()
    return ((torch.exp(d) - d - 1) * mask).sum()


def grpo_loss(
    logp_train: torch.Tensor,
    logp_infer: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgoConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO (Shao et al. 2024, DeepSeekMath), token-level, token-sum aggregation.

    clip: l_t = -min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t)      (PPO's clipped surrogate)
    mask: l_t = -r_t A_t if 1-eps_low <= r_t <= 1+eps_high else 0        (extreme ratios dropped)
    """
    ratio = torch.exp(logp_train - logp_infer)
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    outside = ((ratio < lo) | (ratio > hi)).float()
    if cfg.ratio_correction == "clip":
        per_token = -torch.minimum(ratio * advantages, ratio.clamp(lo, hi) * advantages)
    else:
        per_token = -ratio * advantages * (1.0 - outside)
    stats = {
        "ratio_outside": (outside * mask).sum().detach(),
        "mismatch_kl": mismatch_kl(logp_train, logp_infer, mask),
    }
    return (per_token * mask).sum(), stats


LOSSES: dict[str, LossFn] = {"grpo": grpo_loss}


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"algo.loss='{name}' is unknown; choose one of {sorted(LOSSES)}")
    return LOSSES[name]
