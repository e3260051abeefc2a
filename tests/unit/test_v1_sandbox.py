"""The sandbox of v1 harnesses that execute commands (rlray.envs.sandbox, rlray.envs.v1_sandbox), with the real
bubblewrap: each escape, an episode of rlray_bash whose tool call (a scripted model's, tests/v1_model.py) tries it,
fails in the sandbox, and the same episode under verifiers' own subprocess runtime (the positive control) succeeds; the runaways (a fork bomb, a 10 GB allocation, an endless loop) end at their
limits within the configured time while the host's event loop keeps its pace, and no process of theirs is left.
The v1-side checks run in the v1 interpreter (.venv-v1, which `make test` builds); the non-root one as uid 65534
through the standard-library half, where no cgroup is writable (rlimits only)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from rlray.config import EnvConfig
from rlray.config.schema import SandboxConfig
from rlray.envs import v1
from rlray.envs.sandbox import Limits, Sandbox, SandboxError, probe

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make test "
                                "installs it as root: apt-get install bubblewrap)")

ESCAPES = r'''
import asyncio, json, os, subprocess, sys, time
from pathlib import Path
from rlray.envs.v1_sandbox import BwrapConfig, install
import verifiers.v1 as vf
import verifiers.v1.runtimes as rt
from verifiers.v1.runtimes.subprocess import SubprocessConfig
from tests.v1_model import ScriptedModel, bash_episode

args = json.loads(sys.argv[1])
install()
TRIES = {  # name: a shell command that succeeds only if the escape works
    "host port": "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", %d), 3)'" % args["port"],
    "run folder": f"cat {args['run']}/metrics.jsonl",
    "home": f"cat {args['home']}",
    "write outside": f"echo x > {args['run']}/escaped",
    "other workspace": f"cat {{other}}/secret.txt",
    "other processes": f"ps -eo args | grep -v grep | grep -q {args['marker']}",
}


async def escapes(config, name):
    first, other = rt.make_runtime(config, name + "-a-" + args["marker"]), rt.make_runtime(config, name + "-b-" + args["marker"])
    await first.start(); await other.start()
    await other.write("secret.txt", b"other episode")
    sleeper = asyncio.ensure_future(other.run(["sleep", args["marker"]], {}))
    deadline = time.monotonic() + 60  # the other episode's `sleep` running: the event the checks need
    while subprocess.run(["pgrep", "-f", "^sleep " + args["marker"]], capture_output=True).returncode != 0:
        assert time.monotonic() < deadline, "the other episode's sleep did not start within 60 s"
        await asyncio.sleep(0.05)
    out = {}
    for what, command in TRIES.items():
        command = command.replace("{other}", str(other.workdir))  # an episode whose tool call tries it
        model = ScriptedModel([f"({command}) >/dev/null 2>&1 && echo escaped"])
        await bash_episode(first, model, vf.TaskData(id=what, prompt="go"))
        out[what] = model.tool_outputs() == ["escaped\n"]
    sleeper.cancel()
    await asyncio.gather(sleeper, return_exceptions=True)
    await first.stop(); await other.stop()
    return out


async def runaways():
    runtime = rt.make_runtime(BwrapConfig(wall_s=args["wall_s"], nproc=64, memory_mb=512), "run-" + args["marker"])
    await runtime.start()
    lag = [0.0]

    async def ticks():
        while True:
            t = time.monotonic(); await asyncio.sleep(0.05); lag[0] = max(lag[0], time.monotonic() - t - 0.05)

    ticking = asyncio.ensure_future(ticks())
    out = {}
    for what, command in {"fork bomb": "f(){ f | f & }; f; sleep " + args["marker"],
                          "memory": "python3 -c 'b = bytearray(10 << 30); b[::4096] = b\"x\" * len(b[::4096])'",
                          "endless loop": "while :; do :; done",
                          "big file": "head -c 300000000 /dev/zero > big"}.items():
        t = time.monotonic()
        result = await runtime.run(["bash", "-c", command], {})
        out[what] = [result.exit_code, round(time.monotonic() - t, 1), result.stderr[-200:]]
    out["after"] = (await runtime.run(["bash", "-c", "echo fine"], {})).stdout.strip()
    out["lag"] = lag[0]
    ticking.cancel()
    await runtime.stop()
    out["root left"] = runtime.sandbox.root.exists()
    return out


async def main():
    out = {"sandbox": await escapes(BwrapConfig(), "esc"), "subprocess": await escapes(SubprocessConfig(), "ctl"),
           "runaways": await runaways()}
    out["cgroups left"] = [str(p) for p in Path("/sys/fs/cgroup").glob("*/rlray-*" + args["marker"])]
    found = subprocess.run(["pgrep", "-f", "sleep " + args["marker"]], capture_output=True, text=True).stdout.split()
    out["left"] = [p for p in found if int(p) != os.getpid()]  # this script's own argv holds the marker
    print(json.dumps(out))

asyncio.run(main())
'''


@pytest.fixture
def host(tmp_path: Path):
    """A listening loopback port (a Ray dashboard's stand-in), a run folder and a file in the host's home."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    home = Path.home() / f".rlray-sandbox-test-{uuid.uuid4().hex[:8]}"
    home.write_text("host secret")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield {"port": server.getsockname()[1], "run": str(run), "home": str(home)}
    home.unlink()


def test_escapes_fail_in_the_sandbox_and_succeed_unsandboxed_and_runaways_end_at_their_limits(host) -> None:
    marker = f"77.{uuid.uuid4().int % 10**6}"  # a `sleep` argument no other process has
    args = {**host, "marker": marker, "wall_s": 5}
    done = subprocess.run([v1.python(EnvConfig()), "-c", ESCAPES, json.dumps(args)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert not any(out["sandbox"].values()), out["sandbox"]
    assert all(out["subprocess"].values()), out["subprocess"]  # the positive control: each escape works unsandboxed
    assert not Path(host["run"], "escaped").exists() or out["subprocess"]["write outside"]
    run = out["runaways"]
    for what in ("fork bomb", "memory", "endless loop"):
        code, seconds, _ = run[what]
        assert code != 0 and seconds < args["wall_s"] + 30, (what, run[what])
    assert run["fork bomb"][0] == run["endless loop"][0] == 124, run  # ended at the wall time
    assert run["memory"][0] == 137 and "killed at the memory limit of 512 MB" in run["memory"][2], run["memory"]
    assert run["big file"][0] != 0 and "File too large" in run["big file"][2], run["big file"]
    assert run["after"] == "fine" and run["lag"] < 2.0, run  # the host's event loop kept its pace
    assert not run["root left"] and out["left"] == [] and out["cgroups left"] == [], out


NON_ROOT = r'''
import json, os, signal, subprocess, sys, time
from pathlib import Path
from sandbox import Limits, Sandbox  # rlray/envs/sandbox.py, copied where this user can read it

root, home = Path(sys.argv[1]), sys.argv[2]
box = Sandbox(root, Limits(nproc=32, memory_mb=256))
box.create()
out = {}
for what, command in {"home": f"cat {home}", "fork bomb": "f(){ f | f & }; f; sleep 3; echo survived",
                      "memory": "python3 -c 'b = bytearray(1 << 30)'", "files": "echo hi > a && cat a"}.items():
    proc = subprocess.Popen(box.command(["bash", "-c", command], {}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=60)  # only a fork bomb that never ends waits it out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    out[what] = [proc.returncode, stdout.decode()[-200:], stderr.decode()[-200:]]
print(json.dumps(out))
'''


def test_as_a_user_other_than_root_the_rlimits_hold(host) -> None:
    """Without a writable cgroup (as uid 65534 here) the sandbox limits processes by RLIMIT_NPROC, which binds a
    user other than root, and memory by RLIMIT_AS; the escapes fail alike."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root to run the check as another user (setpriv)")
    root = Path(tempfile.mkdtemp(prefix="rlray-sandbox-", dir="/tmp"))  # pytest's folders are root's alone
    lib = root / "lib"  # the checkout may be unreadable to that user (a clone in a 0700 folder): its two stdlib files
    lib.mkdir()
    for name in ("sandbox.py", "sandbox_launch.py"):
        shutil.copy(ROOT / "rlray" / "envs" / name, lib / name)
    for path in (root, lib, *lib.iterdir()):
        os.chown(path, 65534, 65534)
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I", "-c",
               f"import sys; sys.path.insert(0, {str(lib)!r})\n" + NON_ROOT, str(root / "box"), host["home"]]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["files"][:2] == [0, "hi\n"], out["files"]
    assert out["home"][0] != 0, out["home"]
    assert "survived" in out["fork bomb"][1] and "fork" in out["fork bomb"][2].lower(), out["fork bomb"]
    assert out["memory"][0] != 0 and "MemoryError" in out["memory"][2], out["memory"]


def test_the_sandbox_command_binds_only_what_it_names(tmp_path: Path) -> None:
    box = Sandbox(tmp_path / "box", binds=("/opt/python",))
    box.create()
    argv = box.command(["bash", "-c", "true"], {"X": "1"}, [8100])
    text = " ".join(argv)
    for flag in ("--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--cap-drop ALL",
                 "--ro-bind /usr /usr", "--chdir /workspace", "--ro-bind /opt/python /opt/python", "--setenv X 1"):
        assert flag in text, flag
    sources = {argv[i + 1] for i, a in enumerate(argv) if a in ("--bind", "--ro-bind", "--ro-bind-try")}
    assert not sources & {"/", str(Path.home()), "/root", str(ROOT), "/tmp", "/run"}, sources
    assert "--share-net" not in argv and "--share-net" in Sandbox(tmp_path, network="host").command(["true"], {})
    os.environ["RLRAY_SANDBOX_TEST_SECRET"] = "x"
    try:
        assert "RLRAY_SANDBOX_TEST_SECRET" not in " ".join(box.command(["env"], {}))
    finally:
        del os.environ["RLRAY_SANDBOX_TEST_SECRET"]
    (box.root / "workspace" / "out").symlink_to("/etc")
    for bad in ("../x", "/etc/passwd", "out/passwd", "/workspace/../home/../../x"):
        with pytest.raises(SandboxError):
            box.host_path(bad)
    assert box.host_path("/tmp/a") == (box.root / "tmp" / "a").resolve()
    assert probe() is None


def test_the_sandbox_config_defaults_are_the_limits() -> None:
    assert {k: v for k, v in vars(SandboxConfig()).items() if k in vars(Limits())} == vars(Limits())


V1_CHECKS = r'''
import json, sys
import verifiers.v1 as vf
import verifiers.v1.runtimes as runtimes
from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime
from verifiers.v1.utils.compile import validate_pairing
from rlray.envs import v1_sandbox, v1_worker

v1_sandbox.install(); v1_sandbox.install()
out = {"sandbox": type(runtimes.make_runtime(v1_sandbox.BwrapConfig(), "p1")).__name__,
       "subprocess": type(runtimes.make_runtime(SubprocessConfig(), "p2")).__name__,
       "dump": v1_sandbox.BwrapConfig(memory_mb=5).model_dump(), "local": runtimes.runtime_is_local(v1_sandbox.BwrapConfig())}
spec = {"module": "reverse_text_v1", "args": {}, "eval_args": {}, "harness": "bash", "runtime": "auto",
        "sandbox": {"wall_s": 7.0}, "max_turns": None, "role": "agent", "max_tasks": 4, "timeout_s": 30.0}
v1_worker._import_path([]); v1_worker._register_harness()
harness = lambda h: vf.resolve_env_config(v1_worker._config({**spec, "harness": h}, "train")).agent.harness
validate_pairing(vf.load_harness(harness("bash")), vf.Task, v1_sandbox.BwrapConfig())
try:
    validate_pairing(vf.load_harness(harness("codex")), vf.Task, v1_sandbox.BwrapConfig())
    out["codex"] = "passed"
except Exception as e:
    out["codex"] = type(e).__name__
for runtime in ("auto", "subprocess", "subprocess"):  # the second (the eval split's load) warns no more
    config = v1_worker._sandboxed(vf.resolve_env_config(v1_worker._config({**spec, "runtime": runtime}, "train")),
                                  {**spec, "runtime": runtime})
    out["runtime " + runtime] = [type(config.agent.runtime).__name__, getattr(config.agent.runtime, "wall_s", None)]
chat = v1_worker._sandboxed(vf.resolve_env_config(v1_worker._config({**spec, "harness": "chat"}, "train")), spec)
out["chat"] = type(chat.agent.runtime).__name__
given = {**spec, "harness_args": {"edit": False}}
bash = v1_worker._no_compaction(vf.resolve_env_config(v1_worker._config(given, "train")), given).agent.harness
kept = {**spec, "harness_args": {"compaction": {}}}
out["harness"] = [bash.edit, bash.compaction, v1_worker._no_compaction(
    vf.resolve_env_config(v1_worker._config(kept, "train")), kept).agent.harness.compaction is not None]
print(json.dumps(out))
'''


def test_verifiers_builds_the_sandbox_for_a_harness_that_executes_commands() -> None:
    """`install()` wraps verifiers' private runtime table (`verifiers.v1.runtimes._runtime_cls`); a `BwrapConfig`
    dumps as the subprocess config it extends; verifiers' pairing check passes `bash` and refuses a container
    harness on it; env.v1.runtime=auto gives `bash` the sandbox (its limits from env.v1.sandbox) and rlray's chat
    harness verifiers' subprocess runtime; env.v1.runtime=subprocess leaves `bash` unsandboxed, warning once;
    env.v1.harness_args set the harness's fields, its context compaction off unless they name it."""
    done = subprocess.run([v1.python(EnvConfig()), "-c", V1_CHECKS], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert (out["sandbox"], out["subprocess"], out["dump"], out["local"]) == \
        ("BwrapRuntime", "SubprocessRuntime", {"type": "subprocess"}, True), out
    assert out["codex"] != "passed", out
    assert out["runtime auto"] == ["BwrapConfig", 7.0] and out["runtime subprocess"] == ["SubprocessConfig", None], out
    assert out["chat"] == "SubprocessConfig", out
    assert out["harness"] == [False, None, True], out  # env.v1.harness_args reach it; compaction off unless named
    assert done.stderr.count("runs the policy's commands unsandboxed") == 1, done.stderr[-2000:]


PROGRAM = r'''
import asyncio, hashlib, json, sys, threading, http.server
from rlray.envs.v1_sandbox import BwrapConfig, install
import verifiers.v1.runtimes as rt
from verifiers.v1.runtimes.subprocess import SubprocessConfig
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

args = json.loads(sys.argv[1])
replies = []


class Model(http.server.BaseHTTPRequestHandler):
    """An OpenAI chat endpoint that streams one bash tool call, then a text reply."""
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        messages = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"]
        replies.extend(m["content"] for m in messages if m["role"] == "tool")
        if any(m["role"] == "assistant" for m in messages):
            delta, finish = {"role": "assistant", "content": "done"}, "stop"
        else:
            call = {"index": 0, "id": "c1", "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"command": args["command"]})}}
            delta, finish = {"role": "assistant", "tool_calls": [call]}, "tool_calls"
        chunk = lambda choices, **kw: {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                       "choices": choices, **kw}
        events = [chunk([{"index": 0, "delta": delta, "finish_reason": None}]),
                  chunk([{"index": 0, "delta": {}, "finish_reason": finish}]),
                  chunk([], usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})]
        data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Model)
threading.Thread(target=server.serve_forever, daemon=True).start()


async def episode(config, name):
    runtime = rt.make_runtime(config, name)
    await runtime.start()
    endpoint = runtime.host_url(f"http://127.0.0.1:{server.server_address[1]}/v1")
    if isinstance(config, BwrapConfig):
        program = await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE, {}, activate=False)
    else:  # the control without uv: the same program by the same interpreter
        path = runtime.workdir / "program.py"
        path.write_text(CHAT_PROGRAM_SOURCE)
        program = [sys.executable, str(path)]
    result = await runtime.run_program([*program, f"--base-url={endpoint}", "--api-key=k", "--model=m", "--bash",
                                        "--prompt=go"], {})
    await runtime.stop()
    return [result.exit_code, replies.pop() if replies else None]


async def main():
    install()
    print(json.dumps({"sandbox": await episode(BwrapConfig(wall_s=120), "prog-" + args["marker"]),
                      "subprocess": await episode(SubprocessConfig(), "ctl-" + args["marker"])}))

asyncio.run(main())
'''


def test_the_bash_harness_program_runs_its_tool_calls_in_the_sandbox(host) -> None:
    """verifiers' own bash program (its `CHAT_PROGRAM_SOURCE`, prepared without uv: the v1 interpreter inside)
    reaches the model endpoint on the host through the relay, streaming, and runs the model's tool call in the
    sandbox: the call's escapes fail there and succeed when the same program runs under verifiers' subprocess
    runtime."""
    tries = {"host port": f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {host['port']}), 3)'",
             "run folder": f"cat {host['run']}/metrics.jsonl", "home": f"cat {host['home']}"}
    command = "hostname; " + "; ".join(f"{c} >/dev/null 2>&1 && echo '{what}: escaped'" for what, c in tries.items())
    args = {"command": command, "marker": uuid.uuid4().hex[:8]}
    done = subprocess.run([v1.python(EnvConfig()), "-c", PROGRAM, json.dumps(args)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    (code, inside), (control_code, outside) = out["sandbox"], out["subprocess"]
    assert code == 0 and inside.splitlines() == ["rlray-sandbox"], out
    assert control_code == 0 and [f"{what}: escaped" for what in tries] == outside.splitlines()[1:], out


def test_sweep_removes_the_sandboxes_of_a_process_that_is_gone(tmp_path: Path) -> None:
    """A v1 env actor killed mid-episode runs no teardown: the next one on the node sweeps its sandboxes away
    (their cgroups and folders), and leaves those whose owner still runs."""
    from rlray.envs.sandbox import Cgroup, sweep

    dead = subprocess.Popen(["true"])  # a pid that has exited
    dead.wait()
    name = f"sweep-{uuid.uuid4().hex[:8]}"
    stale, live = Sandbox(tmp_path / name), Sandbox(tmp_path / "live")
    stale.create()
    live.create()
    (stale.root / "owner").write_text(str(dead.pid))
    cgroup = Cgroup.create(f"rlray-{name}", Limits())
    assert sweep(tmp_path) == 1
    assert not stale.root.exists() and live.root.exists()
    assert cgroup is None or not any(p.exists() for p in cgroup.paths)
