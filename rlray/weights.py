"""Trainer → inference weight sync: one path, two backends (gloo on CPU, NCCL on GPU).

Contract:
- A *plan* (`plan_buckets`) is plain picklable metadata: the full (unsharded) parameters in
  send order, packed greedily into buckets of one dtype each. Sender and every receiver
  hold the same plan; nothing else about the model is exchanged.
- A `WeightGroup` is a process group of its own (TCPStore → PrefixStore → ProcessGroupGloo or
  ProcessGroupNCCL) that lives beside any default group. Rank 0 is the trainer's sender;
  ranks 1.. are inference workers. Opening it blocks until every rank has joined, or fails
  after `timeout_s`.
- `WeightSender.send` copies each full tensor into a preallocated flat buffer and broadcasts
  each bucket as soon as it is full, in plan order. `WeightReceiver.iter_weights` receives
  the same buckets and yields `(name, view)` pairs into its receive buffers; a buffer is
  received into again only once nothing else holds a view of it, so a consumer may keep
  views as long as it likes (vLLM keeps a layer's tensors until the layer is complete, and
  a padded layer's until the end of the reload).
- `WorkerExtension` is mixed into vLLM's worker (`worker_extension_cls="rlray.weights.WorkerExtension"`)
  and driven through `collective_rpc`. vllm is imported only inside its methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
        numel = _numel(shape)
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
    """A separate process group for weight broadcasts from rank 0."""

    def __init__(self, store: dist.Store, pg: dist.ProcessGroup, rank: int, world_size: int,
                 backend: str, device: torch.device) -> None:
        self.store = store
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.pg = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]


def open_weight_group(host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                      timeout_s: float = 300.0) -> WeightGroup:
    """Join the weight group; blocks until all `world_size` ranks are there (or times out)."""
    if backend not in BACKENDS:
        raise ValueError(f"weight sync backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside weight group of size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    prefix_store = dist.PrefixStore(STORE_PREFIX, store)
    if backend == "gloo":
        pg: dist.ProcessGroup = dist.ProcessGroupGloo(prefix_store, rank, world_size, timeout)
        device = torch.device("cpu")
    else:
        pg, device = _nccl_group(prefix_store, rank, world_size, timeout)
    group = WeightGroup(store, pg, rank, world_size, backend, device)
    if backend == "nccl":
        # NCCL connects lazily; one tiny broadcast makes joining block like gloo does.
        group.broadcast(torch.zeros(1, device=device))
    return group


def _nccl_group(store: dist.Store, rank: int, world_size: int,
                timeout: timedelta) -> tuple[dist.ProcessGroup, torch.device]:
    if not torch.cuda.is_available():
        raise ValueError("weight sync backend 'nccl' needs CUDA; use backend 'gloo' on CPU")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    device = torch.device("cuda", torch.cuda.current_device())
    return dist.ProcessGroupNCCL(store, rank, world_size, options), device


class WeightSender:
    """Rank 0 of a weight group: streams full tensors bucket by bucket."""

    def __init__(self, plan: list[Bucket], group: WeightGroup) -> None:
        assert group.rank == 0, "the sender must be rank 0 of the weight group"
        self.plan = plan
        self.group = group
        self.buffers = allocate_buffers(plan, group.device)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast every tensor of the plan, in plan order; returns the bytes sent.

        If a broadcast fails (a receiver died), the rest of `named_tensors` is still consumed,
        so trainer ranks that gather full tensors alongside stay in step, then the error is raised.
        """
        specs = [(bucket, spec) for bucket in self.plan for spec in bucket.tensors]
        sent = 0
        index = 0
        failed: Exception | None = None
        for name, tensor in named_tensors:
            if index >= len(specs):
                raise ValueError(f"tensor {name!r} is not in the weight plan (plan has {len(specs)} tensors)")
            bucket, spec = specs[index]
            _check_matches(spec, name, tensor)
            index += 1
            if failed is not None:
                continue
            flat = self.buffers[bucket.dtype]
            flat[spec.offset : spec.offset + spec.numel].view(spec.shape).copy_(tensor.detach())
            if spec is bucket.tensors[-1]:
                try:
                    self.group.broadcast(flat[: bucket.numel])
                except RuntimeError as e:  # gloo/NCCL report a lost peer as RuntimeError
                    failed = e
                sent += bucket.numel * flat.element_size()
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
        for bucket in self.plan:
            flat = self.pool.take(bucket.dtype)
            self.group.broadcast(flat[: bucket.numel])
            yield from iter_bucket_views(bucket, flat)
            del flat
        self.pool.trim()


class WorkerExtension:
    """Mixed into vLLM's worker class; its methods run in every worker via `collective_rpc`."""

    def rlray_init_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str,
                                timeout_s: float, plan: list[dict[str, Any]]) -> int:
        """Join the weight group as `rank` + this worker's rank in its engine; returns that rank.

        `plan` is `plan_to_wire(plan)`.
        """
        # vLLM warns "RotaryEmbedding: Failed to load weights" at every reload: rotary has no weights to load.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        my_rank = rank + _worker_rank()
        group = open_weight_group(host, port, my_rank, world_size, backend, timeout_s)
        self._rlray_receiver = WeightReceiver(plan_from_wire(plan), group)
        return my_rank

    def rlray_receive_weights(self) -> float:
        """Receive every bucket and load it into the model; returns seconds taken."""
        start = time.perf_counter()
        receiver: WeightReceiver = self._rlray_receiver
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=receiver.iter_weights())
        _refresh_tied_head(runner)
        _repack_cpu_experts(runner)
        return time.perf_counter() - start

    def rlray_close_weight_group(self) -> None:
        receiver: WeightReceiver | None = getattr(self, "_rlray_receiver", None)
        if receiver is not None:
            receiver.group.close()
            self._rlray_receiver = None


def _worker_rank() -> int:
    """This worker's rank inside its engine (0 for a single-worker engine)."""
    from vllm.distributed.parallel_state import get_world_group

    return get_world_group().rank_in_group


def _refresh_tied_head(runner: Any) -> None:
    """Repack lm_head from the reloaded embedding when the model ties them.

    vLLM's CPU backend packs lm_head's weight once at start-up; a tied head keeps the
    copy of the old embedding unless it is processed again.
    """
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    config = getattr(runner.model_config, "hf_text_config", None) or runner.model_config.hf_config
    lm_head = getattr(model, "lm_head", None)
    if not getattr(config, "tie_word_embeddings", False) or lm_head is None:
        return
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(lm_head)


def _repack_cpu_experts(runner: Any) -> None:
    """Prepack reloaded MoE expert weights for vLLM's CPU kernel.

    vLLM 0.32 prepacks CPU expert weights (`w13_weight`, `w2_weight`) into its grouped-gemm layout
    only on the first load; a reload copies the checkpoint layout into the packed storage and
    skips that step, so every MoE layer computes garbage after a weight update (measured: logprobs
    off by 0.76 after a sync of unchanged weights). Run the experts' own prepack again.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without CPU experts has nothing to repack
        return
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
