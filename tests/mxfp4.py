"""MXFP4 checkpoints for tests, packed here from the format's definition (not with transformers' or rlray's code).

`pack_mxfp4(w)`: a fused expert tensor (E, n, R) rounded to MXFP4: per expert, row r and block of 32 along n, a
power of two 2^s with max |w| / 2^s <= 6 and each value the nearest of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} times it.
Returns the blocks (E, R, n/32, 16) uint8 (element 2j in byte j's low nibble, 2j + 1 in its high one; bit 3 the
sign), the scales (E, R, n/32) uint8 (s + 127) and the values they stand for, (E, n, R), which every reader must
return exactly. `mxfp4_checkpoint(source, dest)` copies a gpt-oss checkpoint folder with its fused experts so
packed (and `quantization_config: {quant_method: mxfp4}`, as the hub's configs say) and returns the tensors a
dequantizing reader must load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
QUANTIZED = ("experts.gate_up_proj", "experts.down_proj")


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    e, n, r = w.shape
    x = w.transpose(1, 2).reshape(e, r, n // 32, 32).float()
    s = torch.ceil(torch.log2(x.abs().amax(-1).clamp_min(1e-30) / 6.0))
    q = x / torch.exp2(s)[..., None]
    idx = (q.abs()[..., None] - FP4).abs().argmin(-1)
    negative = (q < 0) & (idx > 0)
    code = (idx + 8 * negative).to(torch.uint8)
    values = FP4[idx] * torch.where(negative, -1.0, 1.0) * torch.exp2(s)[..., None]
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (s + 127).to(torch.uint8), values.reshape(e, r, n).transpose(1, 2).contiguous()


def mxfp4_checkpoint(source: Path, dest: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    reference: dict[str, torch.Tensor] = {}
    for path in dest.glob("*.safetensors"):
        on_disk = {}
        for key, t in load_file(str(path)).items():
            if key.endswith(QUANTIZED):
                on_disk[f"{key}_blocks"], on_disk[f"{key}_scales"], values = pack_mxfp4(t)
                reference[key] = values.to(t.dtype)
            else:
                on_disk[key] = reference[key] = t
        save_file(on_disk, str(path), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return reference
