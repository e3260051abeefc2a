"""TurnBridge: the next turn's prompt ids from the previous turn's ids and the new messages only.

Each expectation is written by hand from the template's text, or is the full re-render of a
conversation whose sampled ids decode and re-encode exactly (where both must agree).
"""

from __future__ import annotations

import pytest

from rlray.actors.server import PLAIN_CHAT_TEMPLATE
from rlray.data.tokenizer import char_tokenizer
from rlray.envs.bridge import BridgeError, TurnBridge

TOK = char_tokenizer()
EOS = TOK.eos_token_id
BOS = TOK.bos_token_id

# ChatML-like on the character vocabulary: an assistant turn ends with eos then a space.
CHATML = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}a:{% endif %}")
# GLM-like: no end of turn; the eos the model samples is also the marker that opens a user turn.
GLM = ("{% for m in messages %}{% if m['role'] == 'assistant' %}a:{{ m['content'] }}"
       "{% else %}<|im_end|>u:{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
# Thinking, as Qwen3 and GLM-4.5 behave: the generation prompt opens a reasoning block ("think:"), and
# an earlier assistant turn is rendered without it (only what follows its last "." is kept).
THINK = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
         "a:{{ m['content'].split('.')[-1] }}<|im_end|>{% else %}u:{{ m['content'] }}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}a:think:{% endif %}")


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_plain_template_matches_the_full_render_of_an_exact_conversation() -> None:
    b = TurnBridge(TOK, PLAIN_CHAT_TEMPLATE)
    assert b.end_of_turn == [EOS]
    prompt = b.render([user("rev:abc=")], None, True)
    assert prompt == [BOS, *ids("rev:abc=")]
    completion = [*ids("cba"), EOS]
    got = b.next_prompt(prompt, completion, [user("again:")])
    assert got == [BOS, *ids("rev:abc=cba"), EOS, *ids("again:")]
    assert got == b.render([user("rev:abc="), {"role": "assistant", "content": "cba"}, user("again:")], None, True)


def test_tool_results_follow_the_sampled_tool_call() -> None:
    b = TurnBridge(TOK, PLAIN_CHAT_TEMPLATE)
    prompt = b.render([user("c:1+2=")], None, True)
    completion = [*ids("calc(1+2)"), EOS]
    tool = {"role": "tool", "content": "3", "tool_call_id": "call_0"}
    assert b.next_prompt(prompt, completion, [tool]) == [*prompt, *completion, *ids("3")]


def test_the_rest_of_the_end_of_turn_follows_the_sampled_stop_token() -> None:
    b = TurnBridge(TOK, CHATML)
    assert b.end_of_turn == [EOS, *ids(" ")]
    prompt = b.render([user("hi")], None, True)
    assert prompt == ids("u:hi") + [EOS] + ids(" a:")
    got = b.next_prompt(prompt, [*ids("yo"), EOS], [user("ok")])
    assert got == [*prompt, *ids("yo"), EOS, *ids(" u:ok"), EOS, *ids(" a:")]
    # a turn that ended on a stop string (no stop token) gets the whole end of turn
    assert b.next_prompt(prompt, ids("yo"), [user("ok")]) == [*prompt, *ids("yo"), EOS, *ids(" u:ok"), EOS,
                                                              *ids(" a:")]


def test_a_stop_token_that_opens_the_next_message_is_not_written_twice() -> None:
    b = TurnBridge(TOK, GLM)
    assert b.end_of_turn == []
    prompt = b.render([user("hi")], None, True)
    got = b.next_prompt(prompt, [*ids("yo"), EOS], [user("ok")])
    assert got == [*prompt, *ids("yo"), EOS, *ids("u:ok"), *ids("a:")]
    assert got == b.render([user("hi"), {"role": "assistant", "content": "yo"}, user("ok")], None, True)


def test_earlier_reasoning_stays_as_sampled_under_a_thinking_template() -> None:
    b = TurnBridge(TOK, THINK)
    prompt = b.render([user("q")], None, True)
    assert prompt == [BOS, *ids("u:qa:think:")]
    completion = [*ids("hmm.42"), EOS]
    got = b.next_prompt(prompt, completion, [user("no")])
    assert got == [BOS, *ids("u:qa:think:hmm.42"), EOS, *ids("u:noa:think:")]
    rerendered = b.render([user("q"), {"role": "assistant", "content": "hmm.42"}, user("no")], None, True)
    assert rerendered == [BOS, *ids("u:qa:42"), EOS, *ids("u:noa:think:")]  # what re-rendering would feed


def test_a_template_that_rewrites_the_last_assistant_message_is_refused() -> None:
    odd = ("{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}a:{{ m['content'] }}"
           "{% elif m['role'] == 'assistant' %}a:-{{ m['content'] }}{% else %}u:{{ m['content'] }}{% endif %}"
           "{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
    b = TurnBridge(TOK, odd)
    with pytest.raises(BridgeError, match="differently once messages follow"):
        b.next_prompt(b.render([user("q")], None, True), [*ids("x"), EOS], [user("no")])


def test_a_template_without_assistant_content_is_refused() -> None:
    with pytest.raises(BridgeError, match="env.chat_template"):
        TurnBridge(TOK, "{% for m in messages %}{{ m['role'] }}{% endfor %}")
