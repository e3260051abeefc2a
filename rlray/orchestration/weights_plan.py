"""The plan's forecast of the weight path: what a sync moves and how long it takes, by broadcast and by m2n, what
the HF export needs in host RAM, and what a checkpoint writes. Estimates, printed as such by `dry_run=true`.

Contract: `weights_plan(c, shape)` returns a `WeightsPlan` (None when syncs move no full weights over a network:
`cluster.colocate`, LoRA; `Unplanned`, one line, when the engines' TP splits a tensor their loaders cannot). `lines()`
is what the plan prints, `problems()` a predicted sync past `weights.sync_timeout_s` or a sync whose staging does not
fit beside a GPU engine (one line each; the run would give up on every sync, or its engines run out of memory at the
first), `warnings()` an HF export needing more than one node's `cluster.host_memory_gb` (one line; the run trains and
checkpoints, its last step fails).
- Staging on an engine GPU (`staging`): a worker builds the full-shape tensors of a layer group before its loaders
  slice them, and vLLM's layerwise reload holds what one layer's loaders were handed until the layer is whole
  (vllm/model_executor/model_loader/reload/layerwise.py, `info.loaded_weights`), so a worker's peak is its largest
  layer group full-shape (m2n: the tensors it reads any piece of; broadcast: every tensor) plus its receive buffers
  (m2n: two per trainer rank, its largest message; broadcast: two buckets). It must fit in what the engine leaves
  free: the GPU less rollout.kv_cache_fraction of it (or less its weights, rollout.kv_cache_gb and the activation
  reserve), less `SYNC_RESERVE_GB` for the group's NCCL buffers (assumed). m2n's send buffers (two per worker, its
  largest message) count in the trainer's memory (`send_buffers`).
- The wire list is the trainer's (rlray.actors.publisher.WeightPublisher.shard_source) from the config alone: the
  model on the meta device, every parameter and persistent floating buffer under its name, each with its layout as
  FSDP2 and EP leave it (`layouts`: dense Shard(0) over all trainer.num_ranks; routed experts, with trainer.ep > 1,
  _StridedShard(0, ep) on efsdp and Shard(0) on ep; buffers replicated), experts per expert where the family sends
  them so, fused experts transposed where its checkpoints are; the engines' dtype on the wire, buffers in their own.
- Workers: rollout.num_actors engines (rollout.max_actors for an elastic pool: its largest) x data_parallel_size
  replicas x tensor_parallel_size; rlray.weightsync.totals counts the m2n plan's bytes and messages.
- Time model (`Costs`): seconds = message_s x messages + byte_s x bytes + tensor_s x tensors + sync_s, at the
  busiest end: m2n, the larger of the busiest trainer rank (bytes and messages it sends) and the busiest worker
  (bytes and messages it receives), plus the most tensors one worker loads; broadcast, a message per bucket trainer
  rank 0 sends and per parameter every rank gathers (`boxes.parameters`; none on one rank), every byte, every tensor
  loaded by every worker. The lower bound is the larger of the largest shard one rank holds and the largest slice
  one worker reads, each moved once, over one link, nothing else.
  `GPU` takes published link bandwidths; `CPU` is `fit(rows)` (least squares, non-negative, over measured
  (messages, bytes, tensors, seconds)) of `python -m rlray.bench weight-fit`'s rows on this machine
  (rlray.orchestration.sync_costs).
- HF export (rlray.models.export, streamed: every rank writes its own tensors in bf16): host RAM per rank beyond its
  shards, up to one layer's fp32 bytes (experts included: an upper estimate, experts stored per expert are written
  where they are held) or the largest root tensor (embedding, head) in bf16, whichever is more; times the trainer
  ranks of one node (`cluster.gpus_per_node`; on CPU every rank), each beside its checkpoint.async_save staging copy
  (fp32 weights and AdamW state), against `cluster.host_memory_gb`. Beside it, what
  the gathered export it replaced put on rank 0 (the fp32 model). Checkpoint: each rank's DCP shard, fp32 weights and AdamW state (and the KL reference with algo.kl_coef > 0),
  written at `FS_BYTES_S` per rank.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any

from rlray.config import Config, backend
from rlray.config.checks import m2n_refusal
from rlray.config.families import family, known
from rlray.models.shape import ModelShape
from rlray.orchestration.memory import engine_weights
from rlray.orchestration.phases import BYTES, ENGINE_RESERVE_GB, GB
from rlray.orchestration.sync_costs import CPU, GPU, Links
from rlray.weightsync.boxes import Dims, Engines, Layout, Wire, layer_groups, parameters, replicated
from rlray.weightsync.totals import Holders, Totals, group_name, held_bytes, totals
from rlray.weightsync.transport import BUCKET_BYTES

SYNC_RESERVE_GB = 1.0  # an engine GPU's NCCL buffers for the weight group, outside vLLM's budget (assumed)
FS_BYTES_S = 2e9  # a checkpoint's write rate per trainer rank: a parallel filesystem's ~16 GB/s per node of 8 GPUs
NCCL_BUCKET_BYTES = 1 << 30  # vLLM's packed NCCL buffer when weights.bucket_mb is unset
_IN_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")


# ---- the wire list from the config ------------------------------------------------------------
def wires(c: Config, hf: Any) -> tuple[list[Wire], list[Layout], Dims]:
    """The trainer's wire tensors, their layouts over trainer.num_ranks, and the loader dims (see the contract)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from rlray.models.load import EXPERTS, FUSED
    from rlray.models.multimodal import is_vision, vision_tower
    from rlray.parallel.expert import moe_experts
    from rlray.parallel.hf import expert_sharded, experts_transposed_on_disk

    with torch.device("meta"):
        model = (AutoModelForImageTextToText if is_vision(hf) else AutoModelForCausalLM).from_config(hf)
    n, ep = c.trainer.num_ranks, c.trainer.ep
    dense = Layout((n,), tuple(range(n)), (("S", 0),))
    experts = Layout((n // ep, ep), tuple(range(n)), (("SS", 0, ep), ("S", 0)))
    layouts = [dense, experts, replicated(range(n))]
    sharded = {id(getattr(m, p)) for _, m in moe_experts(model) for p in expert_sharded(m)} if ep > 1 else set()
    tower = vision_tower(model) if c.trainer.freeze_vision else None
    unsent = {id(p) for p in tower.parameters()} if tower is not None else set()
    model_type = hf.model_type
    f = family(model_type) if known(model_type) else None
    per_expert, transposed = bool(f and f.send_per_expert), experts_transposed_on_disk(model_type)
    wire_bytes = BYTES.get(str(c.rollout.dtype), 2)
    out: list[Wire] = []
    for name, p in model.named_parameters():
        if id(p) in unsent:
            continue
        shape, layout = tuple(p.shape), 1 if id(p) in sharded else 0
        fused = EXPERTS.match(name) if per_expert else None
        if fused is not None:
            parts = f.expert_names.get(fused["param"], (fused["param"],)) if f else (fused["param"],)
            out += [Wire(f"{fused['prefix']}.{e}.{part}", (shape[1] // len(parts), *shape[2:]), wire_bytes, layout,
                         shape, e, (k, len(parts))) for e in range(shape[0]) for k, part in enumerate(parts)]
            continue
        flipped = transposed and FUSED.match(name) is not None
        out.append(Wire(name, (shape[0], shape[2], shape[1]) if flipped else shape, wire_bytes, layout, shape,
                        flipped=flipped))
    persistent = set(model.state_dict())
    out += [Wire(name, tuple(b.shape), b.dtype.itemsize, 2, tuple(b.shape)) for name, b in model.named_buffers()
            if name in persistent and b.is_floating_point()]
    return out, layouts, Dims.of(hf, bool(f and f.sliced_experts), bool(f and f.sliced_vision))


def engines(c: Config) -> Engines:
    """Every engine's TP group in weight-group order: the pool at its largest, each DP replica a group."""
    r = c.rollout
    count = max(r.num_actors, r.max_actors or 0) * r.data_parallel_size
    return Engines((r.tensor_parallel_size,) * count, r.expert_parallel)


def size(n: float) -> str:
    """Bytes for people: 3.99 MB, 213.70 GB, 2.05 TB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def secs(s: float) -> str:
    return f"{s:.2f} s" if s >= 0.01 else f"{s * 1e3:.2g} ms"


# ---- the forecast ---------------------------------------------------------------------------
@dataclass
class WeightsPlan:
    c: Config
    shape: ModelShape
    m2n: Totals
    held: list[int]  # bytes of the wire tensors each trainer rank holds (its shards, each byte once)
    nbytes: int  # one sync's bytes, every wire tensor once
    links: Links
    root_largest: int = 0  # elements of the largest tensor outside the decoder layers (embedding, head)
    params: int = 0  # trainer parameters and buffers the wire tensors come from (the broadcast's gathers)
    largest_group: tuple[int, str] = (0, "")  # bytes of the largest layer group, every tensor full-shape; its name

    @property
    def buckets(self) -> int:
        return math.ceil(self.nbytes / self.bucket_bytes)

    def m2n_terms(self) -> tuple[int, int, int]:
        """(messages, bytes, tensors) at the busiest end of an m2n sync."""
        return self.m2n.terms()

    def seconds(self, transport: str) -> float:
        if transport == "m2n":
            return self.links.m2n.seconds(*self.m2n_terms())
        return self.links.broadcast.seconds(self.buckets + self.params, self.nbytes, self.m2n.wires)

    @property
    def lower_bound(self) -> float:
        return max(max(self.held), max(self.m2n.received)) / self.links.link_bytes_s

    def export_bytes(self) -> tuple[float, float]:
        """(host RAM of the streamed export per rank, per node of trainer ranks with checkpoint.async_save's staging
        copy of each rank's fp32 weights and AdamW state beside it), bytes; see the contract."""
        s, n = self.shape, self.c.trainer.num_ranks
        rank = max(4 * (s.layer_dense + s.layer_experts), 2 * self.root_largest)
        staging = 12 * s.params / n if self.c.checkpoint.async_save else 0.0
        on_node = min(n, self.c.cluster.gpus_per_node) if self.c.trainer.gpus_per_rank else n
        return rank, (rank + staging) * on_node

    def checkpoint_bytes(self) -> float:
        """One trainer rank's DCP shard: fp32 weights and AdamW's two moments, and the KL reference's weights with
        algo.kl_coef > 0."""
        ref = 4 * self.shape.params if self.c.algo.kl_coef > 0 else 0
        return (12 * self.shape.params + ref) / self.c.trainer.num_ranks

    def lines(self) -> list[str]:
        return self._sync_lines() + self._storage_lines()

    def _sync_lines(self) -> list[str]:
        c, t, r = self.c, self.m2n, self.c.rollout
        busiest, worker = t.busiest, max(range(len(t.received)), key=t.received.__getitem__)
        note = (" (m2n on GPUs: NCCL point-to-point, built and tested on a stand-in communicator, not yet run on a "
                "GPU)") if c.trainer.gpus_per_rank else ""
        imbalance = max(t.sent) * len(t.sent) / max(sum(t.sent), 1)
        return [f"weight sync forecast (estimates; weights.transport={c.weights.transport} is this run's){note}:",
                (f"  one sync: {size(self.nbytes)} in {t.wires:,} tensors, {c.trainer.num_ranks} trainer ranks -> "
                 f"{plural(len(t.received), 'worker')} ({plural(len(engines(c).tp), 'TP group')} of "
                 f"{r.tensor_parallel_size})"),
                (f"  broadcast: every trainer rank gathers {self.params:,} parameters, rank 0 sends "
                 f"{size(self.nbytes)} in {plural(self.buckets, 'bucket')}, every worker "
                 f"receives it all and loads {t.wires:,} tensors: ~{secs(self.seconds('broadcast'))}"),
                (f"  m2n: the busiest trainer rank ({busiest}) sends {size(max(t.sent))} in {max(t.sends):,} messages, "
                 f"the busiest worker ({worker}) receives {size(max(t.received))} in {max(t.receives):,} messages and "
                 f"loads {max(t.tensors):,} tensors; {t.messages:,} messages in all: ~{secs(self.seconds('m2n'))} "
                 f"(imbalance {imbalance:.2f})"),
                (f"  lower bound: {secs(self.lower_bound)} (each rank sends its {size(max(self.held))} shard once, each "
                 f"worker receives its {size(max(t.received))} slice, at {self.links.link_bytes_s / GB:g} GB/s)"),
                f"  time model: {self.links.source} (rlray.orchestration.weights_plan)", *self._staging_lines()]

    def _storage_lines(self) -> list[str]:
        c = self.c
        rank, node = self.export_bytes()
        per_rank = self.checkpoint_bytes()
        return [(f"HF export (checkpoint.export_hf={str(c.checkpoint.export_hf).lower()}, streamed, bf16): up to "
                 f"{size(rank)} of host RAM per rank beyond its shards, {size(node)} per node"
                 f"{' with checkpoint.async_save' if c.checkpoint.async_save else ''} (cluster.host_memory_gb="
                 f"{c.cluster.host_memory_gb:g}); the gathered export it replaced put "
                 f"{size(4 * self.shape.params)} on rank 0"),
                (f"checkpoint (DCP): {size(per_rank)} per rank, {size(per_rank * c.trainer.num_ranks)} in all; "
                 f"~{secs(per_rank / FS_BYTES_S)} of writing at {FS_BYTES_S / GB:g} GB/s per rank "
                 f"(rlray.orchestration.weights_plan.FS_BYTES_S, assumed){', in the background' if c.checkpoint.async_save else ''}")]

    def staging(self, transport: str) -> tuple[int, int, str]:
        """(full-shape bytes, receive buffers' bytes, the layer group) at the worker that stages the most."""
        if transport == "m2n":
            t = self.m2n
            worker = max(range(len(t.staged)), key=lambda w: t.staged[w] + t.recv_buffers[w])
            return t.staged[worker], t.recv_buffers[worker], t.peak_group
        return self.largest_group[0], 2 * self.bucket_bytes, self.largest_group[1]

    @property
    def bucket_bytes(self) -> int:
        mb = self.c.weights.bucket_mb
        return mb << 20 if mb else NCCL_BUCKET_BYTES if backend(self.c) == "nccl" else BUCKET_BYTES  # a broadcast's

    def engine_free(self) -> float | None:
        """Bytes an engine GPU leaves free for a sync (see the contract); None for CPU engines."""
        r, mem = self.c.rollout, self.c.cluster.gpu_memory_gb * GB
        if not r.gpus_per_actor:
            return None
        if r.kv_cache_gb > 0:
            claimed = engine_weights(self.shape, r) / r.tensor_parallel_size + r.kv_cache_gb * 2**30 + \
                ENGINE_RESERVE_GB * GB
        else:
            claimed = r.kv_cache_fraction * mem
        return mem - claimed - SYNC_RESERVE_GB * GB

    def _staging_lines(self) -> list[str]:
        free = self.engine_free()
        if free is None:
            return []
        r = self.c.rollout
        parts = []
        for transport in ("m2n", "broadcast"):
            full, buffers, group = self.staging(transport)
            parts.append(f"{transport} up to {size(full + buffers)} ({size(full)} of {group}'s full-shape tensors, "
                         f"{size(buffers)} of buffers)")
        budget = (f"rollout.kv_cache_gb={r.kv_cache_gb:g}" if r.kv_cache_gb > 0 else
                  f"1 - rollout.kv_cache_fraction={r.kv_cache_fraction:g} of {self.c.cluster.gpu_memory_gb:g} GB")
        return [(f"  staging per engine GPU (held by vLLM's layerwise reload until a layer is loaded): {parts[0]}; "
                 f"{parts[1]}; the engine leaves ~{size(free)} free ({budget}, less {SYNC_RESERVE_GB:g} GB for NCCL)")]

    def _staging_problem(self) -> list[str]:
        free, transport, r = self.engine_free(), self.c.weights.transport, self.c.rollout
        if free is None:
            return []
        need = sum(self.staging(transport)[:2])
        if need <= free:
            return []
        _, buffers, group = self.staging(transport)
        fixes = []
        if transport == "broadcast" and sum(self.staging("m2n")[:2]) <= free:
            fixes.append("set weights.transport=m2n (each worker stages what it reads)")
        elif self.shape.experts and not r.expert_parallel and self._fits(transport="m2n", expert_parallel=True):
            fixes.append(("set " if transport == "m2n" else "set weights.transport=m2n and ")
                         + "rollout.expert_parallel=true (each worker stages its own experts)")
        fraction = math.floor(100 * (1 - (need + SYNC_RESERVE_GB * GB) / (self.c.cluster.gpu_memory_gb * GB))) / 100
        if r.kv_cache_gb <= 0 and fraction > 0:
            fixes.append(f"lower rollout.kv_cache_fraction to {fraction:g}")
        return [(f"weights.transport={transport}: a sync stages up to {size(need)} on each engine GPU ({group}'s "
                 f"full-shape tensors, which vLLM's layerwise reload holds until the layer is loaded, and "
                 f"{size(buffers)} of receive buffers), more than the ~{size(free)} an engine leaves free; "
                 + (" or ".join(fixes) if fixes else "raise rollout.tensor_parallel_size"))]

    def auto(self) -> str:
        """weights.transport=auto's choice: on GPU trainers m2n where the run allows it (checks.m2n_refusal), its
        forecast beats the broadcast's and its staging fits beside the engines (or the broadcast's does not either);
        broadcast otherwise, and on CPUs (m2n is a choice there: the CPU pipelines run broadcast by default)."""
        if not self.c.trainer.gpus_per_rank or m2n_refusal(self.c) is not None:
            return "broadcast"
        free = self.engine_free()
        fits = {t: free is None or sum(self.staging(t)[:2]) <= free for t in ("m2n", "broadcast")}
        faster = self.seconds("m2n") < self.seconds("broadcast")
        return "m2n" if fits["m2n"] and (faster or not fits["broadcast"]) else "broadcast"

    def _fits(self, transport: str, expert_parallel: bool) -> bool:
        """Whether this run's sync staging would fit with `weights.transport` and `rollout.expert_parallel` so."""
        c = copy.deepcopy(self.c)
        c.weights.transport, c.rollout.expert_parallel = transport, expert_parallel
        other = weights_plan(c, self.shape)
        return isinstance(other, WeightsPlan) and sum(other.staging(transport)[:2]) <= (other.engine_free() or 0)

    def problems(self) -> list[str]:
        w = self.c.weights
        seconds = self.seconds(w.transport)
        if seconds <= w.sync_timeout_s:
            return self._staging_problem()
        other = "m2n" if w.transport == "broadcast" else "broadcast"
        faster = f", or weights.transport={other} (~{secs(self.seconds(other))})" \
            if self.seconds(other) <= w.sync_timeout_s else ""
        source = self.links.source.split(":")[0]
        return [(f"weights.sync_timeout_s={w.sync_timeout_s:g} but a {w.transport} sync is predicted to take "
                 f"~{secs(seconds)} ({source} time model); raise weights.sync_timeout_s{faster}")] + \
            self._staging_problem()

    def warnings(self) -> list[str]:
        node, host = self.export_bytes()[1] / GB, self.c.cluster.host_memory_gb
        if not self.c.checkpoint.export_hf or node <= host:
            return []
        return [(f"checkpoint.export_hf=true: the HF export may take up to {node:.0f} GB of host RAM on a node of "
                 f"trainer ranks (checkpoint.async_save's staging copies included), more than cluster.host_memory_gb="
                 f"{host:g}; raise cluster.host_memory_gb if the nodes have it, or set checkpoint.export_hf=false")]


def weights_plan(c: Config, shape: ModelShape) -> WeightsPlan | Unplanned | None:
    """The forecast of `c`'s full-weight syncs over the network; None when colocated or with LoRA, `Unplanned` when
    the engines' shape has no m2n plan (the loaders' split refused)."""
    if c.cluster.colocate or c.trainer.lora.enabled:
        return None
    wire, layouts, dims = wires(c, shape.hf)
    n, held = c.trainer.num_ranks, Holders(layouts)
    try:
        m2n = totals(wire, layouts, n, engines(c), dims, held)
    except ValueError as e:
        return Unplanned(c, str(e))
    root = max((math.prod(w.shape) for w in wire if not _IN_LAYER.search(w.name)), default=0)
    groups = layer_groups(wire)
    largest = max(((sum(w.nbytes for w in g), -i) for i, g in enumerate(groups)), default=(0, 0))
    return WeightsPlan(c, shape, m2n, held_bytes(wire, layouts, n, held), sum(w.nbytes for w in wire),
                       GPU if c.trainer.gpus_per_rank else CPU, root, parameters(wire) if n > 1 else 0,
                       (largest[0], group_name(groups[-largest[1]])) if groups else (0, ""))


@dataclass
class Unplanned:
    """An engine shape no m2n plan serves: one line, and a problem when the run syncs by m2n."""

    c: Config
    error: str

    def lines(self) -> list[str]:
        return [f"weight sync forecast: none ({self.error})"]

    def problems(self) -> list[str]:
        return [f"weights.transport=m2n: {self.error}"] if self.c.weights.transport == "m2n" else []

    def warnings(self) -> list[str]:
        return []
