"""Expert parallelism for transformers' fused-expert MoE layers, and the router's load statistics.

Contract:
- `moe_experts(model)` lists `(name, module)` of every fused experts module: one with `num_experts`
  and a family record's expert parameters 3-D (rlray.config.families: `gate_up_proj` (E, 2I, H) and
  `down_proj` (E, H, I) for Glm4MoeExperts, Qwen3MoeExperts, Qwen3NextExperts, ...; Nemotron-H's ungated
  `up_proj` (E, I, H) and `down_proj`). A dense MLP's or shared experts' `up_proj` is a linear module, not a
  3-D parameter, and a router holds none of them: neither is an experts module.
- `apply_expert_parallel(model, ep_mesh)` gives each rank of `ep_mesh` E/ep of every layer's
  experts (DTensor `Shard(0)` on `ep_mesh`, gpt-oss's per-expert biases with them) and makes each experts
  module dispatch its (token, expert) pairs to their owners with all-to-all and combine the results with the
  routing weights, in forward and backward (all-to-all of gloo or NCCL; tested on gloo). The router (GLM's
  `e_score_correction_bias`, group-limited top-k) is not touched: it runs on every rank over
  that rank's own tokens. The pieces are transformers' own (rlray.parallel.hf).
- `ExpertLoad(model)` counts the tokens routed to each expert of each layer during the
  model's forward passes (not during activation-checkpoint recomputation);
  `summary(group)` sums the counts over `group` and returns max/mean per layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlray.config.families import FAMILIES
from rlray.parallel.hf import shard_and_dispatch_experts


def moe_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    sets = {f.moe.expert_params for f in FAMILIES.values() if f.moe}
    fused = lambda m, ps: all(isinstance(p := getattr(m, n, None), nn.Parameter) and p.dim() == 3 for n in ps)
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "num_experts")
            and any(fused(m, params) for params in sets)]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    experts = moe_experts(model)
    if not experts:
        raise ValueError(f"{type(model).__name__} has no fused MoE experts; expert parallelism needs an MoE model")
    for _, module in experts:
        shard_and_dispatch_experts(module, ep_mesh)


class ExpertLoad:
    """Tokens per expert, per MoE layer, over the forward passes since the last `reset()`."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = moe_experts(model)
        self.total = [int(m.down_proj.shape[0]) for _, m in self.layers]  # global E, also under EP
        self.counts: list[torch.Tensor] = []
        self.active = False
        self.reset(torch.device("cpu"))
        model.register_forward_pre_hook(lambda *_: setattr(self, "active", True))
        model.register_forward_hook(lambda *_: setattr(self, "active", False))
        for i, (_, module) in enumerate(self.layers):
            module.register_forward_pre_hook(self._hook(i))

    def _hook(self, i: int) -> Any:
        def count(_module: nn.Module, args: tuple) -> None:
            if self.active:  # recomputation in backward runs after the model's forward has returned
                ids = args[1].detach().reshape(-1)
                self.counts[i] += torch.bincount(ids, minlength=self.total[i]).to(self.counts[i].device)
        return count

    def reset(self, device: torch.device) -> None:
        """Zero the counts, kept on `device` (the one the collectives of `summary` use)."""
        self.counts = [torch.zeros(n, dtype=torch.long, device=device) for n in self.total]

    def summary(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """`moe_load_max_mean`: max/mean tokens per expert, averaged over MoE layers (1.0 is
        perfect balance); `moe_load_max_mean_worst`: the worst layer's; counts summed over `group`."""
        if not self.layers:
            return {}
        counts = torch.stack(self.counts).double()
        if dist.is_initialized():
            dist.all_reduce(counts, group=group)
        ratio = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)
        return {"moe_load_max_mean": float(ratio.mean()), "moe_load_max_mean_worst": float(ratio.max())}
