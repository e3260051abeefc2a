"""SFT examples in the format RL and eval use: chat-templated prompts drawn from `env.mix`.

Contract: `SFTData(envs, tokenizer, chat_template, seed, vision=None)` over `load_envs(cfg)`'s weighted
environments. `batch(step, n)` returns the `n` training `Sample`s of SFT step `step`: each
from an environment drawn by weight (a generator seeded by `seed` and `step`, so a step's
draws do not depend on earlier calls), that environment's train rows in order (row
`step * n + i` of the draws that chose it so far, counted per environment); the prompt ids
are `render_prompt` of the row's prompt messages with the chat template the rollout engines
serve (what RL and eval sample from), the target is the row's answer then eos, all of it
trained (loss mask 1). A row with a `solution` (a list of chat messages after the prompt: assistant turns,
tool calls among them, and the tool / user messages between them) is a multi-turn episode instead, rendered
as RL's token-in path would build it (rlray.envs.bridge.TurnBridge), with the env's `tools` (a v1 env's
harness tools) in the template: each assistant turn is the ids the template writes for it up to its first
stop token, trained; what comes between turns (the tool output, the next turn's header) is in the sequence
with loss mask 0. A vision-language model's prompts render with its processor (`vision`:
rlray.envs.images.VisionPrompt, as the rollout actors do) and the samples carry their images.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np

from rlray.data.packing import Sample
from rlray.envs.base import Env, render_prompt
from rlray.envs.bridge import BridgeError, TurnBridge
from rlray.envs.images import VisionPrompt


class SFTData:
    def __init__(self, envs: list[tuple[Env, float]], tokenizer: Any, chat_template: str | None, seed: int,
                 vision: VisionPrompt | None = None) -> None:
        self.envs = [e for e, _ in envs]
        self.weights = [w for _, w in envs]
        self.tokenizer, self.chat_template, self.seed, self.vision = tokenizer, chat_template, seed, vision
        self._bridge: TurnBridge | None = None

    def draws(self, step: int, n: int) -> list[tuple[Env, int]]:
        """(environment, train row index) of each sample of step `step`."""
        counts = {e.id: 0 for e in self.envs}
        out = []
        for s in range(step + 1):  # row indices continue each environment's own sequence
            rng = random.Random(f"{self.seed}:sft:{s}")
            chosen = rng.choices(self.envs, self.weights, k=n) if len(self.envs) > 1 else self.envs * n
            for env in chosen:
                if s == step:
                    out.append((env, counts[env.id]))
                counts[env.id] += 1
        return out

    def sample(self, env: Env, index: int) -> Sample:
        row = env.row("train", index)
        if row.get("solution"):
            return self.episode(row["prompt"], row["solution"], getattr(env, "tools", None))
        images = None
        if self.vision is not None:
            prompt, _, images = self.vision.render(row.get("prompt") or [])
        else:
            prompt = render_prompt(self.tokenizer, row.get("prompt") or [], self.chat_template)
        answer = row.get("answer", "")
        target = list(self.tokenizer(str(answer), add_special_tokens=False)["input_ids"])
        target.append(self.tokenizer.eos_token_id)
        return Sample(np.asarray(prompt), np.asarray(target), np.ones(len(target), np.float32), 0.0,
                      np.zeros(len(target), np.float32), images=images)

    def batch(self, step: int, n: int) -> list[Sample]:
        return [self.sample(env, i) for env, i in self.draws(step, n)]

    def episode(self, prompt: list[dict], solution: list[dict], tools: list | None) -> Sample:
        """The multi-turn sample of `prompt` then `solution` (the assistant turns trained, the rest masked)."""
        if self._bridge is None:
            self._bridge = TurnBridge(self.tokenizer, self.chat_template)
        bridge, history = self._bridge, [dict(m) for m in prompt]
        prompt_ids = bridge.render(history, tools, generation_prompt=True)
        first, mask, completion, pending = len(prompt_ids), [0] * len(prompt_ids), None, []
        for message in map(_plain_args, solution):
            if message.get("role") != "assistant":
                pending.append(message)
            else:
                if (completion is None) != (not pending):
                    raise ValueError("a solution starts with an assistant turn and has a message between each two")
                if completion is not None:
                    prompt_ids = bridge.next_prompt(prompt_ids, completion, pending, tools)
                    mask += [0] * (len(prompt_ids) - len(mask))
                completion = self._turn_ids(history + pending, message, tools)
                mask += [1] * len(completion)
                history += [*pending, message]
                pending = []
        if completion is None:
            raise ValueError("a solution without an assistant turn")
        ids = [*prompt_ids, *completion]
        return Sample(np.asarray(ids[:first]), np.asarray(ids[first:]), np.asarray(mask[first:], np.float32), 0.0,
                      np.zeros(len(ids) - first, np.float32))

    def _turn_ids(self, history: list[dict], message: dict, tools: list | None) -> list[int]:
        """What the model samples for assistant `message` after `history`: the template's ids for it up to its
        first stop token."""
        assert self._bridge is not None
        before = self._bridge.render(history, tools, generation_prompt=True)
        after = self._bridge.render([*history, message], tools, generation_prompt=False)
        if after[: len(before)] != before:
            raise BridgeError("the chat template renders the conversation differently once an assistant turn follows")
        ids = after[len(before):]
        stop = next((i for i, t in enumerate(ids) if t in self._bridge.stop_ids), None)
        return ids if stop is None else ids[: stop + 1]


def _plain_args(message: dict) -> dict:
    """`message` with its tool calls' JSON arguments as mappings (what chat templates render)."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    plain = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
             if isinstance(c["function"].get("arguments"), str) else c for c in calls]
    return {**message, "tool_calls": plain}
