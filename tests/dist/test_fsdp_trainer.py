"""FSDP2 over 2 gloo ranks computes the same loss and gradients as 1 process on the same batch,
and one optimizer step reports the same loss and gradient norm. The trainer's weight source passes
vLLM's own NCCL trainer engine's check (metadata and iteration agree, full tensors in the wire dtype)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlray.algo.loss import algo_config

from rlray.config import ModelConfig, TrainerConfig
from rlray.data.packing import Sample, pack
from rlray.models.tiny import model_path
from tests.dist.common import assert_grads_close, full_grads, spawn

MODEL = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, seed=3)


def batch(num_ranks: int, rl: bool) -> list:
    rng = np.random.default_rng(0)
    samples = []
    for i in range(8):
        p, c = rng.integers(4, 30, size=3 + i % 3), rng.integers(4, 30, size=2 + i % 4)
        logp = np.full(len(c), -3.0, np.float32)
        samples.append(Sample(p, c, np.ones(len(c), np.float32), float(rng.normal()) if rl else 0.0, logp))
    return pack(samples, num_ranks, micro_batch_tokens=24, pad_id=0)


def worker(rank: int, world: int, port: int, out: dict) -> None:
    from rlray.actors.trainer import TrainerActor

    t = TrainerActor(rank, world, f"127.0.0.1:{port}", MODEL, TrainerConfig(lr=1e-2, num_ranks=world),
                     algo_config(), "gloo", temperature=0.7)
    t.setup()
    for rl in (False, True):
        mbs = batch(world, rl)[rank]
        t.forward_backward(mbs, rl)
        grads = full_grads(t.model)
        t.learner.optimizer.zero_grad(set_to_none=True)
        metrics = t.train_step(mbs) if rl else t.sft_step(mbs)
        if rank == 0:
            out[rl] = {"metrics": metrics, "grads": grads}
    if world > 1:  # the weight source against vLLM's own NCCL trainer engine's check of it, in bf16 as GPUs send
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

        t.publisher.wire_dtype = torch.bfloat16
        source = t.weight_source()
        sent = [(n, x.dtype, tuple(x.shape)) for n, x in NCCLTrainerWeightTransferEngine._checked_iter(source,
                                                                                                     source.metadata())]
        if rank == 0:
            out["sent"] = sent
    torch.distributed.destroy_process_group()


def test_fsdp_two_ranks_match_one_process() -> None:
    model_path(MODEL)  # build the shared tiny model once
    one, two = spawn(worker, 1), spawn(worker, 2)
    for rl in (False, True):
        assert one[rl]["metrics"]["loss"] == pytest.approx(two[rl]["metrics"]["loss"], rel=1e-5)
        assert one[rl]["metrics"]["grad_norm"] == pytest.approx(two[rl]["metrics"]["grad_norm"], rel=1e-4)
        assert_grads_close(one[rl]["grads"], two[rl]["grads"], rtol=1e-4)
    # every parameter, full-sized (gathered from both ranks' shards), in the wire dtype, as metadata() declared
    assert [(n, tuple(g.shape)) for n, g in one[True]["grads"].items()] == [(n, s) for n, _, s in two["sent"]]
    assert {d for _, d, _ in two["sent"]} == {torch.bfloat16}
