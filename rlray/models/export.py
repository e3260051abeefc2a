"""A transformers folder's weights, streamed and sharded: every trainer rank writes what it holds; no rank gathers
the model (rlray.actors.export builds the folder around them).

Contract: `write_folder(model, folder, view, rank)`, a collective of every trainer rank, writes into `folder` the
tensors of the FSDP2/EP-sharded `model` that `view` selects (`FULL`; LoRA's `BASE` and `merged_view(lora)`) under
the checkpoint's names and in its layout (transformers' own reverse conversion, rlray.parallel.hf.checkpoint_tensors,
one unit at a time; fused experts transposed for the families whose checkpoints hold them so), as
`model-<k>-of-<n>.safetensors`, one file per rank that holds any; rank 0 writes `model.safetensors.index.json`
naming every tensor's file, and `config.json` (`write_config`: its dtype bfloat16, no `quantization_config`:
quantized checkpoints train and export dequantized) with `generation_config.json`. Parameters are written in bf16,
persistent buffers (the routers' fp32 correction biases) in their own dtype, a tied parameter once (under its first
name, as `save_pretrained` keeps it). The ranks must share the folder's filesystem, as they share DCP checkpoints.

How. The tensors fall into units: the model's FSDP units (a decoder layer, a vision block, an experts module under
EP) and each root-level tensor alone (embeddings, head). Fused experts of a family whose checkpoints hold one tensor
per expert are written by the ranks that hold them (FSDP and EP split them by whole experts), under per-expert
names counted from the rank's first expert: no exchange. Every other tensor of a unit goes to the unit's owner (units
round robin over the ranks) in one all_to_all per round of `world` units, each rank sending its rows cast to the
dtype they are written in; the owner assembles the unit, renames and writes it. Each rank plans its file first (the
same conversion on meta tensors), so its safetensors header is written before any data moves and each tensor once
it is ready (rlray.models.writer). Host memory beyond a rank's shards: its rows of one round's units (about one
unit) and, of the unit it owns, the rows received and the unit assembled: about one layer's fp32 bytes in all. A
unit of one tensor (embeddings, head) is the received buffer itself, its bf16 bytes once: with a large vocabulary
that can exceed a layer.

Why not torch's `HuggingFaceStorageWriter` (torch.distributed.checkpoint.hf_storage): it writes each rank's DTensor
shards under the names it is given, then its consolidation has rank 0 read every shard back and write every tensor
again (twice the writes, rank 0 touching the whole model); it converts no names (per-expert tensors from fused ones,
Nemotron-H's `backbone.`, transposed experts), and experts split per expert are no longer DTensors it can plan.
Here each tensor is written once, by one rank, under its final name.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from rlray.models.load import EXPERTS, FUSED, box, persistent
from rlray.models.lora import base_tensors, checkpoint_name, is_adapter, merged_tensors
from rlray.models.writer import Entry, SafetensorsWriter
from rlray.parallel.hf import checkpoint_tensors, experts_transposed_on_disk, own_class

DTYPE = torch.bfloat16  # what parameters are written in
INDEX = "model.safetensors.index.json"
Rows = tuple[int, int]  # (first row, row count) along dim 0


@dataclass(frozen=True)
class View:
    """What a folder holds: the model's tensors `keep` selects, turned by `form` (model names in and out: LoRA's base
    drops the adapters, its merged folder merges them); `exact`: the rows travel in their own dtype (a merge adds to
    the fp32 weight, then casts), else in the dtype they are written in."""

    keep: Callable[[str], bool] = lambda name: True
    form: Callable[[dict[str, Tensor]], dict[str, Tensor]] = dict
    exact: bool = False


FULL = View()
BASE = View(keep=lambda name: not is_adapter(name), form=base_tensors)


def merged_view(lora: Any) -> View:
    return View(form=functools.partial(merged_tensors, cfg=lora), exact=True)


@dataclass
class Unit:
    gathered: list[str]  # tensors its owner assembles and writes
    local: dict[str, list[str]]  # experts module -> its per-expert-on-disk parameters, written where they are held
    owner: int


def _align(n: int) -> int:
    return n + (-n % 8)


def _flat(t: Tensor) -> Tensor:
    """A tensor as rows along dim 0 (a 0-dim one as one row)."""
    return t.reshape(t.shape[0] if t.dim() else 1, -1)


def _local(t: Tensor) -> Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _renumber(tensors: dict[str, Tensor], first: int) -> dict[str, Tensor]:
    """Per-expert names counted from 0 (a rank's block of experts) counted from `first` (its first expert's id):
    the expert's id is the name's last numeric part."""
    out = {}
    for name, t in tensors.items():
        parts = name.split(".")
        i = max(k for k, p in enumerate(parts) if p.isdigit())
        parts[i] = str(int(parts[i]) + first)
        out[".".join(parts)] = t
    return out


class Exporter:
    """One folder's weights from this rank (build, then `write(folder)`: a collective)."""

    def __init__(self, model: nn.Module, view: View) -> None:
        self.model, self.view = model, view
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tensors = {n: t for n, t in persistent(model) if view.keep(n)}
        buffers = {n for n, _ in model.named_buffers()} & set(self.tensors)
        self.kept = buffers | {checkpoint_name(n) for n in buffers}  # written in their own dtype
        self.transposed = experts_transposed_on_disk(getattr(model.config, "model_type", ""))
        self.units = self._units()
        self.rows: list[dict[str, Rows]] = []  # every rank's rows of each sharded tensor that travels (`write`)
        self.device = next(iter(_local(t) for t in self.tensors.values())).device

    # ---- the plan (every rank computes the same units; each its own file) -------------------------------
    def _units(self) -> list[Unit]:
        """Each tensor in the unit of its nearest FSDP module below the root, a root-level one alone; owners round
        robin; per-expert experts apart (`local`), by module."""
        from torch.distributed.fsdp import FSDPModule

        fsdp = {n for n, m in self.model.named_modules() if n and isinstance(m, FSDPModule)}
        groups: dict[str, list[str]] = {}
        for name in self.tensors:
            parts = name.split(".")
            owner = next((p for p in (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)) if p in fsdp), name)
            groups.setdefault(owner, []).append(name)
        units = []
        for k, names in enumerate(groups.values()):
            local: dict[str, list[str]] = {}
            for n in names:
                if self._per_expert(n):
                    local.setdefault(EXPERTS.match(n)["prefix"], []).append(n)
            held = {n for ns in local.values() for n in ns}
            units.append(Unit([n for n in names if n not in held], local, k % self.world))
        return units

    def _per_expert(self, name: str) -> bool:
        """A fused experts parameter that the checkpoint holds as one tensor per expert."""
        if EXPERTS.match(name) is None:
            return False
        t = self.tensors[name]
        out = checkpoint_tensors(self.model, {name: torch.empty((2, *t.shape[1:]), dtype=t.dtype, device="meta")})
        return name not in out and len(out) > 1

    def _dtype(self, name: str, t: Tensor) -> torch.dtype:
        return t.dtype if name in self.kept or not t.is_floating_point() else DTYPE

    def _wire(self, name: str) -> torch.dtype:
        t = self.tensors[name]
        return t.dtype if self.view.exact else self._dtype(name, t)

    def _on_disk(self, tensors: dict[str, Tensor], first_expert: int | None = None) -> dict[str, Tensor]:
        """Tensors under the model's names -> the folder's: formed, cast, under the checkpoint's names and layout."""
        formed = self.view.form(tensors)
        named = checkpoint_tensors(self.model, {n: t.to(self._dtype(n, t)) for n, t in formed.items()})
        if first_expert is not None:
            named = _renumber(named, first_expert)
        if self.transposed:
            named = {n: t.transpose(1, 2) if FUSED.match(n) else t for n, t in named.items()}
        return named

    def _local_experts(self, unit: Unit, meta: bool) -> Iterator[dict[str, Tensor]]:
        """This rank's experts of each per-expert experts module of `unit`, under the folder's names."""
        for names in unit.local.values():
            held = {n: _local(self.tensors[n]) for n in names}
            if any(t.shape[0] == 0 for t in held.values()):
                continue
            boxes = [box(self.tensors[n]) for n in names]
            assert all(not any(offsets[1:]) for offsets, _ in boxes), f"{names}: experts split along dim 0 only"
            first = {offsets[0] for offsets, _ in boxes}
            assert len(first) == 1, f"the parameters of one experts module split alike: {names}"
            if meta:
                held = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in held.items()}
            yield self._on_disk(held, first.pop())

    def _owned_meta(self, unit: Unit) -> dict[str, Tensor]:
        return self._on_disk({n: torch.empty(tuple(self.tensors[n].shape), dtype=self._wire(n), device="meta")
                              for n in unit.gathered})

    def _rounds(self) -> list[list[Unit]]:
        return [self.units[k:k + self.world] for k in range(0, len(self.units), self.world)]

    def plan(self) -> list[list[Entry]]:
        """This rank's entries, one list per round: its experts of the round's units, then the unit it owns."""
        out = []
        for units in self._rounds():
            written: dict[str, Tensor] = {}
            for unit in units:
                for part in self._local_experts(unit, meta=True):
                    written.update(part)
            mine = [u for u in units if u.owner == self.rank and u.gathered]
            for unit in mine:
                written.update(self._owned_meta(unit))
            out.append([(n, t.dtype, tuple(t.shape)) for n, t in written.items()])
        return out

    # ---- the exchange --------------------------------------------------------------------------------
    def _boxes(self, holds: bool) -> list[tuple[bool, dict[str, Rows]]]:
        """Every rank's (whether it writes a file, its rows of every sharded tensor that travels): one exchange."""
        mine: dict[str, Rows] = {}
        for unit in self.units:
            for n in unit.gathered:
                t = self.tensors[n]
                if isinstance(t, DTensor):
                    offsets, sizes = box(t)
                    assert not any(offsets[1:]) and tuple(sizes[1:]) == tuple(t.shape[1:]), \
                        f"{n}: sharded along dim 0 only ({t.placements})"
                    mine[n] = (offsets[0], sizes[0])
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, (holds, mine))
        return everyone

    def _pieces(self, unit: Unit, rank: int) -> list[tuple[str, Rows]]:
        """What `rank` sends of `unit` to its owner, in order: its shard's rows of each sharded tensor, and the
        owner its own copy of the unsharded ones (buffers: every rank holds them whole)."""
        out = []
        for n in unit.gathered:
            t, held = self.tensors[n], self.rows[rank]
            rows = held.get(n) if n in held else (0, t.shape[0] if t.dim() else 1) if rank == unit.owner else None
            if rows and rows[1]:
                out.append((n, rows))
        return out

    def _bytes(self, name: str, rows: Rows) -> int:
        return rows[1] * math.prod(self.tensors[name].shape[1:]) * self._wire(name).itemsize

    def _size(self, pieces: list[tuple[str, Rows]]) -> int:
        """Bytes in the exchange: each piece starts 8-byte aligned, so that it can be viewed in any dtype."""
        return sum(_align(self._bytes(n, rows)) for n, rows in pieces)

    def _exchange(self, units: list[Unit]) -> dict[str, Tensor]:
        """One all_to_all: every rank's rows of each unit of the round to its owner; the unit this rank owns, whole."""
        if not any(self._pieces(u, r) for u in units for r in range(self.world)):
            return {}
        send = [self._size(self._pieces(u, self.rank)) for u in units] + [0] * (self.world - len(units))
        mine = next((u for u in units if u.owner == self.rank), None)
        recv = [self._size(self._pieces(mine, r)) if mine else 0 for r in range(self.world)]
        out, at = torch.empty(sum(send), dtype=torch.uint8, device=self.device), 0
        for u in units:
            for n, rows in self._pieces(u, self.rank):
                out[at:at + self._bytes(n, rows)].view(self._wire(n)).view(rows[1], -1).copy_(
                    _flat(_local(self.tensors[n])))
                at += _align(self._bytes(n, rows))
        got = torch.empty(sum(recv), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(got, out, recv, send)
        del out
        return self._assemble(mine, got) if mine else {}

    def _assemble(self, unit: Unit, got: Tensor) -> dict[str, Tensor]:
        rows = [rows for r in range(self.world) for _, rows in self._pieces(unit, r)]
        ends = [0] + [first + count for first, count in rows]
        if len(unit.gathered) == 1 and [first for first, _ in rows] == ends[:-1] and \
                sum(self._bytes(unit.gathered[0], r) for r in rows) == got.numel():
            n = unit.gathered[0]  # one tensor, its rows in rank order, unpadded: what came is the tensor (no copy)
            return {n: got.view(self._wire(n)).view(tuple(self.tensors[n].shape))}  # fails unless every row came
        full = {n: torch.empty(tuple(self.tensors[n].shape), dtype=self._wire(n), device=self.device)
                for n in unit.gathered}
        covered, at = dict.fromkeys(full, 0), 0
        for r in range(self.world):
            for n, (first, count) in self._pieces(unit, r):
                src = got[at:at + self._bytes(n, (first, count))].view(full[n].dtype).view(count, -1)
                _flat(full[n])[first:first + count].copy_(src)
                covered[n] += count
                at += _align(self._bytes(n, (first, count)))
        assert all(covered[n] == _flat(full[n]).shape[0] for n in full), f"the shards partition each tensor: {covered}"
        return full

    # ---- the write -----------------------------------------------------------------------------------
    def write(self, folder: Path) -> dict[str, Any]:
        """This rank's file in `folder`; returns the index (every rank's tensors and files) on rank 0, {} elsewhere."""
        plan = self.plan()
        entries = [e for part in plan for e in part]
        everyone = self._boxes(bool(entries))
        self.rows = [rows for _, rows in everyone]
        files = [r for r, (holds, _) in enumerate(everyone) if holds]
        name = f"model-{files.index(self.rank) + 1:05d}-of-{len(files):05d}.safetensors" if entries else ""
        writer = SafetensorsWriter(folder / name, entries, {"format": "pt"}) if entries else None
        for units, part in zip(self._rounds(), plan, strict=True):
            written: list[str] = []
            for unit in units:
                for tensors in self._local_experts(unit, meta=False):
                    written += self._put(writer, tensors)
            owned = self._exchange(units)
            if owned:
                written += self._put(writer, self._on_disk(owned))
            del owned
            assert written == [n for n, _, _ in part], "the write follows the plan"
        if writer is not None:
            writer.close()
        return self._weight_map(name, entries)

    @staticmethod
    def _put(writer: SafetensorsWriter | None, tensors: dict[str, Tensor]) -> list[str]:
        assert writer is not None or not tensors
        for n, t in tensors.items():
            writer.write(n, t)  # type: ignore[union-attr]
        return list(tensors)

    def _weight_map(self, file: str, entries: list[Entry]) -> dict[str, Any]:
        mine = ({n: file for n, _, _ in entries}, sum(math.prod(s) * d.itemsize for _, d, s in entries),
                sum(math.prod(s) for _, _, s in entries))
        everyone: list[Any] = [None] * self.world if self.rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(mine, everyone, dst=0)
        if self.rank != 0:
            return {}
        weight_map = {n: f for files, _, _ in everyone for n, f in files.items()}
        return {"metadata": {"total_size": sum(b for _, b, _ in everyone),
                             "total_parameters": sum(p for _, _, p in everyone)},
                "weight_map": dict(sorted(weight_map.items()))}


def write_config(model: nn.Module, folder: Path) -> None:
    """config.json as transformers' `save_pretrained` writes it (its own class's name), in bf16 and unquantized."""
    config = copy.deepcopy(model.config)
    with own_class(model) as own:
        config.architectures = [own.__name__]
        generates = model.can_generate()
    for c in {id(c): c for c in (config, config.get_text_config())}.values():
        c.dtype = str(DTYPE).removeprefix("torch.")
        if hasattr(c, "quantization_config"):
            del c.quantization_config
    config.save_pretrained(folder)
    if generates:
        model.generation_config.save_pretrained(folder)


def write_folder(model: nn.Module, folder: Path, view: View, rank: int) -> None:
    """The weights `view` selects (every rank its own file), their index and config.json (rank 0)."""
    folder.mkdir(parents=True, exist_ok=True)
    index = Exporter(model, view).write(folder)
    if rank == 0:
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        write_config(model, folder)
