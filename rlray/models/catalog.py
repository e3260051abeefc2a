"""The architectures of the models rlray's recipes name, for planning without the hub, and a checkpoint's config.

Contract: `architecture(name)` returns (a transformers config, where it came from) for a model
name: a local folder (its config.json), an id in `CATALOG` (the hub's config.json values, copied
here so that a dry run and the memory plan work offline), or any other hub id (fetched by
transformers). Training always reads the checkpoint's own config.json; the catalog only sizes the
plan. `read_config(name)` is how every part of rlray reads a checkpoint's config (a folder or a hub id), and
`for_model(model_type, values)` how the catalog builds one: transformers' AutoConfig, except that a model_type
transformers does not know but a family record lists (rlray.config.families: Kimi-K2's `kimi_k2`) is read with
that family's config class, as vLLM reads it (its `_CONFIG_REGISTRY`), without the remote code the checkpoint's
`auto_map` names: the config then says the family's own model_type (`deepseek_v3`). Each entry carries the parameter counts its model card publishes, the rule its active figure
follows (`Counts`), and where the card rounds too coarsely to catch a mistyped dimension, the
checkpoint's exact count: tests/unit/test_plan.py counts every entry on the meta device against them,
so a mistyped dimension fails there. Adding a model is one entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlray.config.families import family, known

# What a card's active figure counts beyond the decoder layers' active parameters: "all" (the embedding and the
# output head too), "head" (the head, a matmul per token, but not the embedding lookup: gpt-oss's table, NVIDIA's
# bare figures), "layers" (neither, nor a vision tower)
Counts = Literal["all", "head", "layers"]

GLM45_AIR = {  # zai-org/GLM-4.5-Air: 106B total, 12B active
    "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "attention_bias": True,
    "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5, "max_position_embeddings": 131072,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "use_qk_norm": False, "rms_norm_eps": 1e-5,
}
# zai-org/GLM-4.5: 355B total (the card's figure counts its multi-token-prediction layer, which transformers does not
# build), 32B active; GLM-4.5-Air's architecture, wider, with query-key norms and 3 dense layers
GLM45 = {**GLM45_AIR, "hidden_size": 5120, "intermediate_size": 12288, "num_hidden_layers": 92,
         "moe_intermediate_size": 1536, "n_routed_experts": 160, "first_k_dense_replace": 3,
         "routed_scaling_factor": 2.5, "use_qk_norm": True}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B: 30.5B total, 3.3B active
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "norm_topk_prob": True,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
}
QWEN3_4B = {  # Qwen/Qwen3-4B: 4.0B, dense (the distill recipe's student)
    "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
}


@dataclass(frozen=True)
class Entry:
    model_type: str
    values: dict[str, Any]
    params: str  # the total its model card publishes, as written there ("106B", "30.5B", "1T")
    active: str  # the parameters per token it publishes
    counts: Counts  # what that figure counts beside the decoder layers
    exact: int | None = None  # the checkpoint's parameters to the unit, as transformers builds it (None: unpublished)
    # the card's total also counts a multi-token-prediction layer that transformers does not build, and matches no
    # count of the config: the total is held to `exact` alone
    total_with_mtp: bool = False


QWEN3_VL_8B = {  # Qwen/Qwen3-VL-8B-Instruct: 8.77B, dense (the vlm recipe's model)
    "text_config": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                        "mrope_interleaved": True}},
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                      "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24], "in_channels": 3,
                      "hidden_act": "gelu_pytorch_tanh"},
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
}
QWEN3_VL_30B_A3B = {  # Qwen/Qwen3-VL-30B-A3B-Instruct: 31.1B total (the hub's count), about 3B active
    "text_config": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
                    "mlp_only_layers": [], "norm_topk_prob": True, "max_position_embeddings": 262144,
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                        "mrope_interleaved": True}},
    "vision_config": {**QWEN3_VL_8B["vision_config"], "out_hidden_size": 2048},
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
}
GLM45V = {  # zai-org/GLM-4.5V: GLM-4.5-Air's language model (12B active) and a 24-block vision tower; 108B on the hub
    "text_config": {**{k: v for k, v in GLM45_AIR.items() if k not in ("rope_theta", "partial_rotary_factor")},
                    "max_position_embeddings": 65536,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                        "mrope_section": [8, 12, 12]}},
    "vision_config": {"depth": 24, "hidden_size": 1536, "intermediate_size": 10944, "num_heads": 12,
                      "out_hidden_size": 4096, "patch_size": 14, "image_size": 336, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "attention_bias": False, "hidden_act": "silu", "in_channels": 3},
    "image_token_id": 151363, "video_token_id": 151364, "image_start_token_id": 151339, "image_end_token_id": 151340,
    "video_start_token_id": 151341, "video_end_token_id": 151342, "tie_word_embeddings": False,
}
_GATED_DELTA_NET = {"full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128}
QWEN3_NEXT_80B = {  # Qwen/Qwen3-Next-80B-A3B-Instruct: 80B total, 3B active; transformers' Qwen3NextConfig documents it
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25,
    **_GATED_DELTA_NET, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "norm_topk_prob": True,
    "max_position_embeddings": 262144, "rope_theta": 10000000.0, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
}
QWEN3_5_35B_A3B = {  # Qwen/Qwen3.5-35B-A3B's language model (the hub checkpoint adds a vision tower): 35B, 3B active
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25, **_GATED_DELTA_NET, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "max_position_embeddings": 32768, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
}
# Nemotron-H: each layer one block, M a Mamba-2 mixer, E an MoE (relu^2 experts, up and down only), * attention
# without RoPE; Super's checkpoint also holds a multi-token-prediction layer (mtp.*), which transformers drops
_NEMOTRON_H = {"vocab_size": 131072, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
               "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128,
               "mamba_ssm_cache_dtype": "float32", "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
               "norm_topk_prob": True, "mlp_hidden_act": "relu2", "use_conv_bias": True, "use_bias": False,
               "max_position_embeddings": 262144, "tie_word_embeddings": False, "layer_norm_epsilon": 1e-5}
NEMOTRON3_NANO = {  # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16: 52 layers, 23 M, 23 E, 6 *
    **_NEMOTRON_H, "hidden_size": 2688, "intermediate_size": 1856, "mamba_num_heads": 64,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "n_routed_experts": 128,
    "num_experts_per_tok": 6, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
    "routed_scaling_factor": 2.5,
}
NEMOTRON3_SUPER = {  # nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16: 88 layers, 40 M, 40 E (latent MoE), 8 *
    **_NEMOTRON_H, "hidden_size": 4096, "intermediate_size": 2688, "mamba_num_heads": 128,
    "hybrid_override_pattern": "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
    "n_routed_experts": 512, "num_experts_per_tok": 22, "moe_intermediate_size": 2688, "moe_latent_size": 1024,
    "moe_shared_expert_intermediate_size": 5376, "routed_scaling_factor": 5.0,
}
# gpt-oss: the hub's configs also hold quantization_config (MXFP4 experts); rlray trains and serves bf16
# (dequantized on load), which is what a build without it counts
GPT_OSS_20B = {  # openai/gpt-oss-20b: 24 layers alternating a 128-token window and full attention, with sinks
    "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "sliding_window": 128,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "attention_bias": True,
    "num_local_experts": 32, "num_experts_per_tok": 4, "swiglu_limit": 7.0, "max_position_embeddings": 131072,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
    "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "layer_types": ["sliding_attention", "full_attention"] * 18,
                "num_local_experts": 128}  # openai/gpt-oss-120b
# DeepSeek-V3's multi-head latent attention: queries through a rank-1536 latent, keys and values through one latent
# of 512 per token plus a 64-wide rope key shared by every head (what an engine caches); per head 128 + 64 query and
# key widths, 128 value. The hub's checkpoints ship FP8 blocks (quantization_config: e4m3 weights, a scale per
# 128 x 128 block) and a multi-token-prediction layer (num_nextn_predict_layers: model.layers.61), which
# transformers builds neither of: the catalog counts the main model in the checkpoints' bf16 (their torch_dtype)
_FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3: 671B (the card's 685B counts the 14B MTP layer), 37B active
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6, "quantization_config": _FP8_BLOCKS,
}
KIMI_K2 = {  # moonshotai/Kimi-K2-Instruct: 1T, 32B active; DeepSeek-V3's architecture with 64 heads, 384 experts
    **DEEPSEEK_V3, "vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
    "routed_scaling_factor": 2.827, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "max_position_embeddings": 131072, "rope_theta": 50000,
    "rope_scaling": {"type": "yarn", "factor": 32, "original_max_position_embeddings": 4096, "beta_fast": 1,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
CATALOG: dict[str, Entry] = {
    "zai-org/GLM-4.5-Air": Entry("glm4_moe", GLM45_AIR, "106B", "12B", counts="layers"),
    # the card's 355B is no count of this config: transformers' build (no MTP layer) has 352.80B, with the MTP layer
    # (a decoder layer, its 2H x H projection and norms, sharing embedding and head) 356.79B; its exact count holds
    # every width, and the 32B active figure (32.08B by the layers rule) is the card's
    "zai-org/GLM-4.5": Entry("glm4_moe", GLM45, "355B", "32B", counts="layers", exact=352_797_814_784,
                             total_with_mtp=True),
    "Qwen/Qwen3-30B-A3B": Entry("qwen3_moe", QWEN3_30B_A3B, "30.5B", "3.3B", counts="all"),
    "Qwen/Qwen3-4B": Entry("qwen3", QWEN3_4B, "4.0B", "4.0B", counts="all"),
    "Qwen/Qwen3-VL-8B-Instruct": Entry("qwen3_vl", QWEN3_VL_8B, "8.77B", "8.77B", counts="all"),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": Entry("qwen3_vl_moe", QWEN3_VL_30B_A3B, "31.1B", "3B",
                                            counts="all"),
    # its active figure is the language model's without embeddings, head and vision tower (the test's rule)
    "zai-org/GLM-4.5V": Entry("glm4v_moe", GLM45V, "108B", "12B", counts="layers"),
    # 2026's gated delta-net hybrids: the cards' active figures leave out embeddings and head (MTP is not counted:
    # transformers drops the checkpoints' mtp.* weights, and the cards quote the main model)
    "Qwen/Qwen3-Next-80B-A3B-Instruct": Entry("qwen3_next", QWEN3_NEXT_80B, "80B", "3B", counts="layers"),
    "Qwen/Qwen3.5-35B-A3B": Entry("qwen3_5_moe_text", QWEN3_5_35B_A3B, "35B", "3B", counts="layers"),
    # Nemotron 3: the cards round to 0.1B and 1B, coarser than a mistyped head_dim moves a model of 6 or 8
    # attention layers, so the exact counts hold them: Nano's is the hub's safetensors total (its 2,944 fp32 router
    # biases are buffers), Super's the BF16 checkpoint's 123,611,012,096 less its MTP layer's 2,942,324,736.
    # Nano's card: 3.2B active, 3.6B including embeddings (counted: 3.23B by the head rule, 3.58B by all); Super's
    # bare 12B follows NVIDIA's head rule (12.23B; all: 12.77B)
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": Entry("nemotron_h", NEMOTRON3_NANO, "31.6B", "3.6B", counts="all",
                                                        exact=31_577_937_344),
    "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16": Entry("nemotron_h", NEMOTRON3_SUPER, "120B", "12B",
                                                           counts="head", exact=120_668_687_360),
    # the gpt-oss model card's table (its summary rounds to 21B / 3.6B and 117B / 5.1B)
    "openai/gpt-oss-20b": Entry("gpt_oss", GPT_OSS_20B, "20.91B", "3.61B", counts="head"),
    "openai/gpt-oss-120b": Entry("gpt_oss", GPT_OSS_120B, "116.83B", "5.13B", counts="head"),
    # the cards' totals round to 1B and 1T: the exact counts (transformers' build, no MTP layer) hold every width
    "deepseek-ai/DeepSeek-V3": Entry("deepseek_v3", DEEPSEEK_V3, "671B", "37B", counts="all", exact=671_026_404_352),
    "moonshotai/Kimi-K2-Instruct": Entry("kimi_k2", KIMI_K2, "1T", "32B", counts="all", exact=1_026_408_209_408),
}


def _family_class(model_type: str | None) -> Any:
    """The config class of a model_type that only a family record knows (None: transformers knows it, or no one)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type is None or model_type in CONFIG_MAPPING or not known(model_type):
        return None
    return getattr(transformers, family(model_type).config_class or "", None)


def for_model(model_type: str, values: dict[str, Any]) -> Any:
    """A transformers config of `model_type` with `values`."""
    from transformers import AutoConfig

    cls = _family_class(model_type)
    return AutoConfig.for_model(model_type, **values) if cls is None else cls(**values)


def read_config(name: str) -> Any:
    """The transformers config of the checkpoint `name` (a folder, or a hub id)."""
    from transformers import AutoConfig, PreTrainedConfig

    values = PreTrainedConfig.get_config_dict(name)[0]
    cls = _family_class(values.get("model_type"))
    if cls is None:
        return AutoConfig.from_pretrained(name)
    return cls.from_dict({k: v for k, v in values.items() if k not in ("model_type", "auto_map")})


def architecture(name: str) -> tuple[Any, str]:
    """(config, where it came from)."""
    if Path(name).is_dir():
        return read_config(name), f"{name}/config.json"
    if name in CATALOG:
        entry = CATALOG[name]
        return for_model(entry.model_type, entry.values), "rlray's catalog of its recipes' models (offline)"
    return read_config(name), f"the hub's {name}/config.json"
