"""RolloutActor: a vLLM engine, its OpenAI-compatible endpoint and the env runner. A plain class;
cluster.py makes it a Ray actor.

Contract:
- `start()` builds the engine (one vLLM adapter: rlray.actors.engine.Engine), serves it through vLLM's
  own OpenAI server on `env.server_host` (rlray.actors.server; `endpoint()` returns its base URL) and
  loads the environments of `env` (id or weighted mix, rlray.envs) into an `EnvRunner`. An MoE
  model's engine captures its routing, so every rollout carries it (`Rollout.routing`). An engine of an MXFP4
  checkpoint (gpt-oss's) or an FP8 one (DeepSeek-V3's, Kimi-K2's) starts in bf16 with dummy weights, which the
  first sync fills (rlray.models.quantized).
- `run(buffer)` loops until `stop()`: reserves group tickets from the buffer (which
  bounds how far ahead of the trainer rollouts may run), takes each ticket's environment,
  row and sampling seed (`EnvRunner.train_row`, a function of the ticket), runs `group_size`
  rollouts of it (verifiers over HTTP, or the direct fast path for
  plain single-turn envs) and `put`s each Group, every token tagged with the policy version
  that produced it. `buffer` is any object whose `reserve`/`put`/`cancel` return awaitables
  (the BufferActor itself in tests, its Ray handle through cluster.py's adapter in a run).
  A failing rollout is a rollout with reward 0 and an error (rlray.envs.runner); only a
  failing engine costs the group (its ticket goes back). The loop ends by raising `EngineFailed`
  once the engine has died (`Engine.death()`) or failed `rollout.max_failed_groups` groups in a row.
- Weight sync is vLLM's weight-transfer protocol, this actor being the inference end a
  `VLLMWeightSyncClient` calls (rlray.orchestration.calls.FleetClient, driven from trainer rank 0):
  `init_weight_transfer_engine(info)` joins the weight group (`workers()` ranks),
  `shutdown_weight_transfer_engine()` leaves it (it is re-formed when an actor is replaced);
  `start_weight_update(adapter)` pauses generation (in-flight requests are kept; `adapter`: the sync
  moves the LoRA adapter of that PEFT config, the engine started with `lora_rank`), `update_weights(info)`
  loads what the trainer sends, `finish_weight_update(version)` clears the prefix cache,
  labels the weights and resumes with the new version. `stats()["loading"]` stays True after
  a sync that broke off between start and finish.
- `sleep(level)` / `wake_up(tags)` (colocated): the engine releases the device while the trainer of
  its bundle trains, and takes it back (rlray.actors.engine.Engine.sleep).
- `evaluate(num_examples, num_samples, temperature, max_tokens)` runs this actor's share
  (examples i, i+A, ... of each environment's eval split) and returns per-example records.
- The weight calls, `evaluate` and `score` on a dead engine raise `EngineFailed` too (an
  evaluation over HTTP would otherwise return every sample as a reward-0 error).
- `stats()` returns counters: groups, tokens, rollouts by path, errors by kind, the last error (a failed group's),
  failed rollouts and the last one's error
  and why the engine can serve no more (`failure`, None while it can); `pid()` the actor's process id.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rlray.config import EnvConfig, ModelConfig, RolloutConfig, engine_workers
from rlray.config.families import family, known, recurrent
from rlray.envs import V1Env, load_envs
from rlray.envs.images import vision_prompt
from rlray.envs.tool_calls import v1_tool_format
from rlray.envs.v1 import specs as v1_specs
from rlray.models.catalog import read_config
from rlray.models.multimodal import is_vision
from rlray.models.quantized import engine_route
from rlray.models.tiny import model_path
from rlray.parallel.dims import num_experts
from rlray.types import Group

T = TypeVar("T")


class EngineFailed(RuntimeError):
    """This actor's engine can serve no more; the message says why in one line ("its vLLM engine ...")."""


def one_line(error: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, at most `limit` characters."""
    return " ".join(f"{type(error).__name__}: {error}".split())[:limit]


def resolve_chat_template(cfg: EnvConfig, tokenizer: Any) -> str:
    from rlray.actors.server import PLAIN_CHAT_TEMPLATE

    template = cfg.chat_template
    if template and os.path.exists(template):
        with open(template) as f:
            return f.read()
    return template or getattr(tokenizer, "chat_template", None) or PLAIN_CHAT_TEMPLATE


def cpu_binding(workers: int, cores: list[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a CPU engine of `workers` (TP x DP) workers: this process's cores
    split into that many equal shares ("0|1", "0,1,2,3|4,5,6,7"). vllm-cpu refuses to start TP
    workers without it ("Not enough allowed NUMA nodes to bind threads")."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if len(cores) < workers:
        raise ValueError(f"{workers} CPU engine workers (rollout.tensor_parallel_size x data_parallel_size) need as "
                         "many cores; "
                         f"this process may use {len(cores)}")
    share = len(cores) // workers
    parts = [cores[i * share:(i + 1) * share] for i in range(workers)]
    return "|".join(",".join(map(str, p)) for p in parts)


class RolloutActor:
    def __init__(self, index: int, num_actors: int, model: ModelConfig, rollout: RolloutConfig,
                 env: EnvConfig, seed: int, run_seed: int = 0, weights_backend: str = "gloo",
                 lora_rank: int = 0, colocated: bool = False, v1_spawner: Callable[..., Any] | None = None) -> None:
        self.index, self.num_actors, self.run_seed = index, num_actors, run_seed
        self.v1_spawner = v1_spawner  # (specs, tokenizer folder, chat template) -> this actor's v1 env actor
        self.lora_rank = lora_rank  # > 0: the engine serves the trainer's LoRA adapter (trainer.lora.rank)
        self.model_cfg, self.cfg, self.env_cfg, self.seed = model, rollout, env, seed
        self.version = 0
        self.weights_backend = weights_backend
        self.colocated = colocated  # in a trainer rank's bundle (cluster.colocate): the engine takes turns with it
        self.loading = False  # inside a weight update (start_weight_update without its finish)
        self._started = self._stopped = 0  # RL loops started, and stopped (`run`, `stop`)
        self.last_error: str | None = None
        self.failed_in_a_row = 0  # groups the engine failed since its last good one
        self.failure: str | None = None  # why the engine can serve no more, once it cannot
        self.stats_ = {"groups": 0, "completion_tokens": 0, "errors": 0, "gen_seconds": 0.0, "failed_rollouts": 0}
        self.last_rollout_error: str | None = None

    async def start(self) -> dict[str, Any]:
        from transformers import AutoTokenizer

        from rlray.actors.engine import Engine, version_warning
        from rlray.actors.server import PLAIN_CHAT_TEMPLATE, OpenAIServer
        from rlray.envs.bridge import TurnBridge
        from rlray.envs.client import make_clients
        from rlray.envs.runner import EnvRunner

        if warning := version_warning():
            print(warning, flush=True)
        path = model_path(self.model_cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        template = resolve_chat_template(self.env_cfg, self.tokenizer)
        hf_config = read_config(path)
        vision = vision_prompt(path, template, self.cfg.max_images) if is_vision(hf_config) else None
        bridge = TurnBridge(self.tokenizer, template)  # fails fast on a template it cannot split
        parser = self.env_cfg.tool_call_parser
        if parser == "auto":
            parser = "rlray" if template == PLAIN_CHAT_TEMPLATE else None
        envs = await self._load_envs(path, template, v1_tool_format(parser))
        if self.cfg.gpus_per_actor == 0 and engine_workers(self.cfg) > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(engine_workers(self.cfg)))
        self.engine = await Engine.create(path, max_model_len=self.cfg.max_model_len, seed=self.seed + self.index,
                                          kv_cache_fraction=self.cfg.kv_cache_fraction,
                                          weights_backend=self.weights_backend,
                                          engine_kwargs={**engine_route(hf_config),  # MXFP4, FP8: bf16, the sync fills it
                                                         **self._engine_kwargs(vision is not None,
                                                                               hf_config.model_type)},
                                          capture_routing=num_experts(hf_config) > 0,
                                          lora_rank=self.lora_rank)
        self.server = await OpenAIServer.start(self.engine, host=self.env_cfg.server_host,
                                               port=self.env_cfg.server_port, chat_template=template,
                                               tool_call_parser=parser or None)
        self.clients = make_clients(self.server.url, self.env_cfg.rollout_timeout_s, bridge, self.cfg.max_model_len,
                                    vision=vision)
        self.runner = EnvRunner(envs, self.engine, self.tokenizer, self.clients, self.env_cfg,
                                version=lambda: self.version, server=self.server, chat_template=template,
                                num_actors=self.num_actors, run_seed=self.run_seed, vision=vision)
        return {"index": self.index, "model": path, "endpoint": self.server.url}

    async def _load_envs(self, path: str, template: str, tool_format: str | None) -> list:
        """The envs of `env`; v1 envs (rlray.envs.v1) get this actor's v1 env actor, which describes their tasks."""
        specs = v1_specs(self.env_cfg)
        if not specs:
            return load_envs(self.env_cfg)
        if self.v1_spawner is None:
            raise ValueError(f"env {list(specs)} is a verifiers v1 env: the rollout actor needs a v1 env actor "
                             "(rlray.orchestration.cluster.spawn_v1_env)")
        self.v1_actor = self.v1_spawner(specs, path, template, tool_format)
        envs = load_envs(self.env_cfg, described=await self.v1_actor.describe.remote())
        for env, _ in envs:
            if isinstance(env, V1Env):
                env.actor = self.v1_actor
        return envs

    def _engine_kwargs(self, vision: bool = False, model_type: str | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"dtype": self.cfg.dtype, "enforce_eager": self.cfg.enforce_eager,
                                  "tensor_parallel_size": self.cfg.tensor_parallel_size,
                                  "data_parallel_size": self.cfg.data_parallel_size}
        if self.colocated and self.cfg.gpus_per_actor > 0:
            # vLLM's Ray workers, one in each trainer rank's bundle (the cluster gave this actor
            # VLLM_RAY_BUNDLE_INDICES and VLLM_RAY_PER_WORKER_GPUS), with sleep mode to make room for it
            kwargs.update(distributed_executor_backend="ray", enable_sleep_mode=True)
        elif engine_workers(self.cfg) > 1:  # the engine's workers are processes in this actor's bundle (not Ray's)
            kwargs["distributed_executor_backend"] = "mp"
        if self.cfg.expert_parallel:
            kwargs["enable_expert_parallel"] = True
        if self.cfg.quantization:
            kwargs["quantization"] = self.cfg.quantization
        if self.cfg.gpus_per_actor == 0:
            # vLLM 0.32 on CPU: a seeded request whose prefill is split (chunked prefill, or the
            # recompute after a weight update) makes the worker call Generator.set_offset, which CPU
            # generators lack ("CPU Generator does not use offset"), and the engine dies.
            kwargs["enable_chunked_prefill"] = False
            if recurrent(model_type):  # vLLM caches a recurrent model's prefixes only with chunked prefill ('align')
                kwargs["enable_prefix_caching"] = False
            if known(model_type):
                kwargs.update(family(model_type).cpu_engine)
        if self.cfg.kv_cache_gb > 0:
            kwargs["kv_cache_memory_bytes"] = int(self.cfg.kv_cache_gb * 2**30)
        if vision:
            kwargs["limit_mm_per_prompt"] = {"image": self.cfg.max_images, "video": 0}
        return {**kwargs, **self.cfg.engine_kwargs}

    async def endpoint(self) -> str:
        """The OpenAI base URL (`.../v1`) of this actor's engine; the served model is named `rlray`."""
        return self.server.url

    def _check_engine(self) -> str | None:
        """Why the engine can serve no more (sticky), or None."""
        death = self.engine.death()
        if self.failure is None and death is not None:
            self.failure = f"its vLLM engine died ({death})"
        elif self.failure is None and self.failed_in_a_row >= self.cfg.max_failed_groups:
            self.failure = (f"its vLLM engine failed {self.failed_in_a_row} groups in a row "
                            f"(rollout.max_failed_groups={self.cfg.max_failed_groups}; last: {self.last_error})")
        return self.failure

    async def _group(self, ticket: int) -> Group | None:
        """The group of buffer ticket `ticket` (its prompt and sampling seed), or None when the engine failed it."""
        t0 = time.perf_counter()
        env, row = self.runner.train_row(ticket)
        try:
            rollouts = await self.runner.group(env, row, self.cfg.group_size, self.cfg.temperature,
                                               self.cfg.max_tokens, seed=self.runner.group_seed(ticket))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.stats_["errors"] += 1
            self.last_error = one_line(e)
            self.failed_in_a_row += 1
            return None
        if self.engine.death() is not None:  # over HTTP a dead engine's rollouts are reward-0 errors
            return None
        self.failed_in_a_row = 0
        failed = [r.error for r in rollouts if r.error]
        if failed:  # for the driver's message when no group is trainable (every rollout of every group failed)
            self.stats_["failed_rollouts"] += len(failed)
            self.last_rollout_error = " ".join(failed[-1].split())[:300]
        self.stats_["gen_seconds"] += time.perf_counter() - t0
        self.stats_["groups"] += 1
        self.stats_["completion_tokens"] += sum(len(r.completion_ids) for r in rollouts)
        return Group(rollouts, ticket=ticket)

    async def _produce(self, buffer: Any, ticket: int, slots: asyncio.Semaphore) -> None:
        try:
            group = await self._group(ticket)
            if group is not None:
                await buffer.put([group])
            else:  # the ticket goes back so that the trainer is not starved
                await buffer.cancel([ticket])
        finally:
            slots.release()

    async def run(self, buffer: Any, loop: int = 0) -> dict[str, Any]:
        """Produce groups until `stop()`; raises EngineFailed when the engine can serve no more. `loop` numbers the
        caller's RL loops (0: the one after the last started): Ray does not order calls on an async actor, so a
        `stop(loop)` that arrives before its `run` still ends it, and a loop started after a `stop()` (a trainer
        group re-created: rlray.orchestration.recovery) runs anew."""
        loop = loop or self._started + 1
        self._started = max(self._started, loop)
        slots = asyncio.Semaphore(self.cfg.max_concurrent_groups)
        tasks: set[asyncio.Task] = set()
        while self._stopped < loop and self._check_engine() is None:
            await slots.acquire()
            granted = await buffer.reserve(self.version, 1)
            if not granted:
                slots.release()
                await asyncio.sleep(0.02)
                continue
            task = asyncio.create_task(self._produce(buffer, granted[0], slots))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for t in list(tasks):
            t.cancel()
        if self.failure is not None:
            raise EngineFailed(self.failure)
        return await self.stats()

    async def stop(self, loop: int | None = None) -> None:
        """End RL loop `loop` and those before it, even one whose `run` has not arrived yet (None: the last started)."""
        self._stopped = max(self._stopped, self._started if loop is None else loop)

    async def stats(self) -> dict[str, Any]:
        if getattr(self, "engine", None) is not None:
            self._check_engine()
        runner = getattr(self, "runner", None)  # set once `start` has the engine up
        return {**self.stats_, **({f"env/{k}": v for k, v in runner.counts.items()} if runner else {}),
                "last_error": self.last_error, "last_rollout_error": self.last_rollout_error,
                "failure": self.failure, "version": self.version,
                "loading": self.loading, "started": runner is not None}

    async def pid(self) -> int:
        return os.getpid()

    async def _serving(self, call: Awaitable[T]) -> T:
        """`call`'s result, or EngineFailed when the engine died before or under it."""
        try:
            result = await call
        except Exception as e:
            self._raise_if_dead(e)
            raise
        self._raise_if_dead(None)
        return result

    def _raise_if_dead(self, error: Exception | None) -> None:
        death = self.engine.death()
        if death is not None:
            raise EngineFailed(f"its vLLM engine died ({death})") from error

    # ---- vLLM's weight-transfer protocol: the calls of a VLLMWeightSyncClient (rlray.orchestration.fleet) ----
    async def workers(self) -> int:
        """The engine's worker processes: the weight-group ranks this actor takes."""
        return self.engine.workers()

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self._serving(self.engine.init_weight_transfer(init_info))

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._serving(self.engine.shutdown_weight_transfer())

    async def start_weight_update(self, adapter: dict[str, Any] | None = None) -> None:
        self.loading = True  # until finish_weight_update: a sync that breaks off leaves it set
        await self._serving(self.engine.start_weight_update(adapter))

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self._serving(self.engine.update_weights(update_info))

    async def finish_weight_update(self, weight_version: str) -> dict[str, float]:
        version = int(weight_version)
        seconds = await self._serving(self.engine.finish_weight_update(
            version, on_loaded=lambda: setattr(self, "version", version)))
        self.loading = False
        return {"load_seconds": seconds}

    async def sleep(self, level: int) -> None:
        """Colocated: release the device while the trainer trains (rlray.actors.engine.Engine.sleep)."""
        await self._serving(self.engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._serving(self.engine.wake_up(tags))

    async def evaluate(self, num_examples: int, num_samples: int = 1, temperature: float = 0.0,
                       max_tokens: int | None = None, part: int | None = None,
                       parts: int | None = None) -> list[dict[str, Any]]:
        """Per-example records of this actor's share of every environment's first `num_examples`
        eval rows: examples i, i+A, ... for part i of A (default: this actor's index of rollout.num_actors;
        an elastic pool passes the actor's place in the pool as it is now)."""
        max_tokens = max_tokens or self.cfg.max_tokens
        part, parts = (self.index, self.num_actors) if part is None or parts is None else (part, parts)
        jobs = []
        for env in self.runner.envs:
            n = min(num_examples, env.num_examples("eval"))
            indices = list(range(part, n, parts))
            jobs.append(self.runner.evaluate(env, indices, num_samples, temperature, max_tokens))
        return [rec for recs in await self._serving(asyncio.gather(*jobs)) for rec in recs]

    async def score(self, token_ids: list[int], start: int) -> list[float]:
        return await self._serving(self.engine.score(token_ids, start))

    async def shutdown(self) -> None:
        if getattr(self, "server", None) is not None:
            await self.server.stop()
        await self.engine.shutdown()
