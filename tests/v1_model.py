"""A stand-in OpenAI chat endpoint for the v1-side checks (standard library only: they run in the v1 interpreter).

`ScriptedModel(commands)` serves `POST .../chat/completions` (JSON, no streaming) on a loopback port (`url`): turn k of
a conversation (k = its tool messages so far) is a `bash` tool call of `commands[k]`, and once they are spent the reply
`done`; with `refuse_after` set, the turn after that many is answered 400 (a limit refusing it). `requests` holds
every request body, `tool_outputs()` the tool messages' contents of the last one.
"""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any


class ScriptedModel:
    def __init__(self, commands: list[str], refuse_after: int | None = None) -> None:
        self.commands, self.refuse_after = list(commands), refuse_after
        self.requests: list[dict[str, Any]] = []
        model = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                model.requests.append(body)
                status, reply = model.answer(body["messages"])
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def answer(self, messages: list[dict]) -> tuple[int, dict]:
        turn = sum(m["role"] == "tool" for m in messages)
        if self.refuse_after is not None and turn >= self.refuse_after:
            return 400, {"error": "rollout stopped: max_turns"}
        if turn < len(self.commands):
            call = {"id": f"c{turn}", "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"command": self.commands[turn]})}}
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            message = {"role": "assistant", "content": "done", "tool_calls": None}
        return 200, {"choices": [{"index": 0, "message": message}]}

    def tool_outputs(self) -> list[str]:
        return [m["content"] for m in self.requests[-1]["messages"] if m["role"] == "tool"]


async def bash_episode(runtime: Any, model: ScriptedModel, data: Any, stop_condition: str | None = None) -> Any:
    """One episode of rlray's in-process bash harness (rlray.envs.v1_tools) on `runtime`, against `model` through the
    URL the runtime gives it (the sandbox's relay), as verifiers' rollout hands a harness its endpoint."""
    import types

    from rlray.envs.v1_tools import BashToolHarness, BashToolHarnessConfig

    harness = BashToolHarness(BashToolHarnessConfig(id="rlray_bash"))
    trace = types.SimpleNamespace(stop_condition=stop_condition)
    return await harness.launch(types.SimpleNamespace(model="m"), trace, runtime, runtime.host_url(model.url), "k", {},
                                data)
