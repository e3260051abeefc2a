"""verifiers v1 (0.4) environments without an engine: which ids are v1, how a v1 branch becomes a Rollout,
what the v1 interpreter describes (and says when an env cannot load), SFT rows of a v1 taskset, and the
private renderers attribute rlray adapts (checked inside the v1 interpreter, .venv-v1, which `make test`
builds)."""

from __future__ import annotations

import json
import subprocess
import textwrap
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from rlray.config import EnvConfig, EnvSpec
from rlray.config.schema import SandboxConfig
from rlray.envs import v1
from rlray.envs.v1_rollouts import to_rollout

V1_TASKSET = '''
"""A v1 taskset with a split field; a reward that raises on task 'boom'."""
import verifiers.v1 as vf

WORDS = {"train": ["abc", "hello", "ray", "boom"], "eval": ["vllm", "mask"]}


class WordData(vf.TaskData):
    answer: str


class WordTask(vf.Task[WordData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, task: WordData, trace: vf.Trace) -> float:
        if task.id == "boom":
            raise RuntimeError("injected reward failure")
        return float(trace.last_reply.strip() == task.answer)


class WordConfig(vf.TasksetConfig):
    split: str = "train"


class WordTaskset(vf.Taskset[WordTask, WordConfig]):
    def load(self):
        for w in WORDS[self.config.split]:
            yield WordTask(WordData(id=w, prompt=f"rev:{w}=", system_prompt="be brief", answer=w[::-1]),
                           self.config.task)


__all__ = ["WordConfig", "WordData", "WordTask", "WordTaskset"]
'''

CLASSIC = '''
import verifiers as vf


def load_environment():
    raise NotImplementedError
'''


def write(folder: Path, name: str, source: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(source)
    return str(folder)


def test_a_module_importing_verifiers_v1_is_a_v1_env_read_from_its_source(tmp_path) -> None:
    folder = write(tmp_path, "rlray_test_words_v1", V1_TASKSET)
    write(tmp_path, "rlray_test_classic", CLASSIC)
    (tmp_path / "rlray_test_pkg_v1").mkdir()
    (tmp_path / "rlray_test_pkg_v1" / "__init__.py").write_text("from verifiers import v1 as vf\n")
    path = [folder]
    assert v1.is_v1("rlray_test_words_v1", path) and v1.is_v1("owner/rlray-test-words-v1@0.1", path)
    assert v1.is_v1("rlray_test_pkg_v1", path)
    assert not v1.is_v1("rlray_test_classic", path) and not v1.is_v1("no_such_env_module", path)
    assert set(v1.BUILTIN_V1) == {"fix_op_v1", "reverse_chain_v1", "reverse_text_v1"}
    assert all(v1.is_v1(i, []) for i in v1.BUILTIN_V1) and not v1.is_v1("reverse_text", [])
    cfg = EnvConfig(mix=[EnvSpec("reverse_text"), EnvSpec("rlray_test_words_v1", {"n": 2}, 1.0, {"harness": "bash"})],
                    python_path=path, rollout_timeout_s=30.0)
    specs = v1.specs(cfg)
    assert list(specs) == ["rlray_test_words_v1"]
    assert specs["rlray_test_words_v1"] == {
        "module": "rlray_test_words_v1", "args": {"n": 2}, "eval_args": {}, "harness": "bash", "harness_args": {},
        "runtime": "auto", "sandbox": asdict(SandboxConfig()), "max_turns": None, "role": "agent",
        "max_tasks": 100_000, "timeout_s": 30.0}
    for bad in ({"harnes": "bash"}, {"python": "/usr/bin/python3"}):  # a typo; the interpreter is one per run
        cfg.mix[1].v1 = bad
        with pytest.raises(ValueError, match=f"env.mix entry 'rlray_test_words_v1': v1.{next(iter(bad))} is not"):
            v1.specs(cfg)


def record(ids: list[int], mask: list[int], **extra) -> dict:
    logprobs = [-0.5 - i / 10 if m else 0.0 for i, m in enumerate(mask)]
    return {"session": "s", "ids": ids, "mask": mask, "logprobs": logprobs, "reward": 0.75, "parts": {"exact": 1.0},
            "stop": "user_closed", "turns": 2, "finish": "stop", "text": "x", "error": None, **extra}


# two turns: prompt [1 5 6], the model's [7 8 2], the environment's [9 9], the model's [10 3]
IDS, MASK = [1, 5, 6, 7, 8, 2, 9, 9, 10, 3], [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
CALLS = [{"id": "a", "prompt": [1, 5, 6], "out": [7, 8, 2], "versions": [4, 4, 5]},
         {"id": "b", "prompt": [1, 5, 6, 7, 8, 2, 9, 9], "out": [10, 3], "versions": [5, 6]}]


def test_a_v1_branch_is_a_rollout_whose_tokens_carry_the_version_that_sampled_them() -> None:
    r = to_rollout(record(IDS, MASK), CALLS, "e", 3, start=4, eos=2)
    assert r.prompt_ids.tolist() == [1, 5, 6] and r.completion_ids.tolist() == [7, 8, 2, 9, 9, 10, 3]
    assert r.loss_mask.tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert r.versions.tolist() == [4, 4, 5, 5, 5, 5, 6]  # environment tokens: the model token's before them
    np.testing.assert_allclose(r.logprobs, [-0.8, -0.9, -1.0, 0.0, 0.0, -1.3, -1.4], rtol=1e-6)
    assert (r.reward, r.error, r.turns, r.stop, r.example_id) == (0.75, None, 2, "user_closed", 3)


@pytest.mark.parametrize("calls, why", [
    ([CALLS[0], {**CALLS[1], "prompt": [1, 5, 6, 7, 8, 2, 9, 4]}], "request 2 of the session does not line up"),
    ([CALLS[0]], "sampled token 8 of the branch came from no request"),
    ([], "sampled token 3 of the branch came from no request"),
])
def test_a_v1_branch_that_does_not_line_up_with_the_engines_requests_is_never_trained(calls, why) -> None:
    r = to_rollout(record(IDS, MASK), calls, "e", 3, start=4, eos=2)
    assert r.error.startswith("TokenMismatch: ") and why in r.error
    assert r.reward == 0.0 and not r.loss_mask.any() and len(r.completion_ids) == 7


def test_a_failed_or_empty_v1_episode_is_a_masked_reward_zero_rollout() -> None:
    failed = to_rollout(record(IDS, MASK, error="RewardError: task T scoring: boom"), CALLS, "e", 0, 4, 2)
    assert failed.error.startswith("RewardError") and failed.reward == 0.0 and not failed.loss_mask.any()
    empty = to_rollout(record([], [], error="ProviderError: Connection error."), [], "e", 0, 4, 2)
    assert empty.prompt_ids.tolist() == [2] and empty.completion_ids.tolist() == [2]
    assert empty.loss_mask.tolist() == [0] and empty.versions.tolist() == [4]
    nothing = to_rollout(record([1, 5], [0, 0]), [], "e", 0, 4, 2)
    assert nothing.error.startswith("NoTokens: ") and not nothing.loss_mask.any()


def test_the_v1_interpreter_describes_tasksets_by_split_and_one_that_fails_in_one_line(tmp_path) -> None:
    from rlray.actors.server import PLAIN_CHAT_TEMPLATE
    from rlray.data.tokenizer import CHARS, char_tokenizer
    from rlray.envs import load_envs
    from rlray.envs.sft import SFTData

    folder = write(tmp_path, "rlray_test_words_v1", V1_TASKSET)
    cfg = EnvConfig(mix=[EnvSpec("rlray_test_words_v1"), EnvSpec("reverse_text", {"num_train": 8, "num_eval": 4}),
                         EnvSpec("reverse_text_v1", {"num": 16}), EnvSpec("reverse_chain_v1", {"num": 16})],
                    python_path=[folder])
    (env, weight), (classic, _), *builtins = load_envs(cfg)
    assert isinstance(env, v1.V1Env) and weight == 1.0 and not isinstance(classic, v1.V1Env)
    for e, _ in builtins:  # the built-in v1 envs: prompts the tiny tokenizer spells, disjoint splits
        train, held_out = (e.example(split, i) for split, i in (("train", 3), ("eval", 3)))
        assert e.num_examples("train") == 16 and set(train.prompt + train.answer) <= set(CHARS)
        assert train.prompt != held_out.prompt and train.answer == train.prompt[4:-1][::-1]
    assert env.num_examples("train") == 4 and env.num_examples("eval") == 2  # eval: split=eval, set by rlray
    row = env.row("eval", 3)
    assert row["prompt"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "rev:mask="}]
    assert (row["answer"], row["example_id"], row["v1_index"], row["v1_split"]) == ("ksam", 1, 1, "eval")
    assert "image" not in row  # TaskData fields at their defaults stay behind
    line = v1.console_line([env, classic], cfg)
    assert line.startswith("verifiers v1 envs: rlray_test_words_v1 (4 train / 2 eval tasks, harness chat); ")
    assert v1.console_line([classic], cfg) is None
    assert env.example("train", 1).prompt == "be briefrev:hello="
    tok = char_tokenizer()
    sample = SFTData([(env, 1.0)], tok, PLAIN_CHAT_TEMPLATE, seed=0).sample(env, 1)
    assert tok.decode(sample.completion_ids, skip_special_tokens=True) == "olleh"

    write(tmp_path, "rlray_test_broken_v1", "import verifiers.v1 as vf\nraise RuntimeError('injected import failure')\n")
    codex = EnvConfig(id="rlray_test_words_v1", python_path=[folder])
    codex.v1.harness = "codex"
    for bad, expected in [(EnvConfig(id="rlray_test_broken_v1", python_path=[folder]), "injected import failure"),
                          (codex, "codex")]:
        with pytest.raises(ValueError) as e:
            load_envs(bad)
        assert "\n" not in str(e.value) and "failed to load" in str(e.value) and expected in str(e.value)


ADAPTER_CHECK = '''
import json, sys
import renderers.client as rc
from renderers.base import create_renderer
from renderers.configs import CustomRendererConfig
from transformers import AutoTokenizer
from verifiers.v1.utils.compile import validate_pairing  # rlray.envs.v1_worker._check_pairing calls it at load
from rlray.envs.v1_render import IMPORT_PATH, TokenInRenderer
from rlray.envs.v1_worker import adapt_renderers

args = json.loads(sys.argv[1])
original = rc._parse_completion_logprobs
adapt_renderers()
out = {"adapted": rc._parse_completion_logprobs is not original,
       "vllm_032": rc._parse_completion_logprobs({"logprobs": {"content": [{"token_id": 5, "logprob": -1.5}]}}, [5]),
       "later": rc._parse_completion_logprobs({"logprobs": {"content": [{"token": "token_id:5", "logprob": -2.5}]}}, [5])}
config = CustomRendererConfig(import_path=IMPORT_PATH, chat_template=args["template"])
renderer = create_renderer(AutoTokenizer.from_pretrained(args["tokenizer"]), config)
assert type(renderer) is TokenInRenderer
first = renderer.render([{"role": "user", "content": "rev:abc="}], add_generation_prompt=True)
bridged = renderer.bridge_to_next_turn(first.token_ids, args["completion"], [{"role": "user", "content": "rev:xy="}])
out.update(first=first.token_ids, bridged=bridged.token_ids, mask=bridged.sampled_mask)
tok = AutoTokenizer.from_pretrained(args["tokenizer"])
calls = create_renderer(tok, CustomRendererConfig(import_path=IMPORT_PATH, chat_template=args["template"],
                                                  tool_format="rlray"))
bash = {"name": "bash", "description": "", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}
reply = calls.parse_response(tok("bash(sed -i s,-,+, f.py)", add_special_tokens=False)["input_ids"], tools=[bash])
plain = calls.parse_response(tok("done", add_special_tokens=False)["input_ids"], tools=[bash])
out.update(tools=[renderer.supports_tools, calls.supports_tools],
           call=[(c.name, c.arguments, c.status.value) for c in reply.tool_calls], plain=[plain.content, plain.tool_calls])
btok = AutoTokenizer.from_pretrained(args["bytes"])  # a model whose template writes hermes-style tool calls
hermes = create_renderer(btok, CustomRendererConfig(import_path=IMPORT_PATH, chat_template=args["template"],
                                                    tool_parser="qwen3"))
text = '<tool_call>{"name": "bash", "arguments": {"command": "ls -la"}}</tool_call>'
reply = hermes.parse_response(btok(text, add_special_tokens=False)["input_ids"], tools=[bash])
out["hermes"] = [hermes.supports_tools, [(c.name, c.arguments) for c in reply.tool_calls]]
print(json.dumps(out))
'''


def test_the_v1_interpreter_has_the_renderers_api_rlray_adapts(tmp_path) -> None:
    """renderers' private response parser (`renderers.client._parse_completion_logprobs`) reads vLLM 0.32's
    logprobs once adapted; the renderer parses the plain template's tool calls when told to (verifiers' `validate_pairing`, which rlray calls at load, is where it is);
    the token-in renderer renders turn 1 as rlray's engines do and bridges turn 2
    after a completion whose text would not re-encode to its ids (a special token mid-answer)."""
    from rlray.actors.server import PLAIN_CHAT_TEMPLATE
    from rlray.data.tokenizer import char_tokenizer
    from rlray.envs.base import render_prompt
    from rlray.envs.tool_calls import v1_tool_format

    tok = char_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    byte_tokenizer().save_pretrained(tmp_path / "bytes")
    completion = [*tok("cb", add_special_tokens=False)["input_ids"], tok.bos_token_id, tok.eos_token_id]
    args = {"tokenizer": str(tmp_path / "tok"), "bytes": str(tmp_path / "bytes"), "template": PLAIN_CHAT_TEMPLATE,
            "completion": completion}
    python = v1.python(EnvConfig())
    done = subprocess.run([python, "-c", textwrap.dedent(ADAPTER_CHECK), json.dumps(args)], capture_output=True,
                          text=True, timeout=300, cwd=v1.REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["adapted"] and out["vllm_032"] == [-1.5] and out["later"] == [-2.5]
    first = render_prompt(tok, [{"role": "user", "content": "rev:abc="}], PLAIN_CHAT_TEMPLATE)
    assert out["first"] == first
    new = render_prompt(tok, [{"role": "user", "content": "rev:xy="}], PLAIN_CHAT_TEMPLATE)[1:]  # no second bos
    assert out["bridged"] == [*first, *completion, *new] and not any(out["mask"])
    # tools: none without a parser (renderers' TrainClient refuses a request with tools then); the plain
    # template's `name(args)` calls parsed with tool_format=rlray, a plain reply left as content
    assert out["tools"] == [False, True]
    assert out["call"] == [["bash", {"command": "sed -i s,-,+, f.py"}, "ok"]] and out["plain"] == ["done", []]
    # a real model's format: vLLM's parser named, renderers' parser of that format parses the v1 harness's calls
    assert [v1_tool_format(p) for p in ("rlray", "hermes", "qwen3_coder", "glm45", "llama3_json", None)] == \
        ["rlray", "qwen3", "qwen3.5", "glm", None, None]
    assert out["hermes"] == [True, [["bash", {"command": "ls -la"}]]], out["hermes"]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (every text encodes) with hermes' tool-call tokens, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    return fast


def test_a_sessions_later_turns_sample_with_their_own_seed_within_the_context_left() -> None:
    """The server's per-session turn rule (rlray.actors.server): turn k of an `X-Session-ID` samples with
    seed + TURN_SEED_STRIDE k, and max_tokens cut to max_model_len minus its prompt; the request's own
    parameters are left as they came."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from rlray.actors.server import _VersionTracking
    from rlray.envs.client import TURN_SEED_STRIDE

    tracking = _VersionTracking(SimpleNamespace(llm=SimpleNamespace(model_config=SimpleNamespace(max_model_len=100))))
    asked = SamplingParams(seed=7, max_tokens=50)
    turns, first = tracking._session_turn("s", {"prompt_token_ids": [1] * 20}, asked)
    assert first is asked and len(turns) == 0
    turns.append({})  # generate records each turn
    _, second = tracking._session_turn("s", {"prompt_token_ids": [1] * 70}, asked)
    assert (second.seed, second.max_tokens) == (7 + TURN_SEED_STRIDE, 30) and (asked.seed, asked.max_tokens) == (7, 50)
    _, other = tracking._session_turn("t", {"prompt_token_ids": [1] * 70}, SamplingParams(max_tokens=10))
    assert (other.seed, other.max_tokens) == (None, 10)
