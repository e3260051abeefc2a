"""A trainer rank's state on disk: checkpoints, the weight digest, the HF export.

Contract (every function is a collective: every rank of the trainer calls it):
- `save(learner, path, rank, base, saver, background)` writes the model, optimizer, scheduler and KL
  reference through torch.distributed.checkpoint (every rank its shards) and this rank's torch, numpy
  and Python RNG states; `load(learner, path, rank)` reads them back. Both return
  `weights_digest(model)`, taken when called. With `background` the shards are written by `saver`
  (rlray.actors.saver) after `save` returns, from a copy of the state taken when called: the folder
  is whole once `saver.finish()` has returned it; the RNG states (and LoRA's `base.json`) are
  written before `save` returns.
- LoRA (`trainer.lora.rank > 0`): a checkpoint holds the adapters (policy and reference), their
  optimizer and scheduler, and `base.json` naming the base: the model's own checkpoint, or, when
  SFT trained the base (`Learner.base_trained`), `BASE` beside the checkpoints, written once by the
  first save after SFT and never pruned (rlray.orchestration.checkpoint prunes `ckpt_*` only);
  `load` reads that base first.
- `weights_digest(model)`: a sha256 of every rank's parameter shards, bit for bit.
- Integrity (not collectives; each rank reads only what it wrote): `checksums(path, rank)` gives
  `{file: [rank, bytes, crc32]}` for the files of checkpoint `path` that rank `rank` wrote (its DCP
  shards `__<rank>_*.distcp` and RNG state; rank 0 also DCP's `.metadata` and `base.json`), and
  `verify(path, rank, files)` returns one line per file of `files` owned by `rank` that is missing, of
  another size or another crc32. CRC32 streams at ~4 GB/s on one core here (sha256 ~1.7): a check
  costs a fraction of reading the shards back.
- `export_hf(learner, path, rank, tokenizer_from, merged)`: a transformers folder (rlray.actors.export: every rank
  writes its own tensors, in bf16 under the checkpoint's names; rank 0 the index, config and the tokenizer of
  `tokenizer_from`, or its processor for a vision-language model; renamed into place once complete). With LoRA:
  `path/adapter` (a PEFT adapter folder: adapter_config.json, adapter_model.safetensors) on its base, `path/base`
  when SFT trained it, and with `merged` `path/merged`, the adapters merged into the base.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlray.actors.learner import Learner
from rlray.actors.saver import Saver
from rlray.models.lora import is_adapter

BASE = "lora_base"  # beside the checkpoints: the base SFT trained, for LoRA runs


def _lora(learner: Learner) -> bool:
    return learner.cfg.lora.enabled


def _model_state(model: torch.nn.Module, adapters: bool | None) -> dict[str, Any]:
    """The model's sharded state dict: whole (None), its adapters (True) or its base (False)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)
    return state if adapters is None else {k: v for k, v in state.items() if is_adapter(k) == adapters}


def _state(learner: Learner) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(learner.model, learner.optimizer)
    adapters = True if _lora(learner) else None
    if adapters:
        model = {k: v for k, v in model.items() if is_adapter(k)}
    state = {"model": model, "optim": optim, "scheduler": learner.scheduler.state_dict()}
    if learner.ref_model is not None:
        learner.snapshot_reference()
        state["ref"] = _model_state(learner.ref_model, adapters)
    return state


def _save_base(learner: Learner, root: Path, rank: int) -> None:
    """The base SFT trained, once per run (a folder without its `done` mark is written again)."""
    import torch.distributed.checkpoint as dcp

    folder = root / BASE
    if (folder / "done").exists():
        return
    dcp.save({"base": _model_state(learner.model, False)}, checkpoint_id=str(folder))
    dist.barrier()
    if rank == 0:
        (folder / "done").write_text("complete\n")


def _load_base(learner: Learner, root: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = {"base": _model_state(learner.model, False)}
    dcp.load(state, checkpoint_id=str(root / BASE))
    for model in (learner.model, learner.ref_model):
        if model is not None:
            set_model_state_dict(model, state["base"], options=StateDictOptions(strict=False))
    learner.base_trained = True


def save(learner: Learner, path: str, rank: int, base: str = "", saver: Saver | None = None,
         background: bool = False) -> str:
    """`base`: the model's own checkpoint (what `base.json` names when SFT did not train the base);
    `background`: DCP's shards written by `saver` in the background (rlray.actors.saver)."""
    if _lora(learner) and learner.base_trained:
        _save_base(learner, Path(path).parent, rank)
    Path(path).mkdir(parents=True, exist_ok=True)
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    torch.save(rng, os.path.join(path, f"rng_rank{rank}.pt"))
    if _lora(learner) and rank == 0:
        named = f"../{BASE}" if learner.base_trained else base
        Path(path, "base.json").write_text(json.dumps({"base": named}) + "\n")
    digest = weights_digest(learner.model)  # before a background write starts, so as not to share the cores with it
    (saver or Saver(learner.cfg.collective_timeout_s)).start(_state(learner), path, background)
    return digest


def load(learner: Learner, path: str, rank: int) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    if _lora(learner) and (Path(path).parent / BASE / "done").exists():
        _load_base(learner, Path(path).parent)
    state = _state(learner)
    dcp.load(state, checkpoint_id=path)
    options = StateDictOptions(strict=not _lora(learner))  # with LoRA, the adapters' part of the state
    set_state_dict(learner.model, learner.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    learner.scheduler.load_state_dict(state["scheduler"])
    if learner.ref_model is not None:
        set_model_state_dict(learner.ref_model, state["ref"], options=options)
    rng = torch.load(os.path.join(path, f"rng_rank{rank}.pt"), weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return weights_digest(learner.model)


def _owned(folder: Path, rank: int) -> list[Path]:
    names = [f"rng_rank{rank}.pt", *(p.name for p in folder.glob(f"__{rank}_*.distcp"))]
    if rank == 0:
        names += [".metadata", "base.json"]
    return [folder / n for n in sorted(names) if (folder / n).is_file()]


def _crc32(path: Path, chunk: int = 64 << 20) -> int:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def checksums(path: str, rank: int) -> dict[str, list[int]]:
    return {p.name: [rank, p.stat().st_size, _crc32(p)] for p in _owned(Path(path), rank)}


def verify(path: str, rank: int, files: dict[str, list[int]]) -> list[str]:
    problems = []
    for name, (owner, size, crc) in sorted(files.items()):
        if owner != rank:
            continue
        p = Path(path, name)
        if not p.is_file():
            problems.append(f"{name} is missing")
        elif p.stat().st_size != size:
            problems.append(f"{name} has {p.stat().st_size} bytes, {size} when committed")
        elif _crc32(p) != crc:
            problems.append(f"{name} does not match its checksum")
    return problems


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        h.update(name.encode())
        h.update(local.contiguous().cpu().view(torch.uint8).numpy())  # hashed in place: no copy to bytes
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, h.hexdigest())
    return hashlib.sha256("".join(str(d) for d in digests).encode()).hexdigest()[:16]


def export_hf(learner: Learner, path: str, rank: int, tokenizer_from: str, merged: bool = False) -> None:
    from rlray.actors.export import export_hf as streamed

    streamed(learner, path, rank, tokenizer_from, merged)
