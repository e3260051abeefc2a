"""Pins every transformers and vLLM internal that rlray's adapters use (rlray.parallel.hf and the
CPU MoE repack in rlray.weightsync.transport), so an upgrade that moves one fails here, by name."""

from __future__ import annotations

import inspect

import pytest
import torch

from rlray.config import ModelConfig
from rlray.models import tiny
from rlray.parallel.expert import moe_experts


def test_transformers_expert_parallel_pieces() -> None:
    from transformers.distributed.tensor_parallel import EpDispatchExpertsParallel, MoEParamShard

    assert list(inspect.signature(MoEParamShard.__init__).parameters)[1:] == ["placement", "shards_expert_dim"]
    assert list(inspect.signature(MoEParamShard.shard_param).parameters)[1:] == ["module", "param", "mesh"]
    params = inspect.signature(EpDispatchExpertsParallel.install_forward).parameters
    assert list(params)[1:3] == ["module", "ep_mesh"]


@pytest.mark.parametrize("arch", ["glm4_moe", "qwen3_moe"])
def test_fused_experts_layout_and_router_signature(arch: str) -> None:
    from transformers import AutoModelForCausalLM

    from rlray.data.tokenizer import char_tokenizer

    cfg = ModelConfig(arch=arch, num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1,
                      moe_intermediate_size=32, num_experts=4)
    tok = char_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny.tiny_architecture(cfg, len(tok), tok))
    (name, experts), *_ = moe_experts(model)
    assert name.endswith("mlp.experts") and experts.num_experts == 4
    assert tuple(experts.gate_up_proj.shape) == (4, 64, 64) and tuple(experts.down_proj.shape) == (4, 64, 32)
    gate = model.get_submodule(name.rsplit(".", 1)[0] + ".gate")
    logits, weights, indices = gate(torch.randn(3, 64))  # the experts module is called with (x, indices, weights)
    assert logits.shape == (3, 4) and weights.shape == indices.shape == (3, 2)
    assert callable(model._init_weights) and model.model.rotary_emb._non_persistent_buffers_set


def test_attention_interface_and_sdpa_pieces() -> None:
    """A registered attention function is what the model calls, with no mask built for it;
    transformers' SDPA function and torch's autograd all-gather keep their signatures."""
    from torch.distributed._functional_collectives import all_gather_single_autograd
    from transformers import AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rlray.data.tokenizer import char_tokenizer
    from rlray.parallel.hf import register_attention, sdpa_attention

    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool).tril()[None, None]
        return sdpa_attention(module, query, key, value, mask, **kwargs)

    register_attention("rlray_test_spy", spy)
    tok = char_tokenizer()
    cfg = tiny.tiny_architecture(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1), len(tok), tok)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="rlray_test_spy")
    ids = torch.randint(4, len(tok), (1, 6))
    ours = model(input_ids=ids, position_ids=torch.arange(6)[None], use_cache=False).logits
    assert seen == [None]  # called once per layer, and handed no mask of transformers' own
    model.set_attn_implementation("sdpa")
    plain = model(input_ids=ids, use_cache=False).logits  # the causal mask, as the spy built it
    torch.testing.assert_close(ours, plain)
    assert list(inspect.signature(sdpa_attention_forward).parameters)[:5] == [
        "module", "query", "key", "value", "attention_mask"]
    assert list(inspect.signature(all_gather_single_autograd).parameters)[:3] == ["self", "gather_dim", "group"]


def test_attention_choice(monkeypatch) -> None:
    """Packed attention on CPU; flash-attn's varlen kernels on GPU when installed and the compute is
    16-bit (flash-attn refuses float32); cp's own under cp."""
    import importlib.util

    from rlray.models.attention import PACKED
    from rlray.models.load import CP_ATTENTION, attention_for
    from rlray.parallel.dims import ParallelDims

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert attention_for(cpu, ParallelDims(2)) == PACKED
    assert attention_for(cpu, ParallelDims(2, cp=2)) == attention_for(gpu, ParallelDims(2, cp=2)) == CP_ATTENTION
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "flash_attn" else real(name))
    assert attention_for(gpu, ParallelDims(2)) == PACKED
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else real(name))
    assert attention_for(gpu, ParallelDims(2), "bfloat16") == attention_for(gpu, ParallelDims(2), "float16") \
        == "flash_attention_2"
    assert attention_for(gpu, ParallelDims(2), "float32") == attention_for(cpu, ParallelDims(2), "bfloat16") == PACKED
    assert attention_for(gpu, ParallelDims(2), "bfloat16", sinks=True) == PACKED  # gpt-oss: no flash, no hub kernel


def _gpt_oss(**extra: int):
    from transformers import AutoModelForCausalLM

    from rlray.data.tokenizer import char_tokenizer

    tok = char_tokenizer()
    cfg = ModelConfig(arch="gpt_oss", num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1,
                      moe_intermediate_size=32, num_experts=4)
    return AutoModelForCausalLM.from_config(tiny.tiny_architecture(cfg, len(tok), tok), **extra)


def test_gpt_oss_experts_shard_their_biases_and_its_router_has_a_bias() -> None:
    """Every parameter of gpt-oss's experts leads with the expert count, its biases included (transformers'
    own EP plan shards them too); its experts are (E, H, 2I) and (E, I, H), its router `.router` a biased
    linear returning (logits, weights, indices)."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig

    from rlray.parallel.hf import expert_sharded

    model = _gpt_oss()
    (name, experts), *_ = moe_experts(model)
    assert expert_sharded(experts) == ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"]
    assert tuple(experts.gate_up_proj.shape) == (4, 64, 64) and tuple(experts.down_proj.shape) == (4, 32, 64)
    assert tuple(experts.gate_up_proj_bias.shape) == (4, 64) and tuple(experts.down_proj_bias.shape) == (4, 64)
    plan = {k.rsplit(".", 1)[-1] for k, v in GptOssConfig.base_model_ep_plan.items() if v == "grouped_gemm"}
    assert plan == set(expert_sharded(experts))
    router = model.get_submodule(name.rsplit(".", 1)[0] + ".router")
    logits, weights, indices = router(torch.randn(3, 64))
    assert router.bias.shape == (4,) and logits.shape == (3, 4) and weights.shape == indices.shape == (3, 2)


def test_gpt_oss_eager_attention_reads_the_sinks_and_gets_the_window() -> None:
    """rlray.parallel.hf.eager_attention is gpt-oss's own eager function, which reads `module.sinks`; gpt-oss's
    attention hands an attention function `sliding_window` (4 on its sliding layers, None on full ones) and
    `scaling`, which packed attention reads (rlray.models.attention)."""
    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gpt_oss import modeling_gpt_oss

    from rlray.models.attention import window_mask
    from rlray.parallel.hf import eager_attention, register_attention

    seen: list[dict] = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(kwargs)
        return eager_attention(module, query, key, value, window_mask(query.shape[2], kwargs["sliding_window"],
                                                                       query.dtype, query.device), **kwargs)

    register_attention("rlray_test_sinks", spy)
    model = _gpt_oss(attn_implementation="rlray_test_sinks")
    ids = torch.randint(4, 40, (1, 9))
    with torch.no_grad():
        ours = model(input_ids=ids, use_cache=False).logits
        model.set_attn_implementation("eager")
        torch.testing.assert_close(ours, model(input_ids=ids, use_cache=False).logits, rtol=0, atol=0)
    assert [k["sliding_window"] for k in seen] == [4, None] and all("scaling" in k for k in seen)
    params = list(inspect.signature(modeling_gpt_oss.eager_attention_forward).parameters)
    assert params[:7] == ["module", "query", "key", "value", "attention_mask", "scaling", "dropout"]
    attn = model.model.layers[0].self_attn
    q, k, v = torch.randn(1, 2, 9, 32), torch.randn(1, 1, 9, 32), torch.randn(1, 1, 9, 32)
    before = eager_attention(attn, q, k, v, None, scaling=0.2)[0]
    with torch.no_grad():
        attn.sinks.add_(1.0)
    assert not torch.allclose(eager_attention(attn, q, k, v, None, scaling=0.2)[0], before)
    rule = sliding_window_causal_mask_function(4)  # transformers' window: q - 4 < k <= q
    want = rule(0, 0, torch.arange(9)[:, None], torch.arange(9)[None, :])
    assert torch.equal(window_mask(9, 4, torch.float32, torch.device("cpu"))[0, 0] == 0, want)


def test_qwen3_vl_moe_checkpoints_hold_transposed_experts() -> None:
    from rlray.parallel.hf import experts_transposed_on_disk

    assert experts_transposed_on_disk("qwen3_vl_moe")
    assert not any(experts_transposed_on_disk(t) for t in ("qwen3_moe", "glm4_moe", "glm4v_moe", "qwen3_vl", "qwen3"))


@pytest.mark.parametrize("hooked", [False, True])
def test_glm45v_layers_get_the_text_positions_only_through_the_hooks(hooked: bool) -> None:
    """transformers' GLM-4.5V text model passes its layers the 3 rotary rows as `position_ids` (what packed
    attention would read sequence bounds from); with rlray's hooks each layer gets row 0, the text positions.
    If the unhooked case starts seeing 2-D text positions, transformers fixed it and the hooks can go."""
    from transformers import AutoModelForImageTextToText

    from rlray.models.vision import VISION_ARCHS, vision_tokenizer
    from rlray.parallel.hf import text_positions_to_layers

    cfg = ModelConfig(arch="glm4v_moe", num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, moe_intermediate_size=16)
    model = AutoModelForImageTextToText.from_config(VISION_ARCHS["glm4v_moe"].config(cfg, vision_tokenizer("glm4v_moe")))
    if hooked:
        text_positions_to_layers(model)
    seen: list[torch.Tensor] = []
    model.model.language_model.layers[1].register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["position_ids"]), with_kwargs=True)
    text = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])  # two packed sequences
    rope = torch.stack([text, text + 10, text + 20])  # rows 1-3 of the [4, B, T] positions
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), position_ids=torch.cat([text[None], rope]))
    assert torch.equal(seen[0], text) if hooked else seen[0].shape == (3, 1, 7)


def test_checkpoint_sources_follow_transformers_renames_and_expert_merges() -> None:
    from transformers import AutoModelForCausalLM

    from rlray.data.tokenizer import char_tokenizer
    from rlray.parallel.hf import checkpoint_sources

    tok = char_tokenizer()

    def meta(arch: str) -> torch.nn.Module:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(tiny.tiny_architecture(ModelConfig(arch=arch, num_layers=2), len(tok), tok))

    experts = lambda prefix, part: [f"{prefix}.{e}.{part}.weight" for e in range(4)]
    nemotron = ["backbone.embeddings.weight", "lm_head.weight", *experts("backbone.layers.1.mixer.experts", "up_proj"),
                *experts("backbone.layers.1.mixer.experts", "down_proj")]
    renamed, merged = checkpoint_sources(meta("nemotron_h"), reversed(nemotron))
    assert renamed == {"model.embeddings.weight": "backbone.embeddings.weight"}  # lm_head keeps its name
    assert merged == {"model.layers.1.mixer.experts.up_proj": [experts("backbone.layers.1.mixer.experts", "up_proj")],
                      "model.layers.1.mixer.experts.down_proj": [experts("backbone.layers.1.mixer.experts", "down_proj")]}
    qwen = [*experts("model.layers.0.mlp.experts", "gate_proj"), *experts("model.layers.0.mlp.experts", "up_proj"),
            "model.layers.0.mlp.experts.gate_up_proj"]  # a fused tensor under its own name is read as it is
    renamed, merged = checkpoint_sources(meta("qwen3_moe"), qwen)
    assert renamed == {} and merged == {"model.layers.0.mlp.experts.gate_up_proj": [
        experts("model.layers.0.mlp.experts", "gate_proj"), experts("model.layers.0.mlp.experts", "up_proj")]}


def test_transformers_unpacks_mxfp4_as_the_format_says() -> None:
    """`dequantize_mxfp4` is transformers' `convert_moe_packed_tensors` (its `Mxfp4Config(dequantize=True)` load):
    blocks and scales packed by tests/mxfp4.py from the format's definition come back exactly, in fp32, (E, n, R)."""
    from rlray.parallel.hf import dequantize_mxfp4
    from tests.mxfp4 import pack_mxfp4

    w = torch.randn(3, 64, 10, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 10)
    blocks, scales, values = pack_mxfp4(w)
    out = dequantize_mxfp4(blocks, scales)
    assert out.dtype == torch.float32 and torch.equal(out, values)
    assert 0 < (values - w).abs().max() < w.abs().max() / 4  # rounded, not copied


def test_checkpoint_tensors_revert_one_layer_and_a_block_of_experts() -> None:
    """`checkpoint_tensors` is transformers' `revert_weight_conversion` on part of a state dict (the streamed export's
    unit): a block of 2 fused experts comes back per expert, counted from 0, gate_up_proj's rows split gate then up;
    other names pass through (Nemotron-H's `model.` -> `backbone.`), meta tensors too; gpt-oss's fused experts stay
    fused (so do Qwen3-VL-MoE's, in transformers' layout: the export transposes them, tests/dist/test_hf_export.py)."""
    from transformers import AutoModelForCausalLM

    from rlray.data.tokenizer import char_tokenizer
    from rlray.parallel.hf import checkpoint_tensors

    tok = char_tokenizer()

    def meta(arch: str) -> torch.nn.Module:
        config = tiny.tiny_architecture(ModelConfig(arch=arch, num_layers=2), len(tok), tok)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)

    gate_up = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3)
    experts = "model.layers.1.mlp.experts"
    layer = {f"{experts}.gate_up_proj": gate_up, f"{experts}.down_proj": torch.zeros(2, 3, 4),
             "model.layers.1.self_attn.q_proj.weight": torch.ones(8, 8)}
    out = checkpoint_tensors(meta("qwen3_moe"), layer)
    per_expert = {f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in (0, 1) for p in ("gate", "up", "down")}
    assert out.keys() == per_expert | {"model.layers.1.self_attn.q_proj.weight"}
    assert torch.equal(out["model.layers.1.mlp.experts.1.up_proj.weight"], gate_up[1, 4:])
    assert torch.equal(out["model.layers.1.mlp.experts.0.gate_proj.weight"], gate_up[0, :4])
    nemotron = {"model.layers.1.mixer.experts.up_proj": torch.empty(2, 8, 3, device="meta"),
                "model.embeddings.weight": torch.empty(5, 3, device="meta")}
    on_meta = {k: tuple(v.shape) for k, v in checkpoint_tensors(meta("nemotron_h"), nemotron).items()}
    assert on_meta == {"backbone.layers.1.mixer.experts.0.up_proj.weight": (8, 3),
                       "backbone.layers.1.mixer.experts.1.up_proj.weight": (8, 3), "backbone.embeddings.weight": (5, 3)}
    fused = {"model.layers.0.mlp.experts.gate_up_proj": torch.empty(4, 3, 8, device="meta")}
    assert {k: v.shape for k, v in checkpoint_tensors(meta("gpt_oss"), fused).items()} == {k: (4, 3, 8) for k in fused}
