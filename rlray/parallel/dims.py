"""ParallelDims: the trainer's parallel degrees, validated, and the device meshes built from them.

Contract: `ParallelDims(world_size, ep=..., cp=...)` checks the degrees against each other
(`check()`) and against a model (`check_model(hf_config)`), raising `ValueError` naming the
`trainer.*` key and the fix. Every rank is a data-parallel shard (`dp_shard = world_size`,
parameters fully sharded over all of them); expert parallelism borrows its ranks from the
data-parallel ones, so each rank still reads its own batch: the ranks of an `ep` group
exchange tokens, and the `efsdp = world_size / ep` ranks that hold the same experts shard
them with FSDP between each other. `cp` (context parallelism) has its place here and must
be 1 until it lands. Callers ask for meshes by name (`mesh("dp_shard")`, `mesh("ep")`,
`mesh("efsdp")`), never by degree; `build_meshes(device_type)` creates them once
torch.distributed is initialised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESHES = ("dp_shard", "ep", "efsdp")


def num_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer of a transformers config (0 for a dense model)."""
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


@dataclass
class ParallelDims:
    world_size: int
    ep: int = 1
    cp: int = 1
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.check()

    @property
    def dp_shard(self) -> int:
        return self.world_size // self.cp

    @property
    def efsdp(self) -> int:
        return self.world_size // self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def check(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"trainer.num_ranks={self.world_size} must be >= 1")
        if self.cp != 1:
            raise ValueError(f"context parallelism (cp={self.cp}) is not available yet; leave it at 1")
        if self.ep < 1 or self.world_size % self.ep:
            raise ValueError(f"trainer.ep={self.ep} must divide trainer.num_ranks={self.world_size}: expert "
                             "parallelism takes its ranks from the data-parallel ones; pick a divisor")

    def check_model(self, hf_config: Any) -> None:
        """Degrees the model cannot take: experts not divisible by ep, ep on a dense model."""
        if not self.ep_enabled:
            return
        experts = num_experts(hf_config)
        name = getattr(hf_config, "model_type", type(hf_config).__name__)
        if experts == 0:
            raise ValueError(f"trainer.ep={self.ep} but the {name} model has no experts; set trainer.ep=1")
        if experts % self.ep:
            raise ValueError(f"trainer.ep={self.ep} does not divide the {experts} experts of the {name} model; "
                             f"choose an ep that divides {experts} and trainer.num_ranks={self.world_size}")

    def experts_of(self, rank: int, total: int) -> range:
        """The experts (global ids) whose weights `rank` holds."""
        per = total // self.ep
        first = (rank % self.ep) * per
        return range(first, first + per)

    def build_meshes(self, device_type: str) -> None:
        """Create the meshes (every rank calls this once, after init_process_group)."""
        self._meshes["dp_shard"] = init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
        if self.ep_enabled:
            # A root of its own, so FSDP over `efsdp` accepts experts already sharded on `ep`.
            experts = init_device_mesh(device_type, (self.efsdp, self.ep), mesh_dim_names=("efsdp", "ep"))
            self._meshes["efsdp"], self._meshes["ep"] = experts["efsdp"], experts["ep"]

    def mesh(self, name: str) -> DeviceMesh:
        if name not in MESHES:
            raise KeyError(f"no mesh named {name!r}; meshes: {MESHES}")
        if name not in self._meshes:
            raise RuntimeError(f"mesh {name!r} is not built (ep={self.ep}); call build_meshes() first")
        return self._meshes[name]
