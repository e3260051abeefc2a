"""Helpers for multi-process gloo tests: spawn ranks and collect what rank 0 reports."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp
from torch import nn

from rlray.bench.common import free_port


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
