"""guess_number: find a hidden number from "higher" / "lower" replies, a multi-turn game.

Prompt `guess:1-8=` (one user message; the secret is not in it). Each model turn is a guess (the
first integer in its text); the environment answers `higher=` or `lower=` as a user message, or
`number?=` when the turn holds none (each reply ends with the prompt's `=`, the cue to guess), and
the rollout ends on the right guess or after `max_turns`.
reward = 0.5 found + 0.5 consistent: `found` is (max_turns - k + 1) / max_turns when the secret is
found on turn k, else 0; `consistent` is the fraction of guesses that lie inside the range the
replies so far leave open (the first inside low-high), the part of the skill the replies teach.
Binary search over 1-8 scores at least 0.625 on every secret; `solved` (found at all) is logged
with weight 0. Train and eval secrets come from disjoint seeds. `load_environment(...)` is a
verifiers `MultiTurnEnv`.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rlray.envs.base import message_text


def secret(split: str, index: int, low: int, high: int, seed: int) -> int:
    return random.Random(f"{seed}:{split}:{index}").randint(low, high)


def guess_of(text: str) -> int | None:
    found = re.search(r"\d+", text)
    return int(found.group()) if found else None


def reply(guess: int | None, answer: int) -> str:
    if guess is None:
        return "number?="
    return "correct" if guess == answer else ("higher=" if guess < answer else "lower=")


def consistency(guesses: list[int | None], answer: int, low: int, high: int) -> float:
    """The fraction of guesses inside the range still open after the replies to the earlier ones."""
    inside = 0
    for g in guesses:
        if g is not None and low <= g <= high:
            inside += 1
        if g is not None:
            low, high = (max(low, g + 1), high) if g < answer else (low, min(high, g - 1))
    return inside / len(guesses) if guesses else 0.0


def _guesses(completion: Any) -> list[int | None]:
    return [guess_of(message_text(m)) for m in completion or []
            if (m.get("role") if isinstance(m, dict) else getattr(m, "role", None)) == "assistant"]


def load_environment(low: int = 1, high: int = 8, max_turns: int = 4, seed: int = 0, num_train: int = 10_000,
                     num_eval: int = 256, **kwargs: Any):
    import verifiers as vf
    from datasets import Dataset

    def rows(split: str, n: int):
        def build() -> Dataset:
            return Dataset.from_dict({
                "prompt": [[{"role": "user", "content": f"guess:{low}-{high}="}]] * n,
                "answer": [str(secret(split, i, low, high, seed)) for i in range(n)],
                "example_id": list(range(n))})
        return build

    def found(completion: Any, answer: str, **_: Any) -> float:
        guesses = _guesses(completion)
        hit = next((k for k, g in enumerate(guesses) if g == int(answer)), None)
        return 0.0 if hit is None else (max_turns - hit) / max_turns

    def consistent(completion: Any, answer: str, **_: Any) -> float:
        return consistency(_guesses(completion), int(answer), low, high)

    def solved(completion: Any, answer: str, **_: Any) -> float:
        return float(int(answer) in _guesses(completion))

    def turns(completion: Any, **_: Any) -> float:
        return float(len(_guesses(completion)))

    class GuessNumber(vf.MultiTurnEnv):
        async def env_response(self, messages: Any, state: Any, **_: Any) -> Any:
            said = reply(guess_of(message_text(messages[-1])), int(state["answer"]))
            if said == "correct":
                state["final_env_response"] = [vf.UserMessage(content=said)]
                return []
            return [vf.UserMessage(content=said)]

    rubric = vf.Rubric(funcs=[found, consistent, solved, turns], weights=[0.5, 0.5, 0.0, 0.0])
    return GuessNumber(dataset=rows("train", num_train), eval_dataset=rows("eval", num_eval), rubric=rubric,
                       max_turns=max_turns, **kwargs)
