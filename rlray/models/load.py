"""Sharded model build: no rank ever materialises the whole model.

Contract: `build_model(path, dims, cfg, device)` reads the transformers config at `path` (a
folder, or a hub id whose snapshot `local_folder` fetches),
builds the model on the meta device (transformers' causal-LM class, or its image-text-to-text one
for a vision-language model, whose tower `trainer.freeze_vision` freezes), applies `rlray.parallel.parallelize` (EP, activation
checkpointing, FSDP2), allocates only this rank's shards on `device`, and fills each one
from the checkpoint's safetensors files, reading just the slice that shard covers
(safetensors slices are memory-mapped reads). Master weights are fp32 whatever the
checkpoint's dtype; with LoRA (`trainer.lora.rank > 0`, rlray.models.lora) the frozen base is held
in `trainer.lora.base_dtype` and the adapters, not in the checkpoint, start as PEFT's. Fused expert
weights (`experts.gate_up_proj` (E, 2I, H), `experts.down_proj` (E, H, I); Nemotron-H's ungated `experts.up_proj`
(E, I, H)) load from either layout on disk: fused, or one tensor per expert (`experts.<e>.gate_proj.weight`, ...:
what the hub checkpoints and transformers' `save_pretrained` write), each rank reading only its experts' tensors.
Names on disk are read as transformers' `from_pretrained` renames and merges them (its conversion mapping, through
rlray.parallel.hf.checkpoint_sources: Nemotron-H's checkpoints say `backbone.` for `model.`); a family whose
checkpoints fuse experts transposed (Qwen3-VL-MoE) is read so, and `to_checkpoint_layout(folder)` writes a saved
model in that layout. Quantized weights (gpt-oss's MXFP4 experts; DeepSeek-V3's and Kimi-K2's FP8 linears, their
per-expert tensors each with its own scales before the merge) are dequantized by the rank that reads them, from
its slice only (rlray.models.quantized); the model is built, and exported, without the checkpoint's
quantization_config.
`resident_bytes(model)` counts the parameter bytes this rank holds; `persistent(model)` names what a checkpoint holds
(parameters, a tied one once, and persistent buffers) and `box(tensor)` the part of it this rank holds.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rlray.config import TrainerConfig
from rlray.config.checks import cp_refusal
from rlray.config.families import expert_params, family, known, moe_attrs
from rlray.models.attention import PACKED, packed_attention
from rlray.models.catalog import read_config
from rlray.models.lora import apply_lora, checkpoint_name, init_adapters, is_adapter
from rlray.models.multimodal import freeze_vision, is_vision
from rlray.models.quantized import (
    Box,
    is_fp8,
    is_mxfp4,
    model_tensors,
    read_fp8,
    read_mxfp4,
    trainable_config,
)
from rlray.models.recurrent import reset_per_sequence
from rlray.parallel import context
from rlray.parallel.dims import ParallelDims
from rlray.parallel.hf import (
    checkpoint_sources,
    experts_transposed_on_disk,
    init_non_persistent_buffers,
    register_attention,
    text_positions_to_layers,
)
from rlray.parallel.parallelize import DTYPES, parallelize

# a fused expert parameter's name, from the family records (rlray.config.families)
FUSED = re.compile(rf"^(?P<prefix>.*\.(?:{'|'.join(sorted({e for _, e in moe_attrs()}))}))"
                   rf"\.(?P<param>{'|'.join(expert_params())})$")
# any parameter of a fused experts module (weights and biases: every one leads with the expert count)
EXPERTS = re.compile(rf"^(?P<prefix>.*\.(?:{'|'.join(sorted({e for _, e in moe_attrs()}))}))\.(?P<param>\w+)$")
CP_ATTENTION = "rlray_cp"
FLASH_DTYPES = ("bfloat16", "float16")


def local_folder(name: str) -> Path:
    """A checkpoint folder on this node: `name` itself, or the hub snapshot of that id (downloaded once
    into the Hugging Face cache, which the ranks of a node share)."""
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "tokenizer*"]
    return Path(snapshot_download(name, allow_patterns=patterns))


def attention_for(device: torch.device, dims: ParallelDims, dtype: str = "float32", sinks: bool = False) -> str:
    """Attention within each packed sequence: flash-attn's varlen kernels on GPU when installed and
    the compute dtype is 16-bit (flash-attn refuses float32; transformers derives the sequence
    boundaries from the position ids), else one SDPA call per sequence; under cp, against the keys
    of the whole cp group. A family with attention sinks (gpt-oss) always takes the packed path (its own
    eager attention per sequence): flash-attn has no sinks, and transformers would swap a hub kernel in."""
    register_attention(PACKED, packed_attention)
    register_attention(CP_ATTENTION, context.attention)
    if dims.cp_enabled:
        return CP_ATTENTION
    if (device.type == "cuda" and dtype in FLASH_DTYPES and not sinks
            and importlib.util.find_spec("flash_attn") is not None):
        return "flash_attention_2"
    return PACKED


def build_model(path: str, dims: ParallelDims, cfg: TrainerConfig, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    folder = local_folder(path)
    config = trainable_config(read_config(str(folder)), path)
    dims.check_model(config)
    f = family(config.model_type) if known(config.model_type) else None
    if f is not None and not f.cp and dims.cp_enabled:
        raise ValueError(f"trainer.cp={dims.cp} with {f.name}: {cp_refusal(f)}; set trainer.cp=1")
    vision = is_vision(config)
    if vision and dims.cp_enabled:
        raise ValueError(f"trainer.cp={dims.cp}: context parallelism does not split image sequences; set "
                         f"trainer.cp=1 for the vision-language model {path}")
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    attention: str | dict[str, str] = attention_for(device, dims, cfg.param_dtype, f is not None and f.sinks)
    if vision:  # the vision tower attends both ways within each image: transformers' own SDPA path
        attention = {"": attention, "text_config": attention, "vision_config": "sdpa"}
    with torch.device("meta"):
        model = auto.from_config(config, dtype=torch.float32, attn_implementation=attention)
    # transformers finds its checkpoint renaming by the model's classes, which FSDP2 renames: look it up first
    reader = SafetensorsReader(folder, experts_transposed_on_disk(config.model_type)).follow(model)
    if vision:
        text_positions_to_layers(model)
    if f is not None and f.recurrent:  # packed rows: the recurrent mixer runs once per sequence
        reset_per_sequence(model, f.recurrent)
    if cfg.freeze_vision:
        freeze_vision(model)
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
        for p in model.parameters():  # a frozen base needs no fp32 master (unless SFT trains it)
            if not p.requires_grad:
                p.data = p.data.to(DTYPES[cfg.lora.base_dtype or cfg.param_dtype])
    parallelize(model, dims, cfg)
    model.to_empty(device=device)
    init_non_persistent_buffers(model)
    with reader:
        load_shards(model, reader)
    if cfg.lora.enabled:
        init_adapters(model, cfg.seed)
    return model


def box(t: torch.Tensor) -> Box:
    """The part of the full tensor that this rank holds."""
    if isinstance(t, DTensor):
        chunks = t.__create_chunk_list__()
        assert len(chunks) == 1, "one contiguous shard per rank"
        return tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    return (0,) * t.dim(), tuple(t.shape)


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(*box))


def to_checkpoint_layout(folder: str | Path) -> None:
    """Rewrite the fused experts that transformers' `save_pretrained` wrote into `folder` in the layout of
    the family's checkpoints, where that is transposed (rlray.parallel.hf.experts_transposed_on_disk)."""
    from safetensors.torch import load_file, save_file

    if not experts_transposed_on_disk(read_config(str(folder)).model_type):
        return
    for path in sorted(Path(folder).glob("*.safetensors")):
        tensors = load_file(str(path))
        if any(FUSED.match(k) for k in tensors):
            save_file({k: v.transpose(1, 2).contiguous() if FUSED.match(k) else v for k, v in tensors.items()},
                      str(path), metadata={"format": "pt"})


class SafetensorsReader:
    """Slices of named tensors from a folder of safetensors files, fused experts included (`transposed`:
    stored as (E, H, 2I) and (E, I, H), read into transformers' (E, 2I, H) and (E, H, I)); after `follow(model)`,
    under the model's names where transformers renames or merges the checkpoint's."""

    def __init__(self, folder: Path, transposed: bool = False) -> None:
        self.transposed = transposed
        self.files = sorted(folder.glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"no *.safetensors files in {folder}")
        self.stack = ExitStack()
        self.where: dict[str, Any] = {}
        self.renamed: dict[str, str] = {}  # model name -> checkpoint key
        self.merged: dict[str, list[list[str]]] = {}  # model name -> parts (along dim 1) of per-expert keys

    def follow(self, model: nn.Module) -> SafetensorsReader:
        from safetensors import safe_open

        keys = []
        for path in self.files:
            with safe_open(str(path), "pt", device="cpu") as handle:
                keys.extend(handle.keys())
        self.renamed, self.merged = checkpoint_sources(model, model_tensors(keys))
        return self

    def __enter__(self) -> SafetensorsReader:  # noqa: PYI034
        from safetensors import safe_open

        for path in self.files:
            handle = self.stack.enter_context(safe_open(str(path), "pt", device="cpu"))
            self.where.update(dict.fromkeys(handle.keys(), handle))
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def read(self, name: str, box: Box) -> torch.Tensor:
        key = self.renamed.get(name, name)
        if key in self.where and self.transposed and FUSED.match(name):
            (e, r, c), (ne, nr, nc) = box
            return self._slice(key, ((e, c, r), (ne, nc, nr))).transpose(1, 2)
        if key in self.where:
            return self._slice(key, box)
        if is_mxfp4(key, self.where):
            return read_mxfp4(self.where, key, box)
        if name in self.merged:
            return self._per_expert(self.merged[name], box)
        raise KeyError(f"checkpoint has no tensor {name!r} (files: {[p.name for p in self.files]})")

    def _per_expert(self, parts: list[list[str]], box: Box) -> torch.Tensor:
        """Experts [e0, e0 + ne) of a fused tensor, each expert's rows [r0, r0 + nr) of its parts one after the
        other (gate_up_proj: gate_proj's rows, then up_proj's), read from one tensor per expert and part."""
        (e0, r0, c0), (ne, nr, nc) = box
        out = []
        for e in range(e0, e0 + ne):
            rows, lo = [], 0
            for keys in parts:
                size = self.where[keys[e]].get_slice(keys[e]).get_shape()[0]
                a, b = max(r0, lo), min(r0 + nr, lo + size)
                if a < b:
                    rows.append(self._rows(keys[e], a - lo, b - a, c0, nc))
                lo += size
            out.append(torch.cat(rows) if rows else torch.empty(0, nc))
        return torch.stack(out) if out else torch.empty(0, nr, nc)

    def _rows(self, key: str, r0: int, nr: int, c0: int, nc: int) -> torch.Tensor:
        return self._slice(key, ((r0, c0), (nr, nc)))

    def _slice(self, key: str, box: Box) -> torch.Tensor:
        """Checkpoint tensor `key`'s slice `box`, dequantized if it is FP8."""
        if is_fp8(key, self.where):
            return read_fp8(self.where, key, box)
        return self.where[key].get_slice(key)[_slices(box)]


def persistent(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What a checkpoint holds: the parameters (a tied one once, under its first name) and persistent buffers."""
    yield from model.named_parameters()
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            yield name, buf


@torch.no_grad()
def load_shards(model: nn.Module, reader: SafetensorsReader) -> None:
    for name, tensor in persistent(model):
        if is_adapter(name):  # not in the base's checkpoint: rlray.models.lora.init_adapters
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel():
            local.copy_(reader.read(checkpoint_name(name), box(tensor)).reshape(local.shape))


def resident_bytes(model: nn.Module) -> int:
    """Bytes of the parameter shards this rank holds (tied parameters once)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total
