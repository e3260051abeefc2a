"""The architectures of the models rlray's recipes name, for planning without the hub.

Contract: `architecture(name)` returns (a transformers config, where it came from) for a model
name: a local folder (its config.json), an id in `CATALOG` (the hub's config.json values, copied
here so that a dry run and the memory plan work offline), or any other hub id (fetched by
transformers). Training always reads the checkpoint's own config.json; the catalog only sizes the
plan. Each entry carries the parameter counts its model card publishes: tests/unit/test_plan.py
counts every entry on the meta device against them, so a mistyped dimension fails there. Adding a
model is one entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

GLM45_AIR = {  # zai-org/GLM-4.5-Air: 106B total, 12B active
    "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "attention_bias": True,
    "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5, "max_position_embeddings": 131072,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "use_qk_norm": False, "rms_norm_eps": 1e-5,
}
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
    params: str  # the total its model card publishes, as written there ("106B", "30.5B")
    active: str  # the parameters per token it publishes
    active_with_embeddings: bool  # whether that figure counts the embedding and the output head


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
CATALOG: dict[str, Entry] = {
    "zai-org/GLM-4.5-Air": Entry("glm4_moe", GLM45_AIR, "106B", "12B", active_with_embeddings=False),
    "Qwen/Qwen3-30B-A3B": Entry("qwen3_moe", QWEN3_30B_A3B, "30.5B", "3.3B", active_with_embeddings=True),
    "Qwen/Qwen3-4B": Entry("qwen3", QWEN3_4B, "4.0B", "4.0B", active_with_embeddings=True),
    "Qwen/Qwen3-VL-8B-Instruct": Entry("qwen3_vl", QWEN3_VL_8B, "8.77B", "8.77B", active_with_embeddings=True),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": Entry("qwen3_vl_moe", QWEN3_VL_30B_A3B, "31.1B", "3B",
                                            active_with_embeddings=True),
    # its active figure is the language model's without embeddings, head and vision tower (the test's rule)
    "zai-org/GLM-4.5V": Entry("glm4v_moe", GLM45V, "108B", "12B", active_with_embeddings=False),
    # 2026's gated delta-net hybrids: the cards' active figures leave out embeddings and head (MTP is not counted:
    # transformers drops the checkpoints' mtp.* weights, and the cards quote the main model)
    "Qwen/Qwen3-Next-80B-A3B-Instruct": Entry("qwen3_next", QWEN3_NEXT_80B, "80B", "3B", active_with_embeddings=False),
    "Qwen/Qwen3.5-35B-A3B": Entry("qwen3_5_moe_text", QWEN3_5_35B_A3B, "35B", "3B", active_with_embeddings=False),
}


def architecture(name: str) -> tuple[Any, str]:
    """(config, where it came from)."""
    from transformers import AutoConfig

    if Path(name).is_dir():
        return AutoConfig.from_pretrained(name), f"{name}/config.json"
    if name in CATALOG:
        entry = CATALOG[name]
        return AutoConfig.for_model(entry.model_type, **entry.values), "rlray's catalog of its recipes' models (offline)"
    return AutoConfig.from_pretrained(name), f"the hub's {name}/config.json"
