"""The tiny-model cache is rank-safe: ranks with torch.distributed initialised (where
transformers' save_pretrained writes nothing but on rank 0) always commit a loadable entry,
and an entry whose files were truncated is rebuilt instead of loaded."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from rlray.config import ModelConfig
from rlray.models.tiny import MANIFEST, is_complete, model_path
from tests.dist.common import spawn

FIRST = ModelConfig(num_layers=1, hidden_size=64, intermediate_size=64, num_heads=2, num_kv_heads=1, seed=11)
SECOND = ModelConfig(arch="qwen3_moe", num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1,
                     moe_intermediate_size=32, seed=12)


def worker(rank: int, world: int, port: int, out: dict, cache: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:  # a rank other than 0 builds alone: under the old cache it wrote only the tokenizer
        model_path(FIRST, Path(cache))
    dist.barrier()
    model_path(SECOND, Path(cache))  # both ranks at once
    dist.barrier()
    dist.destroy_process_group()


def _loads(path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert len(AutoTokenizer.from_pretrained(path)) > 0


def test_ranks_build_loadable_entries_and_a_truncated_one_is_rebuilt(tmp_path) -> None:
    spawn(worker, 2, str(tmp_path))
    entries = sorted(p for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert len(entries) == 2 and all(is_complete(e) for e in entries)
    for cfg in (FIRST, SECOND):
        path = model_path(cfg, tmp_path)  # a cache hit: no rebuild
        assert Path(path) in entries
        _loads(path)

    path = Path(model_path(FIRST, tmp_path))
    weights = next(path.glob("*.safetensors"))
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size // 2)
    assert not is_complete(path)
    assert model_path(FIRST, tmp_path) == str(path)
    assert is_complete(path) and weights.stat().st_size == size
    _loads(str(path))
    (path / MANIFEST).unlink()  # an entry without a manifest (a crash before commit) is not trusted
    assert not is_complete(path)
    model_path(FIRST, tmp_path)
    assert is_complete(path)
