"""Quantized checkpoints (rlray.models.quantized): gpt-oss's MXFP4 and DeepSeek-V3's FP8 (128x128 blocks). Each rank
dequantizes only its slice (MXFP4: its experts; FP8: the fp8 elements of its box and the scale blocks they fall in,
checked by logging every slice read), the model and its exports are built without the quantization, other
quantizations are refused in one line, and an engine of such a checkpoint starts in bf16 with dummy weights for the
first sync to fill (tests/engine/test_hybrids.py runs it for MXFP4; for FP8, vLLM's own config decides no
quantization under the route, and fp8 without it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlray.config import ModelConfig
from rlray.models import quantized
from rlray.models.load import Box, SafetensorsReader, read_config
from rlray.models.tiny import model_path
from tests.fp8 import CONFIG, fp8_checkpoint
from tests.mxfp4 import pack_mxfp4

NAME = "model.layers.0.mlp.experts.gate_up_proj"
# the deepseek_v3 twin: kv_a_proj_with_mqa (576, 128) ends in a partial row block, q_b_proj (384, 64) in a partial
# column block, each expert's gate_proj and up_proj (32, 128) and down_proj (128, 32) are one partial block
DEEPSEEK = ModelConfig(arch="deepseek_v3", num_layers=2, moe_intermediate_size=32, intermediate_size=128, seed=4)
KV_A, EXPERTS = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.experts"


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
    awq = GptOssConfig(quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match=r"^model.name=org/x-AWQ: its checkpoint is quantized with 'awq'.*bf16 copy$"):
        quantized.trainable_config(awq, "org/x-AWQ")


def test_an_mxfp4_engine_starts_without_the_quantization_and_with_dummy_weights() -> None:
    from transformers import GptOssConfig

    route = quantized.engine_route(GptOssConfig(quantization_config={"quant_method": "mxfp4"}))
    assert route == {"load_format": "dummy", "hf_overrides": quantized.without_quantization}
    assert quantized.engine_route(GptOssConfig()) == {}
    # vLLM's gpt-oss loader picks its MXFP4 path by hasattr(config, "quantization_config") (gpt_oss.py load_weights)
    config = route["hf_overrides"](GptOssConfig(quantization_config={"quant_method": "mxfp4"}))
    assert not hasattr(config, "quantization_config")


class Logged:
    """A safetensors handle that logs every slice read from it: (key, shape read)."""

    def __init__(self, handle: object, log: list[tuple[str, tuple[int, ...]]]) -> None:
        self.handle, self.log = handle, log

    def get_slice(self, key: str) -> Logged:
        self.key, self.slice = key, self.handle.get_slice(key)
        return self

    def get_shape(self) -> list[int]:
        return self.slice.get_shape()

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        t = self.slice[index]
        self.log.append((self.key, tuple(t.shape)))
        return t


def _fused(reference: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    parts = ("down_proj",) if name == "down_proj" else ("gate_proj", "up_proj")
    return torch.stack([torch.cat([reference[f"{EXPERTS}.{e}.{p}.weight"] for p in parts]) for e in range(4)])


def _reads(keys: list[str], shape: tuple[int, ...], blocks: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """What reading `shape` of each FP8 tensor of `keys` must read: those elements and `blocks` of its scales."""
    return [r for k in keys for r in ((k, shape), (k + "_scale_inv", blocks))]


def test_each_rank_reads_and_dequantizes_only_its_box_of_an_fp8_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "fp8"
    reference = fp8_checkpoint(Path(model_path(DEEPSEEK)), folder)
    want = {**reference, **{f"{EXPERTS}.{n}": _fused(reference, n) for n in ("gate_up_proj", "down_proj")}}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(quantized.trainable_config(read_config(str(folder)), str(folder)))
    experts = lambda e0, ne, part: [f"{EXPERTS}.{e}.{part}.weight" for e in range(e0, e0 + ne)]
    cases: list[tuple[str, Box, list]] = [  # model tensor, a rank's box, what it must read of the checkpoint
        (KV_A, ((0, 0), (576, 128)), _reads([KV_A], (576, 128), (5, 1))),  # one rank: the whole tensor
        (KV_A, ((100, 10), (470, 100)), _reads([KV_A], (470, 100), (5, 1))),  # rows 100-569: all 5 row blocks
        (KV_A, ((288, 0), (288, 128)), _reads([KV_A], (288, 128), (3, 1))),  # FSDP's second half: from mid-block 2
        ("model.layers.1.self_attn.q_b_proj.weight", ((128, 0), (256, 64)),
         _reads(["model.layers.1.self_attn.q_b_proj.weight"], (256, 64), (2, 1))),
        ("model.layers.1.mlp.gate.weight", ((0, 0), (4, 128)), [("model.layers.1.mlp.gate.weight", (4, 128))]),
        *[(f"{EXPERTS}.gate_up_proj", ((e0, 0, 0), (ne, 64, 128)),  # an EP rank's 4, 2, 1 experts
           [r for e in range(e0, e0 + ne) for p in ("gate_proj", "up_proj")
            for r in _reads(experts(e, 1, p), (32, 128), (1, 1))]) for e0, ne in ((0, 4), (2, 2), (3, 1))],
        (f"{EXPERTS}.down_proj", ((1, 64, 0), (2, 64, 32)), _reads(experts(1, 2, "down_proj"), (64, 32), (1, 1))),
    ]
    reader = SafetensorsReader(folder).follow(model)
    assert set(reader.merged) == {f"{EXPERTS}.gate_up_proj", f"{EXPERTS}.down_proj"}  # no `_scale_inv` tensors
    log: list[tuple[str, tuple[int, ...]]] = []
    with reader:
        reader.where = {k: Logged(h, log) for k, h in reader.where.items()}
        for name, box, reads in cases:
            log.clear()
            got = reader.read(name, box)
            expected = want[name][tuple(slice(o, o + n) for o, n in zip(*box))]
            assert got.dtype == torch.float32 and torch.equal(got, expected), (name, box)
            assert log == reads, (name, box, log)


def test_an_fp8_checkpoint_with_128_blocks_is_trained_dequantized_and_others_are_refused() -> None:
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(quantization_config=dict(CONFIG))
    assert quantized.trainable_config(config, "deepseek-ai/DeepSeek-V3") is config
    assert "quantization_config" not in config.to_dict()
    for block in (None, [64, 64]):
        other = DeepseekV3Config(quantization_config={**CONFIG, "weight_block_size": block})
        with pytest.raises(ValueError, match=rf"^model.name=org/x-FP8: its FP8 checkpoint has weight_block_size="
                                             rf"{re.escape(str(block))}, .*\[128, 128\] blocks only.*bf16 copy$"):
            quantized.trainable_config(other, "org/x-FP8")
    assert quantized.model_tensors(["a.weight", "a.weight_scale_inv", "b.weight", "c_scale_inv"]) == [
        "a.weight", "b.weight", "c_scale_inv"]


def test_an_fp8_engine_starts_without_the_quantization_and_with_dummy_weights(tmp_path: Path) -> None:
    """vLLM's own ModelConfig of the FP8 twin: fp8 as the checkpoint says, and none under the route's override."""
    from transformers import DeepseekV3Config
    from vllm.config import ModelConfig as VllmModelConfig

    route = quantized.engine_route(DeepseekV3Config(quantization_config=dict(CONFIG)))
    assert route == {"load_format": "dummy", "hf_overrides": quantized.without_quantization}
    assert quantized.engine_route(DeepseekV3Config()) == {}
    folder = tmp_path / "fp8"
    fp8_checkpoint(Path(model_path(DEEPSEEK)), folder)
    assert VllmModelConfig(model=str(folder)).quantization == "fp8"
    served = VllmModelConfig(model=str(folder), hf_overrides=route["hf_overrides"])
    assert served.quantization is None and not served.is_quantized
