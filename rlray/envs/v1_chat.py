"""rlray's in-process chat harness for verifiers v1 (0.4) environments: no program, no uv, no container.

Contract: `ChatHarness` is a `verifiers.v1.Harness` whose `launch` runs one chat turn in the env actor's
own event loop: the conversation so far (system prompt, then the task's prompt or the resumed
messages) goes to the rollout's interception `endpoint` with its `secret`, which records the turn on
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
from openai import AsyncOpenAI
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
        # the interception maps failures; it answers from this loop, busy with every other episode: no
        # timeout of the client's own (the episode's timeouts, env.rollout_timeout_s, bound the turn)
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, timeout=httpx.Timeout(None))
        try:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


__all__ = ["ChatHarness", "ChatHarnessConfig"]
