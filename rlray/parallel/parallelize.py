"""parallelize(): the trainer's parallelisms applied to a transformers decoder model, in a fixed order.

Contract: `parallelize(model, dims, cfg)` applies, in this order,
1. expert parallelism (`dims.ep > 1`): each rank keeps E/ep experts of every MoE layer, tokens
   travel by all-to-all (rlray.parallel.expert);
2. activation checkpointing (`cfg.activation_checkpointing`): every decoder layer's activations
   are recomputed in backward (transformers' own gradient checkpointing, non-reentrant);
3. FSDP2: expert weights first, sharded over `efsdp` (the ranks holding the same experts),
   them; then every decoder layer (a vision-language model's: its vision blocks, then its vision
   tower, then the language model's layers) and the root over `dp_shard`, so one layer's parameters
   are gathered at a time, in `cfg.param_dtype` with fp32 master weights and reductions.
It works on a meta-device model (rlray.models.load materialises the shards afterwards).
`clip_grad_norm_(params, max_norm)` clips by the global norm over parameters that may live
on different meshes (dense and expert). Context parallelism needs no change to the model: it lives in
the attention function (rlray.parallel.context) and the micro-batch layout (rlray.data.layout).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlray.config import TrainerConfig
from rlray.parallel.dims import ParallelDims
from rlray.parallel.expert import apply_expert_parallel, moe_experts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers: `model.model.layers`, or a vision-language model's `model.model.language_model.layers`."""
    inner = getattr(model, "model", None)
    layers = getattr(getattr(inner, "language_model", inner), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers ModuleList; cannot shard it per layer")
    return layers


def vision_units(model: nn.Module) -> list[nn.Module]:
    """A vision-language model's vision blocks then its whole tower (`model.model.visual`); [] for a text model."""
    tower = getattr(getattr(model, "model", None), "visual", None)
    if tower is None:
        return []
    blocks = getattr(tower, "blocks", None)
    return [*(blocks if isinstance(blocks, nn.ModuleList) else []), tower]


def parallelize(model: nn.Module, dims: ParallelDims, cfg: TrainerConfig) -> nn.Module:
    if dims.ep_enabled:
        apply_expert_parallel(model, dims.mesh("ep"))
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_fsdp(model, dims, cfg.param_dtype)
    return model


def apply_fsdp(model: nn.Module, dims: ParallelDims, param_dtype: str = "float32") -> nn.Module:
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    if dims.ep_enabled:
        efsdp = dims.mesh("efsdp")
        for _, experts in moe_experts(model):
            fully_shard(experts, mesh=efsdp, mp_policy=mp)
            experts.set_gradient_divide_factor(float(dims.dp_shard))
            # gloo has no PREMUL_SUM: sum, then divide. On a 1-rank mesh torch 2.13 would divide twice.
            if dist.get_backend(efsdp.get_group()) != "nccl" and dims.efsdp > 1:
                experts.set_force_sum_reduction_for_comms(True)
    mesh = dims.mesh("dp_shard")
    for layer in [*vision_units(model), *decoder_layers(model)]:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _mesh_key(p: torch.Tensor) -> object:
    return p.device_mesh if isinstance(p, DTensor) else None


def param_groups(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters grouped by the mesh they are sharded on (foreach kernels need one mesh each)."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(_mesh_key(p), []).append(p)
    return list(groups.values())


@torch.no_grad()
def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale gradients so that their global L2 norm is at most `max_norm`; returns the norm before.

    Every gradient is a DTensor sharded (never replicated) over meshes that together span all
    ranks, dense and expert alike, so the global norm^2 is one all-reduce of the local sums.
    """
    params = [p for p in params if p.grad is not None]
    local = torch.zeros((), dtype=torch.float64, device=params[0].grad.device if params else "cpu")
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            assert not any(pl.is_replicate() or pl.is_partial() for pl in g.placements), g.placements
            assert g.device_mesh.size() == dist.get_world_size(), "a gradient's mesh must span every rank"
            g = g.to_local()
        elif dist.is_initialized() and dist.get_world_size() > 1:
            raise AssertionError("an unsharded gradient would be counted once per rank")
        local += g.double().pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(local)
    total = local.sqrt().float()
    for group in param_groups(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
