"""The `algo.*` overrides that reproduce each paper's objective, keyed by `algo.loss`.

Contract: `PRESETS[name]` is a dict of `AlgoConfig` fields (Hydra: `algo.KEY=VALUE`)
for every key of `LOSSES`; `CORRECTION_PRESETS` adds an off-policy correction on top.
Scale-dependent values stay out (DAPO's overlong buffer is 4096 of 20480 tokens:
set `algo.overlong_buffer` per recipe), and so does GRPO's KL to a reference model
(the paper's beta = 0.04: `algo.kl_coef=0.04`), which loads a second model.
See the README's "RL objectives" section for the table with the papers.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"loss": "grpo", "aggregation": "sequence", "std_normalize": True,
             "eps_low": 0.2, "eps_high": 0.2},
    "dapo": {"loss": "dapo", "aggregation": "token", "std_normalize": True,
             "eps_low": 0.2, "eps_high": 0.28, "filter_zero_advantage": True},
    "dr_grpo": {"loss": "dr_grpo", "aggregation": "constant", "std_normalize": False,
                "eps_low": 0.2, "eps_high": 0.2},
    "gspo": {"loss": "gspo", "aggregation": "sequence", "std_normalize": True,
             "eps_low": 3e-4, "eps_high": 4e-4},
    "cispo": {"loss": "cispo", "aggregation": "token", "std_normalize": True,
              "eps_low": 1.0, "eps_high": 0.28},
    "dppo_tv": {"loss": "dppo_tv", "aggregation": "token", "std_normalize": True,
                "eps_low": 0.2, "eps_high": 0.2, "mismatch_kl_coef": 1e-3},
}

CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    "none": {"correction": "none"},
    "tis": {"correction": "tis", "correction_level": "token", "correction_high": 2.0},
    "mis": {"correction": "mis", "correction_level": "token", "correction_low": 0.5, "correction_high": 2.0},
}
