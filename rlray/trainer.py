"""TrainerActor: one rank of the FSDP2 trainer. A plain class; cluster.py makes it a Ray actor.

Contract:
- `setup()` joins the trainer process group (gloo on CPU, nccl on GPU) and builds the model
  sharded from the start (rlray.models.load: meta device, `parallelize` with the
  `trainer.ep` / `trainer.cp` / `trainer.activation_checkpointing` of `ParallelDims`, each
  rank reading only its shards); the KL reference model, when `algo.kl_coef > 0`, is built
  the same way.
- Micro-batches are rows of one or several sequences (rlray.data.packing); the model sees
  the rows with position ids restarting per sequence (attention stays inside each), the
  losses see one row per sequence. With `trainer.cp > 1` the ranks of a cp group get the
  same micro-batches and each computes its share of every sequence (rlray.parallel.context).
- `set_stage(lr, warmup_steps)` starts a fresh AdamW (SFT and RL each get their own).
- `train_step(micro_batches)` runs forward/backward over this rank's micro-batches, one
  optimizer step per mini-batch (`algo.mini_batches`, `MicroBatch.mini_batch`) and pass
  (`algo.epochs`); the RL loss is chosen by `algo.loss` and every rank divides its sums by
  the mini-batch's *global* normaliser. `sft_step(micro_batches)` takes one step with
  cross-entropy on the masked tokens. A step whose loss or gradient is NaN/inf is not
  applied (counted in `skipped_steps`); `trainer.max_nonfinite_steps` in a row raise
  `NonFiniteError`. `mismatch_kl` is KL(mu || pi) over the tokens the trainer's current
  version sampled (the engine mismatch alone), `stale_kl` over the older ones (lag > 0).
- `forward_backward(micro_batches, rl)` accumulates this rank's gradients and returns the
  local sums (the equivalence tests read the gradients after it).
- `init_weight_group(spec, client)` / `broadcast_weights(version)`: vLLM's weight-transfer
  protocol (rlray.transfer; `client` is a VLLMWeightSyncClient over the engines). Every rank
  gathers one full parameter at a time (dense and EP/FSDP-sharded experts alike), cast first
  to the dtype the engine serves (`wire_dtype`, the rollout dtype); rank 0 sends them,
  bucketed, and drives the engines' start, update and finish, labelled `version`.
  `close_weight_group()` leaves the group (to re-form it after a rollout actor is replaced).
- `logprobs(token_ids, start)` scores a sequence (for checks and tests).
- `save(dir)` / `load(dir)`: model, optimizer, scheduler and the KL reference through
  torch.distributed.checkpoint (every rank writes its shards) plus each rank's torch, numpy
  and Python RNG states; both return `weights_digest()`, a sha256 of the weights bit for bit.
  `export_hf(dir)`: rank 0 writes a transformers folder.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlray.algo.loss import get_loss, loss_normalizer, mismatch_kl
from rlray.config import AlgoConfig, ModelConfig, TrainerConfig
from rlray.data.packing import sequence_rows
from rlray.models.load import build_model
from rlray.models.tiny import model_path
from rlray.parallel import context
from rlray.parallel.dims import ParallelDims
from rlray.parallel.expert import ExpertLoad
from rlray.parallel.parallelize import DTYPES, clip_grad_norm_, param_groups
from rlray.types import MicroBatch
from rlray.weights import TrainerSpec


class NonFiniteError(RuntimeError):
    """`trainer.max_nonfinite_steps` optimizer steps in a row had a NaN/inf loss or gradient."""


class TrainerActor:
    def __init__(self, rank: int, world_size: int, master: str, model: ModelConfig,
                 trainer: TrainerConfig, algo: AlgoConfig, backend: str, temperature: float,
                 wire_dtype: str | None = None) -> None:
        self.rank, self.world_size, self.master = rank, world_size, master
        self.model_cfg, self.cfg, self.algo = model, trainer, algo
        self.backend, self.temperature = backend, temperature
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        self.wire_dtype = DTYPES[wire_dtype] if wire_dtype else None  # the engine's dtype; None: the params' own
        self.transfer: Any = None  # this rank's TrainerWeightTransferEngine (rlray.transfer)
        self.client: Any = None
        self.skipped_steps = self.nonfinite_in_a_row = 0  # optimizer steps not applied: NaN/inf loss or gradient

    def setup(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            torch.cuda.set_device(0)
        if not dist.is_initialized():
            dist.init_process_group(self.backend, init_method=f"tcp://{self.master}",
                                    rank=self.rank, world_size=self.world_size)
        torch.manual_seed(self.cfg.seed)
        # Gathering an expert weight (EP x FSDP) takes two all-gathers; torch warns of it on every one.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        self.dims = ParallelDims(self.world_size, ep=self.cfg.ep, cp=self.cfg.cp)
        self.dims.build_meshes(self.device.type)
        if self.dims.cp_enabled:
            cp = self.dims.mesh("cp")
            self.cp_group, self.cp_rank = cp.get_group(), cp.get_local_rank()
        path = model_path(self.model_cfg)
        self.model = build_model(path, self.dims, self.cfg, self.device)
        self.expert_load = ExpertLoad(self.model)
        self.ref_model, self.ref_ready = None, False
        if self.algo.kl_coef > 0:  # frozen reference for the KL term: the policy at the first RL step
            self.ref_model = build_model(path, self.dims, self.cfg, self.device).requires_grad_(False)
        self.loss_fn = get_loss(self.algo.loss)
        self.set_stage(self.cfg.lr, 0)
        n = sum(p.numel() for p in self.model.parameters())  # DTensor numel is the full size
        return {"rank": self.rank, "pid": os.getpid(), "params_approx": int(n)}

    def set_stage(self, lr: float, warmup_steps: int) -> None:
        groups = [{"params": g} for g in param_groups(self.model.parameters())]  # one mesh per group
        self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=self.cfg.weight_decay,
                                           betas=(self.cfg.beta1, self.cfg.beta2))
        warm = max(1, warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm))

    def _tensors(self, mb: MicroBatch) -> dict[str, Any]:
        """The model's inputs as the micro-batch lays them out ([B, T], packed or padded; with
        context parallelism this rank's positions of each sequence, [B, Tl]), each position's
        next token (`targets`), and the loss's inputs as one row per sequence ([N, L],
        `sequence_rows`), the layout the losses read."""
        index, valid = sequence_rows(mb.segment_ids)

        def rows(x: np.ndarray) -> torch.Tensor:
            return torch.tensor(np.where(valid, np.asarray(x).reshape(-1)[index], 0), device=self.device)

        ids, pos = np.asarray(mb.input_ids), np.asarray(mb.position_ids)
        targets, scope = np.pad(ids[:, 1:], ((0, 0), (0, 1))), None
        first = torch.tensor(pos == 0, device=self.device)  # a sequence's first token: nothing predicts it
        if self.dims.cp_enabled:
            shards, inverse = context.shard(pos, mb.segment_ids, self.dims.cp)
            scope = context.Scope(self.cp_group, self.cp_rank, shards, inverse, self.device)
            src, pos = scope.shard.source, scope.shard.position_ids  # this rank's positions
            ids, targets = (np.where(src >= 0, np.take_along_axis(x, np.maximum(src, 0), 1), 0) for x in (ids, targets))
        t: dict[str, Any] = {k: torch.tensor(v, device=self.device)
                             for k, v in (("input_ids", ids), ("position_ids", pos), ("targets", targets))}
        t.update(first=first, scope=scope, index=torch.tensor(index, device=self.device),
                 valid=torch.tensor(valid, device=self.device))
        t.update({k: rows(getattr(mb, k)) for k in ("loss_mask", "advantages", "inference_logprobs")})
        t["stale"] = rows(mb.lag > 0).float() if mb.lag is not None else torch.zeros_like(t["loss_mask"])
        return t

    def _token_logprobs(self, t: dict[str, Any], temperature: float,
                        model: torch.nn.Module | None = None) -> torch.Tensor:
        """logp[n, j] of sequence n's token j given its tokens before j, one row per sequence
        ([N, L]); a sequence's first token gets 0. Attention never crosses a sequence: the
        position ids restart at each, which transformers turns into a block-causal mask
        (varlen attention with flash kernels); under context parallelism the scope's mask
        does the same over the gathered keys, and the next-token logprobs of every rank of the
        group are gathered back into the micro-batch's layout."""
        with context.active(t["scope"]):
            logits = (model or self.model)(input_ids=t["input_ids"], position_ids=t["position_ids"],
                                           use_cache=False).logits.float()
        if temperature > 0:
            logits = logits / temperature
        nxt = torch.log_softmax(logits, dim=-1).gather(-1, t["targets"][..., None]).squeeze(-1)
        if t["scope"] is not None:
            nxt = t["scope"].gather(nxt)
        logp = torch.where(t["first"], 0.0, torch.nn.functional.pad(nxt[:, :-1], (1, 0)))
        return torch.where(t["valid"], logp.reshape(-1)[t["index"]], 0.0)

    def forward_backward(self, micro_batches: list[MicroBatch], rl: bool,
                         prox: list[torch.Tensor] | None = None) -> dict[str, float]:
        """Accumulate this rank's gradients over its micro-batches; returns the local sums.

        `prox`: per micro-batch, the proximal policy's logprobs (see `train_step`)."""
        self.model.train()
        self.expert_load.reset(self.device)
        sums: dict[str, float] = {"loss": 0.0, "mismatch_kl": 0.0, "ratio_outside": 0.0, "tokens": 0.0, "_slots": 0.0}
        for i, mb in enumerate(micro_batches):
            t = self._tensors(mb)
            norm = loss_normalizer(self.algo, mb) if rl else mb.num_loss_tokens_global
            # FSDP averages gradients over every rank; the cp ranks of a group each hold the whole
            # loss of their shared batch, and their gradients add up to its gradient.
            denom = norm * self.dims.cp / self.world_size
            with context.active(t["scope"]):  # backward recomputes attention under checkpointing
                self._micro_step(sums, mb, t, rl, denom, prox[i] if prox else None)
        if self.dims.cp_enabled:  # every rank of a cp group counted the same sums
            sums = {k: v / self.dims.cp for k, v in sums.items()}
        sums["_norm"] = norm
        return sums

    def _micro_step(self, sums: dict[str, float], mb: MicroBatch, t: dict[str, Any], rl: bool, denom: float,
                    old: torch.Tensor | None) -> None:
        """One micro-batch's forward and backward, its sums added to `sums`."""
        # before the policy's forward, while its parameters are sharded (the reference copies shards)
        ref = self._reference_logprobs(t) if rl and self.ref_model is not None else None
        logp = self._token_logprobs(t, self.temperature if rl else 1.0)
        if rl:
            mu = t["inference_logprobs"]  # NaN: mu unknown (biased sampling), the batch-start policy stands in
            mu = torch.where(torch.isnan(mu), logp.detach() if old is None else old, mu)
            loss_sum, stats = self.loss_fn(logp, mu, t["advantages"], t["loss_mask"], self.algo,
                                           logp_ref=ref, logp_prox=old)
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            self._split_mismatch(sums, logp, mu, t)
        else:
            loss_sum = -(logp * t["loss_mask"]).sum()
        (loss_sum / denom).backward()
        sums["loss"] += float(loss_sum.detach())
        sums["tokens"] += float(mb.num_tokens)
        sums["_slots"] += float(mb.num_slots)

    @staticmethod
    def _split_mismatch(sums: dict[str, float], logp: torch.Tensor, mu: torch.Tensor,
                        t: dict[str, torch.Tensor]) -> None:
        """KL(mu || pi) on tokens sampled by the trainer's current version (the engine mismatch,
        `mismatch_kl`) apart from the stale ones (`stale_kl`: mismatch plus staleness)."""
        stale = t["loss_mask"] * t["stale"]
        fresh = t["loss_mask"] - stale
        for key, mask in (("mismatch_kl", fresh), ("stale_kl", stale)):
            sums[f"_{key}"] = sums.get(f"_{key}", 0.0) + float(mismatch_kl(logp, mu, mask))
            sums[f"_{key}_tokens"] = sums.get(f"_{key}_tokens", 0.0) + float(mask.sum())

    def _step(self, micro_batches: list[MicroBatch], rl: bool,
              prox: list[torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step; skipped (and counted) when the loss or the gradient is not finite."""
        t0 = time.perf_counter()
        sums = self.forward_backward(micro_batches, rl, prox)
        norm = sums.pop("_norm")
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        out = self._reduce(sums, micro_batches[0].num_loss_tokens_global, grad_norm, norm)  # every rank alike
        if math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"]):
            self.optimizer.step()
            self.scheduler.step()
            self.nonfinite_in_a_row = 0
        else:
            self.skipped_steps += 1
            self.nonfinite_in_a_row += 1
            if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
                raise NonFiniteError(
                    f"{self.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                    f"(loss {out['loss']}, grad norm {out['grad_norm']}); each was skipped, none applied, and "
                    f"trainer.max_nonfinite_steps={self.cfg.max_nonfinite_steps} stops the run. Lower trainer.lr "
                    "or resume from the last checkpoint.")
        self.optimizer.zero_grad(set_to_none=True)
        out["skipped_steps"] = float(self.skipped_steps)
        out["train_seconds"] = time.perf_counter() - t0
        return {**out, **self.expert_load.summary()}

    @torch.no_grad()
    def _proximal(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """The logprobs of every micro-batch under the policy at the start of the batch."""
        self.model.eval()
        out = []
        for mb in micro_batches:
            t = self._tensors(mb)
            out.append(self._token_logprobs(t, self.temperature))
        self.model.reshard()
        return out

    @torch.no_grad()
    def _reference_logprobs(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        self._snapshot_reference()  # same FSDP layout, so each rank copies its own shards
        logp = self._token_logprobs(t, self.temperature, self.ref_model)
        self.ref_model.reshard()
        return logp

    def _reduce(self, sums: dict[str, float], n_loss: float, grad_norm: torch.Tensor,
                loss_norm: float | None = None) -> dict[str, float]:
        """Sums over every rank; the loss over its normaliser, every other stat per loss token."""
        keys = sorted(sums)
        t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        out = {k: float(v) for k, v in zip(keys, t.tolist())}
        for k in out:
            if k != "tokens" and not k.startswith("_"):
                out[k] /= (loss_norm or n_loss) if k == "loss" else n_loss
        for key in ("mismatch_kl", "stale_kl"):  # RL: per token of their own kind
            if f"_{key}" in out:
                out[key] = out.pop(f"_{key}") / max(out.pop(f"_{key}_tokens"), 1.0)
        out["padding_frac"] = 1.0 - out["tokens"] / max(out.pop("_slots"), 1.0)  # of the positions computed
        out["grad_norm"] = float(grad_norm)
        out["lr"] = self.scheduler.get_last_lr()[0]  # the rate this step applies
        return out

    def train_step(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        """`algo.epochs` passes over the batch's mini-batches (`MicroBatch.mini_batch`), one
        optimizer step each. With an off-policy correction and more than one step, the
        trust-region ratio is against the policy at the start of the batch (recomputed here,
        one forward); without one it is against mu, the engine's policy, throughout.
        Returns the mean of every step's stats, `optimizer_steps`, and the first step's
        `ratio_outside` as `ratio_outside_first` (0 on-policy)."""
        minis = sorted({mb.mini_batch for mb in micro_batches})
        prox = None
        unknown_mu = any(np.isnan(mb.inference_logprobs).any() for mb in micro_batches)
        if (self.algo.correction != "none" or unknown_mu) and len(minis) * self.algo.epochs > 1:
            prox = self._proximal(micro_batches)
        steps = []
        for _ in range(self.algo.epochs):
            for m in minis:
                idx = [i for i, mb in enumerate(micro_batches) if mb.mini_batch == m]
                steps.append(self._step([micro_batches[i] for i in idx], rl=True,
                                        prox=[prox[i] for i in idx] if prox else None))
        out = {k: float(np.mean([s[k] for s in steps])) for k in steps[0]}
        out.update(optimizer_steps=float(len(steps)), ratio_outside_first=steps[0]["ratio_outside"],
                   skipped_steps=steps[-1]["skipped_steps"], train_seconds=sum(s["train_seconds"] for s in steps))
        return out

    def sft_step(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        return self._step(micro_batches, rl=False)

    @torch.no_grad()
    def logprobs(self, token_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        self.model.eval()
        ones = np.ones((1, len(token_ids)), np.int64)
        mb = MicroBatch(np.asarray([token_ids], np.int64), ones, *(np.zeros(ones.shape, np.float32),) * 3)
        logp = self._token_logprobs(self._tensors(mb), temperature)
        self.model.reshard()
        return logp[0, start:].tolist()

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optim": optim, "scheduler": self.scheduler.state_dict()}
        if self.ref_model is not None:
            self._snapshot_reference()
            state["ref"] = get_model_state_dict(self.ref_model)
        return state

    def _snapshot_reference(self) -> None:
        """The KL reference is the policy at the first RL step: copied (shard by shard) once."""
        assert self.ref_model is not None
        if not self.ref_ready:
            for r, p in zip(self.ref_model.parameters(), self.model.parameters()):
                r.data.copy_(p.data)
            self.ref_ready = True

    def save(self, path: str) -> str:
        """Model, optimizer, scheduler, KL reference (DCP) and this rank's RNG states; returns
        `weights_digest()` of what was saved."""
        import random

        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=path)
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        torch.save(rng, os.path.join(path, f"rng_rank{self.rank}.pt"))
        dist.barrier()
        return self.weights_digest()

    def load(self, path: str) -> str:
        """The state `save` wrote; returns `weights_digest()` of the loaded weights."""
        import random

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ref_model is not None:
            set_model_state_dict(self.ref_model, state["ref"])
        rng = torch.load(os.path.join(path, f"rng_rank{self.rank}.pt"), weights_only=False)
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        return self.weights_digest()

    def weights_digest(self) -> str:
        """sha256 of every rank's parameter shards, bit for bit (a collective: every rank calls it)."""
        import hashlib

        h = hashlib.sha256()
        for name, p in self.model.named_parameters():
            local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
            h.update(name.encode())
            h.update(local.contiguous().cpu().view(torch.uint8).numpy().tobytes())
        digests: list[str | None] = [None] * self.world_size
        dist.all_gather_object(digests, h.hexdigest())
        return hashlib.sha256("".join(str(d) for d in digests).encode()).hexdigest()[:16]

    def export_hf(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            from transformers import AutoTokenizer

            self.model.save_pretrained(path, state_dict=full)
            AutoTokenizer.from_pretrained(model_path(self.model_cfg)).save_pretrained(path)
        dist.barrier()

    def _full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """One full parameter at a time, in `dtype` (cast before the gather: half the bytes for bf16)."""
        for name, p in self.model.named_parameters():
            p = p.detach() if dtype is None else p.detach().to(dtype)
            yield name, p.full_tensor() if hasattr(p, "full_tensor") else p

    def _wire_meta(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, self.wire_dtype or p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def init_weight_group(self, spec: TrainerSpec, client: Any) -> None:
        """Build this rank's end of vLLM's weight-transfer protocol (`client` drives the engines)."""
        from rlray.transfer import ParamSource, trainer_engine

        self.close_weight_group()
        self.client = client
        source = ParamSource(self._wire_meta, lambda: self._full_params(self.wire_dtype))
        self.transfer = trainer_engine(spec, self.rank, client, source)

    def close_weight_group(self) -> None:
        if self.transfer is not None:
            self.transfer.shutdown()
        self.transfer = None

    @torch.no_grad()
    def broadcast_weights(self, version: int) -> dict[str, float]:
        """Every engine loads the current weights as policy `version` (a collective of all ranks)."""
        assert self.transfer is not None, "init_weight_group must run before broadcast_weights"
        t0 = time.perf_counter()
        self.client.weight_version = str(version)
        self.transfer.send_weights()
        seconds = time.perf_counter() - t0
        stats = getattr(self.transfer, "stats", None)  # rlray's gloo engine counts; vLLM's NCCL one sends all
        if not stats:
            stats = {"sync_bytes": float(sum(math.prod(m.shape) * m.dtype.itemsize for m in self._wire_meta())),
                     "changed_frac": 1.0, "full": 1.0}
        return {"sync_seconds": seconds, **(stats if self.rank == 0 else {"sync_bytes": 0.0})}
