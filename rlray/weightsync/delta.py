"""Delta sync's encoding: what to send so that a receiver holding the last weights holds the new ones.

Contract: `delta_tensors(name, new, last)` compares the two bit for bit (in the wire dtype) and
returns the fewest bytes of: nothing, `name.delta_index` (flat positions) + `name.delta_value`,
`name.delta_mask` (a bit per element) + `name.delta_value`, or `name` itself (dense), with the
number of changed elements; `positions_first` orders a sync's tensors so that buckets of one
dtype stay whole; `apply_delta(weights, received)` patches a receiver's copy in place. Torch only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

INDEX, MASK, VALUE = ".delta_index", ".delta_mask", ".delta_value"
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BITS = 2 ** torch.arange(8, dtype=torch.uint8)


def changed_mask(new: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of where `new` and `last` differ bit for bit (NaN == NaN, -0.0 != 0.0)."""
    bits = _SAME_SIZE_INT[new.element_size()]
    return new.reshape(-1).view(bits) != last.reshape(-1).view(bits)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(-(-mask.numel() // 8) * 8, dtype=torch.uint8)
    padded[: mask.numel()] = mask
    return (padded.view(-1, 8) * _BITS).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return ((packed[:, None] & _BITS) != 0).view(-1)[:numel]


def delta_tensors(name: str, new: torch.Tensor, last: torch.Tensor) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """What to send so that a receiver holding `last` holds `new`, and how many elements changed:
    nothing, or the fewest bytes of: `name` itself (dense; in fp32 nearly every element changes),
    the changed elements' flat positions (`name.delta_index`) and values (`name.delta_value`),
    or a bit per element (`name.delta_mask`) and the values."""
    mask = changed_mask(new, last)
    n, size, item = int(mask.sum()), new.numel(), new.element_size()
    if n == 0:
        return [], 0
    index_dtype = torch.int32 if size < 2**31 else torch.int64
    costs = {"dense": size * item, "index": n * (index_dtype.itemsize + item), "mask": -(-size // 8) + n * item}
    best = min(costs, key=costs.__getitem__)
    values = (name + VALUE, new.reshape(-1)[mask])
    if best == "index":
        return [(name + INDEX, mask.nonzero().squeeze(1).to(index_dtype)), values], n
    if best == "mask":
        return [(name + MASK, pack_bits(mask)), values], n
    return [(name, new)], n


def apply_delta(weights: dict[str, torch.Tensor], received: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Patch `weights` in place with what `delta_tensors` produced (positions before values)."""
    where: dict[str, torch.Tensor] = {}
    for name, tensor in received:
        if name.endswith(INDEX):
            where[name.removesuffix(INDEX)] = tensor.long()  # a copy: `tensor` may be a pooled view
        elif name.endswith(MASK):
            base = name.removesuffix(MASK)
            where[base] = unpack_bits(tensor, weights[base].numel())
        elif name.endswith(VALUE):
            base = name.removesuffix(VALUE)
            weights[base].view(-1)[where.pop(base)] = tensor
        else:
            weights[name].copy_(tensor)
    assert not where, f"delta positions without values: {sorted(where)[:3]}"


def positions_first(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Indices, then masks, then values and dense tensors: a bucket holds one dtype, so
    interleaving them would cut a bucket per tensor."""
    order = {INDEX: 0, MASK: 1}
    return sorted(items, key=lambda item: next((v for k, v in order.items() if item[0].endswith(k)), 2))
