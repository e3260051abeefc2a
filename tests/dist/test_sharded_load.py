"""Sharded loading: 2 ranks build a saved checkpoint on the meta device and read only their own
shards. Each rank holds at most 0.6 of the model's parameter bytes, and the loaded model's
logits equal those of the whole model in one plain transformers process. Covered: a dense
Qwen3, a Glm4Moe with EP=2 from the per-expert layout save_pretrained writes, and the same
model from a fused-expert file."""

from __future__ import annotations

import shutil

import numpy as np
import torch

from rlray.config import ModelConfig, TrainerConfig
from rlray.models.tiny import model_path
from tests.dist.common import spawn

DENSE = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=256, num_heads=2, num_kv_heads=1, seed=7)
MOE = ModelConfig(arch="glm4_moe", num_layers=3, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
                  moe_intermediate_size=64, num_experts=4, experts_per_token=2, seed=8)
IDS = torch.tensor([[1, 5, 9, 14, 20, 3, 7, 11], [1, 30, 2, 8, 8, 19, 25, 4]])


def fused_copy(src: str, dst) -> str:
    """The same weights in one file with transformers' in-memory (fused expert) names."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "rlray-manifest.json"))
    model = AutoModelForCausalLM.from_pretrained(src)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return str(dst)


def worker(rank: int, world: int, port: int, out: dict, cases: list) -> None:
    import torch.distributed as dist

    from rlray.models.load import build_model, resident_bytes
    from rlray.parallel.dims import ParallelDims

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for key, path, ep in cases:
        dims = ParallelDims(world, ep=ep)
        dims.build_meshes("cpu")
        model = build_model(path, dims, TrainerConfig(num_ranks=world, ep=ep), torch.device("cpu"))
        with torch.no_grad():
            logits = model(input_ids=IDS).logits
        mine = torch.tensor([resident_bytes(model)], dtype=torch.float64)
        everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(everyone, mine)
        if rank == 0:
            out[key] = {"logits": logits.numpy(), "bytes": [float(b) for b in everyone]}
    dist.destroy_process_group()


def test_each_rank_loads_only_its_shards(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    dense, moe = model_path(DENSE), model_path(MOE)
    fused = fused_copy(moe, tmp_path / "fused")
    out = spawn(worker, 2, [("dense", dense, 1), ("moe", moe, 2), ("fused", fused, 2)])
    for key, path in (("dense", dense), ("moe", moe), ("fused", moe)):
        whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        full_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
        assert max(out[key]["bytes"]) <= 0.6 * full_bytes, (key, out[key]["bytes"], full_bytes)
        with torch.no_grad():
            expected = whole(input_ids=IDS).logits.numpy()
        np.testing.assert_allclose(out[key]["logits"], expected, atol=1e-5, rtol=0, err_msg=key)
