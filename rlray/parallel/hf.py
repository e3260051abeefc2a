"""The one adapter onto transformers internals that rlray relies on (pinned by tests/unit/test_hf_adapter.py).

- `shard_and_dispatch_experts(module, ep_mesh)`: transformers' own expert-parallel pieces for
  a fused experts module: `MoEParamShard` (weights become DTensors `Shard(0)` on `ep_mesh`,
  `module.num_experts` the local count) and `EpDispatchExpertsParallel.install_forward`
  (all-to-all token dispatch and combine around the experts' own kernel). transformers 5.19
  applies them only through `from_pretrained(distributed_config=...)`, which refuses
  `ep_size != tp_size`; rlray needs EP over data-parallel ranks, so it calls them itself.
- `init_non_persistent_buffers(model)`: after a meta-device build and `to_empty`, recompute the
  buffers that no checkpoint holds (rotary `inv_freq`) with the model's own `_init_weights`.
"""

from __future__ import annotations

from torch import nn
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
