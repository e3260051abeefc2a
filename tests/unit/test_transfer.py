"""rlray's gloo engine in vLLM's weight-transfer protocol: registration, rank offsets per
engine, CPU core shares for TP workers, and a pin on every vLLM attribute rlray.weightsync.protocol uses."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

from rlray.actors.rollout import cpu_binding
from rlray.bench.common import EngineClient, LoopThread

vllm = pytest.importorskip("vllm")


def test_gloo_is_registered_in_both_factories_once() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.plugins import load_general_plugins

    from rlray.weightsync.protocol import GlooTrainerWeightTransferEngine, GlooWeightTransferEngine, register

    load_general_plugins()  # what every vLLM process does: the entry point in pyproject.toml
    register()  # a second registration is harmless
    assert WeightTransferEngineFactory._registry["gloo"]() is GlooWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["gloo"]() is GlooTrainerWeightTransferEngine
    assert "nccl" in WeightTransferTrainerFactory._registry  # the GPU path is vLLM's own


class FakeEngine:
    def __init__(self, workers: int) -> None:
        self.n, self.infos = workers, []

    def workers(self) -> int:
        return self.n

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        self.infos.append(init_info)


def test_each_engine_gets_ranks_after_the_previous_engines_workers() -> None:
    loop = LoopThread()
    try:
        engines = [FakeEngine(2), FakeEngine(1), FakeEngine(4)]
        EngineClient(loop, engines).init_weight_transfer_engine({"rank_offset": 1, "world_size": 8})
    finally:
        loop.close()
    assert [e.infos[0]["rank_offset"] for e in engines] == [1, 3, 4]
    assert all(e.infos[0]["world_size"] == 8 for e in engines)


def test_rank_offsets() -> None:
    from rlray.weightsync.transport import rank_offsets

    assert rank_offsets(1, [2, 1, 4]) == [1, 3, 4]
    assert rank_offsets(1, []) == []


def test_cpu_binding_gives_each_worker_its_share_of_cores() -> None:
    assert cpu_binding(2, [0, 1]) == "0|1"
    assert cpu_binding(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    assert cpu_binding(2, [4, 6, 8, 10]) == "4,6|8,10"
    with pytest.raises(ValueError, match=r"3 CPU engine workers \(rollout.tensor_parallel_size x data_parallel_size\) need as many cores"):
        cpu_binding(3, [0, 1])


def test_vllm_pieces_rlray_transfer_uses() -> None:
    """Each vLLM attribute rlray.weightsync.protocol and rlray.actors.engine rely on, as vLLM 0.32 has it."""
    from vllm.config import ParallelConfig
    from vllm.distributed.weight_transfer.base import (
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    assert {"init_transfer_engine", "start_weight_update", "finish_weight_update", "receive_weights",
            "shutdown"} <= WeightTransferEngine.__abstractmethods__
    assert {"trainer_init", "send_weights"} <= TrainerWeightTransferEngine.__abstractmethods__
    assert list(inspect.signature(WeightTransferInitRequest).parameters) == ["init_info"]
    assert list(inspect.signature(WeightTransferUpdateRequest).parameters) == ["update_info"]
    for name in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
                 "shutdown_weight_transfer_engine", "pause_generation", "resume_generation", "reset_prefix_cache"):
        assert callable(getattr(AsyncLLM, name)), name
    assert issubclass(CPUWorker, Worker) and "weight_transfer_engine" in inspect.getsource(Worker.load_model)
    fields = ParallelConfig.__dataclass_fields__
    assert {"data_parallel_index", "data_parallel_size", "rank"} <= set(fields)
    assert isinstance(ParallelConfig.world_size, property) or "world_size" in fields
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_processing

    assert "finalize_layerwise_processing(*args, **kwargs)" in inspect.getsource(finalize_layerwise_reload)
    assert list(inspect.signature(finalize_layerwise_processing).parameters) == ["model", "model_config"]
    assert callable(initialize_layerwise_reload)
    assert callable(CPUUnquantizedExperts.process_weights_after_loading)
    assert "moe_kernel" in inspect.getsource(UnquantizedFusedMoEMethod._setup_kernel)


def test_routing_records_merge_first_routing_first() -> None:
    """A request recomputed after a weight update keeps the routing each position had first; vLLM's
    internal request ids map back to ours and the completion index; turns overlay earlier-first."""
    import numpy as np

    from rlray.actors.extension import external_request, merge_routing
    from rlray.types import no_route, overlay_routing, route_dtype

    u8 = route_dtype(128)
    assert u8 == np.uint8 and route_dtype(256) == np.uint16 and no_route(u8) == 255
    rows = lambda v, n: np.full((n, 1, 2), v, u8)
    merged = merge_routing([(0, rows(1, 3)), (3, rows(2, 1)), (0, rows(7, 5))])  # prefill, decode, recompute
    assert merged[:, 0, 0].tolist() == [1, 1, 1, 2, 7]
    assert external_request("rlray-3-0a1b2c3d") == ("rlray-3", 0)
    assert external_request("2_chatcmpl-x_y-0a1b2c3d") == ("chatcmpl-x_y", 2)
    earlier = np.concatenate([rows(1, 2), rows(255, 1)])  # a turn's last sampled token had none
    assert overlay_routing(earlier, rows(4, 5))[:, 0, 0].tolist() == [1, 1, 4, 4, 4]
    assert overlay_routing(None, rows(4, 2)) is not None and overlay_routing(earlier, None) is earlier


def test_gpu_engines_routing_comes_from_vllms_own_output() -> None:
    """On GPU vLLM captures itself (`enable_return_routed_experts`): the finished completion's
    `routed_experts` [tokens, all layers, k] keeps the MoE layers only, in rlray's dtype; a dense
    layer's rows (GLM's first) are dropped, an unfinished output adds nothing."""
    from types import SimpleNamespace

    import numpy as np
    from vllm.outputs import CompletionOutput

    from rlray.actors.engine import Engine

    assert "routed_experts" in CompletionOutput.__dataclass_fields__  # the field the GPU path reads
    engine = Engine(llm=None, capture_routing=True)
    engine.moe_layers, engine.num_experts = [1, 2], 256
    full = np.arange(4 * 3 * 2, dtype=np.uint8).reshape(4, 3, 2)
    kept: dict = {}
    engine.keep_routing(kept, SimpleNamespace(outputs=[SimpleNamespace(index=1, routed_experts=None)]))
    assert kept == {}
    engine.keep_routing(kept, SimpleNamespace(outputs=[SimpleNamespace(index=1, routed_experts=full)]))
    assert kept[1].dtype == np.uint16 and kept[1].tolist() == full[:, 1:].tolist()


class _CancelledLLM:
    """An AsyncLLM stand-in whose generate yields one token and then waits to be cancelled, and whose worker RPC
    raises as vLLM's GPU workers do for rlray's CPU routing record (they never create it)."""

    def __init__(self) -> None:
        self.rpcs: list[str] = []
        self.errored = False
        self.first = asyncio.Event()

    async def generate(self, prompt, params, request_id, lora_request=None):
        from types import SimpleNamespace

        token = SimpleNamespace(logprob=-0.5)
        yield SimpleNamespace(outputs=[SimpleNamespace(index=0, token_ids=[7], logprobs=[{7: token}],
                                                       finish_reason=None, routed_experts=None)])
        self.first.set()
        await asyncio.sleep(3600)

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.rpcs.append(method)
        raise AttributeError("'Worker' object has no attribute '_rlray_routing'")


@pytest.mark.parametrize("vllm_captures", [True, False], ids=["gpu", "cpu"])
def test_a_cancelled_generate_stays_a_cancellation(vllm_captures: bool) -> None:
    """A generate cancelled before vLLM returned its routing (stop(), an HTTP timeout) raises CancelledError, not
    the cleanup's error; on GPU (vLLM's own capture) no worker RPC is made at all (its workers keep no record)."""
    from rlray.actors.engine import Engine

    async def main() -> tuple[BaseException | None, list[str]]:
        llm = _CancelledLLM()
        engine = Engine(llm, capture_routing=True)
        engine.vllm_captures = vllm_captures  # what Engine.create sets from enable_return_routed_experts
        task = asyncio.ensure_future(engine.generate([1, 2, 3], max_tokens=8))
        await asyncio.wait_for(llm.first.wait(), 30)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=30)
        assert done, "the cancelled generate did not end"
        return (None if task.cancelled() else task.exception()), llm.rpcs

    error, rpcs = asyncio.run(main())
    assert error is None, f"the cancellation became {error!r}"
    assert rpcs == ([] if vllm_captures else ["rlray_routing_take"])


@pytest.mark.parametrize(("arch", "backend", "expected"), [
    ("gpt_oss", "nccl", "rlray_nccl"), ("gpt_oss", "ipc", "rlray_ipc"), ("gpt_oss", "gloo", "gloo"),
    ("qwen3_moe", "nccl", "nccl"), ("qwen3_moe", "ipc", "ipc")])
def test_gpu_engines_of_a_family_with_bare_copies_take_rlrays_transfer_engine(
        monkeypatch: pytest.MonkeyPatch, arch: str, backend: str, expected: str) -> None:
    """What `Engine.create` asks of vLLM (its engine arguments, captured; no engine starts): gpt-oss's sinks are
    loaded again after each reload (rlray.weightsync.reload) only by rlray's own transfer engines, so a GPU engine
    of that family takes rlray_nccl / rlray_ipc where others take vLLM's own nccl / ipc."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from rlray.actors.engine import Engine
    from rlray.config import ModelConfig
    from rlray.models.tiny import model_path

    seen: list[dict[str, Any]] = []

    def capture(args: Any, **_: Any) -> None:
        seen.append(args.weight_transfer_config)
        raise RuntimeError("captured")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", capture)
    path = model_path(ModelConfig(arch=arch, num_layers=2))
    with pytest.raises(RuntimeError, match="captured"):
        asyncio.run(Engine.create(path, max_model_len=64, weights_backend=backend))
    (config,) = seen
    assert (getattr(config, "backend", None) or config["backend"]) == expected
