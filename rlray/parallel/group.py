"""The trainer's process group on the devices its bundles hold.

Contract: `serve_store(host, world_size, timeout_s)` is rank 0's TCPStore on a port the kernel
picks as it binds (a port chosen earlier and bound later can be taken in between: a run lost its
trainer group to EADDRINUSE while vLLM engines started). `open_trainer_group(rank, world_size,
master, backend, device, timeout_s, store)` joins the default process group through that store
(rank 0 passes it; the others connect to `master`, "host:port"; without a store rank 0 serves
`master` itself) with `timeout_s` as every collective's timeout (NCCL's and gloo's alike; torch's default of 10
minutes is shorter than rank 0's HF export behind a barrier), selects the rank's GPU first on
CUDA, and returns the store. A backend that does not match the device is a ValueError.
`check_own_gpu(store, rank, world_size)` makes every rank publish its GPU's UUID through the
store and raises one line when two ranks were given the same GPU (a Ray node declaring more GPUs
than it has), before NCCL would fail with "Duplicate GPU detected" at the first collective.
`shared_gpu(uuids)` is that rule on a list.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

BACKEND_OF = {"cuda": "nccl", "cpu": "gloo"}


def serve_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def open_trainer_group(rank: int, world_size: int, master: str, backend: str, device: torch.device,
                       timeout_s: float, store: dist.Store | None = None) -> dist.Store:
    if BACKEND_OF.get(device.type) != backend:
        raise ValueError(f"trainer rank {rank} holds a {device.type} device but the backend is {backend}; set "
                         f"cluster.backend={BACKEND_OF.get(device.type, 'auto')} (or auto)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"trainer rank {rank}: its bundle holds a GPU (trainer.gpus_per_rank) but torch sees "
                               f"none in this process (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        torch.cuda.set_device(0)  # Ray makes the bundle's GPU the only one this process sees
    host, port = master.rsplit(":", 1)
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore("trainer", store), rank=rank, world_size=world_size,
                            timeout=timeout)
    return store


def shared_gpu(uuids: list[str]) -> tuple[int, int, str] | None:
    """The first two ranks holding the same GPU (rank, rank, uuid), or None."""
    first: dict[str, int] = {}
    for rank, uuid in enumerate(uuids):
        if uuid in first:
            return first[uuid], rank, uuid
        first[uuid] = rank
    return None


def check_own_gpu(store: dist.Store, rank: int, world_size: int) -> None:
    store.set(f"gpu/{rank}", str(torch.cuda.get_device_properties(0).uuid))
    uuids = [store.get(f"gpu/{r}").decode() for r in range(world_size)]
    shared = shared_gpu(uuids)
    if shared is not None:
        a, b, uuid = shared
        raise RuntimeError(f"trainer ranks {a} and {b} were given the same GPU ({uuid}); NCCL refuses two ranks on "
                           "one GPU ('Duplicate GPU detected'): give each rank a GPU of its own (trainer.gpus_per_rank=1 "
                           "on Ray nodes that declare only the GPUs they have)")
