"""rlray's handle on one verifiers environment, and the example record.

Contract:
- `Env(id, vf_env)` wraps a loaded `verifiers.Environment`. `row(split, index)` is the
  dataset row (a verifiers `RolloutInput`: prompt messages, answer, info, example_id) of
  split "train" (the env's dataset) or "eval" (its eval dataset, else its dataset), index
  taken modulo the split's size; `num_examples(split)` is that size.
- `example(split, index) -> Example`: the same row as text, for SFT and logs: `prompt` is
  every prompt message's text joined (what the plain chat template renders after bos),
  `answer` the row's answer.
- `fast_path_ok` is True for plain single-turn environments (no tools, no overridden
  rollout hooks): their rollouts can skip HTTP and sample through the engine directly.
- `render_prompt(tokenizer, messages, chat_template)`: prompt ids as the engine's endpoint
  renders them (the chat template with its generation prompt, no extra special tokens);
  RL, eval and SFT all build prompts with it.
- `completion_text(completion)` and `exact_match(completion, answer)` (a reward) serve the
  built-in environments; `SERVED_MODEL` is the model name the rollout actors' endpoint serves.
- `biased_sampling_args(sampling_args)`: the env's sampling arguments that change the
  distribution sampled from (guided decoding, logit bias, penalties, min_tokens, ...), as
  dotted names; the rollout engines would then sample from a constrained mu while the
  trainer scores the unconstrained model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    index: int
    prompt: str
    answer: str
    row: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


SERVED_MODEL = "rlray"  # the model name the rollout actors' OpenAI endpoint serves (rlray.actors.server)


def message_text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join((p.get("text") if isinstance(p, dict) else getattr(p, "text", None)) or "" for p in content)
    return ""


def completion_text(completion: Any) -> str:
    """A completion's text: itself when a string, else its messages' text joined."""
    if isinstance(completion, str):
        return completion
    return "".join(message_text(m) for m in completion or [])


def exact_match(completion: Any, answer: str, **_: Any) -> float:
    """Reward 1 when the completion's text, stripped, is the answer, else 0 (a verifiers reward function)."""
    return float(completion_text(completion).strip() == answer)


# Sampling arguments that change the sampled distribution, with their neutral value where one exists;
# top_p, top_k, min_p and repetition_penalty are not here: the env runner pins them to neutral.
BIASING_ARGS: dict[str, Any] = {
    "logit_bias": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0,
    "bad_words": None, "allowed_token_ids": None, "logits_processors": None, "response_format": None,
    "structured_outputs": None, "guided_json": None, "guided_regex": None, "guided_choice": None,
    "guided_grammar": None, "guided_decoding_backend": None, "guided_whitespace_pattern": None,
}


def biased_sampling_args(sampling_args: dict[str, Any] | None) -> list[str]:
    """Dotted names (`extra_body.structured_outputs`) of the arguments that bias the sampled distribution."""
    args = dict(sampling_args or {})
    found = [(k, v) for k, v in args.items() if k != "extra_body"]
    found += [(f"extra_body.{k}", v) for k, v in dict(args.get("extra_body") or {}).items()]
    out = []
    for name, value in found:
        key = name.rsplit(".", 1)[-1]
        if key in BIASING_ARGS and value not in (None, {}, [], "", BIASING_ARGS[key]):
            out.append(name)
    return out


def render_prompt(tokenizer: Any, messages: list, chat_template: str | None, tools: list | None = None,
                  generation_prompt: bool = True) -> list[int]:
    """Prompt ids as the endpoint renders them (same chat template, no extra special tokens)."""
    text = tokenizer.apply_chat_template([dict(m) for m in messages], tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt, chat_template=chat_template)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else "".join(message_text(m) for m in prompt or [])


class Env:
    def __init__(self, env_id: str, vf_env: Any) -> None:
        self.id = env_id
        self.vf = vf_env
        self._data: dict[str, Any] = {}

    def _dataset(self, split: str) -> Any:
        if split not in ("train", "eval"):
            raise ValueError(f"split='{split}'; environments have 'train' and 'eval'")
        if split not in self._data:
            ds = None
            if split == "eval":
                ds = self.vf.build_eval_dataset()
            if ds is None:
                ds = self.vf.build_dataset()
            if ds is None:
                ds = self.vf.build_eval_dataset()
            if ds is None or len(ds) == 0:
                raise ValueError(f"environment '{self.id}' has no examples for split '{split}'")
            self._data[split] = ds
        return self._data[split]

    def num_examples(self, split: str) -> int:
        return len(self._dataset(split))

    def row(self, split: str, index: int) -> dict[str, Any]:
        ds = self._dataset(split)
        row = dict(ds[index % len(ds)])
        row.setdefault("example_id", index % len(ds))
        return row

    def example(self, split: str, index: int) -> Example:
        row = self.row(split, index)
        answer = row.get("answer", "")
        return Example(index=index, prompt=prompt_text(row.get("prompt")),
                       answer=answer if isinstance(answer, str) else str(answer), row=row)

    @functools.cached_property
    def fast_path_ok(self) -> bool:
        import verifiers as vf
        from verifiers.envs.multiturn_env import MultiTurnEnv

        env = self.vf
        cls = type(env)
        return (isinstance(env, vf.SingleTurnEnv) and not env.tool_defs
                and cls.setup_state is MultiTurnEnv.setup_state
                and cls.get_prompt_messages is MultiTurnEnv.get_prompt_messages
                and cls.add_model_response is MultiTurnEnv.add_model_response
                and cls.render_completion in (MultiTurnEnv.render_completion, vf.SingleTurnEnv.render_completion))
