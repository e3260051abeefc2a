"""Environments: where prompts come from and how completions are rewarded.

Contract: an environment has an `id`, `example(split, index) -> Example` (deterministic
for a given split and index; split is "train" or "eval") and
`score(completion_text, example) -> (reward, parts)`. `load_env(id, args)` finds a
built-in environment by id.
"""

from __future__ import annotations

from typing import Any, Protocol

from rlray.envs.base import Example


class Env(Protocol):
    id: str

    def example(self, split: str, index: int) -> Example: ...

    def score(self, completion: str, example: Example) -> tuple[float, dict[str, float]]: ...


def load_env(env_id: str, args: dict[str, Any] | None = None) -> Env:
    from rlray.envs.reverse_text import ReverseText

    builtin = {"reverse_text": ReverseText}
    if env_id not in builtin:
        raise ValueError(f"env.id='{env_id}' is not a known environment; built-in: {sorted(builtin)}")
    return builtin[env_id](**(args or {}))
