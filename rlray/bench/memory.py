"""memory: what one trainer rank holds when loading and stepping a model, on 1, 2 and 4 ranks.

Each run spawns `ranks` gloo processes (torch.multiprocessing, no Ray, one torch thread per
rank as Ray gives a trainer actor) that build rlray's `TrainerActor` exactly as a run does
(meta device, `parallelize`, each rank reading its own safetensors slices; the MoE model with
expert parallelism over all ranks) and take one SFT step. Per rank it records the parameter
bytes it holds (`resident_bytes`) and the growth of its peak resident set size (ru_maxrss)
over the process after its imports and process-group set-up, once the model is loaded and once the step (gradients,
AdamW state, activations) is done. The ratios divide rank 0's figures by the full model's fp32
bytes. For comparison, `full load` is one process loading the same checkpoint whole with
transformers' `from_pretrained` and reading every weight once, what every rank did before
sharded loading. Both count the checkpoint's memory-mapped pages a process has read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import tempfile
from pathlib import Path
from typing import Any

from rlray.algo.loss import algo_config
from rlray.bench.common import Column, Report, free_port
from rlray.config import ModelConfig
from rlray.config.families import family

MODELS: dict[str, dict[str, Any]] = {
    "tiny-dense": {"num_layers": 2},
    "tiny-moe": {"arch": "glm4_moe", "num_layers": 3, "num_experts": 4, "moe_intermediate_size": 128},
    # ~200M parameters, 0.8 GB in fp32
    "dense-0.8g": {"hidden_size": 1024, "num_layers": 16, "num_heads": 16, "num_kv_heads": 8, "head_dim": 64,
                   "intermediate_size": 3072},
    # ~170M parameters, 0.7 GB in fp32, 85% of them in 8 routed experts per layer
    "moe-0.7g": {"arch": "glm4_moe", "hidden_size": 512, "num_layers": 12, "num_heads": 8, "num_kv_heads": 4,
                 "head_dim": 64, "intermediate_size": 2048, "num_experts": 8, "experts_per_token": 2,
                 "moe_intermediate_size": 1024},
}
QUICK = {"models": ["tiny-dense", "tiny-moe"], "ranks": [1, 2]}
FULL = {"models": ["dense-0.8g", "moe-0.7g"], "ranks": [1, 2, 4]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), help="default: the ~0.7-0.8 GB dense and MoE")
    p.add_argument("--ranks", nargs="+", type=int, help="rank counts (default 1 2 4)")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sft_batch(world: int, rank: int) -> list[Any]:
    import numpy as np

    from rlray.data.packing import Sample, pack

    rng = np.random.default_rng(0)
    samples = [Sample(rng.integers(4, 40, 32), rng.integers(4, 40, 32), np.ones(32, np.float32), 0.0,
                      np.zeros(32, np.float32)) for _ in range(4 * world)]
    return pack(samples, world, micro_batch_tokens=256, pad_id=0)[rank]


def _warm(path: str) -> None:
    """Import every module the model needs (a meta-device build), so the baseline holds the imports."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlray.models.catalog import read_config

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(read_config(path))


def _worker(rank: int, world: int, port: int, path: str, ep: int, out: str) -> None:
    import torch

    from rlray.actors.trainer import TrainerActor
    from rlray.config import TrainerConfig
    from rlray.models.load import resident_bytes

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world)
    _warm(path)
    base = peak_rss()
    t = TrainerActor(rank, world, f"127.0.0.1:{port}", ModelConfig(name=path),
                     TrainerConfig(num_ranks=world, ep=ep), algo_config(), "gloo", 1.0)
    t.setup()
    loaded = peak_rss()
    held = resident_bytes(t.model)
    t.sft_step(_sft_batch(world, rank))
    stepped = peak_rss()
    Path(out, f"{rank}.json").write_text(json.dumps(
        {"params": held, "load": loaded - base, "step": stepped - base}))
    torch.distributed.destroy_process_group()
    os._exit(0)  # FSDP2 on gloo can abort in interpreter teardown after all work is done


def _full_load(_rank: int, path: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    _warm(path)
    base = peak_rss()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # transformers may keep weights as views of the mmapped file until they are read
        sum(float(p.sum()) for p in model.parameters())
    Path(out, "full.json").write_text(json.dumps({"load": peak_rss() - base}))


def measure(path: str, world: int, ep: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, free_port(), path, ep, out), nprocs=world, join=True)
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def full_load(path: str) -> int:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_full_load, args=(path, out), nprocs=1, join=True)
        return json.loads(Path(out, "full.json").read_text())["load"]


def full_bytes(path: str) -> int:
    """The checkpoint's tensors' bytes in fp32."""
    from safetensors import safe_open

    full = 0
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            full += sum(math.prod(h.get_slice(k).get_shape()) for k in h.keys()) * 4  # noqa: SIM118
    return full


def run(args: argparse.Namespace) -> Report:
    from rlray.models.tiny import model_path

    opts = QUICK if args.quick else FULL
    models, ranks = args.models or opts["models"], args.ranks or opts["ranks"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = Report("memory", args.quick, params={"models": models, "ranks": ranks})
    report.columns = [Column("model", "model"), Column("ranks", "ranks"), Column("ep", "ep"),
                      Column("full_gb", "full fp32 GB", "{:.3f}"), Column("params_gb", "params/rank GB", "{:.3f}"),
                      Column("load_gb", "peak RSS +load GB", "{:.3f}"), Column("step_gb", "peak RSS +step GB", "{:.3f}")]
    for name in models:
        path = model_path(ModelConfig(**MODELS[name]))
        full = full_bytes(path)
        whole = full_load(path)
        report.rows.append({"model": name, "ranks": "full load", "full_gb": full / 1e9, "load_gb": whole / 1e9})
        for world in ranks:
            ep = world if family(MODELS[name].get("arch")).moe else 1
            rank0 = measure(path, world, ep)[0]
            report.rows.append({"model": name, "ranks": world, "ep": ep, "full_gb": full / 1e9,
                                "params_gb": rank0["params"] / 1e9, "load_gb": rank0["load"] / 1e9,
                                "step_gb": rank0["step"] / 1e9})
            report.ratios[f"{name} params/rank / full, {world} ranks"] = rank0["params"] / full
            report.ratios[f"{name} load RSS / full-load RSS, {world} ranks"] = rank0["load"] / whole
    report.notes.append("peak RSS counts everything a rank's process grew by (weights, buffers, allocator "
                        "slack) after its imports; one torch thread per rank")
    return report
