"""Learner: one rank's forward, loss, backward and optimizer step over its micro-batches.

Contract: `Learner(model, ref_model, dims, cfg, algo, temperature, device)` trains the sharded
`model` (rlray.models.load) of one trainer rank; `algo` is resolved (rlray.algo.loss.resolve).
- Micro-batches are rows of one or several sequences (rlray.data.packing); the model sees the
  rows with position ids restarting per sequence (attention stays inside each), the losses see
  one row per sequence (rlray.data.layout). With `trainer.cp > 1` the ranks of a cp group get
  the same micro-batches and each computes its share of every sequence (rlray.parallel.context).
- `set_stage(lr, warmup_steps, stage)` starts a fresh AdamW (SFT and RL each get their own) over
  what `stage` trains: every parameter, or with LoRA (`trainer.lora.rank > 0`, rlray.models.lora)
  the base's full weights in "sft" and only the adapters in "rl".
- `train_step(micro_batches)` runs forward/backward over this rank's micro-batches, one
  optimizer step per mini-batch (`algo.mini_batches`, `MicroBatch.mini_batch`) and pass
  (`algo.epochs`); the RL loss is chosen by `algo.loss` and every rank divides its sums by the
  mini-batch's *global* normaliser. `sft_step(micro_batches)` takes one step with cross-entropy
  on the masked tokens. A step whose loss or gradient is NaN/inf is not applied (counted in
  `skipped_steps`); `trainer.max_nonfinite_steps` in a row raise `NonFiniteError`.
  `mismatch_kl` is KL(mu || pi) over the tokens the trainer's current version sampled (the engine
  mismatch alone), `stale_kl` over the older ones (lag > 0).
- MoE: micro-batches that carry the engine's routing (`MicroBatch.routing`) are replayed when
  `trainer.router_replay` (rlray.parallel.routing: the policy, the KL reference, the proximal
  recompute, activation-checkpoint recomputation alike) and measured on or off:
  `router_agreement` is the share of (token, layer) pairs whose top-k set the trainer's own router
  chooses equals the engine's, over every rank.
- `forward_backward(micro_batches, rl)` accumulates this rank's gradients and returns the local
  sums (the equivalence tests read the gradients after it).
- `logprobs(token_ids, start)` scores a sequence (for checks and tests).
- `move_optimizer_state(device)` moves the optimizer state (trainer.offload_optimizer, colocated GPUs).
- The KL reference (`ref_model`, when `algo.kl_coef > 0`) is the policy at the first RL step:
  `snapshot_reference()` copies it once, shard by shard.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlray.algo.loss import get_loss, loss_normalizer, mismatch_kl, require_resolved
from rlray.config import AlgoConfig, TrainerConfig
from rlray.data.layout import model_inputs
from rlray.models.lora import is_adapter
from rlray.models.multimodal import forward_kwargs
from rlray.parallel import context
from rlray.parallel.dims import ParallelDims
from rlray.parallel.expert import ExpertLoad
from rlray.parallel.parallelize import clip_grad_norm_, param_groups
from rlray.parallel.routing import RouterReplay, moe_routers
from rlray.types import MicroBatch


class NonFiniteError(RuntimeError):
    """`trainer.max_nonfinite_steps` optimizer steps in a row had a NaN/inf loss or gradient."""


class Learner:
    def __init__(self, model: torch.nn.Module, ref_model: torch.nn.Module | None, dims: ParallelDims,
                 cfg: TrainerConfig, algo: AlgoConfig, temperature: float, device: torch.device) -> None:
        require_resolved(algo)
        self.model, self.ref_model, self.ref_ready = model, ref_model, False
        self.dims, self.cfg, self.algo, self.temperature, self.device = dims, cfg, algo, temperature, device
        self.cp = None
        if dims.cp_enabled:
            mesh = dims.mesh("cp")
            self.cp = (mesh.get_group(), mesh.get_local_rank(), dims.cp)
        self.expert_load = ExpertLoad(model)
        self.replay = [RouterReplay(m, cfg.router_replay) for m in (model, ref_model) if m is not None and moe_routers(m)]
        if cfg.router_replay and not self.replay:
            raise ValueError(f"trainer.router_replay=true but {type(model).__name__} has no MoE routers; set "
                             "trainer.router_replay=false")
        self.loss_fn = get_loss(algo.loss)
        self.skipped_steps = self.nonfinite_in_a_row = 0  # optimizer steps not applied: NaN/inf loss or gradient
        self.base_trained = False  # with LoRA: the base is no longer the model's own checkpoint (SFT trained it)
        self.set_stage(cfg.lr, 0)

    def set_stage(self, lr: float, warmup_steps: int, stage: str = "rl") -> None:
        if self.cfg.lora.enabled:  # SFT trains the base's full weights, RL the adapters on that base
            for name, p in self.model.named_parameters():
                p.requires_grad_(is_adapter(name) != (stage == "sft"))
        groups = [{"params": g} for g in param_groups(self.trainable())]  # one mesh per group
        self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=self.cfg.weight_decay,
                                           betas=(self.cfg.beta1, self.cfg.beta2))
        warm = max(1, warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm))

    def move_optimizer_state(self, device: torch.device) -> int:
        """Every optimizer state tensor but AdamW's step counts to `device` (trainer.offload_optimizer:
        host memory while colocated engines generate, back before the next step); the bytes moved."""
        moved = 0
        for st in self.optimizer.state.values():
            for key, value in st.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.device != device:
                    st[key] = value.to(device)
                    moved += value.numel() * value.element_size()
        return moved

    def trainable(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: every parameter, or with LoRA the adapters alone."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _token_logprobs(self, t: dict[str, Any], temperature: float,
                        model: torch.nn.Module | None = None) -> torch.Tensor:
        """logp[n, j] of sequence n's token j given its tokens before j, one row per sequence
        ([N, L]); a sequence's first token gets 0. Attention never crosses a sequence: the
        position ids restart at each, which transformers turns into a block-causal mask
        (varlen attention with flash kernels); under context parallelism the scope's mask
        does the same over the gathered keys, and the next-token logprobs of every rank of the
        group are gathered back into the micro-batch's layout."""
        with context.active(t["scope"]):
            model = model or self.model
            logits = model(input_ids=t["input_ids"], use_cache=False, **forward_kwargs(model, t)).logits.float()
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
            t = model_inputs(mb, self.device, self.cp)
            norm = loss_normalizer(self.algo, mb) if rl else mb.num_loss_tokens_global
            # FSDP averages gradients over every rank; the cp ranks of a group each hold the whole
            # loss of their shared batch, and their gradients add up to its gradient.
            denom = norm * self.dims.cp / self.dims.world_size
            # backward recomputes attention and routing under checkpointing
            with context.active(t["scope"]), self._routing(t):
                self._micro_step(sums, mb, t, rl, denom, prox[i] if prox else None)
        if self.dims.cp_enabled:  # every rank of a cp group counted the same sums
            sums = {k: v / self.dims.cp for k, v in sums.items()}
        if self.replay:  # the policy's routers; each rank of a cp group routed its own share of the tokens
            counts = [r.agreement() for r in self.replay]  # the reference's are reset, not reported
            sums["_router_agree"], sums["_router_pairs"] = counts[0]
        sums["_norm"] = norm
        return sums

    def _routing(self, t: dict[str, Any]) -> ExitStack:
        """The engine's routing of `t`'s tokens for the policy's and the reference's routers."""
        stack = ExitStack()
        for replay in self.replay:
            stack.enter_context(replay.routing(t["routing"]))
        return stack

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

    def step(self, micro_batches: list[MicroBatch], rl: bool,
              prox: list[torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step; skipped (and counted) when the loss or the gradient is not finite."""
        t0 = time.perf_counter()
        sums = self.forward_backward(micro_batches, rl, prox)
        norm = sums.pop("_norm")
        grad_norm = clip_grad_norm_(self.trainable(), self.cfg.max_grad_norm)
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
            t = model_inputs(mb, self.device, self.cp)
            with self._routing(t):
                out.append(self._token_logprobs(t, self.temperature))
        self.model.reshard()
        if self.replay:
            self.replay[0].agreement()  # counted once, in the training forward
        return out

    @torch.no_grad()
    def _reference_logprobs(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        self.snapshot_reference()  # same FSDP layout, so each rank copies its own shards
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
        agree, pairs = out.pop("_router_agree", 0.0), out.pop("_router_pairs", 0.0)
        if pairs > 0:
            out["router_agreement"] = agree / pairs
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
                steps.append(self.step([micro_batches[i] for i in idx], rl=True,
                                        prox=[prox[i] for i in idx] if prox else None))
        out = {k: float(np.mean([s[k] for s in steps])) for k in steps[0]}
        out.update(optimizer_steps=float(len(steps)), ratio_outside_first=steps[0]["ratio_outside"],
                   skipped_steps=steps[-1]["skipped_steps"], train_seconds=sum(s["train_seconds"] for s in steps))
        return out

    def sft_step(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        self.base_trained = self.base_trained or self.cfg.lora.enabled  # LoRA: SFT trains the base
        return self.step(micro_batches, rl=False)

    @torch.no_grad()
    def logprobs(self, token_ids: list[int], start: int, temperature: float = 1.0,
                 routing: np.ndarray | None = None) -> list[float]:
        """The policy's logprob of `token_ids[i]` for i >= start; with `routing` (the engine's experts of every
        position, [T, MoE layers, top-k]) and `trainer.router_replay`, its routers replay them as in training."""
        self.model.eval()
        ones = np.ones((1, len(token_ids)), np.int64)
        mb = MicroBatch(np.asarray([token_ids], np.int64), ones, *(np.zeros(ones.shape, np.float32),) * 3,
                        routing=None if routing is None else np.asarray(routing)[None])
        t = model_inputs(mb, self.device, self.cp)
        with self._routing(t):
            logp = self._token_logprobs(t, temperature)
        self.model.reshard()
        if self.replay:
            self.replay[0].agreement()  # counted in the training forward only
        return logp[0, start:].tolist()

    def snapshot_reference(self) -> None:
        """The KL reference is the policy at the first RL step: copied (shard by shard) once."""
        assert self.ref_model is not None
        if not self.ref_ready:
            for r, p in zip(self.ref_model.parameters(), self.model.parameters()):
                r.data.copy_(p.data)
            self.ref_ready = True
