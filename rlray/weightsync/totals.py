"""The many-to-many plan's totals without its pieces: what rlray.weightsync.boxes.plan counts, at cluster scale.

Contract: `totals(wires, layouts, trainers, engines, dims)` returns `Totals` equal, field for field, to
`of_plan(plan(wires, layouts, trainers, engines, dims))`: the bytes each trainer rank sends and each worker receives,
the messages (one per (trainer rank, worker) link per layer group, `Plan.messages`), the messages each rank sends and
each worker receives, the tensors each worker loads (those it receives any piece of), and the memory the m2n engines
take for it: each worker's staging peak (the full-shape tensors of the layer group where it stages the most: what
rlray.weightsync.m2n allocates and vLLM's layerwise reload holds until the layer is loaded, `peak_group` naming
the group of the largest), each worker's receive buffers and each trainer rank's send buffers (two per peer, each
the largest message between them, 16-byte aligned pieces). Pure, like boxes.

`plan()` enumerates every wire x worker x trainer rank; this does the same box arithmetic once per distinct case:
- workers: every engine of one TP size reads the same regions per TP rank, so each (TP size, TP rank) is computed
  once and counted for every engine of that size;
- trainer ranks: a parameter's boxes depend on its layout and shape alone (a few of each), so they are computed once;
  one expert of a fused tensor sits whole on the ranks whose rows hold it (one lookup per expert);
- wires: the loader rules read a name's pattern, not its layer or expert number, so wires equal but for those
  numbers (and, under engine EP, the expert) share one result.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from rlray.weightsync.boxes import (
    ALIGN,
    Box,
    Dims,
    Engines,
    Layout,
    Plan,
    Wire,
    layer_groups,
    offsets,
    whole,
    worker_boxes,
)

_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")
_LAYER_PREFIX = re.compile(r".*?layers\.\d+")


@dataclass
class Totals:
    sent: list[int]  # bytes per trainer rank
    received: list[int]  # bytes per worker (weight-group order, from 0)
    messages: int  # (trainer rank, worker) links summed over layer groups: Plan.messages
    sends: list[int]  # messages per trainer rank
    receives: list[int]  # messages per worker
    tensors: list[int]  # wire tensors per worker (those it receives any piece of: what its loader is called with)
    wires: int = 0  # wire tensors in all
    staged: list[int] = field(default_factory=list)  # bytes per worker: its largest layer group's full-shape tensors
    peak_group: str = ""  # the layer group where a worker stages the most (its first tensor's name, to its layer)
    recv_buffers: list[int] = field(default_factory=list)  # bytes per worker: 2 per trainer rank, its largest message
    send_buffers: list[int] = field(default_factory=list)  # bytes per trainer rank: 2 per worker, its largest message

    def terms(self) -> tuple[int, int, int]:
        """The time model's (messages, bytes, tensors) at the busiest end: the most messages and bytes any trainer
        rank sends or worker receives, and the most tensors one worker loads."""
        return max(max(self.sends), max(self.receives)), max(max(self.sent), max(self.received)), max(self.tensors)

    @property
    def busiest(self) -> int:
        """The trainer rank that sends the most bytes."""
        return max(range(len(self.sent)), key=self.sent.__getitem__)


def of_plan(p: Plan) -> Totals:
    """The totals of a full plan, counted from its pieces."""
    sends, receives = [0] * p.trainers, [0] * p.workers
    loaded: list[set[str]] = [set() for _ in range(p.workers)]
    staged, peak = [0] * p.workers, (0, 0)
    largest: dict[tuple[int, int], int] = {}
    for g in range(len(p.pieces)):
        names: list[set[str]] = [set() for _ in range(p.workers)]
        for (src, dst), pieces in p.links(g).items():
            sends[src] += 1
            receives[dst] += 1
            names[dst].update(piece.name for piece in pieces)
            largest[(src, dst)] = max(largest.get((src, dst), 0), offsets(pieces)[1])
        full = {w.name: w.nbytes for w in p.groups[g]}
        for dst, here in enumerate(names):
            loaded[dst] |= here
            staged[dst] = max(staged[dst], sum(full[n] for n in here))
            peak = max(peak, (sum(full[n] for n in here), -g))
    recv, send = [0] * p.workers, [0] * p.trainers
    for (src, dst), n in largest.items():
        recv[dst] += 2 * n
        send[src] += 2 * n
    return Totals(list(p.sent), list(p.received), p.messages, sends, receives, [len(s) for s in loaded],
                  sum(len(g) for g in p.groups), staged, group_name(p.groups[-peak[1]]) if p.groups else "", recv, send)


def group_name(group: list[Wire]) -> str:
    """A layer group's name: its first tensor's, to the layer (`model.layers.3`), or the tensor's own."""
    name = group[0].name
    match = _LAYER_PREFIX.match(name)
    return match.group(0) if match else name


Link = tuple[int, int, int]  # (trainer rank, TP size, TP rank): one per engine of that TP size
Case = tuple[object, ...]


def totals(wires: list[Wire], layouts: list[Layout], trainers: int, engines: Engines, dims: Dims,
           held: Holders | None = None) -> Totals:
    """`of_plan(plan(...))` by the cases above; see the module's contract. `held`: a cache of the trainer boxes to
    share with `held_bytes`."""
    sizes = Counter(engines.tp)  # engines per TP size
    cases, uses, groups, labels = _cases(wires, held or Holders(layouts), sizes, dims, engines.expert_parallel)
    per_link: Counter[Link] = Counter()  # bytes over all wires
    loads: Counter[tuple[int, int]] = Counter()  # tensors per (TP size, TP rank)
    for key, n in uses.items():
        for link, (nbytes, _) in cases[key].items():
            per_link[link] += n * nbytes
        for t, r in {(t, r) for _, t, r in cases[key]}:
            loads[(t, r)] += n
    sent, sends, received = [0] * trainers, [0] * trainers, Counter[tuple[int, int]]()
    for (src, t, r), nbytes in per_link.items():
        sent[src] += nbytes * sizes[t]
        received[(t, r)] += nbytes
    receives: Counter[tuple[int, int]] = Counter()
    staged: Counter[tuple[int, int]] = Counter()
    largest: Counter[Link] = Counter()
    messages, peak = 0, (0, 0)
    for g, keys in enumerate(groups):  # a message per link per layer group
        message: Counter[Link] = Counter()
        full: Counter[tuple[int, int]] = Counter()
        for key, n in keys.items():
            for link, (_, aligned) in cases[key].items():
                message[link] += n * aligned
            for t, r in {(t, r) for _, t, r in cases[key]}:
                full[(t, r)] += n * _full_bytes(key)
        for link, nbytes in message.items():
            src, t, _ = link
            sends[src] += sizes[t]
            receives[link[1:]] += 1
            messages += sizes[t]
            largest[link] = max(largest[link], nbytes)
        for worker, nbytes in full.items():
            staged[worker] = max(staged[worker], nbytes)
            peak = max(peak, (nbytes, -g))
    recv, send = Counter[tuple[int, int]](), [0] * trainers
    for (src, t, r), nbytes in largest.items():
        recv[(t, r)] += 2 * nbytes
        send[src] += 2 * nbytes * sizes[t]
    workers = engines.workers()
    return Totals(sent, [received[(t, r)] for r, t in workers], messages, sends, [receives[(t, r)] for r, t in workers],
                  [loads[(t, r)] for r, t in workers], len(wires), [staged[(t, r)] for r, t in workers],
                  labels[-peak[1]] if labels else "", [recv[(t, r)] for r, t in workers], send)


def _full_bytes(key: Case) -> int:
    """A case's wire tensor, full-shape (what a worker stages of it): its shape x itemsize, both in the key."""
    return math.prod(key[1]) * key[2]  # type: ignore[arg-type]


def _cases(wires: list[Wire], held: Holders, sizes: Counter[int], dims: Dims, ep: bool
           ) -> tuple[dict[Case, dict[Link, tuple[int, int]]], Counter[Case], list[Counter[Case]], list[str]]:
    """Each distinct case's bytes per link, how many wires it stands for, the cases of each layer group (how many
    wires each) and each group's name."""
    cases: dict[Case, dict[Link, tuple[int, int]]] = {}
    uses: Counter[Case] = Counter()
    groups: list[Counter[Case]] = []
    labels: list[str] = []
    for group in layer_groups(wires):
        keys: Counter[Case] = Counter()
        for wire in group:
            holders = held.holders(wire)
            key = (_NUMBER.sub("0", wire.name), wire.shape, wire.itemsize, wire.layout, wire.param_shape,
                   wire.flipped, wire.expert if ep and wire.expert >= 0 else -1, holders)
            if key not in cases:
                cases[key] = _case(wire, held.sources(wire), sizes, dims, ep)
            uses[key] += 1
            keys[key] += 1
        groups.append(keys)
        labels.append(group_name(group))
    return cases, uses, groups, labels


def _case(wire: Wire, sources: dict[int, Box], sizes: Counter[int], dims: Dims, ep: bool
          ) -> dict[Link, tuple[int, int]]:
    """One wire's traffic: (bytes, bytes with each piece aligned as a message packs it) per link it uses."""
    links: dict[Link, tuple[int, int]] = {}
    for t in sizes:
        for r in range(t):
            for region in worker_boxes(wire, r, t, dims, ep):
                for src, box in sources.items():
                    if (piece := box & region) is not None:
                        nbytes, aligned = links.get((src, t, r), (0, 0))
                        size = piece.numel * wire.itemsize
                        links[(src, t, r)] = (nbytes + size, aligned + -(-size // ALIGN) * ALIGN)
    return links


class Holders:
    """Each wire's trainer boxes (what `Wire.trainer_boxes` gives), from one box computation per parameter shape."""

    def __init__(self, layouts: list[Layout]) -> None:
        self.layouts = layouts
        self.boxes: dict[tuple[int, tuple[int, ...]], dict[int, Box]] = {}
        self.flipped: dict[tuple[int, tuple[int, ...]], dict[int, Box]] = {}
        self.owners: dict[tuple[int, tuple[int, ...]], list[tuple[int, ...]]] = {}

    def _boxes(self, wire: Wire) -> dict[int, Box]:
        key = (wire.layout, wire.param_shape)
        if key in self.boxes:
            return self.boxes[key]
        layout, shape = self.layouts[wire.layout], wire.param_shape
        if not shape or any(p[0] != "R" and p[1] != 0 for p in layout.placements):
            self.boxes[key] = layout.boxes(shape)
            return self.boxes[key]
        rows = (wire.layout, (shape[0],))  # sharded on dim 0 alone: the other dims are whole on every rank
        if rows not in self.boxes:
            self.boxes[rows] = layout.boxes(rows[1])
        self.boxes[key] = {r: Box((b.offset[0], *[0] * (len(shape) - 1)), (b.shape[0], *shape[1:]))
                           for r, b in self.boxes[rows].items()}
        return self.boxes[key]

    def holders(self, wire: Wire) -> tuple[int, ...]:
        """The ranks holding one expert of a fused tensor whole; () for a parameter's own shards."""
        if wire.expert < 0:
            return ()
        key = (wire.layout, wire.param_shape)
        if key not in self.owners:
            self.owners[key] = self._owners(wire)
        return self.owners[key][wire.expert]

    def sources(self, wire: Wire) -> dict[int, Box]:
        """Each rank's box of `wire`: Wire.trainer_boxes."""
        if wire.expert >= 0:
            return {rank: whole(wire.shape) for rank in self.holders(wire)}
        if not wire.flipped:
            return self._boxes(wire)
        key = (wire.layout, wire.param_shape)
        if key not in self.flipped:
            self.flipped[key] = {r: Box((b.offset[0], b.offset[2], b.offset[1]), (b.shape[0], b.shape[2], b.shape[1]))
                                 for r, b in self._boxes(wire).items()}
        return self.flipped[key]

    def _owners(self, wire: Wire) -> list[tuple[int, ...]]:
        """Per expert, the ranks whose rows hold it whole (Wire.trainer_boxes's rule)."""
        owners: list[list[int]] = [[] for _ in range(wire.param_shape[0])]
        for rank, box in self._boxes(wire).items():
            assert box.shape[1:] == wire.param_shape[1:], f"{wire.name}: experts split inside an expert"
            for e in range(box.offset[0], box.offset[0] + box.shape[0]):
                owners[e].append(rank)
        return [tuple(o) for o in owners]


def held_bytes(wires: list[Wire], layouts: list[Layout], trainers: int, held: Holders | None = None) -> list[int]:
    """Bytes of the wire tensors each trainer rank holds (its boxes; replicas split, so each byte counts once)."""
    held = held or Holders(layouts)
    out = [0] * trainers
    for wire in wires:
        if wire.expert >= 0:
            for rank in held.holders(wire):
                out[rank] += wire.nbytes
            continue
        for rank, box in held.sources(wire).items():
            out[rank] += box.numel * wire.itemsize
    return out
