"""Calls on Ray actors that never hang and never leave an error unread, and vLLM's weight-sync client
over rollout actors.

Contract: `errors(refs, timeout)` waits for `refs` (within `timeout` s in all) and returns the error of
each that raised or did not finish; `get_all(refs)` is `ray.get` that reads every error before raising
the first (Ray prints a traceback for each error never read). `loss_cause(error)` says why a call's
error means its rollout actor is lost (its process died, or its engine can serve no more), or None.
`FleetClient` is vLLM's `VLLMWeightSyncClient` protocol over a list of rollout actors (driven from
trainer rank 0 by the weight-transfer engine).
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from rlray.actors.rollout import EngineFailed
from rlray.weightsync.transport import engine_init_infos

HEALTH_S = 5.0  # an actor that does not answer `stats` within this long counts as not answering


def loss_cause(error: BaseException) -> str | None:
    """Why a call's `error` means its rollout actor is lost, or None when it does not."""
    if isinstance(error, RayActorError):
        return "it died (its Ray actor process is gone)"
    cause = getattr(error, "cause", None)  # a RayTaskError carries the actor's own exception
    return str(cause) if isinstance(cause, EngineFailed) else None


def errors(refs: list[Any], timeout: float | None) -> dict[int, RayError]:
    """The error of each of `refs` whose task raised (or did not finish within `timeout` s; None: wait)."""
    failed = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except RayError as e:
            failed[i] = e
    return failed


def get_all(refs: list[Any], timeout: float | None = None) -> list[Any]:
    """`ray.get(refs)`; when one fails, the others' errors are read too before the first is raised (Ray
    prints a traceback for every error never read: a rank's broken collective after another rank died)."""
    try:
        return ray.get(refs, timeout=timeout)
    except RayError:
        errors(refs, HEALTH_S)
        raise


class FleetClient:
    """vLLM's `VLLMWeightSyncClient` over rollout actors: each call goes to every actor and waits
    for all (within `timeout_s`). Engine i's workers take weight-group ranks from the trainer's
    `rank_offset` plus the workers of engines 0..i-1: vLLM's own Ray client gives every handle
    the same offset, which fits the replicas of one engine, not independent engines.
    `weight_version`, set before each sync, labels the weights at finish (vLLM's NCCL trainer
    engine finishes without one); `adapter`, set before each sync, says it moves a LoRA adapter."""

    def __init__(self, handles: list[Any], workers: list[int], timeout_s: float) -> None:
        self.handles, self.workers, self.timeout_s = handles, workers, timeout_s
        self.weight_version = "0"
        self.adapter: dict[str, Any] | None = None  # set before each sync: the LoRA adapter's config, or None

    def _all(self, refs: list[Any]) -> list[Any]:
        return ray.get(refs, timeout=self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        infos = engine_init_infos(init_info, self.workers)
        self._all([h.init_weight_transfer_engine.remote(info) for h, info in zip(self.handles, infos)])

    def start_weight_update(self) -> None:
        self._all([h.start_weight_update.remote(self.adapter) for h in self.handles])

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._all([h.update_weights.remote(update_info) for h in self.handles])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all([h.finish_weight_update.remote(weight_version or self.weight_version) for h in self.handles])
