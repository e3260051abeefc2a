"""What a run asks of the cluster, and what this machine has, without importing torch.

Contract: `needs(config)` is the (GPUs, CPUs) a run's bundles ask for. `visible_gpus()` counts
the CUDA GPUs this process may use from the NVIDIA driver's device list (`/proc/driver/nvidia/gpus`,
else `/dev/nvidiaN`), narrowed by `CUDA_VISIBLE_DEVICES`; torch is imported only to confirm a
count that falls short, where a driver is present. `check_local(config)` refuses, with one line
naming the keys, a local run (no `cluster.address`, no `RAY_ADDRESS`) whose bundles need GPUs
this machine lacks (a local Ray declares exactly the GPUs it has) or more CPUs than
`cluster.num_cpus`. These checks run before anything heavy is imported: a GPU recipe started on
a laptop is refused in about a second.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from rlray.config import Config, ConfigError

DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")
DEV = Path("/dev")


def needs(c: Config) -> tuple[float, float]:
    """(GPUs, CPUs) that the run's bundles ask of the cluster (colocated: the engines use the trainer's GPUs;
    a distillation teacher pool has bundles of its own)."""
    t, r, te = c.trainer, c.rollout, c.teacher
    teacher = (te.num_actors * te.gpus_per_actor, te.num_actors * te.cpus_per_actor) if te.enabled else (0.0, 0.0)
    if c.cluster.colocate:
        return (t.num_ranks * t.gpus_per_rank + teacher[0],
                t.num_ranks * t.cpus_per_rank + r.num_actors * r.cpus_per_actor + teacher[1])
    return (t.num_ranks * t.gpus_per_rank + r.num_actors * r.gpus_per_actor + teacher[0],
            t.num_ranks * t.cpus_per_rank + r.num_actors * r.cpus_per_actor + teacher[1])


def is_local(c: Config) -> bool:
    return c.cluster.address is None and not os.environ.get("RAY_ADDRESS")


def driver_gpus(proc: Path = DRIVER_GPUS, dev: Path = DEV) -> int:
    """GPUs the NVIDIA driver lists on this machine (0 without a driver)."""
    if proc.is_dir():
        return sum(1 for _ in proc.iterdir())
    return sum(1 for p in dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)) if dev.is_dir() else 0


def visible_gpus(proc: Path = DRIVER_GPUS, dev: Path = DEV, mask: str | None = None) -> int:
    """The driver's GPUs that CUDA_VISIBLE_DEVICES (or `mask`) leaves this process; torch confirms a
    count that falls short of the driver's (MIG slices, UUIDs), and is never imported without a driver."""
    n = driver_gpus(proc, dev)
    mask = os.environ.get("CUDA_VISIBLE_DEVICES") if mask is None else mask
    if n and mask is not None:
        ids = [] if mask.strip() in ("", "-1") else mask.split(",")
        n = min(n, len(ids))
    return n


def _torch_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def check_local(c: Config, command: str = "python -m rlray.launch ...") -> None:
    """A local Ray cluster gets exactly the GPUs this machine has and `cluster.num_cpus` CPUs."""
    if not is_local(c):
        return
    t, r = c.trainer, c.rollout
    need, cpus = needs(c)
    seen = visible_gpus() if need or c.cluster.num_gpus else 0
    if seen and seen < max(need, c.cluster.num_gpus or 0):
        seen = _torch_gpus()
    if c.cluster.num_gpus is not None and c.cluster.num_gpus > seen:
        raise ConfigError(f"cluster.num_gpus={c.cluster.num_gpus} but this machine has {seen} GPUs; a local Ray "
                          "cluster cannot declare GPUs that do not exist (leave cluster.num_gpus unset)")
    if t.num_ranks * t.gpus_per_rank > seen > 0:
        raise ConfigError(f"trainer.num_ranks={t.num_ranks} needs {t.num_ranks} GPUs (one per rank) but this machine "
                          f"has {seen}; lower trainer.num_ranks or submit the run to a Ray cluster")
    if need > seen:
        raise ConfigError(f"run '{c.run.name}' needs {need:g} GPUs (trainer {t.num_ranks} x {t.gpus_per_rank:g}, "
                          f"rollout {r.num_actors} x {r.gpus_per_actor:g}) but this machine has {seen}; "
                          f"submit it to a Ray cluster (ray job submit --address http://HEAD:8265 --working-dir . -- "
                          f"{command}), or run its CPU twin here ({command} +twin={'cpu_cp' if t.cp > 1 else 'cpu'})")
    if cpus > c.cluster.num_cpus:
        te = f" + teacher ({c.teacher.num_actors}x{c.teacher.cpus_per_actor:g})" if c.teacher.enabled else ""
        raise ConfigError(f"trainer ({t.num_ranks}x{t.cpus_per_rank:g}) + rollout ({r.num_actors}x"
                          f"{r.cpus_per_actor:g}){te} need {cpus:g} CPUs but cluster.num_cpus={c.cluster.num_cpus}; "
                          "raise cluster.num_cpus or lower the counts")
