"""reverse_text: reverse a short lowercase string; reward is an LCS similarity.

Prompt `rev:hello=`, answer `olleh`. reward = LCS(completion, answer) / max(len(completion), len(answer)),
in [0, 1], 1 only for the exact reversal. Train and eval examples come from disjoint seeds.
"""

from __future__ import annotations

import random
import string

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

    def example(self, split: str, index: int) -> Example:
        if split not in ("train", "eval"):
            raise ValueError(f"split='{split}'; reverse_text has train and eval")
        rng = random.Random(f"{self.seed}:{split}:{index}")
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(self.min_len, self.max_len)))
        return Example(index=index, prompt=f"rev:{word}=", answer=word[::-1])

    def score(self, completion: str, example: Example) -> tuple[float, dict[str, float]]:
        r = lcs_ratio(completion.strip(), example.answer)
        return r, {"lcs_ratio": r, "exact": float(completion.strip() == example.answer)}
