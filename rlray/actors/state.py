"""A trainer rank's state on disk: checkpoints, the weight digest, the HF export.

Contract (every function is a collective: every rank of the trainer calls it):
- `save(learner, path, rank)` writes the model, optimizer, scheduler and KL reference through
  torch.distributed.checkpoint (every rank its shards) and this rank's torch, numpy and Python
  RNG states; `load(learner, path, rank)` reads them back. Both return `weights_digest(model)`.
- `weights_digest(model)`: a sha256 of every rank's parameter shards, bit for bit.
- `export_hf(model, path, rank, tokenizer_from)`: rank 0 writes a transformers folder (weights
  and the tokenizer of `tokenizer_from`) behind a barrier: trainer.collective_timeout_s must
  cover the write.
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlray.actors.learner import Learner


def _state(learner: Learner) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model, optim = get_state_dict(learner.model, learner.optimizer)
    state = {"model": model, "optim": optim, "scheduler": learner.scheduler.state_dict()}
    if learner.ref_model is not None:
        learner.snapshot_reference()
        state["ref"] = get_model_state_dict(learner.ref_model)
    return state


def save(learner: Learner, path: str, rank: int) -> str:
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(learner), checkpoint_id=path)
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    torch.save(rng, os.path.join(path, f"rng_rank{rank}.pt"))
    dist.barrier()
    return weights_digest(learner.model)


def load(learner: Learner, path: str, rank: int) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = _state(learner)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(learner.model, learner.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    learner.scheduler.load_state_dict(state["scheduler"])
    if learner.ref_model is not None:
        set_model_state_dict(learner.ref_model, state["ref"])
    rng = torch.load(os.path.join(path, f"rng_rank{rank}.pt"), weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return weights_digest(learner.model)


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        h.update(name.encode())
        h.update(local.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, h.hexdigest())
    return hashlib.sha256("".join(str(d) for d in digests).encode()).hexdigest()[:16]


def export_hf(model: torch.nn.Module, path: str, rank: int, tokenizer_from: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        from transformers import AutoTokenizer

        model.save_pretrained(path, state_dict=full)
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    dist.barrier()
