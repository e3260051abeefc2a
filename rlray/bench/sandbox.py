"""`python -m rlray.bench sandbox`: what the sandbox of v1 harnesses that execute commands costs (rlray.envs.v1_sandbox).

Measured in the v1 interpreter (a subprocess), beside verifiers' own unsandboxed subprocess runtime: a sandbox's start
and teardown (folders and cgroup), a command (`true`: one bubblewrap with its namespaces and the launcher), a command
that reaches a host HTTP server through the relay, what an agent episode runs in its runtime (verifiers' bash harness
program up to its argument parsing: a Python importing openai, mcp and httpx; fix_op_v1's hidden tests; with their
processes' CPU time, as bash's `times` counts it, not the sandbox's own), and commands per second with 1, 2, 4, ... sandboxes running at once (their median
latency): how many sandboxes a node's cores keep busy. Median of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from typing import Any

from rlray.bench.common import Column, Report

FULL = {"repeats": 20, "concurrency": [1, 2, 4, 8, 16]}
QUICK = {"repeats": 3, "concurrency": [1, 2]}
PROGRAM = "bash harness program start"
TESTS = "fix_op_v1 hidden tests"
RELAYED = ("exec 3<>/dev/tcp/127.0.0.1/{port} && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3 >/dev/null")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, help=f"timed runs of each (full: {FULL['repeats']})")
    p.add_argument("--concurrency", type=int, nargs="+", help=f"sandboxes at once (full: {FULL['concurrency']})")


def run(args: argparse.Namespace) -> Report:
    from rlray.config import EnvConfig
    from rlray.envs import v1

    preset = QUICK if args.quick else FULL
    params = {"repeats": args.repeats or preset["repeats"], "concurrency": args.concurrency or preset["concurrency"]}
    done = subprocess.run([v1.python(EnvConfig()), "-c", f"from rlray.bench.sandbox import main; main({params!r})"],
                          capture_output=True, text=True, timeout=1800, cwd=v1.REPO, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the sandbox benchmark failed in the v1 interpreter: {done.stderr.strip()[-1500:]}")
    out = json.loads(done.stdout.splitlines()[-1])
    report = Report("sandbox", args.quick, params=params)
    report.columns = [Column("what", "what", left=True), Column("runtime", "runtime", left=True),
                      Column("ms", "median ms", "{:.1f}"), Column("cpu_ms", "CPU ms", "{:.0f}"),
                      Column("per_s", "commands/s", "{:.1f}"),
                      Column("per_core", "commands/s per core", "{:.1f}")]
    report.rows = out["rows"]
    by = {(r["what"], r["runtime"]): r["ms"] for r in out["rows"]}
    report.ratios = {"a command, sandbox / subprocess": by[("command (true)", "sandbox")] /
                     by[("command (true)", "subprocess")],
                     "relayed request, sandbox / subprocess": by[("HTTP request to the host", "sandbox")] /
                     by[("HTTP request to the host", "subprocess")],
                     "bash program start / a command, in the sandbox": by[(PROGRAM, "sandbox")] /
                     by[("command (true)", "sandbox")]}
    report.notes = [f"{os.cpu_count()} cores; cgroup: {out['cgroup']}"]
    return report


def main(params: dict[str, Any]) -> None:
    """In the v1 interpreter: the measurements, printed as one JSON line."""
    import asyncio

    asyncio.run(_measure(params))


async def _measure(params: dict[str, Any]) -> None:
    import asyncio
    import statistics

    from verifiers.v1 import runtimes
    from verifiers.v1.runtimes.subprocess import SubprocessConfig

    from rlray.envs.sandbox import Cgroup
    from rlray.envs.v1_sandbox import BwrapConfig, install

    port = _serve()
    install()
    repeats, rows, tag = params["repeats"], [], os.getpid()
    for label, config in {"sandbox": BwrapConfig(), "subprocess": SubprocessConfig()}.items():
        boxes = [runtimes.make_runtime(config, f"bench-{label}-{i}-{tag}") for i in range(repeats)]
        starts = [await _timed(b.start()) for b in boxes]
        stops = [await _timed(b.stop()) for b in boxes]
        rows += [{"what": "start", "runtime": label, "ms": statistics.median(starts)},
                 {"what": "teardown", "runtime": label, "ms": statistics.median(stops)}]
        box = runtimes.make_runtime(config, f"bench-{label}-cmd-{tag}")
        await box.start()
        inside = box.host_url(f"http://127.0.0.1:{port}/").rsplit(":", 1)[1].strip("/")
        for what, argv in (("command (true)", ["true"]),
                           ("HTTP request to the host", ["bash", "-c", RELAYED.format(port=inside)]),
                           (PROGRAM, [*await _program(box), "--help"]), (TESTS, await _tests(box))):
            ms = statistics.median(await _serial(box, argv, repeats))
            cpu = statistics.median(await _cpu(box, argv, repeats))
            rows.append({"what": what, "runtime": label, "ms": ms, "cpu_ms": cpu})
        await box.stop()
    for n in params["concurrency"]:
        boxes = [runtimes.make_runtime(BwrapConfig(), f"bench-par-{n}-{i}-{tag}") for i in range(n)]
        await asyncio.gather(*(b.start() for b in boxes))
        t = time.perf_counter()
        each = await asyncio.gather(*(_serial(b, ["true"], repeats) for b in boxes))
        per_s = n * repeats / (time.perf_counter() - t)
        await asyncio.gather(*(b.stop() for b in boxes))
        rows.append({"what": f"{n} sandboxes at once, each a command", "runtime": "sandbox",
                     "ms": statistics.median(x for e in each for x in e), "per_s": per_s,
                     "per_core": per_s / (os.cpu_count() or 1)})
    print(json.dumps({"rows": rows, "cgroup": Cgroup.available() or "none (rlimits)"}))


def _serve() -> int:
    """A host HTTP server answering `ok`: the relayed requests' far end."""
    import http.server
    import threading

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1]


async def _program(box: Any) -> list[str]:
    """verifiers' bash harness program as its harness prepares it (the sandbox: the v1 interpreter, no uv)."""
    import sys

    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    if hasattr(box, "host_side"):  # the sandbox
        return await box.prepare_uv_script(CHAT_PROGRAM_SOURCE, {}, activate=False)
    await box.write("program.py", CHAT_PROGRAM_SOURCE.encode())
    return [sys.executable, str(box.workdir / "program.py")]


async def _tests(box: Any) -> list[str]:
    """fix_op_v1's hidden-test run of its first training task, its file in the workspace."""
    import sys

    from rlray.envs import v1_worker

    v1_worker._import_path([])
    from fix_op_v1 import CHECK, task_data

    data = task_data("train", 0, 0)
    await box.write(f"{data.file}.py", data.source.encode())
    return [sys.executable, "-I", "-c", CHECK, data.file, data.fn, json.dumps([t[:2] for t in data.tests])]


async def _cpu(box: Any, argv: list[str], repeats: int) -> list[float]:
    """CPU ms of `argv`'s processes (user + system), as the shell running it inside the runtime counts them."""
    import re

    out = []
    for _ in range(repeats):
        done = await box.run(["bash", "-c", '"$@" >/dev/null 2>&1; times', "bash", *argv], {})
        children = done.stdout.strip().splitlines()[-1]
        out.append(sum(int(m) * 60_000 + float(s) * 1000 for m, s in re.findall(r"(\d+)m([\d.]+)s", children)))
    return out


async def _timed(awaitable: Any) -> float:
    t = time.perf_counter()
    await awaitable
    return (time.perf_counter() - t) * 1000


async def _serial(box: Any, argv: list[str], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        done = await box.run(argv, {})
        out.append((time.perf_counter() - t) * 1000)
        if done.exit_code != 0:
            raise RuntimeError(f"a benchmark command failed ({done.exit_code}): {done.stderr[-300:]}")
    return out
