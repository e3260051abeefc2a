"""The gloo weight path's transport: bucket plans, the weight group, sender and pooled receiver.

rlray.weightsync.protocol puts these behind vLLM's weight-transfer protocol as backend "gloo" (on GPUs
the backend is vLLM's own "nccl"); this module is torch only.

Contract:
- A *plan* (`plan_buckets`) is plain picklable metadata: the full (unsharded) parameters in
  send order, packed greedily into buckets of one dtype each. Sender and every receiver
  hold the same plan; nothing else about the model is exchanged.
- A `WeightGroup` is a process group of its own (TCPStore → PrefixStore → ProcessGroupGloo)
  that lives beside any default group. Rank 0 is the trainer's sender;
  ranks 1.. are inference workers. Opening it blocks until every rank has joined, or fails
  after `timeout_s`. Rank 0 serves its store on a port bound as it is chosen (`serve_weight_store`);
  `pick_port` is the nearest to that for a rendezvous that binds the port itself (vLLM's NCCL group).
- `WeightSender.send` copies each full tensor into a preallocated flat buffer and broadcasts
  each bucket as soon as it is full, in plan order. `WeightReceiver.iter_weights` receives
  the same buckets and yields `(name, view)` pairs into its receive buffers; a buffer is
  received into again only once nothing else holds a view of it, so a consumer may keep
  views as long as it likes (vLLM keeps a layer's tensors until the layer is complete, and
  a padded layer's until the end of the reload).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 16 << 20  # gloo's bucket when weights.bucket_mb is unset: 4-16 MB measured best (BENCHMARKS.md)
SHM_BUCKET_BYTES = 256 << 20  # shm's (colocated CPU) handover round when weights.bucket_mb is unset
STORE_PREFIX = "rlray-weights"


@dataclass(frozen=True)
class TensorSpec:
    """One parameter inside a bucket; `offset` and `numel` count elements of the flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: str
    numel: int
    tensors: tuple[TensorSpec, ...]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise ValueError(f"unknown dtype {name!r} in weight plan")


def plan_buckets(params: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[Bucket]:
    """Pack parameters greedily, in order, into buckets of one dtype and at most `bucket_bytes`.

    A parameter larger than `bucket_bytes` gets a bucket of its own.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    current_dtype: str | None = None
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            buckets.append(Bucket(dtype=current[0].dtype, numel=used, tensors=tuple(current)))
        current, used = [], 0

    for name, shape, dtype in params:
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        name_of_dtype = dtype_name(dtype)
        if current and (name_of_dtype != current_dtype or (used + numel) * itemsize > bucket_bytes):
            close()
        current_dtype = name_of_dtype
        current.append(TensorSpec(name, shape, name_of_dtype, used, numel))
        used += numel
    close()
    return buckets


def plan_to_wire(plan: list[Bucket]) -> list[dict[str, Any]]:
    """The plan as plain dicts and lists (vLLM's RPC encoder turns dataclasses into dicts anyway)."""
    return [asdict(bucket) for bucket in plan]


def plan_from_wire(wire: list[dict[str, Any]] | list[Bucket]) -> list[Bucket]:
    def spec(t: dict[str, Any]) -> TensorSpec:
        return TensorSpec(t["name"], tuple(t["shape"]), t["dtype"], t["offset"], t["numel"])

    return [b if isinstance(b, Bucket) else Bucket(b["dtype"], b["numel"], tuple(spec(t) for t in b["tensors"]))
            for b in wire]


def iter_bucket_views(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, view)` for every tensor of `bucket` laid out in `flat` (no copies)."""
    for spec in bucket.tensors:
        yield spec.name, flat[spec.offset : spec.offset + spec.numel].view(spec.shape)


def largest_buckets(plan: list[Bucket]) -> dict[str, int]:
    """Elements of each dtype's largest bucket: the size of a flat buffer that fits any of them."""
    sizes: dict[str, int] = {}
    for bucket in plan:
        sizes[bucket.dtype] = max(sizes.get(bucket.dtype, 0), bucket.numel)
    return sizes


def allocate_buffers(plan: list[Bucket], device: torch.device) -> dict[str, torch.Tensor]:
    """One flat buffer per dtype, as large as that dtype's largest bucket."""
    return {name: torch.empty(n, dtype=to_dtype(name), device=device) for name, n in largest_buckets(plan).items()}


class WeightGroup:
    """A separate gloo process group for weight broadcasts from rank 0 (NCCL: vLLM's own engine)."""

    def __init__(self, store: dist.Store, pg: dist.ProcessGroup, rank: int, world_size: int,
                 device: torch.device) -> None:
        self.store = store
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.device = device

    def broadcast_async(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast from rank 0 into `tensor`; `.wait()` on the returned work ends it.
        Gloo runs a group's collectives in the order they were started."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return self.pg.broadcast([tensor], opts)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.broadcast_async(tensor).wait()

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.pg = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]


def serve_weight_store(host: str, world_size: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0's store on a port the kernel picks as it binds (`.port`): no other process can take it between
    the choice and the bind, as it could when the driver chose a port and rank 0 bound it later."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def pick_port(host: str) -> int:
    """A port free on `host` now, for a rendezvous that binds it at once (vLLM's NCCL group takes no bound
    socket): a window of microseconds instead of the seconds between the driver's choice and the bind."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def open_weight_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0,
                      store: dist.TCPStore | None = None) -> WeightGroup:
    """Join the weight group; blocks until all `world_size` ranks are there (or times out). Rank 0 may pass
    the store it serves (`serve_weight_store`)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside weight group of size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    pg = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, world_size, timeout)
    return WeightGroup(store, pg, rank, world_size, torch.device("cpu"))


class WeightSender:
    """Rank 0 of a weight group: streams full tensors bucket by bucket, two buffers per dtype,
    so that filling one bucket overlaps the broadcast of the one before."""

    def __init__(self, plan: list[Bucket], group: WeightGroup) -> None:
        assert group.rank == 0, "the sender must be rank 0 of the weight group"
        self.plan = plan
        self.group = group
        self.buffers = {dtype: [flat, flat.clone()] for dtype, flat in allocate_buffers(plan, group.device).items()}

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast every tensor of the plan, in plan order; returns the bytes sent.

        If a broadcast fails (a receiver died), the rest of `named_tensors` is still consumed,
        so trainer ranks that gather full tensors alongside stay in step, then the error is raised.
        """
        specs = [(bucket, spec) for bucket in self.plan for spec in bucket.tensors]
        in_flight: dict[tuple[str, int], Any] = {}  # (dtype, buffer) -> the broadcast using it
        turn = dict.fromkeys(self.buffers, 0)
        sent = index = 0
        failed: Exception | None = None
        flat = self.buffers[specs[0][0].dtype][0] if specs else None

        def wait(key: tuple[str, int]) -> None:
            nonlocal failed
            work = in_flight.pop(key, None)
            try:
                if work is not None:
                    work.wait()
            except RuntimeError as e:  # gloo reports a lost peer as RuntimeError
                failed = failed or e

        for name, tensor in named_tensors:
            if index >= len(specs):
                raise ValueError(f"tensor {name!r} is not in the weight plan (plan has {len(specs)} tensors)")
            bucket, spec = specs[index]
            _check_matches(spec, name, tensor)
            index += 1
            if failed is not None:
                continue
            if spec is bucket.tensors[0]:
                key = (bucket.dtype, turn[bucket.dtype] % 2)
                turn[bucket.dtype] += 1
                wait(key)  # the broadcast that used this buffer last
                flat = self.buffers[bucket.dtype][key[1]]
            assert flat is not None
            flat[spec.offset : spec.offset + spec.numel].view(spec.shape).copy_(tensor.detach())
            if spec is bucket.tensors[-1] and failed is None:
                try:
                    in_flight[key] = self.group.broadcast_async(flat[: bucket.numel])
                except (RuntimeError, AttributeError) as e:  # a lost peer, or a group closed under it
                    failed = e
                    continue
                sent += bucket.numel * flat.element_size()
        for key in list(in_flight):
            wait(key)
        if index != len(specs):
            raise ValueError(f"weight plan expects {len(specs)} tensors, got {index}; "
                             f"first missing: {specs[index][1].name!r}")
        if failed is not None:
            raise RuntimeError(f"weight broadcast failed after {sent} bytes: {failed}") from failed
        return sent


def _check_matches(spec: TensorSpec, name: str, tensor: torch.Tensor) -> None:
    if name != spec.name:
        raise ValueError(f"weight plan expects {spec.name!r} next, got {name!r}: "
                         "send tensors in the order the plan was built from")
    if tuple(tensor.shape) != spec.shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, plan says {spec.shape}: "
                         "send full (unsharded) tensors")


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(tensor: torch.Tensor) -> int:
    """References to `tensor`'s storage; without torch's counter every buffer reads as viewed."""
    if _use_count is None:
        return 1 << 62
    return _use_count(tensor.untyped_storage()._cdata)


class BufferPool:
    """Flat receive buffers, a list per dtype; `take` never returns one that is still viewed.

    A buffer counts as free when its storage has no more references than it had when it was
    allocated, i.e. every view handed out of it has been dropped. A consumer still holds the
    last view while it asks for the next one, so two buffers per dtype usually alternate.
    """

    def __init__(self, plan: list[Bucket], device: torch.device) -> None:
        self.sizes = largest_buckets(plan)
        self.device = device
        self.free_refs: dict[str, list[tuple[torch.Tensor, int]]] = {name: [] for name in self.sizes}

    def take(self, dtype: str) -> torch.Tensor:
        pool = self.free_refs[dtype]
        for flat, refs in pool:
            if _storage_refs(flat) <= refs:
                return flat
        flat = torch.empty(self.sizes[dtype], dtype=to_dtype(dtype), device=self.device)
        pool.append((flat, 0 if _use_count is None else _storage_refs(flat)))
        return flat

    def trim(self, keep: int = 2) -> None:
        """Forget buffers still viewed (their views keep them alive) and all but `keep` free ones."""
        for dtype, pool in self.free_refs.items():
            self.free_refs[dtype] = [(f, r) for f, r in pool if _storage_refs(f) <= r][:keep]

    def __len__(self) -> int:
        return sum(len(pool) for pool in self.free_refs.values())


class WeightReceiver:
    """Rank > 0 of a weight group: receives each bucket into a free pooled buffer."""

    def __init__(self, plan: list[Bucket], group: WeightGroup) -> None:
        assert group.rank > 0, "a receiver cannot be rank 0 of the weight group"
        self.plan = plan
        self.group = group
        self.pool = BufferPool(plan, group.device)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, view)` of every planned tensor; bucket k+1 is received while k's views are used."""
        pending = self._post(0) if self.plan else None
        for k, bucket in enumerate(self.plan):
            assert pending is not None
            data, work = pending
            work.wait()
            del work  # `data` keeps this buffer taken while the next one is chosen
            pending = self._post(k + 1) if k + 1 < len(self.plan) else None
            yield from iter_bucket_views(bucket, data)
            del data
        self.pool.trim()

    def _post(self, k: int) -> tuple[torch.Tensor, Any]:
        bucket = self.plan[k]
        data = self.pool.take(bucket.dtype)[: bucket.numel]
        return data, self.group.broadcast_async(data)


class CudaStreams:
    """The CUDA stream calls `on_default_stream` makes (tests hand it a recording fake)."""

    current = staticmethod(lambda: torch.cuda.current_stream())
    default = staticmethod(lambda: torch.cuda.default_stream())
    use = staticmethod(lambda stream: torch.cuda.stream(stream))
    wait = staticmethod(lambda waiter, producer: waiter.wait_stream(producer))
    record = staticmethod(lambda tensor, stream: tensor.record_stream(stream))


def on_default_stream(pairs: Iterator[tuple[str, torch.Tensor]], device: torch.device,
                      streams: Any = CudaStreams) -> Iterator[tuple[str, torch.Tensor]]:
    """`pairs`, each produced (gathered, cast) on the default stream and handed to the consumer's stream.

    vLLM's packed NCCL sender pulls the weight source inside `torch.cuda.stream(side)`. Produced
    there, a gather would not wait for the optimizer step still queued on the default stream, and
    its blocks would stay in the side stream's pool of the caching allocator (GBs on rank 0 for an
    MoE's experts). Here each tensor is made on the default stream, the consumer's stream waits for
    it, and the allocator is told the consumer uses it (`record_stream`), so the block returns to the
    default stream's pool once the consumer is done. On CPU the pairs pass through unchanged.
    """
    if device.type != "cuda":
        yield from pairs
        return
    default = streams.default()
    while True:
        consumer = streams.current()
        with streams.use(default):
            item = next(pairs, None)
        if item is None:
            return
        if consumer != default:
            streams.wait(consumer, default)
            streams.record(item[1], consumer)
        yield item


@dataclass
class TrainerSpec:
    """What a trainer rank needs to build its end of the weight path (rlray.weightsync.protocol.trainer_engine)."""

    backend: str
    master_address: str
    master_port: int  # 0: trainer rank 0 picks it as it binds (gloo, nccl); shm names its files after it
    world_size: int
    bucket_bytes: int | None  # None: the backend's default (BUCKET_BYTES; vLLM's packed buffer size on nccl)
    timeout_s: float  # gloo: one join or broadcast of the weight group (vLLM's NCCL group has no timeout)
    delta: bool = False  # gloo only: after a full sync, only the changed elements
    full_every: int = 10
    stride: int = 1  # colocated (shm): engine worker w shares trainer rank w * stride's bundle
    workers: int = 0  # colocated (shm): engine workers in all
    trainers: int = 1  # m2n: trainer ranks, every one a sender (weight-group ranks [0, trainers))
    engine_tp: tuple[int, ...] = ()  # m2n: each engine's TP size, in weight-group order
    link: str = "gloo"  # m2n: the messages' transport, gloo or nccl (rlray.weightsync.links)

    def writes(self, rank: int) -> bool:
        """Colocated: whether trainer rank `rank`'s bundle holds an engine worker (rlray.config.colocation)."""
        return rank % self.stride == 0 and rank // self.stride < self.workers


def rank_offsets(first: int, workers: list[int]) -> list[int]:
    """Each engine's first weight-group rank: engine i's workers follow engines 0..i-1's."""
    return [first + sum(workers[:i]) for i in range(len(workers))]


def engine_init_infos(init_info: dict[str, Any], workers: list[int]) -> list[dict[str, Any]]:
    """Each engine's init info: its workers' ranks follow the previous engines' (`rank_offsets`); an
    engine whose info has no `rank_offset` (vLLM's ipc: each worker finds its own GPU's handles) gets it whole."""
    if "rank_offset" not in init_info:
        return [dict(init_info) for _ in workers]
    return [{**init_info, "rank_offset": o} for o in rank_offsets(init_info["rank_offset"], workers)]
