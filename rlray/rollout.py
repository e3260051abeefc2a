"""RolloutActor: a vLLM engine plus the env runner. A plain class; cluster.py makes it a Ray actor.

Contract:
- `start()` builds the engine (one vLLM adapter: rlray.engine.Engine).
- `run(buffer)` loops until `stop()`: reserves group tickets from the buffer (which
  bounds how far ahead of the trainer rollouts may run), generates `group_size`
  completions per prompt, scores them with the environment and `put`s each Group,
  every token tagged with the policy version that produced it. `buffer` is any
  object whose `reserve`/`put` return awaitables (the BufferActor itself in tests,
  its Ray handle through cluster.py's adapter in a run).
- `init_weight_group(...)` joins the weight broadcast group; `update_weights(version)`
  pauses generation (in-flight requests are kept), loads the broadcast weights,
  clears the prefix cache and resumes with the new version.
- `evaluate(split, n, temperature)` returns the mean reward over the first n examples.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from rlray.config import EnvConfig, ModelConfig, RolloutConfig
from rlray.data.tokenizer import encode_prompt
from rlray.envs import load_env
from rlray.envs.base import Example
from rlray.models.tiny import model_path
from rlray.types import Group, Rollout


class RolloutActor:
    def __init__(self, index: int, num_actors: int, model: ModelConfig, rollout: RolloutConfig,
                 env: EnvConfig, seed: int) -> None:
        self.index, self.num_actors = index, num_actors
        self.model_cfg, self.cfg, self.env_cfg, self.seed = model, rollout, env, seed
        self.version = 0
        self._stop = asyncio.Event()
        self._next_example = index
        self.last_error: str | None = None
        self.stats = {"groups": 0, "completion_tokens": 0, "errors": 0, "gen_seconds": 0.0}

    async def start(self) -> dict[str, Any]:
        from transformers import AutoTokenizer

        from rlray.engine import Engine

        path = model_path(self.model_cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.env = load_env(self.env_cfg.id, self.env_cfg.args)
        self.engine = await Engine.create(path, max_model_len=self.cfg.max_model_len, seed=self.seed + self.index,
                                          kv_cache_fraction=self.cfg.kv_cache_fraction,
                                          engine_kwargs=self._engine_kwargs())
        return {"index": self.index, "model": path}

    def _engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"dtype": self.cfg.dtype, "enforce_eager": self.cfg.enforce_eager}
        if self.cfg.kv_cache_gb > 0:
            kwargs["kv_cache_memory_bytes"] = int(self.cfg.kv_cache_gb * 2**30)
        return {**kwargs, **self.cfg.engine_kwargs}

    async def _group(self, ex: Example, n: int, temperature: float) -> Group:
        prompt = encode_prompt(self.tokenizer, ex.prompt)
        samples = await self.engine.generate(prompt, n=n, temperature=temperature, max_tokens=self.cfg.max_tokens,
                                             version=lambda: self.version)
        rollouts = [self._rollout(ex, prompt, s) for s in samples]
        return Group(rollouts)

    def _rollout(self, ex: Example, prompt: list[int], s: Any) -> Rollout:
        text = self.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
        error = None
        try:
            reward, parts = self.env.score(text, ex)
        except Exception as e:  # a broken reward function costs this rollout, not the run
            reward, parts, error = 0.0, {}, f"{type(e).__name__}: {e}"
        n = len(s.completion_ids)
        return Rollout(
            prompt_ids=np.asarray(prompt, dtype=np.int64),
            completion_ids=np.asarray(s.completion_ids, dtype=np.int64),
            logprobs=np.asarray(s.logprobs, dtype=np.float32),
            loss_mask=np.ones(n, dtype=np.int8),
            versions=np.asarray(s.versions, dtype=np.int64),
            reward=float(reward), reward_parts=parts, env_id=self.env_cfg.id, example_id=ex.index,
            finish_reason=s.finish_reason, error=error, text=text,
        )

    async def _produce(self, buffer: Any, ex: Example, slots: asyncio.Semaphore) -> None:
        try:
            t0 = time.perf_counter()
            group = await self._group(ex, self.cfg.group_size, self.cfg.temperature)
            self.stats["gen_seconds"] += time.perf_counter() - t0
            self.stats["groups"] += 1
            self.stats["completion_tokens"] += sum(len(r.completion_ids) for r in group.rollouts)
            await buffer.put([group])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the ticket goes back so the trainer is not starved
            self.stats["errors"] += 1
            self.last_error = f"{type(e).__name__}: {e}"
            await buffer.cancel(1)
        finally:
            slots.release()

    async def run(self, buffer: Any) -> dict[str, Any]:
        slots = asyncio.Semaphore(self.cfg.max_concurrent_groups)
        tasks: set[asyncio.Task] = set()
        while not self._stop.is_set():
            await slots.acquire()
            granted = await buffer.reserve(self.version, 1)
            if not granted:
                slots.release()
                await asyncio.sleep(0.02)
                continue
            ex = self.env.example("train", self._next_example)
            self._next_example += self.num_actors
            task = asyncio.create_task(self._produce(buffer, ex, slots))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for t in list(tasks):
            t.cancel()
        return dict(self.stats)

    async def stop(self) -> None:
        self._stop.set()

    async def init_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str,
                                timeout_s: float, plan: list) -> None:
        await self.engine.init_weight_group(host, port, rank, world_size, backend, timeout_s, plan)

    async def update_weights(self, version: int) -> dict[str, float]:
        seconds = await self.engine.update_weights(on_loaded=lambda: setattr(self, "version", version))
        return {"load_seconds": seconds}

    async def evaluate(self, split: str, n: int, temperature: float = 0.0) -> dict[str, Any]:
        examples = [self.env.example(split, i) for i in range(self.index, n, self.num_actors)]
        groups = await asyncio.gather(*(self._group(ex, 1, temperature) for ex in examples))
        rollouts = [g.rollouts[0] for g in groups]
        return {"rewards": [r.reward for r in rollouts],
                "samples": [{"example": r.example_id, "completion": r.text, "reward": r.reward} for r in rollouts]}

    async def score(self, token_ids: list[int], start: int) -> list[float]:
        return await self.engine.score(token_ids, start)

    async def shutdown(self) -> None:
        await self.engine.shutdown()
