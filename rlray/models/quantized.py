"""Checkpoints whose weights are quantized on disk: what rlray trains from them and what its engines serve.

Contract: rlray trains fp32 master weights and serves and syncs bf16 ones, so quantized weights are dequantized
where they are read, by the rank that holds them, and nothing downstream sees the quantization. Two methods, as the
config's `quantization_config.quant_method` declares them:
- mxfp4 (gpt-oss's experts): `<experts>.gate_up_proj_blocks` (E, 2I, H/32, 16) uint8, two 4-bit values a byte (the
  even element in the low nibble), and `..._scales` (E, 2I, H/32) uint8, each block of 32 values' power of two plus
  127; `down_proj` alike over (E, H, I/32).
- fp8 with 128x128 blocks (DeepSeek-V3's and Kimi-K2's linear weights of attention, MLPs and experts; not the
  embeddings, lm_head, norms, router or its correction bias): `X.weight` float8_e4m3fn (R, C) and
  `X.weight_scale_inv` fp32 (ceil(R/128), ceil(C/128)), W[i, j] = Q[i, j] * S[i // 128, j // 128] (the edge blocks
  may be partial: kv_a_proj_with_mqa's 576 rows are 5 row blocks, the last of 64 rows). A tensor with a
  `_scale_inv` partner is a quantized one; the partners themselves are not model tensors (`model_tensors(keys)`).
- `trainable_config(config, name)`: the transformers config to build the model from, without its quantization
  (the model, its checkpoints and its exports hold dequantized weights); a method rlray does not dequantize, or FP8
  in other blocks than 128x128, raises one line naming it and `model.name`.
- `is_mxfp4(key, where)`, `read_mxfp4(where, key, box)`: whether the checkpoint holds model tensor `key` as MXFP4
  blocks and scales, and its slice `box` (offsets, sizes): the rank's experts [e0, e0 + ne) read and dequantized
  with transformers' own unpacker (rlray.parallel.hf.dequantize_mxfp4), then the rest of the box cut from them.
- `is_fp8(key, where)`, `read_fp8(where, key, box)`: whether checkpoint tensor `key` is FP8 with block scales, and
  its slice `box` dequantized from that slice of the fp8 tensor and the scale blocks it touches, nothing more (any
  leading dims, a fused tensor's experts, sliced alike). Both exact: every MXFP4 value is a float32, and a fp8
  value times a fp32 scale is the one fp32 product the definition names.
- `engine_route(config)`: vLLM's arguments for an engine started from such a checkpoint: the model built without
  the quantization (`hf_overrides=without_quantization`) with dummy weights (`load_format=dummy`), which the
  first weight sync fills, as every stage syncs before it generates (rlray.orchestration.controller). Left to read
  the checkpoint, vLLM builds MXFP4 experts whose loader takes `_blocks`/`_scales` tensors only (gpt_oss.py
  `_load_weights_mxfp4`), and FP8 linears whose bf16 sync loads garbage. In vLLM 0.32 the callable removes the
  quantization before vLLM decides it (paths under vllm/): transformers_utils/config.py:902 sets
  `config.quantization_config` from config.json and :931 then applies the `hf_overrides` callable (config/model.py
  :605-607 passes a callable so), which deletes it; model_arch_config_convertor.py:264 reads the attribute (None),
  so config/model.py:1376-1378 `_verify_quantization` finds no method and `quantization` stays None (unless
  `rollout.quantization` asks vLLM to quantize the bf16 weights online), config/vllm.py:892/920
  `_get_quantization_config` returns None, deepseek_v2.py:1888 hands that None to every layer, and a linear without
  a quant_config is an `UnquantizedLinearMethod` one (layers/linear.py:288-289), the experts
  `UnquantizedFusedMoEMethod` (layers/fused_moe/routed_experts.py:231-234): bf16 weights a sync loads as sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

DEQUANTIZED = ("mxfp4", "fp8")  # quantization methods whose checkpoints rlray dequantizes as it reads them
BLOCKS, SCALES = "_blocks", "_scales"
SCALE_INV, FP8_BLOCK = "_scale_inv", 128  # an FP8 weight's scales (DeepSeek's name: dequantization multipliers)
Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, sizes


def _setting(config: Any, key: str) -> Any:
    """`quantization_config[key]` (a dict, or transformers' config object), or None."""
    q = getattr(config, "quantization_config", None)
    return q.get(key) if isinstance(q, dict) else getattr(q, key, None)


def quant_method(config: Any) -> str | None:
    """The checkpoint's quantization method (`quantization_config.quant_method`), or None."""
    return _setting(config, "quant_method")


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
    block = _setting(config, "weight_block_size")
    if method == "fp8" and list(block or ()) != [FP8_BLOCK, FP8_BLOCK]:
        raise ValueError(f"model.name={name}: its FP8 checkpoint has weight_block_size={block}, and rlray dequantizes "
                         f"[{FP8_BLOCK}, {FP8_BLOCK}] blocks only (DeepSeek-V3's, Kimi-K2's); point model.name at a "
                         "bf16 copy")
    return without_quantization(config)


def model_tensors(keys: Iterable[str]) -> list[str]:
    """The checkpoint's keys without FP8 weights' `_scale_inv` partners."""
    keys = list(keys)
    names = set(keys)
    return [k for k in keys if not (k.endswith(SCALE_INV) and k.removesuffix(SCALE_INV) in names)]


def is_mxfp4(key: str, where: dict[str, Any]) -> bool:
    return key + BLOCKS in where and key + SCALES in where


def read_mxfp4(where: dict[str, Any], key: str, box: Box) -> Tensor:
    from rlray.parallel.hf import dequantize_mxfp4

    (e0, *offsets), (ne, *sizes) = box
    blocks, scales = (where[key + s].get_slice(key + s)[e0:e0 + ne] for s in (BLOCKS, SCALES))
    experts = dequantize_mxfp4(blocks, scales)
    return experts[(slice(None), *(slice(o, o + n) for o, n in zip(offsets, sizes)))]


def is_fp8(key: str, where: dict[str, Any]) -> bool:
    return key in where and key + SCALE_INV in where


def read_fp8(where: dict[str, Any], key: str, box: Box) -> Tensor:
    """fp32 W[box] = Q[box] * S[row // 128, col // 128] over the last two dims, from Q[box] and the scale blocks
    it touches. Written here by that definition, as no library's dequantization takes partial edge blocks: in
    transformers 5.19 `Fp8Dequantize` takes the block size as rows // scale rows (576 rows over 5 scale rows
    raise; (130, 128) over 2 is read as blocks of 65 rows, silently wrong), vLLM 0.32's `scaled_dequantize`
    asserts whole blocks, torch has none; DeepSeek's own `weight_dequant` is a Triton kernel (CUDA)."""
    offsets, sizes = box
    values = where[key].get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
    lead = len(sizes) - 2
    (r0, c0), (nr, nc) = offsets[lead:], sizes[lead:]
    first = (r0 // FP8_BLOCK, c0 // FP8_BLOCK)
    last = ((r0 + nr - 1) // FP8_BLOCK + 1, (c0 + nc - 1) // FP8_BLOCK + 1)
    window = (*(slice(o, o + n) for o, n in zip(offsets[:lead], sizes[:lead])),
              *(slice(a, b) for a, b in zip(first, last)))
    scales = where[key + SCALE_INV].get_slice(key + SCALE_INV)[window].float()
    rows = torch.arange(r0, r0 + nr) // FP8_BLOCK - first[0]
    cols = torch.arange(c0, c0 + nc) // FP8_BLOCK - first[1]
    return values.float() * scales[..., rows[:, None], cols[None, :]]


def engine_route(config: Any) -> dict[str, Any]:
    if quant_method(config) not in DEQUANTIZED:
        return {}
    return {"load_format": "dummy", "hf_overrides": without_quantization}
