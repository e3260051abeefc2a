"""RolloutActor: a vLLM engine, its OpenAI-compatible endpoint and the env runner. A plain class;
cluster.py makes it a Ray actor.

Contract:
- `start()` builds the engine (one vLLM adapter: rlray.engine.Engine), serves it through vLLM's
  own OpenAI server on `env.server_host` (rlray.server; `endpoint()` returns its base URL) and
  loads the environments of `env` (id or weighted mix, rlray.envs) into an `EnvRunner`.
- `run(buffer)` loops until `stop()`: reserves group tickets from the buffer (which
  bounds how far ahead of the trainer rollouts may run), draws an environment and its next
  row, runs `group_size` rollouts of it (verifiers over HTTP, or the direct fast path for
  plain single-turn envs) and `put`s each Group, every token tagged with the policy version
  that produced it. `buffer` is any object whose `reserve`/`put`/`cancel` return awaitables
  (the BufferActor itself in tests, its Ray handle through cluster.py's adapter in a run).
  A failing rollout is a rollout with reward 0 and an error (rlray.envs.runner); only a
  failing engine costs the group (its ticket goes back).
- `init_weight_group(...)` joins the weight broadcast group, `close_weight_group()` leaves
  it (the group is re-formed when a rollout actor is replaced); `update_weights(version)`
  pauses generation (in-flight requests are kept), loads the broadcast weights, labels them
  with `version`, clears the prefix cache and resumes with the new version.
- `evaluate(num_examples, num_samples, temperature, max_tokens)` runs this actor's share
  (examples i, i+A, ... of each environment's eval split) and returns per-example records.
- `stats()` returns counters: groups, tokens, rollouts by path, errors by kind.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from rlray.config import EnvConfig, ModelConfig, RolloutConfig
from rlray.envs import load_envs
from rlray.envs.base import Env
from rlray.models.tiny import model_path
from rlray.types import Group


def resolve_chat_template(cfg: EnvConfig, tokenizer: Any) -> str:
    from rlray.server import PLAIN_CHAT_TEMPLATE

    template = cfg.chat_template
    if template and os.path.exists(template):
        with open(template) as f:
            return f.read()
    return template or getattr(tokenizer, "chat_template", None) or PLAIN_CHAT_TEMPLATE


class RolloutActor:
    def __init__(self, index: int, num_actors: int, model: ModelConfig, rollout: RolloutConfig,
                 env: EnvConfig, seed: int) -> None:
        self.index, self.num_actors = index, num_actors
        self.model_cfg, self.cfg, self.env_cfg, self.seed = model, rollout, env, seed
        self.version = 0
        self._stop = asyncio.Event()
        self.last_error: str | None = None
        self.stats_ = {"groups": 0, "completion_tokens": 0, "errors": 0, "gen_seconds": 0.0}

    async def start(self) -> dict[str, Any]:
        from transformers import AutoTokenizer

        from rlray.engine import Engine
        from rlray.envs.runner import EnvRunner, make_clients
        from rlray.server import PLAIN_CHAT_TEMPLATE, OpenAIServer

        path = model_path(self.model_cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        envs = load_envs(self.env_cfg)
        self.engine = await Engine.create(path, max_model_len=self.cfg.max_model_len, seed=self.seed + self.index,
                                          kv_cache_fraction=self.cfg.kv_cache_fraction,
                                          engine_kwargs=self._engine_kwargs())
        template = resolve_chat_template(self.env_cfg, self.tokenizer)
        parser = self.env_cfg.tool_call_parser
        if parser == "auto":
            parser = "rlray" if template == PLAIN_CHAT_TEMPLATE else None
        self.server = await OpenAIServer.start(self.engine, host=self.env_cfg.server_host,
                                               port=self.env_cfg.server_port, chat_template=template,
                                               tool_call_parser=parser or None)
        self.clients = make_clients(self.server.url, self.env_cfg.rollout_timeout_s)
        self.runner = EnvRunner(envs, self.engine, self.tokenizer, self.clients, self.env_cfg,
                                version=lambda: self.version, server=self.server, chat_template=template,
                                index=self.index, num_actors=self.num_actors, seed=self.seed)
        return {"index": self.index, "model": path, "endpoint": self.server.url}

    def _engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"dtype": self.cfg.dtype, "enforce_eager": self.cfg.enforce_eager,
                                  "tensor_parallel_size": self.cfg.tensor_parallel_size}
        if self.cfg.tensor_parallel_size > 1:  # the engine's workers are processes in this actor's bundle
            kwargs["distributed_executor_backend"] = "mp"
        if self.cfg.kv_cache_gb > 0:
            kwargs["kv_cache_memory_bytes"] = int(self.cfg.kv_cache_gb * 2**30)
        return {**kwargs, **self.cfg.engine_kwargs}

    async def endpoint(self) -> str:
        """The OpenAI base URL (`.../v1`) of this actor's engine; the served model is named `rlray`."""
        return self.server.url

    async def _produce(self, buffer: Any, env: Env, row: dict, slots: asyncio.Semaphore) -> None:
        try:
            t0 = time.perf_counter()
            rollouts = await self.runner.group(env, row, self.cfg.group_size, self.cfg.temperature,
                                               self.cfg.max_tokens)
            self.stats_["gen_seconds"] += time.perf_counter() - t0
            self.stats_["groups"] += 1
            self.stats_["completion_tokens"] += sum(len(r.completion_ids) for r in rollouts)
            await buffer.put([Group(rollouts)])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine failed: the ticket goes back so the trainer is not starved
            self.stats_["errors"] += 1
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
            env, row = self.runner.next_train()
            task = asyncio.create_task(self._produce(buffer, env, row, slots))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for t in list(tasks):
            t.cancel()
        return await self.stats()

    async def stop(self) -> None:
        self._stop.set()

    async def stats(self) -> dict[str, Any]:
        return {**self.stats_, **{f"env/{k}": v for k, v in self.runner.counts.items()},
                "last_error": self.last_error}

    async def init_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str,
                                timeout_s: float, plan: list) -> None:
        await self.engine.init_weight_group(host, port, rank, world_size, backend, timeout_s, plan)

    async def close_weight_group(self) -> None:
        await self.engine.close_weight_group()

    async def update_weights(self, version: int) -> dict[str, float]:
        seconds = await self.engine.update_weights(on_loaded=lambda: setattr(self, "version", version),
                                                   version=version)
        return {"load_seconds": seconds}

    async def evaluate(self, num_examples: int, num_samples: int = 1, temperature: float = 0.0,
                       max_tokens: int | None = None) -> list[dict[str, Any]]:
        """Per-example records of this actor's share of every environment's first `num_examples`
        eval rows: examples i, i+A, ... for actor i of A."""
        max_tokens = max_tokens or self.cfg.max_tokens
        jobs = []
        for env in self.runner.envs:
            n = min(num_examples, env.num_examples("eval"))
            indices = list(range(self.index, n, self.num_actors))
            jobs.append(self.runner.evaluate(env, indices, num_samples, temperature, max_tokens))
        return [rec for recs in await asyncio.gather(*jobs) for rec in recs]

    async def score(self, token_ids: list[int], start: int) -> list[float]:
        return await self.engine.score(token_ids, start)

    async def shutdown(self) -> None:
        if getattr(self, "server", None) is not None:
            await self.server.stop()
        await self.engine.shutdown()
