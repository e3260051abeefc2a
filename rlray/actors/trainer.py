"""TrainerActor: one rank of the FSDP2 trainer, the Ray-facing class over its parts. A plain class;
rlray.orchestration.cluster makes it a Ray actor (with a control thread for `close_weight_group`).

Contract:
- `serve_group()` (rank 0) serves the trainer group's store on a port bound as it is chosen and
  returns its "host:port" (the host of the `master` it was given); every rank's `setup(master)`
  then joins the trainer process group on the device its bundle holds (gloo on CPU, nccl
  on GPU; `trainer.collective_timeout_s`; two ranks given one GPU are refused,
  rlray.parallel.group) and builds the model sharded from the start (rlray.models.load: meta
  device, `parallelize` with the `trainer.ep` / `trainer.cp` / `trainer.activation_checkpointing`
  of `ParallelDims`, each rank reading only its shards); the KL reference, when
  `algo.kl_coef > 0`, is built the same way.
- Training is the `Learner`'s (rlray.actors.learner): `set_stage`, `train_step`, `sft_step`,
  `forward_backward`, `logprobs`; `offload_optimizer(to_host)` (colocated GPUs) moves its state,
  `make_room(offload)` also returns the allocator's cached memory to the device before the engines wake.
- State is rlray.actors.state's: `save(dir, background)` / `load(dir)` (DCP shards, RNG states; both
  return the weight digest), `weights_digest()`, `export_hf(dir, merged)` (a transformers folder, every
  rank writing its own tensors; with LoRA the adapter folder, see rlray.actors.export), `checksums(dir)` /
  `verify(dir, files)` (this rank's files of a checkpoint: their sizes and CRC32s, and what no longer matches).
  With `background` DCP writes the shards after `save` returns (rlray.actors.saver: only the copy of
  the state blocks, one write in flight); `finish_save()` waits for the last save's write and returns
  this rank's checksums of it (a failed write raises, naming the folder); on Ray it runs on a thread
  of its own (rlray.orchestration.cluster.CHECKPOINT), beside training. `load` and `export_hf` first
  wait for a write in flight.
- The weight path is the `WeightPublisher`'s (rlray.actors.publisher): `init_weight_group(spec,
  client)`, `broadcast_weights(version)`, `close_weight_group()`, `weight_source()`.
`algo` must be resolved (rlray.algo.loss.resolve).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from rlray.actors import state
from rlray.actors.learner import Learner
from rlray.actors.publisher import WeightPublisher
from rlray.actors.saver import Saver
from rlray.config import AlgoConfig, ModelConfig, TrainerConfig
from rlray.models.load import build_model
from rlray.models.lora import adapted_modules, adapter_config
from rlray.models.tiny import model_path
from rlray.parallel.dims import ParallelDims
from rlray.parallel.group import check_own_gpu, open_trainer_group, serve_store
from rlray.parallel.parallelize import DTYPES
from rlray.types import MicroBatch
from rlray.weightsync.transport import TrainerSpec


class TrainerActor:
    def __init__(self, rank: int, world_size: int, master: str, model: ModelConfig,
                 trainer: TrainerConfig, algo: AlgoConfig, backend: str, temperature: float,
                 wire_dtype: str | None = None) -> None:
        self.rank, self.world_size, self.master = rank, world_size, master
        self.model_cfg, self.cfg, self.algo = model, trainer, algo
        self.backend, self.temperature = backend, temperature
        self.device = torch.device("cuda" if trainer.gpus_per_rank > 0 else "cpu")  # what the bundle holds
        self.wire_dtype = DTYPES[wire_dtype] if wire_dtype else None  # the engine's dtype; None: the params' own
        self._store: dist.TCPStore | None = None
        self.saver = Saver(trainer.collective_timeout_s, pinned=self.device.type == "cuda")

    def serve_group(self) -> str:
        host = self.master.rsplit(":", 1)[0]
        self._store = serve_store(host, self.world_size, self.cfg.collective_timeout_s)
        self.master = f"{host}:{self._store.port}"
        return self.master

    def setup(self, master: str | None = None) -> dict[str, Any]:
        self.master = master or self.master
        if not dist.is_initialized():
            store = open_trainer_group(self.rank, self.world_size, self.master, self.backend, self.device,
                                       self.cfg.collective_timeout_s, self._store)
            if self.device.type == "cuda":
                check_own_gpu(store, self.rank, self.world_size)
        torch.manual_seed(self.cfg.seed)
        # Gathering an expert weight (EP x FSDP) takes two all-gathers; torch warns of it on every one.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        dims = ParallelDims(self.world_size, ep=self.cfg.ep, cp=self.cfg.cp)
        dims.build_meshes(self.device.type)
        path = model_path(self.model_cfg)
        model = build_model(path, dims, self.cfg, self.device)
        ref = build_model(path, dims, self.cfg, self.device).requires_grad_(False) if self.algo.kl_coef > 0 else None
        self.learner = Learner(model, ref, dims, self.cfg, self.algo, self.temperature, self.device)
        lora = adapter_config(self.cfg.lora, adapted_modules(model), path) if self.cfg.lora.enabled else None
        self.publisher = WeightPublisher(model, self.device, self.rank, self.wire_dtype, lora, self.cfg.freeze_vision)
        n = sum(p.numel() for p in model.parameters())  # DTensor numel is the full size
        return {"rank": self.rank, "pid": os.getpid(), "params_approx": int(n)}

    @property
    def model(self) -> torch.nn.Module:
        return self.learner.model

    def pid(self) -> int:
        return os.getpid()

    # ---- training (rlray.actors.learner) --------------------------------------------------
    def set_stage(self, lr: float, warmup_steps: int, stage: str = "rl") -> None:
        self.learner.set_stage(lr, warmup_steps, stage)
        self.publisher.stage = stage

    def train_step(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        return self.learner.train_step(micro_batches)

    def sft_step(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        return self.learner.sft_step(micro_batches)

    def forward_backward(self, micro_batches: list[MicroBatch], rl: bool) -> dict[str, float]:
        return self.learner.forward_backward(micro_batches, rl)

    def logprobs(self, token_ids: list[int], start: int, temperature: float = 1.0, routing: Any = None) -> list[float]:
        return self.learner.logprobs(token_ids, start, temperature, routing)

    def offload_optimizer(self, to_host: bool) -> int:
        """The optimizer state to host memory (while colocated engines generate) or back; bytes moved."""
        return self.learner.move_optimizer_state(torch.device("cpu") if to_host else self.device)

    def make_room(self, offload: bool) -> int:
        """Before colocated engines wake (and after a handover): the optimizer state to host memory when
        `offload`, then the allocator's cached blocks back to the device (torch keeps a step's peak reserved,
        which vLLM's wake-up cannot use); bytes moved."""
        moved = self.offload_optimizer(True) if offload else 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return moved

    # ---- state (rlray.actors.state) --------------------------------------------------------
    def save(self, path: str, background: bool = False) -> str:
        return state.save(self.learner, path, self.rank, model_path(self.model_cfg), self.saver, background)

    def finish_save(self) -> dict[str, list[int]]:
        path = self.saver.finish()
        return state.checksums(path, self.rank) if path else {}

    def load(self, path: str) -> str:
        self.saver.settle()
        return state.load(self.learner, path, self.rank)

    def weights_digest(self) -> str:
        return state.weights_digest(self.learner.model)

    def checksums(self, path: str) -> dict[str, list[int]]:
        return state.checksums(path, self.rank)

    def verify(self, path: str, files: dict[str, list[int]]) -> list[str]:
        return state.verify(path, self.rank, files)

    def export_hf(self, path: str, merged: bool = False) -> None:
        self.saver.settle()
        state.export_hf(self.learner, path, self.rank, model_path(self.model_cfg), merged)

    # ---- the weight path (rlray.actors.publisher) ------------------------------------------
    def weight_source(self) -> Any:
        return self.publisher.source()

    def init_weight_group(self, spec: TrainerSpec, client: Any) -> None:
        self.publisher.open(spec, client)

    def close_weight_group(self) -> None:
        self.publisher.close()

    def broadcast_weights(self, version: int) -> dict[str, float]:
        return self.publisher.publish(version)
