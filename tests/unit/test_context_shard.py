"""Context-parallel sharding: every token lands on exactly one rank, each sequence split into
a front and a back chunk per rank, and the mask lets a query see only its own sequence's
earlier keys, wherever they were computed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rlray.parallel.context import blocks, shard


def packed_row() -> tuple[np.ndarray, np.ndarray]:
    lengths = [7, 3, 12]  # uneven, none a multiple of 2 cp
    pos = np.concatenate([np.arange(n) for n in lengths])[None]
    seg = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])[None]
    return pos, seg


@pytest.mark.parametrize("cp", [2, 3])
def test_every_token_once_and_the_inverse_finds_it(cp: int) -> None:
    pos, seg = packed_row()
    shards, inverse = shard(pos, seg, cp)
    sources = np.concatenate([s.source for s in shards], axis=1)
    assert sorted(sources[sources >= 0].tolist()) == list(range(pos.shape[1]))
    assert len({s.source.shape for s in shards}) == 1  # every rank computes as many positions
    stacked = np.stack([s.source for s in shards]).reshape(-1)
    assert (stacked[inverse[0]] == np.arange(pos.shape[1])).all()
    for s in shards:  # each local position keeps its sequence and its position in it
        real = s.source >= 0
        assert (s.position_ids[real] == pos[0, s.source[real]]).all()
        assert (s.segment_ids[real] == seg[0, s.source[real]]).all()


def test_front_and_back_chunks_balance_causal_work() -> None:
    pos = np.arange(16)[None]
    seg = np.zeros((1, 16), np.int64)
    shards, _ = shard(pos, seg, 2)
    assert shards[0].source[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shards[1].source[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    work = [sum(int(m.sum()) for _, _, _, m in blocks(shards, r)[0]) for r in range(2)]  # query-key pairs
    assert work[0] == work[1]


def test_blocks_see_exactly_the_earlier_keys_of_their_own_sequence() -> None:
    pos, seg = packed_row()
    shards, _ = shard(pos, seg, 2)
    keys = np.concatenate([s.source for s in shards], axis=1)[0]
    for r, s in enumerate(shards):
        (row,) = blocks(shards, r)
        ends = [(a, b) for a, b, _, _ in row]
        assert ends[0][0] == 0 and ends[-1][1] == s.source.shape[1]  # the runs cover the row, in order
        assert all(b == a for (_, b), (a, _) in itertools.pairwise(ends))
        for start, end, idx, mask in row:
            for i, q in enumerate(s.source[0, start:end]):
                if q < 0:
                    assert mask[i].any()  # padding sees at least itself: no all-masked row, no NaN
                    continue
                seen = keys[idx[mask[i]]]
                assert (seen >= 0).all()  # a real token never sees the padding added for the split
                assert sorted(seen.tolist()) == [k for k in range(pos.shape[1]) if seg[0, k] == seg[0, q] and k <= q]
