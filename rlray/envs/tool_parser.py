"""The `rlray` tool-call parser for vLLM's OpenAI server: tool calls written `name(arg1,arg2)`.

Contract: importing this module registers the parser with vLLM under the name `rlray`
(`--tool-call-parser rlray`; the parsing is rlray.envs.tool_calls'). A completion whose text, stripped, is exactly `name(...)`
with `name` one of the request's tools becomes one tool call; the comma-separated
arguments fill the tool's parameters in schema order (strings, or numbers where the
schema says integer/number). Anything else is plain content. It is the inverse of the
tool-call rendering in `rlray.actors.server.PLAIN_CHAT_TEMPLATE`, so that the tiny character-level
models (whose vocabulary has no brackets or quotes) can call tools; real models use their
own parser (`env.tool_call_parser=hermes`, ...).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import (
    DeltaMessage,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager

from rlray.envs.tool_calls import parse_call


@ToolParserManager.register_module("rlray")
class RlrayToolParser(ToolParser):
    supports_required_and_named = False

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        parsed = parse_call(model_output, list(request.tools or []))
        if parsed is None:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        name, args = parsed
        call = ToolCall(function=FunctionCall(name=name, arguments=json.dumps(args)))
        return ExtractedToolCallInformation(tools_called=True, tool_calls=[call], content=None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> DeltaMessage | None:
        return DeltaMessage(content=delta_text)  # streaming tool calls are not parsed
