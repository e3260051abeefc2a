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


def spawn(worker: Callable[..., None], world: int, *args: Any) -> dict:
    """Run `worker(rank, world, port, out, *args)` on `world` processes; returns the `out` dict."""
    out = mp.Manager().dict()
    mp.spawn(_run, args=(worker, world, free_port(), out, *args), nprocs=world, join=True)
    return dict(out)


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
