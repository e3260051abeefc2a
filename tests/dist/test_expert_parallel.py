"""Expert parallelism on gloo: 2 and 4 ranks, EP alone and with FSDP over the remaining ranks
(and activation checkpointing), give the loss and gradients of one plain transformers process
on the same global batch, for tiny Glm4Moe and Qwen3Moe. Every data-parallel rank trains on
its own sequences; one case routes no token at all to one rank's experts. With router replay (EP x
FSDP, packing, activation checkpointing) every experts call, recomputation included, gets the
engine's experts for every routed token, and the result matches one process replaying them. With
LoRA adapters (EP 2) the adapters' gradients match one process's and the experts stay frozen."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlray.algo.loss import algo_config

from rlray.config import LoraConfig, ModelConfig, TrainerConfig
from rlray.data.packing import Sample, pack
from rlray.data.layout import model_inputs
from rlray.models.lora import apply_lora, init_adapters
from rlray.models.tiny import model_path
from rlray.parallel.expert import moe_experts
from rlray.parallel.routing import RouterReplay
from rlray.types import no_route
from tests.dist.common import assert_grads_close, full_grads, spawn

SHAPE = {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128,
         "moe_intermediate_size": 32, "num_experts": 4, "experts_per_token": 2}
GLM = ModelConfig(arch="glm4_moe", seed=5, **SHAPE)
QWEN = ModelConfig(arch="qwen3_moe", seed=6, **SHAPE)
ROUTER = "model.layers.1.mlp.gate"  # the MoE layer (GLM's layer 0 is dense)
LORA = LoraConfig(rank=4)


def engine_routing(rng: np.random.Generator, positions: int, layers: int) -> np.ndarray:
    """Experts an engine might have routed to: any top-2 of 4 per (position, layer), the last position none."""
    r = np.stack([np.stack([rng.permutation(4)[:2] for _ in range(layers)]) for _ in range(positions)])
    r[-1] = no_route(np.uint8)
    return r.astype(np.uint8)


def samples(routing_layers: int = 0) -> list[Sample]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(8):
        p, c = rng.integers(4, 40, size=3 + i % 4), rng.integers(4, 40, size=3 + i % 3)
        routing = engine_routing(rng, len(p) + len(c), routing_layers) if routing_layers else None
        out.append(Sample(p, c, np.ones(len(c), np.float32), 0.0, np.zeros(len(c), np.float32), routing=routing))
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


def reference(path: str, routing_layers: int = 0, lora: bool = False) -> dict:
    """One plain transformers process over the whole batch: the independent computation (with
    `routing_layers`, replaying the samples' routing over a padded row each; with `lora`, PEFT's
    adapters as the trainer initialises them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora:
        apply_lora(model, LORA)
        init_adapters(model, seed=0)
    (mb,) = pack(samples(routing_layers), 1, micro_batch_tokens=4096, pad_id=0, packed=False)[0]  # a padded row each
    ids, mask = torch.tensor(mb.input_ids), torch.tensor(mb.loss_mask)
    replay = RouterReplay(model, replay=True)
    routing = torch.tensor(mb.routing.reshape(-1, *mb.routing.shape[2:]).astype(np.int64)) if routing_layers else None
    with replay.routing(routing):
        logits = model(input_ids=ids, attention_mask=torch.tensor(mb.attention_mask)).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(logp * mask[:, 1:]).sum() / mask.sum()
    loss.backward()
    return {"loss": float(loss.detach()), "grads": {n: p.grad.numpy().copy() if p.grad is not None else np.zeros(p.shape, np.float32)
                                           for n, p in model.named_parameters()}}


def worker(rank: int, world: int, port: int, out: dict, cases: list) -> None:
    import torch.distributed as dist

    from rlray.actors.trainer import TrainerActor

    for key, path, ep, ac, routing_layers, *lora in cases:
        cfg = TrainerConfig(num_ranks=world, ep=ep, activation_checkpointing=ac, micro_batch_tokens=64,
                            router_replay=routing_layers > 0, lora=LORA if lora else LoraConfig())
        t = TrainerActor(rank, world, f"127.0.0.1:{port}", ModelConfig(name=path), cfg, algo_config(), "gloo", 1.0)
        t.setup()
        mbs = pack(samples(routing_layers), world, micro_batch_tokens=64, pad_id=0)[rank]
        calls = record_expert_calls(t.model)
        sums = t.forward_backward(mbs, rl=False)
        if routing_layers:
            replayed_everywhere(calls, mbs, 2 if ac else 1)
        loss = torch.tensor(sums["loss"] / mbs[0].num_loss_tokens_global, dtype=torch.float64)
        dist.all_reduce(loss)
        grads = full_grads(t.model)
        counts = torch.stack(t.learner.expert_load.counts)
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


def record_expert_calls(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """Per MoE layer, the expert indices each call of its experts module got (recomputation too)."""
    calls: list[list[torch.Tensor]] = []
    for _, module in moe_experts(model):
        calls.append([])
        module.register_forward_pre_hook(lambda _m, args, log=calls[-1]: log.append(args[1].detach().clone()))
    return calls


def replayed_everywhere(calls: list[list[torch.Tensor]], mbs: list, calls_per_micro_batch: int) -> None:
    """Every routed token of every micro-batch went to the engine's experts, in each call."""
    for layer, log in enumerate(calls):
        assert len(log) == len(mbs) * calls_per_micro_batch
        for j, got in enumerate(log):
            want = torch.tensor(model_inputs(mbs[j // calls_per_micro_batch], torch.device("cpu"))["routing"][:, layer])
            routed = (want < 4).all(-1)
            assert routed.sum() > 0 and torch.equal(got[routed], want[routed])


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

    refs["glm_lora"] = reference(glm, lora=True)
    two = spawn(worker, 2, [("glm", glm, 2, False, 0), ("qwen", qwen, 2, False, 0), ("biased", biased, 2, False, 0),
                            ("glm_lora", glm, 2, False, 0, 1)])
    for key in ("glm", "qwen", "biased", "glm_lora"):
        check(two[key], refs[key], ep=2)
    # LoRA under EP: the adapters (attention, the dense layer, the shared experts) learn through the
    # all-to-all, the experts stay frozen
    lora_grads = two["glm_lora"]["grads"]
    assert np.abs(lora_grads["model.layers.1.mlp.shared_experts.up_proj.lora_B.default.weight"]).max() > 0
    assert not np.abs(lora_grads["model.layers.1.mlp.experts.gate_up_proj"]).any()
    counts = two["biased"]["counts"][0]  # tokens per expert of the one MoE layer, over both ranks
    assert counts[2] == counts[3] == 0 and counts[0] == counts[1] > 0  # rank 1's experts get no token

    refs["qwen_replay"] = reference(qwen, routing_layers=2)
    four = spawn(worker, 4, [("glm_fsdp_ac", glm, 2, True, 0), ("qwen_ep4", qwen, 4, False, 0),
                             ("qwen_fsdp", qwen, 2, False, 0), ("qwen_replay", qwen, 2, True, 2)])
    check(four["glm_fsdp_ac"], refs["glm"], ep=2)  # EP 2 x FSDP 2 over experts, checkpointed layers
    check(four["qwen_ep4"], refs["qwen"], ep=4)
    check(four["qwen_fsdp"], refs["qwen"], ep=2)
    check(four["qwen_replay"], refs["qwen_replay"], ep=2)  # EP 2 x FSDP 2, checkpointed, replayed
    assert np.abs(four["qwen_replay"]["grads"][ROUTER + ".weight"]).max() > 0  # the router still learns
