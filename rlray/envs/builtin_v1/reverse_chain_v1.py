"""reverse_chain_v1: a multi-turn verifiers v1 Env: reverse a word, then the next one the env sends.

The task's prompt is `rev:<word>=`; after each reply the environment sends the next word (`rev:<next>=`,
a feedback turn), `turns` words in all (the `multi_turn` recipe's task, reverse_text with turns=3, written
for v1). reward = the mean LCS ratio of the replies to the reversed words (a word never answered scores 0).
"""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf

from rlray.envs.builtin.reverse_text import ReverseText, lcs_ratio


class ChainData(vf.TaskData):
    answer: str
    words: list[str]


class ChainTask(vf.Task[ChainData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def chain_lcs(self, task: ChainData, trace: vf.Trace) -> float:
        replies = [(m.content or "").strip() for m in trace.assistant_messages]
        return sum(lcs_ratio(r, w[::-1]) for r, w in zip(replies, task.words)) / len(task.words)


class ChainConfig(vf.TasksetConfig):
    split: str = "train"
    num: int = 4096
    turns: int = 3
    seed: int = 0


class ChainTaskset(vf.Taskset[ChainTask, ChainConfig]):
    def load(self) -> Iterator[ChainTask]:
        c = self.config
        words = ReverseText(seed=c.seed)
        for i in range(c.num):  # the later words of task i: words num + (turns - 1) i + ..., as reverse_text's
            chain = [words.word(c.split, i)] + [words.word(c.split, c.num + (c.turns - 1) * i + t)
                                                 for t in range(c.turns - 1)]
            yield ChainTask(ChainData(id=f"{c.split}-{i}", prompt=f"rev:{chain[0]}=", answer=chain[0][::-1],
                                      words=chain), c.task)


class ChainEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class ChainEnv(vf.Env[ChainEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as it:
            seg = await it.turn()
            for word in task.data.words[1:]:
                if seg.terminated:
                    break
                seg = await it.turn(f"rev:{word}=")


__all__ = ["ChainConfig", "ChainData", "ChainEnv", "ChainEnvConfig", "ChainTask", "ChainTaskset"]
