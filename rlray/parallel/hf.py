"""The one adapter onto transformers (and torch) internals that rlray relies on (pinned by tests/unit/test_hf_adapter.py).

- `shard_and_dispatch_experts(module, ep_mesh)`: transformers' own expert-parallel pieces for
  a fused experts module: `MoEParamShard` (every parameter of the module that leads with the expert
  count, `expert_sharded(module)`: the fused weights and gpt-oss's per-expert biases, as gpt-oss's own EP
  plan shards them, become DTensors `Shard(0)` on `ep_mesh`, `module.num_experts` the local count) and
  `EpDispatchExpertsParallel.install_forward` (all-to-all token dispatch and combine around the experts'
  own kernel). transformers 5.19 applies them only through `from_pretrained(distributed_config=...)`,
  which refuses `ep_size != tp_size`; rlray needs EP over data-parallel ranks, so it calls them itself.
- `init_non_persistent_buffers(model)`: after a meta-device build and `to_empty`, recompute the
  buffers that no checkpoint holds (rotary `inv_freq`) with the model's own `_init_weights`.
- `register_attention(name, fn)`: an attention function in transformers' `AttentionInterface`,
  chosen with `from_config(..., attn_implementation=name)`. No mask function is registered for
  it, so transformers hands it `attention_mask=None` and builds no mask of its own.
- `sdpa_attention(module, query, key, value, mask, causal, **kwargs)`: transformers' own SDPA
  attention (GQA head repeat, scaling, dropout) with a boolean mask of ours, or causal.
- `eager_attention(module, query, key, value, mask, **kwargs)`: the module's own modeling file's
  `eager_attention_forward` (gpt-oss's adds its attention sinks, `module.sinks`) with an additive mask of ours.
- `router_weights(router, logits, indices)`: what a transformers MoE router computes as the routing
  weights of experts `indices` [N, K] from its `logits` [N, E] (Qwen3-MoE: softmax, renormalised
  over the top-k; GLM-4.5: sigmoid without the correction bias, renormalised, times
  `routed_scaling_factor`; their vision-language variants alike; gpt-oss, "topk_softmax": a softmax over
  the top-k logits, the router's bias in them, equal to Qwen's rule only to rounding), for routing replay
  (rlray.parallel.routing): `ROUTER_RULES` by the rule its family's record names (rlray.config.families).
- `text_positions_to_layers(model)`: a vision-language model's decoder layers get the text positions
  (row 0 of the [4, B, T] `position_ids`) as their `position_ids`, from which packed attention (and
  flash attention's varlen path) read the sequence bounds. Qwen3-VL passes them so; GLM-4.5V's text
  model passes the 3 rotary rows instead (transformers 5.19), which would run a packed row's
  sequences together. Two forward pre-hooks: the text model keeps row 0, each layer takes it.
- `experts_transposed_on_disk(model_type)`: whether the family's checkpoints hold fused experts as
  (E, H, 2I) and (E, I, H), transposed from transformers' in-memory layout (Qwen3-VL-MoE): read from
  transformers' own checkpoint conversion mapping (a `Transpose` on `mlp.experts.*`). vLLM's loader reads
  that layout, so rlray reads, sends and writes the experts so for those families.
- `checkpoint_sources(model, keys)`: transformers' own load-time renaming of a checkpoint's tensor names into the
  model's (its conversion mapping for `model`: Nemotron-H's `backbone.` -> `model.`, and the per-expert tensors
  `experts.<e>.gate_proj.weight`, ... that it merges into fused experts), so that rlray reads slices of exactly
  what `from_pretrained` would load. Returns the renamed tensors (model name -> key) and the merged ones (model
  name -> parts concatenated along dim 1, each part its experts' keys in expert order, stacked along dim 0);
  merges of other shapes than that are left out (Qwen3-VL-MoE's transpose: `experts_transposed_on_disk`).
- `save_pretrained(model, folder, state_dict)`: transformers' `save_pretrained` under the model's own class
  (`own_class(model)`), not the one FSDP2 makes of it (`FSDP<Class>`), by which transformers finds no checkpoint
  conversion: saved so, the tensors take the checkpoint's names (Nemotron-H's `backbone.` and per-expert tensors),
  as `from_pretrained` reads them (Qwen3-VL-MoE's experts then still need their transpose).
- `checkpoint_tensors(model, tensors)`: transformers' `revert_weight_conversion` (what `save_pretrained` runs on
  the whole state dict) on a part of it, under the model's own class: one layer's tensors at a time for the
  streamed export (rlray.actors.export); a rank's block of n fused experts comes back as `experts.0` ..
  `experts.<n-1>`, its offset the caller's to add.
- `all_gather_autograd(x, group)`: torch's functional all-gather along dim 0 whose backward
  returns each rank's share of the gradient (an all-to-all on gloo, which has no reduce-scatter).
- `dequantize_mxfp4(blocks, scales)`: transformers' own MXFP4 unpacker (`convert_moe_packed_tensors`, what
  `from_pretrained` runs with `Mxfp4Config(dequantize=True)`): (E, R, G, 16) nibbles and (E, R, G) exponents
  into fp32 (E, G * 32, R), the layout of gpt-oss's fused experts.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from rlray.config.families import router_rule


def expert_sharded(module: nn.Module) -> list[str]:
    """The experts module's own parameters that lead with the expert count: the fused weights and any
    per-expert biases (gpt-oss's `gate_up_proj_bias` (E, 2I), `down_proj_bias` (E, H))."""
    total = module.num_experts
    return [n for n, p in module.named_parameters(recurse=False) if p.dim() and p.shape[0] == total]


def shard_and_dispatch_experts(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    from transformers.distributed.tensor_parallel import EpDispatchExpertsParallel, MoEParamShard

    shard = MoEParamShard(Shard(0), shards_expert_dim=True)  # sets module.num_experts to the local count
    for param in expert_sharded(module):
        shard.shard_param(module, param, ep_mesh)
    EpDispatchExpertsParallel().install_forward(module, ep_mesh)


def init_non_persistent_buffers(model: nn.Module) -> None:
    init = model._init_weights  # the model class's own initialiser, which knows its rotary modules
    for module in model.modules():
        if module._non_persistent_buffers_set:
            init(module)


def register_attention(name: str, fn: Callable) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)


def sdpa_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                   causal: bool = False, **kwargs: Any) -> tuple[Tensor, None]:
    """Output [B, T, H, D]; `causal` applies only without a mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=causal, **kwargs)


def eager_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                    **kwargs: Any) -> tuple[Tensor, Tensor]:
    """The module's own model's `eager_attention_forward` (gpt-oss's adds its `module.sinks`) under an
    additive `mask`; output [B, T, H, D]."""
    eager = importlib.import_module(type(module).__module__).eager_attention_forward
    return eager(module, query, key, value, mask, **kwargs)


def _softmax_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    w = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, indices)
    if getattr(router, "norm_topk_prob", True):  # Qwen3-VL-MoE's router has no flag: it always renormalises
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def _sigmoid_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    w = logits.sigmoid().gather(1, indices)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


def _topk_softmax_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    return torch.softmax(logits.gather(1, indices), dim=-1, dtype=logits.dtype)


# a family's routing-weight rule (rlray.config.families MoE.rule) -> how its router weighs the chosen experts
ROUTER_RULES: dict[str, Callable[[nn.Module, Tensor, Tensor], Tensor]] = {
    "softmax": _softmax_weights,
    "sigmoid": _sigmoid_weights,
    "topk_softmax": _topk_softmax_weights,
}


def router_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    rule = router_rule(type(router).__name__)
    assert rule is not None, f"no family has the router {type(router).__name__} (RouterReplay refuses it)"
    return ROUTER_RULES[rule](router, logits, indices)


def text_positions_to_layers(model: nn.Module) -> None:
    text = model.model.language_model
    kept: list[Tensor | None] = [None]

    def keep(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        pos = kwargs.get("position_ids")
        kept[0] = pos[0] if pos is not None and pos.ndim == 3 and pos.shape[0] == 4 else None

    def give(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        pos = kwargs.get("position_ids")
        if kept[0] is not None and pos is not None and pos.ndim == 3:
            kwargs["position_ids"] = kept[0]
        return args, kwargs

    text.register_forward_pre_hook(keep, with_kwargs=True)
    for layer in text.layers:
        layer.register_forward_pre_hook(give, with_kwargs=True)


def experts_transposed_on_disk(model_type: str) -> bool:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Transpose

    return any(getattr(c, "source_patterns", None) == ["mlp.experts.gate_up_proj"]
               and any(isinstance(op, Transpose) for op in c.operations)
               for c in get_checkpoint_conversion_mapping(model_type) or [])


def checkpoint_sources(model: nn.Module, keys: Iterable[str]) -> tuple[dict[str, str], dict[str, list[list[str]]]]:
    """(model name -> the key renamed into it, model name -> its per-expert keys: parts, each in expert order)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    renamed: dict[str, str] = {}
    merged: dict[str, list[dict[int, str]]] = {}
    for key in sorted(keys):  # transformers renames in sorted order too (a GroupWeightRename keeps state)
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            if name != key:
                renamed[name] = key
        elif _stacks_experts(by_pattern[pattern]):
            expert = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
            parts = merged.setdefault(name, [{} for _ in by_pattern[pattern].source_patterns])
            parts[by_pattern[pattern].source_patterns.index(pattern)][int(expert[1])] = key
    return renamed, {name: [[p[e] for e in sorted(p)] for p in parts] for name, parts in merged.items()}


def _stacks_experts(converter: Any) -> bool:
    """One tensor per expert stacked along dim 0 (`MergeModulelist(dim=0)`), its parts then concatenated along
    dim 1 (`Concatenate(dim=1)`: gate_proj's rows, then up_proj's)."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    return ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


def all_gather_autograd(x: Tensor, group: Any) -> Tensor:
    from torch.distributed._functional_collectives import all_gather_single_autograd

    return all_gather_single_autograd(x, 0, group)


@contextmanager
def own_class(model: nn.Module) -> Iterator[type]:
    """The model under its own class, not the one FSDP2 makes of it (`FSDP<Class>`), by which transformers finds
    no checkpoint conversion; FSDP2's forward hooks are not called meanwhile. Yields that class."""
    from torch.distributed.fsdp import FSDPModule

    wrapped = type(model)
    own = next(c for c in wrapped.__mro__ if not issubclass(c, FSDPModule))
    model.__class__ = own
    try:
        yield own
    finally:
        model.__class__ = wrapped


def save_pretrained(model: nn.Module, folder: str, state_dict: dict[str, Tensor]) -> None:
    with own_class(model):
        model.save_pretrained(folder, state_dict=state_dict)


def checkpoint_tensors(model: nn.Module, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """`tensors` (the model's names; one decoder layer's, or part of one) under the checkpoint's names and layout
    as `save_pretrained` writes them: transformers' `revert_weight_conversion`, which works on any part of a state
    dict whose conversions it holds whole (meta tensors too). Fused experts of a family whose checkpoints hold
    them per expert come back as `experts.<i>.<part>` with i counted from 0 in the part given; fused experts
    stay fused in transformers' layout (`experts_transposed_on_disk` says when to transpose them)."""
    from transformers.core_model_loading import revert_weight_conversion

    with own_class(model):
        return revert_weight_conversion(model, dict(tensors))


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
