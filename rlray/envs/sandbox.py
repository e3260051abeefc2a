"""A sandbox for the commands a policy writes: bubblewrap (`bwrap`) around every command of one episode. Standard
library only: rlray's interpreter (the checks at start) and the verifiers v1 one (rlray.envs.v1_sandbox) import it.

Contract:
- `Limits`: per episode. `wall_s` per command; `cpu_s`, `nofile`, `fsize_mb` are rlimits of every process (RLIMIT_CPU,
  RLIMIT_NOFILE, RLIMIT_FSIZE: per file); `nproc` and `memory_mb` a cgroup of the episode's own where one is writable
  (cgroup v2, or v1's `pids` and `memory`), else RLIMIT_NPROC (which root ignores) and RLIMIT_AS per process;
  `disk_mb` the workspace's total, checked after each command (a command that passes it fails) and free on the
  host's disk for the sandbox to start.
- `Sandbox(root, limits, binds, network)`: one episode. On the host its folders `root/{workspace,tmp,home,scripts,run}`;
  inside, `/workspace` (the working directory), `/tmp`, `/home/agent`, read-only `/usr` and a few files of `/etc`,
  `binds` read-only at their own paths (the v1 interpreter), its own PID, network, IPC, UTS and user namespaces
  (uid 1000), no capabilities, a new session, an environment of its own (nothing of the host's). `command(argv, env,
  ports)` is the bwrap command line; `ports` are loopback ports inside bound by the launcher (rlray.envs.sandbox_launch)
  and handed to the host over `/run/rlray/relay.sock` (the host pipes them to the model endpoint: `network="none"`
  reaches nothing else). `host_path(path)` maps a sandbox path (relative: the workspace) to the host, refusing any
  other (`..`, symlinks out, `/etc`). `usage_mb()` is the workspace's size. `create()` makes the folders, or raises
  SandboxError when the host's disk has less than `disk_mb` free.
- `Cgroup.create(name, limits)`: the episode's cgroup, or None where none is writable; `attach()` (in a child before
  exec), `kill()`, `remove()`.
- `max_running(memory_mb, given)`: how many commands a process runs in sandboxes at once: `given`, or when 0 as many
  as half this node's memory (MemTotal) holds at `memory_mb` each, at most `PER_CORE` per core of this process's
  (at least 1): more would starve each other's CPU until all of them ran past their wall time.
- `probe()`: None when bwrap runs here with the namespaces above, else one line naming the fix.
- `sweep(root)`: removes the sandboxes under `root` whose owning process is gone (killed before its teardown).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

LAUNCHER = Path(__file__).with_name("sandbox_launch.py")
INSIDE_LAUNCHER = "/opt/rlray/launch.py"
RELAY_SOCKET = "/run/rlray/relay.sock"
WORKSPACE, TMP, HOME, SCRIPTS = "/workspace", "/tmp", "/home/agent", "/opt/rlray/scripts"
UID = 1000
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "ca-certificates", "ca-certificates.conf",
       "localtime", "nsswitch.conf", "mime.types")
PATH = "/usr/local/bin:/usr/bin:/bin"
CGROUP = Path("/sys/fs/cgroup")
PER_CORE = 4  # sandboxed commands at once per core by default (verifiers' bash program: ~0.8 CPU-s to start)


@dataclass(frozen=True)
class Limits:
    wall_s: float = 600.0
    cpu_s: int = 300
    memory_mb: int = 2048
    nproc: int = 256
    nofile: int = 1024
    fsize_mb: int = 256
    disk_mb: int = 512


class SandboxError(RuntimeError):
    pass


def node_memory_mb() -> int:
    with open("/proc/meminfo") as f:
        return int(next(line.split()[1] for line in f if line.startswith("MemTotal:"))) >> 10


def cores() -> int:
    return len(os.sched_getaffinity(0))


def max_running(memory_mb: int, given: int = 0) -> int:
    return given if given > 0 else max(1, min(node_memory_mb() // 2 // memory_mb, PER_CORE * cores()))


def _passwd() -> bytes:
    return f"root:x:0:0:root:/root:/bin/sh\nagent:x:{UID}:{UID}:agent:{HOME}:/bin/bash\n".encode()


@dataclass
class Sandbox:
    root: Path
    limits: Limits = field(default_factory=Limits)
    binds: tuple[str, ...] = ()
    network: str = "none"  # "none": the relayed ports only; "host": the host's network namespace

    def create(self) -> None:
        self.root.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root.parent).free >> 20
        if free < self.limits.disk_mb:
            raise SandboxError(f"cannot start: {free} MB free under {self.root.parent}, less than one episode may use "
                               f"(env.v1.sandbox.disk_mb={self.limits.disk_mb})")
        for sub in ("workspace", "tmp", "home", "scripts", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "owner").write_text(str(os.getpid()))  # for `sweep` once this process is gone
        (self.root / "passwd").write_bytes(_passwd())
        (self.root / "group").write_bytes(f"root:x:0:\nagent:x:{UID}:\n".encode())

    def command(self, argv: list[str], env: dict[str, str], ports: list[int] = ()) -> list[str]:
        r = self.root
        out = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
               "--uid", str(UID), "--gid", str(UID), "--hostname", "rlray-sandbox", "--clearenv",
               "--ro-bind", "/usr", "/usr"]
        if self.network == "host":
            out += ["--share-net"]
        for link in ("bin", "lib", "lib64", "sbin"):
            if Path(f"/{link}").is_symlink():
                out += ["--symlink", f"usr/{link}", f"/{link}"]
            elif Path(f"/{link}").is_dir():
                out += ["--ro-bind", f"/{link}", f"/{link}"]
        for name in ETC:
            out += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        out += ["--ro-bind", str(r / "passwd"), "/etc/passwd", "--ro-bind", str(r / "group"), "/etc/group",
                "--proc", "/proc", "--dev", "/dev",
                "--bind", str(r / "workspace"), WORKSPACE, "--bind", str(r / "tmp"), TMP,
                "--bind", str(r / "home"), HOME, "--ro-bind", str(r / "scripts"), SCRIPTS,
                "--bind", str(r / "run"), "/run/rlray", "--ro-bind", str(LAUNCHER), INSIDE_LAUNCHER]
        for path in dict.fromkeys(self.binds):
            out += ["--ro-bind", path, path]
        variables = {"PATH": PATH, "HOME": HOME, "USER": "agent", "LANG": "C.UTF-8", "TMPDIR": TMP, **env}
        for name, value in variables.items():
            out += ["--setenv", name, value]
        spec = {"ports": list(ports), "socket": RELAY_SOCKET, "limits": self._rlimits()}
        return [*out, "--chdir", WORKSPACE, "--", launcher_python(), "-I", "-S", INSIDE_LAUNCHER, json.dumps(spec),
                *argv]

    def _rlimits(self) -> dict[str, int]:
        mb = 1 << 20
        out = {"CPU": self.limits.cpu_s, "NOFILE": self.limits.nofile, "FSIZE": self.limits.fsize_mb * mb, "CORE": 0}
        if Cgroup.available() is None:  # no cgroup: per process, and NPROC binds only a user other than root
            out |= {"AS": self.limits.memory_mb * mb, "NPROC": self.limits.nproc}
        return out

    def host_path(self, path: str) -> Path:
        """The host file behind sandbox path `path` (relative paths are the workspace's)."""
        p = Path(path)
        for inside, sub in ((WORKSPACE, "workspace"), (TMP, "tmp"), (HOME, "home")):
            if p.is_absolute() and (p == Path(inside) or Path(inside) in p.parents):
                p, base = p.relative_to(inside), self.root / sub
                break
        else:
            if p.is_absolute():
                raise SandboxError(f"{path!r} is outside the sandbox's {WORKSPACE}, {TMP} and {HOME}")
            base = self.root / "workspace"
        target = (base / p).resolve()
        if target != base.resolve() and base.resolve() not in target.parents:
            raise SandboxError(f"{path!r} leaves the sandbox's folders")
        return target

    def usage_mb(self) -> float:
        total = 0
        for folder in ("workspace", "tmp", "home"):
            for dirpath, _, files in os.walk(self.root / folder):
                total += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in files)
        return total / (1 << 20)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def launcher_python() -> str:
    """The interpreter that runs the launcher inside: the system's (under /usr, bound read-only)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    raise SandboxError("the sandbox needs a python3 under /usr (apt-get install python3-minimal)")


@dataclass
class Cgroup:
    """The episode's cgroup: `pids.max` and the memory limit (v2, or v1's pids and memory hierarchies)."""

    paths: list[Path]

    @staticmethod
    def available() -> str | None:
        """"v2", "v1" or None: where this process may make cgroups of its own."""
        if (CGROUP / "cgroup.controllers").is_file():
            own = _own_v2()
            return "v2" if own is not None and os.access(own, os.W_OK) else None
        if all(os.access(CGROUP / c, os.W_OK) for c in ("pids", "memory")):
            return "v1"
        return None

    @classmethod
    def create(cls, name: str, limits: Limits) -> Cgroup | None:
        kind = cls.available()
        memory = str(limits.memory_mb << 20)
        try:
            if kind == "v2":
                path = _own_v2() / name  # type: ignore[operator]
                path.mkdir()
                (path / "pids.max").write_text(str(limits.nproc))
                (path / "memory.max").write_text(memory)
                (path / "memory.swap.max").exists() and (path / "memory.swap.max").write_text("0")
                return cls([path])
            if kind == "v1":
                pids, mem = CGROUP / "pids" / name, CGROUP / "memory" / name
                pids.mkdir()
                mem.mkdir()
                (pids / "pids.max").write_text(str(limits.nproc))
                (mem / "memory.limit_in_bytes").write_text(memory)
                return cls([pids, mem])
        except OSError as e:
            raise SandboxError(f"could not make the sandbox's cgroup {name}: {e}") from e
        return None

    @classmethod
    def find(cls, name: str) -> Cgroup | None:
        """The cgroup `create(name, ...)` made, if it is still there."""
        own = _own_v2() if (CGROUP / "cgroup.controllers").is_file() else None
        paths = [p for p in ([own / name] if own else [CGROUP / "pids" / name, CGROUP / "memory" / name]) if p.is_dir()]
        return cls(paths) if paths else None

    def attach(self) -> None:
        """Move the calling process (a child between fork and exec) into the cgroup."""
        for path in self.paths:
            (path / "cgroup.procs").write_text("0")

    def oom_kills(self) -> int:
        """Processes the kernel killed at the group's memory limit so far."""
        for path in self.paths:
            for name in ("memory.events", "memory.oom_control"):  # v2, v1
                if (path / name).is_file():
                    for line in (path / name).read_text().splitlines():
                        if line.startswith("oom_kill "):
                            return int(line.split()[1])
        return 0

    def pids(self) -> list[int]:
        found: set[int] = set()
        for path in self.paths:
            procs = path / "cgroup.procs"
            if procs.exists():
                found |= {int(p) for p in procs.read_text().split()}
        return sorted(found)

    def kill(self, timeout_s: float = 10.0) -> bool:
        """SIGKILL every process in the group until it is empty (a fork bomb forks while it is killed, and a killed
        process leaves the group once reaped); whether it emptied within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():
            if time.monotonic() > deadline:
                return False
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        return True

    def remove(self) -> None:
        self.kill()
        deadline = time.monotonic() + 10.0
        for path in self.paths:
            while path.exists():
                try:
                    path.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise SandboxError(f"the sandbox's cgroup {path} would not go: {self.pids()} in it") from None
                    time.sleep(0.05)


def sweep(root: Path) -> int:
    """Remove the sandboxes under `root` whose owning process is gone (an actor killed mid-episode never ran its
    teardown): their processes, cgroups and folders. How many."""
    swept = 0
    for box in root.iterdir() if root.is_dir() else []:
        try:
            owner = int((box / "owner").read_text())
            os.kill(owner, 0)
            continue  # its owner runs: its own teardown removes it
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue  # not a sandbox this code made, or not ours to judge
        cgroup = Cgroup.find(f"rlray-{box.name}")
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(box, ignore_errors=True)
        swept += 1
    return swept


def _own_v2() -> Path | None:
    try:
        line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
    except (OSError, StopIteration):
        return None
    return CGROUP / line[3:].lstrip("/")


def probe() -> str | None:
    """None when bubblewrap runs a command with the sandbox's namespaces here, else the fix in one line."""
    if shutil.which("bwrap") is None:
        return ("the sandbox needs bubblewrap: apt-get install bubblewrap (make test and make run install it as root), "
                "or set env.v1.runtime=subprocess to run the harness's commands unsandboxed on this node")
    try:
        launcher_python()
    except SandboxError as e:
        return str(e)
    if os.geteuid() == 0 and Cgroup.available() is None:
        return ("the sandbox runs as root here with no writable cgroup (v2, or v1's pids and memory), so nothing would "
                "bound an episode's processes (root ignores RLIMIT_NPROC): run rlray as another user, or on a node "
                "whose cgroups it may write, or set env.v1.runtime=subprocess to run unsandboxed")
    try:
        with tempfile.TemporaryDirectory(prefix="rlray-probe-") as root:
            box = Sandbox(Path(root))
            box.create()
            proc = subprocess.run(box.command(["true"], {}), check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap could not start here ({e}): set env.v1.runtime=subprocess to run unsandboxed"
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return (f"bubblewrap cannot create namespaces for this user ({reason}): allow unprivileged user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1, or a container run with them), or set "
                "env.v1.runtime=subprocess to run unsandboxed")
    return None


def limits_dict(limits: Limits) -> dict[str, float]:
    return asdict(limits)


if __name__ == "__main__":  # `python -m rlray.envs.sandbox`: whether this node can sandbox, in one line
    problem = probe()
    print(problem or f"bubblewrap sandbox ready (cgroup: {Cgroup.available() or 'none, rlimits only'})")
    sys.exit(1 if problem else 0)
