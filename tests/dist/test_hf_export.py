"""The streamed, sharded HF export (rlray.models.export) on 2 gloo ranks against the gathered one it replaced
(rlray.bench.export.gathered_export: rank 0 gathers the whole model in fp32 and writes it with transformers).

A GLM-4.5 MoE twin with EP 2: each rank writes a file, its own experts among them (no gather: experts 0-1 in rank
0's file, 2-3 in rank 1's, under the checkpoint's per-expert names); the index covers every key the old export
wrote; every tensor equals the old one cast to bf16 (the routers' fp32 correction bias kept fp32), in the files and
through transformers' `from_pretrained`; config.json says bfloat16. Each rank's resident set grows during the
export by less than its largest decoder layer's fp32 bytes plus ALLOWANCE, where the old export grew rank 0 by the
whole model. A Qwen3-VL-MoE twin (fused experts its checkpoints hold transposed, each layer's experts split by FSDP,
tied embeddings) loads through transformers equal to the old export cast, the tied head written once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist

from rlray.algo.loss import algo_config
from rlray.config import ModelConfig, TrainerConfig
from rlray.models.tiny import model_path
from tests.dist.common import folder_tensors, spawn

# ~27 MB of fp32 weights, a decoder layer ~7 MB (8 experts of 256 x 256 x 3)
GLM = ModelConfig(arch="glm4_moe", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                  intermediate_size=512, num_experts=8, moe_intermediate_size=256, seed=11)
VL = ModelConfig(arch="qwen3_vl_moe", num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1,
                 intermediate_size=128, moe_intermediate_size=48, tie_word_embeddings=True, seed=12)
# what an export may grow a rank's resident set by beyond one layer: Python's objects (the plan, the header, the
# reverse conversion's), the tokenizer rank 0 reads, allocator slack. Measured: 2.4 MiB beyond the tensors' bytes
# (each rank's experts of a layer in bf16, 1.5 MiB), 4.0 MiB in all, on the second export of a process (the first
# did the imports), glibc returning every block over 64 KiB (MALLOC_MMAP_THRESHOLD_) so that the resident set
# follows what is alive: by default freed memory stays resident and a later peak reads lower than it is
ALLOWANCE = 8 << 20


def worker(rank: int, world: int, port: int, out: dict, cfg: ModelConfig, ep: int, root: str) -> None:
    from rlray.actors.trainer import TrainerActor
    from rlray.bench.export import gathered_export, layer_bytes, measured

    t = TrainerActor(rank, world, f"127.0.0.1:{port}", cfg, TrainerConfig(num_ranks=world, ep=ep),
                     algo_config(loss="dapo"), "gloo", 1.0)
    t.setup()
    t.export_hf(f"{root}/new")  # the first export imports what an export needs
    new = measured(lambda: t.export_hf(f"{root}/new"))
    old = measured(lambda: gathered_export(t.learner, f"{root}/old", rank, model_path(cfg)))
    out[rank] = {"new": new, "old": old, "layer": layer_bytes(t.learner.model)}
    dist.destroy_process_group()


def loaded(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = getattr(AutoConfig.from_pretrained(folder), "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return auto.from_pretrained(folder, dtype=torch.float32).state_dict()


def check_equal_cast(root: Path, tied: bool = False) -> dict[str, torch.Tensor]:
    """The new folder's tensors are the old one's cast to theirs, in the files and through transformers; a tied head
    is written once (the old export wrote it twice: the gathered state dict no longer shared the embedding's storage,
    by which transformers finds ties)."""
    new, old = folder_tensors(root / "new"), folder_tensors(root / "old")
    index = json.loads((root / "new" / "model.safetensors.index.json").read_text())["weight_map"]
    assert index.keys() == new.keys() == old.keys() - ({"lm_head.weight"} if tied else set()), new.keys() ^ old.keys()
    assert {str(t.dtype) for t in new.values()} <= {"torch.bfloat16", "torch.float32"}
    bad = [k for k in new if not torch.equal(new[k], old[k].to(new[k].dtype))]
    assert not bad, bad[:5]
    theirs, ours = loaded(root / "old"), loaded(root / "new")
    assert theirs.keys() == ours.keys()
    on_disk = {k: v.dtype for k, v in new.items()}
    cast = lambda k, v: v.to(on_disk.get(k, torch.bfloat16)).float()  # a tied head reads the embedding's bytes
    differ = [k for k in theirs if not torch.equal(ours[k], cast(k, theirs[k]))]
    assert not differ, differ[:5]
    config = json.loads((root / "new" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    return new


def test_each_rank_writes_its_own_tensors_in_bf16_and_holds_one_layer(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 << 10))  # the spawned ranks' allocator (see ALLOWANCE)
    out = spawn(worker, 2, GLM, 2, str(tmp_path))
    new = check_equal_cast(tmp_path)
    assert new["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    index = json.loads((tmp_path / "new" / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], files
    experts = {k: int(re.search(r"\.experts\.(\d+)\.", k)[1]) for k in index if ".experts." in k}
    assert len(experts) == 3 * 3 * 8 and all(index[k] == files[e // 4] for k, e in experts.items())  # rank e // 4's
    assert not (tmp_path / "new.tmp").exists() and not (tmp_path / "new.old").exists()
    full = sum(t.numel() * 4 for t in new.values())
    for rank in (0, 1):
        new, old, layer = out[rank]["new"], out[rank]["old"], out[rank]["layer"]
        print(f"rank {rank}: streamed export +{new['grew'] / 2**20:.1f} MiB in {new['seconds']:.2f} s; gathered "
              f"+{old['grew'] / 2**20:.1f} MiB in {old['seconds']:.2f} s; layer {layer / 2**20:.1f} MiB, model "
              f"{full / 2**20:.1f} MiB (fp32)")
        assert new["grew"] <= layer + ALLOWANCE, (rank, new, layer)
    assert out[0]["old"]["grew"] > full  # what the bound rules out: the old export gathered the model on rank 0


def test_experts_stored_transposed_and_a_tied_head(tmp_path: Path) -> None:
    spawn(worker, 2, VL, 1, str(tmp_path))
    new = check_equal_cast(tmp_path, tied=True)
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert tuple(new[name].shape) == (4, 64, 96)  # (E, H, 2I): Qwen3-VL-MoE's checkpoint layout
