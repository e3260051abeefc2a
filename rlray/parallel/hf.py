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
- `all_gather_autograd(x, group)`: torch's functional all-gather along dim 0 whose backward
  returns each rank's share of the gradient (an all-to-all on gloo, which has no reduce-scatter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def shard_and_dispatch_experts(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    from transformers.distributed.tensor_parallel import EpDispatchExpertsParallel, MoEParamShard

    shard = MoEParamShard(Shard(0), shards_expert_dim=True)
    for param in EXPERT_PARAMS:
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


def all_gather_autograd(x: Tensor, group: Any) -> Tensor:
    from torch.distributed._functional_collectives import all_gather_single_autograd

    return all_gather_single_autograd(x, 0, group)
