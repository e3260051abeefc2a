"""LoRA without processes: targets and their errors on the real architectures, names on the wire, the
config's one-line errors, the plan's memory, the workers' adapter updates, and a pin on every vLLM
LoRA attribute rlray.weightsync.lora uses."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlray.config import ConfigError, LoraConfig, ModelConfig, validate
from rlray.data.tokenizer import char_tokenizer
from rlray.models.lora import (
    adapted_modules,
    adapter_config,
    adapter_params,
    apply_lora,
    checkpoint_name,
    is_adapter,
    lora_targets,
    peft_name,
)
from rlray.models.tiny import tiny_architecture
from tests.unit.test_plan import composed

vllm = pytest.importorskip("vllm")


def meta_model(arch: str) -> torch.nn.Module:
    tok = char_tokenizer()
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_architecture(ModelConfig(arch=arch, num_layers=2), len(tok), tok))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "glm4_moe", "nemotron_h"])
def test_default_targets_are_attention_and_dense_mlps_never_experts(arch: str) -> None:
    model = meta_model(arch)
    targets = apply_lora(model, LoraConfig(rank=4))
    leaves = {t.rpartition(".")[2] for t in targets}
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= leaves
    assert not any(".experts" in t for t in targets), targets
    assert ("gate_proj" in leaves) == (arch in ("qwen3", "glm4_moe"))  # GLM: its dense first layer and shared experts
    if arch in ("glm4_moe", "nemotron_h"):  # Nemotron-H: the shared experts' up/down (its experts have no gate)
        assert any(".shared_experts." in t for t in targets)
    assert not leaves & {"in_proj", "out_proj"}  # Nemotron-H's Mamba projections: not a default target
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter(n) for n in trainable)
    assert adapted_modules(model) == targets
    count = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
    assert count == adapter_params(meta_model(arch), LoraConfig(rank=4))


def test_latent_attention_takes_adapters_on_its_low_rank_projections() -> None:
    """DeepSeek-V3's MLA has no q/k/v_proj: its record's targets are the query's and the latent's down and up
    projections and the output; its dense first layer and shared experts take them too, its routed experts never."""
    model = meta_model("deepseek_v3")
    targets = apply_lora(model, LoraConfig(rank=4))
    attn = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    assert {t for t in targets if t.startswith("model.layers.0.self_attn.")} == {f"model.layers.0.self_attn.{n}"
                                                                                 for n in attn}
    assert {t.rpartition(".")[2] for t in targets} == {*attn, "gate_proj", "up_proj", "down_proj"}
    assert any(t.startswith("model.layers.0.mlp.") for t in targets) and any(".shared_experts." in t for t in targets)
    assert not any(".experts." in t or t.endswith(".gate") for t in targets), targets


def test_target_errors_name_the_key_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"trainer.lora.target_modules: \['gate_proj'\] match no linear layer"):
        lora_targets(meta_model("qwen3_moe"), LoraConfig(rank=4, target_modules=["q_proj", "gate_proj"]))
    with pytest.raises(ValueError, match=r"trainer.lora.rank=100 is larger than .*k_proj \(64 on its smaller side\)"):
        lora_targets(meta_model("qwen3"), LoraConfig(rank=100))


def test_names_on_the_wire() -> None:
    assert is_adapter("model.layers.0.self_attn.q_proj.lora_A.default.weight")
    assert not is_adapter("model.layers.0.self_attn.q_proj.base_layer.weight")
    assert checkpoint_name("model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert peft_name("model.layers.0.mlp.up_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    config = adapter_config(LoraConfig(rank=8, alpha=16.0), ["model.layers.0.self_attn.q_proj",
                                                            "model.layers.1.self_attn.q_proj"], "/base")
    assert config["r"] == 8 and config["target_modules"] == ["q_proj"] and config["base_model_name_or_path"] == "/base"


@pytest.mark.parametrize("overrides, message", [
    (["trainer.lora.rank=-1"], "trainer.lora.rank=-1 must be >= 0"),
    (["trainer.lora.rank=8", "trainer.lora.dropout=0.1"], "trainer.lora.dropout=0.1: RL needs 0"),
    (["trainer.lora.rank=8", "weights.delta=true"], "weights.delta=true with trainer.lora.rank > 0"),
    (["trainer.lora.rank=8", "trainer.lora.base_dtype=bfloat16"], "the sft stage trains the full weights"),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=[]"], "trainer.lora.target_modules is empty"),
    (["trainer.lora.rank=1000"], "vLLM serves adapters up to rank 512"),
])
def test_bad_lora_config_is_one_line_before_ray(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        validate(composed(*overrides))
    assert "\n" not in str(e.value)


def test_lora_on_an_moe_model_needs_gpu_engines() -> None:
    from rlray.orchestration.plan import make_plan

    problems = make_plan(composed("+recipe=tiny_moe", "trainer.lora.rank=8")).problems()
    assert any(p.startswith("trainer.lora.rank=8 with the MoE model") for p in problems), problems


def test_the_base_is_float32_when_sft_trains_it_else_the_compute_dtype() -> None:
    assert composed("trainer.lora.rank=8").trainer.lora.base_dtype == "float32"
    c = composed("trainer.lora.rank=8", "stages=[rl]", "trainer.param_dtype=bfloat16")
    assert c.trainer.lora.base_dtype == "bfloat16"


def test_the_plan_counts_a_frozen_base_and_fp32_adapters() -> None:
    from rlray.orchestration.plan import make_plan

    full = make_plan(composed("+recipe=qwen3_moe"))
    lora = make_plan(composed("+recipe=qwen3_moe", "trainer.lora.rank=16"))
    p, a, n = lora.shape.params, lora.shape.lora_params, lora.c.trainer.num_ranks
    assert 0 < a < p / 100
    assert lora.trainer["bfloat16 base"] == pytest.approx(2 * p / n)
    assert lora.trainer["AdamW state"] == pytest.approx(8 * a / n)
    assert sum(lora.trainer.values()) < sum(full.trainer.values())
    assert lora.ranks_to_fit() < full.ranks_to_fit()
    assert "LoRA: rank 16" in lora.render() and f"fits on {lora.ranks_to_fit()} trainer GPUs" in lora.render()
    recipe = make_plan(composed("+recipe=qwen3_moe_lora"))  # the LoRA variant: one trainer node, not two
    assert not recipe.problems() and recipe.c.trainer.num_ranks == 8 < full.c.trainer.num_ranks
    assert recipe.gpus == full.gpus - 8 and recipe.c.trainer.lora.base_dtype == "bfloat16"


class Loads:
    """A stand-in weight-transfer engine: base weights go to `self.model.load_weights` between a
    start and a finish that open and close a reload."""

    def __init__(self) -> None:
        self.model, self.model_config, self.calls = self, None, []

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def finish_weight_update(self) -> None:
        self.calls.append("finish")

    def load_weights(self, weights: object) -> None:
        self.calls.append("load")

    def set_weight_update_target(self, model: object, model_config: object) -> None:
        self.model = model


def test_an_announced_adapter_update_is_kept_not_loaded() -> None:
    from rlray.weightsync.lora import AdapterUpdates

    engine = type("Engine", (AdapterUpdates, Loads), {})()
    engine.start_weight_update()
    engine.model.load_weights([("w", torch.ones(2))])
    engine.finish_weight_update()
    assert engine.calls == ["start", "load", "finish"] and engine.adapter is None  # base weights, as before
    engine.set_weight_update_target(engine, None)
    engine.expect_adapter({"r": 8})
    engine.start_weight_update()
    buffer = torch.ones(2)
    engine.model.load_weights([("base_model.model.x.lora_A.weight", buffer)])
    buffer.zero_()  # receive buffers are reused: the adapter keeps a copy
    engine.finish_weight_update()
    assert engine.calls == ["start", "load", "finish"]  # no reload opened or closed
    config, tensors = engine.adapter
    assert config == {"r": 8} and tensors["base_model.model.x.lora_A.weight"].tolist() == [1.0, 1.0]
    engine.set_weight_update_target(engine, None)
    engine.start_weight_update()  # the announcement covers one update
    assert engine.calls[-1] == "start"


def test_vllm_lora_pieces_rlray_uses() -> None:
    """Each vLLM attribute rlray.weightsync.lora relies on, as vLLM 0.32 has it."""
    from vllm.config.lora import MaxLoRARanks
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager
    from vllm.v1.worker.gpu_worker import Worker

    from rlray.weightsync.lora import (
        LORA_ID,
        LORA_NAME,
        LORA_PATH,
        MAX_RANKS,
        _servable_modules,
        lora_request,
    )
    from rlray.weightsync.nccl_lora import NCCLAdapterWeightTransferEngine

    assert MaxLoRARanks.__args__ == MAX_RANKS
    # why the adapter is served from memory: every update ends by dropping the adapters
    assert "reset_lora_state()" in inspect.getsource(Worker.finish_weight_update)
    assert "self._load_adapter(lora_request)" in inspect.getsource(LRUCacheWorkerLoRAManager.add_adapter)
    init = inspect.getsource(WorkerLoRAManager.__init__)
    assert all(f"self.{a}" in init for a in ("max_position_embeddings", "lora_config", "vocab_size", "_lora_model_cls"))
    assert "self._adapter_manager = " in inspect.getsource(WorkerLoRAManager.create_lora_manager)
    assert {"lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size", "weights_mapper",
            "skip_prefixes"} <= set(inspect.signature(LoRAModel.from_lora_tensors).parameters)
    assert callable(PEFTHelper.from_dict) and callable(PEFTHelper.validate_legal)
    manager_attributes = set(re.findall(r"self\.(\w+)", inspect.getsource(LoRAModelManager.__init__)))
    assert {"modules", "packed_modules", "packed_modules_mapping", "model"} <= manager_attributes
    request = lora_request()
    assert isinstance(request, LoRARequest) and (request.lora_name, request.lora_int_id, request.lora_path) == (
        LORA_NAME, LORA_ID, LORA_PATH) and not request.load_inplace
    # vLLM's engines load what they receive through self.model.load_weights (the sink stands in for it)
    assert "self.model.load_weights" in inspect.getsource(NCCLWeightTransferEngine.receive_weights)
    assert callable(WeightTransferEngine.set_weight_update_target)
    assert NCCLAdapterWeightTransferEngine.start_weight_update.__qualname__ == "AdapterUpdates.start_weight_update"
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does: GPU engines serving LoRA get "rlray_nccl"
    assert WeightTransferEngineFactory._registry["rlray_nccl"]() is NCCLAdapterWeightTransferEngine
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    manager = SimpleNamespace(_adapter_manager=SimpleNamespace(
        modules={"model.layers.0.self_attn.qkv_proj": None, "model.layers.0.self_attn.o_proj": None},
        packed_modules={}, packed_modules_mapping=packed))
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"} <= _servable_modules(manager)
    assert "model.layers.0.mlp.experts" not in _servable_modules(manager)


def test_vllms_nccl_engine_with_the_adapter_mixin_keeps_an_adapter_and_loads_base_weights(monkeypatch) -> None:
    """The GPU path on CPU: vLLM's own NCCL worker engine (its receive loop, one broadcast per tensor,
    the CUDA stream stubbed) under rlray's mixin: an announced adapter lands in the kept copy, not
    in the model; the next update, unannounced, loads into the model as vLLM's engine does."""
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferEngine,
        NCCLWeightTransferUpdateInfo,
    )

    from rlray.weightsync.nccl_lora import NCCLAdapterWeightTransferEngine

    class Group:  # stands in for vLLM's PyNcclCommunicator: the trainer's rank 0 sent 7s
        def broadcast(self, tensor: torch.Tensor, src: int, stream: object = None) -> None:
            tensor.fill_(7.0)

    class Model:
        def __init__(self) -> None:
            self.loaded: list[str] = []

        def load_weights(self, weights: object) -> None:
            self.loaded += [name for name, _ in weights]

    model = Model()
    engine = NCCLAdapterWeightTransferEngine(None, SimpleNamespace(parallel_config=None, model_config=None),
                                             torch.device("cpu"), model)
    engine.model_update_group = Group()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    # vLLM's own start/finish open and close a layerwise reload of a real model: recorded instead
    monkeypatch.setattr(NCCLWeightTransferEngine, "start_weight_update", lambda self: model.loaded.append("start"))
    monkeypatch.setattr(NCCLWeightTransferEngine, "finish_weight_update", lambda self: model.loaded.append("finish"))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    update = NCCLWeightTransferUpdateInfo(names=[name], dtype_names=["float32"], shapes=[[4, 8]])
    engine.expect_adapter({"r": 4})
    engine.start_weight_update()
    engine.receive_weights(update)
    engine.finish_weight_update()
    engine.reset_weight_update_target()  # what vLLM's worker does after finish
    config, tensors = engine.adapter
    assert model.loaded == [] and config == {"r": 4} and tensors[name].shape == (4, 8) and (tensors[name] == 7).all()
    engine.start_weight_update()
    engine.receive_weights(NCCLWeightTransferUpdateInfo(names=["lm_head.weight"], dtype_names=["float32"],
                                                        shapes=[[2, 2]]))
    engine.finish_weight_update()
    assert model.loaded == ["start", "lm_head.weight", "finish"]
