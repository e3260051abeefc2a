"""WeightPublisher: a trainer rank's end of the weight path (vLLM's weight-transfer protocol).

Contract: `WeightPublisher(model, device, rank, wire_dtype, lora, frozen_tower)`. `open(spec, client)` builds this
rank's trainer engine (rlray.weightsync.protocol; `client` is a VLLMWeightSyncClient over the
engines, driven by rank 0); `publish(version)` is one sync, a collective of every rank: each
gathers one full parameter at a time (dense and EP/FSDP-sharded experts alike), cast first to
`wire_dtype` (the engines' dtype: bf16 halves the bytes; the routers' persistent correction biases keep theirs, as
vLLM does) and on the default CUDA stream whatever
stream the sender pulls from (rlray.weightsync.transport.on_default_stream); rank 0 sends them and
drives the engines' start, update and finish, labelled `version`. Returns the seconds and, on
rank 0, the bytes sent. With LoRA (`lora`, the adapters' PEFT config) an RL sync moves only the
adapters (PEFT's names; the engines keep them, rlray.weightsync.lora), preceded by the base
(checkpoint names) when the group's engines do not hold it yet (a new group: start, resume, a
replaced engine); SFT's syncs (`stage`) move the base it trains. A frozen vision tower
(`trainer.freeze_vision`) is never sent: every engine loads it from the same checkpoint. Fused experts
go in the layout of the family's checkpoints (transposed for Qwen3-VL-MoE, rlray.models.load).
`close()` leaves the group (safe from another thread while a sync is in flight: the trainer's control thread). `source()`
is the `WeightSource` vLLM's engines read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from rlray.config.families import family, known
from rlray.models.load import EXPERTS, FUSED
from rlray.models.lora import checkpoint_name, is_adapter, peft_name
from rlray.models.multimodal import vision_tower
from rlray.parallel.hf import experts_transposed_on_disk
from rlray.weightsync.transport import TrainerSpec, on_default_stream


class WeightPublisher:
    def __init__(self, model: torch.nn.Module, device: torch.device, rank: int, wire_dtype: torch.dtype | None,
                 lora: dict[str, Any] | None = None, frozen_tower: bool = False) -> None:
        self.model, self.device, self.rank, self.wire_dtype = model, device, rank, wire_dtype
        self.lora = lora  # the adapters' PEFT config (rlray.models.lora.adapter_config); None: no LoRA
        # a family whose checkpoints hold fused experts transposed is sent so: vLLM's loader reads that layout
        model_type = getattr(getattr(model, "config", None), "model_type", "")
        self.transposed = experts_transposed_on_disk(model_type)
        self.per_expert = known(model_type) and family(model_type).send_per_expert
        self.expert_names = family(model_type).expert_names if self.per_expert else {}
        tower = vision_tower(model) if frozen_tower else None
        self.unsent = {id(p) for p in tower.parameters()} if tower is not None else set()
        persistent = set(model.state_dict())
        self.buffers = [(n, b) for n, b in model.named_buffers() if n in persistent and b.is_floating_point()]
        self.kept_dtype = {id(b) for _, b in self.buffers}  # sent in their own dtype (fp32 routing biases)
        self.transfer: Any = None  # this rank's TrainerWeightTransferEngine
        self.client: Any = None
        self.stage = "rl"  # with LoRA, RL syncs move the adapters; SFT's the base it trains
        self.adapters = False  # what the sync in progress moves: the adapters, or the (base) weights
        self.base_synced = False  # the engines of this weight group hold the trainer's base

    def _sent(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name on the wire, parameter or buffer) of what the sync in progress moves: with the weights, the
        persistent buffers a checkpoint holds (the routers' `e_score_correction_bias`: an engine started from dummy
        weights, rlray.models.quantized.engine_route, has nothing else to take them from)."""
        for name, p in self.model.named_parameters():
            if id(p) in self.unsent:
                continue
            if self.lora is None:
                yield name, p
            elif is_adapter(name) == self.adapters:  # the engines know PEFT's names and the checkpoint's
                yield (peft_name(name) if self.adapters else checkpoint_name(name)), p
        if not self.adapters:
            yield from ((checkpoint_name(n) if self.lora else n, b) for n, b in self.buffers)

    def full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """One full parameter at a time, in `dtype` (cast before the gather), gathered on the default stream."""

        def gathered() -> Iterator[tuple[str, torch.Tensor]]:
            for name, p in self._sent():
                p = p.detach() if dtype is None or id(p) in self.kept_dtype else p.detach().to(dtype)
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                yield from self._per_expert(name, full.transpose(1, 2).contiguous() if self._flipped(name) else full)

        return on_default_stream(gathered(), self.device)

    def _wire_meta(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        shape = lambda n, p: (p.shape[0], p.shape[2], p.shape[1]) if self._flipped(n) else tuple(p.shape)
        wire = lambda p: p.dtype if id(p) in self.kept_dtype else self.wire_dtype or p.dtype
        return [ParamMeta(n, wire(p), tuple(t.shape)) for name, p in self._sent()
                for n, t in self._per_expert(name, torch.empty(shape(name, p), device="meta"))]

    def _per_expert(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A fused experts tensor (biases too) as one tensor per expert, `experts.<e>.<param>` or, its rows split,
        under the family's per-expert names (`experts.<e>.gate_proj.weight`, ...), for a family whose vLLM loader
        keeps only those (rlray.config.families `send_per_expert`, `expert_names`); anything else as it is."""
        fused = EXPERTS.match(name) if self.per_expert else None
        if fused is None:
            yield name, tensor
            return
        names = self.expert_names.get(fused["param"], (fused["param"],))
        for e in range(tensor.shape[0]):
            for part, piece in zip(names, tensor[e].chunk(len(names)), strict=True):
                yield f"{fused['prefix']}.{e}.{part}", piece

    def _flipped(self, name: str) -> bool:
        return self.transposed and FUSED.match(name) is not None

    def source(self) -> Any:
        """Every parameter's metadata in the wire dtype, and a fresh gathered pass of the full tensors."""
        from rlray.weightsync.protocol import ParamSource

        return ParamSource(self._wire_meta, lambda: self.full_params(self.wire_dtype))

    def shard_source(self, trainers: int) -> Any:
        """The many-to-many engine's source (rlray.weightsync.m2n): every wire tensor as a piece of its parameter, the
        parameters' layouts over the `trainers` ranks, and this rank's local shards, cast, per group."""
        from rlray.weightsync.boxes import Dims, Wire, layout_of
        from rlray.weightsync.m2n import ShardSource

        wires, layouts, held, dtypes = [], [], {}, {}
        for name, p in self._sent():
            layout = layout_of(p, trainers)
            if layout not in layouts:
                layouts.append(layout)
            dtype = p.dtype if id(p) in self.kept_dtype else self.wire_dtype or p.dtype
            shape, fused = tuple(p.shape), EXPERTS.match(name) if self.per_expert else None
            if fused is not None and self._flipped(name):
                raise ValueError(f"{name}: experts sent per expert from a transposed checkpoint layout have no m2n "
                                 "plan; set weights.transport=broadcast")
            parts = self.expert_names.get(fused["param"], (fused["param"],)) if fused else ()
            pieces = [Wire(f"{fused['prefix']}.{e}.{part}", (shape[1] // len(parts), *shape[2:]), dtype.itemsize,
                           layouts.index(layout), shape, e, (k, len(parts)))
                      for e in range(shape[0]) for k, part in enumerate(parts)] if fused else \
                [Wire(name, (shape[0], shape[2], shape[1]) if self._flipped(name) else shape, dtype.itemsize,
                      layouts.index(layout), shape, flipped=self._flipped(name))]
            for wire in pieces:
                wires.append(wire)
                held[wire.name], dtypes[wire.name] = (p, layout), dtype
        model_type = getattr(self.model.config, "model_type", "")
        f = family(model_type) if known(model_type) else None
        dims = Dims.of(self.model.config, bool(f and f.sliced_experts), bool(f and f.sliced_vision))

        def shards(group: list[Any]) -> dict[str, tuple[torch.Tensor, Any]]:
            cast: dict[int, tuple[torch.Tensor, Any]] = {}
            out = {}
            for wire in group:
                p, layout = held[wire.name]
                if id(p) not in cast:
                    local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
                    cast[id(p)] = (local.to(dtypes[wire.name]), layout.held(tuple(p.shape), self.rank))
                local, box = cast[id(p)]
                out[wire.name] = (wire.local(local, box), wire.origin(layout, self.rank))
            return out

        return ShardSource(wires, layouts, dims, dtypes, shards)

    def open(self, spec: TrainerSpec, client: Any) -> None:
        from rlray.weightsync.protocol import trainer_engine

        self.close()
        self.client = client
        source = self.shard_source(spec.trainers) if spec.backend == "m2n" else self.source()
        self.transfer = trainer_engine(spec, self.rank, client, source)
        self.base_synced = False  # new engines hold the model's own base

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.shutdown()
        self.transfer = None

    @torch.no_grad()
    def publish(self, version: int) -> dict[str, float]:
        """One sync labelled `version`; with LoRA in RL, the adapters (after the base, when this weight
        group's engines do not hold it yet); otherwise every weight."""
        assert self.transfer is not None, "open the weight group before publishing"
        t0 = time.perf_counter()
        if self.client is not None:  # only rank 0's drives the engines
            self.client.weight_version = str(version)
        rounds = [False] if self.lora is None or self.stage != "rl" else [True] if self.base_synced else [False, True]
        sent = 0.0
        for adapters in rounds:
            self.adapters = adapters
            if self.client is not None:
                self.client.adapter = self.lora if adapters else None
            self.transfer.send_weights()
            sent += self._stats()["sync_bytes"]
        self.base_synced = True
        seconds = time.perf_counter() - t0
        stats = {**self._stats(), "sync_bytes": sent}
        sender = self.rank == 0 or getattr(self.transfer, "info", None) is not None  # m2n: every rank sends
        return {"sync_seconds": seconds, **(stats if sender else {"sync_bytes": 0.0})}

    def _stats(self) -> dict[str, float]:
        stats = getattr(self.transfer, "stats", None)  # rlray's gloo engine counts; vLLM's NCCL one sends all
        if stats:
            return dict(stats)
        return {"sync_bytes": float(sum(math.prod(m.shape) * m.dtype.itemsize for m in self._wire_meta())),
                "changed_frac": 1.0, "full": 1.0}
