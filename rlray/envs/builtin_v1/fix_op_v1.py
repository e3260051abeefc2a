"""fix_op_v1: a tiny software-engineering taskset for agents with a bash tool: fix the operator of a generated function.

Each task is a one-file Python repository, `<file>.py` holding `def <fn>(<x>, <y>):` whose body returns `<x><op><y>`
with the wrong operator (one of + - *), and a prompt naming the file, what the function should do and the buggy
line: `fix calc.py: calc should multiply. it has: return a-b`. Hidden tests (three calls, each telling the right
operator from the others, never in the workspace) run inside the episode's runtime after the agent is done: reward =
the fraction whose value is right (a file that fails to import or raises scores 0); a test run that does not finish
(past the sandbox's wall time, killed) raises, which verifiers records as a scoring error (rlray: `RewardError`,
reward 0, counted). Everything the agent must write is in the tiny character vocabulary (rlray.data.tokenizer): the
fix is one tool call, `sed -i s,<x>.<y>,<x><op><y>, <file>.py`, then a reply ending the episode; `solution` holds
that episode (an assistant tool call, its empty tool output, the reply `done`) for multi-turn SFT (rlray.envs.sft).
Splits: `train` and `eval` draw from disjoint (file, arguments, right operator, wrong operator) combinations (one in
five held out), so no eval repository and request was trained on; tasks of a combination differ in their tests.
"""

from __future__ import annotations

import json
import random
import sys
import zlib
from collections.abc import Iterator

import verifiers.v1 as vf

OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
VERBS = {"+": "add", "-": "subtract", "*": "multiply"}
FILES = ("calc", "ops", "mathx", "f", "g")
ARGS = (("a", "b"), ("x", "y"), ("m", "n"), ("p", "q"))
CHECK = ("import importlib,json,sys\nsys.path.insert(0,'.')\ntry:\n    m=importlib.import_module(sys.argv[1])\n"
         "    print(json.dumps([getattr(m,sys.argv[2])(*c) for c in json.loads(sys.argv[3])]))\n"
         "except Exception as e:\n    print(json.dumps(type(e).__name__))\n")


class FixData(vf.TaskData):
    file: str
    fn: str
    source: str
    tests: list[list[int]]  # [x, y, expected]
    solution: list[dict]


class FixTask(vf.Task[FixData, vf.State, vf.TaskConfig]):
    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        await runtime.write(f"{self.data.file}.py", self.data.source.encode())

    @vf.reward
    async def tests_pass(self, task: FixData, runtime: vf.Runtime) -> float:
        calls = json.dumps([t[:2] for t in task.tests])
        done = await runtime.run([sys.executable, "-I", "-c", CHECK, task.file, task.fn, calls], {})
        if done.exit_code != 0:  # the runner itself did not finish (past the wall time, killed): an error, not a 0
            raise RuntimeError(f"the hidden tests did not finish (exit {done.exit_code}): "
                               f"{' '.join(done.stderr.split())[-200:]}")
        try:
            values = json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            values = None
        if not isinstance(values, list):
            return 0.0
        return sum(v == t[2] for v, t in zip(values, task.tests)) / len(task.tests)


class FixConfig(vf.TasksetConfig):
    split: str = "train"
    num: int = 2048
    seed: int = 0


def _calls(rng: random.Random, op: str, n: int) -> list[tuple[int, int]]:
    """`n` distinct calls whose value under `op` differs from every other operator's (each test tells `op` apart)."""
    out: list[tuple[int, int]] = []
    while len(out) < n:
        x, y = rng.randint(2, 9), rng.randint(2, 9)
        if (x, y) not in out and sum(OPS[o](x, y) == OPS[op](x, y) for o in OPS) == 1:
            out.append((x, y))
    return out


def split_of(file: str, args: tuple[str, str], right: str, wrong: str) -> str:
    return "eval" if zlib.crc32(f"{file}:{args}:{right}:{wrong}".encode()) % 5 == 0 else "train"


def task_data(split: str, index: int, seed: int) -> FixData:
    rng = random.Random(f"fix_op:{seed}:{split}:{index}")
    while True:
        file, (a, b), right = rng.choice(FILES), rng.choice(ARGS), rng.choice(list(OPS))
        wrong = rng.choice([o for o in OPS if o != right])
        if split_of(file, (a, b), right, wrong) == split:
            break
    fn = file
    source = f"def {fn}({a}, {b}):\n    return {a}{wrong}{b}\n"
    call = f"sed -i s,{a}.{b},{a}{right}{b}, {file}.py"
    solution = [{"role": "assistant", "content": "",
                 "tool_calls": [{"id": "call-0", "type": "function",
                                 "function": {"name": "bash", "arguments": json.dumps({"command": call})}}]},
                {"role": "tool", "tool_call_id": "call-0", "name": "bash", "content": ""},
                {"role": "assistant", "content": "done"}]
    prompt = f"fix {file}.py: {fn} should {VERBS[right]}. it has: return {a}{wrong}{b}"
    return FixData(id=f"{split}-{index}", prompt=prompt, file=file, fn=fn, source=source,
                   tests=[[x, y, OPS[right](x, y)] for x, y in _calls(rng, right, 3)], solution=solution)


class FixTaskset(vf.Taskset[FixTask, FixConfig]):
    def load(self) -> Iterator[FixTask]:
        c = self.config
        for i in range(c.num):
            yield FixTask(task_data(c.split, i, c.seed), c.task)


__all__ = ["FixConfig", "FixData", "FixTask", "FixTaskset", "task_data"]
