"""Checkpoints whose weights are quantized on disk: what rlray trains from them and what its engines serve.

Contract: gpt-oss's hub checkpoints hold their experts in MXFP4, declared by the config's
`quantization_config: {quant_method: mxfp4}`: `<experts>.gate_up_proj_blocks` (E, 2I, H/32, 16) uint8, two 4-bit
values a byte (the even element in the low nibble), and `..._scales` (E, 2I, H/32) uint8, each block of 32 values'
power of two plus 127; `down_proj` alike over (E, H, I/32). rlray trains fp32 master weights and serves and syncs
bf16 ones, so the experts are dequantized where they are read, by the rank that holds them:
- `trainable_config(config, name)`: the transformers config to build the model from, without its quantization
  (the model, its checkpoints and its exports hold dequantized weights); a method rlray does not dequantize raises
  one line naming it and `model.name`.
- `is_mxfp4(key, where)`, `read_mxfp4(where, key, box)`: whether the checkpoint holds model tensor `key` as MXFP4
  blocks and scales, and its slice `box` (offsets, sizes): the rank's experts [e0, e0 + ne) read and dequantized
  with transformers' own unpacker (rlray.parallel.hf.dequantize_mxfp4), then the rest of the box cut from them.
  Exact: every MXFP4 value is a float32 (and a bfloat16).
- `engine_route(config)`: vLLM's arguments for an engine started from such a checkpoint: the model built without
  the quantization (`hf_overrides=without_quantization`) with dummy weights (`load_format=dummy`), which the
  first weight sync fills, as every stage syncs before it generates (rlray.orchestration.controller). Left to read
  the checkpoint, vLLM builds MXFP4 experts whose loader takes `_blocks`/`_scales` tensors only (gpt_oss.py
  `_load_weights_mxfp4`), which no bf16 sync can update.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

DEQUANTIZED = ("mxfp4",)  # quantization methods whose checkpoints rlray dequantizes as it reads them
BLOCKS, SCALES = "_blocks", "_scales"


def quant_method(config: Any) -> str | None:
    """The checkpoint's quantization method (`quantization_config.quant_method`), or None."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    return q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)


def without_quantization(config: Any) -> Any:
    """`config` without its quantization_config (vLLM's `hf_overrides` callable; models read only its presence)."""
    if "quantization_config" in vars(config):
        del config.quantization_config
    return config


def trainable_config(config: Any, name: str) -> Any:
    method = quant_method(config)
    if method is not None and method not in DEQUANTIZED:
        raise ValueError(f"model.name={name}: its checkpoint is quantized with {method!r}, which rlray does not "
                         f"dequantize (it reads {', '.join(DEQUANTIZED)}); point model.name at a bf16 copy")
    return without_quantization(config)


def is_mxfp4(key: str, where: dict[str, Any]) -> bool:
    return key + BLOCKS in where and key + SCALES in where


def read_mxfp4(where: dict[str, Any], key: str, box: tuple[tuple[int, ...], tuple[int, ...]]) -> Tensor:
    from rlray.parallel.hf import dequantize_mxfp4

    (e0, *offsets), (ne, *sizes) = box
    blocks, scales = (where[key + s].get_slice(key + s)[e0:e0 + ne] for s in (BLOCKS, SCALES))
    experts = dequantize_mxfp4(blocks, scales)
    return experts[(slice(None), *(slice(o, o + n) for o, n in zip(offsets, sizes)))]


def engine_route(config: Any) -> dict[str, Any]:
    if quant_method(config) not in DEQUANTIZED:
        return {}
    return {"load_format": "dummy", "hf_overrides": without_quantization}
