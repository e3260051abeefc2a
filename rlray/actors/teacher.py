"""TeacherActor: a vLLM engine that only scores, on-policy distillation's teacher. A plain class;
cluster.py makes it a Ray actor.

Contract:
- `start()` builds the engine of `teacher.name` (rlray.actors.engine.Engine) with the teacher
  section's engine settings and no weight-transfer engine: the teacher is frozen.
- `score(sequences)`: for each `(token_ids, start)`, the teacher's temperature-1 logprob of
  `token_ids[i]` given `token_ids[:i]` for every i >= start, as float32 [len - start] (vLLM prompt
  logprobs of the ids as given: the student's chat template and its completion, nothing
  re-rendered). The sequences are scored concurrently (vLLM batches them). A dead engine raises
  `EngineFailed`.
- `watch(poll_s)` returns one line once the engine has died (the pool's health check; a dead
  process fails the call instead).
- `stats()`: sequences and tokens scored, seconds spent scoring, the engine's failure (or None).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np

from rlray.actors.rollout import EngineFailed, cpu_binding
from rlray.config import TeacherConfig


class TeacherActor:
    def __init__(self, index: int, cfg: TeacherConfig, seed: int = 0) -> None:
        self.index, self.cfg, self.seed = index, cfg, seed
        self.stats_ = {"sequences": 0, "tokens": 0, "seconds": 0.0}

    async def start(self) -> dict[str, Any]:
        from rlray.actors.engine import Engine

        c = self.cfg
        if c.gpus_per_actor == 0 and c.tensor_parallel_size > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(c.tensor_parallel_size))
        # one more position than the longest student sequence: vLLM keeps room for the token it generates
        self.engine = await Engine.create(c.name, max_model_len=c.max_model_len + 1, seed=self.seed + self.index,
                                          kv_cache_fraction=c.kv_cache_fraction, weights_backend=None,
                                          engine_kwargs=self._engine_kwargs())
        return {"index": self.index, "model": c.name}

    def _engine_kwargs(self) -> dict[str, Any]:
        c = self.cfg
        kwargs: dict[str, Any] = {"dtype": c.dtype, "enforce_eager": c.enforce_eager,
                                  "tensor_parallel_size": c.tensor_parallel_size}
        if c.tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "mp"
        if c.kv_cache_gb:
            kwargs["kv_cache_memory_bytes"] = int(c.kv_cache_gb * 2**30)
        return {**kwargs, **c.engine_kwargs}

    def _failure(self) -> str | None:
        death = self.engine.death()
        return None if death is None else f"teacher-{self.index}'s vLLM engine died ({death})"

    async def score(self, sequences: list[tuple[np.ndarray, int]]) -> list[np.ndarray]:
        if (failure := self._failure()) is not None:
            raise EngineFailed(failure)
        t0 = time.perf_counter()
        try:
            scores = await asyncio.gather(*(self.engine.score([int(t) for t in ids], int(start))
                                            for ids, start in sequences))
        except Exception as e:
            if (failure := self._failure()) is not None:
                raise EngineFailed(failure) from e
            raise
        self.stats_["sequences"] += len(sequences)
        self.stats_["tokens"] += sum(len(s) for s in scores)
        self.stats_["seconds"] += time.perf_counter() - t0
        return [np.asarray(s, np.float32) for s in scores]

    async def watch(self, poll_s: float = 1.0) -> str:
        while (failure := self._failure()) is None:
            await asyncio.sleep(poll_s)
        return failure

    async def stats(self) -> dict[str, Any]:
        return {**self.stats_, "failure": self._failure()}

    async def shutdown(self) -> None:
        await self.engine.shutdown()
