"""The software-engineering taskset (rlray/envs/builtin_v1/fix_op_v1.py), rlray's in-process bash harness
(rlray.envs.v1_tools) and multi-turn SFT of tool episodes (rlray.envs.sft).

- Hidden tests score a repository in the episode's sandbox: the task's own solution gets 1, the file as given or
  fixed wrongly 0, a file whose import never ends 0 at the sandbox's wall time; verifiers' subprocess runtime (the
  control) scores the same files the same.
- Hidden tests that do not finish (an import that never ends) raise at the sandbox's wall time: a scoring error.
- rlray_bash against a stand-in model endpoint (the sandbox's relay URL, as verifiers hands it to every harness):
  verifiers' bash system prompt and tool on every request, the tool call run in the sandbox (hostname
  `rlray-sandbox`; the host's own under the subprocess control), its output as the tool message, the reply ending
  the loop; a turn refused by a limit ends it too; a tool call past the wall time raises (a harness error).
- An SFT sample of a tool episode is the hand-written sequence the harness would send: the harness's system prompt,
  the prompt, each assistant turn trained (loss mask 1), the tool output in between masked.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from rlray.config import EnvConfig, EnvSpec
from rlray.envs import v1

ROOT = Path(__file__).resolve().parents[2]
BASH_SYSTEM = "You are a coding agent. You have access to a bash tool for running shell commands."  # verifiers 0.4's
WALL_S = 10  # the sandbox's per command here: a loaded CI machine's Python starts well within it
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make test "
                                 "installs it as root: apt-get install bubblewrap)")

TASK_CHECK = r'''
import asyncio, json, sys, time
import verifiers.v1 as vf
import verifiers.v1.runtimes as rt
from verifiers.v1.runtimes.subprocess import SubprocessConfig
from rlray.envs import v1_worker
from rlray.envs.v1_sandbox import BwrapConfig, install
from tests.v1_model import ScriptedModel, bash_episode

v1_worker._import_path([]); v1_worker._register_harness(); install()
from fix_op_v1 import FixTask, task_data

args = json.loads(sys.argv[1])
data = task_data("train", 3, 0)
right = data.tests[0][2]


async def score(config, name, command):
    runtime = rt.make_runtime(config, name)
    await runtime.start()
    task = FixTask(data, vf.TaskConfig())
    await task.setup(None, runtime)
    if command:
        await runtime.run(["bash", "-c", command], {})
    started = time.monotonic()
    try:
        reward = await task.tests_pass(data, runtime)
    except Exception as e:
        reward = f"{type(e).__name__}: {e}"
    await runtime.stop()
    return [reward, time.monotonic() - started]


async def episode(config, name):
    runtime = rt.make_runtime(config, name)
    await runtime.start()
    model = ScriptedModel([args["command"]], refuse_after=1 if args["refuse"] else None)
    try:
        result = await bash_episode(runtime, model, data, "max_turns" if args["refuse"] else None)
    except Exception as e:
        return ["raised", f"{type(e).__name__}: {e}"]
    finally:
        await runtime.stop()
    first = model.requests[0]
    return [result.stdout, [[m["role"] for m in r["messages"]] for r in model.requests], first["messages"][0]["content"],
            [t["function"]["name"] for t in first["tools"]], model.requests[-1]["messages"][-1]]


async def main():
    call = data.solution[0]["tool_calls"][0]["function"]
    fix = json.loads(call["arguments"])["command"]
    a, right_op, b = fix.split(",")[2]
    other = [o for o in "+-*" if o not in (right_op, data.source.splitlines()[1].strip()[-2])][0]
    wrong = fix.replace(f",{a}{right_op}{b},", f",{a}{other}{b},")
    hang = f"printf 'while 1:\\n    pass\\n' > {data.file}.py"
    out = {"data": [data.file, data.source, data.tests, fix, wrong]}
    for kind, config in (("sandbox", BwrapConfig(wall_s=args["wall_s"])), ("subprocess", SubprocessConfig())):
        if kind not in args["kinds"]:
            continue
        tried = {"as given": None, "fixed": fix, "fixed wrongly": wrong} if args["score"] else {}
        if kind == "sandbox" and args["score"]:
            tried["hangs"] = hang
        out[kind] = {what: await score(config, f"fix-{kind}-{i}-{args['marker']}", c)
                     for i, (what, c) in enumerate(tried.items())}
        out[kind + " episode"] = await episode(config, f"ep-{kind}-{args['marker']}")
    print(json.dumps(out))

asyncio.run(main())
'''


SLOTS_CHECK = r'''
import asyncio, json, sys, time
import verifiers.v1.runtimes as rt
from rlray.envs.v1_sandbox import BwrapConfig, install

install()
STAMP = "echo $(date +%s.%N); sleep 0.3; echo $(date +%s.%N)"


async def main():
    boxes = [rt.make_runtime(BwrapConfig(max_running=1), f"slot-{i}-{sys.argv[1]}") for i in range(3)]
    for b in boxes:
        await b.start()
    done = await asyncio.gather(*(b.run(["bash", "-c", STAMP], {}) for b in boxes))
    for b in boxes:
        await b.stop()
    print(json.dumps([[float(t) for t in d.stdout.split()] for d in done]))

asyncio.run(main())
'''


@needs_bwrap
def test_a_process_runs_at_most_max_running_sandboxed_commands_at_once() -> None:
    done = subprocess.run([v1.python(EnvConfig()), "-c", SLOTS_CHECK, uuid.uuid4().hex[:8]], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    spans = sorted(json.loads(done.stdout.splitlines()[-1]))
    assert len(spans) == 3 and all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans  # one after another


def run_check(refuse: bool = False, command: str = "hostname", kinds: tuple = ("sandbox", "subprocess")) -> dict:
    args = {"marker": uuid.uuid4().hex[:8], "refuse": refuse, "command": command, "kinds": kinds, "wall_s": WALL_S,
            "score": not refuse and command == "hostname"}
    done = subprocess.run([v1.python(EnvConfig()), "-c", TASK_CHECK, json.dumps(args)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@needs_bwrap
def test_hidden_tests_score_the_repository_in_the_sandbox_and_rlray_bash_runs_tool_calls_there() -> None:
    out = run_check()
    file, source, tests, fix, wrong = out["data"]
    assert source.startswith(f"def {file}(") and len(tests) == 3 and fix.startswith("sed -i s,") and wrong != fix
    for kind in ("sandbox", "subprocess"):
        scores = {what: reward for what, (reward, _) in out[kind].items()}
        assert scores["as given"] == 0.0 and scores["fixed"] == 1.0 and scores["fixed wrongly"] == 0.0, (kind, out)
    hung, seconds = out["sandbox"]["hangs"]  # not a 0 the policy earned: a scoring error (rlray counts RewardError)
    assert hung.startswith("RuntimeError: the hidden tests did not finish (exit 124)") and seconds < WALL_S + 30, hung
    for kind, host in (("sandbox", "rlray-sandbox"), ("subprocess", socket.gethostname())):
        reply, sent, system, tools, last = out[kind + " episode"]
        assert reply == "done" and system.startswith(BASH_SYSTEM) and tools == ["bash"], out[kind + " episode"]
        assert sent == [["system", "user"], ["system", "user", "assistant", "tool"]], sent
        assert last["role"] == "tool" and last["content"] == host + "\n", last


@needs_bwrap
def test_rlray_bash_ends_at_a_refused_turn_and_raises_for_a_tool_call_past_the_wall_time() -> None:
    out = run_check(refuse=True)
    for kind in ("sandbox", "subprocess"):
        reply, sent, *_ = out[kind + " episode"]
        assert reply == "" and len(sent) == 2, out[kind + " episode"]
    raised, why = run_check(command="sleep 100", kinds=("sandbox",))["sandbox episode"]  # past WALL_S
    assert raised == "raised" and why.startswith("ToolTimeout: tool call bash(sleep 100) ran past"), why


@needs_bwrap
def test_a_tool_episode_is_sft_data_as_the_harness_sends_it() -> None:
    from rlray.actors.server import PLAIN_CHAT_TEMPLATE
    from rlray.data.tokenizer import CHARS, char_tokenizer
    from rlray.envs import load_envs
    from rlray.envs.sft import SFTData

    cfg = EnvConfig(mix=[EnvSpec("fix_op_v1", {"num": 64}, v1={"harness": "rlray_bash"})])
    [(env, _)] = load_envs(cfg)
    assert isinstance(env, v1.V1Env) and [t["function"]["name"] for t in env.tools] == ["bash"]
    train = {env.row("train", i)["prompt"][1]["content"] for i in range(64)}
    held_out = {env.row("eval", i)["prompt"][1]["content"] for i in range(64)}
    assert not train & held_out  # the splits' example calls differ
    mem_mb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) >> 10
    lines = v1.console_line([env], cfg).splitlines()
    assert "fix_op_v1 (64 train / 64 eval tasks, harness rlray_bash, sandboxed)" in lines[0]
    most = max(1, min(mem_mb // 2 // 2048, 4 * len(os.sched_getaffinity(0))))  # memory's half, 4 per core
    assert lines[1].startswith(f"sandbox: up to {most} commands at once per v1 env actor"), lines
    row = env.row("train", 5)
    system, user = row["prompt"]
    assert system == {"role": "system", "content": BASH_SYSTEM} and user["role"] == "user"
    command = json.loads(row["solution"][0]["tool_calls"][0]["function"]["arguments"])["command"]
    assert set(user["content"] + command + "bash()done") <= set(CHARS)  # all the tiny model reads and writes

    tok = char_tokenizer()
    sft = SFTData([(env, 1.0)], tok, PLAIN_CHAT_TEMPLATE, seed=0)
    sample = sft.sample(env, 5)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    eos = [tok.eos_token_id]
    assert sample.prompt_ids.tolist() == [tok.bos_token_id, *ids(BASH_SYSTEM + user["content"])]
    assert sample.completion_ids.tolist() == [*ids(f"bash({command})"), *eos, *ids("done"), *eos]
    assert sample.loss_mask.tolist() == [1.0] * len(sample.completion_ids)  # sed prints nothing: no tool tokens

    output = "x = 1"  # a tool that prints: its output in the sequence, masked
    episode = [row["solution"][0], {**row["solution"][1], "content": output}, row["solution"][2]]
    sample = sft.episode(row["prompt"], episode, env.tools)
    call, tail = [*ids(f"bash({command})"), *eos], [*ids("done"), *eos]
    assert sample.completion_ids.tolist() == [*call, *ids(output), *tail]
    assert sample.loss_mask.tolist() == [1.0] * len(call) + [0.0] * len(output) + [1.0] * len(tail)
