"""Off-policy correction of the inference/trainer mismatch: TIS and MIS.

Contract: `correction_weights(logp_train, logp_infer, mask, cfg)` returns a detached
[B, T] weight per token and stats (sums over masked tokens). With w = pi_train / mu
(mu: the inference engine's probability of the sampled token, which also covers the
staleness of asynchronous rollouts):

- none: weight 1 (the loss's own ratio is taken against mu; nothing else to correct).
- tis, truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training"): weight min(w, C_high).
- mis, masked importance sampling (Liu et al. 2025, "When Speed Kills Stability";
  IcePop, Ling team 2025): weight w * 1[C_low <= w <= C_high]; the rest is masked.

Level: "token" uses w_t; "sequence" uses the product over the sequence's loss tokens,
prod_t w_t (the sequence-level estimator of Liu et al.); "geometric" uses its geometric
mean exp(mean_t log w_t). Sequence and geometric weights are shared by a row's tokens
(one row of a micro-batch is one sequence).

When a correction is on, the losses take their trust-region ratio against the
trainer's own policy at the start of the step, sg(pi_train) (decoupled PPO, Hilton et
al. 2021), and this weight carries the gap to the behaviour policy mu.
Stats: `correction_clipped` (tis) or `correction_masked` (mis): loss tokens whose
weight was truncated or masked.
"""

from __future__ import annotations

import math

import torch

from rlray.config import AlgoConfig

CORRECTIONS = ("none", "tis", "mis")
LEVELS = ("token", "sequence", "geometric")
PRESETS: dict[str, dict[str, object]] = {  # each correction's `algo.*` values (README "RL objectives")
    "none": {"correction": "none"},
    "tis": {"correction": "tis", "correction_level": "token", "correction_high": 2.0},
    "mis": {"correction": "mis", "correction_level": "token", "correction_low": 0.5, "correction_high": 2.0},
}
_MAX_LOG_W = 30.0  # exp(30) ~ 1e13: keeps products of long sequences finite


def log_weights(logp_train: torch.Tensor, logp_infer: torch.Tensor, mask: torch.Tensor,
                level: str) -> torch.Tensor:
    """log w per token at the chosen level, detached, [B, T]."""
    d = (logp_train - logp_infer).detach() * mask
    if level == "token":
        lw = d
    elif level == "sequence":
        lw = d.sum(-1, keepdim=True).expand_as(d)
    elif level == "geometric":
        lw = (d.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(d)
    else:
        raise ValueError(f"algo.correction_level='{level}' is unknown; choose one of {list(LEVELS)}")
    return lw.clamp(-_MAX_LOG_W, _MAX_LOG_W)


def correction_weights(logp_train: torch.Tensor, logp_infer: torch.Tensor, mask: torch.Tensor,
                       cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if cfg.correction == "none":
        return torch.ones_like(mask), {}
    lw = log_weights(logp_train, logp_infer, mask, cfg.correction_level)
    high = math.log(cfg.correction_high)
    if cfg.correction == "tis":
        clipped = (lw > high).float()
        return torch.exp(lw.clamp(max=high)), {"correction_clipped": (clipped * mask).sum()}
    if cfg.correction == "mis":
        low = math.log(cfg.correction_low) if cfg.correction_low > 0 else -math.inf
        keep = ((lw >= low) & (lw <= high)).float()
        return torch.exp(lw) * keep, {"correction_masked": ((1 - keep) * mask).sum()}
    raise ValueError(f"algo.correction='{cfg.correction}' is unknown; choose one of {list(CORRECTIONS)}")
