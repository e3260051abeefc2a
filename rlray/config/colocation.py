"""Colocated placement (`cluster.colocate=true`): which bundle holds which trainer rank and engine worker.

Contract: `Colocation(config)` describes one placement group of N bundles, one per trainer rank (a GPU
each on GPUs). The W engine workers (rollout.num_actors x tensor_parallel_size x data_parallel_size)
divide N (rlray.config.checks); worker w sits in bundle `w * stride` (stride = N / W), beside trainer
rank `w * stride`, and engine i's workers are numbered i*per .. i*per+per-1 (per: one engine's workers).
`bundles()` is what each bundle asks of Ray: the trainer rank's CPUs (and GPU), plus the rollout actor's
CPUs in an engine's first bundle. On GPUs Ray's accounting splits each GPU: `TRAINER_GPU_SHARE` for the
trainer rank, the rest for the engine worker (vLLM's Ray workers, `VLLM_RAY_PER_WORKER_GPUS`).
`weight_backend(config)` names the weight path: vLLM's "ipc" (GPU) or rlray's "shm" (CPU) when
colocated, else the collective backend (`checks.backend`).
"""

from __future__ import annotations

from rlray.config.checks import backend, engine_workers
from rlray.config.schema import Config

TRAINER_GPU_SHARE = 0.5  # of a colocated bundle's GPU, in Ray's accounting; the engine worker takes the rest


def weight_backend(c: Config) -> str:
    """The weight path's backend: ipc or shm when colocated (GPU or CPU), else nccl or gloo."""
    if c.cluster.colocate:
        return "ipc" if c.trainer.gpus_per_rank > 0 else "shm"
    if c.weights.transport == "m2n":
        return "m2n"
    return backend(c)


class Colocation:
    def __init__(self, c: Config) -> None:
        t, r = c.trainer, c.rollout
        self.ranks, self.per_engine = t.num_ranks, engine_workers(r)
        self.workers = r.num_actors * self.per_engine
        self.stride = max(1, self.ranks // self.workers)
        self.on_gpu = t.gpus_per_rank > 0
        self.trainer_cpus, self.rollout_cpus = t.cpus_per_rank, r.cpus_per_actor

    def worker_bundle(self, worker: int) -> int:
        return worker * self.stride

    def engine_bundles(self, engine: int) -> list[int]:
        """The bundles of engine `engine`'s workers (its first holds the rollout actor)."""
        return [self.worker_bundle(engine * self.per_engine + k) for k in range(self.per_engine)]

    def first_bundle(self, engine: int) -> int:
        return self.engine_bundles(engine)[0]

    def hosts_worker(self, rank: int) -> bool:
        """Whether trainer rank `rank`'s bundle holds an engine worker (the rank writes its handover)."""
        return rank % self.stride == 0 and rank // self.stride < self.workers

    def bundles(self) -> list[dict[str, float]]:
        firsts = {self.first_bundle(i) for i in range(self.workers // self.per_engine)}
        return [{"CPU": self.trainer_cpus + (self.rollout_cpus if b in firsts else 0.0),
                 **({"GPU": 1.0} if self.on_gpu else {})} for b in range(self.ranks)]

    def describe(self, b: int) -> str:
        """Who bundle `b` holds, e.g. 'trainer-0 + rollout-0 (engine 0, worker 0)'."""
        if b % self.stride or b // self.stride >= self.workers:
            return f"trainer-{b}"
        w = b // self.stride
        engine, k = divmod(w, self.per_engine)
        return f"trainer-{b} + " + (f"rollout-{engine} (engine {engine}, worker 0)" if k == 0 else
                                    f"engine {engine}'s worker {k}")
