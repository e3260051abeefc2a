"""The m2n group's two transports (rlray.weightsync.links) on four processes: two trainer ranks, two workers.

The NCCL transport runs on tests/fake_nccl.py's gloo-backed `PyNcclCommunicator` (NCCL's rules, no GPU). Crossing
order: t0 sends to w0 then w1, t1 to w1 then w0, w0 receives from t1 then t0, w1 from t0 then t1. Issued one
operation at a time (as NCCL blocks a stream), each rank waits on the next in a cycle (t0 -> w0 -> t1 -> w1 -> t0)
and the fake names it; as one exchange per rank (one NCCL group) every message arrives. A silent peer: a receive
whose send never comes ends in `LinkTimeout` at the group's timeout, on either transport.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.dist.common import spawn

T0, T1, W0, W1 = range(4)
ORDER = {T0: [("send", W0), ("send", W1)], T1: [("send", W1), ("send", W0)],
         W0: [("recv", T1), ("recv", T0)], W1: [("recv", T0), ("recv", T1)]}


def open_links(kind: str, rank: int, world: int, port: int, timeout_s: float):  # type: ignore[no-untyped-def]
    from rlray.weightsync import links

    if kind == "gloo":
        return links.open_gloo_links("127.0.0.1", port, rank, world, timeout_s)
    os.environ[links.COMMUNICATOR] = "tests.fake_nccl:FakePyNccl"
    return links.open_nccl_links("127.0.0.1", port, rank, world, timeout_s, torch.device("cpu"))


def message(src: int, dst: int) -> torch.Tensor:
    return torch.full((5 + src + dst,), 10 * src + dst, dtype=torch.uint8)


def crossing(rank: int, world: int, port: int, out: dict, kind: str, grouped: bool) -> None:
    from tests.fake_nccl import Deadlock

    links = open_links(kind, rank, world, port, timeout_s=60)
    ops = [(op, peer, message(rank, peer) if op == "send" else torch.zeros_like(message(peer, rank)))
           for op, peer in ORDER[rank]]
    try:
        if grouped:
            links.exchange([(t, p) for op, p, t in ops if op == "send"],
                           [(t, p) for op, p, t in ops if op == "recv"]).wait()
        else:  # what a transport without groups would issue: one blocking operation after another
            for op, peer, t in ops:
                getattr(links.comm, op)(t, peer)
        out[rank] = {"received": {p: t.tolist() for op, p, t in ops if op == "recv"},
                     "ungrouped": getattr(getattr(links, "comm", None), "ungrouped", 0)}
    except Deadlock as e:
        out[rank] = {"deadlock": str(e)}
        deadline = time.monotonic() + 60
        while len(out) < world and time.monotonic() < deadline:  # rank 0 hosts the store the others still read
            time.sleep(0.1)
    links.close()


@pytest.mark.parametrize("kind", ["gloo", "fake_nccl"])
def test_crossing_messages_of_one_exchange_all_arrive(kind: str) -> None:
    out = spawn(crossing, 4, kind, True)
    for rank in (W0, W1):
        assert out[rank]["received"] == {src: message(src, rank).tolist() for src in (T0, T1)}, out
    assert all(out[r]["ungrouped"] == 0 for r in range(4)), out


def test_crossing_messages_issued_one_by_one_deadlock_as_nccl_would() -> None:
    out = spawn(crossing, 4, "fake_nccl", False)
    assert all("deadlock" in out[r] for r in range(4)), out  # every rank of the cycle names it
    assert "0 -> 2 -> 1 -> 3 -> 0" in out[T0]["deadlock"], out


def silent(rank: int, world: int, port: int, out: dict, kind: str, op: str = "recv") -> None:
    from rlray.weightsync.links import LinkTimeout

    links = open_links(kind, rank, world, port, timeout_s=2)
    if rank == 1:
        message_ = [(torch.zeros(8, dtype=torch.uint8), 0)]
        batch = links.exchange(*((message_, []) if op == "send" else ([], message_)))
        t0 = time.monotonic()
        try:
            batch.wait()
            out[rank] = "returned"
        except LinkTimeout as e:
            out[rank] = (time.monotonic() - t0, str(e))
        try:
            links.exchange([], [(torch.zeros(8, dtype=torch.uint8), 0)])
        except RuntimeError as e:
            out["after"] = str(e)
    else:  # alive, never sending, until rank 1 has seen its deadline pass
        deadline = time.monotonic() + 60
        while "after" not in out and time.monotonic() < deadline:
            time.sleep(0.1)
    links.close()


@pytest.mark.parametrize("kind", ["gloo", "fake_nccl"])
def test_a_peer_that_never_sends_times_out_and_closes_this_end(kind: str) -> None:
    out = spawn(silent, 2, kind)
    seconds, message_ = out[1]
    assert 2 <= seconds < 2 + 5, out
    assert message_ == ("m2n messages with ranks [0] not done within 2s (weights.group_timeout_s): "
                        "this end of the group closed"), out
    assert "closed" in out["after"] or "destroyed" in out["after"], out


def test_a_send_to_a_peer_that_never_receives_times_out_on_nccl() -> None:
    """NCCL has no eager buffer: a send is done only when its receive was posted (gloo's small sends may finish
    alone), so a silent receiver is found by the same deadline."""
    out = spawn(silent, 2, "fake_nccl", "send")
    assert 2 <= out[1][0] < 2 + 5 and "ranks [0]" in out[1][1], out
