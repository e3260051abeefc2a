"""The rollout loop ends with EngineFailed once its engine can serve no more (dead, or
`rollout.max_failed_groups` failed groups in a row) and never puts a dead engine's groups;
occasional failed groups only cost their tickets. In-process, with a fake engine and runner."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from rlray.actors.rollout import EngineFailed, RolloutActor
from rlray.config import Config, ConfigError, EnvConfig, ModelConfig, RolloutConfig, validate


class FakeEngine:
    def __init__(self) -> None:
        self.dead: str | None = None

    def death(self) -> str | None:
        return self.dead


class FakeRunner:
    """Group i fails when `fails(i)`; `kill_at` kills the engine while group `kill_at` runs."""

    def __init__(self, engine: FakeEngine, fails: Callable[[int], bool] = lambda i: False,
                 kill_at: int = -1) -> None:
        self.engine, self.fails, self.kill_at = engine, fails, kill_at
        self.calls = 0
        self.counts: dict[str, int] = {}

    def next_train(self) -> tuple[None, dict]:
        return None, {}

    def train_row(self, ticket: int) -> tuple[None, dict]:
        return None, {}

    def group_seed(self, ticket: int) -> int:
        return ticket

    async def group(self, env: None, row: dict, n: int, temperature: float, max_tokens: int,
                    seed: int | None = None) -> list:
        i, self.calls = self.calls, self.calls + 1
        await asyncio.sleep(0)
        if i == self.kill_at:
            self.engine.dead = "EngineDeadError: gone"  # over HTTP its rollouts come back as errors
        if self.fails(i):
            raise ValueError(f"group {i} failed")
        return [SimpleNamespace(completion_ids=[1, 2], error=None)] * n


class FakeBuffer:
    """Grants `tickets` tickets, then none; stops the actor after `stop_after` puts. Tickets are
    granted as a list of numbers and taken back by count or by list."""

    def __init__(self, actor: RolloutActor, tickets: int = 1000, stop_after: int = 1000) -> None:
        self.actor, self.tickets, self.stop_after = actor, tickets, stop_after
        self.issued = self.puts = self.cancels = 0

    async def reserve(self, version: int, want: int) -> list[int]:
        granted = min(want, self.tickets - self.issued)
        self.issued += granted
        return list(range(self.issued - granted, self.issued))

    async def put(self, groups: list) -> None:
        self.puts += len(groups)
        if self.puts >= self.stop_after:
            await self.actor.stop()

    async def cancel(self, tickets: int | list[int]) -> None:
        self.cancels += tickets if isinstance(tickets, int) else len(tickets)


def actor(**runner: object) -> tuple[RolloutActor, FakeEngine]:
    a = RolloutActor(0, 1, ModelConfig(), RolloutConfig(max_concurrent_groups=1, max_failed_groups=3),
                     EnvConfig(), seed=0)
    a.engine = FakeEngine()  # type: ignore[assignment]
    a.runner = FakeRunner(a.engine, **runner)  # type: ignore[arg-type, assignment]
    return a, a.engine  # type: ignore[return-value]


def test_consecutive_failed_groups_end_the_loop() -> None:
    a, _ = actor(fails=lambda i: i >= 2)
    buf = FakeBuffer(a)
    with pytest.raises(EngineFailed) as caught:
        asyncio.run(a.run(buf))
    assert str(caught.value) == ("its vLLM engine failed 3 groups in a row (rollout.max_failed_groups=3; "
                                 "last: ValueError: group 4 failed)")
    assert buf.puts == 2 and buf.cancels == 3


def test_occasional_failed_groups_only_cost_their_tickets() -> None:
    a, _ = actor(fails=lambda i: i % 3 == 1)  # two good groups, one failed, ...
    buf = FakeBuffer(a, stop_after=6)
    stats = asyncio.run(a.run(buf))
    assert buf.puts == 6 and buf.cancels == 3
    assert stats["failure"] is None and stats["last_error"] == "ValueError: group 7 failed"


def test_an_engine_dying_under_a_group_ends_the_loop_without_putting_it() -> None:
    a, _ = actor(kill_at=1)
    buf = FakeBuffer(a)
    with pytest.raises(EngineFailed, match=r"^its vLLM engine died \(EngineDeadError: gone\)$"):
        asyncio.run(a.run(buf))
    assert buf.puts == 1 and buf.cancels == 1


def test_an_idle_engine_dying_ends_the_loop() -> None:
    a, engine = actor()
    buf = FakeBuffer(a, tickets=0)  # the trainer is behind: no group may start

    async def go() -> None:
        loop = asyncio.create_task(a.run(buf))
        await asyncio.sleep(0.05)
        assert not loop.done()
        engine.dead = "EngineDeadError: gone"
        await asyncio.wait_for(loop, 5)

    with pytest.raises(EngineFailed, match="its vLLM engine died"):
        asyncio.run(go())


@pytest.mark.parametrize("section, key, value", [("rollout", "max_failed_groups", 0), ("rl", "batch_timeout_s", 0.0)])
def test_limits_must_be_positive(section: str, key: str, value: float) -> None:
    c = Config()
    setattr(getattr(c, section), key, value)
    with pytest.raises(ConfigError, match=f"{section}.{key}={value} must be"):
        validate(c)


def test_a_stop_that_arrives_before_its_run_still_ends_that_loop() -> None:
    """Ray does not order calls on an async actor: the fleet's stop(n) may run before its run(buffer, n) (a run
    resumed at its last step starts and stops its loops at once). That loop ends at once; a later loop runs."""
    a, _ = actor()
    buf = FakeBuffer(a, stop_after=3)

    async def go() -> None:
        await a.stop(1)
        await asyncio.wait_for(a.run(buf, 1), 5)
        assert buf.puts == 0
        await asyncio.wait_for(a.run(buf, 2), 5)  # the next loop (a trainer group re-created) runs until stopped
        assert buf.puts == 3

    asyncio.run(go())
