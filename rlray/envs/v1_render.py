"""The renderer rlray gives verifiers v1's TrainClient: the engine's chat template, token in, token out.

Contract: `TokenInRenderer` is renderers' `DefaultRenderer` (a Jinja chat template, here the one the rollout
engines serve, given as `chat_template` in its config) plus `bridge_to_next_turn`: turn k+1's prompt is
turn k's prompt and sampled ids exactly as sampled, then the template's ids for the new (user / tool)
messages only (rlray.envs.bridge.TurnBridge, the classic client's bridge). DefaultRenderer re-renders the
whole conversation every turn, so a sampled text that does not re-encode to its own ids (a special token
mid-answer, a truncated turn) would split the trace into two branches. New messages holding an assistant
message, or a template the bridge cannot split, fall back to that full re-render (`None`), as renderers'
contract asks.

Imported only inside the verifiers 0.4 interpreter of a v1 env actor (rlray.envs.v1_worker names it in a
`CustomRendererConfig`).
"""

from __future__ import annotations

from typing import Any

from renderers.base import RenderedTokens
from renderers.configs import DefaultRendererConfig
from renderers.default import DefaultRenderer

from rlray.envs.bridge import BridgeError, TurnBridge

IMPORT_PATH = "rlray.envs.v1_render.TokenInRenderer"


class TokenInRenderer(DefaultRenderer):
    config_class = DefaultRendererConfig

    def __init__(self, tokenizer: Any, config: DefaultRendererConfig | None = None) -> None:
        super().__init__(tokenizer, config)
        template = (self.config.model_extra or {}).get("chat_template")
        self.turns = TurnBridge(tokenizer, template)

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
