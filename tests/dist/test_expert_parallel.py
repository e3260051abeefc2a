"""Expert parallelism on gloo: 2 and 4 ranks, EP alone and with FSDP over the remaining ranks
(and activation checkpointing), give the loss and gradients of one plain transformers process
on the same global batch, for tiny Glm4Moe and Qwen3Moe. Every data-parallel rank trains on
its own sequences; one case routes no token at all to one rank's experts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlray.config import AlgoConfig, ModelConfig, TrainerConfig
from rlray.data.packing import Sample, pack
from rlray.models.tiny import model_path
from tests.dist.common import assert_grads_close, full_grads, spawn

SHAPE = {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128,
         "moe_intermediate_size": 32, "num_experts": 4, "experts_per_token": 2}
GLM = ModelConfig(arch="glm4_moe", seed=5, **SHAPE)
QWEN = ModelConfig(arch="qwen3_moe", seed=6, **SHAPE)
ROUTER = "model.layers.1.mlp.gate"  # the MoE layer (GLM's layer 0 is dense)


def samples() -> list[Sample]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(8):
        p, c = rng.integers(4, 40, size=3 + i % 4), rng.integers(4, 40, size=3 + i % 3)
        out.append(Sample(p, c, np.ones(len(c), np.float32), 0.0, np.zeros(len(c), np.float32)))
    return out


def biased_glm(folder) -> str:
    """GLM with e_score_correction_bias pushing every token to experts 0 and 1 (rank 0's at ep=2)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = model_path(GLM)
    model = AutoModelForCausalLM.from_pretrained(src)
    model.get_submodule(ROUTER).e_score_correction_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(src).save_pretrained(folder)
    return str(folder)


def reference(path: str) -> dict:
    """One plain transformers process over the whole batch: the independent computation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    (mb,) = pack(samples(), 1, micro_batch_tokens=4096, pad_id=0, packed=False)[0]  # a padded row each
    ids, mask = torch.tensor(mb.input_ids), torch.tensor(mb.loss_mask)
    logits = model(input_ids=ids, attention_mask=torch.tensor(mb.attention_mask)).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(logp * mask[:, 1:]).sum() / mask.sum()
    loss.backward()
    return {"loss": float(loss), "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters()}}


def worker(rank: int, world: int, port: int, out: dict, cases: list) -> None:
    import torch.distributed as dist

    from rlray.trainer import TrainerActor

    for key, path, ep, ac in cases:
        cfg = TrainerConfig(num_ranks=world, ep=ep, activation_checkpointing=ac, micro_batch_tokens=64)
        t = TrainerActor(rank, world, f"127.0.0.1:{port}", ModelConfig(name=path), cfg, AlgoConfig(), "gloo", 1.0)
        t.setup()
        mbs = pack(samples(), world, micro_batch_tokens=64, pad_id=0)[rank]
        sums = t.forward_backward(mbs, rl=False)
        loss = torch.tensor(sums["loss"] / mbs[0].num_loss_tokens_global, dtype=torch.float64)
        dist.all_reduce(loss)
        grads = full_grads(t.model)
        counts = torch.stack(t.expert_load.counts)
        dist.all_reduce(counts)
        positions = torch.tensor(sum(mb.input_ids.size for mb in mbs))  # the router sees padding too
        dist.all_reduce(positions)
        first = int(mbs[0].input_ids[0, 0])
        firsts = [None] * world
        dist.all_gather_object(firsts, first)
        if rank == 0:
            out[key] = {"loss": float(loss), "grads": grads, "counts": counts.numpy(), "firsts": firsts,
                        "positions": int(positions),
                        "local_experts": int(t.model.get_submodule("model.layers.1.mlp.experts").num_experts)}
    dist.destroy_process_group()


def check(result: dict, ref: dict, ep: int) -> None:
    assert result["loss"] == pytest.approx(ref["loss"], rel=1e-4)
    assert_grads_close(ref["grads"], result["grads"], rtol=1e-4)
    assert len(set(result["firsts"])) > 1, "data-parallel ranks must train on different sequences"
    assert result["local_experts"] == 4 // ep
    # every position routed to top-2 experts once: counted in the forward, not again in a recomputation
    assert result["counts"].sum() == 2 * result["positions"] * len(result["counts"])


def test_expert_parallel_matches_one_process(tmp_path) -> None:
    glm, qwen, biased = model_path(GLM), model_path(QWEN), biased_glm(tmp_path / "biased")
    refs = {"glm": reference(glm), "qwen": reference(qwen), "biased": reference(biased)}

    two = spawn(worker, 2, [("glm", glm, 2, False), ("qwen", qwen, 2, False), ("biased", biased, 2, False)])
    for key in ("glm", "qwen", "biased"):
        check(two[key], refs[key], ep=2)
    counts = two["biased"]["counts"][0]  # tokens per expert of the one MoE layer, over both ranks
    assert counts[2] == counts[3] == 0 and counts[0] == counts[1] > 0  # rank 1's experts get no token

    four = spawn(worker, 4, [("glm_fsdp_ac", glm, 2, True), ("qwen_ep4", qwen, 4, False),
                             ("qwen_fsdp", qwen, 2, False)])
    check(four["glm_fsdp_ac"], refs["glm"], ep=2)  # EP 2 x FSDP 2 over experts, checkpointed layers
    check(four["qwen_ep4"], refs["qwen"], ep=4)
    check(four["qwen_fsdp"], refs["qwen"], ep=2)
