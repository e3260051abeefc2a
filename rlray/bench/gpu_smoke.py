"""gpu-smoke: the trainer half of the GPU path, checked in one command on one CUDA GPU.

`python -m rlray.bench gpu-smoke` needs torch, transformers (and Triton) plus rlray's small
pure-Python needs (omegaconf; BENCHMARKS.md lists the wheels and the exact command): no Ray, no
vLLM, no package index. For a dense Qwen3 (~1.1B) and a Qwen3-MoE (~1B, 0.3B active) with random
weights built from a config (gpu-step's models) it checks, one table row each:
- setup: `TrainerActor` on CUDA, FSDP2 on one rank, bf16 compute over fp32 master weights, and
  which attention it chose (flash-attn only for 16-bit compute);
- logprobs: `TrainerActor.logprobs` against transformers' own fp32 forward of the same checkpoint;
- train step: finite loss and gradient norm; tokens/s, TFLOP/s, MFU and peak memory (gpu-step's);
- DCP: save and load through torch.distributed.checkpoint, the weight digest of the loaded state
  equal to the saved one (and a step in between changed it); the same with the save written in the
  background (checkpoint.async_save: the state copied to pinned host memory, a gloo group beside the
  trainer's, the step taken while the write runs), and the seconds that save blocked;
- side-stream gather: right after an optimizer step, the weights gathered for a sync while the
  consumer runs on a side stream (as vLLM's packed NCCL sender does) equal those gathered on the
  default stream, bit for bit; the memory the pass leaves reserved is reported;
- optimizer offload (trainer.offload_optimizer, colocated GPUs): `make_room` moves the AdamW state off the GPU
  and returns it to the device (reserved memory, not only allocated, falls), it comes back, and a step runs;
and once: two trainer ranks on one GPU are refused with one line, by the config check and by
the trainer itself (two processes); another process reads a CUDA tensor through an IPC handle
(the mechanism of vLLM's ipc engine, the colocated handover), and the arguments of such a handle hold the type
objects for which vLLM's RPC needs VLLM_ALLOW_INSECURE_SERIALIZATION=1; the m2n group's NCCL transport on one
rank (rlray.bench.gpu_links: a grouped self-exchange, the deadline and abort; where vLLM is installed). Exit 0 when every check passed, 1 otherwise; on a machine
without CUDA, exit 1 with one line. `--cpu` runs the same checks on the CPU with tiny models
(gloo, fp32), the CUDA-only ones reported as skipped: how CI tests this script.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import multiprocessing as mp
import os
import queue
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlray.algo.loss import algo_config
from rlray.bench.common import Column, Report, free_port
from rlray.bench.gpu_links import nccl_rows
from rlray.bench.gpu_step import (
    ARCHS,
    DEFAULTS,
    Arch,
    batch,
    finish,
    matmul_tflops,
    model_dir,
    spec_peak,
    time_steps,
    trainer,
)

NO_CUDA = ("gpu-smoke: no CUDA device here (torch.cuda.is_available() is False); run it on a machine with one "
           "CUDA GPU, or pass --cpu to test the script on the CPU")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu", action="store_true", help="run the checks on the CPU with tiny models (tests the script)")
    p.add_argument("--peak-tflops", type=float, help="the device's bf16 dense peak (default: known GPUs)")
    p.add_argument("--cache", help="where the random-weight model folders go (default: $RLRAY_CACHE or /tmp)")


def row(check: str, model: str, ok: bool | None, value: str, detail: str = "") -> dict[str, Any]:
    return {"check": check, "model": model, "result": {True: "ok", False: "FAIL", None: "skipped"}[ok],
            "value": value, "detail": detail}


def reference_logprobs(path: str, ids: list[int], device: str) -> list[float]:
    """Next-token logprobs of `ids` by transformers itself, fp32, one plain forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits.float()
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(ids[1:], device=device)[:, None])
    del model
    return logp.squeeze(-1).tolist()


def gathered(actor: Any, side: Any) -> dict[str, bytes]:
    """A digest of each full tensor of a sync's gather, consumed on `side` (None: the default stream)."""
    import contextlib

    import torch

    out = {}
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for name, tensor in actor.publisher.full_params(torch.bfloat16):
            packed = tensor.contiguous().view(-1).view(torch.uint8).clone()  # what vLLM's pack_tensors does
            out[name] = hashlib.sha256(packed.cpu().numpy().tobytes()).digest()
        if side is not None:
            side.synchronize()
    return out


def check_model(arch: Arch, path: str, opts: dict[str, Any], device: str, peak: float | None) -> list[dict[str, Any]]:
    import torch

    rows = []
    t0 = time.perf_counter()
    actor = trainer(path, opts["micro_batch_tokens"], device)
    masters = {p.dtype for p in actor.model.parameters()}
    attention = actor.model.config._attn_implementation
    compute = actor.cfg.param_dtype
    ok = masters == {torch.float32} and compute == ("bfloat16" if device == "cuda" else "float32")
    rows.append(row("setup", arch.name, ok, f"{time.perf_counter() - t0:.1f} s",
                    f"{compute} compute over {','.join(str(d).removeprefix('torch.') for d in masters)} masters; "
                    f"attention {attention}"))

    ids = np.random.default_rng(1).integers(3, arch.vocab, opts["seq_len"]).tolist()
    mine = actor.logprobs(ids, 1)
    ref = reference_logprobs(path, ids, device)
    diff = max(abs(a - b) for a, b in zip(mine, ref))
    tol = 0.1 if compute != "float32" else 1e-4
    rows.append(row("logprobs vs transformers fp32", arch.name, diff < tol, f"max |diff| {diff:.2g}",
                    f"{len(ref)} tokens, tolerance {tol:g} for {compute} compute"))

    mbs = batch(arch, opts["batch"], opts["seq_len"], opts["micro_batch_tokens"])
    before = actor.weights_digest()
    res = time_steps(actor, arch, mbs, opts, device)
    ok = math.isfinite(res["loss"]) and math.isfinite(res["grad_norm"]) and res["grad_norm"] > 0
    ok = ok and actor.weights_digest() != before
    mfu = f", MFU {res['tflops'] / peak:.3f}" if peak else ""
    peak_mem = f", peak {res['peak_mem_gb']:.1f} GiB" if res["peak_mem_gb"] is not None else ""
    rows.append(row("train step", arch.name, ok, f"{res['tokens_per_s']:.0f} tokens/s",
                    f"{res['tflops']:.3g} TFLOP/s{mfu}{peak_mem}; {res['tokens']} tokens, {res['seconds']:.3f} s/step")
                | {"tokens_per_s": res["tokens_per_s"], "tflops": res["tflops"], "peak_mem_gb": res["peak_mem_gb"]})

    with tempfile.TemporaryDirectory() as ckpt:
        saved = actor.save(ckpt)
        actor.train_step(mbs)
        moved = actor.weights_digest()
        loaded = actor.load(ckpt)
    rows.append(row("DCP save and load", arch.name, loaded == saved != moved, f"digest {saved}",
                    f"loaded {loaded}; a step between them gave {moved}"))
    with tempfile.TemporaryDirectory() as ckpt:
        t0 = time.perf_counter()
        saved = actor.save(ckpt, background=True)
        blocked = time.perf_counter() - t0
        actor.train_step(mbs)  # beside the write, from the state the save copied
        moved, files = actor.weights_digest(), actor.finish_save()
        loaded = actor.load(ckpt)
    rows.append(row("DCP background save", arch.name, loaded == saved != moved and ".metadata" in files,
                    f"blocked {blocked:.2f} s", f"loaded {loaded}; the step beside the write gave {moved}"))

    rows.append(check_offload(actor, mbs, arch.name, device))
    if device != "cuda":
        rows.append(row("side-stream gather", arch.name, None, "-", "CUDA streams only"))
    else:
        actor.train_step(mbs)  # the optimizer step's kernels are still queued when the gather starts
        reserved = torch.cuda.memory_reserved()
        side = gathered(actor, torch.cuda.Stream())
        grown = (torch.cuda.memory_reserved() - reserved) / 2**30
        default = gathered(actor, None)
        bad = [n for n in default if side.get(n) != default[n]]
        rows.append(row("side-stream gather", arch.name, not bad and len(side) == len(default),
                        f"{len(bad)} of {len(default)} differ", f"reserved memory +{grown:.2f} GiB after the pass"))
    del actor
    finish(device)
    return rows


def check_offload(actor: Any, mbs: Any, model: str, device: str) -> dict[str, Any]:
    """trainer.offload_optimizer (colocated): the AdamW state leaves the GPU and comes back unchanged."""
    import torch

    if device != "cuda":
        return row("optimizer offload", model, None, "-", "host memory already on CPU")
    # reserved, not allocated: what vLLM's wake-up can map is what torch's allocator gave back (make_room)
    before = torch.cuda.memory_reserved()
    out = actor.make_room(True)
    freed = before - torch.cuda.memory_reserved()
    back = actor.offload_optimizer(False)
    res = actor.train_step(mbs)
    ok = out > 0 and back == out and freed >= 0.9 * out and math.isfinite(res["loss"])
    return row("optimizer offload", model, ok, f"{out / 2**30:.2f} GiB",
               f"{freed / 2**30:.2f} GiB of reserved memory returned to the GPU; moved back, then a step "
               f"(loss {res['loss']:.3g})")


def check_ipc_payload(device: str) -> dict[str, Any]:
    """What vLLM's msgpack RPC carries for the ipc handover: reduce_tensor's arguments for a CUDA tensor hold type
    objects and a dtype, which it encodes only with VLLM_ALLOW_INSECURE_SERIALIZATION=1 (rlray.orchestration.cluster
    .rollout_env sets it for colocated GPU engines)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    if device != "cuda":
        return row("ipc payload", "-", None, "-", "CUDA only (tests/unit/test_colocation.py encodes a meta tensor's)")
    _, args = reduce_tensor(torch.zeros(4, device="cuda"))
    kinds = sorted({type(a).__name__ for a in args if isinstance(a, (type, torch.dtype))})
    ok = any(a is torch.Tensor for a in args) and any(isinstance(a, torch.dtype) for a in args)
    return row("ipc payload", "-", ok, ", ".join(kinds), "type objects and a dtype: needs the variable for vLLM's RPC")


def _ipc_child(inbox: Any, outbox: Any) -> None:
    tensor = inbox.get()  # a CUDA tensor arrives as an IPC handle (what vLLM's ipc engine ships)
    outbox.put(float(tensor.double().sum()))


def check_cuda_ipc(device: str) -> dict[str, Any]:
    """The colocated GPU handover's mechanism: another process on this GPU reads a tensor through CUDA IPC."""
    import torch
    import torch.multiprocessing as tmp

    if device != "cuda":
        return row("CUDA IPC handover", "-", None, "-", "CUDA only")
    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_child, args=(inbox, outbox))
    proc.start()
    tensor = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    inbox.put(tensor)
    try:
        got = outbox.get(timeout=120)
    except queue.Empty:
        got = None
    proc.join(timeout=30)
    want = float(tensor.double().sum())
    return row("CUDA IPC handover", "-", got == want, "read" if got == want else "not read",
               f"sum {got} in the other process, {want} here")


def _two_ranks(rank: int, master: str, out: Any) -> None:
    """One of two trainer ranks given the same GPU: what its setup says."""
    from rlray.actors.trainer import TrainerActor
    from rlray.config import ModelConfig, TrainerConfig

    actor = TrainerActor(rank, 2, master, ModelConfig(), TrainerConfig(num_ranks=2, gpus_per_rank=1), algo_config(),
                         "nccl", temperature=1.0)
    try:
        actor.setup()
        out.put((rank, "set up: not refused"))
    except (RuntimeError, ValueError) as e:  # the refusal under test (anything else is a traceback: a failure)
        out.put((rank, f"{type(e).__name__}: {e}"))


def check_shared_gpu(device: str) -> list[dict[str, Any]]:
    from rlray.config import Config, ConfigError, validate

    c = Config()
    c.trainer.gpus_per_rank = c.rollout.gpus_per_actor = 0.5
    try:
        validate(c)
        config = row("two ranks, one GPU: config", "-", False, "accepted")
    except ConfigError as e:
        config = row("two ranks, one GPU: config", "-", "trainer.gpus_per_rank" in str(e) and "\n" not in str(e),
                     "refused", str(e))
    if device != "cuda":
        return [config, row("two ranks, one GPU: trainer", "-", None, "-", "CUDA only")]
    ctx = mp.get_context("spawn")
    out, master = ctx.Queue(), f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_two_ranks, args=(r, master, out)) for r in range(2)]
    for p in procs:
        p.start()
    said = {r: "no answer within 300 s" for r in range(2)}
    try:
        for _ in procs:
            rank, what = out.get(timeout=300)
            said[rank] = what
    except queue.Empty:
        pass
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    ok = all("were given the same GPU" in said[r] and "\n" not in said[r] for r in range(2))
    return [config, row("two ranks, one GPU: trainer", "-", ok, "refused" if ok else "not refused", said[0])]


def run(args: argparse.Namespace) -> Report:
    import torch

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(NO_CUDA)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    size = "tiny" if args.cpu or args.quick else "full"
    opts = {**DEFAULTS[size], "experts_impl": None}
    cache = Path(args.cache or os.environ.get("RLRAY_CACHE", Path(tempfile.gettempdir()) / "rlray-models"))
    peak = spec_peak(device, args.peak_tflops)
    mm, mm_what = matmul_tflops(device)
    report = Report("gpu-smoke", size == "tiny", params={
        "size": size, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "cuda": torch.version.cuda, "spec_peak_tflops": peak, "matmul_tflops": mm, "matmul": mm_what, **opts})
    report.columns = [Column("check", "check"), Column("model", "model", left=True),
                      Column("result", "result", left=True), Column("value", "value"),
                      Column("detail", "detail", left=True)]
    for arch in ARCHS[size]:
        report.rows += check_model(arch, model_dir(arch, cache, device), opts, device, peak)
        train = next(r for r in report.rows if r["check"] == "train step" and r["model"] == arch.name)
        report.ratios[f"{arch.name} TFLOP/s / measured matmul"] = train["tflops"] / mm
        if peak:
            report.ratios[f"{arch.name} MFU (spec peak {peak:g} TFLOP/s)"] = train["tflops"] / peak
    report.rows += [*check_shared_gpu(device), check_cuda_ipc(device), check_ipc_payload(device), *nccl_rows(device)]
    report.failed = [f"{r['check']} ({r['model']})" for r in report.rows if r["result"] == "FAIL"]
    report.notes = [f"measured matmul ({mm_what}): {mm:.3g} TFLOP/s on {device}",
                    f"{sum(r['result'] == 'ok' for r in report.rows)} ok, {len(report.failed)} failed, "
                    f"{sum(r['result'] == 'skipped' for r in report.rows)} skipped"
                    + (f": {', '.join(report.failed)}" if report.failed else "")]
    return report
