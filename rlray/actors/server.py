"""vLLM's own OpenAI-compatible server around a running `Engine`, inside the caller's event loop.

Contract:
- `OpenAIServer.start(engine, host=..., port=0, ...)` (host "node": every interface, advertised
  by the node's address) builds vLLM's FastAPI app
  (`build_app` + `init_app_state`) around the engine's `AsyncLLM` and serves it with
  uvicorn as a task on the current event loop: the same engine answers HTTP requests
  (`/v1/chat/completions`, `/v1/completions`, `/tokenize`, `/v1/models`, ...; with vLLM's
  scale-out routes on, the token-in turns of `rlray.envs.client` use render, generate and
  derender) and direct `Engine.generate` calls. `url` is the OpenAI base URL (`http://host:port/v1`).
- Token ids and logprobs come back when a request asks for them (`logprobs: true`,
  `return_token_ids: true`); logprobs are the engine's `processed_logprobs`.
- Every finished request's weight-version spans (which policy version sampled which
  output tokens; vLLM labels them, see `Engine.finish_weight_update`) are kept by response id:
  `versions(response_id, num_tokens)` returns one version per output token; with routing capture
  (MoE), `routing(response_id, num_tokens)` the experts of every position of prompt + completion.
  With LoRA every request is served with the engine's current adapter (`Engine.lora`).
- Sessions (verifiers v1's TrainClient sends `X-Session-ID: <trace id>` on every generate request, which
  vLLM hands the engine client as `session_id`): turn k of a session samples with seed `seed +
  TURN_SEED_STRIDE * k` when seeded, and `max_tokens` cut to what `max_model_len` leaves after its prompt;
  `session(session_id, default)` pops the session's finished requests in order, each `{"id", "prompt",
  "out", "versions"}` (prompt and output ids, one policy version per output token).
- A tokenizer without a chat template gets `PLAIN_CHAT_TEMPLATE` (bos, then every
  message's text; an assistant turn ends with eos; tool calls are written `name(args)`),
  which together with the `rlray` tool-call parser (rlray.envs.tool_parser) lets the
  character-level tiny models play multi-turn and tool environments.
- vllm, fastapi and uvicorn are imported inside functions only.
"""

from __future__ import annotations

import asyncio
import socket
from collections import OrderedDict
from typing import Any

from rlray.envs.base import SERVED_MODEL
from rlray.envs.client import TURN_SEED_STRIDE

PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% for tc in m.get('tool_calls') or [] %}"
    "{% set args = tc['function']['arguments'] %}"
    "{{ tc['function']['name'] }}({% if args is mapping %}{{ args.values() | join(',') }}"
    "{% else %}{{ args }}{% endif %})"
    "{% endfor %}"
    "{{ eos_token }}"
    "{% elif m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
)



class _VersionTracking:
    """The engine client the server sees: the `AsyncLLM` itself, plus a record of the
    weight-version spans and the routing (MoE, `Engine.capture_routing`) of every finished
    request (keyed by request id = response id)."""

    def __init__(self, engine: Any, capacity: int = 65536) -> None:
        self._engine, self._llm = engine, engine.llm
        self._spans: OrderedDict[str, dict[int, list]] = OrderedDict()
        self._routing: OrderedDict[str, dict[int, Any]] = OrderedDict()
        self._sessions: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._capacity = capacity

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def _session_turn(self, session: str, prompt: Any, params: Any) -> tuple[list, Any]:
        """The session's record list (a new turn appended) and this turn's sampling parameters."""
        turns = self._sessions.setdefault(session, [])
        self._sessions.move_to_end(session)
        if len(self._sessions) > self._capacity:
            self._sessions.popitem(last=False)
        k, length = len(turns), _prompt_len(prompt)
        room = None if length is None else self._llm.model_config.max_model_len - length
        if (params.seed is not None and k) or (room is not None and 0 < room < (params.max_tokens or room + 1)):
            params = params.clone()
            if params.seed is not None:  # replaying turn 0's random draws would repeat its choices
                params.seed = (params.seed + TURN_SEED_STRIDE * k) % 2**31
            if room is not None and 0 < room < (params.max_tokens or room + 1):
                params.max_tokens = room
        return turns, params

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any):
        routing: dict[int, Any] = {}
        if self._engine.lora is not None:  # the policy's LoRA adapter, whatever model name the request gave
            kwargs["lora_request"] = self._engine.lora
        session = kwargs.get("session_id")
        if session is not None:
            turns, sampling_params = self._session_turn(session, prompt, sampling_params)
            record: dict[str, Any] = {"id": request_id, "prompt": [], "out": [], "spans": None}
            turns.append(record)
        try:
            async for out in self._llm.generate(prompt, sampling_params, request_id, *args, **kwargs):
                for c in out.outputs:
                    if c.weight_versions is not None:
                        self._spans.setdefault(request_id, {})[c.index] = list(c.weight_versions)
                if session is not None and out.finished:
                    record.update(prompt=list(out.prompt_token_ids or []), out=list(out.outputs[0].token_ids),
                                  spans=self._spans.pop(request_id, {}).get(0))
                self._engine.keep_routing(routing, out)
                if out.finished and len(self._spans) > self._capacity:
                    self._spans.popitem(last=False)
                if out.finished and self._engine.capture_routing:  # before the response, which a caller may read
                    self._routing[request_id] = await self._engine.finished_routing(request_id, routing)
                    if len(self._routing) > self._capacity:
                        self._routing.popitem(last=False)
                yield out
        finally:
            if self._engine.capture_routing and request_id not in self._routing:  # cancelled: forget it
                await self._engine.forget_routing(request_id)

    def pop_spans(self, request_id: str, index: int = 0) -> list | None:
        spans = self._spans.pop(request_id, None)
        return None if spans is None else spans.get(index)

    def pop_session(self, session: str) -> list[dict[str, Any]]:
        return self._sessions.pop(session, [])

    def pop_routing(self, request_id: str, index: int = 0) -> Any:
        routing = self._routing.pop(request_id, None)
        return None if routing is None else routing.get(index)


def _prompt_len(prompt: Any) -> int | None:
    """The token count of an engine input (a dict or object with `prompt_token_ids`), None if unknown."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else getattr(prompt, "prompt_token_ids", None)
    return None if ids is None else len(ids)


def spans_to_versions(spans: list | None, num_tokens: int, default: int) -> list[int]:
    """One int version per output token from vLLM's `WeightVersionSpan`s; `default` where unlabelled."""
    out = [default] * num_tokens
    for span in spans or []:
        try:
            v = int(span.version)
        except (TypeError, ValueError):
            continue
        for i in range(max(0, span.start), min(num_tokens, span.end)):
            out[i] = v
    return out


def node_address() -> str:
    """This node's outward address (the interface a default route would use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class OpenAIServer:
    def __init__(self, tracking: _VersionTracking, server: Any, task: asyncio.Task, host: str, port: int) -> None:
        self.tracking, self.server, self.task = tracking, server, task
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @classmethod
    async def start(cls, engine: Any, *, host: str = "127.0.0.1", port: int = 0, chat_template: str | None = None,
                    tool_call_parser: str | None = None, model_name: str = SERVED_MODEL) -> OpenAIServer:
        import uvicorn
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.entrypoints.launchers.launcher import NoSignalServer
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        llm = engine.llm
        model = llm.model_config.model
        if chat_template is None and not getattr(llm.renderer.tokenizer, "chat_template", None):
            chat_template = PLAIN_CHAT_TEMPLATE
        argv = ["--model", model, "--served-model-name", model_name, model, "--disable-uvicorn-access-log",
                "--disable-log-stats", "--disable-fastapi-docs", "--enable-scale-out"]
        if chat_template is not None:
            argv += ["--chat-template", chat_template]
        if tool_call_parser:
            if tool_call_parser == "rlray":
                import rlray.envs.tool_parser  # noqa: F401  (registers the parser)
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        advertised = host
        if host == "node":  # serve on every interface, advertise the node's address
            host, advertised = "0.0.0.0", node_address()
        sock = _bind(host, port)
        port = sock.getsockname()[1]
        args.host, args.port = host, port
        tracking = _VersionTracking(engine)
        tasks = await llm.get_supported_tasks()
        app = build_app(args, tasks, llm.model_config)
        await init_app_state(tracking, app.state, args, tasks)
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30)
        server = NoSignalServer(config)
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()  # raises the start-up error
            await asyncio.sleep(0.01)
        return cls(tracking, server, task, advertised, port)

    def versions(self, response_id: str, num_tokens: int, default: int, index: int = 0) -> list[int]:
        return spans_to_versions(self.tracking.pop_spans(response_id, index), num_tokens, default)

    def session(self, session_id: str, default: int) -> list[dict[str, Any]]:
        """The finished generate requests of a session (`X-Session-ID`), in the order they came, each with
        `versions`: one per output token (`default` where unlabelled)."""
        return [{**r, "versions": spans_to_versions(r["spans"], len(r["out"]), default)}
                for r in self.tracking.pop_session(session_id)]

    def routing(self, response_id: str, num_tokens: int, index: int = 0) -> Any:
        """The routing of a finished response's prompt + completion (`num_tokens` positions; None without)."""
        from rlray.actors.engine import fit_routing

        r = self.tracking.pop_routing(response_id, index)
        return None if r is None else fit_routing(r, num_tokens)

    async def stop(self) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self.task, timeout=10)
        except Exception:  # a server that will not stop is cancelled
            self.task.cancel()
