"""reverse_text: reverse a short lowercase string; reward is an LCS similarity. The default recipe's task.

Prompt `rev:hello=` (one user message), answer `olleh`.
reward = LCS(completion, answer) / max(len(completion), len(answer)), in [0, 1], 1 only for the
exact reversal. Train and eval examples come from disjoint seeds; example i of a split is the
same string on every node. `load_environment(...)` is the verifiers `SingleTurnEnv` (loaded by
`env.id=reverse_text` like any environment); `ReverseText` is the same task as plain functions.
"""

from __future__ import annotations

import random
import string
from typing import Any

from rlray.envs.base import Example


def lcs(a: str, b: str) -> int:
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_ratio(completion: str, answer: str) -> float:
    denom = max(len(completion), len(answer))
    return lcs(completion, answer) / denom if denom else 1.0


class ReverseText:
    id = "reverse_text"

    def __init__(self, min_len: int = 3, max_len: int = 8, seed: int = 0) -> None:
        self.min_len, self.max_len, self.seed = min_len, max_len, seed

    def word(self, split: str, index: int) -> str:
        if split not in ("train", "eval"):
            raise ValueError(f"split='{split}'; reverse_text has train and eval")
        rng = random.Random(f"{self.seed}:{split}:{index}")
        return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(self.min_len, self.max_len)))

    def example(self, split: str, index: int) -> Example:
        word = self.word(split, index)
        return Example(index=index, prompt=f"rev:{word}=", answer=word[::-1])

    def score(self, completion: str, example: Example) -> tuple[float, dict[str, float]]:
        r = lcs_ratio(completion.strip(), example.answer)
        return r, {"lcs_ratio": r, "exact": float(completion.strip() == example.answer)}


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    texts = [m.get("content") if isinstance(m, dict) else getattr(m, "content", None) for m in completion or []]
    return "".join(t for t in texts if isinstance(t, str))


def lcs_reward(completion: Any, answer: str, **_: Any) -> float:
    return lcs_ratio(_completion_text(completion).strip(), answer)


def exact(completion: Any, answer: str, **_: Any) -> float:
    return float(_completion_text(completion).strip() == answer)


def load_environment(min_len: int = 3, max_len: int = 8, seed: int = 0, num_train: int = 50_000,
                     num_eval: int = 1_000, **kwargs: Any):
    import verifiers as vf
    from datasets import Dataset

    task = ReverseText(min_len, max_len, seed)

    def rows(split: str, n: int):
        def build() -> Dataset:
            examples = [task.example(split, i) for i in range(n)]
            return Dataset.from_dict({"prompt": [[{"role": "user", "content": e.prompt}] for e in examples],
                                      "answer": [e.answer for e in examples],
                                      "example_id": list(range(n))})
        return build

    rubric = vf.Rubric(funcs=[lcs_reward, exact], weights=[1.0, 0.0])
    return vf.SingleTurnEnv(dataset=rows("train", num_train), eval_dataset=rows("eval", num_eval), rubric=rubric,
                            **kwargs)
