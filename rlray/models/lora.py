"""LoRA adapters on a frozen base, through PEFT: the one module that touches PEFT.

Contract:
- `lora_targets(model, cfg)`: the full names of the `nn.Linear` modules of the decoder layers that
  get an adapter: those whose last name part is in `cfg.target_modules` (null: those of
  `LoraConfig.DEFAULT_TARGETS` the model has). MoE experts (fused 3-D
  parameters) never do: vLLM serves no adapter on fused experts on CPU, and rlray keeps one rule
  for CPU and GPU. (Nemotron-H's defaults: attention q/k/v/o and the up/down of its shared experts and
  dense MLPs; its Mamba `in_proj`/`out_proj` only when listed: vLLM splits `in_proj`'s gate, x, B, C and dt
  rows over tensor-parallel ranks part by part, and an adapter there is unproven.) Raises `ValueError`
  naming `trainer.lora.target_modules` for an entry that matches no module, and `trainer.lora.rank` when
  it exceeds a targeted layer's smaller side.
  `adapter_params(model, cfg)` counts the adapters' parameters (the plan's LoRA memory).
- `apply_lora(model, cfg)`: injects the adapters (PEFT's `inject_adapter_in_model`) into the decoder
  layers and freezes every other parameter; works on a meta-device model, before `parallelize`.
  PEFT gets the layer list, not the model: given a transformers-5 MoE model, PEFT 0.21 rewrites
  `gate_proj`/`up_proj`/`down_proj` targets to the fused experts (its conversion of v4 adapters),
  and the shared experts then lose theirs.
- `init_adapters(model, seed)`: PEFT's initialisation (lora_A uniform in +-1/sqrt(fan_in), lora_B
  zero), each lora_A drawn whole from a generator seeded by `seed` and its name, then sliced to this
  rank's shard: the same adapter on any number of ranks.
- Names: `adapted_modules(model)`, `is_adapter(name)`; `checkpoint_name(name)` is a base weight's name in the model's own
  checkpoint (`...q_proj.base_layer.weight` -> `...q_proj.weight`); `peft_name(name)` an adapter
  tensor's name in a PEFT adapter file (`base_model.model.<name>` without the adapter's name).
- `adapter_config(cfg, targets, base)`: the `adapter_config.json` PEFT and vLLM read.
- From a full state dict (rlray's names): `adapter_tensors` (PEFT's adapter file), `base_tensors`
  (the base, checkpoint names), `merged_tensors` (each adapted weight plus alpha / rank x B A).
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rlray.config import LoraConfig
from rlray.config.families import family, known

ADAPTER = "default"  # PEFT's adapter name inside the model
_ADAPTER_PART = re.compile(rf"\.(lora_A|lora_B)\.{ADAPTER}\.")


def _layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers ModuleList; LoRA needs decoder layers")
    return layers


def lora_targets(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Full module names (`model.layers.3.self_attn.q_proj`) that get an adapter."""
    if cfg.target_modules is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        defaults = family(model_type).lora_targets if known(model_type) else cfg.DEFAULT_TARGETS
        wanted = set(defaults) & _linear_leaves(model)
    else:
        wanted = set(cfg.target_modules)
    found: dict[str, list[str]] = {leaf: [] for leaf in wanted}
    smallest: dict[str, int] = {}
    for index, layer in enumerate(_layers(model)):
        for name, module in layer.named_modules():
            leaf = name.rpartition(".")[2]
            if leaf not in wanted or not isinstance(module, nn.Linear) or ".experts." in f".{name}.":
                continue
            full = f"model.layers.{index}.{name}"
            found[leaf].append(full)
            smallest[full] = min(module.in_features, module.out_features)
    missing = sorted(leaf for leaf, names in found.items() if not names)
    if missing:
        raise ValueError(f"trainer.lora.target_modules: {missing} match no linear layer of {type(model).__name__} "
                         f"(MoE experts take no adapter); its layers have "
                         f"{sorted(_linear_leaves(model))}")
    too_big = {name: size for name, size in smallest.items() if cfg.rank > size}
    if too_big:
        name, size = min(too_big.items(), key=lambda kv: kv[1])
        raise ValueError(f"trainer.lora.rank={cfg.rank} is larger than {name} ({size} on its smaller side); "
                         f"set trainer.lora.rank <= {size} or drop that module from trainer.lora.target_modules")
    return sorted(n for names in found.values() for n in names)


def adapter_params(model: nn.Module, cfg: LoraConfig) -> int:
    """Parameters of the adapters `apply_lora` would add: rank x (in + out) per targeted layer."""
    modules = dict(model.named_modules())
    return sum(cfg.rank * (modules[n].in_features + modules[n].out_features) for n in lora_targets(model, cfg))


def _linear_leaves(model: nn.Module) -> set[str]:
    return {name.rpartition(".")[2] for layer in _layers(model) for name, m in layer.named_modules()
            if isinstance(m, nn.Linear) and ".experts." not in f".{name}."}


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Adapters on `lora_targets(model, cfg)`, every other parameter frozen; returns the targets."""
    import peft

    targets = lora_targets(model, cfg)
    prefix = "model.layers."
    relative = [t[len(prefix):] for t in targets]
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                             target_modules="|".join(re.escape(n) for n in relative))
    peft.inject_adapter_in_model(config, _layers(model), adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return targets


def adapted_modules(model: nn.Module) -> list[str]:
    """The names of the modules that hold an adapter (what `apply_lora` returned)."""
    return sorted({name.partition(f".lora_A.{ADAPTER}.")[0] for name, _ in model.named_parameters()
                   if f".lora_A.{ADAPTER}." in name})


def is_adapter(name: str) -> bool:
    return _ADAPTER_PART.search(name) is not None


def checkpoint_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


def peft_name(name: str) -> str:
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        if ".lora_B." in name:
            local.zero_()
            continue
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1.0 / math.sqrt(p.shape[1])
        full = torch.empty(tuple(p.shape)).uniform_(-bound, bound, generator=generator)
        if isinstance(p, DTensor):
            chunk = p.__create_chunk_list__()[0]
            full = full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
        if local.numel():
            local.copy_(full.reshape(local.shape))


def adapter_config(cfg: LoraConfig, targets: list[str], base: str) -> dict[str, Any]:
    """PEFT's adapter_config.json for these adapters on the base model at `base`."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "bias": "none", "fan_in_fan_out": False,
            "target_modules": sorted({t.rpartition(".")[2] for t in targets}), "use_rslora": False,
            "use_dora": False, "inference_mode": True}


def adapter_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {peft_name(n): t for n, t in state.items() if is_adapter(n)}


def base_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {checkpoint_name(n): t for n, t in state.items() if not is_adapter(n)}


def merged_tensors(state: dict[str, torch.Tensor], cfg: LoraConfig) -> dict[str, torch.Tensor]:
    merged = base_tensors(state)
    for name, a in state.items():
        if f".lora_A.{ADAPTER}." not in name:
            continue
        module = name.partition(f".lora_A.{ADAPTER}.")[0]
        b = state[f"{module}.lora_B.{ADAPTER}.weight"]
        weight = merged[f"{module}.weight"]
        merged[f"{module}.weight"] = (weight.float() + (cfg.alpha / cfg.rank) * (b.float() @ a.float())).to(weight.dtype)
    return merged
