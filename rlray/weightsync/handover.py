"""The colocated GPU handover's buffer: one size for the plan and for the trainer's init info.

vLLM's ipc engine (`packed=True`) copies the tensors it sends into one reusable CUDA buffer on each
trainer GPU and hands the engine an IPC handle to it; the engine clones each chunk before loading it.
A tensor larger than the buffer is a ValueError inside vLLM at the first sync, so the buffer must hold
the largest tensor sent.

Contract: `handover_bytes(bucket_bytes, tensors)` is that buffer's size in bytes, from `weights.bucket_mb`
in bytes (None: vLLM's default, `VLLM_PACKED_BYTES`, or the largest tensor when that is larger) and `tensors`,
(name, bytes on the wire) of everything a sync sends; a `weights.bucket_mb` smaller than the largest
tensor is a one-line ValueError naming it. `largest(tensors)` is that tensor. No torch, no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable

VLLM_PACKED_BYTES = 1 << 30  # vLLM 0.32's DEFAULT_PACKED_BUFFER_SIZE_BYTES (pinned by tests/unit/test_colocation.py)


def largest(tensors: Iterable[tuple[str, int]]) -> tuple[str, int]:
    """(name, bytes) of the largest tensor; ("", 0) when there is none."""
    return max(tensors, key=lambda t: t[1], default=("", 0))


def handover_bytes(bucket_bytes: int | None, tensors: Iterable[tuple[str, int]]) -> int:
    name, size = largest(tensors)
    if not bucket_bytes:
        return max(VLLM_PACKED_BYTES, size)
    if bucket_bytes < size:
        need = -(-size // (1 << 20))
        raise ValueError(f"weights.bucket_mb={bucket_bytes >> 20} is smaller than {name} ({size / 2**20:.0f} MiB on the wire), "
                         f"which vLLM's ipc handover packs whole; set weights.bucket_mb >= {need}, or unset it (the "
                         "buffer is then sized to the largest tensor)")
    return bucket_bytes
