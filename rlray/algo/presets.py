"""The `algo.*` values that reproduce each paper's objective, keyed by `algo.loss`.

Contract: `PRESETS[name]` is a dict of `AlgoConfig` fields (Hydra: `algo.KEY=VALUE`)
for every key of `LOSSES`: the loss and every `PRESET_KEYS` value its paper sets. The
shipped config leaves those keys unset, so `algo.loss=NAME` alone applies them
(`AlgoConfig.__post_init__`); a key set in a recipe or on the command line wins.
`CORRECTION_PRESETS` adds an off-policy correction on top.
Scale-dependent values stay out (DAPO's overlong buffer is 4096 of 20480 tokens:
set `algo.overlong_buffer` per recipe), and so does GRPO's KL to a reference model
(the paper's beta = 0.04: `algo.kl_coef=0.04`), which loads a second model.
See the README's "RL objectives" section for the table with the papers.
"""

from __future__ import annotations

from typing import Any

from rlray.config import LOSS_PRESETS, PRESET_DEFAULTS

PRESETS: dict[str, dict[str, Any]] = {
    name: {"loss": name, **PRESET_DEFAULTS, **values} for name, values in LOSS_PRESETS.items()
}

CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    "none": {"correction": "none"},
    "tis": {"correction": "tis", "correction_level": "token", "correction_high": 2.0},
    "mis": {"correction": "mis", "correction_level": "token", "correction_low": 0.5, "correction_high": 2.0},
}
