"""Packed rows for recurrent token mixers (a gated delta-net, a Mamba block): one call per sequence.

A recurrent mixer knows nothing of position ids: over a packed row its state, and its short convolution's
window, run from one sequence into the next. transformers' CPU fallbacks take one sequence per row and drop
`cu_seqlens` (hub kernels filter keyword arguments to their signature), so rlray runs the mixer once per
sequence, as packed attention runs SDPA once per sequence (rlray.models.attention).

Contract: `reset_per_sequence(model, attr)` makes the `attr` module of every linear-attention decoder layer (a
Qwen3-Next layer's `linear_attn`, a Nemotron-H Mamba layer's `mixer`) run once per sequence of its row: each decoder layer's forward pre-hook keeps
the `position_ids` it is given, whose runs that count up by one are the row's sequences (`spans`, the rule
packed attention uses), and the mixer's forward is called on each run alone, without a cache (one would carry
a sequence's state into the next; the trainer runs without one anyway), and the outputs put back in place. Rows holding one sequence each (the padded layout) take one
call. Returns how many mixers it wrapped. `switch(model, on)` turns the reset off and on (a test shows packed
rows then differ from padded ones).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rlray.models.attention import spans
from rlray.models.cache import LINEAR, layer_kinds
from rlray.parallel.parallelize import decoder_layers

_ON = "_rlray_reset_per_sequence"


def reset_per_sequence(model: nn.Module, attr: str) -> int:
    wrapped = 0
    kinds = layer_kinds(model.config.get_text_config())
    for layer, kind in zip(decoder_layers(model), kinds, strict=True):
        mixer = getattr(layer, attr, None)
        if mixer is None or kind != LINEAR:  # Nemotron-H calls every layer's block `mixer`
            continue
        layer.register_forward_pre_hook(_keep_positions(mixer), with_kwargs=True)
        mixer.forward = _per_sequence(mixer, mixer.forward)
        setattr(mixer, _ON, True)
        wrapped += 1
    return wrapped


def switch(model: nn.Module, on: bool) -> None:
    for module in model.modules():
        if hasattr(module, _ON):
            setattr(module, _ON, on)


def _keep_positions(mixer: nn.Module) -> Callable:
    def keep(_layer: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        mixer._rlray_positions = kwargs.get("position_ids")

    return keep


def _per_sequence(mixer: nn.Module, forward: Callable) -> Callable:
    def run(hidden_states: torch.Tensor, *args: Any, attention_mask: torch.Tensor | None = None,
            **kwargs: Any) -> torch.Tensor:
        positions = getattr(mixer, "_rlray_positions", None)
        if positions is None or not getattr(mixer, _ON):
            return forward(hidden_states, *args, attention_mask=attention_mask, **kwargs)
        rows = spans(positions[0] if positions.dim() == 3 else positions)  # [rope rows, B, T]: the text positions
        if all(len(r) == 1 for r in rows):
            return forward(hidden_states, *args, attention_mask=attention_mask, **kwargs)
        mask = lambda b, s, e: None if attention_mask is None else attention_mask[b:b + 1, s:e]
        kwargs["cache_params"] = None  # a cache would carry one sequence's state into the next
        out = [torch.cat([forward(hidden_states[b:b + 1, s:e], *args, attention_mask=mask(b, s, e), **kwargs)
                          for s, e in row], dim=1) for b, row in enumerate(rows)]
        return torch.cat(out, dim=0)

    return run
