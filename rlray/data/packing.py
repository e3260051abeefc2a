"""Packing of training sequences into micro-batches, balanced across trainer ranks by tokens.

Contract: `pack(samples, num_ranks, micro_batch_tokens, pad_id, packed=True, cp=1)` returns one
list of `MicroBatch` per rank. Samples are dealt longest-first onto the least-loaded of the
`num_ranks / cp` data-parallel ranks (the `cp` ranks of a context-parallel group share their
micro-batches). Then
- packed (default): first-fit decreasing into rows of at most `micro_batch_tokens` tokens, one
  row per micro-batch, several sequences per row with no padding; `position_ids` restart at 0
  for each sequence and `segment_ids` number the sequences, so attention stays inside each one
  (block-causal) and the trainer can read every sequence back out;
- padded (`packed=False`): one right-padded row per sequence, at most `micro_batch_tokens`
  padded tokens per micro-batch (the layout before packing, kept as the baseline).
Every rank gets the same number of micro-batches (FSDP runs collectives per forward), padding
with a fully masked one where needed. Samples' routing (MoE) rides along position by position
(`MicroBatch.routing`, `no_route` at padding and for samples without one; None when no sample has
one). Images (a vision-language model's, `Sample.images`) ride along the same way: a micro-batch
holds every image of its sequences (an image never crosses micro-batches), in row-major
placeholder order, with the placeholder positions (`MicroBatch.image_mask`); the trainer derives the
model family's multimodal rotary positions per sequence from them (rlray.models.multimodal).
A sequence longer than `micro_batch_tokens` gets a row of its own. `sequence_rows(segment_ids)` gives the gather index from a micro-batch's tokens to
one row per sequence, the layout the losses read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlray.types import Images, MicroBatch, no_route


@dataclass
class Sample:
    """One training sequence: prompt then completion, with per-completion-token values."""

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    loss_mask: np.ndarray  # [C]
    advantage: float | np.ndarray  # one for the sequence, or one per completion token [C]
    logprobs: np.ndarray  # [C]
    lag: np.ndarray | None = None  # [C]: trainer step minus the policy version that sampled each token
    routing: np.ndarray | None = None  # [P + C, MoE layers, top-k]: the engine's experts (rlray.types.no_route: none)
    images: Images | None = None  # a vision-language sequence's images

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def _deal(samples: list[Sample], num_ranks: int) -> list[list[Sample]]:
    ranks: list[list[Sample]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for s in sorted(samples, key=len, reverse=True):
        r = int(np.argmin(loads))
        ranks[r].append(s)
        loads[r] += len(s)
    return ranks


def _cut_padded(samples: list[Sample], budget: int) -> list[list[Sample]]:
    chunks: list[list[Sample]] = []
    current: list[Sample] = []
    for s in samples:  # already longest-first, so padded size = count * first length
        if current and (len(current) + 1) * len(current[0]) > budget:
            chunks.append(current)
            current = []
        current.append(s)
    if current:
        chunks.append(current)
    return chunks


def _fill_rows(samples: list[Sample], budget: int) -> list[list[Sample]]:
    """First-fit decreasing: each sample (longest first) goes into the first row it fits in."""
    rows: list[list[Sample]] = []
    used: list[int] = []
    for s in samples:
        i = next((i for i, u in enumerate(used) if u + len(s) <= budget), len(rows))
        if i == len(rows):
            rows.append([])
            used.append(0)
        rows[i].append(s)
        used[i] += len(s)
    return rows


def to_micro_batch(rows: list[list[Sample]], pad_id: int) -> MicroBatch:
    """Rows of sequences, each row's sequences back to back, rows right-padded to the longest."""
    T = max(sum(len(s) for s in row) for row in rows)
    shape = (len(rows), T)
    ids = np.full(shape, pad_id, dtype=np.int64)
    attn, lag, seg = np.zeros(shape, np.int64), np.zeros(shape, np.int64), np.full(shape, -1, np.int64)
    pos = np.tile(np.arange(T, dtype=np.int64), (len(rows), 1))  # padding continues the last sequence's count
    mask, adv, logp = (np.zeros(shape, np.float32) for _ in range(3))
    like = next((s.routing for row in rows for s in row if s.routing is not None), None)
    route = None if like is None else np.full((*shape, *like.shape[1:]), no_route(like.dtype), like.dtype)
    n = 0
    for b, row in enumerate(rows):
        at = 0
        for s in row:
            p, c = len(s.prompt_ids), len(s.completion_ids)
            span, done = slice(at, at + p + c), slice(at + p, at + p + c)
            ids[b, at:at + p], ids[b, done] = s.prompt_ids, s.completion_ids
            attn[b, span], seg[b, span] = 1, n
            pos[b, span] = np.arange(p + c)
            pos[b, at + p + c:] = np.arange(p + c, p + c + T - (at + p + c))
            mask[b, done], adv[b, done], logp[b, done] = s.loss_mask, s.advantage, s.logprobs
            if s.lag is not None:
                lag[b, done] = s.lag
            if route is not None and s.routing is not None:
                route[b, span] = s.routing
            at, n = at + p + c, n + 1
    mb = MicroBatch(ids, attn, mask, adv, logp, lag=lag, position_ids=pos, segment_ids=seg, routing=route)
    _add_images(mb, rows)
    return mb


def _add_images(mb: MicroBatch, rows: list[list[Sample]]) -> None:
    """The rows' images in row-major placeholder order (sequences in a row follow each other)."""
    placed = [(b, at, s) for b, at, s in _placed(rows) if s.images is not None and len(s.images.grid_thw)]
    if not placed:
        return
    mb.image_mask = np.zeros(np.shape(mb.input_ids), bool)
    for b, at, s in placed:
        mb.image_mask[b, at:at + len(s)] = s.images.mask(len(s))
    mb.pixel_values = np.concatenate([s.images.pixel_values for _, _, s in placed])
    mb.image_grid_thw = np.concatenate([s.images.grid_thw for _, _, s in placed]).astype(np.int64)


def _placed(rows: list[list[Sample]]) -> list[tuple[int, int, Sample]]:
    """(row, first position, sample) of every sample, in row-major order."""
    out = []
    for b, row in enumerate(rows):
        at = 0
        for s in row:
            out.append((b, at, s))
            at += len(s)
    return out


def sequence_rows(segment_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(index, valid)`, both [N, L]: `index[n, j]` is the flat position (in `segment_ids.ravel()`)
    of sequence n's j-th token, `valid` where j < its length (index 0 elsewhere)."""
    flat = segment_ids.ravel()
    n = int(flat.max()) + 1 if flat.size and flat.max() >= 0 else 0
    positions = [np.flatnonzero(flat == i) for i in range(n)]
    L = max((len(p) for p in positions), default=0)
    index, valid = np.zeros((n, L), np.int64), np.zeros((n, L), bool)
    for i, p in enumerate(positions):
        index[i, :len(p)], valid[i, :len(p)] = p, True
    return index, valid


def pack(samples: list[Sample], num_ranks: int, micro_batch_tokens: int, pad_id: int,
         packed: bool = True, cp: int = 1) -> list[list[MicroBatch]]:
    dp = num_ranks // cp
    if packed:
        per_dp = [[[row] for row in _fill_rows(r, micro_batch_tokens)] for r in _deal(samples, dp)]
    else:
        per_dp = [[[[s] for s in chunk] for chunk in _cut_padded(r, micro_batch_tokens)] for r in _deal(samples, dp)]
    count = max(1, max(len(mbs) for mbs in per_dp))
    total = float(sum(s.loss_mask.sum() for s in samples))
    sequences = float(sum(s.loss_mask.sum() > 0 for s in samples))
    filler = Sample(np.array([pad_id]), np.array([pad_id]), np.zeros(1, np.float32), 0.0, np.zeros(1, np.float32))
    out: list[list[MicroBatch]] = []
    for mbs_rows in per_dp:
        mbs = [to_micro_batch(rows, pad_id) for rows in mbs_rows + [[[filler]]] * (count - len(mbs_rows))]
        for mb in mbs:
            mb.num_loss_tokens_global = max(total, 1.0)
            mb.num_sequences_global = max(sequences, 1.0)
        out.extend([mbs] * cp)
    return out
