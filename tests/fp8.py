"""FP8 checkpoints for tests, quantized here by the format's definition (not with transformers', vLLM's or rlray's code).

`quantize_fp8(w)`: a weight (R, C) in 128x128 blocks (the edge ones partial when R or C is no multiple of 128): per
block, scale = max |w| / 448 (float8_e4m3fn's largest value) and Q = (w / scale) as float8_e4m3fn. Returns Q, the
scales (ceil(R/128), ceil(C/128)) fp32, which DeepSeek's checkpoints store as `weight_scale_inv` (the multiplier that
dequantizes), and the values they stand for, Q.float() * scale block by block, which every reader must return
exactly. `fp8_checkpoint(source, dest)` copies a checkpoint folder with its linear weights of attention, MLPs and
experts so quantized (`*proj.weight`, `*proj_with_mqa.weight`: not the embeddings, lm_head, norms, the router
`mlp.gate.weight` or its `e_score_correction_bias`), `quantization_config` as DeepSeek-V3's config.json says it,
and returns the tensors a dequantizing reader must load, by checkpoint name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

BLOCK, FP8_MAX = 128, 448.0
QUANTIZED = ("proj.weight", "proj_with_mqa.weight")
CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}


def _blockwise(scales: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Each block's scale repeated over the block's elements, cut at the tensor's edges."""
    return scales.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:shape[0], :shape[1]]


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r, c = w.shape
    rb, cb = -(-r // BLOCK), -(-c // BLOCK)
    padded = torch.zeros(rb * BLOCK, cb * BLOCK)
    padded[:r, :c] = w.float().abs()
    amax = padded.reshape(rb, BLOCK, cb, BLOCK).amax(dim=(1, 3))
    scales = amax.clamp_min(1e-12) / FP8_MAX
    q = (w.float() / _blockwise(scales, w.shape)).to(torch.float8_e4m3fn)
    return q, scales, q.float() * _blockwise(scales, w.shape)


def fp8_checkpoint(source: Path, dest: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("rlray-manifest.json"))
    reference: dict[str, torch.Tensor] = {}
    for path in dest.glob("*.safetensors"):
        on_disk = {}
        for key, t in load_file(str(path)).items():
            if key.endswith(QUANTIZED):
                on_disk[key], on_disk[f"{key}_scale_inv"], values = quantize_fp8(t)
                reference[key] = values.to(t.dtype)
            else:
                on_disk[key] = reference[key] = t
        save_file(on_disk, str(path), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = CONFIG
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return reference
