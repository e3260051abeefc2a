"""gpt-oss's MXFP4 checkpoints (rlray.models.quantized): each rank dequantizes only its experts' slice, the model and
its exports are built without the quantization, other quantizations are refused in one line, and an engine of such
a checkpoint starts in bf16 with dummy weights for the first sync to fill (tests/engine/test_hybrids.py runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlray.models import quantized
from rlray.models.load import SafetensorsReader
from tests.mxfp4 import pack_mxfp4

NAME = "model.layers.0.mlp.experts.gate_up_proj"


def test_each_rank_dequantizes_only_its_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlray.parallel import hf

    w = torch.randn(4, 64, 6, generator=torch.Generator().manual_seed(1))  # (E, H, 2I) as gpt-oss holds it
    blocks, scales, values = pack_mxfp4(w)
    save_file({f"{NAME}_blocks": blocks, f"{NAME}_scales": scales, "lm_head.weight": torch.ones(2, 2)},
              str(tmp_path / "model.safetensors"))
    unpacked: list[int] = []
    real = hf.dequantize_mxfp4
    monkeypatch.setattr(hf, "dequantize_mxfp4", lambda b, s: unpacked.append(b.shape[0]) or real(b, s))
    with SafetensorsReader(tmp_path) as reader:
        for box in [((0, 0, 0), (4, 64, 6)), ((1, 0, 0), (2, 64, 6)), ((3, 32, 2), (1, 32, 4))]:
            got = reader.read(NAME, box)
            assert torch.equal(got, values[tuple(slice(o, o + n) for o, n in zip(*box))]), box
        with pytest.raises(KeyError, match="model.layers.0.mlp.experts.down_proj"):
            reader.read("model.layers.0.mlp.experts.down_proj", ((0, 0, 0), (1, 1, 1)))
    assert unpacked == [4, 2, 1]  # an EP rank unpacks its experts, never the whole tensor


def test_the_model_is_built_without_the_quantization_and_other_methods_are_refused() -> None:
    from transformers import GptOssConfig

    config = GptOssConfig(quantization_config={"quant_method": "mxfp4"})
    assert quantized.trainable_config(config, "openai/gpt-oss-20b") is config
    assert not hasattr(config, "quantization_config") and "quantization_config" not in config.to_dict()
    assert quantized.trainable_config(GptOssConfig(), "x").to_dict() == GptOssConfig().to_dict()
    fp8 = GptOssConfig(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match=r"^model.name=deepseek-ai/x: its checkpoint is quantized with 'fp8'.*bf16 copy$"):
        quantized.trainable_config(fp8, "deepseek-ai/x")


def test_an_mxfp4_engine_starts_without_the_quantization_and_with_dummy_weights() -> None:
    from transformers import GptOssConfig

    route = quantized.engine_route(GptOssConfig(quantization_config={"quant_method": "mxfp4"}))
    assert route == {"load_format": "dummy", "hf_overrides": quantized.without_quantization}
    assert quantized.engine_route(GptOssConfig()) == {}
    # vLLM's gpt-oss loader picks its MXFP4 path by hasattr(config, "quantization_config") (gpt_oss.py load_weights)
    config = route["hf_overrides"](GptOssConfig(quantization_config={"quant_method": "mxfp4"}))
    assert not hasattr(config, "quantization_config")
