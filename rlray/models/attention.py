"""Packed attention: causal attention inside each sequence of a packed row, one SDPA call per sequence.

Contract: `packed_attention(module, query, key, value, attention_mask, position_ids=..., **kwargs)`
has transformers' attention-interface signature; rlray.models.load registers it (as `PACKED`)
for the trainer's models, and the trainer passes `position_ids` and no attention mask. A row's
sequences are its runs of position ids that count up by one, the rule transformers' own
packed-sequence detection uses. The result is SDPA's under the block-causal mask, but the masked
blocks are never computed: a row of sequences of lengths L_i costs sum L_i^2, not (sum L_i)^2
(what flash-attn's varlen kernels give on GPU; CPU has no varlen kernel). Rows holding one
sequence each (the padded layout) take a single batched causal SDPA call.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from rlray.parallel.hf import sdpa_attention

PACKED = "rlray_packed"
_last: list[Any] = [None, None]  # (position_ids, spans): every layer of one forward sees the same tensor


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


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    if attention_mask is not None:
        raise ValueError("packed attention takes position_ids, not an attention mask")
    rows = spans(position_ids) if position_ids is not None else [[(0, query.shape[2])]] * query.shape[0]
    if all(len(r) == 1 for r in rows):
        return sdpa_attention(module, query, key, value, None, causal=True, **kwargs)
    out = []
    for b, row in enumerate(rows):
        parts = [sdpa_attention(module, query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
                                None, causal=True, **kwargs)[0] for s, e in row]
        out.append(torch.cat(parts, dim=1))
    return torch.cat(out, dim=0), None
