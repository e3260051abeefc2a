"""What an engine keeps per token and per sequence, from a model's transformers config: the plan's cache formula.

Contract: `cache_bytes(text_config, tp, dtype_bytes)` returns (bytes per token, bytes per sequence) on one engine
GPU at tensor parallel `tp`:
- per token, the KV cache of the full-attention layers: 2 x layers x ceil(KV heads / tp) x head dim x bytes. A
  hybrid's `layer_types` names its full-attention layers (Qwen3-Next and Qwen3.5: one in `full_attention_interval`);
  without it every layer is attention;
- per sequence, the recurrent state of its linear-attention layers, whatever the sequence's length (a gated
  delta-net, as vLLM sizes it in `gated_delta_net_state_shape`): its short convolution's last kernel-1 inputs,
  (2 x key width + value width) / tp of them, and its temporal state, value heads / tp x value dim x key dim.
Estimates, like the rest of the plan: vLLM aligns a hybrid's attention blocks to its state pages.
"""

from __future__ import annotations

import math
from typing import Any

FULL, LINEAR = "full_attention", "linear_attention"


def layer_kinds(config: Any) -> list[str]:
    """Each decoder layer's kind: `layer_types` where the config has them, else every layer attention."""
    kinds = getattr(config, "layer_types", None)
    return list(kinds) if kinds else [FULL] * int(config.num_hidden_layers)


def cache_bytes(config: Any, tp: int, dtype_bytes: int) -> tuple[float, float]:
    kinds = layer_kinds(config)
    heads = int(getattr(config, "num_attention_heads", 1))
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // max(heads, 1))
    kv_heads = math.ceil(int(getattr(config, "num_key_value_heads", None) or heads) / tp)
    per_token = 2 * kinds.count(FULL) * kv_heads * head_dim * dtype_bytes
    linear = kinds.count(LINEAR)
    if not linear:
        return float(per_token), 0.0
    key = config.linear_key_head_dim * config.linear_num_key_heads
    value = config.linear_value_head_dim * config.linear_num_value_heads
    conv = (2 * key + value) / tp * (config.linear_conv_kernel_dim - 1)
    temporal = config.linear_num_value_heads / tp * config.linear_value_head_dim * config.linear_key_head_dim
    return float(per_token), float(linear * (conv + temporal) * dtype_bytes)
