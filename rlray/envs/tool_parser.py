"""The `rlray` tool-call parser for vLLM's OpenAI server: tool calls written `name(arg1,arg2)`.

Contract: importing this module registers the parser with vLLM under the name `rlray`
(`--tool-call-parser rlray`). A completion whose text, stripped, is exactly `name(...)`
with `name` one of the request's tools becomes one tool call; the comma-separated
arguments fill the tool's parameters in schema order (strings, or numbers where the
schema says integer/number). Anything else is plain content. It is the inverse of the
tool-call rendering in `rlray.actors.server.PLAIN_CHAT_TEMPLATE`, so that the tiny character-level
models (whose vocabulary has no brackets or quotes) can call tools; real models use their
own parser (`env.tool_call_parser=hermes`, ...).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import (
    DeltaMessage,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager

CALL = re.compile(r"^([a-z][a-z0-9]*)\((.*)\)$", re.DOTALL)


def _schema(tool: Any) -> tuple[str, dict]:
    fn = getattr(tool, "function", None)
    if fn is not None:
        return fn.name, fn.parameters or {}
    return getattr(tool, "name", ""), getattr(tool, "parameters", None) or {}


def _coerce(value: str, schema: dict) -> Any:
    kind = schema.get("type")
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            return float(value)
    except ValueError:
        pass
    return value


def parse_call(text: str, tools: list[Any]) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) when `text` is one call of a known tool, else None."""
    m = CALL.match(text.strip())
    if m is None:
        return None
    schemas = dict(_schema(t) for t in tools)
    name, raw = m.group(1), m.group(2)
    if name not in schemas:
        return None
    props: dict = schemas[name].get("properties", {}) or {}
    values = raw.split(",") if raw else []
    if len(values) > len(props):  # a comma inside the last argument belongs to it
        values = values[: len(props) - 1] + [",".join(values[len(props) - 1:])] if props else []
    return name, {k: _coerce(v, props[k]) for k, v in zip(props, values)}


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
