"""A micro-batch as the tensors the trainer computes with.

Contract: `model_inputs(mb, device, cp)` lays one `MicroBatch` out for the model and the losses:
the model's inputs as the micro-batch packs them (`input_ids`, `position_ids` [B, T], packed or
padded; with context parallelism this rank's positions of each sequence, [B, Tl], and the
`scope` that gathers keys and logprobs across the cp group, rlray.parallel.context), each
position's next token (`targets`), where sequences start (`first`), and the losses' inputs as one
row per sequence ([N, L]: `loss_mask`, `advantages`, `inference_logprobs`, `stale`), read back
from the packed layout through `index` / `valid` (rlray.data.packing.sequence_rows).
With MoE routing (`mb.routing`), `routing` is the engine's experts of every token the model sees
([B x T (or Tl), MoE layers, top-k], long; rlray.parallel.routing replays them), else None.
With images (`mb.pixel_values`), `images` holds `pixel_values`, `image_grid_thw` and `image_mask`
(rlray.models.multimodal makes the model's inputs of them), else None; context parallelism does not
split image sequences (a `ValueError`).
`cp` is None, or (group, rank in it, degree).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlray.data.packing import sequence_rows
from rlray.parallel import context
from rlray.types import MicroBatch, no_route


def model_inputs(mb: MicroBatch, device: torch.device, cp: tuple[Any, int, int] | None = None) -> dict[str, Any]:
    index, valid = sequence_rows(mb.segment_ids)

    def rows(x: np.ndarray) -> torch.Tensor:
        return torch.tensor(np.where(valid, np.asarray(x).reshape(-1)[index], 0), device=device)

    ids, pos = np.asarray(mb.input_ids), np.asarray(mb.position_ids)
    targets, scope, routing = np.pad(ids[:, 1:], ((0, 0), (0, 1))), None, mb.routing
    first = torch.tensor(pos == 0, device=device)  # a sequence's first token: nothing predicts it
    if cp is not None:
        if mb.pixel_values is not None:
            raise ValueError("trainer.cp > 1 cannot split sequences with images; set trainer.cp=1 for a "
                             "vision-language model")
        group, rank, degree = cp
        shards, inverse = context.shard(pos, mb.segment_ids, degree)
        scope = context.Scope(group, rank, shards, inverse, device)
        src, pos = scope.shard.source, scope.shard.position_ids  # this rank's positions
        ids, targets = (np.where(src >= 0, np.take_along_axis(x, np.maximum(src, 0), 1), 0) for x in (ids, targets))
        if routing is not None:
            taken = np.take_along_axis(routing, np.maximum(src, 0)[..., None, None], 1)
            routing = np.where((src >= 0)[..., None, None], taken, no_route(routing.dtype))
    t: dict[str, Any] = {k: torch.tensor(v, device=device)
                         for k, v in (("input_ids", ids), ("position_ids", pos), ("targets", targets))}
    t.update(first=first, scope=scope, index=torch.tensor(index, device=device), valid=torch.tensor(valid, device=device))
    t.update({k: rows(getattr(mb, k)) for k in ("loss_mask", "advantages", "inference_logprobs")})
    t["stale"] = rows(mb.lag > 0).float() if mb.lag is not None else torch.zeros_like(t["loss_mask"])
    t["routing"] = None if routing is None else torch.tensor(
        routing.reshape(-1, *routing.shape[2:]).astype(np.int64), device=device)
    t["images"] = None if mb.pixel_values is None else {
        "pixel_values": torch.tensor(mb.pixel_values, device=device),
        "image_grid_thw": torch.tensor(mb.image_grid_thw, device=device),
        "image_mask": torch.tensor(mb.image_mask, device=device)}
    return t
