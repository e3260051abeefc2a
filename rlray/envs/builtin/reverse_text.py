"""reverse_text: reverse a short lowercase string; reward is an LCS similarity. The default recipe's task.

Prompt `rev:hello=` (one user message), answer `olleh`.
reward = LCS(completion, answer) / max(len(completion), len(answer)), in [0, 1], 1 only for the
exact reversal. Train and eval examples come from disjoint seeds; example i of a split is the
same string on every node. `load_environment(...)` is the verifiers `SingleTurnEnv` (loaded by
`env.id=reverse_text` like any environment); `ReverseText` is the same task as plain functions.
With `turns=T > 1` it is a `MultiTurnEnv`: after each answer the environment sends the next word
(`rev:world=`), T words in all, and the reward is the mean LCS ratio of the T answers (an answer
never given scores 0); the row's `answer` is the first word's reversal.
"""

from __future__ import annotations

import random
import string
from typing import Any

from rlray.envs.base import Example, completion_text, exact_match


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


def lcs_reward(completion: Any, answer: str, **_: Any) -> float:
    return lcs_ratio(completion_text(completion).strip(), answer)


def _answers(completion: Any) -> list[str]:
    return [completion_text([m]).strip() for m in completion or []
            if (m.get("role") if isinstance(m, dict) else getattr(m, "role", None)) == "assistant"]


def chain_lcs(completion: Any, info: dict, **_: Any) -> float:
    words = info["words"]
    answers = _answers(completion)
    return sum(lcs_ratio(a, w[::-1]) for a, w in zip(answers, words)) / len(words)


def load_environment(min_len: int = 3, max_len: int = 8, seed: int = 0, num_train: int = 50_000,
                     num_eval: int = 1_000, turns: int = 1, **kwargs: Any):
    import verifiers as vf
    from datasets import Dataset

    task = ReverseText(min_len, max_len, seed)

    def rows(split: str, n: int):
        def build() -> Dataset:
            examples = [task.example(split, i) for i in range(n)]
            data = {"prompt": [[{"role": "user", "content": e.prompt}] for e in examples],
                    "answer": [e.answer for e in examples], "example_id": list(range(n))}
            if turns > 1:  # the later words of example i: words n + (turns - 1) i + ...
                data["info"] = [{"words": [task.word(split, i)] + [task.word(split, n + (turns - 1) * i + t)
                                                                    for t in range(turns - 1)]} for i in range(n)]
            return Dataset.from_dict(data)
        return build

    if turns == 1:
        rubric = vf.Rubric(funcs=[lcs_reward, exact_match], weights=[1.0, 0.0])
        return vf.SingleTurnEnv(dataset=rows("train", num_train), eval_dataset=rows("eval", num_eval),
                                rubric=rubric, **kwargs)

    class ReverseChain(vf.MultiTurnEnv):
        async def env_response(self, messages: Any, state: Any, **_: Any) -> Any:
            done = len(_answers(messages))
            return [vf.UserMessage(content=f"rev:{state['info']['words'][done]}=")]

    return ReverseChain(dataset=rows("train", num_train), eval_dataset=rows("eval", num_eval), max_turns=turns,
                        rubric=vf.Rubric(funcs=[chain_lcs]), **kwargs)
