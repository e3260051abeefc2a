"""A DeepSeek-V3 checkpoint in FP8 (tests/fp8.py quantizes the deepseek_v3 twin in 128x128 blocks, partial ones at
the edges: kv_a_proj_with_mqa's 576 rows, each expert's 32) trains dequantized: the TrainerActor on 2 ranks (FSDP2,
EP 2: each rank reads its half of every weight, its 2 experts' per-expert tensors and their scales) holds the
dequantized values exactly, and its export is plain, as the checkpoint names it (no quantization_config, no scale
tensors, one tensor per expert, each rank writing its own) and equal to those values cast to bf16.
rlray.models.quantized; the reads of each rank's box alone are counted in tests/unit/test_quantized.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from rlray.algo.loss import algo_config
from rlray.config import ModelConfig, TrainerConfig
from rlray.models.tiny import model_path
from tests.dist.common import folder_tensors, spawn
from tests.fp8 import fp8_checkpoint

DEEPSEEK = ModelConfig(arch="deepseek_v3", num_layers=2, moe_intermediate_size=32, intermediate_size=128, seed=4)
EXPERTS = "model.layers.1.mlp.experts"


def worker(rank: int, world: int, port: int, out: dict, folder: str, export: str) -> None:
    from rlray.actors.trainer import TrainerActor
    from rlray.parallel.expert import moe_experts

    t = TrainerActor(rank, world, f"127.0.0.1:{port}", ModelConfig(name=folder, arch="deepseek_v3"),
                     TrainerConfig(num_ranks=world, ep=world), algo_config(loss="dapo"), "gloo", 1.0)
    t.setup()
    held = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in t.learner.model.named_parameters()}
    t.export_hf(export)
    if rank == 0:
        out.update(held=held, experts=[m.num_experts for _, m in moe_experts(t.learner.model)])
    dist.destroy_process_group()


def test_an_fp8_checkpoint_trains_and_exports_dequantized_on_two_ranks(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    folder, export = tmp_path / "fp8", tmp_path / "hf"
    reference = fp8_checkpoint(Path(model_path(DEEPSEEK)), folder)
    assert load_file(str(folder / "model.safetensors"))[f"{EXPERTS}.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    out = spawn(worker, 2, str(folder), str(export))
    assert out["experts"] == [2]  # EP 2: each rank holds 2 of the 4 experts
    fused = {f"{EXPERTS}.{n}": torch.stack([torch.cat([reference[f"{EXPERTS}.{e}.{p}.weight"] for p in parts])
                                            for e in range(4)])
             for n, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))}
    want = {**reference, **fused}
    held = out["held"]
    assert held.keys() <= want.keys() and fused.keys() <= held.keys()
    assert all(torch.equal(held[k], want[k]) for k in held), [k for k in held if not torch.equal(held[k], want[k])]
    exported = folder_tensors(export)  # bf16 (fp32 buffers: the routers' correction biases), from both ranks
    assert len(list(export.glob("*.safetensors"))) == 2
    assert "quantization_config" not in json.loads((export / "config.json").read_text())
    assert exported.keys() == reference.keys() and not any(k.endswith("_scale_inv") for k in exported)
    assert all(torch.equal(exported[k], reference[k].to(exported[k].dtype)) for k in reference)
