"""A stand-in for vLLM's `PyNcclCommunicator`, backed by gloo, with its surface and NCCL's rules, so the m2n group's
NCCL transport (rlray.weightsync.links.NcclLinks) runs on a CPU machine: selected by
`RLRAY_NCCL_COMMUNICATOR=tests.fake_nccl:FakePyNccl` in every process of the group.

NCCL's rules it keeps:
- no tag: messages between two ranks match in the order they were issued (gloo, every message tag 0), and a
  receive must be the size of its send (gloo raises where NCCL would corrupt or hang);
- inside `group_start`/`group_end` the operations are issued together at `group_end` and progress concurrently;
  outside a group each operation blocks until its peer's matching one has run, as an NCCL kernel holds its stream.
  Either way a send is done only once its peer has posted the matching receive (NCCL's kernels meet; no eager
  buffer): a send to a silent peer never completes;
- no failure propagates: an operation whose peer died or aborted stays pending forever, as an NCCL kernel spins
  (only the caller's deadline ends the wait);
  A rank blocked so publishes whom it waits for; a cycle of such waits (t0 sends to w0 while w0 sends to t0, both
  ungrouped) raises `Deadlock` instead of hanging, naming the cycle;
- `destroy` aborts: pending operations of peers with this rank fail; nothing waits;
- a world of one is a silent no-op, as vLLM's is (`disabled`).
`ungrouped` counts operations issued outside a group: the m2n transport must issue none.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

PREFIX = "fake-nccl"


class Deadlock(RuntimeError):
    """Ungrouped operations waiting on each other in a cycle of ranks: NCCL would hang here."""


class _Done:
    """One group call's end: a thread waits until each operation's peer has posted its match, then on its gloo work
    (gloo's works report completion only through `wait`), as the GPU would run the group's kernels. A failure (a
    peer gone, this end aborted) leaves it unfinished, as NCCL would: `error` keeps it for a reader."""

    def __init__(self, comm: FakePyNccl | None = None, ops: list[tuple[Any, str, int]] = ()) -> None:
        self.finished, self.error = threading.Event(), None
        if not ops:
            self.finished.set()
            return
        threading.Thread(target=self._wait, args=(comm, ops), daemon=True).start()

    def _wait(self, comm: FakePyNccl, ops: list[tuple[Any, str, int]]) -> None:
        try:
            for work, match, n in ops:
                while comm.store.add(match, 0) < n:
                    if comm.pg is None:
                        raise RuntimeError("NCCL: the communicator was destroyed")
                    time.sleep(0.01)
                work.wait()
        except Exception as e:
            self.error = e
            return
        self.finished.set()


class _Events:
    """`NcclLinks`' events for the fake: no streams; a batch's event is its group's `_Done`."""

    def __init__(self, comm: FakePyNccl) -> None:
        self.comm = comm

    def side(self) -> Any:
        return nullcontext(None)

    def record(self) -> _Done:
        return self.comm.last

    def done(self, event: _Done) -> bool:
        return event.finished.is_set()

    def join(self, event: _Done) -> None:
        assert event.finished.is_set(), "NCCL: joined an event that is not done"


class FakePyNccl:
    def __init__(self, group: Any, device: Any = None, library_path: str | None = None) -> None:
        self.rank, self.world_size, self.store = group.rank, group.world_size, group.store
        self.device = torch.device("cpu")
        self.disabled = self.world_size == 1
        self.available = not self.disabled
        self.queue: list[tuple[str, torch.Tensor, int]] | None = None
        self.last = _Done()
        self.ungrouped = 0
        self.pg = None if self.disabled else dist.ProcessGroupGloo(
            dist.PrefixStore(PREFIX, self.store), self.rank, self.world_size, timedelta(seconds=300))

    def events(self) -> _Events:
        return _Events(self)

    def send(self, tensor: torch.Tensor, dst: int, stream: Any = None) -> None:
        self._op("send", tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        self._op("recv", tensor, src)

    def group_start(self) -> None:
        assert self.queue is None, "NCCL: nested group_start"
        self.queue = []

    def group_end(self) -> None:
        assert self.queue is not None, "NCCL: group_end without group_start"
        queue, self.queue = self.queue, None
        self.last = _Done(self, [self._issue(*op) for op in queue])

    def destroy(self) -> None:
        if self.pg is not None:
            self.pg.shutdown()  # the abort: peers' pending operations with this rank fail
        self.pg, self.disabled, self.available = None, True, False

    def _op(self, kind: str, tensor: torch.Tensor, peer: int) -> None:
        if self.disabled:
            return
        if self.queue is not None:
            self.queue.append((kind, tensor, peer))
            return
        self.ungrouped += 1
        self._block(*self._issue(kind, tensor, peer), peer)

    def _issue(self, kind: str, tensor: torch.Tensor, peer: int) -> tuple[Any, str, int]:
        """Post one operation; returns its gloo work, the store key counting the peer's matching operations, and
        its number among this rank's `kind`s with `peer` (the match it waits for)."""
        if self.pg is None:
            raise RuntimeError("NCCL: the communicator was destroyed")
        n = self.store.add(f"{PREFIX}/{kind}/{self.rank}/{peer}", 1)
        match = f"{PREFIX}/{'recv' if kind == 'send' else 'send'}/{peer}/{self.rank}"
        return (self.pg.send if kind == "send" else self.pg.recv)([tensor], peer, 0), match, n

    def _block(self, work: Any, match: str, n: int, peer: int) -> None:
        """Wait as a stream held by an NCCL kernel does: until `peer` has issued the matching operation (a send
        meets the peer's receive, not its eager buffer) and the data moved; a cycle of ranks each waiting on the
        next raises `Deadlock`."""
        key = f"{PREFIX}/waits/{self.rank}"
        self.store.set(key, str(peer))
        seen: list[int] = []
        while self.store.add(match, 0) < n:
            cycle = self._cycle()
            if cycle and cycle == seen:  # the same cycle twice, 0.2 s apart, nothing moved: not a race
                # the key stays: this rank is stuck as its stream would be, so every rank of the cycle sees it
                raise Deadlock("ungrouped NCCL point-to-point operations wait on each other in a cycle: "
                               + " -> ".join(map(str, cycle)))
            seen = cycle
            time.sleep(0.2 if cycle else 0.01)
        self.store.delete_key(key)
        work.wait()

    def _cycle(self) -> list[int]:
        chain = [self.rank]
        while True:
            key = f"{PREFIX}/waits/{chain[-1]}"
            if not self.store.check([key]):
                return []
            nxt = int(self.store.get(key).decode())
            if nxt == self.rank:
                return [*chain, nxt]
            if nxt in chain:
                return []
            chain.append(nxt)
