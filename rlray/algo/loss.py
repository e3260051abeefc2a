"""Policy-gradient losses over packed token tensors: one registry (`LOSSES`), each loss a
decorated function with its paper's preset beside it, chosen by `algo.loss`.

Contract:
- `@loss(name, paper, **preset)` registers a function under `name` with the values of every
  `PRESET_KEYS` key its paper sets (the keys it leaves out take `PRESET_DEFAULTS`). One
  function may carry several names (DAPO and Dr.GRPO are GRPO's surrogate with other presets).
  Adding a loss is one decorated function: the config, the console, the README's table
  (`preset_table()`) and the end-to-end test of every loss read this registry.
- `resolve(algo)` applies the chosen loss's preset to every preset key left unset (None),
  records which came from it (`algo.from_preset`, for `preset_line`) and validates every
  `algo.*` key, raising ValueError naming the key. It runs once, where the config is resolved
  (rlray.launch.configure); `algo_config(**kw)` is `resolve(AlgoConfig(**kw))`. The trainer and
  the buffer take only resolved configs.
- A loss takes the trainer's logprobs of the sampled tokens, the inference engine's logprobs
  of the same tokens, per-token advantages and the loss mask (all [B, T] float tensors, one
  row per sequence) plus the algo config and, when `algo.kl_coef > 0`, a frozen reference
  model's logprobs (`logp_ref`). It returns `(loss_sum, stats)`: `loss_sum` is a *sum* that
  the caller divides by `loss_normalizer(cfg, micro_batch)` (the same global number on every
  rank), and `stats` holds sums over masked tokens (the caller divides them by the global
  number of loss tokens).

Each loss builds a per-token loss l[b, t] and shares the rest of the pipeline:
- ratio: r = pi_theta / mu, mu the inference engine's probability of the sampled
  token (the behaviour policy, also the old policy of every mini-batch's step).
  With an off-policy correction (`algo.correction` tis/mis, see `correction.py`)
  r = pi_theta / pi_prox instead, pi_prox the trainer's policy at the start of the
  batch (`logp_prox`; the trainer recomputes it when a batch takes several optimizer
  steps, `algo.mini_batches` x `algo.epochs`; else it is sg(pi_theta), value 1), and the
  correction weight carries pi_prox / mu (decoupled PPO, Hilton et al. 2021).
- extra terms: `kl_coef * k3(pi_theta || pi_ref)` (Schulman 2020's k3 estimator,
  GRPO's KL to a frozen reference) and `mismatch_kl_coef * (log pi_theta/mu)^2`
  (Kimi K2.5's penalty on the trainer/inference log ratio, used by dppo_tv).
- aggregation (`algo.aggregation`, set by the loss's paper preset unless given):
  token:    sum_{b,t} l / (global loss tokens)                      (DAPO)
  sequence: sum_b mean_t l / (global sequences)                     (GRPO, GSPO)
  constant: sum_{b,t} l / (global sequences * algo.max_tokens)      (Dr.GRPO)
Scale-dependent values stay out of the presets (DAPO's overlong buffer is 4096 of 20480 tokens:
set `algo.overlong_buffer` per recipe), and so does GRPO's KL to a reference model (the paper's
beta = 0.04: `algo.kl_coef=0.04`), which loads a second model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlray.algo.advantages import BASELINES, _max_tokens
from rlray.algo.correction import CORRECTIONS, LEVELS, correction_weights
from rlray.config import AlgoConfig
from rlray.types import MicroBatch

Tensor = torch.Tensor
LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
AGGREGATIONS = ("token", "sequence", "constant")
PRESET_KEYS = ("aggregation", "std_normalize", "eps_low", "eps_high", "filter_zero_advantage",
               "mismatch_kl_coef", "ratio_cap")
PRESET_DEFAULTS: dict[str, Any] = {"filter_zero_advantage": False, "mismatch_kl_coef": 0.0, "ratio_cap": 0.0}


@dataclass(frozen=True)
class Loss:
    name: str
    fn: LossFn
    paper: str  # the paper and its link (Markdown): the README's table
    objective: str  # what the paper's objective does, in a line
    preset: dict[str, Any] = field(default_factory=dict)  # every PRESET_KEYS value


LOSSES: dict[str, Loss] = {}


def loss(name: str, paper: str, objective: str, **preset: Any) -> Callable[[LossFn], LossFn]:
    """Register the decorated function as loss `name`: its paper, objective and preset."""
    missing = set(PRESET_KEYS) - set(PRESET_DEFAULTS) - set(preset)
    unknown = set(preset) - set(PRESET_KEYS)
    assert not missing and not unknown, f"loss {name!r}: preset lacks {missing}, has unknown {unknown}"

    def register(fn: LossFn) -> LossFn:
        assert name not in LOSSES, f"loss {name!r} is registered twice"
        LOSSES[name] = Loss(name, fn, paper, objective, {**PRESET_DEFAULTS, **preset})
        return fn

    return register


def mismatch_kl(logp_train: Tensor, logp_infer: Tensor, mask: Tensor) -> Tensor:
    """Sum over masked tokens of the k3 estimate of KL(infer || train): e^d - d - 1, d = train - infer.

    In float64: in fp32, e^d - d - 1 rounds to exactly 0 for |d| below ~3e-4.
    """
    d = (logp_train - logp_infer).detach().double()
    return ((torch.exp(d) - d - 1) * mask.double()).sum()


def k3_kl(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): e^u - u - 1 with u = logp_ref - logp (unbiased, >= 0)."""
    u = logp_ref - logp
    return torch.exp(u) - u - 1


def aggregation(cfg: AlgoConfig) -> str:
    assert cfg.aggregation is not None, "resolve(cfg) fills it from the loss's preset"
    return cfg.aggregation


def aggregate(per_token: Tensor, mask: Tensor, how: str) -> Tensor:
    """The loss sum: over tokens (token, constant) or of per-row token means (sequence)."""
    if how == "sequence":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    return (per_token * mask).sum()


def loss_normalizer(cfg: AlgoConfig, mb: MicroBatch) -> float:
    """The global divisor of the loss sums of one step, the same on every rank."""
    how = aggregation(cfg)
    if how == "token":
        return mb.num_loss_tokens_global
    if how == "sequence":
        return mb.num_sequences_global
    return mb.num_sequences_global * _max_tokens(cfg)


def _log_ratio(logp_train: Tensor, logp_infer: Tensor, mask: Tensor, cfg: AlgoConfig,
               logp_prox: Tensor | None) -> Tensor:
    """log r per token, zero off the mask: against mu, or against pi_prox under a correction."""
    if cfg.correction == "none":
        old = logp_infer
    else:
        old = logp_train.detach() if logp_prox is None else logp_prox
    return (logp_train - old) * mask


def _clipped(ratio: Tensor, adv: Tensor, cfg: AlgoConfig) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate (ratio_correction=clip) or its masked variant (mask); and the outside flags."""
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    outside = ((ratio < lo) | (ratio > hi)).float()
    if cfg.ratio_correction == "clip":
        return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv), outside
    return -ratio * adv * (1.0 - outside), outside


def _finish(per_token: Tensor, outside: Tensor, logp_train: Tensor, logp_infer: Tensor, mask: Tensor,
            cfg: AlgoConfig, logp_ref: Tensor | None, logp_prox: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """Correction weight, extra terms, aggregation and stats shared by every loss."""
    prox = logp_train if logp_prox is None else logp_prox
    weight, stats = correction_weights(prox, logp_infer, mask, cfg)
    per_token = per_token * weight
    if cfg.mismatch_kl_coef > 0:
        per_token = per_token + cfg.mismatch_kl_coef * ((logp_train - logp_infer) * mask) ** 2
    if cfg.kl_coef > 0:
        if logp_ref is None:
            raise ValueError("algo.kl_coef > 0 needs the reference model's logprobs (logp_ref)")
        kl = k3_kl(logp_train, logp_ref) * mask
        per_token = per_token + cfg.kl_coef * kl
        stats["kl_ref"] = kl.detach().sum()
    stats["ratio_outside"] = (outside * mask).sum().detach()
    stats["mismatch_kl"] = mismatch_kl(logp_train, logp_infer, mask)
    return aggregate(per_token, mask, aggregation(cfg)), stats


@loss("opd", "On-policy distillation — Agarwal et al. 2024, GKD ([2306.13649](https://arxiv.org/abs/2306.13649)); "
      "Lu & Thinking Machines 2025", "per-token advantage log π_teacher − log μ (reverse KL to a served teacher, "
      "`teacher.name`), + `algo.opd_reward_coef` × the group advantage; PPO clip, token-level mean",
      aggregation="token", std_normalize=True, eps_low=0.2, eps_high=0.2)
@loss("dr_grpo", "Dr.GRPO — Liu et al. 2025 ([2503.20783](https://arxiv.org/abs/2503.20783))",
      "token sum / (G · L_max), advantage r − mean without std (L_max = `algo.max_tokens`, default "
      "`rollout.max_tokens`)", aggregation="constant", std_normalize=False, eps_low=0.2, eps_high=0.2)
@loss("dapo", "DAPO — Yu et al. 2025 ([2503.14476](https://arxiv.org/abs/2503.14476))",
      "clip-higher, token-level mean, dynamic sampling, no KL; the paper's soft overlong punishment: "
      "`algo.overlong_buffer=4096` with `rollout.max_tokens=20480`", aggregation="token", std_normalize=True,
      eps_low=0.2, eps_high=0.28, filter_zero_advantage=True)
@loss("grpo", "GRPO — Shao et al. 2024, DeepSeekMath ([2402.03300](https://arxiv.org/abs/2402.03300))",
      "token ratio, PPO clip ±ε, mean of per-sequence token means, (r−mean)/std; the paper's KL to a "
      "reference (k3): `algo.kl_coef=0.04`", aggregation="sequence", std_normalize=True, eps_low=0.2, eps_high=0.2)
def clipped_surrogate(logp_train: Tensor, logp_infer: Tensor, advantages: Tensor, mask: Tensor, cfg: AlgoConfig,
                      logp_ref: Tensor | None = None, logp_prox: Tensor | None = None
                      ) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate per token: GRPO, and DAPO and Dr.GRPO by their presets.

    l_t = -min(r_t A, clip(r_t, 1-eps_low, 1+eps_high) A)  [+ beta k3(pi_theta || pi_ref)]
    GRPO: J = 1/G sum_i 1/|o_i| sum_t l_t (aggregation sequence).
    DAPO: eps_high > eps_low (0.2, 0.28), J = 1/sum_i |o_i| sum_i sum_t l_t (token); dynamic
    sampling (algo.filter_zero_advantage) and overlong shaping (algo.overlong_*) live in the buffer.
    Dr.GRPO: A = r - mean(r) (algo.std_normalize=false), J = 1/(G * L_max) sum_i sum_t l_t
    (constant, L_max = algo.max_tokens), so neither length nor group std biases the update.
    OPD: A_t = log pi_teacher(y_t) - log mu(y_t) (+ opd_reward_coef x the group advantage), per token
    (rlray.algo.advantages.opd_advantages), J = 1/sum_i |o_i| sum_i sum_t l_t (token): the surrogate's
    gradient is the reverse KL's to the teacher, with the ratio and clip of every other loss.
    ratio_correction=mask drops tokens outside the band instead: l_t = -r_t A 1[r_t in band].
    """
    ratio = torch.exp(_log_ratio(logp_train, logp_infer, mask, cfg, logp_prox))
    per_token, outside = _clipped(ratio, advantages, cfg)
    return _finish(per_token, outside, logp_train, logp_infer, mask, cfg, logp_ref, logp_prox)


@loss("gspo", "GSPO — Zheng et al. 2025, Qwen ([2507.18071](https://arxiv.org/abs/2507.18071))",
      "sequence ratio (geometric mean of token ratios), sequence clip, sequence mean",
      aggregation="sequence", std_normalize=True, eps_low=3e-4, eps_high=4e-4)
def gspo_loss(logp_train: Tensor, logp_infer: Tensor, advantages: Tensor, mask: Tensor, cfg: AlgoConfig,
              logp_ref: Tensor | None = None, logp_prox: Tensor | None = None
              ) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, Qwen, arXiv:2507.18071): a sequence-level ratio and clip.

    s_i = (pi_theta(y_i) / mu(y_i))^(1/|y_i|) = exp(1/|y_i| sum_t log r_t)
    l_i = -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i), eps (3e-4, 4e-4) in the paper
    J = 1/G sum_i l_i (preset aggregation: sequence; every token of sequence i carries l_i).
    """
    log_r = _log_ratio(logp_train, logp_infer, mask, cfg, logp_prox)
    n = mask.sum(-1, keepdim=True).clamp(min=1)
    seq_ratio = torch.exp(log_r.sum(-1, keepdim=True) / n)
    seq_adv = (advantages * mask).sum(-1, keepdim=True) / n
    per_seq, outside = _clipped(seq_ratio, seq_adv, cfg)
    return _finish(per_seq.expand_as(mask), outside.expand_as(mask), logp_train, logp_infer, mask, cfg,
                   logp_ref, logp_prox)


@loss("cispo", "CISPO — MiniMax-M1 ([2506.13585](https://arxiv.org/abs/2506.13585))",
      "sg(clip(r)) · A · log π, no lower bound, token-level mean (ε_high is the tuned knob)",
      aggregation="token", std_normalize=True, eps_low=1.0, eps_high=0.28)
def cispo_loss(logp_train: Tensor, logp_infer: Tensor, advantages: Tensor, mask: Tensor, cfg: AlgoConfig,
               logp_ref: Tensor | None = None, logp_prox: Tensor | None = None
               ) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): a clipped, stop-gradient importance weight.

    l_t = -sg(clip(r_t, 1-eps_low, 1+eps_high)) A log pi_theta(y_t); no token loses its
    gradient. The paper sets no lower bound (eps_low = 1) and tunes eps_high only.
    Computed as -sg(r^) A pi_theta/sg(pi_theta): the same gradient, value -r^ A.
    J = 1/sum_i |o_i| sum_i sum_t l_t (preset aggregation: token).
    """
    ratio = torch.exp(_log_ratio(logp_train, logp_infer, mask, cfg, logp_prox)).detach()
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    outside = ((ratio < lo) | (ratio > hi)).float()
    score = torch.exp(logp_train - logp_train.detach())
    per_token = -ratio.clamp(lo, hi) * advantages * score
    return _finish(per_token, outside, logp_train, logp_infer, mask, cfg, logp_ref, logp_prox)


@loss("dppo_tv", "DPPO-Binary-TV ([2602.04879](https://arxiv.org/abs/2602.04879)) + Kimi K2.5 KL, prime-rl's "
      "default", "drop a token when π − μ left ±ε in its advantage's direction, or its ratio passed "
      "`algo.ratio_cap`; + τ (log π/μ)²", aggregation="token", std_normalize=True, eps_low=0.2, eps_high=0.2,
      mismatch_kl_coef=1e-3, ratio_cap=10.0)
def dppo_tv_loss(logp_train: Tensor, logp_infer: Tensor, advantages: Tensor, mask: Tensor, cfg: AlgoConfig,
                 logp_ref: Tensor | None = None, logp_prox: Tensor | None = None
                 ) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (arXiv:2602.04879) as prime-rl's default loss: a probability-difference mask.

    d_t = pi_theta(y_t) - mu(y_t); a token is dropped when it left the trust region in
    the direction its advantage pushes: A > 0 and d_t > eps_high, or A < 0 and d_t < -eps_low.
    A token whose ratio exceeds `algo.ratio_cap` (preset 10; 0: off) is dropped as well.
    l_t = -1[kept] r_t A  [+ mismatch_kl_coef (log r_t)^2, Kimi K2.5's KL penalty]
    J = 1/sum_i |o_i| sum_i sum_t l_t (preset aggregation: token).
    """
    log_r = _log_ratio(logp_train, logp_infer, mask, cfg, logp_prox)
    ratio = torch.exp(log_r)
    diff = (torch.exp(logp_train) - torch.exp(logp_train - log_r)).detach()
    dropped = ((advantages > 0) & (diff > cfg.eps_high)) | ((advantages < 0) & (diff < -cfg.eps_low))
    if cfg.ratio_cap:  # a rare token (mu tiny) can pass the probability test with an unbounded ratio
        dropped = dropped | (ratio.detach() > cfg.ratio_cap)
    per_token = -ratio * advantages * (~dropped).float()
    return _finish(per_token, dropped.float(), logp_train, logp_infer, mask, cfg, logp_ref, logp_prox)


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"algo.loss='{name}' is unknown; choose one of {sorted(LOSSES)}")
    return LOSSES[name].fn


def _choose(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"algo.{key}='{value}' is unknown; choose one of {list(options)}")


def resolve(cfg: AlgoConfig) -> AlgoConfig:
    """`cfg` with the chosen loss's preset in every preset key left unset, validated (in place)."""
    get_loss(cfg.loss)  # an unknown name raises, naming algo.loss and the choices
    if getattr(cfg, "from_preset", None) is None:  # once: a second call finds every key set
        cfg.from_preset = [k for k in PRESET_KEYS if getattr(cfg, k) is None]
        for key in cfg.from_preset:
            setattr(cfg, key, LOSSES[cfg.loss].preset[key])
    _check(cfg)
    return cfg


def algo_config(**values: Any) -> AlgoConfig:
    """A resolved `AlgoConfig` (benchmarks and tests; a run's comes from rlray.launch.configure)."""
    return resolve(AlgoConfig(**values))


def require_resolved(cfg: AlgoConfig) -> None:
    if any(getattr(cfg, k) is None for k in PRESET_KEYS):
        raise ValueError("the algo section is not resolved: pass it through rlray.algo.loss.resolve first")


def preset_line(cfg: AlgoConfig) -> str:
    """One line: the loss, the values its preset set, and those set explicitly."""
    chosen = getattr(cfg, "from_preset", [])
    shown = ", ".join(f"{k}={getattr(cfg, k)}" for k in chosen)
    own = ", ".join(f"{k}={getattr(cfg, k)}" for k in PRESET_KEYS if k not in chosen)
    return (f"algo.loss={cfg.loss}: paper preset {shown or '(every key set explicitly)'}"
            + (f"; set explicitly: {own}" if own else ""))


def preset_table() -> str:
    """The registry as the README's Markdown table: paper, objective and what `algo.loss=NAME` sets."""
    rows = ["| Paper | Objective | Config |", "|---|---|---|"]
    for e in LOSSES.values():
        values = " ".join(f"algo.{k}={_yaml(e.preset[k])}" for k in PRESET_KEYS
                          if PRESET_DEFAULTS.get(k) != e.preset[k])
        rows.append(f"| {e.paper} | {e.objective} | `algo.loss={e.name}` sets `{values}` |")
    return "\n".join(rows)


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def _check(cfg: AlgoConfig) -> None:
    """Every `algo.*` value the losses and the buffer will read; raises ValueError naming the key."""
    _choose("aggregation", str(cfg.aggregation), AGGREGATIONS)
    _choose("baseline", cfg.baseline, BASELINES)
    _choose("correction", cfg.correction, CORRECTIONS)
    _choose("correction_level", cfg.correction_level, LEVELS)
    _choose("ratio_correction", cfg.ratio_correction, ("clip", "mask"))
    if not 0 <= cfg.eps_low <= 1 or cfg.eps_high < 0:
        raise ValueError(f"algo.eps_low={cfg.eps_low} must be in [0, 1] and algo.eps_high={cfg.eps_high} >= 0")
    if not 0 <= cfg.correction_low < 1 < cfg.correction_high:
        raise ValueError(f"algo.correction_low={cfg.correction_low} must be in [0, 1) and "
                         f"algo.correction_high={cfg.correction_high} > 1")
    if cfg.kl_coef < 0 or cfg.mismatch_kl_coef < 0 or cfg.ratio_cap < 0 or cfg.opd_reward_coef < 0:
        raise ValueError("algo.kl_coef, algo.mismatch_kl_coef, algo.ratio_cap and algo.opd_reward_coef must be >= 0")
    if cfg.mini_batches < 1 or cfg.epochs < 1:
        raise ValueError(f"algo.mini_batches={cfg.mini_batches} and algo.epochs={cfg.epochs} must be >= 1")
    if aggregation(cfg) == "constant" or cfg.overlong_buffer > 0:
        max_tokens = _max_tokens(cfg)
        if cfg.overlong_buffer >= max_tokens:
            raise ValueError(f"algo.overlong_buffer={cfg.overlong_buffer} must be smaller than "
                             f"algo.max_tokens={max_tokens} (rollout.max_tokens)")
