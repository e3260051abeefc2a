"""gpu-smoke's rows for the m2n group's NCCL transport (rlray.weightsync.links.NcclLinks) on one CUDA GPU.

One GPU holds one NCCL rank (NCCL refuses two ranks of one communicator on one GPU), so the communicator here is
vLLM's `PyNcclCommunicator` made for a world of one, which vLLM itself turns into a silent no-op (`disabled`): the
rows build it past that (`one_rank`: the library loaded, a unique id, `_init_comm`), the only vLLM internals touched.
- self-exchange: one `exchange` of two sliced uint8 messages sent to this rank and two received from it, one NCCL
  group call on the side stream, its event polled; the received slices equal the sent ones;
- deadline and abort: a receive with no send; `wait` raises `LinkTimeout` at the deadline (2 s here), having
  aborted the communicator (`ncclCommAbort` on vLLM's daemon thread), and the end refuses another exchange;
- staging peak: one MoE layer of Qwen3-30B-A3B's shape (128 experts of 3 x 768 x 2048, bf16) staged by the m2n
  worker engine for a TP 1 worker from one trainer rank: the CUDA memory it takes (torch's peak allocated, all of a
  layer's tensors alive at once, as vLLM's layerwise reload holds them) against the plan's figure (totals.of_plan).
Skipped without CUDA or without vLLM (the device image has none; `pip install vllm==0.32.0` where a GPU has it).
"""

from __future__ import annotations

import time
from typing import Any

DEADLINE_S = 2.0


def row(check: str, ok: bool | None, value: str, detail: str = "") -> dict[str, Any]:
    """gpu-smoke's row of a check that belongs to no model."""
    from rlray.bench.gpu_smoke import row as smoke_row  # imported at call time: gpu_smoke imports this module

    return smoke_row(check, "-", ok, value, detail)


def one_rank(device: Any) -> Any:
    """vLLM's communicator for a world of one, initialized as its __init__ does for more ranks."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    comm = PyNcclCommunicator.__new__(PyNcclCommunicator)
    comm.rank, comm.world_size, comm.group = 0, 1, None
    comm.nccl = NCCLLibrary(None)
    comm.available, comm.disabled, comm._suspended = True, False, False
    comm.nccl_version = comm.nccl.ncclGetRawVersion()
    comm.unique_id = comm.nccl.ncclGetUniqueId()
    comm._init_comm(device)
    return comm


def nccl_rows(device: str) -> list[dict[str, Any]]:
    names = ("m2n NCCL self-exchange", "m2n NCCL deadline and abort", "m2n staging peak (one MoE layer)")
    if device != "cuda":
        return [row(n, None, "-", "CUDA and NCCL only") for n in names]
    try:
        import vllm.distributed.device_communicators.pynccl  # noqa: F401
    except ImportError:
        return [row(n, None, "-", "needs vLLM (pip install vllm==0.32.0)") for n in names]
    import torch

    from rlray.weightsync.links import CudaEvents, LinkTimeout, NcclLinks

    gpu = torch.device("cuda", torch.cuda.current_device())
    links = NcclLinks(one_rank(gpu), CudaEvents(gpu), gpu, 30.0)
    sent = torch.arange(256, dtype=torch.uint8, device=gpu)
    got = torch.zeros(512, dtype=torch.uint8, device=gpu)
    t0 = time.perf_counter()
    links.exchange([(sent[:100], 0), (sent[100:], 0)], [(got[:100], 0), (got[200:356], 0)]).wait()
    ok = torch.equal(got[:100], sent[:100]) and torch.equal(got[200:356], sent[100:]) and not got[100:200].any()
    rows = [row(names[0], ok, f"{(time.perf_counter() - t0) * 1e3:.1f} ms", "2 sliced messages each way, one group")]
    links.close()

    late = NcclLinks(one_rank(gpu), CudaEvents(gpu), gpu, DEADLINE_S)
    batch, t0 = late.exchange([], [(got[:8], 0)]), time.perf_counter()
    try:
        batch.wait()
        rows.append(row(names[1], False, "-", "a receive with no send completed"))
    except LinkTimeout:
        seconds = time.perf_counter() - t0
        try:
            late.exchange([], [(got[:8], 0)])
            refused = False
        except RuntimeError:
            refused = True
        rows.append(row(names[1], DEADLINE_S <= seconds < DEADLINE_S + 5 and refused, f"{seconds:.1f} s",
                        f"deadline {DEADLINE_S:g} s; aborted, then refused"))
    return [*rows, staging_row(names[2], gpu)]


def staging_row(name: str, gpu: Any, experts: int = 128, hidden: int = 2048, width: int = 768) -> dict[str, Any]:
    import torch

    from rlray.weightsync.boxes import Dims, Engines, Layout, Wire, offsets, plan
    from rlray.weightsync.m2n import M2NWeightEngine
    from rlray.weightsync.totals import of_plan

    prefix = "model.layers.0.mlp"
    wires = [Wire(f"{prefix}.gate.weight", (experts, hidden), 2, 0, (experts, hidden))]
    wires += [Wire(f"{prefix}.experts.{e}.{proj}.weight", shape, 2, 0, shape) for e in range(experts)
              for proj, shape in (("gate_proj", (width, hidden)), ("up_proj", (width, hidden)),
                                  ("down_proj", (hidden, width)))]
    p = plan(wires, [Layout((1,), (0,), (("S", 0),))], 1, Engines((1,)), Dims())
    posted = [(pieces, torch.zeros(offsets(pieces)[1], dtype=torch.uint8, device=gpu))
              for pieces in p.links(0).values()]
    engine = M2NWeightEngine.__new__(M2NWeightEngine)
    engine.plan, engine.dtypes, engine.poison, engine.received = p, {w.name: torch.bfloat16 for w in wires}, False, 0
    torch.cuda.synchronize(gpu)
    base = torch.cuda.memory_allocated(gpu)
    torch.cuda.reset_peak_memory_stats(gpu)
    staged = engine._staged(0, posted)
    peak, planned = torch.cuda.max_memory_allocated(gpu) - base, of_plan(p).staged[0]
    del staged
    return row(name, abs(peak - planned) <= 0.01 * planned, f"{peak / 1e9:.3f} GB", f"plan {planned / 1e9:.3f} GB")
