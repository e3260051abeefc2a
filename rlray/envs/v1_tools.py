"""rlray's in-process bash harness for verifiers v1 (0.4): verifiers' `bash` harness's loop, without its program.

Contract: `BashToolHarness` (harness id `HARNESS_ID`) runs the tool loop of verifiers' `bash` harness in the env
actor's own event loop (so it calls the host's endpoint, not the sandbox's relay of it): the system prompt is that harness's (`BASH_SYSTEM_PROMPT`, then the task's), the one tool
is its `BASH_TOOL`, each model turn goes to the rollout's interception `endpoint` with the conversation so far and
the tool, each tool call's command runs in the episode's runtime (`runtime.run(["bash", "-c", command])`: the
sandbox under env.v1.runtime=auto, as `EXECUTES_CODE` says) and its stdout then stderr (at most `max_output_chars`)
comes back as the tool message (a call killed at the sandbox's wall time raises: verifiers records a harness
error, which rlray counts and trains as reward 0); the loop ends at the first reply without a tool call, or when verifiers refuses a
turn (a limit such as `max_turns`: the trace holds the stop condition). What the model sees is what the `bash`
harness's program would show it; what it costs is one sandboxed `bash` per tool call instead of a Python
program per episode (rlray.bench sandbox measures both). `preamble(config)` is (system prompt, tools) of this harness
or of verifiers' `bash` with `config`, what SFT renders its episodes with (rlray.envs.v1_worker.describe).

Imported only inside the verifiers 0.4 interpreter of a v1 env actor.
"""

from __future__ import annotations

import json
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.bash.harness import BASH_SYSTEM_PROMPT, EDIT_SYSTEM_PROMPT
from verifiers.v1.harnesses.utils.core import BASH_TOOL, EDIT_TOOL

from rlray.envs.v1_chat import http_client

HARNESS_ID = "rlray_bash"
TIMED_OUT = 124  # rlray.envs.v1_sandbox's exit code for a command killed at its wall time (timeout(1)'s)


class ToolTimeout(RuntimeError):
    """A tool call killed at its runtime's wall time (not a TimeoutError: verifiers reads those as its own timeouts)."""


class BashToolHarnessConfig(vf.HarnessConfig):
    max_output_chars: int = 2000  # of a tool call's stdout + stderr, as the model sees it


class BashToolHarness(vf.Harness[BashToolHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = False
    SUPPORTS_MCP = False
    EXECUTES_CODE = True
    NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: Any,
                     data: Any, tool_interception_url: Any = None) -> Any:
        endpoint = runtime.host_side(endpoint) if hasattr(runtime, "host_side") else endpoint  # the sandbox's relay
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": "\n\n".join(p for p in (BASH_SYSTEM_PROMPT, system) if p)}]
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(m) for m in prompt)
        while True:
            reply = await http_client().post(f"{endpoint.rstrip('/')}/chat/completions",
                                             json={"model": ctx.model, "messages": messages, "tools": [BASH_TOOL]},
                                             headers={"Authorization": f"Bearer {secret}"})
            if reply.status_code >= 400 and trace.stop_condition:
                break  # a limit refused the turn: the episode ends here, as verifiers' own harnesses do
            reply.raise_for_status()  # a failed model call: the interception has recorded it on the trace
            message = reply.json()["choices"][0]["message"]
            messages.append({k: v for k, v in message.items() if v is not None})
            if not message.get("tool_calls"):
                return vf.ProgramResult(exit_code=0, stdout=message.get("content") or "", stderr="")
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                                 "content": await self._run(runtime, call["function"])})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    async def _run(self, runtime: Any, function: dict[str, Any]) -> str:
        if function.get("name") != "bash":
            return f"error: unknown tool {function.get('name')!r}"
        try:
            args = json.loads(function.get("arguments") or "{}")
        except json.JSONDecodeError as e:
            return f"error: invalid JSON in tool arguments ({e})"
        command = args.get("command", "") if isinstance(args, dict) else ""
        done = await runtime.run(["bash", "-c", str(command)], {})
        if done.exit_code == TIMED_OUT:
            raise ToolTimeout(f"tool call bash({' '.join(str(command).split())[:80]}) ran past the runtime's wall "
                               "time (env.v1.sandbox.wall_s)")
        return (done.stdout + done.stderr)[: self.config.max_output_chars]


def preamble(harness: Any) -> dict[str, Any] | None:
    """{"system": ..., "tools": [...]} that a bash-like harness (`harness` its verifiers config) puts before the task's
    own system prompt and offers on every turn; None for another harness."""
    if harness.id == HARNESS_ID:
        return {"system": BASH_SYSTEM_PROMPT, "tools": [BASH_TOOL]}
    if harness.id == "bash":
        edit = bool(getattr(harness, "edit", False))
        system = " ".join([BASH_SYSTEM_PROMPT, EDIT_SYSTEM_PROMPT] if edit else [BASH_SYSTEM_PROMPT])
        return {"system": system, "tools": [BASH_TOOL, EDIT_TOOL] if edit else [BASH_TOOL]}
    return None


__all__ = ["BashToolHarness", "BashToolHarnessConfig", "preamble"]
