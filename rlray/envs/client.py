"""The verifiers client rlray hands environments: token in, token out, over vLLM's own HTTP routes.

Contract:
- `make_clients(base_url, timeout_s, bridge, max_model_len)` returns verifiers chat clients of an
  rlray endpoint (`rlray.actors.server`), several small connection pools (httpx's pool costs
  O(connections x waiting requests) per request).
- A rollout's first turn is a plain chat completion: the endpoint renders the prompt with its
  chat template and returns the prompt and completion ids. Every later turn is token in: the
  prompt ids are `bridge.next_prompt(...)` of the previous turn's ids and the new messages
  (`rlray.envs.bridge`), sent to the engine as ids through vLLM's scale-out routes
  (`/v1/chat/completions/render` once per rollout, for the sampling parameters the chat route
  would use; `/inference/v1/generate` with the ids in place of the rendered ones; with tools,
  `/v1/chat/completions/derender` for the message, tool calls parsed as the chat route parses
  them, else the tokenizer's decoding as the chat route decodes; the ids and logprobs are the
  generate route's own). The environment and the rubric
  still see decoded messages, as verifiers expects.
- A turn after a conversation whose messages do not extend the previous turn's (an environment
  that rewrites its history) falls back to a plain chat completion: the env runner's
  `TokenMismatch` guard then decides whether its ids still line up.
- A seeded rollout (`seed` in its sampling args) samples turn k (from 0) with seed
  `seed + TURN_SEED_STRIDE * k`: every turn reusing one seed would replay the same random draws.
- `max_tokens` is cut to what `max_model_len` leaves; a prompt that leaves nothing raises
  verifiers' `OverlongPromptError`, which ends the rollout (`prompt_too_long`), never an
  engine error.
- An empty completion is a valid (bad) answer: an empty assistant message.
- Images (a vision-language model: `vision`, rlray.envs.images.VisionPrompt): the first turn's image
  parts go through the chat route as they are. A later turn renders the new messages' image parts as
  the family's placeholder, expanded to each image's size, and sends the ids with vLLM's `features`:
  each image processed once per rollout by the render route (hash, tensors, placeholder count) and
  placed at the runs of image pads the environment wrote. vLLM's token-in `content_parts` would
  expand every image pad in the ids, also one the model sampled (a random model does). Images for a
  text-only model, more than `max_images` or placeholders that do not match raise `ImageError`.
"""

from __future__ import annotations

import copy
from typing import Any

from rlray.envs.bridge import TurnBridge
from rlray.envs.images import ImageError, VisionPrompt, encode_png, has_images, split_images
from rlray.models.vision import placeholder_spans

_ROLE_KEYS = ("role", "content", "tool_calls", "tool_call_id")
TURN_SEED_STRIDE = 1_000_003


def make_clients(base_url: str, timeout_s: float, bridge: TurnBridge, max_model_len: int, n: int = 8,
                 connections: int = 16, vision: VisionPrompt | None = None) -> list[Any]:
    import httpx
    from openai import AsyncOpenAI

    cls = client_class()

    def one() -> Any:
        http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s),
                                 limits=httpx.Limits(max_connections=connections,
                                                     max_keepalive_connections=connections))
        client = cls(AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, http_client=http))
        client.bridge, client.max_model_len, client.vision = bridge, max_model_len, vision
        return client

    return [one() for _ in range(n)]


def client_class() -> type:
    import verifiers as vf
    from openai.types.chat import ChatCompletion
    from verifiers.clients.openai_chat_completions_client import handle_openai_overlong_prompt

    class TokenInClient(vf.OpenAIChatCompletionsClient):
        bridge: TurnBridge
        max_model_len: int
        vision: VisionPrompt | None

        async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                      **kwargs: Any) -> Any:
            state = kwargs.get("state")
            steps = [s for s in (state or {}).get("trajectory") or [] if s.get("tokens") is not None]
            new = await self._new_messages(steps[-1], prompt) if steps else None
            if new is None:
                return await super().get_native_response(prompt, model, sampling_args, tools, **kwargs)
            tokens = steps[-1]["tokens"]
            features = None
            if has_images(prompt):
                new, _ = split_images(new)
            ids = self.bridge.next_prompt(list(tokens["prompt_ids"]), list(tokens["completion_ids"]), new, tools)
            if has_images(prompt):
                ids, features = await self._image_turn(ids, steps, prompt, model, state)
            return ChatCompletion.construct(**await self._generate(ids, prompt, model, sampling_args, tools, state,
                                                                   features))

        async def _image_turn(self, ids: list[int], steps: list, prompt: list, model: str,
                              state: Any) -> tuple[list[int], dict[str, Any]]:
            """`ids` with the new images' pads expanded, and the generate request's `features`: every
            image's vLLM-processed tensors (one render per image per rollout) at its placeholders, the
            runs of image pads the environment wrote (a pad the model sampled is a plain token)."""
            if self.vision is None:
                raise ImageError("the conversation has images but the model is text-only: model.name must be "
                                 "a vision-language model for this environment")
            _, images = split_images(prompt)
            if len(images) > self.vision.max_images:
                raise ImageError(f"the conversation has {len(images)} images, over the engine's limit of "
                                 f"{self.vision.max_images} (rollout.max_images)")
            items = state.setdefault("rlray_images", [])  # [hash, tensors, placeholder count] per image so far
            new = len(images) - len(items)
            if new > 0:
                items += await self._render_images(images[len(items):], model)
            tokens = steps[-1]["tokens"]
            base = len(tokens["prompt_ids"]) + len(tokens["completion_ids"])
            tail, counts = [], iter(n for _, _, n in items[len(items) - new:])
            for i in ids[base:]:
                tail += [i] * (next(counts, 1) if i == self.vision.pad else 1)
            ids = [*ids[:base], *tail]
            sampled = [False] * len(ids)
            for step in steps:
                start = len(step["tokens"]["prompt_ids"])
                sampled[start:start + len(step["tokens"]["completion_ids"])] = [True] * len(
                    step["tokens"]["completion_ids"])
            spans = placeholder_spans([-1 if s else i for i, s in zip(ids, sampled)], self.vision.pad).tolist()
            if [n for _, n in spans] != [n for _, _, n in items]:
                raise ImageError(f"the conversation's image placeholders {[n for _, n in spans]} do not match its "
                                 f"{len(items)} images' sizes {[n for _, _, n in items]}")
            return ids, {"mm_hashes": {"image": [h for h, _, _ in items]},
                         "mm_placeholders": {"image": [{"offset": o, "length": n} for o, n in spans]},
                         "kwargs_data": {"image": [k for _, k, _ in items]}}

        async def _render_images(self, images: list[Any], model: str) -> list[list]:
            """vLLM's processing of `images`: per image its hash, serialized tensors and placeholder count."""
            parts = [{"type": "image_url", "image_url": {"url": encode_png(i)}} for i in images]
            out = await self.client.post("/chat/completions/render", cast_to=object, body={
                "model": model, "messages": [{"role": "user", "content": parts}], "mm_payload": "tensors"})
            f = out["features"]
            return [[h, k, p["length"]] for h, k, p in zip(f["mm_hashes"]["image"], f["kwargs_data"]["image"],
                                                            f["mm_placeholders"]["image"], strict=True)]

        async def _new_messages(self, step: Any, prompt: list) -> list | None:
            """The messages after the previous turn's prompt + completion; None if `prompt` does not extend them."""
            before, _ = await self.to_native_prompt([*step["prompt"], *step["completion"]])
            if len(prompt) <= len(before) or any(_key(a) != _key(b) for a, b in zip(before, prompt)):
                return None
            return list(prompt[len(before):])

        @handle_openai_overlong_prompt
        async def _generate(self, ids: list[int], prompt: list, model: str, sampling_args: Any,
                            tools: Any, state: Any, features: dict[str, Any] | None) -> dict[str, Any]:
            if len(ids) >= self.max_model_len:
                raise vf.OverlongPromptError(f"the conversation reached rollout.max_model_len={self.max_model_len} "
                                             f"({len(ids)} tokens)")
            body = _chat_body(prompt, model, sampling_args, tools)
            if "rlray_generate" not in state:  # one rollout's turns share their sampling parameters
                render = {**body, "mm_payload": "none"} if features else body  # images go with each turn
                state["rlray_generate"] = await self.client.post("/chat/completions/render", body=render,
                                                                 cast_to=object)
            request = copy.deepcopy(state["rlray_generate"])
            request.pop("features", None)
            params = request["sampling_params"]
            room = self.max_model_len - len(ids)
            params["max_tokens"] = min(params.get("max_tokens") or room, room)
            request["token_ids"] = ids
            if features:
                request["features"] = features
            turn = len(state["trajectory"])
            request["request_id"] = f"{request['request_id']}-{turn}"
            if params.get("seed") is not None:  # a replay of turn 1's random draws would repeat its choices
                params["seed"] = (params["seed"] + TURN_SEED_STRIDE * turn) % 2**31
            root = str(self.client.base_url).rstrip("/").removesuffix("/v1")
            generated = await self.client.post(f"{root}/inference/v1/generate", body=request, cast_to=object)
            choice = generated["choices"][0]
            out_ids, logprobs = list(choice["token_ids"]), list(choice["logprobs"]["content"])
            message = await self._message(generated, choice, out_ids, logprobs, body, ids, model)
            finish = choice["finish_reason"]
            if message.get("tool_calls") and finish == "stop":
                finish = "tool_calls"  # as the chat route reports it
            return {"id": generated["request_id"], "object": "chat.completion", "created": generated.get("created") or 0,
                    "model": model, "usage": generated.get("usage"),
                    "prompt_token_ids": ids,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish, "token_ids": out_ids,
                                 "logprobs": {"content": [{"token": "", "logprob": c["logprob"], "bytes": None,
                                                           "top_logprobs": []} for c in logprobs]}}]}

        async def _message(self, generated: dict, choice: dict, out_ids: list[int], logprobs: list, body: dict,
                           ids: list[int], model: str) -> dict[str, Any]:
            """The assistant message of the sampled ids, parsed by vLLM's derender route. The stop token is
            left out of what it decodes, as the chat route leaves it out of the text."""
            text_ids = out_ids[:-1] if out_ids and out_ids[-1] in self.bridge.stop_ids else out_ids
            if not text_ids or not body.get("tools"):  # nothing to parse: the chat route's own decoding
                return {"role": "assistant",
                        "content": self.bridge.tokenizer.decode(text_ids, skip_special_tokens=True)}
            trimmed = {**generated, "choices": [{**choice, "token_ids": text_ids,
                                                 "logprobs": {"content": logprobs[: len(text_ids)]}}]}
            out = await self.client.post("/chat/completions/derender", cast_to=object, body={
                "generate_response": trimmed, "chat_request": body, "prompt_token_ids": ids, "model": model})
            return out["choices"][0]["message"]

        async def raise_from_native_response(self, response: Any) -> None:
            if response is None or not response.choices:
                raise vf.EmptyModelResponseError("the endpoint returned no choices")

        async def from_native_response(self, response: Any) -> Any:
            out = await super().from_native_response(response)
            if out.message.content is None and not out.message.tool_calls:
                out.message.content = ""
            return out

    return TokenInClient


def _key(message: Any) -> tuple:
    get = message.get if isinstance(message, dict) else lambda k: getattr(message, k, None)
    return tuple(str(get(k) or "") for k in _ROLE_KEYS)


def _chat_body(prompt: list, model: str, sampling_args: Any, tools: Any) -> dict[str, Any]:
    """The chat-completions body verifiers' client would send for this turn."""
    args = {k: v for k, v in dict(sampling_args).items() if v is not None}
    if "max_tokens" in args:
        args["max_completion_tokens"] = args.pop("max_tokens")
    extra = args.pop("extra_body", None) or {}
    body = {"model": model, "messages": prompt, **args, **extra}
    if tools:
        body["tools"] = tools
    return body
