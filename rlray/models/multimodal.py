"""The trainer's view of a vision-language model: which parts it has and what its forward takes.

Contract:
- `is_vision(hf_config)`: a config with a vision tower (transformers' image-text-to-text classes build it).
- `vision_tower(model)`: the tower (`model.model.visual`), or None for a text model;
  `freeze_vision(model)` stops its parameters' gradients (`trainer.freeze_vision`).
- `forward_kwargs(model, t)`: the model's inputs besides `input_ids` for one micro-batch laid out by
  rlray.data.layout (`t["images"]`: None, or pixel values, grids and the placeholder mask):
  * `position_ids` [4, B, T]: row 0 the text positions (they restart per sequence; packed attention
    reads the sequence bounds from them), rows 1-3 the family's multimodal rotary positions from its
    own `get_rope_index`, computed sequence by sequence so they restart with each;
  * `pixel_values` / `image_grid_thw`, with the placeholders taken from the mask instead of the token
    id: an image-pad token the policy sampled is a plain token, as vLLM treats it;
  * a micro-batch without images gives the tower a blank one-token image that no position takes, so
    every FSDP rank gathers and reduces the tower's shards in every micro-batch.
A text model gets `{"position_ids": t["position_ids"]}`.

The transformers attributes used here are pinned by tests/unit/test_multimodal.py:
`model.model.visual`, `model.model.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw)`, the
instance override of `model.model.get_placeholder_mask`, and the vision config's `spatial_merge_size`,
`in_channels`, `temporal_patch_size`, `patch_size`.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn


def is_vision(hf_config: Any) -> bool:
    return getattr(hf_config, "vision_config", None) is not None


def vision_tower(model: nn.Module) -> nn.Module | None:
    return getattr(getattr(model, "model", None), "visual", None)


def freeze_vision(model: nn.Module) -> None:
    tower = vision_tower(model)
    if tower is None:
        raise ValueError(f"trainer.freeze_vision=true but {type(model).__name__} has no vision tower; "
                         "set trainer.freeze_vision=false")
    for p in tower.parameters():
        p.requires_grad_(False)


def forward_kwargs(model: nn.Module, t: dict[str, Any]) -> dict[str, Any]:
    if vision_tower(model) is None:
        if t.get("images") is not None:
            raise ValueError(f"a micro-batch carries images but {type(model).__name__} is a text-only model: "
                             "model.name must be a vision-language model for image environments")
        return {"position_ids": t["position_ids"]}
    inner, images = model.model, t.get("images")
    pos = t["position_ids"]
    if images is None:
        pixels, grids = _blank(inner, pos.device)
        mask = torch.zeros_like(pos, dtype=torch.bool)
    else:
        pixels, grids, mask = images["pixel_values"], images["image_grid_thw"], images["image_mask"]
    inner.get_placeholder_mask = _placeholders(mask)
    return {"position_ids": rope_positions(inner, t["input_ids"], pos, mask, grids if images else None),
            "pixel_values": pixels, "image_grid_thw": grids}


def rope_positions(inner: nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                   grids: torch.Tensor | None) -> torch.Tensor:
    """[4, B, T]: text positions, then the family's rotary positions of each sequence on its own
    (a sequence starts where its text position is 0; image-free ones keep the text positions)."""
    out = pos[None].repeat(4, 1, 1)
    if grids is None:
        return out
    taken, (B, T) = 0, pos.shape
    for b in range(B):
        starts = [*torch.nonzero(pos[b] == 0).flatten().tolist(), T]
        for s, e in itertools.pairwise(starts):
            m = mask[b, s:e]
            n = int(m[0]) + int((m[1:] & ~m[:-1]).sum())  # placeholder runs: one per image
            if n == 0:
                continue
            rope, _ = inner.get_rope_index(ids[b:b + 1, s:e], mm_token_type_ids=m[None].int(),
                                           image_grid_thw=grids[taken:taken + n])
            out[1:, b, s:e] = rope[:, 0]
            taken += n
    if taken != len(grids):
        raise ValueError(f"the micro-batch's placeholders make {taken} images but it carries {len(grids)}")
    return out


def _blank(inner: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest image the tower takes: one merged token's patches, all zero."""
    vc = inner.config.vision_config
    m = vc.spatial_merge_size
    patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    return torch.zeros(m * m, patch, device=device), torch.tensor([[1, m, m]], device=device)


def _placeholders(mask: torch.Tensor) -> Any:
    """`get_placeholder_mask` that answers from `mask` (bool [B, T]) instead of the token ids."""

    def get_placeholder_mask(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor,
                             image_features: torch.Tensor | None = None,
                             video_features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if image_features is not None and mask.any() and int(mask.sum()) * inputs_embeds.shape[-1] != image_features.numel():
            raise ValueError(f"{int(mask.sum())} image placeholders but {image_features.shape[0]} image features")
        image = mask[..., None].expand_as(inputs_embeds).to(inputs_embeds.device)
        return image, torch.zeros_like(image)

    return get_placeholder_mask
