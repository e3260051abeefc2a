"""Trainer save/load through DCP restores model and optimizer exactly, on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rlray.algo.loss import algo_config

from rlray.orchestration import checkpoint
from rlray.config import TrainerConfig
from tests.dist.common import spawn
from tests.dist.test_fsdp_trainer import MODEL, batch


def worker(rank: int, world: int, port: int, out: dict, root: str) -> None:
    from rlray.actors.trainer import TrainerActor

    t = TrainerActor(rank, world, f"127.0.0.1:{port}", MODEL, TrainerConfig(lr=1e-2, num_ranks=world),
                     algo_config(aggregation="token"), "gloo", temperature=1.0)
    t.setup()
    mbs = batch(world, rl=True)[rank]
    t.train_step(mbs)
    tmp = checkpoint.staging(Path(root), "rl", 1) if rank == 0 else None
    path = str(Path(root) / "ckpt_rl_00000001.tmp")
    torch.distributed.barrier()
    t.save(path)
    saved = {n: p.clone() for n, p in t.publisher.full_params()}
    after_save = t.train_step(mbs)  # moves the weights and the Adam moments
    moved = {n: p.clone() for n, p in t.publisher.full_params()}
    t.load(path)
    restored = {n: p.clone() for n, p in t.publisher.full_params()}
    replay = t.train_step(mbs)  # the same step from the same model *and Adam state*: the same weights
    replayed = {n: p.clone() for n, p in t.publisher.full_params()}
    if rank == 0:
        checkpoint.commit(tmp, {"stage": "rl", "step": 1, "saved_at": 0.0}, keep=1)
        out["moved"] = max(float((moved[n] - saved[n]).abs().max()) for n in saved)
        out["restored"] = max(float((restored[n] - saved[n]).abs().max()) for n in saved)
        out["replayed"] = max(float((replayed[n] - moved[n]).abs().max()) for n in saved)
        out["loss"] = (after_save["loss"], replay["loss"])
        out["grad_norm"] = (after_save["grad_norm"], replay["grad_norm"])
    torch.distributed.destroy_process_group()


def test_save_load_round_trip(tmp_path) -> None:
    out = spawn(worker, 2, str(tmp_path))
    assert out["moved"] > 1e-4
    assert out["restored"] == 0.0
    assert out["replayed"] < 1e-6
    np.testing.assert_allclose(out["loss"][0], out["loss"][1], rtol=1e-6)
    np.testing.assert_allclose(out["grad_norm"][0], out["grad_norm"][1], rtol=1e-6)
    assert checkpoint.latest(tmp_path).name == "ckpt_rl_00000001"
