"""The ids a chat template puts between two model turns, found without re-rendering the conversation.

Contract:
- `TurnBridge(tokenizer, chat_template)` studies the template once: `end_of_turn` is what it
  writes after an assistant message's content (Qwen's `<|im_end|>` + newline, the plain
  template's eos, nothing for GLM, whose next role marker ends the turn).
- `next_prompt(prompt_ids, completion_ids, new_messages, tools)` is the prompt of the next model
  turn, token in, token out: the previous turn's prompt ids, its sampled ids exactly as sampled,
  the rest of the template's end of turn (what follows the sampled stop token; all of it when the
  turn ended without one, on a stop string), then the template's rendering of only the new
  (user / tool) messages with the generation prompt. Earlier turns are never rendered again, so
  templates that rewrite them (Qwen3 and GLM-4.5 drop earlier reasoning) and decodings that
  do not re-encode to the sampled ids change nothing.
- The new messages are rendered after a stand-in assistant message (with one tool call per
  leading tool message, so templates that check tool-call ids accept it) whose own ids are cut
  off; a template that renders the stand-in differently once messages follow it raises
  `BridgeError`. A sampled stop token the template also writes at the start of the next message
  (GLM's `<|observation|>`) is not written twice.
"""

from __future__ import annotations

from typing import Any

from rlray.envs.base import render_prompt

STAND_IN = "x"  # the stand-in assistant's content: one character every vocabulary has
CACHE_SIZE = 4096


class BridgeError(ValueError):
    """The chat template cannot be split into turns."""


class TurnBridge:
    def __init__(self, tokenizer: Any, chat_template: str | None) -> None:
        self.tokenizer, self.template = tokenizer, chat_template
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.stop_ids = set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
        turn = self.render([self._assistant([])], None, generation_prompt=False)
        content = self.ids(STAND_IN)
        at = _rfind(turn, content)
        if at < 0:
            raise BridgeError(f"the chat template does not write an assistant message's content ('{STAND_IN}' "
                              f"rendered as {turn}); set env.chat_template to one that does")
        self.end_of_turn = turn[at + len(content):]
        self._cache: dict[str, list[int]] = {}  # bridges of recent new messages (games repeat their replies)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: list, tools: list | None, generation_prompt: bool) -> list[int]:
        return render_prompt(self.tokenizer, messages, self.template, tools, generation_prompt)

    def next_prompt(self, prompt_ids: list[int], completion_ids: list[int], new_messages: list,
                    tools: list | None = None) -> list[int]:
        if not new_messages:
            raise BridgeError("no new messages after the model's turn")
        bridge = self._bridge(new_messages, tools)
        last = completion_ids[-1] if completion_ids else None
        end = self.end_of_turn
        if last is not None and last in self.stop_ids:
            gap = end[end.index(last) + 1:] if last in end else []
            if not gap and bridge[:1] == [last]:
                bridge = bridge[1:]
        else:
            gap = end
        return [*prompt_ids, *completion_ids, *gap, *bridge]

    def _bridge(self, new_messages: list, tools: list | None) -> list[int]:
        """The template's ids for `new_messages` and the generation prompt, after an assistant turn."""
        key = repr((list(map(_plain, new_messages)), tools))
        if key not in self._cache:
            stand_in = self._assistant(_tool_call_ids(new_messages))
            base = self.render([stand_in], tools, generation_prompt=False)
            full = self.render([stand_in, *new_messages], tools, generation_prompt=True)
            if full[: len(base)] != base:
                raise BridgeError("the chat template renders an assistant message differently once messages "
                                  "follow it")
            if len(self._cache) >= CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = full[len(base):]
        return list(self._cache[key])

    @staticmethod
    def _assistant(tool_call_ids: list[str]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": STAND_IN, "reasoning_content": ""}
        if tool_call_ids:
            message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}}
                                     for i in tool_call_ids]
        return message


def _tool_call_ids(messages: list) -> list[str]:
    out = []
    for m in messages:
        if _get(m, "role") != "tool":
            break
        out.append(str(_get(m, "tool_call_id") or f"call_{len(out)}"))
    return out


def _plain(message: Any) -> Any:
    return dict(message) if isinstance(message, dict) else message


def _get(message: Any, key: str) -> Any:
    return message.get(key) if isinstance(message, dict) else getattr(message, key, None)


def _rfind(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub), -1, -1):
        if seq[i:i + len(sub)] == sub:
            return i
    return -1
