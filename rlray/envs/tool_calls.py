"""Tool calls written `name(arg1,arg2)`: the format of rlray.actors.server.PLAIN_CHAT_TEMPLATE, which the tiny
character-level models (no brackets or quotes in their vocabulary) can write. Standard library only: vLLM's parser
(rlray.envs.tool_parser) and the v1 renderer (rlray.envs.v1_render, in the verifiers 0.4 interpreter) use it.

Contract: `v1_tool_format(vllm_parser)` is how a v1 harness's tool calls are parsed for the engine's tool format:
"rlray" for this one, the name of renderers' parser of the same format as vLLM's `vllm_parser`
(`RENDERER_TOOL_PARSERS`), or None (none: a v1 request with tools is then refused by verifiers' TrainClient).
`parse_call(text, tools)` is (name, arguments) when `text`, stripped, is exactly `name(...)` with `name`
one of `tools`, else None; the comma-separated arguments fill the tool's parameters in schema order (strings, or
numbers where the schema says integer/number), a comma inside the last argument belonging to it.
"""

from __future__ import annotations

import re
from typing import Any

RENDERER_TOOL_PARSERS = {  # vLLM's --tool-call-parser -> renderers' tool_parser of the same format (renderers 0.1.12)
    "hermes": "qwen3", "qwen3_xml": "qwen3.5", "qwen3_coder": "qwen3.5", "glm45": "glm", "glm47": "glm",
    "deepseek_v3": "deepseek-v3", "deepseek_v31": "deepseek-v3"}
CALL = re.compile(r"^([a-z][a-z0-9]*)\((.*)\)$", re.DOTALL)


def v1_tool_format(vllm_parser: str | None) -> str | None:
    if vllm_parser == "rlray":
        return "rlray"
    return RENDERER_TOOL_PARSERS.get(vllm_parser or "")


def _schema(tool: Any) -> tuple[str, dict]:
    """(name, parameters) of an OpenAI tool: vLLM's request objects, or plain dicts (renderers' ToolSpec, or
    {"type": "function", "function": {...}})."""
    if isinstance(tool, dict):
        fn = tool.get("function", tool)
        return fn.get("name", ""), fn.get("parameters") or {}
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
