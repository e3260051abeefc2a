"""The sandbox as a verifiers v1 (0.4) runtime: every command of an episode under bubblewrap (rlray.envs.sandbox).
The v1 interpreter imports it (rlray.envs.v1_worker).

verifiers' runtimes are a closed set (`RuntimeConfig` a discriminated union on `type`, the classes a dict inside
`verifiers.v1.runtimes._runtime_cls`), so the sandbox is the subprocess runtime's subclass under its `type`:
`BwrapConfig` is a `SubprocessConfig` whose own fields are excluded from dumps (a trace records `subprocess`), and
`install()` wraps the private `_runtime_cls` (pinned by tests/unit/test_v1_sandbox.py) so that a `BwrapConfig`
makes a `BwrapRuntime`. verifiers' own checks see a subprocess runtime: a harness that needs a container image stays
refused, `bash` passes.

Contract:
- `BwrapConfig(network, wall_s, cpu_s, memory_mb, nproc, nofile, fsize_mb, disk_mb, keep_failed, max_running)`.
- `slots(config)`: the process's one semaphore of commands running at once (`max_running`, rlray.envs.sandbox), sized
  by the first config that asks; `run` waits for a slot before its command starts (and its wall time with it).
- `BwrapRuntime`: `start()` makes the episode's folders under `~/.cache/rlray/sandbox/<name>` and its cgroup;
  `run`/`run_program` one bwrap each (files persist between them, processes do not), killed past `wall_s` (exit
  124, the reason on stderr); `write`/`read` the sandbox's files by their paths inside; `host_url(url)` gives a
  loopback url an inside port relayed to it; `prepare_uv_script` runs a PEP 723 program with the v1 interpreter
  (bound read-only; its dependencies are this interpreter's, never downloaded); `teardown()` kills every process and
  removes the folders (kept when `keep_failed` and a command failed). `open_process` and `run_background` are not
  offered (no process outlives its command).
- `install()`: idempotent; first sweeps away the sandboxes of processes that are gone (rlray.envs.sandbox.sweep).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import sys
import sysconfig
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field
from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes.base import ProgramResult
from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime, SubprocessRuntimeInfo

from rlray.envs.sandbox import RELAY_SOCKET, SCRIPTS, Cgroup, Limits, Sandbox, max_running, sweep

ROOT = Path.home() / ".cache" / "rlray" / "sandbox"
FIRST_PORT = 8100
LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


class BwrapConfig(SubprocessConfig):
    network: str = Field("none", exclude=True)
    wall_s: float = Field(Limits.wall_s, exclude=True)
    cpu_s: int = Field(Limits.cpu_s, exclude=True)
    memory_mb: int = Field(Limits.memory_mb, exclude=True)
    nproc: int = Field(Limits.nproc, exclude=True)
    nofile: int = Field(Limits.nofile, exclude=True)
    fsize_mb: int = Field(Limits.fsize_mb, exclude=True)
    disk_mb: int = Field(Limits.disk_mb, exclude=True)
    keep_failed: bool = Field(False, exclude=True)
    max_running: int = Field(0, exclude=True)

    def limits(self) -> Limits:
        return Limits(self.wall_s, self.cpu_s, self.memory_mb, self.nproc, self.nofile, self.fsize_mb, self.disk_mb)


def interpreter_binds() -> tuple[str, ...]:
    """The v1 interpreter's folders, bound read-only at their own paths (its venv and the Python it was made from)."""
    paths = sorted({sys.prefix, sys.base_prefix, sysconfig.get_paths()["stdlib"],
                    str(Path(sys.executable).resolve().parent)})
    kept: list[str] = []
    for p in paths:  # sorted: a folder before what is under it
        if not p.startswith("/usr/") and not any(p == k or p.startswith(k + "/") for k in kept):
            kept.append(p)
    return tuple(kept)


_SLOTS: list[asyncio.Semaphore] = []


def slots(config: BwrapConfig) -> asyncio.Semaphore:
    if not _SLOTS:
        _SLOTS.append(asyncio.Semaphore(max_running(config.memory_mb, config.max_running)))
    return _SLOTS[0]


class BwrapRuntime(SubprocessRuntime):
    scripts_dir: ClassVar[str] = SCRIPTS

    def __init__(self, config: BwrapConfig, name: str | None = None) -> None:
        super().__init__(config, name)
        self.info = SubprocessRuntimeInfo()
        self.sandbox = Sandbox(ROOT / self.name, config.limits(), interpreter_binds(), config.network)
        self.cgroup: Cgroup | None = None
        self.ports: dict[tuple[str, int], int] = {}  # (host, port) outside -> port inside
        self.failed = False
        self.oom_kills = 0

    async def start(self) -> None:
        self.sandbox.create()
        self.workdir = self.sandbox.root / "workspace"
        self.cgroup = Cgroup.create(f"rlray-{self.name}", self.sandbox.limits)
        self.info.id = str(self.sandbox.root)

    async def run(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        if self.workdir is None:
            raise SandboxError("the sandbox runtime was not started")
        async with slots(self.config):
            return await self._run(argv, env)

    async def _run(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        limits = self.sandbox.limits
        ports = dict(self.ports)
        command = self.sandbox.command(argv, self.process_env(env), list(ports.values()))
        relay = await Relay.open(self.sandbox.root / "run" / Path(RELAY_SOCKET).name, ports) if ports else None
        cgroup = self.cgroup
        proc = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
            preexec_fn=cgroup.attach if cgroup else None)
        try:
            if relay is not None:
                await relay.accept(proc)
            stdout, stderr = await asyncio.wait_for(proc.communicate(), limits.wall_s)
            code = proc.returncode or 0
        except TimeoutError:
            stdout, stderr, code = b"", f"sandbox: killed past its wall time of {limits.wall_s:g} s\n".encode(), 124
        finally:
            await self._kill(proc)
            if relay is not None:
                await relay.close()
        if cgroup is not None and cgroup.oom_kills() > self.oom_kills:
            self.oom_kills = cgroup.oom_kills()
            stderr += f"\nsandbox: a process was killed at the memory limit of {limits.memory_mb} MB\n".encode()
        used = await asyncio.to_thread(self.sandbox.usage_mb)
        if used > limits.disk_mb:
            stderr += f"\nsandbox: its files take {used:.0f} MB, over its {limits.disk_mb} MB\n".encode()
            code = code or 1
        self.failed |= code != 0
        return ProgramResult(exit_code=code, stdout=stdout.decode(errors="replace"),
                             stderr=stderr.decode(errors="replace"))

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        """bwrap dies, and with it (--die-with-parent, the PID namespace) everything the command started; the
        cgroup is emptied off the event loop (a fork bomb takes a few rounds)."""
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill)

    async def open_process(self, argv: list[str], env: dict[str, str]) -> Any:
        raise NotImplementedError("the sandbox runtime runs one command at a time (no live processes)")

    async def run_background(self, argv: list[str], env: dict[str, str], log: str) -> None:
        raise NotImplementedError("the sandbox runtime keeps no process past its command (no background servers)")

    @property
    def supports_live_processes(self) -> bool:
        return False

    async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        target = self.sandbox.host_path(path)

        def read() -> bytes:
            fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO the policy made does not block
            with os.fdopen(fd, "rb") as file:
                return file.read(-1 if max_bytes is None else max_bytes)

        try:
            return await asyncio.to_thread(read)
        except OSError as e:
            raise SandboxError(f"read {path!r}: {e}") from e

    async def write(self, path: str, data: bytes) -> None:
        if path.startswith(SCRIPTS + "/"):
            target = self.sandbox.root / "scripts" / Path(path).name
        else:
            target = self.sandbox.host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(target.write_bytes, data)

    def host_url(self, url: str) -> str:
        parts = urlsplit(url)
        if self.sandbox.network == "host" or parts.hostname not in LOOPBACK:
            return url
        origin = (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        inside = self.ports.setdefault(origin, FIRST_PORT + len(self.ports))
        return urlunsplit(parts._replace(netloc=f"127.0.0.1:{inside}"))

    def host_side(self, url: str) -> str:
        """The host URL behind `url` when `host_url` wrote it (rlray's in-process harnesses call the host directly)."""
        parts = urlsplit(url)
        for (host, port), inside in self.ports.items():
            if parts.hostname == "127.0.0.1" and parts.port == inside:
                return urlunsplit(parts._replace(netloc=f"[{host}]:{port}" if ":" in host else f"{host}:{port}"))
        return url

    async def prepare_uv_script(self, script: str | bytes, env: dict[str, str] | None = None, *,
                                activate: bool = True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        name = f"{hashlib.sha256(data).hexdigest()}.py"
        await self.write(f"{SCRIPTS}/{name}", data)
        return [sys.executable, f"{SCRIPTS}/{name}"]

    def cleanup(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
        if not (self.failed and self.config.keep_failed):
            self.sandbox.remove()

    async def teardown(self) -> None:
        await asyncio.to_thread(self.cleanup)


class Relay:
    """The host end of the sandbox's loopback ports: the launcher hands their listening sockets over a Unix socket;
    each connection is piped to its origin on the host."""

    def __init__(self, server: socket.socket, ports: dict[tuple[str, int], int]) -> None:
        self.server, self.ports = server, ports
        self.servers: list[asyncio.Server] = []

    @classmethod
    async def open(cls, path: Path, ports: dict[tuple[str, int], int]) -> Relay:
        path.unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen(1)
        server.setblocking(False)
        return cls(server, ports)

    async def accept(self, proc: asyncio.subprocess.Process, timeout_s: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        accepted = asyncio.ensure_future(loop.sock_accept(self.server))
        exited = asyncio.ensure_future(proc.wait())
        done, _ = await asyncio.wait({accepted, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        if accepted not in done:
            accepted.cancel()
            return  # the command failed to start (its stderr says why) or is stuck: its own limits end it
        conn, _ = accepted.result()
        with conn:
            conn.setblocking(True)
            _, fds, _, _ = await asyncio.to_thread(socket.recv_fds, conn, 16, len(self.ports))
            for fd, origin in zip(fds, self.ports, strict=True):
                listener = socket.socket(fileno=fd)
                self.servers.append(await asyncio.start_server(_piping(origin), sock=listener))
            conn.sendall(b"k")

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        self.server.close()


def _piping(origin: tuple[str, int]) -> Any:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*origin)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return handle


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def install() -> None:
    """Make verifiers build a `BwrapRuntime` for a `BwrapConfig` (its runtime table is private)."""
    from verifiers.v1 import runtimes

    if getattr(runtimes._runtime_cls, "rlray_sandbox", False):
        return
    sweep(ROOT)  # the sandboxes of an earlier actor on this node that was killed mid-episode
    original = runtimes._runtime_cls

    def runtime_cls(config: Any) -> type:
        return BwrapRuntime if isinstance(config, BwrapConfig) else original(config)

    runtime_cls.rlray_sandbox = True  # type: ignore[attr-defined]
    runtimes._runtime_cls = runtime_cls
