"""Advantages, DAPO's overlong handling and dynamic sampling, by hand."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rlray.actors.buffer import BufferActor
from rlray.algo.advantages import compute_advantages, group_advantages, overlong_penalty, trains_on
from rlray.algo.loss import algo_config
from rlray.types import Group, Rollout


def rollout(reward: float, n: int = 3, finish: str = "stop", version: int = 0) -> Rollout:
    return Rollout(prompt_ids=np.array([1, 5]), completion_ids=np.arange(7, 7 + n),
                   logprobs=np.full(n, -0.5, np.float32), loss_mask=np.ones(n, np.int8),
                   versions=np.full(n, version), reward=reward, finish_reason=finish)


def test_rloo_leaves_each_rollout_out_of_its_baseline() -> None:
    r = np.array([1.0, 0.0, 0.5])
    # r_i - mean of the others: 1 - 0.25, 0 - 0.75, 0.5 - 0.5
    np.testing.assert_allclose(group_advantages(r, False, baseline="rloo"), [0.75, -0.75, 0.0], atol=1e-6)
    np.testing.assert_allclose(group_advantages(r, False, baseline="mean"), [0.5, -0.5, 0.0], atol=1e-6)
    std = np.sqrt(((0.5 ** 2) * 2) / 3)
    np.testing.assert_allclose(group_advantages(r, True, 1e-4, "rloo"), np.array([0.75, -0.75, 0]) / (std + 1e-4),
                               rtol=1e-5)
    assert group_advantages(np.array([1.0]), False, baseline="rloo").tolist() == [0.0]
    with pytest.raises(ValueError, match="algo.baseline"):
        group_advantages(r, baseline="median")


def test_the_group_std_is_the_population_std() -> None:
    """rlray divides by the population std (ddof 0), by hand: G=8 with two rewards of 1 has mean 0.25 and
    variance (2 x 0.75^2 + 6 x 0.25^2) / 8 = 0.1875. verl and TRL divide by the sample std (ddof 1, /7):
    their advantages are sqrt(7/8) of these (rlray's are 1.069x theirs at G=8, 1.41x at G=2). A group of one
    (or all equal) gets 0, with no division by zero."""
    r = np.array([1.0, 1.0, 0, 0, 0, 0, 0, 0])
    adv = group_advantages(r, True, 1e-4)
    np.testing.assert_allclose(adv[[0, 2]], [0.75 / (np.sqrt(0.1875) + 1e-4), -0.25 / (np.sqrt(0.1875) + 1e-4)],
                               rtol=1e-6)
    sample = (r - 0.25) / (np.sqrt(1.5 / 7) + 1e-4)
    assert adv[0] / sample[0] == pytest.approx(np.sqrt(8 / 7), rel=1e-3) == pytest.approx(1.069, abs=1e-3)
    pair = group_advantages(np.array([1.0, 0.0]), True, 0.0)
    assert pair.tolist() == [1.0, -1.0]  # ddof 1 would give +-0.707: 1.41x
    assert group_advantages(np.array([0.7]), True).tolist() == [0.0]
    assert group_advantages(np.array([0.5, 0.5, 0.5]), True).tolist() == [0.0, 0.0, 0.0]


def test_soft_overlong_penalty_by_hand() -> None:
    # L_max 10, L_cache 4: free up to 6 tokens, then -1/4 per token, -1 from 10 on (times the factor)
    got = overlong_penalty(np.array([5, 6, 7, 8, 10, 12]), max_tokens=10, buffer=4, factor=0.5)
    np.testing.assert_allclose(got, [0, 0, -0.125, -0.25, -0.5, -0.5])
    assert not np.any(overlong_penalty(np.array([50]), 10, 0))


def test_overlong_penalty_shapes_rewards_before_advantages() -> None:
    g = Group([rollout(1.0, n=4), rollout(1.0, n=8)])
    cfg = algo_config(std_normalize=False, max_tokens=10, overlong_buffer=4)
    np.testing.assert_allclose(compute_advantages(g, cfg), [0.25, -0.25])  # shaped rewards 1, 0.5
    np.testing.assert_allclose(compute_advantages(g, algo_config(std_normalize=False)), [0, 0])


def test_overlong_filter_masks_truncated_completions() -> None:
    cut, done = rollout(1.0, finish="length"), rollout(1.0)
    assert trains_on(cut, algo_config(overlong_filter=True)) == 0.0
    assert trains_on(done, algo_config(overlong_filter=True)) == 1.0
    assert trains_on(cut, algo_config()) == 1.0

    async def go() -> None:
        buf = BufferActor(algo_config(overlong_filter=True), groups_per_step=1, max_off_policy_steps=0,
                          num_ranks=1, micro_batch_tokens=4096, pad_id=0)
        await buf.put([Group([rollout(1.0, n=3, finish="length"), rollout(0.0, n=2)])])
        mbs = await buf.get_batch(0)  # one rank: its own micro-batches
        assert mbs[0].loss_mask.sum() == 2  # only the finished completion trains
        assert mbs[0].num_loss_tokens_global == 2 and mbs[0].num_sequences_global == 1
        assert (await buf.step_stats(0))["truncated_frac"] == 0.5
    asyncio.run(go())


def test_dynamic_sampling_keeps_sampling_until_the_batch_is_full() -> None:
    """DAPO: all-equal groups are dropped, their tickets return, and get_batch waits for G useful groups."""
    async def go() -> None:
        buf = BufferActor(algo_config(filter_zero_advantage=True), groups_per_step=2, max_off_policy_steps=0,
                          num_ranks=1, micro_batch_tokens=4096, pad_id=0)
        assert await buf.reserve(0, 10) == [0, 1]
        task = asyncio.create_task(buf.get_batch(0))
        await buf.put([Group([rollout(1.0), rollout(1.0)]), Group([rollout(1.0), rollout(0.0)])])
        await asyncio.sleep(0.05)
        assert not task.done()  # one useful group of two
        assert await buf.reserve(0, 10) == [2]  # the dropped group's ticket is granted again, numbered anew
        await buf.put([Group([rollout(0.0), rollout(0.0)])])  # dropped too
        assert await buf.reserve(0, 10) == [3]
        await buf.put([Group([rollout(0.0), rollout(0.5)])])
        mbs = await asyncio.wait_for(task, 1)  # one rank: its own micro-batches
        stats = await buf.step_stats(0)
        assert stats["zero_adv_dropped"] == 2
        assert sum(mb.num_sequences_global for mb in mbs[:1]) == 4
        assert all(np.any(mb.advantages) for mb in mbs)
    asyncio.run(go())


def test_dynamic_sampling_looks_at_raw_rewards_not_shaped_ones() -> None:
    async def go() -> None:
        cfg = algo_config(filter_zero_advantage=True, max_tokens=10, overlong_buffer=4)
        buf = BufferActor(cfg, groups_per_step=1, max_off_policy_steps=0, num_ranks=1,
                          micro_batch_tokens=4096, pad_id=0)
        await buf.put([Group([rollout(1.0, n=4), rollout(1.0, n=9)])])  # all correct: dropped
        assert buf.counts["zero_adv_dropped"] == 1
    asyncio.run(go())
