"""What an engine keeps per token and per sequence, from a model's transformers config: the plan's cache formula.

Contract: `cache_bytes(text_config, tp, dtype_bytes, max_len=None)` returns (bytes per token, bytes per sequence)
on one engine GPU at tensor parallel `tp`, from each layer's kind (`layer_kinds`: the config's `layer_types`, else
every layer full attention; Nemotron-H's also name its "moe" and "mlp" blocks, which keep nothing):
- per token, the KV cache of the full-attention layers: 2 x layers x ceil(KV heads / tp) x head dim x bytes; with
  multi-head latent attention (the family record's `mla`: DeepSeek-V3, Kimi-K2) layers x (kv_lora_rank +
  qk_rope_head_dim) x bytes, vLLM's one latent per token that every head reads, which tensor parallelism does not
  split (each rank keeps all of it);
- per sequence, whatever the sequence's length:
  - the KV of the sliding-window layers (gpt-oss), which keep at most `sliding_window` tokens (or `max_len`);
  - the recurrent state of the linear-attention layers, as vLLM sizes it: a gated delta-net
    (`gated_delta_net_state_shape`): its short convolution's last kernel-1 inputs, (2 x key width + value width)
    / tp of them, and its state, value heads / tp x value dim x key dim; a Mamba-2 mixer (`mamba2_state_shape`):
    kernel-1 inputs of (heads x head dim + 2 x groups x state size) / tp, and its state, heads / tp x head dim x
    state size, in `mamba_ssm_cache_dtype` where the config names one (Nemotron-H: float32, which vLLM keeps).
Estimates, like the rest of the plan: vLLM aligns a hybrid's attention blocks to its state pages.
"""

from __future__ import annotations

import math
from typing import Any

from rlray.config.families import family, known

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def layer_kinds(config: Any) -> list[str]:
    """Each decoder layer's kind: `layer_types` where the config has them, else every layer attention."""
    kinds = getattr(config, "layer_types", None)
    return list(kinds) if kinds else [FULL] * int(config.num_hidden_layers)


def _kv_per_token(config: Any, tp: int, dtype_bytes: int) -> int:
    """Keys and values of one token in one attention layer (its latent under multi-head latent attention)."""
    if known(config.model_type) and family(config.model_type).mla:
        return (int(config.kv_lora_rank) + int(config.qk_rope_head_dim)) * dtype_bytes
    heads = int(getattr(config, "num_attention_heads", 1))
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // max(heads, 1))
    kv_heads = math.ceil(int(getattr(config, "num_key_value_heads", None) or heads) / tp)
    return 2 * kv_heads * head_dim * dtype_bytes


def _gated_delta_net(c: Any, tp: int, dtype_bytes: int) -> float:
    key, value = c.linear_key_head_dim * c.linear_num_key_heads, c.linear_value_head_dim * c.linear_num_value_heads
    conv = (2 * key + value) / tp * (c.linear_conv_kernel_dim - 1)
    temporal = c.linear_num_value_heads / tp * c.linear_value_head_dim * c.linear_key_head_dim
    return (conv + temporal) * dtype_bytes


def _mamba2(c: Any, tp: int, dtype_bytes: int) -> float:
    groups = c.n_groups + (0 if c.n_groups % tp == 0 else tp - c.n_groups)  # vLLM repeats groups over head shards
    conv = (c.mamba_num_heads * c.mamba_head_dim + 2 * groups * c.ssm_state_size) / tp * (c.conv_kernel - 1)
    temporal = c.mamba_num_heads / tp * c.mamba_head_dim * c.ssm_state_size
    return conv * dtype_bytes + temporal * _BYTES.get(getattr(c, "mamba_ssm_cache_dtype", None), dtype_bytes)


def recurrent_state(config: Any, tp: int, dtype_bytes: int) -> float:
    """One linear-attention layer's state per sequence: a Mamba-2 mixer's where the config has one, else a gated
    delta-net's."""
    return (_mamba2 if hasattr(config, "mamba_num_heads") else _gated_delta_net)(config, tp, dtype_bytes)


def cache_bytes(config: Any, tp: int, dtype_bytes: int, max_len: int | None = None) -> tuple[float, float]:
    kinds = layer_kinds(config)
    kv = _kv_per_token(config, tp, dtype_bytes)
    per_sequence = 0.0
    if kinds.count(SLIDING):
        window = min(int(config.sliding_window), max_len or int(config.sliding_window))
        per_sequence += kinds.count(SLIDING) * kv * window
    if kinds.count(LINEAR):
        per_sequence += kinds.count(LINEAR) * recurrent_state(config, tp, dtype_bytes)
    return float(kinds.count(FULL) * kv), per_sequence
