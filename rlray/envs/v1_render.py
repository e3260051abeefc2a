"""The renderer rlray gives verifiers v1's TrainClient: the engine's chat template, token in, token out.

Contract: `TokenInRenderer` is renderers' `DefaultRenderer` (a Jinja chat template, here the one the rollout
engines serve, given as `chat_template` in its config) plus `bridge_to_next_turn`: turn k+1's prompt is
turn k's prompt and sampled ids exactly as sampled, then the template's ids for the new (user / tool)
messages only (rlray.envs.bridge.TurnBridge, the classic client's bridge). DefaultRenderer re-renders the
whole conversation every turn, so a sampled text that does not re-encode to its own ids (a special token
mid-answer, a truncated turn) would split the trace into two branches. New messages holding an assistant
message, or a template the bridge cannot split, fall back to that full re-render (`None`), as renderers'
contract asks. With `tool_format: rlray` in its config (the plain chat template's `name(args)` calls, which a
vLLM-side parser would read: rlray.envs.tool_calls) it supports tools and parses a reply that is one such call
into a tool call; otherwise renderers' own `tool_parser`, when its config names one.

Imported only inside the verifiers 0.4 interpreter of a v1 env actor (rlray.envs.v1_worker names it in a
`CustomRendererConfig`).
"""

from __future__ import annotations

from typing import Any

from renderers.base import ParsedResponse, ParsedToolCall, RenderedTokens
from renderers.configs import DefaultRendererConfig
from renderers.default import DefaultRenderer

from rlray.envs.bridge import BridgeError, TurnBridge
from rlray.envs.tool_calls import parse_call

IMPORT_PATH = "rlray.envs.v1_render.TokenInRenderer"


class TokenInRenderer(DefaultRenderer):
    config_class = DefaultRendererConfig

    def __init__(self, tokenizer: Any, config: DefaultRendererConfig | None = None) -> None:
        super().__init__(tokenizer, config)
        extra = self.config.model_extra or {}
        self.turns = TurnBridge(tokenizer, extra.get("chat_template"))
        self.tool_format = extra.get("tool_format")

    @property
    def supports_tools(self) -> bool:
        return self.tool_format == "rlray" or super().supports_tools

    def parse_response(self, token_ids: list[int], *, tools: list | None = None,
                       prompt_ids: list[int] | None = None) -> ParsedResponse:
        parsed = super().parse_response(token_ids, tools=tools, prompt_ids=prompt_ids)
        call = parse_call(parsed.content, list(tools)) if self.tool_format == "rlray" and tools else None
        if call is None:
            return parsed
        return ParsedResponse(content="", reasoning_content=parsed.reasoning_content,
                              tool_calls=[ParsedToolCall(raw=parsed.content, name=call[0], arguments=call[1])])

    def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                            new_messages: list, *, tools: list | None = None, **_: Any) -> RenderedTokens | None:
        if any(_role(m) == "assistant" for m in new_messages):
            return None
        try:
            ids = self.turns.next_prompt(list(previous_prompt_ids), list(previous_completion_ids),
                                         [dict(m) for m in new_messages], tools)
        except BridgeError:
            return None
        return RenderedTokens(token_ids=ids, message_indices=[-1] * len(ids), sampled_mask=[False] * len(ids))


def _role(message: Any) -> str | None:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
