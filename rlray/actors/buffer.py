"""BufferActor: groups in, per-rank micro-batches out, with a bounded staleness.

Contract:
- `reserve(version, want, actor)` grants rollout actor `actor` up to `want` group tickets,
  numbered 0, 1, 2, ...: ticket n names the prompt of its group (`EnvRunner.train_row`), so the
  prompt stream is a function of the ticket numbers.
  With G groups per step and bound k = max_off_policy_steps, a rollout at policy version v
  may have started at most G*(v+k+1) groups in all, plus one for every group that
  was dropped; so rollouts never run further ahead than the trainer can use.
- `put(groups, actor)` computes per-group advantages over each group's valid rollouts,
  drops (counts, returns the ticket of) groups with fewer than 2 valid rollouts and
  zero-advantage groups when `filter_zero_advantage` is on, and queues the rest.
  `cancel(tickets, actor)` returns tickets of groups that were not produced; `forget(actor)`
  returns every ticket a dead actor still held.
- A rollout sampled under biasing args (`Rollout.biased`) goes to the trainer with NaN
  inference logprobs: mu unknown, the trainer takes its own batch-start policy instead.
- On-policy distillation (`algo.loss=opd`, teachers given by `set_teachers(teachers)`: objects whose
  `score(sequences)` returns an awaitable of `TeacherActor.score`'s result): a group
  that arrives is sent whole to a teacher (round robin) to be scored (`TeacherActor.score` of each
  valid rollout's prompt + completion) while the buffer serves other calls; it is queued once
  scored, with per-token advantages (rlray.algo.advantages.opd_advantages). A group whose scoring
  fails (a teacher died: the pool replaces it and calls `set_teachers` again) is dropped and
  counted (`teacher_failed_groups`). `step_stats` adds `teacher_kl`, `teacher_seconds` (the mean time
  one group's scoring took since the last batch) and `teacher_tokens_per_s` (tokens scored per wall second since
  the last batch).
- `get_batch(step)` waits until G fresh groups are queued, drops (and counts) groups
  older than `step - k`, takes the G with the lowest tickets, and returns one list of packed
  micro-batches per trainer rank (with one rank, that rank's list itself: what Ray's
  `num_returns=1` hands the trainer).
  With `algo.mini_batches` = M, the batch's sequences are cut into M consecutive equal
  shares, each packed on its own and labelled `MicroBatch.mini_batch` (one optimizer step each).
- `queued(step)` is how many queued groups `get_batch(step)` could use now (of G).
- `step_stats(step)` returns the rewards, lags and drop counts of that batch, the rollout
  errors so far, in all and by kind (`errors/<Kind>`), and `rollout_tokens_per_s`: completion
  tokens the rollout actors delivered (kept or dropped) per wall second since the last batch;
  `turns_mean` and `token_mismatch_frac` (rollouts flagged TokenMismatch) of the batch, and
  per environment `env/<id>/turns_mean`, `env/<id>/tokens_mean` (completion tokens, environment
  tokens included) and `env/<id>/token_mismatch_frac`.
- `state()` / `load_state()` round-trip the counters and the lowest ticket not trained on:
  a resumed run grants tickets from there, so the groups in flight at the checkpoint are
  generated again for the same prompts (with `async.max_off_policy_steps=0` and no dropped
  groups, every step trains on the same prompts as an uninterrupted run).
Methods are coroutines so one actor serves puts while a get_batch waits.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import numpy as np

from rlray.algo.advantages import compute_advantages, opd_advantages, teacher_kl, trains_on, valid
from rlray.config import AlgoConfig
from rlray.data.packing import Sample, pack
from rlray.envs.instrument import error_kind
from rlray.types import Group, MicroBatch


class BufferActor:
    def __init__(
        self,
        algo: AlgoConfig,
        groups_per_step: int,
        max_off_policy_steps: int,
        num_ranks: int,
        micro_batch_tokens: int,
        pad_id: int,
        packed: bool = True,
        cp: int = 1,
    ) -> None:
        self.algo = algo
        self.G, self.k = groups_per_step, max_off_policy_steps
        self.num_ranks, self.micro_batch_tokens, self.pad_id = num_ranks, micro_batch_tokens, pad_id
        self.packed, self.cp = packed, cp  # the trainer's layout: sequences packed per row, context-parallel degree
        self.queue: deque[Group] = deque()
        self.issued = 0
        self.released = 0
        self.next_ticket = 0  # the number of the next ticket granted: it names the group's prompt
        self.consumed: set[int] = set()  # tickets trained on, at or above `unconsumed`
        self.unconsumed = 0  # the lowest ticket not trained on yet: a resume starts granting here
        self.held: dict[int, set[int]] = {}  # tickets granted to each rollout actor, not yet put or cancelled
        self.counts = {"stale_dropped": 0, "zero_adv_dropped": 0, "invalid_groups_dropped": 0, "groups_in": 0,
                       "biased_rollouts": 0, "rollout_errors": 0}
        self.teachers: list[Any] = []  # algo.loss=opd: the teacher actors (set_teachers)
        self._turn = 0  # the next teacher to score a group
        self._scoring: set[asyncio.Task] = set()
        self.teacher_error: str | None = None  # the last scoring failure, one line
        self._scored = {"tokens": 0, "seconds": 0.0, "groups": 0}  # since the last batch
        self._stats: dict[int, dict[str, Any]] = {}
        self.generated_tokens = 0  # completion tokens of every group put, dropped ones too
        self._rate_mark: tuple[float, int] | None = None  # (time, generated_tokens) at the last batch
        self._ready = asyncio.Condition()

    async def reserve(self, version: int, want: int, actor: int = 0) -> list[int]:
        """Up to `want` ticket numbers; each names the prompt of the group it is produced for."""
        allowed = self.G * (version + self.k + 1) + self.released - self.issued
        granted = list(range(self.next_ticket, self.next_ticket + max(0, min(want, allowed))))
        self.issued += len(granted)
        self.next_ticket += len(granted)
        self.held.setdefault(actor, set()).update(granted)
        return granted

    def _settle(self, actor: int, tickets: list[int]) -> None:
        self.held.get(actor, set()).difference_update(tickets)

    async def cancel(self, tickets: list[int], actor: int = 0) -> None:
        """Return tickets of groups that a rollout actor failed to produce."""
        self._settle(actor, tickets)
        self.released += len(tickets)

    async def forget(self, actor: int) -> int:
        """Return the tickets a dead rollout actor held; its replacement starts with none."""
        lost = len(self.held.pop(actor, set()))
        self.released += lost
        return lost

    async def put(self, groups: list[Group], actor: int = 0) -> None:
        self._settle(actor, [g.ticket for g in groups])
        async with self._ready:
            for g in groups:
                self.counts["groups_in"] += 1
                self.generated_tokens += sum(len(r.completion_ids) for r in g.rollouts)
                if self._rate_mark is None:
                    self._rate_mark = (time.monotonic(), 0)
                self.counts["biased_rollouts"] += sum(r.biased for r in g.rollouts)
                for r in g.rollouts:
                    if r.error is not None:
                        self.counts["rollout_errors"] += 1
                        kind = f"errors/{error_kind(r.error)}"
                        self.counts[kind] = self.counts.get(kind, 0) + 1
                if valid(g).sum() < 2:  # no baseline to compare with
                    self._drop(g, "invalid_groups_dropped")
                elif self.teachers:
                    task = asyncio.create_task(self._score(g))
                    self._scoring.add(task)
                    task.add_done_callback(self._scoring.discard)
                else:
                    self._admit(g)
            self._ready.notify_all()

    def _admit(self, g: Group) -> None:
        """The group's advantages; queued unless DAPO's dynamic sampling drops it."""
        if self.algo.loss == "opd":
            g.advantages = opd_advantages(g, self.algo)
        else:
            g.advantages = compute_advantages(g, self.algo)  # with DAPO's overlong penalty if set
        if self.algo.filter_zero_advantage and np.ptp(g.rewards[valid(g)]) == 0:  # DAPO: on raw rewards
            self._drop(g, "zero_adv_dropped")
            return
        self.queue.append(g)

    async def set_teachers(self, teachers: list[Any]) -> None:
        self.teachers = list(teachers)

    async def _score(self, g: Group) -> None:
        """The group's valid rollouts scored by the next teacher, then admitted; dropped when scoring fails."""
        teacher = self.teachers[self._turn % len(self.teachers)]
        self._turn += 1
        ok = [r for r in g.rollouts if r.error is None]
        sequences = [(np.concatenate([r.prompt_ids, r.completion_ids]), len(r.prompt_ids)) for r in ok]
        t0 = time.perf_counter()
        try:
            scores = await teacher.score(sequences)
        except Exception as e:  # noqa: BLE001 - any failure costs the group only: a dead teacher, its engine
            self.teacher_error = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            async with self._ready:
                self._drop(g, "teacher_failed_groups")
            return
        self._scored["seconds"] += time.perf_counter() - t0
        self._scored["tokens"] += sum(len(s) for s in scores)
        self._scored["groups"] += 1
        for r, s in zip(ok, scores):
            r.teacher_logprobs = s
        async with self._ready:
            self._admit(g)
            self._ready.notify_all()

    def _drop(self, g: Group, counter: str) -> None:
        """A group that will not be trained on: counted, its ticket granted again, its prompt done."""
        self.counts[counter] = self.counts.get(counter, 0) + 1
        self.released += 1
        self._consume([g.ticket])

    def _drop_stale(self, step: int) -> None:
        fresh = [g for g in self.queue if step - g.version <= self.k]
        for g in self.queue:
            if step - g.version > self.k:
                self._drop(g, "stale_dropped")
        self.queue = deque(fresh)

    async def get_batch(self, step: int) -> list[list[MicroBatch]] | list[MicroBatch]:
        async with self._ready:
            while True:
                self._drop_stale(step)
                if len(self.queue) >= self.G:
                    break
                await self._ready.wait()
            ordered = sorted(self.queue, key=lambda g: g.ticket)  # the lowest tickets first: resumable
            groups, self.queue = ordered[:self.G], deque(ordered[self.G:])
            self._consume([g.ticket for g in groups])
        self._stats[step] = self._batch_stats(step, groups)
        per_rank = self._pack(self._samples(groups, step))
        return per_rank if self.num_ranks > 1 else per_rank[0]

    def _pack(self, samples: list[Sample]) -> list[list[MicroBatch]]:
        """Each of `algo.mini_batches` equal, consecutive shares of the samples packed on its own
        (its own global normalisers), labelled with its index; per rank, in order."""
        m = self.algo.mini_batches
        size = len(samples) // m
        per_rank: list[list[MicroBatch]] = [[] for _ in range(self.num_ranks)]
        for i in range(m):
            share = samples[i * size:(i + 1) * size] if i < m - 1 else samples[i * size:]
            for rank, mbs in enumerate(pack(share, self.num_ranks, self.micro_batch_tokens, self.pad_id,
                                              self.packed, self.cp)):
                for mb in mbs:
                    mb.mini_batch = i
                per_rank[rank].extend(mbs)
        return per_rank

    def _samples(self, groups: list[Group], step: int) -> list[Sample]:
        return [
            Sample(r.prompt_ids, r.completion_ids, r.loss_mask.astype(np.float32) * trains_on(r, self.algo),
                   a if np.ndim(a) else float(a), np.full_like(r.logprobs, np.nan) if r.biased else r.logprobs, step - r.versions,
                   r.routing, r.images)
            for g in groups
            for r, a in zip(g.rollouts, g.advantages)
        ]

    def _batch_stats(self, step: int, groups: list[Group]) -> dict[str, Any]:
        rewards = np.concatenate([g.rewards for g in groups])
        lags = np.array([step - g.version for g in groups])
        tokens = sum(len(r.completion_ids) for g in groups for r in g.rollouts)
        now = time.monotonic()
        since, generated = self._rate_mark or (now, self.generated_tokens)
        self._rate_mark = (now, self.generated_tokens)
        return {
            "rollout_tokens_per_s": (self.generated_tokens - generated) / max(now - since, 1e-9),
            "prompts": [f"{g.rollouts[0].env_id}:{g.rollouts[0].example_id}" for g in groups],  # in ticket order
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "lag_mean": float(lags.mean()),
            "lag_max": int(lags.max()),
            "completion_tokens": int(tokens),
            "completion_len_mean": tokens / max(1, len(rewards)),
            "truncated_frac": sum(r.finish_reason == "length" for g in groups for r in g.rollouts)
            / max(1, len(rewards)),
            **_env_stats([r for g in groups for r in g.rollouts]),
            **self._teacher_stats(groups, now - since),
            **self.counts,
            "queued": len(self.queue),
        }

    def _teacher_stats(self, groups: list[Group], seconds: float) -> dict[str, float]:
        if not self.teachers:
            return {}
        scored, self._scored = self._scored, {"tokens": 0, "seconds": 0.0, "groups": 0}
        kl = teacher_kl([r for g in groups for r in g.rollouts])
        return {**({"teacher_kl": kl} if kl is not None else {}),
                "teacher_seconds": scored["seconds"] / max(scored["groups"], 1),
                "teacher_tokens_per_s": scored["tokens"] / max(seconds, 1e-9),
                "teacher_failed_groups": self.counts.get("teacher_failed_groups", 0)}

    async def teacher_state(self) -> dict[str, Any]:
        """Groups being scored now, and the last scoring failure."""
        return {"scoring": len(self._scoring), "last_error": self.teacher_error}

    async def queued(self, step: int) -> int:
        return sum(step - g.version <= self.k for g in self.queue)

    def _consume(self, tickets: list[int]) -> None:
        self.consumed.update(tickets)
        while self.unconsumed in self.consumed:
            self.consumed.discard(self.unconsumed)
            self.unconsumed += 1

    async def step_stats(self, step: int) -> dict[str, Any]:
        return self._stats.pop(step, {})

    async def state(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "unconsumed": self.unconsumed}

    async def load_state(self, state: dict[str, Any]) -> None:
        """Counters from `state()`; tickets restart as if steps before `state["step"]` were consumed,
        numbered from the lowest ticket not trained on, so groups in flight get their prompts again."""
        self.counts.update(state["counts"])
        self.issued, self.released, self.held = self.G * state.get("step", 0), 0, {}
        self.next_ticket = self.unconsumed = state.get("unconsumed", self.G * state.get("step", 0))
        self.consumed = set()


def _env_stats(rollouts: list) -> dict[str, float]:
    def summary(rs: list, prefix: str) -> dict[str, float]:
        n = max(1, len(rs))
        return {f"{prefix}turns_mean": sum(r.turns for r in rs) / n,
                f"{prefix}token_mismatch_frac": sum(error_kind(r.error) == "TokenMismatch" for r in rs) / n}

    out = summary(rollouts, "")
    for env_id in sorted({r.env_id for r in rollouts}):
        rs = [r for r in rollouts if r.env_id == env_id]
        out.update(summary(rs, f"env/{env_id}/"))
        out[f"env/{env_id}/tokens_mean"] = sum(len(r.completion_ids) for r in rs) / len(rs)
    return out
