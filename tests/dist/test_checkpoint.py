"""Trainer save/load through DCP restores model and optimizer exactly, on 2 gloo ranks; each rank checksums
the files it wrote and verifies only those; a damaged checkpoint is set aside, kept, and skipped by
`latest`, `complete` and `prune`. A background save (DCP's async_save) holds the state of its save step
although training changed it before the write, which ends only when waited for; a write that fails
raises on `finish_save`, naming the folder, and leaves no DCP metadata."""

from __future__ import annotations

import threading
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
    out[f"sums{rank}"] = t.checksums(path)
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
    verify_and_set_aside(tmp_path / "ckpt_rl_00000001", out["sums0"], out["sums1"])


def verify_and_set_aside(folder: Path, sums0: dict, sums1: dict) -> None:
    """Rank 0 owns DCP's .metadata, its shard and RNG state, rank 1 its own two; a byte flipped in rank 1's
    shard is rank 1's finding alone, a cut file names its sizes, a lost one is missing."""
    from rlray.actors import state

    assert set(sums0) == {".metadata", "__0_0.distcp", "rng_rank0.pt"} and set(sums1) == {"__1_0.distcp",
                                                                                            "rng_rank1.pt"}
    files = {**sums0, **sums1}
    assert all(size == (folder / name).stat().st_size for name, (_, size, _) in files.items())
    assert state.verify(str(folder), 0, files) == state.verify(str(folder), 1, files) == []
    shard = folder / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert state.verify(str(folder), 0, files) == []
    assert state.verify(str(folder), 1, files) == ["__1_0.distcp does not match its checksum"]
    shard.write_bytes(bytes(data[:100]))
    (folder / "rng_rank1.pt").unlink()
    assert state.verify(str(folder), 1, files) == [f"__1_0.distcp has 100 bytes, {len(data)} when committed",
                                                   "rng_rank1.pt is missing"]
    root = folder.parent
    moved = checkpoint.set_aside(folder)
    assert moved.name == "ckpt_rl_00000001.damaged" and (moved / "meta.json").is_file()
    assert checkpoint.latest(root) is None and checkpoint.complete(root) == []
    for step in (1, 2, 3):  # a later commit of the damaged step, then two more with keep=1
        checkpoint.commit(checkpoint.staging(root, "rl", step), {"stage": "rl", "step": step, "saved_at": step}, 1)
    assert sorted(p.name for p in root.iterdir()) == ["ckpt_rl_00000001.damaged", "ckpt_rl_00000003"]
    assert checkpoint.set_aside(root / "ckpt_rl_00000003").name == "ckpt_rl_00000003.damaged"
    checkpoint.commit(checkpoint.staging(root, "rl", 3), {"stage": "rl", "step": 3, "saved_at": 4}, 1)
    assert checkpoint.set_aside(root / "ckpt_rl_00000003").name == "ckpt_rl_00000003.damaged2"


def background_worker(rank: int, world: int, port: int, out: dict, root: str) -> None:
    """The write is held back (each rank's `write_data` waits for `release`) while a train step moves the
    weights; the second save's write fails on rank 1."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from rlray.actors.trainer import TrainerActor

    release, real_write = threading.Event(), FileSystemWriter.write_data

    def held_write(self, plan, planner):  # noqa: ANN001, ANN202 - DCP's signature
        assert release.wait(60), "the test never released the write"
        if "fails" in str(self.path) and rank == 1:
            raise OSError("No space left on device")
        return real_write(self, plan, planner)

    FileSystemWriter.write_data = held_write
    t = TrainerActor(rank, world, f"127.0.0.1:{port}", MODEL, TrainerConfig(lr=1e-2, num_ranks=world),
                     algo_config(aggregation="token"), "gloo", temperature=1.0)
    t.setup()
    mbs = batch(world, rl=True)[rank]
    t.train_step(mbs)
    path = Path(root) / "ckpt_rl_00000001.tmp"
    saved = {n: p.clone() for n, p in t.publisher.full_params()}
    digest = t.save(str(path), background=True)
    t.train_step(mbs)  # while the write waits: the weights and Adam moments it holds change
    moved = {n: p.clone() for n, p in t.publisher.full_params()}
    out[f"unwritten{rank}"] = sorted(p.name for p in path.iterdir())  # before the write: RNG state only
    release.set()
    out[f"sums{rank}"] = t.finish_save()
    restored_digest = t.load(str(path))
    restored = {n: p.clone() for n, p in t.publisher.full_params()}
    release.clear()
    t.save(str(Path(root) / "fails.tmp"), background=True)
    release.set()
    try:
        t.finish_save()
    except RuntimeError as e:
        out[f"failed{rank}"] = str(e)
    if rank == 0:
        out["digests"] = (digest, restored_digest)
        out["moved"] = max(float((moved[n] - saved[n]).abs().max()) for n in saved)
        out["restored"] = max(float((restored[n] - saved[n]).abs().max()) for n in saved)
    torch.distributed.destroy_process_group()


def test_background_save_holds_the_save_steps_state(tmp_path) -> None:
    out = spawn(background_worker, 2, str(tmp_path))
    assert out["unwritten0"] == ["rng_rank0.pt", "rng_rank1.pt"]  # no shard, no .metadata until the write ends
    assert out["moved"] > 1e-4 and out["restored"] == 0.0
    assert out["digests"][0] == out["digests"][1]
    assert set(out["sums0"]) == {".metadata", "__0_0.distcp", "rng_rank0.pt"}
    assert set(out["sums1"]) == {"__1_0.distcp", "rng_rank1.pt"}
    for rank in (0, 1):
        assert out[f"failed{rank}"].startswith(f"writing checkpoint {tmp_path / 'fails.tmp'} failed ("), out
        assert "No space left on device" in out[f"failed{rank}"] and "\n" not in out[f"failed{rank}"]
    assert not (tmp_path / "fails.tmp" / ".metadata").exists()
    ckpt = checkpoint.commit(tmp_path / "ckpt_rl_00000001.tmp", {"stage": "rl", "step": 1, "saved_at": 0.0,
                                                                 "files": {**out["sums0"], **out["sums1"]}}, keep=1)
    assert checkpoint.latest(tmp_path) == ckpt
    from rlray.actors import state

    assert state.verify(str(ckpt), 0, checkpoint.read_meta(ckpt)["files"]) == []
