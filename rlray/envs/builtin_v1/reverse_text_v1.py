"""reverse_text_v1: reverse_text (rlray.envs.builtin.reverse_text) as a verifiers v1 taskset, single turn.

Task `rev:hello=` (the prompt), answer `olleh`; reward = the LCS ratio of the reply and the answer,
`exact` logged with weight 0. Tasks of `split` train and eval come from disjoint seeds (as reverse_text's).
"""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf

from rlray.envs.builtin.reverse_text import ReverseText, lcs_ratio


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def lcs(self, task: ReverseData, trace: vf.Trace) -> float:
        return lcs_ratio(trace.last_reply.strip(), task.answer)

    @vf.reward(weight=0.0)
    async def exact(self, task: ReverseData, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == task.answer)


class ReverseConfig(vf.TasksetConfig):
    split: str = "train"
    num: int = 4096
    min_len: int = 3
    max_len: int = 8
    seed: int = 0


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> Iterator[ReverseTask]:
        c = self.config
        words = ReverseText(c.min_len, c.max_len, c.seed)
        for i in range(c.num):
            example = words.example(c.split, i)
            yield ReverseTask(ReverseData(id=f"{c.split}-{i}", prompt=example.prompt, answer=example.answer),
                              c.task)


__all__ = ["ReverseConfig", "ReverseData", "ReverseTask", "ReverseTaskset"]
