"""Verifiers v1 (0.4) env modules the tests write to a temporary folder (envs written outside rlray)."""

V1_FEEDBACK_ENV = '''
"""Reverse a word; a wrong reply gets "no, again" (a feedback turn), three model turns at most."""
import verifiers.v1 as vf


class WordData(vf.TaskData):
    answer: str


class WordTask(vf.Task[WordData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def solved(self, task: WordData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)


class WordTaskset(vf.Taskset[WordTask, vf.TasksetConfig]):
    def load(self):
        for w in ["abc", "hello", "ray", "vllm"]:
            yield WordTask(WordData(id=w, prompt=f"rev:{w}=", answer=w[::-1]), self.config.task)


class FeedbackConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class FeedbackEnv(vf.Env[FeedbackConfig]):
    async def run(self, task, agents) -> None:
        async with agents.agent.interaction(task) as it:
            seg, turns = await it.turn(), 1
            while not seg.terminated and seg.last_reply != task.data.answer and turns < 3:
                seg, turns = await it.turn("no, again"), turns + 1


__all__ = ["FeedbackConfig", "FeedbackEnv", "WordData", "WordTask", "WordTaskset"]
'''
