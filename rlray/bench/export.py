"""export: seconds and peak resident memory per trainer rank of the HF export, streamed (today's) vs gathered (before).

Each run spawns `ranks` gloo processes (one torch thread each, as Ray gives a trainer actor) that build rlray's
`TrainerActor` (the MoE model with expert parallelism over all ranks), export once to import what an export needs,
then measure the streamed export (rlray.actors.export: every rank writes its own tensors in bf16) and the gathered
one it replaced (`gathered_export`: `get_model_state_dict(full_state_dict=True, cpu_offload=True)` puts the whole
model in fp32 on rank 0, which writes it with transformers' `save_pretrained`). Per rank: seconds, and the growth of
the peak resident set over the export (VmHWM after `clear_refs` 5, above VmRSS at the start), against the full
model's fp32 bytes and the largest decoder layer's. The ranks' glibc returns every block over 64 KiB
(MALLOC_MMAP_THRESHOLD_), so that the resident set follows what is alive (by default freed memory stays resident and
the second export's peak would read low). Written files live in the page cache and do not count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlray.bench.common import Column, Report, free_port
from rlray.bench.memory import MODELS
from rlray.config import ModelConfig
from rlray.config.families import family

QUICK = {"models": ["tiny-moe"], "ranks": [2]}
FULL = {"models": ["dense-0.8g", "moe-0.7g"], "ranks": [1, 2, 4]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), help="default: the ~0.7-0.8 GB dense and MoE")
    p.add_argument("--ranks", nargs="+", type=int, help="rank counts (default 1 2 4)")


def gathered_export(learner: Any, path: str, rank: int, tokenizer_from: str) -> None:
    """The export before the streamed one (no LoRA): the whole model in fp32 gathered to rank 0, which writes it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoTokenizer

    from rlray.models.load import to_checkpoint_layout
    from rlray.models.multimodal import is_vision
    from rlray.parallel.hf import save_pretrained

    model = learner.model
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        save_pretrained(model, path, full)
        to_checkpoint_layout(path)
        if not is_vision(model.config):
            AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    dist.barrier()


def layer_bytes(model: nn.Module) -> int:
    """The largest decoder layer's fp32 bytes (experts included, whatever rank holds them)."""
    from rlray.parallel.parallelize import decoder_layers

    return max(sum(p.numel() * 4 for p in layer.parameters()) for layer in decoder_layers(model))


def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) << 10


def measured(fn: Callable[[], None]) -> dict[str, float]:
    """Seconds and peak resident growth of `fn()`."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the resident set now
    start, t0 = _status("VmRSS"), time.perf_counter()
    fn()
    return {"seconds": time.perf_counter() - t0, "grew": _status("VmHWM") - start}


def _worker(rank: int, world: int, port: int, path: str, ep: int, out: str) -> None:
    from rlray.actors.trainer import TrainerActor
    from rlray.algo.loss import algo_config
    from rlray.config import TrainerConfig
    from rlray.models.load import resident_bytes

    torch.set_num_threads(1)
    t = TrainerActor(rank, world, f"127.0.0.1:{port}", ModelConfig(name=path), TrainerConfig(num_ranks=world, ep=ep),
                     algo_config(), "gloo", 1.0)
    t.setup()
    t.export_hf(f"{out}/new")  # imports and first-use caches
    new = measured(lambda: t.export_hf(f"{out}/new"))
    old = measured(lambda: gathered_export(t.learner, f"{out}/old", rank, path))
    Path(out, f"{rank}.json").write_text(json.dumps({"new": new, "old": old, "params": resident_bytes(t.model),
                                                     "layer": layer_bytes(t.model)}))
    torch.distributed.destroy_process_group()
    os._exit(0)  # FSDP2 on gloo can abort in interpreter teardown after all work is done


def measure(path: str, world: int, ep: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, free_port(), path, ep, out), nprocs=world, join=True)
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def run(args: argparse.Namespace) -> Report:
    from rlray.bench.memory import full_bytes
    from rlray.models.tiny import model_path

    opts = QUICK if args.quick else FULL
    models, ranks = args.models or opts["models"], args.ranks or opts["ranks"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 << 10))  # freed blocks leave the resident set
    report = Report("export", args.quick, params={"models": models, "ranks": ranks})
    gb = lambda key, header: Column(key, f"{header} GB", "{:.3f}")
    report.columns = [Column("model", "model"), Column("ranks", "ranks"), Column("rank", "rank"),
                      gb("full_fp32", "full fp32"), gb("layer_fp32", "layer fp32"), gb("params", "params/rank"),
                      Column("new_s", "streamed s", "{:.2f}"), gb("new_peak", "streamed +peak"),
                      Column("old_s", "gathered s", "{:.2f}"), gb("old_peak", "gathered +peak")]
    for name in models:
        path = model_path(ModelConfig(**MODELS[name]))
        full = full_bytes(path)
        for world in ranks:
            ep = world if family(MODELS[name].get("arch")).moe else 1
            ranks_ = measure(path, world, ep)
            for rank, r in enumerate(ranks_):
                report.rows.append({"model": name, "ranks": world, "rank": rank, "full_fp32": full / 1e9,
                                    "layer_fp32": r["layer"] / 1e9, "params": r["params"] / 1e9,
                                    "new_s": r["new"]["seconds"], "new_peak": r["new"]["grew"] / 1e9,
                                    "old_s": r["old"]["seconds"], "old_peak": r["old"]["grew"] / 1e9})
            layer = ranks_[0]["layer"]
            report.ratios[f"{name} {world} ranks: streamed peak / layer (largest rank)"] = \
                max(r["new"]["grew"] for r in ranks_) / layer
            report.ratios[f"{name} {world} ranks: gathered peak / full (rank 0)"] = ranks_[0]["old"]["grew"] / full
            report.ratios[f"{name} {world} ranks: gathered s / streamed s (rank 0)"] = \
                ranks_[0]["old"]["seconds"] / ranks_[0]["new"]["seconds"]
    report.notes.append("peak = growth of the rank's peak resident set over the export (VmHWM after clear_refs 5); "
                        "streamed writes bf16, gathered wrote fp32; one torch thread per rank; the same disk")
    return report
