"""FSDP2 over 2 gloo ranks takes the same optimizer step as 1 process on the same batch."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from rlray.config import AlgoConfig, ModelConfig, TrainerConfig
from rlray.data.packing import Sample, pack
from rlray.models.tiny import model_path

MODEL = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, seed=3)


def batch(num_ranks: int, rl: bool) -> list:
    rng = np.random.default_rng(0)
    samples = []
    for i in range(8):
        p, c = rng.integers(4, 30, size=3 + i % 3), rng.integers(4, 30, size=2 + i % 4)
        logp = np.full(len(c), -3.0, np.float32)
        samples.append(Sample(p, c, np.ones(len(c), np.float32), float(rng.normal()) if rl else 0.0, logp))
    return pack(samples, num_ranks, micro_batch_tokens=24, pad_id=0)


def worker(rank: int, world: int, port: int, rl: bool, out: dict) -> None:
    from rlray.trainer import TrainerActor

    t = TrainerActor(rank, world, f"127.0.0.1:{port}", MODEL, TrainerConfig(lr=1e-2, num_ranks=world),
                     AlgoConfig(), "gloo", temperature=0.7)
    t.setup()
    metrics = t.train_step(batch(world, rl)[rank]) if rl else t.sft_step(batch(world, rl)[rank])
    full = {n: p.detach().clone() for n, p in t._full_params()}
    if rank == 0:
        out["metrics"] = metrics
        out["params"] = {k: v.numpy() for k, v in full.items() if k.endswith("q_proj.weight")}
    torch.distributed.destroy_process_group()


def run(world: int, rl: bool) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(worker, args=(world, port, rl, out), nprocs=world, join=True)
    return dict(out)


def test_fsdp_two_ranks_match_one_process() -> None:
    model_path(MODEL)  # build the shared tiny model once
    for rl in (False, True):
        one, two = run(1, rl), run(2, rl)
        assert one["metrics"]["loss"] == pytest.approx(two["metrics"]["loss"], rel=1e-5)
        assert one["metrics"]["grad_norm"] == pytest.approx(two["metrics"]["grad_norm"], rel=1e-4)
        for name, p in one["params"].items():
            np.testing.assert_allclose(p, two["params"][name], atol=1e-5, err_msg=name)
