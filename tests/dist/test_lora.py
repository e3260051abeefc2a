"""LoRA on the FSDP2 trainer: on 2 gloo ranks the adapters' gradients equal one process's on the
same batch; the SFT stage trains the base's full weights and leaves the adapters, RL trains only
the adapters and leaves the base bit for bit; a zero-initialised adapter leaves the base model's
logprobs unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlray.algo.loss import algo_config
from rlray.config import LoraConfig, ModelConfig, TrainerConfig
from rlray.models.lora import checkpoint_name, is_adapter
from rlray.models.tiny import model_path
from tests.dist.common import assert_grads_close, full_grads, spawn
from tests.dist.test_fsdp_trainer import MODEL, batch

LORA = LoraConfig(rank=4, alpha=8.0)
SEQ = [3, 17, 5, 22, 9, 14, 28, 6, 11, 4]


def full_params(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().numpy().copy()
            for n, p in model.named_parameters()}


def worker(rank: int, world: int, port: int, out: dict) -> None:
    from rlray.actors.trainer import TrainerActor

    t = TrainerActor(rank, world, f"127.0.0.1:{port}", MODEL, TrainerConfig(lr=1e-2, num_ranks=world, lora=LORA),
                     algo_config(), "gloo", temperature=0.7)
    t.setup()
    start = full_params(t.model)
    logprobs = t.logprobs(SEQ, 1)
    t.set_stage(1e-2, 0, "sft")  # with LoRA, SFT trains the base's full weights
    t.sft_step(batch(world, False)[rank])
    after_sft = full_params(t.model)
    t.set_stage(1e-2, 0, "rl")  # and RL the adapters on that base
    rounds = []
    for _ in range(2):  # lora_B starts at zero: lora_A has a gradient from the second round on
        mbs = batch(world, True)[rank]
        t.forward_backward(mbs, True)
        grads = full_grads(t.model)
        t.learner.optimizer.zero_grad(set_to_none=True)
        rounds.append({"metrics": t.train_step(mbs), "grads": grads})
    end = full_params(t.model)
    trainable = [n for n, p in t.model.named_parameters() if p.requires_grad]
    if rank == 0:
        out.update(rounds=rounds, start=start, after_sft=after_sft, end=end, trainable=trainable, logprobs=logprobs,
                   optimized=sum(len(g["params"]) for g in t.learner.optimizer.param_groups))
    torch.distributed.destroy_process_group()


def test_lora_two_ranks_match_one_process_and_the_base_stays() -> None:
    path = model_path(MODEL)
    one, two = spawn(worker, 1), spawn(worker, 2)
    adapters = [n for n in one["start"] if is_adapter(n)]
    # q, k, v, o, gate, up, down in each of 2 layers, an A and a B each; nothing else trains
    assert len(adapters) == 2 * 7 * 2 and one["trainable"] == two["trainable"] == adapters
    assert one["optimized"] == two["optimized"] == len(adapters)
    for a, b in zip(one["rounds"], two["rounds"]):
        assert a["metrics"]["loss"] == pytest.approx(b["metrics"]["loss"], rel=1e-5)
        assert_grads_close(a["grads"], b["grads"], rtol=1e-4)
    last = one["rounds"][1]["grads"]
    assert all(np.abs(last[n]).max() > 0 for n in adapters), "every adapter has a gradient in the second round"
    for name in one["start"]:  # the same adapters start on 1 and 2 ranks (seeded per name, sliced per shard)
        np.testing.assert_array_equal(one["start"][name], two["start"][name])
    # the base starts as the checkpoint, SFT moves it (not the adapters), RL leaves it bit for bit
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    for run in (one, two):
        for name, value in run["end"].items():
            before, sft = run["start"][name], run["after_sft"][name]
            if is_adapter(name):
                np.testing.assert_array_equal(sft, before, err_msg=name)
                assert not np.array_equal(value, sft), name
            else:
                np.testing.assert_array_equal(before, base[checkpoint_name(name)].numpy(), err_msg=name)
                np.testing.assert_array_equal(value, sft, err_msg=name)
        moved = [n for n in run["start"] if not is_adapter(n) and not np.array_equal(run["after_sft"][n], run["start"][n])]
        assert len(moved) > len(adapters) // 2, moved
    # lora_B starts at zero: the wrapped model scores a sequence as the base does
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([SEQ])).logits[0]
    expected = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(SEQ[1:])[:, None]).squeeze(-1)
    np.testing.assert_allclose(one["logprobs"], expected.numpy(), rtol=1e-5, atol=1e-5)
