"""Context parallelism on gloo: cp=2 on 2 processes, and cp=2 with FSDP (plus activation
checkpointing) or with EP on 4, give the loss and gradients of one process on the same batch
of uneven sequences, for a sequence-mean and a sequence-ratio loss; cp=2 with LoRA adapters too. The MoE runs replay the
engine's routing (each cp rank its own share of the positions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rlray.algo.loss import algo_config

from rlray.algo.loss import get_loss
from rlray.config import LoraConfig, ModelConfig, TrainerConfig
from rlray.data.packing import Sample, pack
from rlray.models.tiny import model_path
from tests.dist.common import assert_grads_close, full_grads, spawn
from tests.dist.test_expert_parallel import engine_routing

DENSE = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, seed=3)
MOE = ModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
                  moe_intermediate_size=32, num_experts=4, experts_per_token=2, seed=6)
LOSSES = ("grpo", "gspo")


def samples(routing_layers: int = 0) -> list[Sample]:
    rng = np.random.default_rng(2)
    out = []
    for i in range(8):
        p, c = rng.integers(4, 30, size=3 + i % 4), rng.integers(4, 30, size=2 + (i * 5) % 17)
        logp = rng.uniform(-4, -1, len(c)).astype(np.float32)
        routing = engine_routing(np.random.default_rng(i), len(p) + len(c), routing_layers) if routing_layers else None
        out.append(Sample(p, c, np.ones(len(c), np.float32), float(rng.normal()), logp, routing=routing))
    return out


def worker(rank: int, world: int, port: int, out: dict, cases: list) -> None:
    from rlray.actors.trainer import TrainerActor

    for key, model, cp, ep, ac, *lora in cases:
        replay = model == MOE  # (a copy: the case crossed a process boundary)
        cfg = TrainerConfig(num_ranks=world, cp=cp, ep=ep, activation_checkpointing=ac, router_replay=replay,
                            lora=LoraConfig(rank=4) if lora else LoraConfig())
        t = TrainerActor(rank, world, f"127.0.0.1:{port}", model, cfg, algo_config(), "gloo", temperature=0.7)
        t.setup()
        for name in LOSSES:
            t.learner.algo, t.learner.loss_fn = algo_config(loss=name), get_loss(name)
            t.learner.optimizer.zero_grad(set_to_none=True)
            mbs = pack(samples(2 if replay else 0), world, micro_batch_tokens=48, pad_id=0, cp=cp)[rank]
            sums = t.forward_backward(mbs, rl=True)
            loss = torch.tensor([sums["loss"], sums.get("_router_pairs", 0.0)], dtype=torch.float64)
            dist.all_reduce(loss)
            grads = full_grads(t.model)
            if rank == 0:
                out[(key, name)] = {"loss": float(loss[0]) / sums["_norm"], "grads": grads, "micro_batches": len(mbs),
                                    "routed_pairs": float(loss[1])}
    dist.destroy_process_group()


def check(result: dict, ref: dict) -> None:
    assert result["loss"] == pytest.approx(ref["loss"], rel=1e-4)
    assert_grads_close(ref["grads"], result["grads"], rtol=1e-4)


def test_context_parallel_matches_one_process() -> None:
    model_path(DENSE), model_path(MOE)
    one = spawn(worker, 1, [("dense", DENSE, 1, 1, False), ("moe", MOE, 1, 1, False), ("lora", DENSE, 1, 1, False, 1)])
    # cp alone: both ranks split one batch; and with LoRA adapters (the base frozen)
    two = spawn(worker, 2, [("cp2", DENSE, 2, 1, False), ("cp2_lora", DENSE, 2, 1, False, 1)])
    four = spawn(worker, 4, [("cp2_fsdp2_ac", DENSE, 2, 1, True), ("cp2_ep2", MOE, 2, 2, False)])
    for name in LOSSES:
        assert two[("cp2", name)]["micro_batches"] >= 2
        check(two[("cp2", name)], one[("dense", name)])
        check(two[("cp2_lora", name)], one[("lora", name)])
        assert np.abs(one[("lora", name)]["grads"]["model.layers.1.self_attn.q_proj.lora_B.default.weight"]).max() > 0
        check(four[("cp2_fsdp2_ac", name)], one[("dense", name)])
        check(four[("cp2_ep2", name)], one[("moe", name)])
        # every routed (position, layer) replayed once over the cp and data-parallel ranks, as on one process
        assert four[("cp2_ep2", name)]["routed_pairs"] == one[("moe", name)]["routed_pairs"] > 0
