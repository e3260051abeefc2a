"""TokenInClient without an engine: what it sends vLLM's routes on a later turn, from a recorded fake."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlray.actors.server import PLAIN_CHAT_TEMPLATE
from rlray.data.tokenizer import char_tokenizer
from rlray.envs.bridge import TurnBridge
from rlray.envs.client import TURN_SEED_STRIDE, make_clients

TOK = char_tokenizer()
EOS, BOS = TOK.eos_token_id, TOK.bos_token_id


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class FakeRoutes:
    """Answers render and generate like vLLM's scale-out routes, and records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    async def post(self, path: str, *, body: dict, cast_to: Any) -> dict:
        self.calls.append((path, body))
        if path.endswith("/chat/completions/render"):
            return {"request_id": "chatcmpl-1", "token_ids": [BOS], "sampling_params": {"max_tokens": 8, "seed": 5}}
        assert path.endswith("/inference/v1/generate")
        return {"request_id": f"generate-tokens-{body['request_id']}", "usage": None,
                "choices": [{"index": 0, "token_ids": [*ids("7"), EOS], "finish_reason": "stop",
                             "logprobs": {"content": [{"token_id": 0, "logprob": -0.5}, {"token_id": 0, "logprob": -0.1}]}}]}


def client(max_model_len: int = 64) -> tuple[Any, FakeRoutes]:
    (c,) = make_clients("http://rlray.invalid/v1", 5.0, TurnBridge(TOK, PLAIN_CHAT_TEMPLATE), max_model_len, n=1)
    fake = FakeRoutes()
    c.client.post = fake.post
    return c, fake


def turn(prompt: list[int], completion: list[int], messages: list[dict], answer: str) -> dict:
    """A trajectory step as verifiers records it: the turn's whole prompt, its answer, their ids."""
    import verifiers as vf

    kinds = {"user": vf.UserMessage, "assistant": vf.AssistantMessage}
    return {"prompt": [kinds[m["role"]](content=m["content"]) for m in messages],
            "completion": [vf.AssistantMessage(content=answer)],
            "tokens": {"prompt_ids": prompt, "completion_ids": completion}}


def test_a_later_turn_sends_the_sampled_ids_and_a_new_seed() -> None:
    c, fake = client()
    first_prompt, first = [BOS, *ids("guess:1-8=")], [*ids("3"), EOS]
    messages = [{"role": "user", "content": "guess:1-8="}, {"role": "assistant", "content": "3"},
                {"role": "user", "content": "higher="}]
    state = {"trajectory": [turn(first_prompt, first, messages[:1], "3")]}
    out = asyncio.run(c.get_native_response(messages, "rlray", {"max_tokens": 4, "seed": 5}, state=state))
    (render_path, render), (gen_path, gen) = fake.calls
    assert render_path.endswith("/chat/completions/render") and gen_path.endswith("/inference/v1/generate")
    assert render["messages"] == messages and render["max_completion_tokens"] == 4
    expected = [*first_prompt, *first, *ids("higher=")]  # sampled ids as sampled, then only the new message
    assert gen["token_ids"] == expected
    assert gen["sampling_params"] == {"max_tokens": 8, "seed": 5 + TURN_SEED_STRIDE}
    assert out.prompt_token_ids == expected and out.choices[0].token_ids == [*ids("7"), EOS]
    assert [x.logprob for x in out.choices[0].logprobs.content] == [-0.5, -0.1]
    assert out.choices[0].message.content == "7" and out.id == "generate-tokens-chatcmpl-1-1"

    state["trajectory"].append(turn(expected, [*ids("7"), EOS], messages, "7"))
    more = [*messages, {"role": "assistant", "content": "7"}, {"role": "user", "content": "lower="}]
    asyncio.run(c.get_native_response(more, "rlray", {"max_tokens": 4, "seed": 5}, state=state))
    assert [p.rsplit("/", 1)[-1] for p, _ in fake.calls] == ["render", "generate", "generate"]  # one render
    assert fake.calls[-1][1]["sampling_params"]["seed"] == 5 + 2 * TURN_SEED_STRIDE


def test_the_context_window_caps_max_tokens_and_then_ends_the_rollout() -> None:
    import verifiers as vf

    first_prompt, first = [BOS, *ids("guess:1-8=")], [*ids("3"), EOS]
    messages = [{"role": "user", "content": "guess:1-8="}, {"role": "assistant", "content": "3"},
                {"role": "user", "content": "higher="}]
    room = len(first_prompt) + len(first) + len(ids("higher="))
    c, fake = client(max_model_len=room + 3)
    state = {"trajectory": [turn(first_prompt, first, messages[:1], "3")]}
    asyncio.run(c.get_native_response(messages, "rlray", {"max_tokens": 4}, state=state))
    assert fake.calls[-1][1]["sampling_params"]["max_tokens"] == 3
    c, fake = client(max_model_len=room)
    state = {"trajectory": [turn(first_prompt, first, messages[:1], "3")]}
    with pytest.raises(vf.OverlongPromptError, match="rollout.max_model_len"):
        asyncio.run(c.get_native_response(messages, "rlray", {"max_tokens": 4}, state=state))
    assert fake.calls == []
