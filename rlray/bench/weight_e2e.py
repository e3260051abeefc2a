"""weight-sync, end to end: the trainer's weights into real vLLM engines through vLLM's
weight-transfer protocol (rlray's gloo engines), beside a raw collective of the same bytes.

The driver process is trainer rank 0: an HF model of the size's shapes in fp32, one process (so
the FSDP gather is not in these numbers; tests/dist covers it). The ceiling is a raw gloo
broadcast of the same buckets from the driver to a helper process, nothing else, in the same
run. Per engine (its dtype and TP size) it times:
- dense: full syncs, split as the trainer sees them: start (pause, open the layerwise reload),
  update (the broadcast and, beside it, the worker's load of each bucket) and finish (finalize
  the reload, reset the prefix cache, resume);
- delta (`weights.delta`): after each AdamW step at a learning rate (the default recipe's RL
  rate, 1e-4, first), a delta sync: bytes sent, the changed fraction, seconds;
- a bf16 engine also takes the fp32 wire (the trainer's fp32 master weights, cast by the
  engine): what the weight path sent before it cast to the engine's dtype.
Before each timed sync a raw round of the same buckets runs (`RawPeer`), so the two alternate
on the same machine; every engine starts from a fresh copy of the model and its optimizer, so
their delta rows follow the same optimizer steps. After every sync the engine scores a sequence
and its logprobs are compared with the trainer's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from rlray.bench.common import EngineClient, LoopThread, free_port, median, ratio

GB = 1e9
PHASES = ("start_weight_update", "update_weights", "finish_weight_update")


class TimedClient(EngineClient):
    """An EngineClient that times each protocol call of the last sync."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.phases: dict[str, float] = {}

    def _timed(self, name: str, call: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        call()
        self.phases[name] = time.perf_counter() - t0

    def start_weight_update(self) -> None:
        self._timed("start_weight_update", super().start_weight_update)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._timed("update_weights", lambda: super(TimedClient, self).update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._timed("finish_weight_update", lambda: super(TimedClient, self).finish_weight_update(weight_version))


def _raw_receiver(host: str, port: int, jobs: Any) -> None:
    from rlray.weightsync.transport import open_weight_group

    group = open_weight_group(host, port, 1, 2, 300.0)
    flat = torch.empty(0, dtype=torch.uint8)
    while (sizes := jobs.recv()) is not None:
        if flat.numel() < max(sizes):
            flat = torch.ones(max(sizes), dtype=torch.uint8)
        for n in sizes:
            group.broadcast(flat[:n])
        group.pg.allreduce([torch.zeros(1)]).wait()
    group.close()


class RawPeer:
    """A helper process on the far end of a plain gloo group: `round(sizes)` broadcasts buckets
    of those byte sizes to it and nothing else, the ceiling for any sync of the same buckets.
    Its rounds alternate with the end-to-end ones, so both see the same machine."""

    def __init__(self) -> None:
        from rlray.weightsync.transport import open_weight_group

        port = free_port()
        ctx = mp.get_context("spawn")
        self.jobs, far = ctx.Pipe()
        self.helper = ctx.Process(target=_raw_receiver, args=("127.0.0.1", port, far), daemon=True)
        self.helper.start()
        self.group = open_weight_group("127.0.0.1", port, 0, 2, 300.0)
        self.flat = torch.empty(0, dtype=torch.uint8)

    def round(self, sizes: list[int]) -> float:
        if self.flat.numel() < max(sizes):
            self.flat = torch.ones(max(sizes), dtype=torch.uint8)
        self.jobs.send(sizes)
        t0 = time.perf_counter()
        for n in sizes:
            self.group.broadcast(self.flat[:n])
        self.group.pg.allreduce([torch.zeros(1)]).wait()  # the helper has every byte
        return time.perf_counter() - t0

    def close(self) -> None:
        self.jobs.send(None)
        self.group.close()
        self.helper.join(60)


class Setup:
    """The driver's model (trainer rank 0), its optimizer, and a sequence to score."""

    def __init__(self, path: str, lr: float) -> None:
        from transformers import AutoModelForCausalLM

        self.path = path
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(0)
        vocab = self.model.config.vocab_size
        self.batch = torch.randint(3, vocab, (8, 64), generator=g)
        self.tokens = self.batch[0, :48].tolist()

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def logprobs(self) -> torch.Tensor:
        ids = torch.tensor([self.tokens])
        logits = self.model(ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]

    def source(self, dtype: torch.dtype) -> Any:
        from vllm.distributed.weight_transfer.base import ParamMeta

        from rlray.weightsync.protocol import ParamSource

        params = self.model.named_parameters
        return ParamSource(lambda: [ParamMeta(n, dtype, tuple(p.shape)) for n, p in params()],
                           lambda: ((n, p.detach().to(dtype)) for n, p in params()))


def start_engine(loop: LoopThread, path: str, dtype: str, tp: int, lora_rank: int = 0, backend: str = "gloo") -> Any:
    from rlray.actors.engine import Engine
    from rlray.actors.rollout import cpu_binding

    kwargs: dict[str, Any] = {"dtype": dtype, "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20,
                              "tensor_parallel_size": tp, "enable_chunked_prefill": False}
    if tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tp)
    try:
        return loop.run(Engine.create(path, max_model_len=128, seed=0, engine_kwargs=kwargs, lora_rank=lora_rank,
                                      weights_backend=backend), timeout=600)
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def bucket_sizes(setup: Setup, wire: torch.dtype, bucket_mb: int) -> list[int]:
    from rlray.weightsync.transport import plan_buckets

    plan = plan_buckets([(n, tuple(p.shape), wire) for n, p in setup.model.named_parameters()], bucket_mb << 20)
    return [b.numel * wire.itemsize for b in plan]


def measure_engine(setup: Setup, loop: LoopThread, engine: Any, label: str, wire: torch.dtype, bucket_mb: int,
                   repeats: int, lrs: list[float], raw: RawPeer, raw_times: dict[str, list[float]],
                   backend: str = "gloo") -> list[dict[str, Any]]:
    """Dense rounds, then (for the engine's own wire dtype) delta rounds after optimizer steps;
    a raw round of the dense sync's buckets before each timed one (into `raw_times[wire]`). `backend`
    "shm": the colocated handover (the driver as the trainer rank of the engine's bundle), dense only."""
    from rlray.weightsync.protocol import trainer_engine
    from rlray.weightsync.transport import TrainerSpec

    sizes, rows = bucket_sizes(setup, wire, bucket_mb), []
    modes = [("dense", None)] + ([("delta", lr) for lr in lrs] if lrs else [])
    for mode, lr in modes:
        client = TimedClient(loop, [engine])
        spec = TrainerSpec(backend, "127.0.0.1", free_port(), 1 + engine.workers(), bucket_mb << 20, 300.0,
                           delta=mode == "delta", full_every=1 << 30, workers=engine.workers())
        transfer = trainer_engine(spec, 0, client, setup.source(wire))
        if mode == "delta":
            transfer.send_weights()  # the full sync a delta needs first
        times, phases, stats, diffs, raws = [], [], [], [], []
        for rnd in range(repeats + (mode == "dense")):
            if lr is not None:
                setup.step(lr)
            raws.append(raw.round(sizes))
            t0 = time.perf_counter()
            transfer.send_weights()
            seconds = time.perf_counter() - t0
            scored = torch.tensor(loop.run(engine.score(setup.tokens, 1)))
            diffs.append(float((scored - setup.logprobs()).abs().max()))
            if mode == "delta" or rnd:
                times.append(seconds)
                phases.append(dict(client.phases))
                stats.append(dict(transfer.stats))
        loop.run(engine.shutdown_weight_transfer())
        transfer.shutdown()
        raw_times.setdefault(str(wire).removeprefix("torch."), []).extend(raws[-len(times):])
        rows.append(_row(label, wire, mode, lr, times, phases, stats, diffs, median(raws)))
        r = rows[-1]
        print(f"  {label:<10} {r['wire']:<8} {r['mode']:<14} {r['mb_sent']:8.1f} MB  {r['seconds']:.3f} s  "
              f"changed {r['changed_frac']:.3f}  logprob diff {r['logprob_diff']:.1e}", flush=True)
    return rows


def _row(label: str, wire: torch.dtype, mode: str, lr: float | None, times: list[float],
         phases: list[dict[str, float]], stats: list[dict[str, float]], diffs: list[float],
         raw_seconds: float) -> dict[str, Any]:
    """x raw = the raw broadcast's seconds (of the dense buckets) over this sync's: for a dense
    sync that is its GB/s over the raw GB/s; a delta sync above 1 beats even a raw dense one."""
    sent = median([s["sync_bytes"] for s in stats])
    seconds = median(times)
    return {"engine": label, "wire": str(wire).removeprefix("torch."),
            "mode": mode if lr is None else f"{mode} lr={lr:g}", "mb_sent": sent / 1e6,
            "changed_frac": median([s["changed_frac"] for s in stats]), "seconds": seconds,
            "seconds_all": times, **{p.split("_")[0] + "_s": median([ph[p] for ph in phases]) for p in PHASES},
            "gb_per_s": sent / seconds / GB, "vs_raw": ratio(raw_seconds, seconds),
            "logprob_diff": max(diffs)}


def measure(path: str, engines: list[tuple[str, int]], bucket_mb: int, repeats: int,
            lrs: list[float]) -> list[dict[str, Any]]:
    """Rows for every engine (dtype, TP), each from a fresh copy of the model and its optimizer,
    then a row per wire dtype for the raw rounds that ran between them."""
    rows: list[dict[str, Any]] = []
    raw_times: dict[str, list[float]] = {}
    raw, loop = RawPeer(), LoopThread()
    nparams = 0
    try:
        for dtype, tp in engines:
            t0 = time.perf_counter()
            engine = start_engine(loop, path, dtype, tp)
            label = f"{dtype.replace('float', 'fp').replace('bfp', 'bf')} TP{tp}"
            print(f"vLLM engine {label} started in {time.perf_counter() - t0:.1f}s", flush=True)
            try:
                wire = getattr(torch, dtype)
                setup = Setup(path, lrs[0] if lrs else 1e-4)  # every engine sees the same optimizer steps
                nparams = sum(p.numel() for p in setup.model.parameters())
                rows += measure_engine(setup, loop, engine, label, wire, bucket_mb, repeats, lrs, raw, raw_times)
                if wire != torch.float32:  # the fp32 master weights on the wire, the engine casting them
                    rows += measure_engine(setup, loop, engine, label, torch.float32, bucket_mb, repeats, [], raw,
                                           raw_times)
            finally:
                loop.run(engine.shutdown(), timeout=120)
        for wire, times in raw_times.items():
            sent = nparams * getattr(torch, wire).itemsize
            rows.insert(0, {"engine": "raw gloo", "wire": wire, "mode": "broadcast only", "mb_sent": sent / 1e6,
                            "changed_frac": 1.0, "seconds": median(times), "seconds_all": times,
                            "gb_per_s": sent / median(times) / GB, "vs_raw": 1.0})
    finally:
        loop.close()
        raw.close()
    return rows


def ratios(rows: list[dict[str, Any]], size: str) -> dict[str, float]:
    by = {(r["engine"], r["wire"], r["mode"]): r for r in rows}
    out: dict[str, float] = {}
    for (engine, wire, mode), r in by.items():
        if engine == "raw gloo":
            continue
        if mode == "dense":
            out[f"{size} {engine} {wire} wire: end to end / raw collective"] = r["vs_raw"]
        else:
            out[f"{size} {engine} {mode}: delta / dense bytes"] = ratio(r["mb_sent"], by[(engine, wire, "dense")]["mb_sent"])
    for engine in {r["engine"] for r in rows if r["wire"] == "bfloat16" and r["engine"] != "raw gloo"}:
        bf, fp = by[(engine, "bfloat16", "dense")], by[(engine, "float32", "dense")]
        out[f"{size} {engine}: bf16 / fp32 wire seconds"] = ratio(bf["seconds"], fp["seconds"])
    if ("fp32 TP2", "float32", "dense") in by:
        out[f"{size} fp32: TP2 / TP1 engine sync seconds"] = ratio(by[("fp32 TP2", "float32", "dense")]["seconds"],
                                                                  by[("fp32 TP1", "float32", "dense")]["seconds"])
    return out


def measure_lora(path: str, dtype: str, bucket_mb: int, repeats: int, rank: int) -> list[dict[str, Any]]:
    """One engine serving a rank-`rank` adapter (every projection) on the size's model: adapter syncs
    and full syncs of the same model into it, alternating, through the trainer's `WeightPublisher`."""
    from rlray.actors.publisher import WeightPublisher
    from rlray.config import LoraConfig
    from rlray.models.lora import adapted_modules, adapter_config, apply_lora, init_adapters
    from rlray.weightsync.transport import TrainerSpec

    loop = LoopThread()
    engine = start_engine(loop, path, dtype, 1, lora_rank=rank)
    try:
        cfg = LoraConfig(rank=rank)
        setup = Setup(path, 1e-4)  # the model and the sequence the engine scores after each sync
        model = setup.model
        apply_lora(model, cfg)
        init_adapters(model, seed=0)
        with torch.no_grad():  # a trained adapter: lora_B away from zero
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0.0, 0.01)
        wire = getattr(torch, dtype)
        client = TimedClient(loop, [engine])
        publisher = WeightPublisher(model, torch.device("cpu"), 0, wire, adapter_config(cfg, adapted_modules(model), path))
        publisher.open(TrainerSpec("gloo", "127.0.0.1", free_port(), 1 + engine.workers(), bucket_mb << 20, 300.0),
                       client)
        publisher.publish(0)  # the base, then the adapter: warm-up
        samples: dict[str, list[tuple[float, dict[str, float], float, float]]] = {"adapter": [], "full": []}
        for r in range(repeats):
            for kind in ("adapter", "full")[:: 1 if r % 2 == 0 else -1]:
                publisher.stage = "rl" if kind == "adapter" else "sft"
                t0 = time.perf_counter()
                out = publisher.publish(r + 1)
                seconds = time.perf_counter() - t0
                scored = torch.tensor(loop.run(engine.score(setup.tokens, 1)))
                samples[kind].append((seconds, dict(client.phases), out["sync_bytes"],
                                      float((scored - setup.logprobs()).abs().max())))
        publisher.close()
        loop.run(engine.shutdown_weight_transfer())
    finally:
        loop.run(engine.shutdown(), timeout=120)
        loop.close()
    label = f"{dtype.replace('float', 'fp').replace('bfp', 'bf')} TP1 LoRA r{rank}"
    rows = []
    for kind, mode in (("full", "full (base weights)"), ("adapter", "adapter only")):
        times = [t for t, _, _, _ in samples[kind]]
        sent = median([b for _, _, b, _ in samples[kind]])
        rows.append({"engine": label, "wire": str(wire).removeprefix("torch."), "mode": mode, "mb_sent": sent / 1e6,
                     "changed_frac": 1.0, "seconds": median(times), "seconds_all": times,
                     **{p.split("_")[0] + "_s": median([ph[p] for _, ph, _, _ in samples[kind]]) for p in PHASES},
                     "gb_per_s": sent / median(times) / GB, "vs_raw": None,
                     "logprob_diff": max(d for _, _, _, d in samples[kind])})
    return rows


def measure_colocated(path: str, bucket_mb: int, repeats: int) -> list[dict[str, Any]]:
    """The colocated handover (rlray.weightsync.shm) into an fp32 TP1 engine: dense syncs of `bucket_mb`
    rounds, each after a raw gloo broadcast of the same bytes (the "raw gloo" row it is measured against)."""
    raw, loop, raw_times = RawPeer(), LoopThread(), {}
    engine = start_engine(loop, path, "float32", 1, backend="shm")
    try:
        rows = measure_engine(Setup(path, 1e-4), loop, engine, "fp32 TP1 shm", torch.float32, bucket_mb, repeats, [],
                              raw, raw_times, backend="shm")
    finally:
        loop.run(engine.shutdown(), timeout=120)
        loop.close()
        raw.close()
    times = raw_times["float32"]
    sent = rows[0]["mb_sent"] * 1e6
    return [{"engine": "raw gloo", "wire": "float32", "mode": "broadcast only", "mb_sent": sent / 1e6,
             "changed_frac": 1.0, "seconds": median(times), "seconds_all": times, "gb_per_s": sent / median(times) / GB,
             "vs_raw": 1.0}, *rows]
