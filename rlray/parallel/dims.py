"""ParallelDims: the trainer's parallel degrees, validated, and the device meshes built from them.

Contract: `ParallelDims(world_size, ep=..., cp=...)` checks the degrees against each other
(`check()`) and against a model (`check_model(hf_config)`), raising `ValueError` naming the
`trainer.*` key and the fix. Parameters are fully sharded over every rank (`dp_shard =
world_size`, context-parallel ranks included, torchtitan's dp_shard x cp). Context parallelism
groups `cp` consecutive ranks that split each sequence of one shared batch, so `dp = world_size
/ cp` ranks read distinct batches. Expert parallelism borrows its ranks from the
data-parallel ones: the ranks of an `ep` group exchange tokens, and the `efsdp = world_size /
ep` ranks that hold the same experts shard them with FSDP between each other. Callers ask for
meshes by name (`mesh("dp_shard")`, `mesh("cp")`, `mesh("ep")`, `mesh("efsdp")`), never by
degree; `build_meshes(device_type)` creates them once torch.distributed is initialised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESHES = ("dp_shard", "cp", "ep", "efsdp")


def num_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer of a transformers config (0 for a dense model); a vision-language
    model's are in its text config. A config whose layer kinds name its feed-forward layers (Nemotron-H's "moe",
    "mlp") and none "moe" is dense, whatever its expert count says."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    kinds = getattr(text, "layer_types", None) or ()
    if "mlp" in kinds and "moe" not in kinds:
        return 0
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        value = getattr(text, key, None)
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
        return self.world_size

    @property
    def dp(self) -> int:
        """Ranks that read distinct batches."""
        return self.world_size // self.cp

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def efsdp(self) -> int:
        return self.world_size // self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def check(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"trainer.num_ranks={self.world_size} must be >= 1")
        if self.cp < 1 or self.world_size % self.cp:
            raise ValueError(f"trainer.cp={self.cp} must divide trainer.num_ranks={self.world_size}: each group of "
                             "cp ranks splits the sequences of one batch; pick a divisor")
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
        if self.cp_enabled:
            self._meshes["cp"] = init_device_mesh(device_type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))["cp"]
        if self.ep_enabled:
            # A root of its own, so FSDP over `efsdp` accepts experts already sharded on `ep`.
            experts = init_device_mesh(device_type, (self.efsdp, self.ep), mesh_dim_names=("efsdp", "ep"))
            self._meshes["efsdp"], self._meshes["ep"] = experts["efsdp"], experts["ep"]

    def mesh(self, name: str) -> DeviceMesh:
        if name not in MESHES:
            raise KeyError(f"no mesh named {name!r}; meshes: {MESHES}")
        if name not in self._meshes:
            raise RuntimeError(f"mesh {name!r} is not built (ep={self.ep}, cp={self.cp}); call build_meshes() first")
        return self._meshes[name]
