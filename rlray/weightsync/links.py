"""The m2n group's point-to-point transport: one rank's end of it, over gloo or NCCL, behind one contract.

Contract:
- `exchange(sends, recvs)` posts this rank's messages of one layer group at once: each a (contiguous tensor, peer)
  pair, peers as weight-group ranks. It returns a `Batch`; `Batch.wait()` returns once every message is done, or
  raises `LinkTimeout` `timeout_s` after the post, having closed this end (so peers blocked on it fail too).
- Messages between two ranks match in the order they were posted: NCCL has no tag, so neither does this contract.
  Within one exchange the order of peers does not matter (a batch cannot deadlock on a cycle of ranks).
- `close()` aborts this end: it never waits for a peer (the peer may be dead); it may be called twice, and from
  another thread, where a `wait` in flight then raises at once.
- `device` is where this end's buffers live: the CPU for gloo, the rank's CUDA device for NCCL.
- `GlooLinks` (CPU): `ProcessGroupGloo.send/recv`, each wait bounded by what is left of the batch's time.
  `NcclLinks`: a communicator with vLLM's `PyNcclCommunicator` surface (`send(t, peer, stream)`, `recv`, `group_start`, `group_end`, `destroy`); each
  exchange is one group call on a side stream that first waits for the current stream (the buffers were packed
  there), its end an event that `wait` polls until the deadline, then hands to the current stream.
  `CudaEvents` holds the CUDA calls; a fake communicator brings its own (tests/fake_nccl.py).
- Opening: `open_gloo_links` over rlray's weight group (rlray.weightsync.transport); `open_nccl_links` over vLLM's
  `StatelessProcessGroup`, rank 0 on a socket bound as its port was chosen (`bind_listen_socket`), the communicator
  class from `RLRAY_NCCL_COMMUNICATOR` ("module:Class") where a test sets it, vLLM's otherwise.
"""

from __future__ import annotations

import importlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol

import torch

from rlray.weightsync.transport import WeightGroup, open_weight_group

COMMUNICATOR = "RLRAY_NCCL_COMMUNICATOR"  # "module:Class" with PyNcclCommunicator's surface (a test's fake)
POLL_S = 0.001
Messages = list[tuple[torch.Tensor, int]]


class LinkTimeout(TimeoutError):
    """A batch of m2n messages not done within the group's timeout; this end was closed."""


class Batch(Protocol):
    def wait(self) -> None: ...


class Links(Protocol):
    device: torch.device

    def exchange(self, sends: Messages, recvs: Messages) -> Batch: ...

    def close(self) -> None: ...


# ---- gloo --------------------------------------------------------------------------------
class _GlooBatch:
    def __init__(self, links: GlooLinks, works: list[Any], peers: list[int]) -> None:
        self.links, self.works, self.peers = links, works, peers
        self.deadline = time.monotonic() + links.timeout_s

    def wait(self) -> None:
        for work in self.works:
            left = self.deadline - time.monotonic()
            try:
                work.wait(timedelta(seconds=max(left, 0.001)))
            except RuntimeError as e:
                if time.monotonic() < self.deadline:
                    raise  # a peer's end closed: gloo's own error names it
                self.links.close()
                raise LinkTimeout(_late(self.peers, self.links.timeout_s)) from e


class GlooLinks:
    """The CPU transport: gloo's tagged send/recv, every message tag 0 (pairs match in order, as NCCL's do)."""

    def __init__(self, group: WeightGroup, timeout_s: float) -> None:
        self.group, self.timeout_s, self.device = group, timeout_s, torch.device("cpu")

    def exchange(self, sends: Messages, recvs: Messages) -> _GlooBatch:
        pg = self.group.pg
        if pg is None:
            raise RuntimeError("this end of the m2n group is closed")
        works = [pg.recv([t], peer, 0) for t, peer in recvs] + [pg.send([t], peer, 0) for t, peer in sends]
        return _GlooBatch(self, works, [peer for _, peer in sends + recvs])

    def close(self) -> None:
        if self.group.pg is not None:
            self.group.close()


def open_gloo_links(host: str, port: int, rank: int, world_size: int, timeout_s: float, store: Any = None
                    ) -> GlooLinks:
    return GlooLinks(open_weight_group(host, port, rank, world_size, timeout_s, store), timeout_s)


def _late(peers: list[int], timeout_s: float) -> str:
    return (f"m2n messages with ranks {sorted(set(peers))} not done within {timeout_s:g}s "
            "(weights.group_timeout_s): this end of the group closed")


# ---- NCCL --------------------------------------------------------------------------------
class CudaEvents:
    """The CUDA calls `NcclLinks` makes: a side stream for the communicator and events that end its batches."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @contextmanager
    def side(self) -> Iterator[Any]:
        """The side stream, current inside, after the current stream's work (the packed buffers); yields it for the
        communicator's calls (vLLM's take a stream, else its own cached current one)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield self.stream

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def join(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


class _NcclBatch:
    def __init__(self, links: NcclLinks, event: Any, peers: list[int]) -> None:
        self.links, self.event, self.peers = links, event, peers
        self.deadline = time.monotonic() + links.timeout_s

    def wait(self) -> None:
        events = self.links.events
        while not events.done(self.event):
            if self.links.closed:  # aborted from another thread (the fleet breaking the sync off): NCCL says nothing
                raise RuntimeError("this end of the m2n group was closed with messages in flight")
            if time.monotonic() > self.deadline:
                self.links.close()
                raise LinkTimeout(_late(self.peers, self.links.timeout_s))
            time.sleep(POLL_S)
        events.join(self.event)


class NcclLinks:
    """The GPU transport: one NCCL group call per exchange on a side stream; waits poll its event to a deadline."""

    def __init__(self, comm: Any, events: Any, device: torch.device, timeout_s: float) -> None:
        if getattr(comm, "disabled", False):
            raise RuntimeError("vLLM's NCCL communicator is disabled here (no NCCL library, VLLM_DISABLE_PYNCCL, or "
                               "a world of 1): weights.transport=m2n on GPUs needs NCCL on every rank")
        self.comm, self.events, self.device, self.timeout_s = comm, events, device, timeout_s
        self.closed = False

    def exchange(self, sends: Messages, recvs: Messages) -> _NcclBatch:
        if self.closed:
            raise RuntimeError("this end of the m2n group is closed")
        with self.events.side() as stream:
            self.comm.group_start()
            try:
                for t, peer in recvs:
                    self.comm.recv(t, peer, stream)
                for t, peer in sends:
                    self.comm.send(t, peer, stream)
            finally:
                self.comm.group_end()
            event = self.events.record()
        return _NcclBatch(self, event, [peer for _, peer in sends + recvs])

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.comm.destroy()  # vLLM's: ncclCommAbort on a daemon thread joined 5 s; never synchronizes


def bind_listen_socket(host: str) -> socket.socket:
    """Rank 0's rendezvous socket, bound to a port the kernel picks (`.getsockname()[1]`), so nothing can take the
    port between its choice and the bind; `open_nccl_links` hands it to vLLM's store."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    s.listen()
    return s


def communicator_class() -> Callable[..., Any]:
    name = os.environ.get(COMMUNICATOR)
    if not name:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        return PyNcclCommunicator
    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(module), cls)


def open_nccl_links(host: str, port: int, rank: int, world_size: int, timeout_s: float, device: torch.device,
                    listen: socket.socket | None = None) -> NcclLinks:
    """Join the m2n group over NCCL: blocks until every rank has joined (vLLM's store, then the communicator's
    collective init). Rank 0 passes its bound socket."""
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.utils.nccl import unpinned_nccl_env

    pg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                      store_timeout=int(timeout_s), listen_socket=listen)
    with unpinned_nccl_env():
        comm = communicator_class()(pg, device=device)
    events = comm.events() if hasattr(comm, "events") else CudaEvents(device)  # a fake brings its own
    return NcclLinks(comm, events, device, timeout_s)
