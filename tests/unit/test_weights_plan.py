"""The weight path's forecast: the fast totals equal the m2n plan's, the wire list from a config is the trainer's, the
time model on hand-computed cases and its least-squares fit on synthetic rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlray.config import Config, ModelConfig
from rlray.orchestration.sync_costs import Costs, Links, fit
from rlray.orchestration.weights_plan import WeightsPlan, weights_plan, wires
from rlray.weightsync.boxes import Dims, Engines, Layout, Wire, plan, replicated
from rlray.weightsync.totals import held_bytes, of_plan, totals

ROOT = Path(__file__).resolve().parents[2]


def tiny(arch: str, ranks: int, ep: int, **model: int) -> tuple[Config, object]:
    from rlray.data.tokenizer import char_tokenizer
    from rlray.models.tiny import tiny_architecture

    c = Config()
    c.model = ModelConfig(arch=arch, **model)
    c.trainer.num_ranks, c.trainer.ep = ranks, ep
    tok = char_tokenizer()
    return c, tiny_architecture(c.model, len(tok), tok)


ENGINES = [Engines((2, 1, 2)), Engines((2, 1, 2), expert_parallel=True), Engines((4,)), Engines((1,))]


@pytest.mark.parametrize("engines", ENGINES, ids=lambda e: f"tp{e.tp}-ep{int(e.expert_parallel)}")
@pytest.mark.parametrize("arch, ranks, ep", [("glm4_moe", 4, 2), ("glm4_moe", 3, 1), ("deepseek_v3", 4, 2),
                                             ("qwen3", 3, 1), ("gpt_oss", 4, 4)])
def test_totals_equal_the_full_plans(arch: str, ranks: int, ep: int, engines: Engines) -> None:
    """Bytes per trainer rank and per worker, messages (in all, per rank, per worker) and tensors per worker: the
    same numbers as enumerating every piece, on tiny models of each wire kind (fused and per-expert experts, uneven
    FSDP chunks over 3 ranks, replicated fp32 buffers) and engines of mixed TP sizes, with and without engine EP."""
    c, hf = tiny(arch, ranks, ep, num_experts=4, num_heads=4, num_kv_heads=2)
    wire, layouts, dims = wires(c, hf)
    assert totals(wire, layouts, ranks, engines, dims) == of_plan(plan(wire, layouts, ranks, engines, dims))


def test_totals_of_transposed_and_uneven_wires() -> None:
    """Fused experts stored transposed (Qwen3-VL-MoE's checkpoints), a tensor shorter than the ranks, a scalar."""
    dense, experts = Layout((3,), (0, 1, 2), (("S", 0),)), Layout((1, 3), (0, 1, 2), (("SS", 0, 3), ("S", 0)))
    wire = [Wire("model.layers.0.mlp.experts.gate_up_proj", (3, 4, 8), 2, 1, (3, 8, 4), flipped=True),
            Wire("model.layers.0.mlp.experts.down_proj", (3, 2, 4), 2, 1, (3, 4, 2), flipped=True),
            Wire("model.layers.0.self_attn.k_proj.weight", (2, 4), 2, 0, (2, 4)),
            Wire("model.layers.0.self_attn.o_proj.weight", (4, 6), 2, 0, (4, 6)),
            Wire("model.embed_tokens.weight", (70, 4), 2, 0, (70, 4)),
            Wire("model.layers.0.mlp.gate.scale", (), 4, 2, ())]
    layouts = [dense, experts, replicated(range(3))]
    for engines in (Engines((2, 1)), Engines((2, 2), expert_parallel=True)):
        dims = Dims(kv_heads=1, sliced_experts=True)
        assert totals(wire, layouts, 3, engines, dims) == of_plan(plan(wire, layouts, 3, engines, dims))


def test_a_hand_computed_sync() -> None:
    """Two trainer ranks, one engine of TP 2, one layer of an 8 x 4 q_proj and a 4 x 8 o_proj in bf16: rank r holds
    rows 4r..4r+3 of q (32 B), which worker r reads whole, and rows 2r, 2r+1 of o (32 B), whose columns 0-3 and 4-7
    the two workers read (16 B each). Each rank sends 32 + 16 + 16 = 64 B in 2 messages, each worker receives 64 B in 2
    and loads 2 tensors; 4 messages in all. Its m2n seconds: 2 messages, 64 bytes, 2 tensors."""
    layouts = [Layout((2,), (0, 1), (("S", 0),))]
    wire = [Wire("model.layers.0.self_attn.q_proj.weight", (8, 4), 2, 0, (8, 4)),
            Wire("model.layers.0.self_attn.o_proj.weight", (4, 8), 2, 0, (4, 8))]
    t = totals(wire, layouts, 2, Engines((2,)), Dims())
    assert (t.sent, t.received, t.messages, t.sends, t.receives, t.tensors) == \
        ([64, 64], [64, 64], 4, [2, 2], [2, 2], [2, 2])
    assert held_bytes(wire, layouts, 2) == [64, 64]  # 32 B of q and 32 B of o each
    costs = Costs(message_s=1e-3, byte_s=1e-6, tensor_s=1e-2)
    c = Config()
    c.weights.bucket_mb = 1  # broadcast: one bucket of 128 B, every worker loads both tensors
    forecast = WeightsPlan(c, None, t, [48, 48], 128, Links(costs, costs, 64.0, "hand"))  # type: ignore[arg-type]
    assert forecast.m2n_terms() == (2, 64, 2)
    assert forecast.seconds("m2n") == pytest.approx(2e-3 + 64e-6 + 2e-2)
    assert forecast.seconds("broadcast") == pytest.approx(1e-3 + 128e-6 + 2e-2)
    assert forecast.lower_bound == pytest.approx(64 / 64.0)  # the 64 B a worker reads over a 64 B/s link


def test_the_fit_recovers_its_costs_and_keeps_them_non_negative() -> None:
    truth = Costs(message_s=2e-4, byte_s=1 / 1.5e9, tensor_s=3e-5, sync_s=0.05)
    rows = [(m, b, t, truth.seconds(m, b, t)) for m, b, t in
            [(10, 1e8, 300), (40, 5e8, 300), (200, 2e9, 4000), (80, 2e8, 9000), (5, 1e6, 20)]]
    assert truth.seconds(10, 1e8, 300) == pytest.approx(10 * 2e-4 + 1e8 / 1.5e9 + 300 * 3e-5 + 0.05)
    got = fit(rows)
    for name in ("message_s", "byte_s", "tensor_s", "sync_s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    noisy = [(10, 1e8, 100, 0.10), (20, 2e8, 100, 0.19), (30, 3e8, 50, 0.31)]  # unconstrained: a negative term
    got = fit(noisy)
    assert min(got.message_s, got.byte_s, got.tensor_s) >= 0
    assert got.seconds(20, 2e8, 100) == pytest.approx(0.2, rel=0.1)
    with pytest.raises(ValueError, match="2 or more measured rows"):
        fit(rows[:1])


def test_the_wire_list_from_a_config_is_the_trainers() -> None:
    """Under a fake 8-rank process group the trainer's own FSDP2 + EP model gives WeightPublisher.shard_source the
    same wire tensors and layouts that `wires` builds from the config alone (GLM's fused experts, DeepSeek-V3's per
    expert), in a subprocess (the fake group is process-wide)."""
    script = r"""
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
from transformers import AutoModelForCausalLM
from rlray.actors.publisher import WeightPublisher
from rlray.parallel.dims import ParallelDims
from rlray.parallel.parallelize import parallelize
from rlray.config import TrainerConfig
from rlray.orchestration.weights_plan import wires
from tests.unit.test_weights_plan import tiny
for arch in ("glm4_moe", "deepseek_v3"):
    c, hf = tiny(arch, 8, 4, num_experts=8)
    expected, layouts, dims = wires(c, hf)
    model = AutoModelForCausalLM.from_config(hf)
    d = ParallelDims(8, ep=4)
    d.build_meshes("cpu")
    parallelize(model, d, TrainerConfig(num_ranks=8, ep=4))
    source = WeightPublisher(model, torch.device("cpu"), 5, torch.float32).shard_source(8)
    got = [(w.name, w.shape, w.itemsize, source.layouts[w.layout], w.param_shape, w.expert, w.part, w.flipped)
           for w in source.wires]
    want = [(w.name, w.shape, w.itemsize, layouts[w.layout], w.param_shape, w.expert, w.part, w.flipped)
            for w in expected]
    assert got == want, [(g, w) for g, w in zip(got, want) if g != w][:3]
    assert source.dims == dims, (source.dims, dims)
    print(arch, len(got), "wires agree")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "glm4_moe" in proc.stdout and "deepseek_v3" in proc.stdout, proc.stdout


def test_colocated_and_lora_runs_have_no_network_forecast() -> None:
    from rlray.orchestration.plan import shape_of

    c = Config()
    c.cluster.colocate = True
    assert weights_plan(c, shape_of(c)) is None
    c = Config()
    c.trainer.lora.rank = 4
    assert weights_plan(c, shape_of(c)) is None


def test_weight_fit_fits_on_its_fit_rows_and_predicts_the_others() -> None:
    """rlray.bench.weight-fit's `fitted`: each path's constants from its "fit" rows only; every row's prediction
    and error, the "check" rows' included (here measured 10% over what the fitted costs give)."""
    from rlray.bench.weight_fit import fitted

    truth = {"m2n": Costs(1e-3, 1e-9, 1e-4, 0.02), "broadcast": Costs(0.0, 2e-9, 2e-4, 0.05)}
    shapes = {"fit": [(8, 1e6, 25), (36, 1.2e7, 179), (10, 4e7, 30), (24, 9e7, 70)], "check": [(12, 1e7, 47)]}
    rows = [{"path": path, "set": kind, "fit_messages": m, "fit_bytes": b, "fit_tensors": t,
             "seconds": truth[path].seconds(m, b, t) * (1.1 if kind == "check" else 1.0)}
            for path in truth for kind, xs in shapes.items() for m, b, t in xs]
    costs = fitted(rows)
    for path, c in truth.items():
        assert costs[path].seconds(50, 1e8, 100) == pytest.approx(c.seconds(50, 1e8, 100), rel=1e-6)
    check = [r for r in rows if r["set"] == "check"]
    assert [r["error"] for r in check] == pytest.approx([1 / 1.1 - 1] * 2)
    assert all(abs(r["error"]) < 1e-9 for r in rows if r["set"] == "fit")


def test_a_tp2_worker_of_qwen3_vl_30b_receives_half_its_vision_tower_too() -> None:
    """Qwen3-VL-30B-A3B (the catalog's config, built on the meta device): a TP 2 worker of an m2n sync from 8 ranks
    (EP 8) receives about half the model, its vision tower (1.7% of the bytes) split as vLLM's loaders read it."""
    import dataclasses

    from rlray.models.catalog import architecture
    from rlray.weightsync.totals import Holders

    name = "Qwen/Qwen3-VL-30B-A3B-Instruct"
    c = Config()
    c.model.name, c.trainer.num_ranks, c.trainer.ep = name, 8, 8
    wire, layouts, dims = wires(c, architecture(name)[0])
    assert dims.sliced_vision and dims.sliced_experts
    whole = sum(w.nbytes for w in wire)
    tower = sum(w.nbytes for w in wire if ".visual." in f".{w.name}")
    split, kept = (totals(wire, layouts, 8, Engines((2,)), d, Holders(layouts)).received
                   for d in (dims, dataclasses.replace(dims, sliced_vision=False)))
    assert max(split) <= 0.55 * whole and 0.016 < tower / whole < 0.018, (split, whole, tower)
    assert max(kept) - max(split) == pytest.approx(tower / 2, rel=0.01)  # the tower whole: its other half too
