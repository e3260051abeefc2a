"""rlray.models.writer: a safetensors file written one tensor at a time reads back as `save_file`'s would (safetensors'
own reader, every dtype the export writes, a 0-dim and an empty tensor, the metadata), and a write off its plan fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlray.models.writer import SafetensorsWriter


def test_a_streamed_file_reads_back_whole(tmp_path: Path) -> None:
    from safetensors import safe_open

    g = torch.Generator().manual_seed(0)
    tensors = {"b": torch.randn(3, 5, generator=g).bfloat16(), "a.weight": torch.randn(7, generator=g),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
               "ids": torch.arange(5, dtype=torch.int64), "t": torch.randn(4, 6, generator=g).t()}  # not contiguous
    path = tmp_path / "x.safetensors"
    with SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], {"format": "pt"}) as w:
        for n, t in tensors.items():
            w.write(n, t)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(tensors)
        for n, t in tensors.items():
            got = f.get_tensor(n)
            assert got.dtype == t.dtype and torch.equal(got, t), n


def test_a_write_off_the_plan_fails(tmp_path: Path) -> None:
    plan = [("a", torch.bfloat16, (2,)), ("b", torch.float32, (2,))]
    w = SafetensorsWriter(tmp_path / "x.safetensors", plan)
    with pytest.raises(AssertionError, match="entry 0"):
        w.write("a", torch.zeros(2))  # fp32 where the header says bf16
    w.write("a", torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="never written"):
        w.close()
