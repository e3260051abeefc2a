"""The buffer: advantages, the staleness filter, tickets and per-rank packing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rlray.actors.buffer import BufferActor
from rlray.algo.loss import algo_config
from rlray.types import Group, Rollout


def rollout(reward: float, version: int, n: int = 3) -> Rollout:
    return Rollout(prompt_ids=np.array([1, 5, 6]), completion_ids=np.arange(7, 7 + n),
                   logprobs=np.full(n, -0.5, np.float32), loss_mask=np.ones(n, np.int8),
                   versions=np.full(n, version), reward=reward)


def group(version: int, rewards=(1.0, 0.0)) -> Group:
    return Group([rollout(r, version) for r in rewards])


def test_failed_rollouts_stay_out_of_the_group_baseline() -> None:
    """Rewards 1, 0, 0 and a failed rollout (reward 0): the baseline is mean(1, 0, 0) = 1/3 with the std
    of those three, not of four; the failed rollout gets advantage 0. A group left with one valid rollout
    has no baseline: it is dropped and counted, and its ticket comes back."""
    async def go() -> None:
        buf = make(k=0, G=1, ranks=1, std_normalize=True, std_eps=0.0)
        g = group(0, rewards=(1.0, 0.0, 0.0, 0.0))
        g.rollouts[3].error = "EnvError: RuntimeError: boom"
        lone = group(0, rewards=(1.0, 0.0))
        lone.rollouts[1].error = "RewardError: ValueError: bad"
        lone.ticket, g.ticket = 0, 1
        await buf.put([lone, g])
        await buf.get_batch(0)
        std = np.std([1.0, 0.0, 0.0])
        np.testing.assert_allclose(g.advantages, [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, 0.0], rtol=1e-5)
        stats = await buf.step_stats(0)
        assert stats["invalid_groups_dropped"] == 1 and buf.released == 1 and buf.unconsumed == 2
    asyncio.run(go())


def make(k: int = 1, ranks: int = 2, G: int = 2, **algo) -> BufferActor:
    return BufferActor(algo_config(**algo), groups_per_step=G, max_off_policy_steps=k, num_ranks=ranks,
                       micro_batch_tokens=4096, pad_id=0)


def test_stale_group_is_dropped_and_counted() -> None:
    async def go() -> None:
        buf = make(k=1)
        await buf.put([group(0), group(2), group(3)])
        batch = await buf.get_batch(3)  # version 0 is 3 behind step 3 > k=1
        stats = await buf.step_stats(3)
        assert stats["stale_dropped"] == 1
        assert stats["lag_max"] == 1
        assert len(batch) == 2
    asyncio.run(go())


def test_rollout_errors_are_counted_by_kind() -> None:
    async def go() -> None:
        buf = make(k=0, G=2)
        bad = group(0, rewards=(1.0, 0.0, 1.0))
        bad.rollouts[0].error = "ToolTimeout: tool 'calc' ran past env.tool_timeout_s=1.0s"
        worse = group(0, rewards=(1.0, 0.0, 1.0, 0.0))
        worse.rollouts[0].error = "EnvError: RuntimeError: boom"
        worse.rollouts[1].error = "ToolTimeout: tool 'calc' ran past env.tool_timeout_s=1.0s"
        await buf.put([bad, worse])
        await buf.get_batch(0)
        stats = await buf.step_stats(0)
        assert stats["rollout_errors"] == 3
        assert stats["errors/ToolTimeout"] == 2 and stats["errors/EnvError"] == 1
    asyncio.run(go())


def test_multi_turn_stats_per_env() -> None:
    async def go() -> None:
        buf = make(k=0, G=2)
        game, text = group(0, rewards=(1.0, 0.0, 1.0, 0.0)), Group([rollout(1.0, 0, n=5), rollout(0.0, 0)])
        for j, r in enumerate(game.rollouts):
            r.env_id, r.turns = "guess_number", j + 1  # 1, 2, 3, 4 turns
        game.rollouts[3].error = "TokenMismatch: turn 4's prompt does not extend turn 3's"
        for r in text.rollouts:
            r.env_id = "reverse_text"
        await buf.put([game, text])
        await buf.get_batch(0)
        stats = await buf.step_stats(0)
        assert stats["env/guess_number/turns_mean"] == 2.5 and stats["env/reverse_text/turns_mean"] == 1.0
        assert stats["env/guess_number/token_mismatch_frac"] == 0.25 and stats["token_mismatch_frac"] == 1 / 6
        assert stats["env/reverse_text/tokens_mean"] == 4.0 and stats["env/guess_number/tokens_mean"] == 3.0
        assert stats["turns_mean"] == (1 + 2 + 3 + 4 + 1 + 1) / 6
    asyncio.run(go())


def test_get_batch_waits_for_a_full_batch() -> None:
    async def go() -> None:
        buf = make(k=0)
        task = asyncio.create_task(buf.get_batch(0))
        await buf.put([group(0)])
        await asyncio.sleep(0.05)
        assert not task.done()
        await buf.put([group(0)])
        per_rank = await asyncio.wait_for(task, 30)  # the batch is full now: only a hang takes this long
        assert len(per_rank) == 2 and len(per_rank[0]) == len(per_rank[1])
    asyncio.run(go())


def test_tickets_bound_how_far_rollouts_run_ahead() -> None:
    async def go() -> None:
        buf = make(k=2, G=4)
        assert await buf.reserve(0, 100) == list(range(12))  # G * (v + k + 1), numbered in order
        assert await buf.reserve(0, 1) == []
        assert await buf.reserve(1, 10) == [12, 13, 14, 15]
        await buf.cancel([3, 7])
        assert await buf.reserve(1, 10) == [16, 17]
    asyncio.run(go())


def ticketed(version: int, ticket: int) -> Group:
    g = group(version)
    g.ticket = ticket
    return g


def test_a_dead_actors_tickets_come_back_and_only_its_own() -> None:
    async def go() -> None:
        buf = make(k=0, G=4)
        assert await buf.reserve(0, 3, actor=0) == [0, 1, 2]
        assert await buf.reserve(0, 3, actor=1) == [3]
        await buf.put([ticketed(0, 0)], actor=0)
        await buf.cancel([1], actor=0)
        assert await buf.reserve(0, 10, actor=1) == [4]  # the cancelled ticket's place
        assert await buf.forget(0) == 1  # actor 0 still held ticket 2
        assert await buf.forget(0) == 0
        assert await buf.reserve(0, 10, actor=2) == [5]
        await buf.put([ticketed(0, 2)], actor=0)  # a put that was in flight when actor 0 died
        assert await buf.forget(1) == 2 and await buf.reserve(0, 10, actor=2) == [6, 7]
    asyncio.run(go())


def test_batches_take_the_lowest_tickets_and_a_resume_regrants_what_was_not_trained() -> None:
    """Groups arrive out of order; each batch is the lowest tickets queued, in ticket order. The state
    names the lowest ticket not trained on, dropped ones counting as done; a resumed buffer grants from
    there, so the group in flight (ticket 5) and the queued one (4) are produced again for their prompts."""
    async def go() -> None:
        buf = make(k=0, G=2, ranks=1)
        assert await buf.reserve(0, 2) == [0, 1]
        await buf.put([ticketed(0, 1), ticketed(0, 0)])
        await buf.get_batch(0)
        assert await buf.reserve(1, 4) == [2, 3]
        dropped = Group([rollout(1.0, 1), rollout(0.0, 1)], ticket=2)
        dropped.rollouts[0].error = "EnvError: boom"
        await buf.put([ticketed(1, 3), dropped])
        assert await buf.reserve(1, 4) == [4]  # ticket 2's group was dropped: one more
        await buf.put([ticketed(1, 4)])
        mbs = await buf.get_batch(1)
        assert [g.ticket for g in buf.queue] == [] and sum(int(mb.segment_ids.max()) + 1 for mb in mbs) == 4
        assert await buf.reserve(2, 4) == [5, 6]
        await buf.put([ticketed(2, 6)])
        state = await buf.state()
        assert state["unconsumed"] == 5
        resumed = make(k=0, G=2, ranks=1)
        await resumed.load_state({**state, "step": 2})
        assert await resumed.reserve(2, 4) == [5, 6]
    asyncio.run(go())


def test_zero_advantage_groups_are_filtered_when_asked() -> None:
    async def go() -> None:
        buf = make(k=0, G=1, filter_zero_advantage=True)
        await buf.put([group(0, (0.5, 0.5)), group(0, (1.0, 0.0))])
        await buf.get_batch(0)
        stats = await buf.step_stats(0)
        assert stats["zero_adv_dropped"] == 1
        assert stats["reward_mean"] == pytest.approx(0.5)
        assert len(await buf.reserve(0, 10)) == 2  # G*(0+0+1) + 1 released - 0 issued
    asyncio.run(go())


def test_packed_batch_carries_advantages_and_global_token_count() -> None:
    async def go() -> None:
        buf = make(k=0, G=1, ranks=2, std_normalize=False)
        await buf.put([group(0, (1.0, 0.0))])
        per_rank = await buf.get_batch(0)
        advs = sorted(float(mb.advantages[mb.loss_mask > 0].mean()) for mbs in per_rank for mb in mbs)
        assert advs == [-0.5, 0.5]
        for mbs in per_rank:
            for mb in mbs:
                assert mb.num_loss_tokens_global == 6.0
                assert mb.loss_mask[0, :3].sum() == 0  # prompt tokens are not trained
    asyncio.run(go())


def test_token_lags_reach_the_trainer_and_split_the_mismatch() -> None:
    """A batch at step 2 of groups sampled at versions 2 and 1: lags 0 and 1 per token; the trainer's
    mismatch_kl covers the lag-0 tokens only and stale_kl the others, each per token of its kind."""
    import math

    import torch

    from rlray.actors.learner import Learner

    async def go() -> list:
        buf = make(k=1, ranks=1, G=2)
        await buf.put([group(2), group(1)])
        return await buf.get_batch(2)
    mbs = asyncio.run(go())
    lags = np.concatenate([mb.lag[mb.loss_mask > 0] for mb in mbs])
    assert sorted(set(lags.tolist())) == [0, 1] and (lags == 0).sum() == (lags == 1).sum() == 6
    mask = torch.ones(1, 4)
    t = {"loss_mask": mask, "stale": torch.tensor([[0.0, 0.0, 1.0, 1.0]])}
    mu = torch.zeros(1, 4)
    logp = torch.tensor([[0.1, 0.1, 0.5, 0.5]])
    sums: dict = {}
    Learner._split_mismatch(sums, logp, mu, t)
    def k3(d: float) -> float:
        return math.exp(d) - d - 1
    assert sums["_mismatch_kl"] == pytest.approx(2 * k3(0.1)) and sums["_mismatch_kl_tokens"] == 2
    assert sums["_stale_kl"] == pytest.approx(2 * k3(0.5)) and sums["_stale_kl_tokens"] == 2
