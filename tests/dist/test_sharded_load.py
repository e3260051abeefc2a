"""Sharded loading: 2 ranks build a saved checkpoint on the meta device and read only their own
shards. Each rank holds at most 0.6 of the model's parameter bytes, and the loaded model's
logits equal those of the whole model in one plain transformers process, and under EP each rank's experts
equal those experts of the whole model. Covered: a dense Qwen3, a Glm4Moe with EP=2 from the per-expert layout
save_pretrained writes, the same model from a fused-expert file, and a Nemotron-H with EP=2 from what
save_pretrained writes for it (`backbone.` names, ungated per-expert `up_proj`/`down_proj`, read through
transformers' own renaming)."""

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
NEMOTRON = ModelConfig(arch="nemotron_h", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=2,
                       num_kv_heads=1, moe_intermediate_size=32, init_std=0.1, seed=7)  # the hybrid trainer test's twin
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
    from rlray.parallel.expert import moe_experts

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
        out[f"{key}@{rank}"] = {f"{name}.{p}": (t.__create_chunk_list__()[0].offsets[0], t.to_local().detach().numpy())
                                for name, m in moe_experts(model) for p, t in m.named_parameters(recurse=False)}
    dist.destroy_process_group()


def test_each_rank_loads_only_its_shards(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    dense, moe, nemotron = model_path(DENSE), model_path(MOE), model_path(NEMOTRON)
    fused = fused_copy(moe, tmp_path / "fused")
    out = spawn(worker, 2, [("dense", dense, 1), ("moe", moe, 2), ("fused", fused, 2), ("nemotron", nemotron, 2)])
    for key, path in (("dense", dense), ("moe", moe), ("fused", moe), ("nemotron", nemotron)):
        whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        full_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
        assert max(out[key]["bytes"]) <= 0.6 * full_bytes, (key, out[key]["bytes"], full_bytes)
        with torch.no_grad():
            expected = whole(input_ids=IDS).logits.numpy()
        np.testing.assert_allclose(out[key]["logits"], expected, atol=1e-5, rtol=0, err_msg=key)
        held = [out[f"{key}@{rank}"] for rank in range(2)]
        assert all(len(h) == (0 if key == "dense" else 4) for h in held), (key, [list(h) for h in held])
        for name, full in whole.state_dict().items():
            for rank, h in enumerate(held):
                if name in h:  # this rank's experts (E/2 of them, from its offset) are the model's
                    first, local = h[name]
                    assert first == rank * full.shape[0] // 2 and local.shape[0] == full.shape[0] // 2, (name, rank)
                    np.testing.assert_array_equal(local, full[first:first + local.shape[0]].numpy(), err_msg=name)


def test_nemotron_h_checkpoint_is_in_its_hub_layout() -> None:
    """What the sharded load above reads: `backbone.` names and one ungated tensor per expert, as on the hub."""
    from safetensors import safe_open

    with safe_open(f"{model_path(NEMOTRON)}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "backbone.embeddings.weight" in keys and not any(k.startswith("model.") for k in keys)
    assert {f"backbone.layers.1.mixer.experts.{e}.{p}.weight" for e in range(4) for p in ("up_proj", "down_proj")} <= keys
    assert not any("gate_proj" in k or k.endswith("experts.up_proj") for k in keys)
