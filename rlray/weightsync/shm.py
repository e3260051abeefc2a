"""rlray's "shm" engine for vLLM's weight-transfer protocol: the colocated handover on CPUs.

vLLM's colocated engine ("ipc") passes CUDA IPC handles: every trainer rank materializes each full
tensor on its GPU and the worker on that GPU rebuilds it in place. CPUs have no IPC handles, so this
engine does the same through a shared-memory file (`/dev/shm`, mapped by both processes): the trainer
rank of a colocated bundle writes each bucket of full tensors into its file, and the engine worker of
that bundle (rlray.config.colocation) reads it and loads it through vLLM's layerwise reload.

Contract:
- Trainer side (`ShmTrainerWeightTransferEngine`, every rank): `send_weights()` iterates the
  `WeightSource` (its gathers are collectives) bucket by bucket (`plan_buckets`, `bucket_bytes` each);
  the ranks whose bundle holds a worker (`writes`) copy the bucket into their file, every rank meets at
  a barrier of the trainer's default process group, rank 0 asks the workers to load it
  (`update_weights`, one call per bucket through the client) and every rank meets again before the file
  is written over. Rank 0 drives start and finish as the gloo engine does; whatever fails, it still
  meets every barrier (the other ranks wait in them) and raises at the end. Returns the bytes handed
  over; `stats` as the gloo engine's. `shutdown()` removes this rank's file.
- Worker side (`ShmWeightTransferEngine`): init computes the worker's global index (`rank_offset`, as
  the gloo engine) and reads the file of trainer rank `index * stride`; each update's info is a one-bucket
  plan and the file's size; the worker copies each tensor out (vLLM may keep a layer's tensors until
  the layer is complete, and the next bucket overwrites the file) and loads it. Start and finish are
  the gloo engine's (layerwise reload and the CPU fix-ups); LoRA adapters are kept (AdapterUpdates).
- A /dev/shm without room for one bucket fails in one line naming the fix.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlray.weightsync.lora import AdapterUpdates
from rlray.weightsync.protocol import GlooWeightEngine
from rlray.weightsync.reload import KeepsBareCopies
from rlray.weightsync.transport import (
    SHM_BUCKET_BYTES,
    Bucket,
    iter_bucket_views,
    plan_buckets,
    plan_from_wire,
    plan_to_wire,
    to_dtype,
)

BACKEND = "shm"
SHM_DIR = Path("/dev/shm")


def shm_file(prefix: str, rank: int) -> Path:
    return SHM_DIR / f"{prefix}-{rank}"


def bucket_bytes(bucket: Bucket) -> int:
    return bucket.numel * to_dtype(bucket.dtype).itemsize


def map_file(path: Path, nbytes: int, create: bool = False) -> torch.Tensor:
    """The file as a uint8 tensor shared with every process that maps it (created, `nbytes` long, if `create`)."""
    if create:
        free = os.statvfs(path.parent).f_bavail * os.statvfs(path.parent).f_frsize
        if free < nbytes:
            raise RuntimeError(f"{path.parent} has {free / 2**20:.0f} MiB free but one weight handover round needs "
                               f"{nbytes / 2**20:.0f} MiB; give the container more shared memory (docker run "
                               "--shm-size, a Kubernetes emptyDir with medium Memory) or lower weights.bucket_mb")
        with open(path, "wb") as f:
            f.truncate(nbytes)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


# ---- worker side ------------------------------------------------------------------------
@dataclass(kw_only=True)
class ShmInitInfo(WeightTransferInitInfo):
    prefix: str  # the trainer ranks' files: /dev/shm/<prefix>-<rank>
    rank_offset: int  # this engine's first worker index (rlray.orchestration.calls.FleetClient)
    stride: int  # worker w reads trainer rank w * stride's file


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    plan: list[dict[str, Any]]  # plan_to_wire of the one bucket in the file now
    nbytes: int  # the file's size


class ShmWeightEngine(GlooWeightEngine):
    """One vLLM worker's end: the bucket in its colocated trainer rank's file, copied out and loaded."""

    init_info_cls = ShmInitInfo  # type: ignore[assignment]
    update_info_cls = ShmUpdateInfo  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path: Path | None = None
        self.mapped: tuple[int, torch.Tensor] | None = None

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:  # type: ignore[override]
        pc = self.parallel_config
        index = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.path, self.mapped = shm_file(init_info.prefix, index * init_info.stride), None

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:  # type: ignore[override]
        if self.path is None:
            raise RuntimeError("shm weight transfer is not initialized: call init_weight_transfer_engine first")
        if self.mapped is None or self.mapped[0] != update_info.nbytes:
            self.mapped = (update_info.nbytes, map_file(self.path, update_info.nbytes))
        raw = self.mapped[1]
        for bucket in plan_from_wire(update_info.plan):
            flat = raw[:bucket_bytes(bucket)].view(to_dtype(bucket.dtype))
            self.model.load_weights((name, view.clone()) for name, view in iter_bucket_views(bucket, flat))

    def shutdown(self) -> None:
        self.mapped = None


class ShmWeightTransferEngine(AdapterUpdates, KeepsBareCopies, ShmWeightEngine):
    """The shm engine vLLM builds ("shm"): base weights, and LoRA adapters kept (AdapterUpdates)."""


# ---- trainer side -----------------------------------------------------------------------
@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    prefix: str = "rlray-weights"
    bucket_bytes: int = SHM_BUCKET_BYTES
    stride: int = 1  # rlray.config.colocation.Colocation
    writes: bool = True  # this rank's bundle holds an engine worker


class ShmTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    init_info_cls = ShmTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool,
                 info: ShmTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.path = shm_file(info.prefix, info.rank) if info.writes else None
        self.file: torch.Tensor | None = None
        self.stats: dict[str, float] = {}

    @classmethod
    def trainer_init(cls, init_info: ShmTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> ShmTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("shm trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if engine.is_sender:
            client.init_weight_transfer_engine(asdict(ShmInitInfo(prefix=init_info.prefix, rank_offset=0,
                                                                  stride=init_info.stride)))
        return engine

    def _file(self, nbytes: int) -> torch.Tensor | None:
        if self.path is not None and (self.file is None or self.file.numel() != nbytes):
            self.file = map_file(self.path, nbytes, create=True)
        return self.file

    def send_weights(self) -> int:
        """One handover of every weight, bucket by bucket; returns the bytes rank 0's file held."""
        assert self.source is not None
        plan = plan_buckets([(m.name, m.shape, m.dtype) for m in self.source.metadata()], self.info.bucket_bytes)
        nbytes = max(bucket_bytes(b) for b in plan)
        file, tensors = self._file(nbytes), iter(self.source)
        failed: BaseException | None = self._call(self.client.start_weight_update) if self.is_sender else None
        for bucket in plan:
            flat = None if file is None else file[:bucket_bytes(bucket)].view(to_dtype(bucket.dtype))
            for spec in bucket.tensors:
                _, tensor = next(tensors)
                if flat is not None:
                    flat[spec.offset:spec.offset + spec.numel].copy_(tensor.reshape(-1))
            _barrier()
            if self.is_sender and failed is None:
                failed = self._call(self.client.update_weights, asdict(ShmUpdateInfo(plan_to_wire([bucket]), nbytes)))
            _barrier()  # the workers have copied this bucket out before anyone writes the next
        if failed is None and self.is_sender:
            failed = self._call(self.client.finish_weight_update)
        if failed is not None:
            raise failed
        sent = sum(bucket_bytes(b) for b in plan)
        self.stats = {"sync_bytes": float(sent), "changed_frac": 1.0, "full": 1.0}
        return sent

    @staticmethod
    def _call(fn: Any, *args: Any) -> BaseException | None:
        try:
            fn(*args)
        except Exception as e:  # every rank still meets every barrier; rank 0 raises after the pass
            return e
        return None

    def shutdown(self) -> None:
        self.file = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
