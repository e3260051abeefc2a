"""FSDP2 for transformers decoder models.

Contract: `data_parallel_mesh(device, n)` builds the 1-D `dp_shard` mesh;
`apply_fsdp(model, mesh, param_dtype, reduce_dtype)` wraps every decoder layer and
then the root with `fully_shard`, so one layer's parameters are gathered at a time.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def data_parallel_mesh(device_type: str, world_size: int) -> DeviceMesh:
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp_shard",))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers ModuleList; cannot apply FSDP per layer")
    return layers


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: str = "float32",
               reduce_dtype: str = "float32") -> nn.Module:
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
