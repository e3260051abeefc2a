"""Helpers for multi-process gloo tests: spawn ranks and collect what rank 0 reports."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rlray.bench.common import free_port
from rlray.data.packing import Sample, pack

# the trainer tests' tiny twins (tests/dist/test_hybrid_trainer.py, test_sink_trainer.py)
SHAPE = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "num_kv_heads": 1,
         "moe_intermediate_size": 32, "init_std": 0.1}


def samples() -> list[Sample]:
    """8 sequences of 3-7 prompt and 2-14 completion tokens, rewards and behaviour logprobs (seeded)."""
    rng = np.random.default_rng(5)
    out = []
    for i in range(8):
        p, c = rng.integers(4, 40, size=3 + i % 5), rng.integers(4, 40, size=2 + (i * 7) % 13)
        logp = rng.uniform(-4, -1, len(c)).astype(np.float32)
        out.append(Sample(p, c, np.ones(len(c), np.float32), float(rng.normal()), logp))
    return out


def _run(rank: int, worker: Callable[..., None], *args: Any) -> None:
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo/FSDP threads occasionally abort it (SIGABRT) after the work is done.
    os._exit(0)


def spawn(worker: Callable[..., None], world: int, *args: Any, tries: int = 3) -> dict:
    """Run `worker(rank, world, port, out, *args)` on `world` processes; returns the `out` dict.

    Rank 0 binds `port` (its trainer store) a second or two after it was found free, so another process may
    take it first: a start that fails with EADDRINUSE is run again on a new port (nothing ran yet)."""
    for attempt in range(tries):
        out = mp.Manager().dict()
        try:
            mp.spawn(_run, args=(worker, world, free_port(), out, *args), nprocs=world, join=True)
            return dict(out)
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) and "Address already in use" not in str(e) or attempt + 1 == tries:
                raise
    raise AssertionError("unreachable")


def folder_tensors(folder: Any) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers folder's safetensors files (rlray's export writes one per rank)."""
    from pathlib import Path

    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


@torch.no_grad()
def round_to_bf16(model: nn.Module) -> None:
    """Every parameter shard rounded to bf16 values in place (its dtype kept): rlray's bf16 export then holds the
    trainer's weights exactly, and what loads it computes what the trainer does."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.is_floating_point():
            local.copy_(local.to(torch.bfloat16))


def full_grads(model: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter's full gradient (a collective: every rank must call it)."""
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().numpy().copy()
    return grads


def assert_grads_close(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray], rtol: float) -> None:
    """Each gradient within `rtol` of the expected one's largest entry (summation order differs)."""
    assert expected.keys() == actual.keys()
    for name, g in expected.items():
        scale = max(float(np.abs(g).max()), 1e-12)
        err = float(np.abs(actual[name] - g).max())
        assert err <= rtol * scale, f"{name}: max diff {err:.3g} > {rtol} x {scale:.3g}"


def step_sums(t: Any, data: list[Sample], world: int, rank: int, packed: bool, cp: int = 1) -> dict:
    """One forward-backward of rank `rank`'s share of `data` (micro-batches of 96 tokens; with `cp` > 1 each sequence
    split over the context-parallel ranks): the mean loss over all ranks, every full gradient and the rows this rank ran
    (a collective)."""
    mbs = pack(data, world, micro_batch_tokens=96, pad_id=0, packed=packed, cp=cp)[rank]
    t.learner.optimizer.zero_grad(set_to_none=True)
    sums = t.forward_backward(mbs, rl=True)
    loss = torch.tensor(sums["loss"], dtype=torch.float64)
    dist.all_reduce(loss)
    return {"loss": float(loss) / sums["_norm"], "grads": full_grads(t.model), "rows": sum(len(m.input_ids) for m in mbs)}


@torch.no_grad()
def reference_logprobs(path: str, data: list[Sample], **kwargs: Any) -> list[np.ndarray]:
    """transformers alone (`from_pretrained(path, **kwargs)`, fp32), on each sequence alone: the logprobs of each
    sample's completion at temperature 0.7."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    out = []
    for s in data:
        ids = torch.tensor(np.concatenate([s.prompt_ids, s.completion_ids]))[None]
        lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, len(s.prompt_ids) - 1:-1] / 0.7, -1)
        out.append(lp.gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0].numpy())
    return out


def scored(t: Any, data: list[Sample]) -> list[np.ndarray]:
    """Trainer `t`'s logprobs of each sample's completion (temperature 0.7), every sequence in one packed row, longest
    first."""
    from rlray.data.layout import model_inputs

    mb = pack(data, 1, micro_batch_tokens=10_000, pad_id=0)[0][0]
    with torch.no_grad():
        got = t.learner._token_logprobs(model_inputs(mb, t.device), 0.7).numpy()
    return [got[n, len(s.prompt_ids):len(s)] for n, s in enumerate(sorted(data, key=len, reverse=True))]
