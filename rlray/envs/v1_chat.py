"""rlray's in-process chat harness for verifiers v1 (0.4) environments: no program, no uv, no container.

Contract: `ChatHarness` is a `verifiers.v1.Harness` whose `launch` runs one chat turn in the env actor's
own event loop: the conversation so far (system prompt, then the task's prompt or the resumed
messages) goes to the rollout's interception `endpoint` (`POST /chat/completions`, one shared HTTP
client) with its `secret`, which records the turn on
the trace and samples it through the TrainClient (token in, token out, rlray's engine). verifiers
v1 allows this (`verifiers/v1/harness.py`, `Harness.launch`: a harness may run its loop in process as
long as every model call goes through the endpoint). Loaded by verifiers' own harness loader under the
id `HARNESS_ID` (rlray.envs.v1_worker registers the module under that top-level name).

Imported only inside the verifiers 0.4 interpreter of a v1 env actor.
"""

from __future__ import annotations

from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

HARNESS_ID = "rlray_chat"


class ChatHarnessConfig(vf.HarnessConfig):
    """No options of its own."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the task's system prompt is this harness's first message
    SUPPORTS_RESUME = True  # a later turn relaunches on the conversation so far (Harness.resume)
    SUPPORTS_MCP = False
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: Any,
                     data: Any, tool_interception_url: Any = None) -> Any:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(m) for m in prompt)
        reply = await http_client().post(f"{endpoint.rstrip('/')}/chat/completions",
                                         json={"model": ctx.model, "messages": messages},
                                         headers={"Authorization": f"Bearer {secret}"})
        reply.raise_for_status()  # a failed model call: the interception has recorded it on the trace
        text = reply.json()["choices"][0]["message"].get("content") or ""
        return vf.ProgramResult(exit_code=0, stdout=text, stderr="")


_client: httpx.AsyncClient | None = None


def http_client() -> httpx.AsyncClient:
    """One HTTP client for every turn of the actor's episodes (a client per turn would build an SSL context per
    turn: measured, most of the env actor's CPU). No timeout of its own: the interception answers from this
    event loop, busy with every other episode, and the episode's timeouts (env.rollout_timeout_s) bound a turn."""
    global _client
    if _client is None or _client.is_closed:
        _client = httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False,
                                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    return _client


__all__ = ["ChatHarness", "ChatHarnessConfig"]
