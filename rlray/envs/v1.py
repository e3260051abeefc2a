"""verifiers v1 (0.4) environments, seen from rlray's own interpreter (which runs verifiers 0.3).

Contract:
- `BUILTIN_V1`: the built-in v1 envs (the modules of rlray/envs/builtin_v1, ids as their file names).
- `is_v1(env_id, python_path)`: a built-in v1 id, or the env module (found as verifiers 0.4 would import it: `owner/` and
  `@version` dropped, dashes as underscores, lower case) imports `verifiers.v1`, read from its source
  without importing it (verifiers 0.4 cannot load here).
- `spec(env, env_id, args, overrides)`: what a v1 env actor needs to load that env (rlray.envs.v1_worker):
  module, args, eval_args, harness, harness_args, runtime, sandbox, max_turns, role, max_tasks, timeout_s
  (`env.rollout_timeout_s`), from
  `env.v1` with a mix entry's `v1` overrides.
- `python(env)`: the v1 interpreter: `env.v1.python` when set (must exist), else `.venv-v1` of this
  checkout, created on first use (`make v1env`'s recipe: a venv of this interpreter's Python with
  `V1_PACKAGES` and this process's Ray version) and reused when present.
- `describe(python, specs, python_path)`: every v1 env's tasks by split, from a subprocess of the v1
  interpreter (`python -m rlray.envs.v1_worker describe`, once per process and request); a v1 env that
  fails to load is a ValueError of one line.
- `console_line(envs, env)`: the launch's line about the run's v1 envs, and when one runs in the sandbox a line of
  how many sandboxed commands run at once and each one's limits (`sandbox_line`).
- `V1Env(id, spec, rows)`: rlray's handle on one v1 env (the `Env` interface: `row`, `example`,
  `num_examples`) over `describe`'s entry; a row is the task's data with `prompt` as chat messages (the system
  prompt first: a bash-like harness's own, then the task's, as the harness sends them), `answer` (empty when
  the task has none) and `example_id`; `tools` are the harness's tools (None without); `sandboxed` whether its
  episodes run in the sandbox; `actor` is set by the rollout actor to its
  v1 env actor, which runs the episodes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlray.envs.base import Example, prompt_text

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-v1"
BUILTIN_V1_DIR = Path(__file__).resolve().parent / "builtin_v1"
BUILTIN_V1 = tuple(sorted(m.name for m in pkgutil.iter_modules([str(BUILTIN_V1_DIR)])))
V1_PACKAGES = ("verifiers==0.4.0", "renderers==0.1.12")  # rlray.envs.v1_worker.adapt_renderers pins the second
_IMPORTS_V1 = re.compile(r"^\s*(from\s+verifiers\.v1\b|from\s+verifiers\s+import\s+v1\b|import\s+verifiers\.v1\b)",
                         re.MULTILINE)


def module_of(env_id: str) -> str:
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _source(module: str, python_path: list[str]) -> str | None:
    for folder in [BUILTIN_V1_DIR, *python_path]:  # built-ins, then env.python_path, as on the v1 env actors
        for candidate in (Path(folder) / f"{module}.py", Path(folder) / module / "__init__.py"):
            if candidate.is_file():
                return candidate.read_text(errors="replace")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if found is None or not found.origin or not found.origin.endswith(".py"):
        return None
    return Path(found.origin).read_text(errors="replace")


def is_v1(env_id: str, python_path: list[str]) -> bool:
    if "." in module_of(env_id):
        return False
    source = _source(module_of(env_id), list(python_path))
    return source is not None and _IMPORTS_V1.search(source) is not None


def spec(env: Any, env_id: str, args: dict[str, Any], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    base = _plain(env.v1)
    per_env = set(base) - {"python"}  # the interpreter is one per run
    unknown = sorted(set(overrides or {}) - per_env)
    if unknown:
        raise ValueError(f"env.mix entry '{env_id}': v1.{unknown[0]} is not a per-env v1 option; give one of "
                         f"{sorted(per_env)}")
    v1 = {**base, **dict(overrides or {})}
    return {"module": module_of(env_id), "args": dict(args or {}), "eval_args": dict(v1["eval_args"] or {}),
            "harness": v1["harness"], "harness_args": dict(v1["harness_args"] or {}), "runtime": v1["runtime"],
            "sandbox": dict(v1["sandbox"] or {}),
            "max_turns": v1["max_turns"], "role": v1["role"],
            "max_tasks": int(v1["max_tasks"]), "timeout_s": float(env.rollout_timeout_s)}


def _plain(section: Any) -> dict[str, Any]:
    from dataclasses import asdict, is_dataclass

    return asdict(section) if is_dataclass(section) else dict(section)


def specs(env: Any) -> dict[str, dict[str, Any]]:
    """The v1 envs of `env` (its id, or its mix), by env id."""
    entries = [(s.id, s.args, getattr(s, "v1", None)) for s in env.mix] if env.mix else [(env.id, env.args, None)]
    return {i: spec(env, i, a, o) for i, a, o in entries if is_v1(i, list(env.python_path))}


# ---- the v1 interpreter -------------------------------------------------------------
def python(env: Any) -> str:
    given = env.v1.python
    if given:
        if not os.access(given, os.X_OK):
            raise ValueError(f"env.v1.python='{given}' is not an executable; give the python of an environment "
                             f"with {' '.join(V1_PACKAGES)} and ray, or leave it unset to build {VENV}")
        return given
    exe = VENV / "bin" / "python"
    if not (VENV / ".installed").exists():
        build_venv()
    return str(exe)


def build_venv() -> None:
    from importlib.metadata import version

    ray_version = version("ray")  # the v1 interpreter runs Ray's worker of this install: the same Ray
    started = time.monotonic()
    print(f"v1 environments: creating {VENV} ({', '.join(V1_PACKAGES)}, ray=={ray_version}) ...", flush=True)
    steps = [[sys.executable, "-m", "venv", str(VENV)],
             [str(VENV / "bin" / "pip"), "install", "-q", *V1_PACKAGES, f"ray=={ray_version}"]]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = " ".join((done.stderr or done.stdout).split())[-300:]
            raise ValueError(f"creating {VENV} failed ({' '.join(cmd[:3])} ...): {tail}; on a machine without a "
                             "package index set env.v1.python to a prepared environment")
    (VENV / ".installed").touch()
    print(f"v1 environments: {VENV} ready in {time.monotonic() - started:.0f}s", flush=True)


_DESCRIBED: dict[str, dict[str, dict[str, Any]]] = {}  # the launch checks and SFT describe the same envs


def describe(python_exe: str, env_specs: dict[str, dict], python_path: list[str]) -> dict[str, dict[str, Any]]:
    request = json.dumps({"specs": env_specs, "python_path": [str(Path(p).resolve()) for p in python_path]})
    if (python_exe + request) not in _DESCRIBED:
        _DESCRIBED[python_exe + request] = _describe(python_exe, request)
    return _DESCRIBED[python_exe + request]


def _describe(python_exe: str, request: str) -> dict[str, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([python_exe, "-m", "rlray.envs.v1_worker", "describe"], input=request,
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or "").splitlines() if ln.strip()]
        raise ValueError(lines[-1] if lines else f"{python_exe} -m rlray.envs.v1_worker failed ({done.returncode})")
    return json.loads(done.stdout)


# ---- the handle -----------------------------------------------------------------------
def _row(data: dict[str, Any], index: int, harness_system: str | None = None) -> dict[str, Any]:
    prompt = data.get("prompt")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
    system = "\n\n".join(p for p in (harness_system, data.get("system_prompt")) if p)  # as the harness joins them
    if system:
        messages.insert(0, {"role": "system", "content": system})
    answer = data.get("answer", "")
    return {**data, "prompt": messages, "answer": answer if isinstance(answer, str) else str(answer),
            "example_id": int(data.get("idx", index))}


class V1Env:
    fast_path_ok = False
    vf = None  # no classic verifiers environment behind it

    def __init__(self, env_id: str, env_spec: dict[str, Any], rows: dict[str, Any]) -> None:
        self.id, self.spec = env_id, env_spec
        harness = rows.get("harness") or {}
        self.tools: list[dict] | None = harness.get("tools")
        self.sandboxed = bool(rows.get("sandboxed"))
        self.rows = {split: [_row(d, i, harness.get("system")) for i, d in enumerate(rs)]
                     for split, rs in rows.items() if split in ("train", "eval")}
        self.actor: Any = None

    def num_examples(self, split: str) -> int:
        if split not in self.rows:
            raise ValueError(f"split='{split}'; environments have 'train' and 'eval'")
        if not self.rows[split]:
            raise ValueError(f"environment '{self.id}' has no examples for split '{split}'")
        return len(self.rows[split])

    def row(self, split: str, index: int) -> dict[str, Any]:
        n = self.num_examples(split)
        return {**self.rows[split][index % n], "v1_index": index % n, "v1_split": split}

    def example(self, split: str, index: int) -> Example:
        row = self.row(split, index)
        return Example(index=index, prompt=prompt_text(row["prompt"]), answer=row["answer"], row=row)


def console_line(envs: list, env: Any) -> str | None:
    """What the launch prints about the run's v1 envs (None without any)."""
    found = [e for e in envs if isinstance(e, V1Env)]
    if not found:
        return None
    each = ", ".join(f"{e.id} ({e.num_examples('train')} train / {e.num_examples('eval')} eval tasks, "
                     f"harness {e.spec['harness']}{', sandboxed' if e.sandboxed else ''})" for e in found)
    line = f"verifiers v1 envs: {each}; a v1 env actor beside each rollout actor, in {python(env)}"
    boxed = next((e for e in found if e.sandboxed), None)
    return line if boxed is None else line + "\n" + sandbox_line(boxed.spec["sandbox"])


def sandbox_line(box: dict[str, Any]) -> str:
    """How many sandboxed commands each v1 env actor runs at once, and what bounds each (rlray.envs.sandbox)."""
    from rlray.envs.sandbox import PER_CORE, cores, max_running, node_memory_mb

    n = max_running(box["memory_mb"], box["max_running"])
    how = ("env.v1.sandbox.max_running" if box["max_running"] else
           f"half of this node's {node_memory_mb() / 1024:.0f} GB at env.v1.sandbox.memory_mb={box['memory_mb']}, at "
           f"most {PER_CORE} per core of {cores()}")
    return (f"sandbox: up to {n} commands at once per v1 env actor ({how}; the rest wait their turn), each within "
            f"{box['memory_mb']} MB, {box['nproc']} processes, {box['cpu_s']} CPU-s, {box['wall_s']:g} s, "
            f"{box['disk_mb']} MB of files, network {box['network']}")
