"""Packing of rollouts into right-padded micro-batches, balanced across trainer ranks.

Contract: `pack(samples, num_ranks, micro_batch_tokens, ...)` returns one list of
`MicroBatch` per rank. Every rank gets the same number of micro-batches (FSDP runs
collectives per forward), padding with a fully masked micro-batch where needed.
Samples are dealt to ranks longest-first onto the least-loaded rank, then cut into
micro-batches of at most `micro_batch_tokens` padded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlray.types import MicroBatch


@dataclass
class Sample:
    """One training sequence: prompt then completion, with per-completion-token values."""

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    loss_mask: np.ndarray  # [C]
    advantage: float
    logprobs: np.ndarray  # [C]
    lag: np.ndarray | None = None  # [C]: trainer step minus the policy version that sampled each token

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


def _cut(samples: list[Sample], budget: int) -> list[list[Sample]]:
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


def to_micro_batch(samples: list[Sample], pad_id: int) -> MicroBatch:
    T = max(len(s) for s in samples)
    B = len(samples)
    ids = np.full((B, T), pad_id, dtype=np.int64)
    attn = np.zeros((B, T), dtype=np.int64)
    mask = np.zeros((B, T), dtype=np.float32)
    adv = np.zeros((B, T), dtype=np.float32)
    logp = np.zeros((B, T), dtype=np.float32)
    lag = np.zeros((B, T), dtype=np.int64)
    for b, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[b, :p] = s.prompt_ids
        ids[b, p:p + c] = s.completion_ids
        attn[b, :p + c] = 1
        mask[b, p:p + c] = s.loss_mask
        adv[b, p:p + c] = s.advantage
        logp[b, p:p + c] = s.logprobs
        if s.lag is not None:
            lag[b, p:p + c] = s.lag
    return MicroBatch(ids, attn, mask, adv, logp, lag=lag)


def pack(samples: list[Sample], num_ranks: int, micro_batch_tokens: int, pad_id: int) -> list[list[MicroBatch]]:
    per_rank = [_cut(r, micro_batch_tokens) for r in _deal(samples, num_ranks)]
    count = max(1, max(len(chunks) for chunks in per_rank))
    total = float(sum(s.loss_mask.sum() for s in samples))
    sequences = float(sum(s.loss_mask.sum() > 0 for s in samples))
    filler = Sample(np.array([pad_id]), np.array([pad_id]), np.zeros(1, np.float32), 0.0, np.zeros(1, np.float32))
    out: list[list[MicroBatch]] = []
    for chunks in per_rank:
        chunks = chunks + [[filler]] * (count - len(chunks))
        mbs = [to_micro_batch(c, pad_id) for c in chunks]
        for mb in mbs:
            mb.num_loss_tokens_global = max(total, 1.0)
            mb.num_sequences_global = max(sequences, 1.0)
        out.append(mbs)
    return out
