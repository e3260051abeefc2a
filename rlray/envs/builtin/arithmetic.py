"""arithmetic: integer expressions with an exactly checked answer (single-turn).

Prompt `12+34=` (one user message), answer `46`. reward = 1 when the completion, stripped,
is exactly the answer, else 0. Operands are in [0, max_operand]; operators from `ops`.
Train and eval examples come from disjoint seeds. With `think=True` (reasoning models such as
GLM-4.5) a system prompt asks for the bare integer after the reasoning, and only the text after
the last `</think>` is compared.
"""

from __future__ import annotations

import random
from typing import Any

from rlray.envs.base import completion_text, exact_match


def problem(split: str, index: int, max_operand: int = 99, ops: str = "+-*", seed: int = 0) -> tuple[str, str]:
    rng = random.Random(f"arith:{seed}:{split}:{index}")
    a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a}{op}{b}=", str(value)


THINK_PROMPT = "Compute the expression. After your reasoning, reply with the integer result only."


def final_answer(completion: Any, answer: str, **_: Any) -> float:
    return float(completion_text(completion).rsplit("</think>", 1)[-1].strip() == answer)


def load_environment(max_operand: int = 99, ops: str = "+-*", seed: int = 0, num_train: int = 50_000,
                     num_eval: int = 1_000, think: bool = False, **kwargs: Any):
    import verifiers as vf
    from datasets import Dataset

    bad = set(ops) - set("+-*")
    if bad:
        raise ValueError(f"arithmetic: ops may hold + - * only, got {sorted(bad)}")

    def rows(split: str, n: int):
        def build() -> Dataset:
            problems = [problem(split, i, max_operand, ops, seed) for i in range(n)]
            return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q, _ in problems],
                                      "answer": [a for _, a in problems], "example_id": list(range(n))})
        return build

    rubric = vf.Rubric(funcs=[final_answer if think else exact_match], weights=[1.0])
    if think:
        kwargs.setdefault("system_prompt", THINK_PROMPT)
    return vf.SingleTurnEnv(dataset=rows("train", num_train), eval_dataset=rows("eval", num_eval), rubric=rubric,
                            **kwargs)
