"""A trainer rank's DCP write, in the foreground or in the background: one in flight.

Contract: `Saver(timeout_s, pinned)` writes a state dict to a checkpoint folder with
torch.distributed.checkpoint. `start(state, path, background)` with `background=False` is
`dcp.save` (it returns when the folder is written; its errors raise there). With `background=True`
it is `dcp.async_save`: the state is first copied into memory of the Saver's own (DCP's staging
copy, to host memory, pinned with `pinned`; its buffers are kept and refilled by the next save), and
only that copy blocks the caller; a thread then writes the copy, while training goes on changing
the tensors it was copied from. The background write coordinates the ranks over a gloo group of
its own (made once, by the first background save, on every rank: a collective of the default
group; `timeout_s` its collectives' timeout), never over the default group the training step uses.
Every rank must call `start` at the same point.
One write in flight: `start` first waits for the previous one (its outcome is `finish`'s to report).
`finish()` waits for the last write and returns its folder (None when nothing was saved); a write
that failed raises a one-line RuntimeError naming the folder. `settle()` waits without raising
(before a load or an export reads the disk, or training state is loaded over the staging copy's source).
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from datetime import timedelta
from typing import Any

import torch.distributed as dist


class Saver:
    def __init__(self, timeout_s: float, pinned: bool = False) -> None:
        self.timeout_s, self.pinned = timeout_s, pinned
        self._group: dist.ProcessGroup | None = None
        self._stager: Any = None  # DCP's DefaultStager: its host buffers are reused save after save
        self._last: tuple[str, Future] | None = None  # (folder, the write's future)

    def start(self, state: dict[str, Any], path: str, background: bool) -> None:
        import torch.distributed.checkpoint as dcp

        self.settle()
        if not background:
            dcp.save(state, checkpoint_id=path)
            done: Future = Future()
            done.set_result(None)
            self._last = (path, done)
            return
        if self._group is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            # a blocking copy on the caller's thread (no staging thread, no shared memory)
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=self.pinned, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))
        future = dcp.async_save(state, checkpoint_id=path, process_group=self._group, async_stager=self._stager)
        assert isinstance(future, Future), "a blocking stager returns the write's future"
        self._last = (path, future)

    def settle(self) -> None:
        if self._last is not None:
            wait_for([self._last[1]])

    def finish(self) -> str | None:
        if self._last is None:
            return None
        path, future = self._last
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            future.result()
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException; any failure leaves it unwhole
            raise RuntimeError(f"writing checkpoint {path} failed ({_why(e)}); it must not be committed") from e
        return path


def _why(e: BaseException) -> str:
    """One line: each failed rank's exception (DCP gathers them, with tracebacks), else `e` itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        text = "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(failures.items()))
    else:
        text = f"{type(e).__name__}: {e}"
    return " ".join(text.split())[:300]
