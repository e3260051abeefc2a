"""Environments without an engine: loading by id, built-in tasks, pass@k, rollout assembly from
verifiers trajectories (masks, versions, the multi-turn prefix check), failure capture, the
`rlray` tool-call parser and the plain chat template."""

from __future__ import annotations

import asyncio
import threading
import time
from math import comb
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rlray.config import EnvConfig
from rlray.data.tokenizer import char_tokenizer
from rlray.envs import BUILTIN, load_env, load_envs
from rlray.envs.evaluation import pass_at_k, summarize
from rlray.envs.instrument import CURRENT, ToolTimeoutError, Tracker, _timed_tool, instrument_rubric
from rlray.envs.runner import EnvRunner


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


# ---- loading ----------------------------------------------------------------------------
@pytest.mark.parametrize("env_id", BUILTIN)
def test_builtin_envs_load_by_id_with_disjoint_splits(env_id: str) -> None:
    env = load_env(env_id, {"num_train": 50, "num_eval": 20})
    train = [env.example("train", i) for i in range(20)]
    evals = [env.example("eval", i) for i in range(20)]
    assert env.num_examples("train") == 50 and env.num_examples("eval") == 20
    assert env.example("train", 3) == env.example("train", 3)  # deterministic
    if env_id == "guess_number":  # one prompt; the splits differ in their secrets
        assert [e.answer for e in train] != [e.answer for e in evals]
    elif env_id == "largest_shape":  # one question; the splits differ in their pictures
        def pictures(split: str) -> set[str]:
            return {str(env.row(split, i)["prompt"]) for i in range(20)}
        assert len(pictures("train")) == 20 and pictures("train").isdisjoint(pictures("eval"))
    else:
        assert {e.prompt for e in train}.isdisjoint({e.prompt for e in evals}) or env_id == "arithmetic"
    assert env.example("train", 53).prompt == env.example("train", 3).prompt  # index modulo the split
    assert env.fast_path_ok == (env_id not in ("calculator", "guess_number"))


def test_reverse_text_matches_the_plain_task() -> None:
    from rlray.envs.builtin.reverse_text import ReverseText

    env, plain = load_env("reverse_text", {"num_train": 10, "num_eval": 10}), ReverseText()
    for i in range(10):
        assert env.example("train", i).prompt == plain.example("train", i).prompt
        assert env.example("eval", i).answer == plain.example("eval", i).answer


def test_unknown_env_id_names_the_fix() -> None:
    with pytest.raises(ValueError, match="python_path"):
        load_env("no_such_env_module_xyz")


def test_args_an_env_does_not_take_name_them() -> None:
    with pytest.raises(ValueError, match=r"env 'reverse_text' does not take env.args=\{'turns': 3, 'max_turns': 16\}"):
        load_env("reverse_text", {"turns": 3, "max_turns": 16})


def test_an_envs_own_argument_error_is_one_line_naming_it() -> None:
    with pytest.raises(ValueError) as caught:
        load_env("arithmetic", {"ops": "/"})
    assert str(caught.value) == "env 'arithmetic' refused env.args={'ops': '/'}: arithmetic: ops may hold + - * only, got ['/']"


@pytest.mark.parametrize("env_id", BUILTIN)
def test_builtin_prompts_use_only_characters_the_tiny_tokenizer_knows(env_id: str, tok) -> None:
    """A character outside rlray.data.tokenizer.CHARS would become <unk> for the tiny models, silently."""
    env = load_env(env_id, {"num_train": 64, "num_eval": 64})
    known = set(tok.get_vocab())
    prompts = {env.example(split, i).prompt for split in ("train", "eval") for i in range(64)}
    unknown = {c for p in prompts for c in p} - known
    assert not unknown, f"{env_id}: prompts use {sorted(unknown)}, which the tiny tokenizer does not know"


def test_env_module_from_a_folder_on_python_path(tmp_path) -> None:
    (tmp_path / "tiny_echo_env.py").write_text(
        "import verifiers as vf\nfrom datasets import Dataset\n"
        "def load_environment(n=5):\n"
        "    ds = Dataset.from_dict({'prompt': [[{'role': 'user', 'content': f'q{i}'}] for i in range(n)],"
        " 'answer': [str(i) for i in range(n)]})\n"
        "    return vf.SingleTurnEnv(dataset=ds, rubric=vf.Rubric(funcs=[lambda completion, answer: 1.0]))\n")
    cfg = EnvConfig(id="tiny_echo_env", args={"n": 3}, python_path=[str(tmp_path)])
    (env, weight), = load_envs(cfg)
    assert weight == 1.0 and env.num_examples("train") == 3 and env.example("eval", 1).prompt == "q1"


def test_env_modules_ship_with_the_runtime_env(tmp_path, monkeypatch) -> None:
    """rlray and each module of an env.python_path folder travel as py_modules; an actor that got
    them so (RLRAY_SHIPPED_CODE) leaves the driver's folder off its sys.path."""
    import sys

    import rlray
    from rlray.envs import add_python_path
    from rlray.orchestration.cluster import SHIPPED, code_env

    (tmp_path / "one_env.py").write_text("")
    (tmp_path / "pkg_env").mkdir()
    (tmp_path / "pkg_env" / "__init__.py").write_text("")
    (tmp_path / "data").mkdir()  # no __init__.py: not a module
    (tmp_path / "notes.txt").write_text("")
    monkeypatch.setenv("RLRAY_SOME_SETTING", "on")  # the driver's rlray settings reach every actor
    monkeypatch.setenv(SHIPPED, "a parent run's")  # this run's own value wins
    env = code_env([str(tmp_path)])
    assert env["env_vars"]["RLRAY_SOME_SETTING"] == "on"
    assert env["py_modules"] == [str(Path(rlray.__file__).parent), str(tmp_path / "one_env.py"),
                                 str(tmp_path / "pkg_env")]
    assert env["env_vars"][SHIPPED] == str(tmp_path)
    assert env["excludes"] == ["/bench/"] and "excludes" not in code_env(benchmarks=True)  # a run's code, not the benches'

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv(SHIPPED, str(tmp_path))
    add_python_path([str(tmp_path)])
    assert str(tmp_path) not in sys.path
    monkeypatch.delenv(SHIPPED)
    add_python_path([str(tmp_path)])
    assert sys.path[0] == str(tmp_path)


def test_mix_has_weights() -> None:
    from rlray.config import EnvSpec

    cfg = EnvConfig(mix=[EnvSpec("reverse_text", {"num_train": 5}, 3.0), EnvSpec("arithmetic", {"num_train": 5}, 1.0)])
    assert [(e.id, w) for e, w in load_envs(cfg)] == [("reverse_text", 3.0), ("arithmetic", 1.0)]


def test_env_config_from_hydra_overrides() -> None:
    from hydra import compose, initialize_config_dir

    from rlray.config import register, to_config
    from rlray.launch import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["env.mix=[{id: reverse_text, weight: 2}, {id: calculator}]",
                                           "eval.num_samples=4", "eval.pass_k=[1,4]", "rl.eval_every=7"])
    c = to_config(cfg)
    assert [(s.id, s.weight) for s in c.env.mix] == [("reverse_text", 2.0), ("calculator", 1.0)]
    assert c.eval.every_n_steps == 7 and c.eval.max_tokens == c.rollout.max_tokens and c.eval.pass_k == [1, 4]


# ---- pass@k -----------------------------------------------------------------------------
def test_pass_at_k_by_hand() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - comb(3, 2) / comb(4, 2))  # 0.5
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # one of the 10 triples has no correct sample
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)
    records = [{"rewards": [1.0, 0.0, 0.0, 0.0], "errors": [None] * 4},
               {"rewards": [1.0, 1.0, 0.2, 0.0], "errors": [None, None, None, "EnvError: x"]}]
    s = summarize(records, [1, 2], threshold=1.0)
    assert s["pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert s["pass@2"] == pytest.approx((0.5 + (1 - 1 / 6)) / 2)
    assert s["reward_mean"] == pytest.approx(3.2 / 8) and s["errors"] == 1


# ---- rollout assembly ---------------------------------------------------------------------
def fake_runner(tok, **cfg) -> EnvRunner:
    cfg = SimpleNamespace(**{"tool_timeout_s": 1.0, "rollout_timeout_s": 5.0, "fast_path": True, **cfg})
    env = load_env("reverse_text", {"num_train": 4, "num_eval": 4})
    from rlray.actors.server import PLAIN_CHAT_TEMPLATE

    return EnvRunner([(env, 1.0)], engine=None, tokenizer=tok, clients=[None], cfg=cfg, version=lambda: 0,
                     chat_template=PLAIN_CHAT_TEMPLATE)


def step(prompt, completion, logprobs, versions, finish="stop"):
    return {"tokens": {"prompt_ids": prompt, "completion_ids": completion, "completion_logprobs": logprobs},
            "extras": {"rlray_versions": versions, "rlray_finish_reason": finish}, "response": None,
            "is_truncated": finish == "length"}


def test_multi_turn_rollout_masks_environment_tokens(tok) -> None:
    runner = fake_runner(tok)
    env = runner.envs[0]
    p1, c1 = [1, 10, 11], [20, 21, 2]
    p2 = p1 + c1 + [30, 31]  # the environment's turn: tool result and template glue
    c2 = [22, 2]
    state = {"trajectory": [step(p1, c1, [-0.1, -0.2, -0.3], [3, 3, 4]), step(p2, c2, [-0.4, -0.5], [5, 5])],
             "reward": 0.5, "metrics": {"r": 0.5}, "stop_condition": "max_turns_reached"}
    r = runner._rollout(env, {"prompt": [], "example_id": 7}, Tracker(version=3, state=state))
    assert r.error is None and r.reward == 0.5 and r.example_id == 7
    assert r.turns == 2 and r.stop == "max_turns_reached"
    assert r.prompt_ids.tolist() == p1
    assert r.completion_ids.tolist() == c1 + [30, 31] + c2
    assert r.loss_mask.tolist() == [1, 1, 1, 0, 0, 1, 1]
    np.testing.assert_allclose(r.logprobs, [-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5])
    assert r.versions.tolist() == [3, 3, 4, 4, 4, 5, 5] and r.min_version == 3
    assert r.prompt_ids.tolist() + r.completion_ids.tolist() == p2 + c2  # exactly what the model saw last


def test_non_extending_turn_is_flagged_and_not_trained(tok) -> None:
    runner = fake_runner(tok)
    p1, c1 = [1, 10, 11], [20, 21, 2]
    p2 = [1, 10, 11, 20, 99, 2, 30]  # re-tokenised differently
    state = {"trajectory": [step(p1, c1, [-0.1] * 3, [0] * 3), step(p2, [22, 2], [-0.1] * 2, [0] * 2)],
             "reward": 1.0, "metrics": {}}
    r = runner._rollout(runner.envs[0], {"prompt": []}, Tracker(version=0, state=state))
    assert r.error.startswith("TokenMismatch: turn 2") and "token 4" in r.error
    assert r.reward == 1.0 and not r.loss_mask.any()


def test_failed_rollout_gets_reward_zero_and_keeps_a_version(tok) -> None:
    runner = fake_runner(tok)
    r = runner._rollout(runner.envs[0], {"prompt": [{"role": "user", "content": "rev:abc="}]},
                        Tracker(version=6, errors=["EnvError: ValueError: boom"]))
    assert r.reward == 0.0 and r.error == "EnvError: ValueError: boom"
    assert r.prompt_ids.tolist() == [tok.bos_token_id] + tok("rev:abc=", add_special_tokens=False)["input_ids"]
    assert r.completion_ids.tolist() == [tok.eos_token_id] and r.loss_mask.tolist() == [0]
    assert r.versions.tolist() == [6]


def test_rollout_without_a_model_turn_is_an_error(tok) -> None:
    runner = fake_runner(tok)
    state = {"trajectory": [], "reward": 0.3, "metrics": {}, "prompt_too_long": True}
    r = runner._rollout(runner.envs[0], {"prompt": []}, Tracker(version=2, state=state))
    assert r.error == "NoTokens: no model turn (the prompt exceeds the context window)" and r.reward == 0.0
    assert r.versions.tolist() == [2] and not r.loss_mask.any()


# ---- failure capture ------------------------------------------------------------------------
def test_reward_function_errors_are_recorded_per_rollout() -> None:
    import verifiers as vf

    def fine(completion, answer) -> float:
        return 1.0

    def broken(completion, answer) -> float:
        if answer == "b":
            raise RuntimeError("reward bug")
        return 0.5

    def group_broken(completions, answers) -> list[float]:
        raise KeyError("group bug")

    rubric = vf.Rubric(funcs=[fine, broken], weights=[1.0, 1.0])
    instrument_rubric(rubric)
    states = [vf.State(input={"prompt": [], "answer": a, "example_id": 0}) for a in ("a", "b")]
    for s in states:
        s.update(prompt=[], completion=[], trajectory=[], task={})
    asyncio.run(rubric.score_group(states))
    assert [s["reward"] for s in states] == [1.5, 1.0]
    assert dict.get(states[0], "rlray_reward_errors") == []
    assert dict.get(states[1], "rlray_reward_errors") == ["RewardError: broken: RuntimeError: reward bug"]

    group = vf.Rubric(funcs=[group_broken])
    instrument_rubric(group)
    asyncio.run(group.score_group(states))
    assert all("RewardError: group_broken: KeyError" in dict.get(s, "rlray_reward_errors")[-1] for s in states)


def test_hanging_sync_tool_times_out_without_blocking_the_loop() -> None:
    release = threading.Event()

    def slow(x: str) -> str:
        release.wait(60)  # hangs until the test is done with it
        return x

    async def main() -> tuple[float, list[str], int, str]:
        tracker = Tracker(version=0)
        CURRENT.set(tracker)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        try:
            with pytest.raises(ToolTimeoutError):
                await _timed_tool(slow, "slow", 1.0)(x="a")
            seconds = time.perf_counter() - t0
        finally:
            t.cancel()
            release.set()
        fast = await _timed_tool(lambda x: x + "!", "echo", 1.0)(x="a")
        return seconds, tracker.errors, ticks, fast

    seconds, errors, ticks, fast = asyncio.run(main())
    # Waiting for the tool would take the 60 s it hangs; the loop ticked meanwhile (~100 ticks in 1 s unloaded).
    assert seconds < 30, seconds
    assert ticks > 5 and fast == "a!", (ticks, fast)
    assert errors == ["ToolTimeout: tool 'slow' ran past env.tool_timeout_s=1.0s"]


# ---- tool-call syntax and the plain chat template ---------------------------------------------
def test_plain_template_round_trips_tool_calls(tok) -> None:
    pytest.importorskip("vllm")
    from rlray.actors.server import PLAIN_CHAT_TEMPLATE
    from rlray.envs.tool_calls import parse_call

    tools = [{"type": "function", "function": {"name": "calc", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]
    tools_obj = [SimpleNamespace(function=SimpleNamespace(name="calc", parameters=tools[0]["function"]["parameters"]))]
    assert parse_call("calc(12*3)", tools_obj) == ("calc", {"expression": "12*3"})
    assert parse_call(" calc(1,2) ", tools_obj) == ("calc", {"expression": "1,2"})
    assert parse_call("calc 12", tools_obj) is None and parse_call("add(1)", tools_obj) is None
    assert parse_call("calc(1+2)", tools) == parse_call("calc(1+2)", [tools[0]["function"]]) == ("calc", {"expression": "1+2"})
    messages = [{"role": "user", "content": "c:12*3="},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "x", "type": "function", "function": {"name": "calc", "arguments": {"expression": "12*3"}}}]},
                {"role": "tool", "tool_call_id": "x", "content": "36"}]
    text = tok.apply_chat_template(messages, chat_template=PLAIN_CHAT_TEMPLATE, tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<bos>c:12*3=calc(12*3)<|im_end|>36"


# ---- sampling arguments and SFT examples ----------------------------------------------
def test_biasing_sampling_args_are_named_and_rejected_at_load() -> None:
    from rlray.envs.base import biased_sampling_args

    assert biased_sampling_args({"max_tokens": 8, "presence_penalty": 0.0, "extra_body": {"top_k": 5}}) == []
    assert biased_sampling_args({"logit_bias": {"3": 5}, "extra_body": {"min_tokens": 4, "guided_regex": "a+"}}) \
        == ["logit_bias", "extra_body.min_tokens", "extra_body.guided_regex"]
    cfg = EnvConfig(id="calculator", args={"force_tool_format": True})
    with pytest.raises(ValueError) as e:
        load_envs(cfg)
    message = str(e.value)
    assert "\n" not in message and "env 'calculator'" in message
    assert "extra_body.structured_outputs" in message and "env.allow_biased_sampling=true" in message
    cfg.allow_biased_sampling = True
    assert [env.id for env, _ in load_envs(cfg)] == ["calculator"]


def test_sft_prompts_use_the_chat_template_and_draw_from_the_mix(tok) -> None:
    from rlray.actors.server import PLAIN_CHAT_TEMPLATE
    from rlray.config import EnvSpec
    from rlray.data.tokenizer import encode_prompt
    from rlray.envs.sft import SFTData

    envs = load_envs(EnvConfig(mix=[EnvSpec("reverse_text", {"num_train": 40}, 3.0),
                                    EnvSpec("arithmetic", {"num_train": 40}, 1.0)]))
    plain = SFTData(envs, tok, PLAIN_CHAT_TEMPLATE, seed=0)
    draws = [plain.draws(step, 64) for step in range(3)]
    assert draws[1] == plain.draws(1, 64)  # a step's draws depend on the step only
    ids = [e.id for step in draws for e, _ in step]
    assert 0.6 < ids.count("reverse_text") / len(ids) < 0.9 and "arithmetic" in ids  # weights 3:1
    for env_id in ("reverse_text", "arithmetic"):  # each env's rows continue in order across steps
        rows = [i for step in draws for e, i in step if e.id == env_id]
        assert rows == list(range(len(rows)))
    env, i = draws[2][0]
    ex = env.example("train", i)
    s = plain.sample(env, i)
    assert s.prompt_ids.tolist() == encode_prompt(tok, ex.prompt)  # the plain template: bos + the text
    assert s.completion_ids.tolist() == tok(ex.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    chat = "{% for m in messages %}<|im_end|>user:{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
    templated = SFTData(envs, tok, chat, seed=0).sample(env, i)
    assert tok.decode(templated.prompt_ids.tolist()) == f"<|im_end|>user:{ex.prompt}a:"


# ---- guess_number and the end of a truncated turn -----------------------------------------------
def test_guess_number_replies_and_rewards_by_hand() -> None:
    from rlray.envs.builtin.guess_number import guess_of, reply

    env = load_env("guess_number", {"low": 1, "high": 8, "max_turns": 4, "num_train": 16, "num_eval": 16})
    assert env.row("train", 0)["prompt"] == [{"role": "user", "content": "guess:1-8="}]
    assert guess_of("x37y") == 37 and guess_of("abc") is None
    assert (reply(3, 5), reply(7, 5), reply(None, 5), reply(5, 5)) == ("higher=", "lower=", "number?=", "correct")
    rubrics = [env.vf.rubric, *getattr(env.vf.rubric, "rubrics", [])]
    funcs = {f.__name__: f for r in rubrics for f in r.funcs}
    found, solved, turns, consistent = funcs["found"], funcs["solved"], funcs["turns"], funcs["consistent"]
    game = [{"role": "assistant", "content": "4"}, {"role": "user", "content": "higher="},
            {"role": "assistant", "content": "x"}, {"role": "user", "content": "number?="},
            {"role": "assistant", "content": "6"}]
    assert found(game, "6") == (4 - 2) / 4 and solved(game, "6") == 1.0 and turns(game) == 3.0
    assert found(game, "7") == 0.0 and solved(game, "7") == 0.0
    assert found(game[:1], "4") == 1.0
    assert consistent(game, "6") == 2 / 3  # 4, then nothing, then 6 inside 5-8
    assert consistent(game, "3") == 1 / 3  # after "lower" for 4, 6 is outside 1-3
    from rlray.envs.builtin.guess_number import consistency
    assert consistency([4, 6, 5], 5, 1, 8) == 1.0 and consistency([9], 5, 1, 8) == 0.0


def test_a_truncated_turn_ends_the_rollout() -> None:
    from rlray.envs.instrument import instrument_env, turn_truncated

    env = load_env("guess_number", {"num_train": 4, "num_eval": 4})
    instrument_env(env, 1.0)
    instrument_env(env, 1.0)  # idempotent
    conditions = env.vf._stop_conditions
    assert conditions[0].__name__ == "has_error" and conditions[1] is turn_truncated
    assert conditions.count(turn_truncated) == 1
    state = {"trajectory": [{"is_truncated": False}, {"is_truncated": True}]}
    assert asyncio.run(env.vf.is_completed(state)) and state["stop_condition"] == "turn_truncated"
    assert not asyncio.run(turn_truncated({"trajectory": [{"is_truncated": False}]}))


def test_reverse_text_in_turns_sends_the_next_word_and_averages_the_answers() -> None:
    import verifiers as vf

    from rlray.envs.builtin.reverse_text import chain_lcs

    env = load_env("reverse_text", {"turns": 3, "num_train": 8, "num_eval": 4})
    assert isinstance(env.vf, vf.MultiTurnEnv) and not env.fast_path_ok and env.vf.max_turns == 3
    row = env.row("train", 2)
    words = row["info"]["words"]
    assert row["prompt"][0]["content"] == f"rev:{words[0]}=" and row["answer"] == words[0][::-1]
    assert len(set(words)) == 3 and words[0] == load_env("reverse_text", {"num_train": 8}).row("train", 2)["answer"][::-1]
    said = [{"role": "user", "content": row["prompt"][0]["content"]}, {"role": "assistant", "content": "x"}]
    reply = asyncio.run(env.vf.env_response(said, {"info": row["info"]}))
    assert reply[0].content == f"rev:{words[1]}="
    game = [{"role": "assistant", "content": words[0][::-1]}, {"role": "user", "content": "rev:...="},
            {"role": "assistant", "content": words[1][::-1]}]
    assert chain_lcs(game, row["info"]) == 2 / 3  # the third answer was never given


def test_a_groups_rollouts_share_their_prompts_routing() -> None:
    """Prompt positions a rollout found in the prefix cache (no routing) take a sibling's; others stay."""
    from rlray.envs.runner import share_prompt_routing
    from rlray.types import Rollout

    def rollout(prompt: list[int], routing: list[int]) -> Rollout:
        r = np.asarray(routing, np.uint8)[:, None, None].repeat(2, 2)
        ids = np.asarray(prompt)
        return Rollout(ids, np.ones(len(r) - len(ids), np.int64), np.zeros(1, np.float32), np.ones(1, np.int8),
                       np.zeros(1, np.int64), routing=r)

    computed, hit, other = rollout([1, 2, 3], [0, 1, 2, 3]), rollout([1, 2, 3], [255, 255, 3, 255]), \
        rollout([1, 2, 4], [255, 255, 255, 255])
    share_prompt_routing([computed, hit, other])
    assert hit.routing[:, 0, 0].tolist() == [0, 1, 3, 255]  # the prompt from its sibling; its own completion kept
    assert other.routing[:, 0, 0].tolist() == [255] * 4  # another prompt: nothing to share
