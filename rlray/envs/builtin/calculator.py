"""calculator: a multi-turn tool environment; the model may call `calc(expression)` before answering.

Prompt `c:37*23+5=` (one user message), answer `856`. The environment is a verifiers
`ToolEnv` with one tool, `calc`, which evaluates an integer expression of + - * and
parentheses; the model calls it through the OpenAI tool-call API (served by the rollout
actor's endpoint; the tiny character-level models write `calc(37*23)`, which the `rlray`
tool-call parser turns into a tool call) and gets the value back as a tool message. The
rollout ends when the model answers without a tool call, or after `max_turns` turns.
reward = 1 when the last assistant message, stripped, is exactly the answer, else 0; the
number of tool calls is a metric. `force_tool_format=True` constrains every turn to the
`calc(...)` syntax (vLLM structured outputs), so that even an untrained model exercises
the tool path (tests).
"""

from __future__ import annotations

import ast
import operator
import random
from typing import Any

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError(f"not allowed: {type(node).__name__}")


def calc(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: integers combined with + - * and parentheses, e.g. 37*23+5
    """
    try:
        if len(expression) > 64:
            raise ValueError
        return str(_eval(ast.parse(expression.strip(), mode="eval")))
    except (SyntaxError, ValueError, TypeError, RecursionError):
        raise ValueError("invalid expression") from None  # short: tool results share the context window


def problem(split: str, index: int, seed: int = 0) -> tuple[str, str]:
    rng = random.Random(f"calc:{seed}:{split}:{index}")
    a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(0, 99)
    return f"c:{a}*{b}+{c}=", str(a * b + c)


def _last_assistant_text(completion: Any) -> str:
    for m in reversed(completion or []):
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        if role == "assistant":
            content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
            return content if isinstance(content, str) else ""
    return ""


def correct_answer(completion: Any, answer: str, **_: Any) -> float:
    return float(_last_assistant_text(completion).strip() == answer)


def load_environment(max_turns: int = 3, seed: int = 0, num_train: int = 10_000, num_eval: int = 500,
                     force_tool_format: bool = False, **kwargs: Any):
    import verifiers as vf
    from datasets import Dataset

    def rows(split: str, n: int):
        def build() -> Dataset:
            problems = [problem(split, i, seed) for i in range(n)]
            return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q, _ in problems],
                                      "answer": [a for _, a in problems], "example_id": list(range(n))})
        return build

    sampling_args = dict(kwargs.pop("sampling_args", None) or {})
    if force_tool_format:
        sampling_args["extra_body"] = {**sampling_args.get("extra_body", {}),
                                       "structured_outputs": {"regex": r"calc\([0-9+*-]{1,8}\)"}}
    rubric = vf.Rubric(funcs=[correct_answer], weights=[1.0])
    return vf.ToolEnv(tools=[calc], max_turns=max_turns, dataset=rows("train", num_train),
                      eval_dataset=rows("eval", num_eval), rubric=rubric, sampling_args=sampling_args, **kwargs)
