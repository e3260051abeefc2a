"""Plain data that crosses actor boundaries: rollouts, groups and trainer micro-batches.

Contract: numpy arrays and Python scalars only (no torch, no ray), so every value
pickles cheaply and numpy arrays travel zero-copy through Ray's object store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def route_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned integer dtype holding every expert index and `no_route`."""
    return np.dtype(np.uint8 if num_experts < 255 else np.uint16)


def no_route(dtype: np.dtype) -> int:
    """The routing value of a position the engine computed no routing for (it routes normally)."""
    return int(np.iinfo(dtype).max)


def overlay_routing(earlier: np.ndarray | None, later: np.ndarray | None) -> np.ndarray | None:
    """A multi-turn rollout's routing: `later` (a turn's, over every position up to its end) where
    `earlier` (the turns before, a prefix of those positions) has none; an earlier turn's stays."""
    if earlier is None or later is None:
        return later if earlier is None else earlier
    out = later.copy()
    head = out[:len(earlier)]
    routed = (earlier != no_route(earlier.dtype)).all(axis=tuple(range(1, earlier.ndim)))
    head[routed] = earlier[routed]
    return out


@dataclass
class Images:
    """A sequence's images as its model family's processor made them, and where their placeholders sit.

    The rollouts of one prompt share one object (pickle keeps one copy per group)."""

    pixel_values: np.ndarray  # float32 [patches, patch_dim]: every image's patches, in placeholder order
    grid_thw: np.ndarray  # int64 [I, 3]: each image's (time, height, width) patch grid
    spans: np.ndarray  # int64 [I, 2]: each image's (first position, placeholder count) in the sequence

    def __post_init__(self) -> None:
        if len(self.grid_thw) != len(self.spans):
            raise ValueError(f"{len(self.grid_thw)} image grids but {len(self.spans)} placeholder spans")

    def mask(self, length: int) -> np.ndarray:
        """bool [length]: the positions holding an image's placeholder tokens."""
        out = np.zeros(length, bool)
        for start, count in self.spans:
            out[start:start + count] = True
        return out


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
    routing: np.ndarray | None = None  # [P + C, MoE layers, top-k] (route_dtype): the engine's experts per position
    teacher_logprobs: np.ndarray | None = None  # float32 [C]: the distillation teacher's logprob of each token
    images: Images | None = None  # a vision-language prompt's images (placeholders in prompt or env tokens)

    @property
    def min_version(self) -> int:
        return int(self.versions.min()) if len(self.versions) else 0


@dataclass
class Group:
    """The rollouts of one prompt; advantages are computed within a group."""

    rollouts: list[Rollout]
    # set by the buffer: float32 [len(rollouts)], one per rollout; or (algo.loss=opd) one float32 [C] per rollout
    advantages: np.ndarray | list[np.ndarray] | None = None
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
    """Rows of sequences for one forward/backward on one trainer rank (rlray.data.packing).

    Every [B, T] array is aligned on input positions: `loss_mask[b, t] = 1` means
    token `input_ids[b, t]` is a trained target, predicted from position t-1 of the same
    sequence. A row holds one sequence (padded layout) or several back to back (packed):
    `segment_ids[b, t]` numbers the sequence token t belongs to (-1: padding) and
    `position_ids` restart at 0 for each sequence.
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
    position_ids: np.ndarray | None = None  # int64 [B, T]; None: 0..T-1 in every row
    segment_ids: np.ndarray | None = None  # int64 [B, T]; None: one sequence per row, padding off the mask
    routing: np.ndarray | None = None  # [B, T, MoE layers, top-k] (route_dtype): the engine's experts per position
    # images (a vision-language model): every image of the micro-batch in row-major placeholder order
    pixel_values: np.ndarray | None = None  # float32 [patches, patch_dim]
    image_grid_thw: np.ndarray | None = None  # int64 [I, 3]
    image_mask: np.ndarray | None = None  # bool [B, T]: the image placeholder positions

    def __post_init__(self) -> None:
        B, T = np.shape(self.input_ids)
        if self.position_ids is None:
            self.position_ids = np.tile(np.arange(T, dtype=np.int64), (B, 1))
        if self.segment_ids is None:
            rows = np.repeat(np.arange(B, dtype=np.int64)[:, None], T, axis=1)
            self.segment_ids = np.where(np.asarray(self.attention_mask) > 0, rows, -1)

    @property
    def num_slots(self) -> int:
        """Token positions the forward computes, padding included."""
        return int(np.size(self.input_ids))

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())
