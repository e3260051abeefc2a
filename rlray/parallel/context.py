"""Context parallelism: every sequence split over the `cp` ranks of a group, attention over the
whole context by an all-gather of keys and values.

Contract:
- `shard(position_ids, segment_ids, cp)` (pure numpy) splits each sequence of a micro-batch
  (each run of one segment id in a row) into `2 cp` equal chunks, the sequence padded at its
  end to a multiple of `2 cp`; rank r keeps chunks r and 2cp-1-r, a front and a back chunk, so
  every rank does the same share of causal attention work. It returns one `Shard` per rank
  (which original token each local position holds, and its position id and segment) and the
  inverse map from every original token to its place among all ranks' local positions.
- `attention(...)`, registered with transformers' attention interface (rlray.parallel.hf),
  gathers the keys and values of the rank's cp group (an autograd-aware all-gather, so their
  gradients return to the ranks that computed them) and runs transformers' own SDPA attention
  of each sequence's local queries against that sequence's keys, masked by position: a query
  sees the keys of its own sequence at or before its position, wherever they were computed.
  `active(scope)` sets the group and mask it reads; it must cover the backward pass too, which
  recomputes attention under activation checkpointing.
- `Scope.gather(x)` brings a per-local-position tensor ([B, Tl]) of every rank of the group
  back to the micro-batch's own layout ([B, T]), differentiably.
Why K/V all-gather and not Ulysses: it needs no head count divisible by cp (GLM-4.5 and
Qwen3-MoE have 4-8 KV heads) and moves only the KV heads, which GQA makes few.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlray.parallel.hf import all_gather_autograd, sdpa_attention

_ACTIVE: list[Scope] = []


@dataclass
class Shard:
    """One rank's local positions: `source[b, j]` the original token index (-1: padding added
    for the split), with its position id and segment (padding continues its sequence)."""

    source: np.ndarray  # int64 [B, Tl]
    position_ids: np.ndarray  # int64 [B, Tl]
    segment_ids: np.ndarray  # int64 [B, Tl]


def _spans(segments: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of every run of one segment id in a row."""
    cuts = np.flatnonzero(np.diff(segments)) + 1
    bounds = np.concatenate([[0], cuts, [len(segments)]])
    return [(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


def _row(pos: np.ndarray, seg: np.ndarray, cp: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Per rank: (source, position, segment) lists of one row."""
    out: list[tuple[list[int], list[int], list[int]]] = [([], [], []) for _ in range(cp)]
    for a, b in _spans(seg):
        c = -(-(b - a) // (2 * cp))  # chunk length
        idx = [a + i if a + i < b else -1 for i in range(2 * cp * c)]
        positions = [int(pos[a]) + i for i in range(2 * cp * c)]
        for r in range(cp):
            for k in (r, 2 * cp - 1 - r):
                src, p, s = out[r]
                src += idx[k * c:(k + 1) * c]
                p += positions[k * c:(k + 1) * c]
                s += [int(seg[a])] * c
    return out


def shard(position_ids: np.ndarray, segment_ids: np.ndarray, cp: int) -> tuple[list[Shard], np.ndarray]:
    """Every rank's `Shard` and `inverse` [B, T]: the index of each original token in the
    flattened [cp, B, Tl] stack of all ranks' local positions."""
    B, T = segment_ids.shape
    rows = [_row(position_ids[b], segment_ids[b], cp) for b in range(B)]
    Tl = max(len(rows[b][0][0]) for b in range(B))
    shards = []
    for r in range(cp):
        src = np.full((B, Tl), -1, np.int64)
        pos = np.tile(np.arange(Tl, dtype=np.int64), (B, 1))
        seg = np.full((B, Tl), -1, np.int64)  # rows evened out with padding of their own
        for b in range(B):
            s, p, g = rows[b][r]
            src[b, :len(s)], pos[b, :len(p)], seg[b, :len(g)] = s, p, g
        shards.append(Shard(src, pos, seg))
    inverse = np.zeros((B, T), np.int64)
    for r, sh in enumerate(shards):
        b, j = np.nonzero(sh.source >= 0)
        inverse[b, sh.source[b, j]] = (r * B + b) * Tl + j
    return shards, inverse


def blocks(shards: list[Shard], rank: int) -> list[list[tuple[int, int, np.ndarray, np.ndarray]]]:
    """Per row of `rank`'s positions, each run of one segment as (start, end, keys, mask): the
    gathered positions (in rank order) of that segment's keys, and bool [end - start, len(keys)]:
    the local query sees the key at or before its position."""
    seg_k = np.concatenate([s.segment_ids for s in shards], axis=1)
    pos_k = np.concatenate([s.position_ids for s in shards], axis=1)
    seg_q, pos_q = shards[rank].segment_ids, shards[rank].position_ids
    out = []
    for b in range(seg_q.shape[0]):
        row = []
        cuts = [0, *(np.flatnonzero(np.diff(seg_q[b])) + 1), seg_q.shape[1]]
        for start, end in itertools.pairwise(cuts):
            keys = np.flatnonzero(seg_k[b] == seg_q[b, start])
            row.append((int(start), int(end), keys, pos_k[b, keys][None, :] <= pos_q[b, start:end][:, None]))
        out.append(row)
    return out


class Scope:
    """One micro-batch's context-parallel layout on one rank, and the group it was split over;
    `blocks` (see `blocks()`) let attention be computed only inside sequences."""

    def __init__(self, group: dist.ProcessGroup, rank: int, shards: list[Shard], inverse: np.ndarray,
                 device: torch.device) -> None:
        self.group, self.shard = group, shards[rank]
        self.inverse = torch.tensor(inverse, device=device)
        self.blocks = [[(start, end, torch.tensor(keys, device=device), torch.tensor(mask, device=device)[None, None])
                        for start, end, keys, mask in row] for row in blocks(shards, rank)]

    def gather_seq(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """All ranks' `x` concatenated along `dim`, in rank order (gradients return to each rank)."""
        return all_gather_autograd(x.movedim(dim, 0).contiguous(), self.group).movedim(0, dim)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Tl] per local position -> [B, T] per original token."""
        stacked = self.gather_seq(x[None], 0)  # [cp, B, Tl]
        return stacked.reshape(-1)[self.inverse]


@contextmanager
def active(scope: Scope | None) -> Iterator[None]:
    """Make `scope` the one `attention` reads (None: leave the current one)."""
    if scope is not None:
        _ACTIVE.append(scope)
    try:
        yield
    finally:
        if scope is not None:
            _ACTIVE.pop()


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature; `attention_mask` is None (no mask function
    is registered for this implementation): the active scope's mask stands in."""
    if not _ACTIVE:
        raise RuntimeError("context-parallel attention ran outside rlray.parallel.context.active(...)")
    scope = _ACTIVE[-1]
    keys, values = scope.gather_seq(key, 2), scope.gather_seq(value, 2)
    out = []
    for b, row in enumerate(scope.blocks):
        parts = [sdpa_attention(module, query[b:b + 1, :, start:end], keys[b:b + 1, :, idx], values[b:b + 1, :, idx],
                                mask, **kwargs)[0] for start, end, idx, mask in row]
        out.append(torch.cat(parts, dim=1))
    return torch.cat(out, dim=0), None
