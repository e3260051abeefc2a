"""The v1 env actor: verifiers v1 (0.4) environments, run in a Python environment of their own.

verifiers 0.3 (the classic API rlray's rollout actors load) and 0.4 are one distribution and cannot
share an interpreter, so v1 environments run in this actor, started by rlray.orchestration.cluster
with the v1 interpreter (Ray's `runtime_env` `py_executable`) on its rollout actor's node. This module
imports nothing at its top but the standard library: the driver and the rollout actors import it to
name the actor class; only the v1 interpreter runs its methods.

Contract:
- `V1EnvActor(specs, python_path, tokenizer, chat_template, tool_format)`: `specs` maps env id -> spec (rlray.envs.v1.
  spec: module, args, eval_args, harness, harness_args, runtime, sandbox, max_turns, timeout_s); `tokenizer` is the served model's
  tokenizer folder and `chat_template` the template the engine serves with (the renderer renders
  prompts with it, so the ids the TrainClient sends are the ids the engine's chat route would build);
  `tool_format` "rlray" when tool calls are written as that template's `name(args)` (rlray.envs.v1_render), or
  the name of renderers' tool parser for the model's format (rlray.envs.tool_calls.v1_tool_format), or None.
- `describe() -> {env id: {"train": rows, "eval": rows, "harness": ..., "sandboxed": ...}}`: loads every env once
  (off the event loop, whose interception servers answer the harnesses; a harness its runtime cannot host fails
  here, as verifiers' own `validate_pairing` says) and returns every task's data (`TaskData.model_dump`, JSON
  types, fields at their defaults left out, at most `max_tasks`) of the taskset loaded with `args` (train) and
  with `args` + `eval_args` (eval; `split: eval` too when the taskset config has a `split` field), the system
  prompt and tools a bash-like harness adds (rlray.envs.v1_tools.preamble; None for others) and whether the
  env's episodes run in the sandbox.
- `group(env_id, split, index, base_url, model, sampling) -> list[dict]`: one episode per entry of
  `sampling` (each its own sampling args, a seed among them) of task `index` (modulo the split's size),
  run with verifiers' own `Env.run_slot` and a `TrainClient` on the rollout actor's endpoint `base_url`.
  Each result: `session` (the trace id, which the TrainClient sends as `X-Session-ID` on every generate
  request), `ids`, `mask` (`sampled_mask`), `logprobs` of the trainable trace's branch, `reward`, `parts`,
  `error` ("<Kind>: ..." or None), `stop`, `turns`, `finish`, `text`. Never raises for an episode: a
  trace or episode that is not ok, a timeout, a second trainable branch become the error.
- `python -m rlray.envs.v1_worker describe` reads `{"specs": ..., "python_path": ...}` as JSON on stdin and
  prints `describe()`'s JSON (the driver's check of a v1 env before Ray starts), or one error line and exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
from typing import Any

API_KEY_VAR = "RLRAY_V1_API_KEY"  # unset: the TrainClient sends "EMPTY" (and never reads ~/.prime)


def _import_path(paths: list[str]) -> None:
    from rlray.envs.v1 import BUILTIN_V1_DIR

    for p in reversed([str(BUILTIN_V1_DIR), *paths]):
        if p not in sys.path:
            sys.path.insert(0, p)


def _register_harness() -> None:
    from rlray.envs import v1_chat, v1_tools

    for module in (v1_chat, v1_tools):
        sys.modules.setdefault(module.HARNESS_ID, module)  # verifiers imports harness ids as top-level modules


def adapt_renderers() -> None:
    """vLLM 0.32's generate route returns each sampled token's logprob as `{"token_id": N, "logprob": x}`;
    renderers 0.1 (verifiers 0.4's TrainClient) reads `{"token": "token_id:N", ...}`, the shape of later vLLMs.
    Its parser (`renderers.client._parse_completion_logprobs`, private: pinned by tests/unit/test_v1_envs.py)
    gets entries in the shape it reads; entries already in it pass unchanged."""
    import renderers.client as rc

    original = rc._parse_completion_logprobs
    if getattr(original, "rlray_adapted", False):
        return

    def parse(choice: Any, completion_ids: list[int]) -> list[float]:
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            content = [{**e, "token": f"token_id:{e['token_id']}"}
                       if isinstance(e, dict) and "token" not in e and "token_id" in e else e
                       for e in logprobs["content"]]
            choice = {**choice, "logprobs": {**logprobs, "content": content}}
        return original(choice, completion_ids)

    parse.rlray_adapted = True  # type: ignore[attr-defined]
    rc._parse_completion_logprobs = parse


def _config(spec: dict[str, Any], split: str, has_split: bool = False) -> dict[str, Any]:
    """verifiers' env config of `spec` for `split`; `has_split`: the taskset config has a `split` field,
    set to "eval" for the eval split unless env.args / env.v1.eval_args set it."""
    given = {**spec["args"], **(spec["eval_args"] if split == "eval" else {})}
    args = {"split": "eval", **given} if split == "eval" and has_split and "split" not in given else given
    harness = "rlray_chat" if spec["harness"] == "chat" else spec["harness"]
    runtime = "subprocess" if spec["runtime"] in ("auto", "sandbox") else spec["runtime"]  # the sandbox: see `load`
    agent: dict[str, Any] = {"harness": {"id": harness, **spec.get("harness_args", {})}, "runtime": {"type": runtime},
                             "timeout": {"rollout": spec["timeout_s"]}}
    if spec.get("max_turns"):
        agent["max_turns"] = spec["max_turns"]
    return {"taskset": {"id": spec["module"], **args}, spec.get("role", "agent"): agent,
            "timeout": {"episode": spec["timeout_s"]}}


def load(spec: dict[str, Any], split: str) -> Any:
    import verifiers.v1 as vf

    _register_harness()
    config = vf.resolve_env_config(_config(spec, "train"))
    if split == "eval":
        has_split = "split" in type(config.taskset).model_fields
        config = vf.resolve_env_config(_config(spec, "eval", has_split))
    config = _sandboxed(_no_compaction(config, spec), spec)
    env = vf.load_environment(config)
    _check_pairing(env, config, spec)
    return env


def _no_compaction(config: Any, spec: dict[str, Any]) -> Any:
    """`config` with its harness's context compaction off unless env.v1.harness_args names it: a summarised
    context is a re-rendered prompt, which token-in training refuses (TokenMismatch)."""
    role = spec.get("role", "agent")
    agent = getattr(config, role, None)
    harness = getattr(agent, "harness", None)
    if harness is None or "compaction" not in type(harness).model_fields or "compaction" in spec.get("harness_args", {}):
        return config
    agent = agent.model_copy(update={"harness": harness.model_copy(update={"compaction": None})})
    return config.model_copy(update={role: agent})


_WARNED: set[str] = set()


def _sandboxed(config: Any, spec: dict[str, Any]) -> Any:
    """`config` with its agent's runtime the sandbox (rlray.envs.v1_sandbox) when env.v1.runtime is sandbox, or auto
    and the harness executes commands; a harness that does, run by env.v1.runtime=subprocess, warns in one line."""
    import logging

    import verifiers.v1 as vf

    from rlray.envs import sandbox, v1_sandbox

    agent = getattr(config, spec.get("role", "agent"), None)
    if not isinstance(agent, vf.AgentConfig) or agent.harness is None:
        return config
    executes = vf.load_harness(agent.harness).EXECUTES_CODE
    if spec["runtime"] == "subprocess" and executes and agent.harness.id not in _WARNED:
        _WARNED.add(agent.harness.id)  # once per harness and process (each split loads the env)
        logging.getLogger("rlray").warning(
            "env.v1.runtime=subprocess: harness '%s' runs the policy's commands unsandboxed on this node, as this "
            "user (env.v1.runtime=auto runs them in the sandbox)", agent.harness.id)
    if not (spec["runtime"] == "sandbox" or (spec["runtime"] == "auto" and executes)):
        return config
    problem = sandbox.probe()
    if problem:
        raise ValueError(problem)
    v1_sandbox.install()
    runtime = v1_sandbox.BwrapConfig(**spec.get("sandbox", {}))
    logging.getLogger("verifiers.v1.env").addFilter(_SubprocessWarning(agent.harness.id))
    return config.model_copy(update={spec.get("role", "agent"): agent.model_copy(update={"runtime": runtime})})


class _SubprocessWarning:
    """Drops verifiers' warning that a harness runs "in the subprocess runtime on the local system" (the sandbox is
    a subprocess runtime to verifiers) for the sandboxed harness."""

    def __init__(self, harness: str) -> None:
        self.harness = harness

    def filter(self, record: Any) -> bool:
        return not (str(record.msg).startswith("Harness %r is running in the subprocess runtime")
                    and record.args and record.args[0] == self.harness)


def _check_pairing(env: Any, config: Any, spec: dict[str, Any]) -> None:
    """verifiers' own check of a harness against its runtime (a container harness on the subprocess
    runtime, ...), which it makes only when an episode starts: made at load, so it is one line before
    training."""
    import verifiers.v1 as vf
    from verifiers.v1.utils.compile import validate_pairing

    agent = getattr(config, spec["role"], None)
    if not isinstance(agent, vf.AgentConfig):
        raise ValueError(f"the env has no agent role '{spec['role']}' (env.v1.role)")  # noqa: TRY004 (a config error)
    if agent.harness is not None:
        validate_pairing(vf.load_harness(agent.harness), type(env.taskset).task_type(), agent.runtime)


def tasks(env: Any, spec: dict[str, Any]) -> list[Any]:
    return list(itertools.islice(env.taskset, spec["max_tasks"]))


def load_all(specs: dict[str, dict], python_path: list[str]) -> dict[tuple[str, str], tuple[Any, list]]:
    """(env, its tasks) of every env and split; a v1 env that fails to load is a ValueError of one line."""
    _import_path(python_path)
    out = {}
    for env_id, spec in specs.items():
        try:
            for split in ("train", "eval"):
                env = load(spec, split)
                out[env_id, split] = env, tasks(env, spec)
        except Exception as e:
            raise ValueError(f"v1 env '{env_id}' (module {spec['module']}) failed to load: "
                             f"{type(e).__name__}: {' '.join(str(e).split())[:400]}") from e
        if not out[env_id, "train"][1]:
            raise ValueError(f"v1 env '{env_id}' has no tasks (env.args={spec['args']})")
    return out


def describe_all(loaded: dict[tuple[str, str], tuple[Any, list]],
                 specs: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """Each task's data, fields at their defaults left out (a taskset's rows cross a pipe and Ray), and under
    "harness" what a bash-like harness puts before the task (rlray.envs.v1_tools.preamble) or None, under
    "sandboxed" whether its episodes run in the sandbox."""
    from rlray.envs.v1_sandbox import BwrapConfig
    from rlray.envs.v1_tools import preamble

    out: dict[str, dict[str, Any]] = {}
    for (env_id, split), (env, listed) in loaded.items():
        out.setdefault(env_id, {})[split] = [{**t.data.model_dump(mode="json", exclude_defaults=True),
                                              "idx": t.data.idx} for t in listed]
        agent = getattr(env.config, specs[env_id].get("role", "agent"), None)
        out[env_id]["harness"] = preamble(agent.harness) if getattr(agent, "harness", None) is not None else None
        out[env_id]["sandboxed"] = isinstance(getattr(agent, "runtime", None), BwrapConfig)
    return out


def _kind(error: Any) -> str:
    if error.type == "TaskError" and "scoring" in (error.message or ""):
        return "RewardError"
    return error.type or "EnvError"


def _result(episode: Any) -> dict[str, Any]:
    """One rollout record of an episode: its trainable trace's one branch."""
    errors = [f"EnvError: {e.type}: {e.message}" for e in episode.errors]
    traces = [t for t in episode.traces if t.agent.trainable]
    out = empty_result()
    if len(traces) != 1:
        errors.append(f"EnvError: the episode has {len(traces)} trainable traces; rlray trains one per rollout")
    if traces:
        t = traces[0]
        errors += [f"{_kind(e)}: {' '.join((e.message or '').split())[:300]}" for e in t.errors]
        if t.is_timeout:
            errors.append(f"RolloutTimeout: {t.stop_condition} (env.rollout_timeout_s)")
        branches = [b for b in t.branches if b.trainable]
        if len(branches) > 1:
            errors.append(f"BranchError: the trace has {len(branches)} trainable branches (the conversation's "
                          "re-rendered prefix changed); rlray trains one sequence per rollout")
        if branches:
            b = branches[0]
            out.update(ids=list(b.token_ids), mask=[int(m) for m in b.sampled_mask],
                       logprobs=[float(x) for x in b.logprobs])
        parts = {k: float(r.score) for k, r in t.rewards.items() if r is not None and r.score is not None}
        parts.update({k: float(v) for k, v in t.metrics.items() if isinstance(v, (int, float))})
        out.update(session=t.id, reward=float(t.reward or 0.0), parts=parts, stop=t.stop_condition or "",
                   turns=int(t.num_turns), text=t.last_reply or "",
                   finish=(t.calls[-1].finish_reason or "") if t.calls else "")
    out["error"] = "; ".join(dict.fromkeys(errors)) if errors else None
    return out


class V1EnvActor:
    def __init__(self, specs: dict[str, dict], python_path: list[str], tokenizer: str, chat_template: str,
                 tool_format: str | None = None) -> None:
        _import_path(python_path)
        adapt_renderers()
        self.specs, self.python_path = specs, python_path
        self.tokenizer, self.chat_template, self.tool_format = tokenizer, chat_template, tool_format
        self.loaded: dict[tuple[str, str], tuple[Any, list]] = {}
        self.serving = contextlib.AsyncExitStack()
        self.loading = asyncio.Lock()

    async def describe(self) -> dict[str, dict[str, list]]:
        """Loads every env (once: the episodes run in them) and returns their tasks."""
        await self._load()
        return describe_all(self.loaded, self.specs)

    async def _load(self) -> None:
        """Every env and split, loaded off the event loop (its interception servers must keep answering),
        each served (interception servers on this loop) until the actor ends."""
        async with self.loading:
            if not self.loaded:
                loaded = await asyncio.to_thread(load_all, self.specs, self.python_path)
                for env, _ in loaded.values():
                    await self.serving.enter_async_context(env.serving())
                self.loaded = loaded

    def _context(self, base_url: str, model: str, sampling: dict[str, Any]) -> Any:
        import verifiers.v1 as vf
        from renderers.configs import CustomRendererConfig

        from rlray.envs.v1_render import IMPORT_PATH

        tools = {"tool_format": "rlray"} if self.tool_format == "rlray" else (
            {"tool_parser": self.tool_format} if self.tool_format else {})  # renderers' own parser of that name
        renderer = CustomRendererConfig(import_path=IMPORT_PATH, chat_template=self.chat_template, **tools)
        client = vf.TrainClientConfig(base_url=base_url, api_key_var=API_KEY_VAR, renderer_model_name=self.tokenizer,
                                      renderer=renderer)
        return vf.ModelContext(model=model, client=client, sampling=vf.SamplingConfig(**sampling))

    async def group(self, env_id: str, split: str, index: int, base_url: str, model: str,
                    sampling: list[dict[str, Any]]) -> list[dict[str, Any]]:
        await self._load()  # a restarted actor loads again
        env, listed = self.loaded[env_id, split]
        task = listed[index % len(listed)]
        slots = env.slots(task, len(sampling))
        limit = self.specs[env_id]["timeout_s"] + 30.0  # verifiers' own timeouts first; this one if they hang

        async def one(slot: Any, args: dict[str, Any]) -> dict[str, Any]:
            try:
                return _result(await asyncio.wait_for(env.run_slot(slot, self._context(base_url, model, args)), limit))
            except TimeoutError:
                return empty_result(f"RolloutTimeout: the episode ran past {limit:.0f}s")
            except Exception as e:
                return empty_result(f"EnvError: {type(e).__name__}: {' '.join(str(e).split())[:300]}")

        return list(await asyncio.gather(*(one(s, a) for s, a in zip(slots, sampling))))

    async def pid(self) -> int:
        import os

        return os.getpid()


def empty_result(error: str | None = None) -> dict[str, Any]:
    """A rollout record with no tokens (an episode that failed before its trace, or with `error`)."""
    return {"session": None, "ids": [], "mask": [], "logprobs": [], "reward": 0.0, "parts": {}, "stop": "",
            "turns": 0, "finish": "", "text": "", "error": error}


def main(argv: list[str]) -> int:
    if argv[1:] != ["describe"]:
        print("usage: python -m rlray.envs.v1_worker describe  (JSON on stdin)", file=sys.stderr)
        return 2
    request = json.load(sys.stdin)
    try:
        print(json.dumps(describe_all(load_all(request["specs"], request["python_path"]), request["specs"])))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
