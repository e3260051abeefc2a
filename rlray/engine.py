"""The one vLLM adapter: an `AsyncLLM` engine with sampling, scoring and in-place weight updates.

Contract:
- `Engine.create(...)` must be awaited inside a running event loop; everything else is a
  coroutine on that same loop. Many `generate` calls may run at once on one engine.
- `generate` returns token ids only (no text), the logprob of every sampled token under the
  distribution actually sampled from (`logprobs_mode="processed_logprobs"`, so temperature
  is applied) and, per token, the value of `version()` when that token reached us: tokens
  produced after a weight update carry the new version when the caller bumps it in
  `finish_weight_update(on_loaded=...)`.
- `score` gives temperature-1 logprobs of given tokens under the current weights.
- Weight updates follow vLLM's weight-transfer protocol (rlray.transfer drives it from the
  trainer): `init_weight_transfer` once, then per sync `start_weight_update` (in-flight requests
  freeze, keeping their KV cache), `update_weights` (the workers receive and load what rank 0
  of the weight group sends) and `finish_weight_update` (KV made with old weights is
  recomputed, the weights are labelled with their version, generation resumes).
- `death()` is None while the engine core process runs, and vLLM's error in one line once it
  has died (out of memory, a CUDA fault, killed): every call fails from then on, and a
  weight-group call in flight when it dies raises that error instead of waiting forever.
- vllm is imported inside functions only, so `import rlray.engine` works without it.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Sample:
    """One completion: per-token ids, sampled-distribution logprobs and policy versions."""

    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""


class Engine:
    """A vLLM `AsyncLLM` whose workers hold a weight-transfer engine (`weights_backend`)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._ids = itertools.count()
        self._paused_at = 0.0

    @classmethod
    async def create(cls, model_path: str, *, max_model_len: int, seed: int = 0,
                     kv_cache_fraction: float = 0.05, weights_backend: str = "gloo",
                     engine_kwargs: dict[str, Any] | None = None) -> Engine:
        """Start the engine (15-25 s on CPU); call from inside the event loop that will use it.

        On CPU, `kv_cache_fraction` (vLLM's gpu_memory_utilization) is a share of the NUMA node's
        RAM that must also cover the worker's own RSS (~0.7 GiB), so 0.05 can fail with a
        negative KV size; `engine_kwargs={"kv_cache_memory_bytes": ...}` sets the KV cache exactly.
        """
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs: dict[str, Any] = {
            "model": model_path,
            "max_model_len": max_model_len,
            "seed": seed,
            "gpu_memory_utilization": kv_cache_fraction,
            "logprobs_mode": "processed_logprobs",
            "weight_transfer_config": {"backend": weights_backend},
            "enable_prefix_caching": True,
        }
        kwargs.update(engine_kwargs or {})
        return cls(AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs)))

    def _request_id(self) -> str:
        return f"rlray-{next(self._ids)}"

    def death(self) -> str | None:
        """None while the engine core runs; once it has died, vLLM's error (EngineDeadError: ...)."""
        if not self.llm.errored:
            return None
        error = self.llm.dead_error
        return f"{type(error).__name__}: {error}"

    async def _unless_dead(self, call: Awaitable[T], poll_s: float = 0.5) -> T:
        """`call`'s result; vLLM leaves a utility call waiting forever when the core dies under it."""
        task = asyncio.ensure_future(call)
        while not (await asyncio.wait({task}, timeout=poll_s))[0]:
            if self.llm.errored:
                task.cancel()
                raise self.llm.dead_error
        return task.result()

    async def generate(self, prompt_ids: list[int], *, n: int = 1, temperature: float = 1.0,
                       max_tokens: int = 256, version: Callable[[], int] = lambda: 0,
                       seed: int | None = None, ignore_eos: bool = False,
                       stop_token_ids: list[int] | None = None) -> list[Sample]:
        """Sample `n` completions of `prompt_ids`; temperature 0 is greedy."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        if temperature == 0.0 and n > 1:  # vLLM refuses n > 1 when greedy; all n would be equal
            one = await self.generate(prompt_ids, n=1, temperature=0.0, max_tokens=max_tokens,
                                      version=version, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)
            return [copy.deepcopy(one[0]) for _ in range(n)]
        params = SamplingParams(
            n=n, temperature=temperature, max_tokens=max_tokens, seed=seed, logprobs=0,
            ignore_eos=ignore_eos, stop_token_ids=stop_token_ids, detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        samples = [Sample() for _ in range(n)]
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        async for output in self.llm.generate(prompt, params, self._request_id()):
            now = version()
            for completion in output.outputs:
                _append_delta(samples[completion.index], completion, now)
        return samples

    async def score(self, token_ids: list[int], start: int) -> list[float]:
        """Temperature-1 logprob of `token_ids[i]` given `token_ids[:i]`, for i >= start >= 1."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        if not 1 <= start <= len(token_ids):
            raise ValueError(f"score start must be in [1, {len(token_ids)}], got {start}")
        # Prompt logprobs skip the sampling processors, so they are temperature 1 in every mode.
        params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for output in self.llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params,
                                              self._request_id()):
            final = output
        assert final is not None and final.prompt_logprobs is not None
        return [final.prompt_logprobs[i][token_ids[i]].logprob for i in range(start, len(token_ids))]

    def workers(self) -> int:
        """This engine's worker processes (TP x PP x DP): the weight-group ranks it takes."""
        pc = self.llm.vllm_config.parallel_config
        return pc.world_size * pc.data_parallel_size

    # ---- vLLM's weight-transfer protocol (rlray.transfer) ------------------------------
    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Every worker joins the weight group (blocks until the trainer's rank 0 has joined too)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._unless_dead(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info)))

    async def start_weight_update(self) -> None:
        """Freeze in-flight requests (they keep their KV cache) and open the workers' reload."""
        self._paused_at = time.perf_counter()
        await self._unless_dead(self.llm.pause_generation(mode="keep", clear_cache=False))
        await self._unless_dead(self.llm.start_weight_update())

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and load what the trainer sends for `update_info` (the backend's own payload)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._unless_dead(self.llm.update_weights(WeightTransferUpdateRequest(update_info)))

    async def finish_weight_update(self, version: int | None = None,
                                   on_loaded: Callable[[], None] | None = None) -> float:
        """Close the reload, drop KV made with the old weights, label them `version`, resume.

        `on_loaded` runs after the new weights are in and before generation resumes: bump the
        policy version there so that every token sampled with the new weights carries it.
        `version` also labels the engine's weights (vLLM's weight-version spans), so requests
        served over HTTP learn which version sampled each of their tokens (rlray.server).
        Returns the seconds the engine was paused.
        """
        await self._unless_dead(self.llm.finish_weight_update(None if version is None else str(version)))
        # KV computed with the old weights must not be reused: running requests are recomputed.
        await self._unless_dead(self.llm.reset_prefix_cache(reset_running_requests=True))
        if on_loaded is not None:
            on_loaded()
        await self._unless_dead(self.llm.resume_generation())
        return time.perf_counter() - self._paused_at

    async def shutdown_weight_transfer(self) -> None:
        await self._unless_dead(self.llm.shutdown_weight_transfer_engine())

    async def shutdown(self) -> None:
        """Stop the engine and its processes (blocks for a few seconds)."""
        self.llm.shutdown()


def _append_delta(sample: Sample, completion: Any, version: int) -> None:
    ids = list(completion.token_ids)
    logprobs = completion.logprobs or []
    assert len(logprobs) == len(ids), "vLLM returned logprobs misaligned with tokens"
    sample.completion_ids.extend(ids)
    sample.logprobs.extend(position[token].logprob for position, token in zip(logprobs, ids))
    sample.versions.extend([version] * len(ids))
    if completion.finish_reason is not None:
        sample.finish_reason = str(completion.finish_reason)
