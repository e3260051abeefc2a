"""Checkpoints written in the background (checkpoint.async_save), over stand-in trainer ranks (Ray actors
that write one file each and finish when released): meta.json is the save step's, the folder is renamed
into place only once every rank's write has ended, one save is in flight (a second waits for and commits
the first), a write that fails on one rank is never committed and raises one line naming the checkpoint,
and a pending checkpoint whose rank died is dropped with one line. Synchronously, `save` commits before it
returns."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import ray

from rlray.orchestration import checkpoint
from rlray.orchestration.cluster import CHECKPOINT


class Rank:
    """A trainer rank's save protocol: `save` returns at once, `finish_save` when released."""

    def __init__(self, rank: int) -> None:
        self.rank, self.path, self.gate = rank, "", threading.Event()
        self.gate.set()

    def hold(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def save(self, path: str, background: bool) -> str:
        self.path = path
        Path(path, f"shard{self.rank}").write_text(f"rank {self.rank}\n")
        return "digest"

    def finish_save(self) -> dict[str, list[int]]:
        assert self.gate.wait(60)
        if self.rank == 1 and "00000002" in self.path:
            raise RuntimeError(f"writing checkpoint {self.path} failed (rank 1: OSError: No space left on device); "
                               "it must not be committed")
        return {f"shard{self.rank}": [self.rank, 7, 0]}


def test_a_background_checkpoint_commits_only_once_written(ray_cluster, tmp_path, capsys) -> None:
    ranks = [ray.remote(concurrency_groups={CHECKPOINT: 1})(Rank).options(num_cpus=0).remote(i) for i in range(2)]
    ckpts = checkpoint.Checkpoints(tmp_path, ranks, keep=5, background=True, timeout_s=5)
    hold = lambda: ray.get([r.hold.remote() for r in ranks])
    release = lambda: ray.get([r.release.remote() for r in ranks])

    sync = checkpoint.Checkpoints(tmp_path / "sync", ranks, keep=1)  # checkpoint.async_save=false
    assert sync.save("rl", 1, {}) == tmp_path / "sync" / "ckpt_rl_00000001" and sync.pending is None
    assert set(checkpoint.read_meta(tmp_path / "sync" / "ckpt_rl_00000001")["files"]) == {"shard0", "shard1"}

    hold()
    meta = {"buffer": {"next": 1}}
    final = ckpts.save("rl", 1, meta)
    meta["buffer"]["next"] = 2  # the run goes on changing its state
    assert final == tmp_path / "ckpt_rl_00000001" and not final.exists() and ckpts.poll() is None
    assert checkpoint.latest(tmp_path) is None
    release()
    assert ckpts.wait() == final and checkpoint.latest(tmp_path) == final
    saved = checkpoint.read_meta(final)
    assert saved["buffer"] == {"next": 1} and saved["weights"] == "digest"
    assert saved["files"] == {"shard0": [0, 7, 0], "shard1": [1, 7, 0]}

    final = ckpts.save("rl", 2, meta)  # rank 1's write fails
    with pytest.raises(RuntimeError) as info:
        ckpts.wait()
    message = str(info.value)
    assert "\n" not in message and message.startswith("checkpoint ckpt_rl_00000002 was not committed: "), message
    assert "No space left on device" in message
    assert not final.exists() and not final.with_suffix(".tmp").exists()
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt_rl_00000001" and ckpts.pending is None

    hold()
    ckpts.save("rl", 3, meta)
    threading.Timer(0.5, release).start()
    ckpts.save("rl", 4, meta)  # waits for step 3's writes, commits it, then starts its own
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["ckpt_rl_00000001", "ckpt_rl_00000003"]
    assert ckpts.wait() == tmp_path / "ckpt_rl_00000004"

    hold()
    ckpts.save("rl", 5, meta)
    ray.get(ranks[0].release.remote())
    ray.kill(ranks[1])
    capsys.readouterr()
    ckpts.settle()
    out = capsys.readouterr().out
    assert out.startswith("checkpoint ckpt_rl_00000005 was not committed: trainer-1's write did not end ("), out
    assert not (tmp_path / "ckpt_rl_00000005.tmp").exists() and ckpts.pending is None
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt_rl_00000004"
    assert json.loads((tmp_path / "ckpt_rl_00000004" / "meta.json").read_text())["step"] == 4
    ray.kill(ranks[0])
