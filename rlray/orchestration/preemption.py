"""Preemption: SIGTERM or SIGUSR1 (Slurm's `--signal`) to the driver ends the run cleanly and resumably.

Contract: `install(grace_s)` (the driver's main thread, rlray.launch) makes SIGTERM and SIGUSR1 set
`requested()` to the signal's name and start a watchdog (`rearm()` sets the handlers again once
`ray.init` has put its own SIGTERM handler, a plain exit, in their place; it does nothing where
`install` was not called): a driver still running `grace_s` seconds
after the signal prints one line and exits with status 1. The controller looks at `requested()`
between steps and while a step waits for its batch (`Preempted`): in RL it commits a checkpoint at
the step it is at, stops the actors and returns with `summary["preempted"]`; in SFT (which keeps no
checkpoints: an interrupted SFT restarts) it stops. A second signal changes nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_requested: list[str] = []
_grace: list[float] = []  # install's grace_s


class Preempted(Exception):
    """Raised where a step waits, to bring the controller back to its loop's top."""


def requested() -> str | None:
    return _requested[0] if _requested else None


def _on_signal(grace_s: float, signum: int, _frame: object) -> None:
    if _requested:
        return
    _requested.append(signal.Signals(signum).name)

    def overdue() -> None:
        print(f"preempted ({_requested[0]}) but the run did not stop within checkpoint.preempt_grace_s="
              f"{grace_s:g}s; exiting without its last checkpoint (resume from the previous one)",
              file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(grace_s, overdue)
    timer.daemon = True
    timer.start()


def install(grace_s: float) -> None:
    _grace[:] = [grace_s]
    rearm()


def rearm() -> None:
    if not _grace or threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, lambda signum, frame: _on_signal(_grace[0], signum, frame))
