"""The one adapter onto transformers (and torch) internals that rlray relies on (pinned by tests/unit/test_hf_adapter.py).

- `shard_and_dispatch_experts(module, ep_mesh)`: transformers' own expert-parallel pieces for
  a fused experts module: `MoEParamShard` (weights become DTensors `Shard(0)` on `ep_mesh`,
  `module.num_experts` the local count) and `EpDispatchExpertsParallel.install_forward`
  (all-to-all token dispatch and combine around the experts' own kernel). transformers 5.19
  applies them only through `from_pretrained(distributed_config=...)`, which refuses
  `ep_size != tp_size`; rlray needs EP over data-parallel ranks, so it calls them itself.
- `init_non_persistent_buffers(model)`: after a meta-device build and `to_empty`, recompute the
  buffers that no checkpoint holds (rotary `inv_freq`) with the model's own `_init_weights`.
- `register_attention(name, fn)`: an attention function in transformers' `AttentionInterface`,
  chosen with `from_config(..., attn_implementation=name)`. No mask function is registered for
  it, so transformers hands it `attention_mask=None` and builds no mask of its own.
- `sdpa_attention(module, query, key, value, mask, causal, **kwargs)`: transformers' own SDPA
  attention (GQA head repeat, scaling, dropout) with a boolean mask of ours, or causal.
- `router_weights(router, logits, indices)`: what a transformers MoE router computes as the routing
  weights of experts `indices` [N, K] from its `logits` [N, E] (Qwen3-MoE: softmax, renormalised
  over the top-k; GLM-4.5: sigmoid without the correction bias, renormalised, times
  `routed_scaling_factor`; their vision-language variants alike), for routing replay (rlray.parallel.routing):
  `ROUTER_RULES` by the rule its family's record names (rlray.config.families).
- `text_positions_to_layers(model)`: a vision-language model's decoder layers get the text positions
  (row 0 of the [4, B, T] `position_ids`) as their `position_ids`, from which packed attention (and
  flash attention's varlen path) read the sequence bounds. Qwen3-VL passes them so; GLM-4.5V's text
  model passes the 3 rotary rows instead (transformers 5.19), which would run a packed row's
  sequences together. Two forward pre-hooks: the text model keeps row 0, each layer takes it.
- `experts_transposed_on_disk(model_type)`: whether the family's checkpoints hold fused experts as
  (E, H, 2I) and (E, I, H), transposed from transformers' in-memory layout (Qwen3-VL-MoE): read from
  transformers' own checkpoint conversion mapping (a `Transpose` on `mlp.experts.*`). vLLM's loader reads
  that layout, so rlray reads, sends and writes the experts so for those families.
- `all_gather_autograd(x, group)`: torch's functional all-gather along dim 0 whose backward
  returns each rank's share of the gradient (an all-to-all on gloo, which has no reduce-scatter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from rlray.config.families import expert_params, router_rule

EXPERT_PARAMS = expert_params()  # every family's fused expert parameters (rlray.config.families)


def shard_and_dispatch_experts(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    from transformers.distributed.tensor_parallel import EpDispatchExpertsParallel, MoEParamShard

    shard = MoEParamShard(Shard(0), shards_expert_dim=True)
    for param in EXPERT_PARAMS:
        if isinstance(getattr(module, param, None), nn.Parameter):
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


# a family's routing-weight rule (rlray.config.families MoE.rule) -> how its router weighs the chosen experts
ROUTER_RULES: dict[str, Callable[[nn.Module, Tensor, Tensor], Tensor]] = {
    "softmax": _softmax_weights,
    "sigmoid": _sigmoid_weights,
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


def all_gather_autograd(x: Tensor, group: Any) -> Tensor:
    from torch.distributed._functional_collectives import all_gather_single_autograd

    return all_gather_single_autograd(x, 0, group)
