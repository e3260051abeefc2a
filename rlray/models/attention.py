"""Packed attention: causal attention inside each sequence of a packed row, one call per sequence.

Contract: `packed_attention(module, query, key, value, attention_mask, position_ids=..., **kwargs)`
has transformers' attention-interface signature; rlray.models.load registers it (as `PACKED`)
for the trainer's models, and the trainer passes `position_ids` and no attention mask. A row's
sequences are its runs of position ids that count up by one, the rule transformers' own
packed-sequence detection uses. The result is SDPA's under the block-causal mask, but the masked
blocks are never computed: a row of sequences of lengths L_i costs sum L_i^2, not (sum L_i)^2
(what flash-attn's varlen kernels give on GPU; CPU has no varlen kernel). Rows holding one
sequence each (the padded layout) take a single batched call.

An attention module with per-head sinks (gpt-oss: `module.sinks`), or a call given a `sliding_window`,
runs the model's own eager attention instead (rlray.parallel.hf.eager_attention: SDPA has neither),
under an additive causal mask limited to the window: query q sees keys k with q - W < k <= q
(transformers' masking_utils.sliding_window_overlay). `switch_sinks(model, on=False)` sends such modules
back to plain SDPA, for a test to show what the sinks and windows change.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rlray.parallel.hf import eager_attention, sdpa_attention

PACKED = "rlray_packed"
_last: list[Any] = [None, None]  # (position_ids, spans): every layer of one forward sees the same tensor
_OFF = "_rlray_sinks_off"


def spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each run of position ids counting up by one."""
    if _last[0] is position_ids:
        return _last[1]
    pos = position_ids.cpu()
    breaks = torch.diff(pos, dim=-1) != 1
    out = []
    for row in breaks:
        cuts = [0, *(torch.nonzero(row).flatten() + 1).tolist(), pos.shape[-1]]
        out.append(list(itertools.pairwise(cuts)))
    _last[0], _last[1] = position_ids, out
    return out


def switch_sinks(model: nn.Module, on: bool) -> int:
    """Run every attention module that has sinks with them and its window (on), or as plain SDPA without
    either (off); returns how many modules."""
    modules = [m for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.Tensor)]
    for m in modules:
        setattr(m, _OFF, not on)
    return len(modules)


def window_mask(length: int, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, 1, L, L] additive mask: 0 where query q sees key k (k <= q, and k > q - window), else dtype's min."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    seen = (k <= q) & (k > q - window) if window else k <= q
    mask = torch.zeros(length, length, dtype=dtype, device=device)
    return mask.masked_fill_(~seen, torch.finfo(dtype).min)[None, None]


def _eager(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           **kwargs: Any) -> torch.Tensor:
    mask = window_mask(query.shape[2], kwargs.get("sliding_window"), query.dtype, query.device)
    return eager_attention(module, query, key, value, mask, **kwargs)[0]


def _attend(module: nn.Module, **kwargs: Any) -> Callable[..., torch.Tensor]:
    """This module's attention of one call: (query, key, value) -> [B, T, H, D]."""
    own = isinstance(getattr(module, "sinks", None), torch.Tensor) or bool(kwargs.get("sliding_window"))
    if own and not getattr(module, _OFF, False):
        return lambda q, k, v: _eager(module, q, k, v, **kwargs)
    return lambda q, k, v: sdpa_attention(module, q, k, v, None, causal=True, **kwargs)[0]


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    if attention_mask is not None:
        raise ValueError("packed attention takes position_ids, not an attention mask")
    attend = _attend(module, **kwargs)
    rows = spans(position_ids) if position_ids is not None else [[(0, query.shape[2])]] * query.shape[0]
    if all(len(r) == 1 for r in rows):
        return attend(query, key, value), None
    out = []
    for b, row in enumerate(rows):
        parts = [attend(query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e]) for s, e in row]
        out.append(torch.cat(parts, dim=1))
    return torch.cat(out, dim=0), None
