"""SFT examples in the format RL and eval use: chat-templated prompts drawn from `env.mix`.

Contract: `SFTData(envs, tokenizer, chat_template, seed, vision=None)` over `load_envs(cfg)`'s weighted
environments. `batch(step, n)` returns the `n` training `Sample`s of SFT step `step`: each
from an environment drawn by weight (a generator seeded by `seed` and `step`, so a step's
draws do not depend on earlier calls), that environment's train rows in order (row
`step * n + i` of the draws that chose it so far, counted per environment); the prompt ids
are `render_prompt` of the row's prompt messages with the chat template the rollout engines
serve (what RL and eval sample from), the target is the row's answer then eos, all of it
trained (loss mask 1). A vision-language model's prompts render with its processor (`vision`:
rlray.envs.images.VisionPrompt, as the rollout actors do) and the samples carry their images.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from rlray.data.packing import Sample
from rlray.envs.base import Env, render_prompt
from rlray.envs.images import VisionPrompt


class SFTData:
    def __init__(self, envs: list[tuple[Env, float]], tokenizer: Any, chat_template: str | None, seed: int,
                 vision: VisionPrompt | None = None) -> None:
        self.envs = [e for e, _ in envs]
        self.weights = [w for _, w in envs]
        self.tokenizer, self.chat_template, self.seed, self.vision = tokenizer, chat_template, seed, vision

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
