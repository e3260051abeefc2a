"""The shard plan of the many-to-many weight path: which slice of each checkpoint tensor every trainer rank holds,
which slice every engine worker's loaders read, and what moves between them. Pure: shapes and layouts in, no
processes; the m2n engines (rlray.weightsync.m2n), their tests and the recipe planner read it (the planner through
rlray.weightsync.totals, the same numbers without enumerating pieces).

Contract:
- `Box(offset, shape)`: a block of a tensor in the full tensor's coordinates; `a & b` is their overlap or None.
- `Layout(mesh_shape, ranks, placements)`: how the trainer holds a parameter (a DTensor's mesh and placements, as
  plain data: ("S", dim), ("SS", dim, split_factor) for torch's `_StridedShard`, ("R",)); `layout.boxes(shape)` is
  each trainer rank's box by torch's own `_compute_local_shape_and_global_offset` (FSDP2's uneven torch.chunk, EP's
  expert ranges); ranks that hold the same box (replicas) split it along dim 0, so each byte has one sender.
- `Wire(name, shape, dtype, layout, expert, part, flipped)`: one tensor a sync moves, under the checkpoint's name,
  and where it lies in its trainer parameter: expert `e` of a fused experts tensor, row part `(k, n)` of it (a
  family that sends gate and up apart), transposed (a family whose checkpoints store fused experts so).
- `Engines(tp, expert_parallel)`: the engines' TP sizes in weight-group order (engine i's workers after engine
  i-1's). `Dims(kv_heads, sliced_experts, sliced_vision)`: what the loader rules need from the model's config.
- `worker_boxes(wire, tp_rank, tp, dims, ep)` is the region a worker's vLLM loaders read (rules below); anything
  no rule knows is the whole tensor (correct, only slower).
- `plan(wires, trainers, engines, dims)` is every piece (tensor, trainer rank, worker, box) grouped per layer,
  with the bytes each trainer rank sends and each worker receives; `Plan.digest()` lets both ends check they
  planned alike. Workers are numbered from 0 here; the weight group puts them after the trainer ranks.

The rules are vLLM 0.32's loaders for unquantized weights (tensor parallel): column-parallel rows split evenly
(q, dense and shared gate/up, MLA's q_b/kv_b), k/v heads split or replicated when TP exceeds them, row-parallel
columns split evenly (o, dense and shared down), embedding and head rows by the vocabulary padded to 64, routed
experts (families marked `sliced_experts`) by their intermediate rows and, with engine EP, by whole experts; a
Qwen3-VL vision tower (families marked `sliced_vision`) by its heads and widths as its language model is.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 16  # bytes: where each piece starts in a packed message
VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_LANGUAGE = re.compile(r"(?:^|\.)layers\.\d+\.")
_COLUMN = re.compile(r"\.(?:q_proj|q_b_proj|kv_b_proj|gate_proj|up_proj)\.(?:weight|bias)$")
_KV = re.compile(r"\.(?:k_proj|v_proj)\.(?:weight|bias)$")
_ROW = re.compile(r"\.(?:o_proj|down_proj)\.weight$")
_VOCAB = re.compile(r"(?:^|\.)(?:embed_tokens|lm_head)\.weight$")
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
# Qwen3-VL's vision tower (vllm/model_executor/models/qwen3_vl.py, qwen2_5_vl.py's attention): its blocks' fused qkv
# (QKVParallelLinear, as many k/v heads as q heads), the blocks' and the mergers' linear_fc1 column-, attn.proj and
# linear_fc2 row-parallel; norms, the patch and position embeddings whole
_VISION = re.compile(r"(?:^|\.)visual\.")
_VISION_QKV = re.compile(r"\.attn\.qkv\.(?:weight|bias)$")
_VISION_COLUMN = re.compile(r"\.linear_fc1\.(?:weight|bias)$")
_VISION_ROW = re.compile(r"\.(?:attn\.proj|linear_fc2)\.weight$")


@dataclass(frozen=True)
class Box:
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __and__(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape,
                                                           strict=True))
        if any(h <= l for l, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi, strict=True)))

    def within(self, outer: Box) -> Box:
        """This box in `outer`'s coordinates."""
        return Box(tuple(a - b for a, b in zip(self.offset, outer.offset, strict=True)), self.shape)

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The view of `tensor` this box covers."""
        for dim, (start, size) in enumerate(zip(self.offset, self.shape, strict=True)):
            tensor = tensor.narrow(dim, start, size)
        return tensor


def whole(shape: tuple[int, ...]) -> Box:
    return Box((0,) * len(shape), tuple(shape))


def rows(shape: tuple[int, ...], dim: int, start: int, size: int) -> Box:
    """The block of `shape` with `size` indices from `start` on `dim`, everything on the other dims."""
    return Box(tuple(start if d == dim else 0 for d in range(len(shape))),
               tuple(size if d == dim else n for d, n in enumerate(shape)))


@dataclass(frozen=True)
class Layout:
    mesh_shape: tuple[int, ...]
    ranks: tuple[int, ...]  # global trainer ranks in the mesh's row-major order
    placements: tuple[tuple[object, ...], ...]

    def held(self, shape: tuple[int, ...], rank: int) -> Box:
        """The box of a parameter of `shape` that rank `rank`'s local tensor holds."""
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        coordinate = list(_unravel(self.ranks.index(rank), self.mesh_shape))
        placements = [_placement(p) for p in self.placements]
        local, offset = _compute_local_shape_and_global_offset(shape, self.mesh_shape, coordinate, placements)
        return Box(tuple(offset), tuple(local))

    def boxes(self, shape: tuple[int, ...]) -> dict[int, Box]:
        """Each rank's box of a parameter of `shape`; ranks holding nothing are left out."""
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        placements = [_placement(p) for p in self.placements]
        held: dict[Box, list[int]] = {}
        for i, rank in enumerate(self.ranks):
            coordinate = list(_unravel(i, self.mesh_shape))
            local, offset = _compute_local_shape_and_global_offset(shape, self.mesh_shape, coordinate, placements)
            if math.prod(local) > 0:
                held.setdefault(Box(tuple(offset), tuple(local)), []).append(rank)
        out: dict[int, Box] = {}
        for box, holders in held.items():  # replicas: one sender per byte, the box split along dim 0
            if not box.shape:  # a scalar: its first holder sends it
                out[holders[0]] = box
                continue
            for k, rank in enumerate(holders):
                start, size = _chunk(box.shape[0], len(holders), k)
                if size:
                    out[rank] = Box((box.offset[0] + start, *box.offset[1:]), (size, *box.shape[1:]))
        return out


def replicated(ranks: Iterable[int]) -> Layout:
    """A plain (not sharded) parameter every rank in `ranks` holds whole."""
    ranks = tuple(ranks)
    return Layout((len(ranks),), ranks, (("R",),))


def layout_of(tensor: torch.Tensor, world: int) -> Layout:
    """The `Layout` of a trainer parameter: a DTensor's mesh and placements, or replicated on all `world` ranks."""
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None:
        return replicated(range(world))
    codes = []
    for p in tensor.placements:
        if type(p).__name__ == "_StridedShard":
            codes.append(("SS", p.dim, p.split_factor))
        elif p.is_shard():
            codes.append(("S", p.dim))
        elif p.is_replicate():
            codes.append(("R",))
        else:
            raise ValueError(f"m2n weight sync cannot plan placement {p} of a trainer parameter: set "
                             "weights.transport=broadcast")
    return Layout(tuple(mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist()), tuple(codes))


def _placement(code: tuple[object, ...]) -> object:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if code[0] == "S":
        return Shard(int(code[1]))  # type: ignore[call-overload]
    if code[0] == "SS":
        return _StridedShard(int(code[1]), split_factor=int(code[2]))  # type: ignore[call-overload]
    return Replicate()


def _unravel(i: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(i % n)
        i //= n
    return tuple(reversed(out))


def _chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """torch.chunk's i-th of k pieces of n: (start, size), size 0 past the end."""
    size = -(-n // k) if k else 0
    start = min(i * size, n)
    return start, max(0, min(size, n - start))


def _even(n: int, k: int, i: int, name: str) -> tuple[int, int]:
    if n % k:
        raise ValueError(f"{name}: {n} rows do not split over {k} tensor-parallel ranks; vLLM needs them to")
    return i * (n // k), n // k


@dataclass(frozen=True)
class Wire:
    name: str
    shape: tuple[int, ...]
    itemsize: int
    layout: int  # index into the plan's layouts
    param_shape: tuple[int, ...]
    expert: int = -1
    part: tuple[int, int] = (0, 1)  # rows (k of n) of the expert's slab
    flipped: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def trainer_boxes(self, layout: Layout) -> dict[int, Box]:
        """Each trainer rank's box of this wire tensor, in the wire tensor's coordinates."""
        out = {}
        for rank, box in layout.boxes(self.param_shape).items():
            if self.expert >= 0:  # one expert of a fused tensor: whole on the rank whose rows hold it
                if box.offset[0] <= self.expert < box.offset[0] + box.shape[0]:
                    assert box.shape[1:] == self.param_shape[1:], f"{self.name}: experts split inside an expert"
                    out[rank] = whole(self.shape)
                continue
            out[rank] = Box((box.offset[0], box.offset[2], box.offset[1]), (box.shape[0], box.shape[2], box.shape[1])) \
                if self.flipped else box
        return out

    def origin(self, layout: Layout, rank: int) -> Box:
        """The box of this wire tensor that `local()` gives on trainer rank `rank` (what its shard holds)."""
        if self.expert >= 0:
            return whole(self.shape)
        box = layout.held(self.param_shape, rank)
        return Box((box.offset[0], box.offset[2], box.offset[1]), (box.shape[0], box.shape[2], box.shape[1])) \
            if self.flipped else box

    def local(self, param_local: torch.Tensor, held: Box) -> torch.Tensor:
        """This wire tensor's part of a trainer rank's local shard (`param_local`, whose box is `held`), in the
        wire's coordinates, relative to `origin()`."""
        if self.expert >= 0:
            k, n = self.part
            return param_local[self.expert - held.offset[0]].chunk(n)[k]
        return param_local.transpose(1, 2) if self.flipped else param_local


def parameters(wires: list[Wire]) -> int:
    """How many trainer parameters (and buffers) `wires` come from: what the broadcast gathers, one collective each
    (a fused experts tensor sent per expert is one)."""
    return sum(1 for w in wires if w.expert < 0 or (w.expert == 0 and w.part[0] == 0))


@dataclass(frozen=True)
class Dims:
    kv_heads: int = 0  # 0: no k/v rule (k/v go whole)
    sliced_experts: bool = False  # routed experts loaded by vLLM's fused-MoE rows (rlray.config.families)
    sliced_vision: bool = False  # a Qwen3-VL vision tower split by the engines' TP (not mm_encoder_tp_mode=data)

    @classmethod
    def of(cls, config: Any, sliced_experts: bool, sliced_vision: bool) -> Dims:
        """From a transformers config (a vision-language one's text config holds the k/v heads) and its family's
        flags (rlray.config.families)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(int(getattr(text, "num_key_value_heads", 0) or 0), sliced_experts,
                   sliced_vision and getattr(config, "vision_config", None) is not None)


@dataclass(frozen=True)
class Engines:
    tp: tuple[int, ...]
    expert_parallel: bool = False

    def workers(self) -> list[tuple[int, int]]:
        """(TP rank, TP size) of every worker, in weight-group order."""
        return [(r, t) for t in self.tp for r in range(t)]


def worker_boxes(wire: Wire, tp_rank: int, tp: int, dims: Dims, ep: bool = False) -> list[Box]:
    """The region of `wire` (checkpoint coordinates) a worker of TP rank `tp_rank` of `tp` reads."""
    shape, name = wire.shape, wire.name
    if tp == 1 or not shape:
        return [whole(shape)]
    if _VOCAB.search(name):
        padded = -(-shape[0] // VOCAB_PAD) * VOCAB_PAD
        per = padded // tp
        start, end = min(tp_rank * per, shape[0]), min((tp_rank + 1) * per, shape[0])
        return [rows(shape, 0, start, end - start)] if end > start else []
    if dims.sliced_vision and _VISION.search(name):
        return _vision(wire, tp_rank, tp)
    if not _LANGUAGE.search(name) or "visual" in name or "vision" in name:
        return [whole(shape)]
    if dims.sliced_experts and (fused := _FUSED.search(name)):
        return _experts(wire, fused.group(1), tp_rank, tp, ep)
    if dims.sliced_experts and (one := _PER_EXPERT.search(name)):
        return _one_expert(wire, one.group(1), tp_rank, tp, ep)
    if ".experts." in name:
        return [whole(shape)]
    if _COLUMN.search(name):
        return [rows(shape, 0, *_even(shape[0], tp, tp_rank, name))]
    if _KV.search(name) and dims.kv_heads:
        head = shape[0] // dims.kv_heads
        if tp <= dims.kv_heads:
            return [rows(shape, 0, *_even(shape[0], tp, tp_rank, name))]
        return [rows(shape, 0, (tp_rank // (tp // dims.kv_heads)) * head, head)]
    if _ROW.search(name) and len(shape) == 2:
        return [rows(shape, 1, *_even(shape[1], tp, tp_rank, name))]
    return [whole(shape)]


def _vision(wire: Wire, tp_rank: int, tp: int) -> list[Box]:
    shape, name = wire.shape, wire.name
    if _VISION_QKV.search(name):  # q, k, v stacked: each split by heads
        third = shape[0] // 3
        start, size = _even(third, tp, tp_rank, name)
        return [rows(shape, 0, k * third + start, size) for k in range(3)]
    if _VISION_COLUMN.search(name):
        return [rows(shape, 0, *_even(shape[0], tp, tp_rank, name))]
    if _VISION_ROW.search(name) and len(shape) == 2:
        return [rows(shape, 1, *_even(shape[1], tp, tp_rank, name))]
    return [whole(shape)]


def _expert_range(n: int, ep: int, r: int) -> tuple[int, int]:
    """vLLM's "linear" expert placement: rank r's first expert and count (the remainder to the first ranks)."""
    base, rem = divmod(n, ep)
    return r * base + min(r, rem), base + (r < rem)


def _experts(wire: Wire, param: str, tp_rank: int, tp: int, ep: bool) -> list[Box]:
    shape = wire.shape
    if ep:
        return [rows(shape, 0, *_expert_range(shape[0], tp, tp_rank))]
    # (E, 2I, H) gate then up; (E, H, I) down; transposed checkpoints swap the last two
    width_dim = (2 if wire.flipped else 1) if param == "gate_up_proj" else (1 if wire.flipped else 2)
    if param == "down_proj":
        return [rows(shape, width_dim, *_even(shape[width_dim], tp, tp_rank, wire.name))]
    half = shape[width_dim] // 2
    start, size = _even(half, tp, tp_rank, wire.name)
    return [rows(shape, width_dim, k * half + start, size) for k in (0, 1)]


def _one_expert(wire: Wire, param: str, tp_rank: int, tp: int, ep: bool) -> list[Box]:
    shape = wire.shape
    if ep:  # whole experts: this one is read by the worker whose range holds it
        first, count = _expert_range(wire.param_shape[0], tp, tp_rank)
        return [whole(shape)] if first <= wire.expert < first + count else []
    dim = 1 if param == "down_proj" else 0
    return [rows(shape, dim, *_even(shape[dim], tp, tp_rank, wire.name))]


@dataclass(frozen=True)
class Piece:
    name: str
    src: int  # trainer rank
    dst: int  # worker, from 0
    box: Box  # in the wire tensor's coordinates
    nbytes: int


@dataclass
class Plan:
    groups: list[list[Wire]]  # per layer group, in send order
    pieces: list[list[Piece]]  # per layer group
    trainers: int
    workers: int
    sent: list[int] = field(default_factory=list)  # bytes per trainer rank
    received: list[int] = field(default_factory=list)  # bytes per worker
    messages: int = 0

    def links(self, group: int) -> dict[tuple[int, int], list[Piece]]:
        """(src, dst) -> its pieces in this group, in a fixed order (both ends pack and unpack by it)."""
        out: dict[tuple[int, int], list[Piece]] = {}
        for piece in self.pieces[group]:
            out.setdefault((piece.src, piece.dst), []).append(piece)
        return out

    @property
    def imbalance(self) -> float:
        """The busiest trainer rank's bytes over the mean."""
        mean = sum(self.sent) / max(len(self.sent), 1)
        return max(self.sent) / mean if mean else 1.0

    def digest(self) -> str:
        h = hashlib.sha256()
        for group in self.pieces:
            for p in group:
                h.update(f"{p.name}|{p.src}|{p.dst}|{p.box.offset}|{p.box.shape};".encode())
        return h.hexdigest()[:16]


def offsets(pieces: list[Piece]) -> tuple[list[int], int]:
    """Each piece's byte offset in one packed message, and the message's size."""
    out, at = [], 0
    for p in pieces:
        out.append(at)
        at += -(-p.nbytes // ALIGN) * ALIGN
    return out, at


def layer_groups(wires: list[Wire]) -> list[list[Wire]]:
    """Consecutive wire tensors of one decoder layer form a group; every other run of tensors one more."""
    groups: list[list[Wire]] = []
    last: object = object()
    for wire in wires:
        match = _LAYER.search(wire.name)
        key = match.group(1) if match else None
        if not groups or key != last:
            groups.append([])
        groups[-1].append(wire)
        last = key
    return groups


def plan(wires: list[Wire], layouts: list[Layout], trainers: int, engines: Engines, dims: Dims) -> Plan:
    """Every piece that moves: for each wire tensor, each trainer rank's box overlapped with each worker's region."""
    workers = engines.workers()
    groups = layer_groups(wires)
    out = Plan(groups, [], trainers, len(workers), [0] * trainers, [0] * len(workers))
    for group in groups:
        pieces = []
        for wire in group:
            sources = sorted(wire.trainer_boxes(layouts[wire.layout]).items())
            for dst, (tp_rank, tp) in enumerate(workers):
                for region in worker_boxes(wire, tp_rank, tp, dims, engines.expert_parallel):
                    for src, box in sources:
                        if (piece := box & region) is not None:
                            pieces.append(Piece(wire.name, src, dst, piece, piece.numel * wire.itemsize))
        pieces.sort(key=lambda p: (p.src, p.dst))  # stable: wire order inside each link
        for p in pieces:
            out.sent[p.src] += p.nbytes
            out.received[p.dst] += p.nbytes
        out.messages += len({(p.src, p.dst) for p in pieces})
        out.pieces.append(pieces)
    return out
