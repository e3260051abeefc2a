"""A safetensors file written one tensor at a time, its header first (the streamed HF export, rlray.actors.export).

Contract: `SafetensorsWriter(path, entries, metadata)` opens `path` and writes the safetensors header of `entries`
(name, dtype, shape, in the order the data will come); `write(name, tensor)` appends the next entry's bytes
(any device; it must be that entry: same name, dtype and shape, else AssertionError); `close()` (or leaving the
`with` block) checks that every entry came. The file is what `safetensors.torch.save_file` would write for those
tensors in that order (tensors are stored back to back after an 8-byte little-endian header length and a JSON header
padded with spaces to 8 bytes), so `safe_open`, transformers and vLLM read it. Why not `save_file`: it takes every
tensor at once, and a rank's file would then hold all its tensors in memory together; here one tensor is held at a time.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch

DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
          torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
          torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
Entry = tuple[str, torch.dtype, tuple[int, ...]]


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def header(entries: list[Entry], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and the JSON header of `entries`, stored back to back in that order."""
    head: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in DTYPES:
            raise ValueError(f"{name}: safetensors has no dtype for {dtype}")
        size = nbytes(dtype, shape)
        head[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
    def __init__(self, path: str | Path, entries: list[Entry], metadata: dict[str, str] | None = None) -> None:
        assert len({n for n, _, _ in entries}) == len(entries), "duplicate tensor names"
        self.path, self.entries, self.next = Path(path), entries, 0
        self.file: BinaryIO = self.path.open("wb")
        self.file.write(header(entries, metadata))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        assert self.next < len(self.entries), f"{self.path.name}: {name} comes after the last entry"
        want = self.entries[self.next]
        got = (name, tensor.dtype, tuple(tensor.shape))
        assert got == want, f"{self.path.name}: entry {self.next} is {want}, got {got}"
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.file.write(memoryview(data.numpy()))
        self.next += 1

    def close(self) -> None:
        self.file.close()
        missing = [n for n, _, _ in self.entries[self.next:]]
        assert not missing, f"{self.path.name}: never written: {missing[:5]}"

    def __enter__(self) -> SafetensorsWriter:  # noqa: PYI034
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.close()
        else:
            self.file.close()
