"""rlray's many-to-many engine pair for vLLM's weight-transfer protocol ("m2n"): every trainer rank sends its
own slices straight to the workers that read them; nothing is gathered, no worker receives what it does not keep.

Shapes mirror vLLM's `nccl_m2n` engines (one group: trainer ranks [0, T), workers from `rank_offset` = T; the static
plan rides the init info, the update info is a sync number) and its `sharded_rdt` idea of slicing for the
receiver; the plan is rlray.weightsync.boxes's, computed alike on every rank from the same data.

Contract:
- Trainer side (`M2NTrainerWeightTransferEngine`): `trainer_init` on every trainer rank; rank 0 serves the group's
  store, hands its port to the others over the trainer's default group and inits the workers (from a side thread:
  they block in the join). The source is a `ShardSource`: the wire tensors (boxes.Wire), the parameters' layouts,
  the loader dims and each group's local shards. `send_weights()` on every rank, with no collective among the
  trainer ranks (one frozen or slow rank holds up only the workers waiting for its slices): rank 0 starts the
  update and asks the workers to receive (side thread), then every rank packs, per layer group and worker, the
  pieces it holds into one 16-byte-aligned message and sends it (in plan order; two buffers per link, so a group
  is packed while the one before is on the wire); rank 0 finishes. Returns the bytes this rank sent; `stats` as the gloo engine's.
- Worker side (`M2NWeightTransferEngine`): init joins the group and plans; each update receives group g+1 while it
  loads group g: every planned piece lands in a full-shape staging tensor (`torch.empty`: on CPU pages it never
  writes cost no memory, on CUDA every page is real; NaN-filled with `RLRAY_WEIGHTS_POISON=1`, so a plan that misses
  a byte the loaders read shows as NaN logprobs), handed to vLLM's layerwise reload as today's path does, with the
  same CPU fix-ups at finish.
- Failure: any rank whose send or receive fails closes its end of the group, which fails the peers blocked on it;
  a rank whose workers never receive (rank 0 could not start them) waits until the fleet closes its end from the
  control thread, as for a broadcast, or `timeout_s` (weights.group_timeout_s) passes.
- The transport is rlray.weightsync.links (`transport` in both init infos): gloo's send/recv on CPU, vLLM's NCCL
  communicator on GPUs; each rank's messages of one layer group go as one exchange (one NCCL group call), and each
  end warms every planned pair with one byte at init.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
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

from rlray.weightsync.boxes import Dims, Engines, Layout, Piece, Plan, Wire, offsets, plan
from rlray.weightsync.links import Batch, Links, bind_listen_socket, open_gloo_links, open_nccl_links
from rlray.weightsync.lora import AdapterUpdates
from rlray.weightsync.reload import KeepsBareCopies
from rlray.weightsync.transport import serve_weight_store, to_dtype

BACKEND = "m2n"
POISON = "RLRAY_WEIGHTS_POISON"


@dataclass
class ShardSource(WeightSource):
    """What the m2n trainer engine sends: the wire tensors, their layouts, the loader dims, and per group of wire
    tensors this rank's local shards (`shards(wires)` -> {name: tensor in the wire's coordinates relative to
    `Wire.origin`}, only for the wires this rank holds)."""

    wires: list[Wire]
    layouts: list[Layout]
    dims: Dims
    dtypes: dict[str, torch.dtype]
    shards: Callable[[list[Wire]], dict[str, tuple[torch.Tensor, Any]]] = field(repr=False)

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(w.name, self.dtypes[w.name], w.shape) for w in self.wires]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError("the m2n engine sends shards, never full tensors")


def _wire_dicts(wires: list[Wire]) -> list[dict[str, Any]]:
    return [asdict(w) for w in wires]


def _wires(dicts: list[dict[str, Any]]) -> list[Wire]:
    return [w if isinstance(w, Wire) else Wire(w["name"], tuple(w["shape"]), w["itemsize"], w["layout"],
                                               tuple(w["param_shape"]), w["expert"], tuple(w["part"]), w["flipped"])
            for w in dicts]


def _layouts(dicts: list[Any]) -> list[Layout]:
    return [d if isinstance(d, Layout) else Layout(tuple(d["mesh_shape"]), tuple(d["ranks"]),
                                                   tuple(tuple(p) for p in d["placements"])) for d in dicts]


def _buffers(p: Plan, mine: Callable[[Piece], int | None], device: torch.device) -> dict[int, list[torch.Tensor]]:
    """Two uint8 buffers per peer, each as large as the largest message between us (sized once from the plan)."""
    sizes: dict[int, int] = {}
    for g in range(len(p.pieces)):
        for pieces in p.links(g).values():
            peer = mine(pieces[0])
            if peer is not None:
                sizes[peer] = max(sizes.get(peer, 0), offsets(pieces)[1])
    return {peer: [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2)] for peer, n in sizes.items()}


def _view(buffer: torch.Tensor, at: int, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
    return buffer[at:at + piece.nbytes].view(dtype).view(piece.box.shape)


# ---- worker side ------------------------------------------------------------------------
@dataclass(kw_only=True)
class M2NInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int  # this engine's first rank: the trainer ranks and the workers of the engines before it
    world_size: int
    trainers: int
    timeout_s: float
    wires: list[Any]
    layouts: list[Any]
    dtypes: dict[str, str]
    tp: list[int]  # every engine's TP size, in weight-group order
    kv_heads: int = 0
    sliced_experts: bool = False
    sliced_vision: bool = False
    expert_parallel: bool = False
    digest: str = ""
    transport: str = "gloo"  # or "nccl" (rlray.weightsync.links)


@dataclass
class M2NUpdateInfo(WeightTransferUpdateInfo):
    sync: int = 0


class M2NWeightEngine(WeightTransferEngine[M2NInitInfo, M2NUpdateInfo]):
    """One vLLM worker's end of the m2n group."""

    init_info_cls = M2NInitInfo
    update_info_cls = M2NUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.links: Links | None = None
        self.plan: Plan | None = None
        self.received = 0  # bytes of the last update

    def init_transfer_engine(self, init_info: M2NInitInfo) -> None:
        self.shutdown()
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        engines = Engines(tuple(init_info.tp), init_info.expert_parallel)
        self.worker, self.trainers = rank - init_info.trainers, init_info.trainers
        self.dtypes = {n: to_dtype(d) for n, d in init_info.dtypes.items()}
        self.plan = plan(_wires(init_info.wires), _layouts(init_info.layouts), self.trainers, engines,
                         Dims(init_info.kv_heads, init_info.sliced_experts, init_info.sliced_vision))
        if self.plan.digest() != init_info.digest:
            raise RuntimeError("m2n weight plan differs between trainer and worker: the same rlray must run on both")
        if init_info.sliced_vision and _encoder_tp_mode(self.model_config) == "data":
            raise RuntimeError("m2n plans the vision tower split by TP, this engine runs it data parallel "
                               "(mm_encoder_tp_mode=data): drop it from rollout.engine_kwargs")
        if engines.workers()[self.worker] != (pc.rank, pc.tensor_parallel_size):
            raise RuntimeError(f"m2n worker {self.worker} is TP rank {pc.rank} of {pc.tensor_parallel_size}, the plan "
                               f"says {engines.workers()[self.worker]}: engines must join in weight-group order")
        self.links = open_links(init_info.transport, init_info.master_address, init_info.master_port, rank,
                                init_info.world_size, init_info.timeout_s)
        self.buffers = _buffers(self.plan, lambda p: p.src if p.dst == self.worker else None, self.links.device)
        warm(self.links, [], list(self.buffers))
        self.poison = os.environ.get(POISON) == "1"

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: M2NUpdateInfo) -> None:
        if self.links is None or self.plan is None:
            raise RuntimeError("m2n weight transfer is not initialized: call init_weight_transfer_engine first")
        self.received = 0
        try:
            pending = self._post(0)
            for g in range(len(self.plan.pieces)):
                posted, batch = pending
                batch.wait()
                if g + 1 < len(self.plan.pieces):
                    pending = self._post(g + 1)
                self.model.load_weights(self._staged(g, posted))
        except Exception:
            self.shutdown()  # trainer ranks blocked in a send to this worker fail instead of waiting
            raise

    def _post(self, g: int) -> tuple[list[tuple[list[Piece], torch.Tensor]], Batch]:
        """Group g's messages to this worker, posted as one exchange."""
        assert self.links is not None and self.plan is not None
        posted = [(pieces, self.buffers[src][g % 2][:offsets(pieces)[1]], src)
                  for (src, dst), pieces in self.plan.links(g).items() if dst == self.worker]
        batch = self.links.exchange([], [(buffer, src) for _, buffer, src in posted])
        return [(pieces, buffer) for pieces, buffer, _ in posted], batch

    def _staged(self, g: int, posted: list[tuple[list[Piece], torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Group g's tensors this worker reads, each full-shape with the planned pieces in place."""
        assert self.plan is not None
        staged: dict[str, torch.Tensor] = {}
        shapes = {w.name: w.shape for w in self.plan.groups[g]}
        for pieces, buffer in posted:
            for piece, at in zip(pieces, offsets(pieces)[0], strict=True):
                dtype = self.dtypes[piece.name]
                if piece.name not in staged:
                    staged[piece.name] = torch.empty(shapes[piece.name], dtype=dtype, device=buffer.device)
                    if self.poison and dtype.is_floating_point:
                        staged[piece.name].fill_(float("nan"))
                piece.box.of(staged[piece.name]).copy_(_view(buffer, at, piece, dtype))
                self.received += piece.nbytes
        order = [w.name for w in self.plan.groups[g] if w.name in staged]
        return [(name, staged[name]) for name in order]

    def finish_weight_update(self) -> None:
        from rlray.weightsync.protocol import finish_reload

        finish_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self.links is not None:
            self.links.close()
        self.links = None


class M2NWeightTransferEngine(AdapterUpdates, KeepsBareCopies, M2NWeightEngine):
    """The m2n engine vLLM builds ("m2n"), with the base-weight fix-ups of rlray's gloo engine."""


# ---- trainer side -----------------------------------------------------------------------
@dataclass
class M2NTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    master_address: str
    master_port: int
    world_size: int  # trainer ranks + every worker
    trainers: int
    tp: list[int]
    timeout_s: float = 300.0
    expert_parallel: bool = False
    transport: str = "gloo"  # or "nccl" (rlray.weightsync.links)


class M2NTrainerWeightTransferEngine(TrainerWeightTransferEngine[M2NTrainerInitInfo]):
    """A trainer rank's end: every rank sends its pieces; rank 0 also drives the client."""

    init_info_cls = M2NTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: ShardSource, rank: int, info: M2NTrainerInitInfo
                 ) -> None:
        super().__init__(client=client, source=source, is_sender=True)
        self.rank, self.info, self.source = rank, info, source
        engines = Engines(tuple(info.tp), info.expert_parallel)
        self.plan = plan(source.wires, source.layouts, info.trainers, engines, source.dims)
        self.links: Links | None = None
        self.syncs = 0
        self.stats: dict[str, float] = {}

    @classmethod
    def trainer_init(cls, init_info: M2NTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> M2NTrainerWeightTransferEngine:
        if not isinstance(source, ShardSource):
            raise TypeError("the m2n trainer engine needs a ShardSource (rlray.actors.publisher)")
        engine = cls(client=client, source=source, rank=init_info.rank, info=init_info)
        host, port, rendezvous, kind = init_info.master_address, init_info.master_port, None, init_info.transport
        if engine.rank == 0 and not port:
            rendezvous, port = serve(kind, host, init_info.world_size, init_info.timeout_s)
        port = _from_rank0(port, init_info.trainers)
        if engine.rank != 0:
            engine._join(open_links(kind, host, port, engine.rank, init_info.world_size, init_info.timeout_s))
            return engine
        workers = M2NInitInfo(master_address=host, master_port=port, rank_offset=init_info.trainers,
                              world_size=init_info.world_size, trainers=init_info.trainers,
                              timeout_s=init_info.timeout_s, wires=_wire_dicts(source.wires),
                              layouts=[asdict(x) for x in source.layouts],
                              dtypes={n: str(d).removeprefix("torch.") for n, d in source.dtypes.items()},
                              tp=list(init_info.tp), kv_heads=source.dims.kv_heads,
                              sliced_experts=source.dims.sliced_experts, sliced_vision=source.dims.sliced_vision,
                              expert_parallel=init_info.expert_parallel,
                              digest=engine.plan.digest(), transport=kind)
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers block in init until the group is whole
            joined = pool.submit(client.init_weight_transfer_engine, asdict(workers))
            engine._join(open_links(kind, host, port, 0, init_info.world_size, init_info.timeout_s, rendezvous))
            joined.result()
        return engine

    def _join(self, links: Links) -> None:
        self.links = links
        self.buffers = _buffers(self.plan, lambda p: p.dst if p.src == self.rank else None, links.device)
        warm(links, [self.info.trainers + dst for dst in self.buffers], [])

    def send_weights(self) -> int:
        """One sync; returns the bytes this rank sent."""
        if self.rank == 0:
            try:
                self.client.start_weight_update()
            except Exception:
                self.shutdown()  # the other ranks' sends fail once the fleet closes their ends (or time out)
                raise
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(M2NUpdateInfo(self.syncs))) \
                if self.rank == 0 else None
            try:
                sent = self._send()
            except Exception:
                self.shutdown()  # workers blocked in a receive from this rank fail instead of waiting
                raise
            if received is not None:
                received.result()
        finally:
            pool.shutdown(wait=False)
        if self.rank == 0:
            self.client.finish_weight_update()
        self.syncs += 1
        self.stats = {"sync_bytes": float(sent), "changed_frac": 1.0, "full": 1.0}
        return sent

    def _send(self) -> int:
        assert self.links is not None, "trainer_init must run before send_weights"
        sent, in_flight = 0, {0: None, 1: None}  # batches by buffer parity
        for g, wires in enumerate(self.plan.groups):
            links = {dst: pieces for (src, dst), pieces in self.plan.links(g).items() if src == self.rank}
            shards = self.source.shards([w for w in wires if any(p.name == w.name for ps in links.values()
                                                                   for p in ps)]) if links else {}
            if in_flight[g % 2] is not None:  # this parity's buffers were last sent two groups ago
                in_flight[g % 2].wait()
            messages = []
            for dst, pieces in links.items():
                at, size = offsets(pieces)
                buffer = self.buffers[dst][g % 2][:size]
                for piece, offset in zip(pieces, at, strict=True):
                    local, origin = shards[piece.name]
                    _view(buffer, offset, piece, local.dtype).copy_(piece.box.within(origin).of(local))
                    sent += piece.nbytes
                messages.append((buffer, self.info.trainers + dst))
            in_flight[g % 2] = self.links.exchange(messages, []) if messages else None
            shards = {}  # packed: drop this group's casts before the next group's are made
        for batch in in_flight.values():
            if batch is not None:
                batch.wait()
        return sent

    def shutdown(self) -> None:
        if self.links is not None:
            self.links.close()


def serve(transport: str, host: str, world_size: int, timeout_s: float) -> tuple[Any, int]:
    """Rank 0's rendezvous, bound as its port is chosen: gloo's store, or the socket vLLM's NCCL store takes."""
    if transport == "nccl":
        listen = bind_listen_socket(host)
        return listen, listen.getsockname()[1]
    store = serve_weight_store(host, world_size, timeout_s)
    return store, store.port


def open_links(transport: str, host: str, port: int, rank: int, world_size: int, timeout_s: float,
               rendezvous: Any = None) -> Links:
    """This rank's end of the m2n group over `transport` ("gloo" or "nccl": the rank's current CUDA device)."""
    if transport == "nccl":
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return open_nccl_links(host, port, rank, world_size, timeout_s, device, rendezvous)
    if transport != "gloo":
        raise ValueError(f"m2n transport {transport!r}: choose gloo or nccl")
    return open_gloo_links(host, port, rank, world_size, timeout_s, rendezvous)


def warm(links: Links, sends: list[int], recvs: list[int]) -> None:
    """One byte with every planned peer, so that no connection is made inside a timed batch (NCCL connects a pair
    lazily, at its first message)."""
    one = torch.zeros(1, dtype=torch.uint8, device=links.device)
    links.exchange([(one, p) for p in sends], [(one.clone(), p) for p in recvs]).wait()


def _encoder_tp_mode(model_config: Any) -> str:
    """vLLM's `mm_encoder_tp_mode` ("weights": the vision tower split by TP; "data": whole on every worker)."""
    return getattr(getattr(model_config, "multimodal_config", None), "mm_encoder_tp_mode", None) or "weights"


def _from_rank0(value: Any, trainers: int) -> Any:
    """`value` as trainer rank 0 has it, on every trainer rank (the trainer's default group)."""
    import torch.distributed as dist

    if trainers == 1 or not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
