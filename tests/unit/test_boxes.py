"""The many-to-many shard plan (rlray.weightsync.boxes) against hand-computed boxes: FSDP2's uneven torch.chunk, EP x
FSDP's strided expert rows, replicas splitting their box, and vLLM's TP loader rules (q/k/v with replicated KV heads,
o and down by columns, the vocabulary padded to 64, fused and per-expert experts, engine EP's whole experts). On the
tiny twins (GLM-4.5 MoE, Qwen3-MoE, Qwen3-VL-MoE's transposed experts, a tied dense Qwen3) with trainers of 2 and 4
ranks: each worker's region is covered exactly once, a TP 2 worker receives at most 0.55x of what today's broadcast
sends it, and the busiest trainer rank sends at most 1.1x the mean."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlray.config import ModelConfig
from rlray.weightsync.boxes import (
    Box,
    Dims,
    Engines,
    Layout,
    Wire,
    parameters,
    plan,
    replicated,
    worker_boxes,
)

FSDP4 = Layout((4,), (0, 1, 2, 3), (("S", 0),))


def test_fsdp_chunks_rows_unevenly_as_torch_chunk_does() -> None:
    boxes = FSDP4.boxes((5, 3))
    assert boxes == {0: Box((0, 0), (2, 3)), 1: Box((2, 0), (2, 3)), 2: Box((4, 0), (1, 3))}  # rank 3 holds none
    assert FSDP4.held((5, 3), 3).shape[0] == 0


def test_experts_under_ep_and_fsdp_are_one_block_of_whole_experts_per_rank() -> None:
    # mesh (efsdp 2, ep 2), rank = f * ep + e: EP block e first (4 experts each), then FSDP chunk f inside it
    layout = Layout((2, 2), (0, 1, 2, 3), (("SS", 0, 2), ("S", 0)))
    rows = {r: (b.offset[0], b.shape[0]) for r, b in layout.boxes((8, 6, 4)).items()}
    assert rows == {0: (0, 2), 2: (2, 2), 1: (4, 2), 3: (6, 2)}


def test_replicas_split_their_box_so_each_byte_has_one_sender() -> None:
    assert replicated(range(3)).boxes((7, 2)) == {0: Box((0, 0), (3, 2)), 1: Box((3, 0), (3, 2)),
                                                  2: Box((6, 0), (1, 2))}


def wire(name: str, shape: tuple[int, ...], **kw: object) -> Wire:
    return Wire(name, shape, 2, 0, kw.pop("param_shape", shape), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "shape", "tp", "kv", "expected"), [
    ("model.layers.0.self_attn.q_proj.weight", (8, 4), 2, 2, [[(0, 4, 0, 4)], [(4, 4, 0, 4)]]),
    ("model.layers.0.self_attn.k_proj.weight", (4, 4), 2, 2, [[(0, 2, 0, 4)], [(2, 2, 0, 4)]]),
    # 4 TP ranks over 2 KV heads of 2 rows: ranks 0, 1 read head 0; ranks 2, 3 head 1
    ("model.layers.0.self_attn.v_proj.weight", (4, 4), 4, 2,
     [[(0, 2, 0, 4)], [(0, 2, 0, 4)], [(2, 2, 0, 4)], [(2, 2, 0, 4)]]),
    ("model.layers.0.self_attn.o_proj.weight", (4, 8), 2, 2, [[(0, 4, 0, 4)], [(0, 4, 4, 4)]]),
    ("model.layers.0.mlp.down_proj.weight", (4, 6), 2, 2, [[(0, 4, 0, 3)], [(0, 4, 3, 3)]]),
    ("model.layers.0.mlp.gate_proj.weight", (6, 4), 2, 2, [[(0, 3, 0, 4)], [(3, 3, 0, 4)]]),
    # vocab 51 padded to 64, 32 rows per rank: the last rank reads rows 32..50
    ("model.embed_tokens.weight", (51, 4), 2, 2, [[(0, 32, 0, 4)], [(32, 19, 0, 4)]]),
    ("lm_head.weight", (51, 4), 4, 2, [[(0, 16, 0, 4)], [(16, 16, 0, 4)], [(32, 16, 0, 4)], [(48, 3, 0, 4)]]),
    ("model.layers.0.input_layernorm.weight", (4,), 2, 2, [[(0, 4)], [(0, 4)]]),
    ("model.visual.blocks.0.mlp.down_proj.weight", (4, 6), 2, 2, [[(0, 4, 0, 6)], [(0, 4, 0, 6)]]),
])
def test_worker_regions_follow_vllms_tp_loaders(name: str, shape: tuple[int, ...], tp: int, kv: int,
                                                 expected: list[list[tuple[int, ...]]]) -> None:
    for rank, boxes in enumerate(expected):
        got = [tuple(x for pair in zip(b.offset, b.shape, strict=True) for x in pair)
               for b in worker_boxes(wire(name, shape), rank, tp, Dims(kv_heads=kv))]
        assert got == boxes, (name, rank, got)


def test_fused_experts_split_by_intermediate_rows_and_by_whole_experts_under_ep() -> None:
    dims = Dims(kv_heads=2, sliced_experts=True)
    gate_up = wire("model.layers.1.mlp.experts.gate_up_proj", (4, 8, 6))  # E 4, 2I 8 (gate rows 0-3, up 4-7), H 6
    assert worker_boxes(gate_up, 1, 2, dims) == [Box((0, 2, 0), (4, 2, 6)), Box((0, 6, 0), (4, 2, 6))]
    flipped = wire("model.layers.1.mlp.experts.gate_up_proj", (4, 6, 8), flipped=True)  # stored (E, H, 2I)
    assert worker_boxes(flipped, 0, 2, dims) == [Box((0, 0, 0), (4, 6, 2)), Box((0, 0, 4), (4, 6, 2))]
    down = wire("model.layers.1.mlp.experts.down_proj", (4, 6, 4))
    assert worker_boxes(down, 1, 2, dims) == [Box((0, 0, 2), (4, 6, 2))]
    assert worker_boxes(gate_up, 1, 3, dims, ep=True) == [Box((2, 0, 0), (1, 8, 6))]  # 4 experts over 3: 2, 1, 1
    one = wire("model.layers.1.mlp.experts.2.up_proj.weight", (4, 6), param_shape=(4, 8, 6), expert=2, part=(1, 2))
    assert worker_boxes(one, 1, 2, dims) == [Box((2, 0), (2, 6))]
    assert worker_boxes(one, 0, 2, dims, ep=True) == [] and worker_boxes(one, 1, 2, dims, ep=True) == [whole_box(one)]
    assert worker_boxes(gate_up, 0, 2, Dims(kv_heads=2)) == [whole_box(gate_up)]  # a family not marked: whole


def test_a_qwen3_vl_vision_tower_splits_as_vllms_tp_loaders_read_it() -> None:
    """By hand, from vllm 0.32's qwen3_vl.py: fused qkv (q, k, v of 4 rows each) split by heads within each, fc1
    rows and fc2 / attn.proj columns evenly, row-parallel biases, norms and embeddings whole."""
    vl, plain = Dims(kv_heads=2, sliced_vision=True), Dims(kv_heads=2)
    cases = {
        "model.visual.blocks.0.attn.qkv.weight": ((12, 4), [[(0, 2, 0, 4), (4, 2, 0, 4), (8, 2, 0, 4)],
                                                           [(2, 2, 0, 4), (6, 2, 0, 4), (10, 2, 0, 4)]]),
        "model.visual.blocks.1.attn.qkv.bias": ((12,), [[(0, 2), (4, 2), (8, 2)], [(2, 2), (6, 2), (10, 2)]]),
        "model.visual.blocks.0.attn.proj.weight": ((4, 4), [[(0, 4, 0, 2)], [(0, 4, 2, 2)]]),
        "model.visual.blocks.0.attn.proj.bias": ((4,), [[(0, 4)], [(0, 4)]]),
        "model.visual.blocks.0.mlp.linear_fc1.bias": ((6,), [[(0, 3)], [(3, 3)]]),
        "model.visual.blocks.0.mlp.linear_fc2.weight": ((4, 6), [[(0, 4, 0, 3)], [(0, 4, 3, 3)]]),
        "model.visual.merger.linear_fc1.weight": ((16, 16), [[(0, 8, 0, 16)], [(8, 8, 0, 16)]]),
        "model.visual.deepstack_merger_list.0.linear_fc2.weight": ((8, 16), [[(0, 8, 0, 8)], [(0, 8, 8, 8)]]),
        "model.visual.merger.linear_fc2.bias": ((8,), [[(0, 8)], [(0, 8)]]),
        "model.visual.blocks.0.norm1.weight": ((4,), [[(0, 4)], [(0, 4)]]),
        "model.visual.pos_embed.weight": ((9, 4), [[(0, 9, 0, 4)], [(0, 9, 0, 4)]]),
    }
    for name, (shape, expected) in cases.items():
        for rank, boxes in enumerate(expected):
            got = [tuple(x for pair in zip(b.offset, b.shape, strict=True) for x in pair)
                   for b in worker_boxes(wire(name, shape), rank, 2, vl)]
            assert got == boxes, (name, rank, got)
        assert worker_boxes(wire(name, shape), 1, 2, plain) == [whole_box(wire(name, shape))]  # unmarked: whole
    with pytest.raises(ValueError, match="do not split over 2"):
        worker_boxes(wire("model.visual.blocks.0.attn.qkv.weight", (9, 4)), 0, 2, vl)  # 3 heads over TP 2


def whole_box(w: Wire) -> Box:
    return Box((0,) * len(w.shape), w.shape)


def twin_wires(cfg: ModelConfig, trainers: int, ep: int) -> tuple[list[Wire], list[Layout], Dims]:
    """A twin's wire tensors as the trainer sends them, laid out as rlray's FSDP2 x EP trainer holds them."""
    from transformers import AutoModelForCausalLM

    from rlray.actors.publisher import WeightPublisher
    from rlray.models.tiny import model_path

    model = AutoModelForCausalLM.from_pretrained(model_path(cfg))
    source = WeightPublisher(model, torch.device("cpu"), 0, torch.bfloat16).shard_source(1)
    ranks = tuple(range(trainers))
    layouts = [Layout((trainers,), ranks, (("S", 0),)),
               Layout((trainers // ep, ep), ranks, (("SS", 0, ep), ("S", 0)))]
    expert = lambda w: ".experts." in w.name
    return [dataclasses.replace(w, layout=int(expert(w))) for w in source.wires], layouts, source.dims


TWINS = {
    "glm4_moe": ModelConfig(arch="glm4_moe", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                            intermediate_size=128, moe_intermediate_size=64, num_experts=4, experts_per_token=2),
    "qwen3_moe": ModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                             intermediate_size=128, moe_intermediate_size=64, num_experts=4, experts_per_token=2),
    "qwen3_tied": ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
                              tie_word_embeddings=True),
}


@pytest.mark.parametrize(("twin", "trainers", "ep"), [(t, n, ep) for t in sorted(TWINS) for n, ep in
                                                      ((2, 1), (2, 2), (4, 2)) if ep == 1 or "moe" in t])
def test_twin_plans_cover_each_region_once_and_balance_the_senders(twin: str, trainers: int, ep: int) -> None:
    wires, layouts, dims = twin_wires(TWINS[twin], trainers, ep)
    engines = Engines((2, 1))
    p = plan(wires, layouts, trainers, engines, dims)
    whole = sum(w.nbytes for w in wires)
    for dst, (tp_rank, tp) in enumerate(engines.workers()):
        region = sum(b.numel * w.itemsize for w in wires for b in worker_boxes(w, tp_rank, tp, dims))
        assert p.received[dst] == region  # every byte read arrives once, from one trainer rank
    assert p.received[2] == whole  # the TP 1 worker reads everything
    assert max(p.received[:2]) <= 0.55 * whole, (p.received, whole)
    assert sum(p.sent) == sum(p.received) and p.imbalance <= 1.1, (p.sent, p.imbalance)
    assert p.messages <= len(p.groups) * trainers * len(engines.workers())


def test_parameters_counts_a_fused_experts_tensor_sent_per_expert_once() -> None:
    """What the broadcast gathers: q_proj, and 3 experts' gate_up (sent as gate and up, 6 wires) and down (3 wires)
    from two fused parameters: 3 parameters from 10 wire tensors."""
    q = Wire("model.layers.0.self_attn.q_proj.weight", (8, 4), 2, 0, (8, 4))
    gate_up = [Wire(f"model.layers.0.mlp.experts.{e}.{part}", (2, 4), 2, 0, (3, 4, 4), e, (k, 2))
               for e in range(3) for k, part in enumerate(("gate_proj.weight", "up_proj.weight"))]
    down = [Wire(f"model.layers.0.mlp.experts.{e}.down_proj.weight", (4, 2), 2, 0, (3, 4, 2), e) for e in range(3)]
    assert parameters([q, *gate_up, *down]) == 3
