"""Plain data that crosses actor boundaries: rollouts, groups and trainer micro-batches.

Contract: numpy arrays and Python scalars only (no torch, no ray), so every value
pickles cheaply and numpy arrays travel zero-copy through Ray's object store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Rollout:
    """One completion of one prompt, token-exact as the inference engine saw it."""

    prompt_ids: np.ndarray  # int64 [P]
    completion_ids: np.ndarray  # int64 [C]
    logprobs: np.ndarray  # float32 [C], inference logprob of each completion token
    loss_mask: np.ndarray  # int8 [C], 1 for model tokens, 0 for env/tool tokens
    versions: np.ndarray  # int64 [C], policy version that produced each token
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    env_id: str = ""
    example_id: int = -1
    finish_reason: str = ""
    error: str | None = None
    text: str = ""
    biased: bool = False  # sampled under distribution-changing args (env.allow_biased_sampling): mu unknown
    turns: int = 1  # model turns
    stop: str = ""  # the verifiers stop condition that ended it (max_turns_reached, turn_truncated, ...)

    @property
    def min_version(self) -> int:
        return int(self.versions.min()) if len(self.versions) else 0


@dataclass
class Group:
    """The rollouts of one prompt; advantages are computed within a group."""

    rollouts: list[Rollout]
    advantages: np.ndarray | None = None  # float32 [len(rollouts)], set by the buffer
    ticket: int = -1  # the buffer ticket it was produced for (its number names the prompt)

    @property
    def version(self) -> int:
        """The oldest policy version that produced any token of the group."""
        return min(r.min_version for r in self.rollouts)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([r.reward for r in self.rollouts], dtype=np.float32)


@dataclass
class MicroBatch:
    """Right-padded sequences for one forward/backward on one trainer rank.

    Every [B, T] array is aligned on input positions: `loss_mask[b, t] = 1` means
    token `input_ids[b, t]` is a trained target, predicted from position t-1.
    """

    input_ids: np.ndarray  # int64 [B, T]
    attention_mask: np.ndarray  # int64 [B, T]
    loss_mask: np.ndarray  # float32 [B, T]
    advantages: np.ndarray  # float32 [B, T]
    inference_logprobs: np.ndarray  # float32 [B, T]
    num_loss_tokens_global: float = 1.0  # loss tokens in the whole step, over every rank
    num_sequences_global: float = 1.0  # sequences with a loss token in the whole step, over every rank
    lag: np.ndarray | None = None  # int64 [B, T]: trainer step minus the sampling policy's version (0: on-policy)
    mini_batch: int = 0  # the optimizer step (of algo.mini_batches) this micro-batch belongs to; the
    # global counts above are that mini-batch's

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())
