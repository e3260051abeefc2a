"""The HF export of a trainer: a transformers folder written by every rank, renamed into place once complete.

Contract: `export_hf(learner, path, rank, tokenizer_from, merged)`, a collective of every trainer rank
(rlray.actors.state's `export_hf`), writes the model at `path` (rlray.models.export: every rank its own tensors in
bf16 under the checkpoint's names, rank 0 the index and config.json) with the tokenizer of `tokenizer_from` (a
vision-language model's processor). With LoRA: `path/adapter` (a PEFT adapter folder on its base, the adapters
gathered: they are small), `path/base` when SFT trained the base, and with `merged` `path/merged`, the adapters
merged into the base; both stream like the whole model. Everything goes to `<path>.tmp`, which rank 0 renames to
`path` once every rank is done (an older `path` is replaced): a folder at `path` is complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from rlray.actors.learner import Learner
from rlray.models.export import BASE, FULL, merged_view, write_folder
from rlray.models.lora import adapted_modules, adapter_config, adapter_tensors, is_adapter
from rlray.models.multimodal import is_vision


def _tokenizer(model: nn.Module, tokenizer_from: str) -> Any:
    from transformers import AutoProcessor, AutoTokenizer

    # a vision-language model's folder gets its processor (image processor, template, tokenizer)
    return (AutoProcessor if is_vision(model.config) else AutoTokenizer).from_pretrained(tokenizer_from)


def _write_adapter(model: nn.Module, folder: Path, config: dict[str, Any], rank: int) -> None:
    """The adapters, gathered (every rank joins each gather; rank 0 writes): PEFT's adapter file and config."""
    from safetensors.torch import save_file

    held = {n: p.detach() for n, p in model.named_parameters() if is_adapter(n)}
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).cpu() for n, p in held.items()}
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in adapter_tensors(full).items()}
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def staging(path: Path, rank: int) -> Path:
    """`<path>.tmp`, emptied by rank 0 (a crashed export's leftovers), once every rank is there."""
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    return tmp


def commit(tmp: Path, path: Path, rank: int) -> None:
    """Once every rank has written: rank 0 renames `tmp` to `path` (an older `path` goes)."""
    dist.barrier()
    if rank == 0:
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


@torch.no_grad()
def export_hf(learner: Learner, path: str, rank: int, tokenizer_from: str, merged: bool = False) -> None:
    model, lora, out = learner.model, learner.cfg.lora, Path(path)
    tmp = staging(out, rank)
    tokenizer = _tokenizer(model, tokenizer_from) if rank == 0 else None
    folders = {tmp: FULL}
    if lora.enabled:
        folders = {tmp / "base": BASE} if learner.base_trained else {}
        if merged:
            folders[tmp / "merged"] = merged_view(lora)
        base = str(out / "base") if learner.base_trained else tokenizer_from
        _write_adapter(model, tmp / "adapter", adapter_config(lora, adapted_modules(model), base), rank)
        if rank == 0:
            tokenizer.save_pretrained(tmp / "adapter")
    for folder, view in folders.items():
        write_folder(model, folder, view, rank)
        if rank == 0:
            tokenizer.save_pretrained(folder)
    commit(tmp, out, rank)
