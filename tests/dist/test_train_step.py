"""One RL batch as several optimizer steps (algo.mini_batches): the trust region acts, alone and
under TIS; a NaN loss is skipped, counted and leaves the weights unchanged. One gloo process."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from rlray.algo.loss import algo_config

from rlray.actors.buffer import BufferActor
from rlray.config import AlgoConfig, ModelConfig, TrainerConfig
from rlray.models.tiny import model_path
from rlray.types import Group, Rollout
from tests.dist.common import spawn

MODEL = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, seed=5)
TEMPERATURE = 1.0


def groups(trainer, offset: float, biased: bool = False) -> list[Group]:  # type: ignore[no-untyped-def]
    """4 groups of 4 rollouts with rewards 1, 0, 1, 0; mu = the trainer's own probability x e^-offset."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(4):
        rollouts = []
        for j in range(4):
            prompt, completion = rng.integers(4, 30, size=5), rng.integers(4, 30, size=6)
            ids = np.concatenate([prompt, completion]).tolist()
            logp = np.asarray(trainer.logprobs(ids, len(prompt), TEMPERATURE), np.float32) - offset
            rollouts.append(Rollout(prompt, completion, logp, np.ones(6, np.int8), np.zeros(6, np.int64),
                                    reward=float(j % 2), biased=biased))
        out.append(Group(rollouts))
    return out


def batch(trainer, algo: AlgoConfig, offset: float, biased: bool) -> list:  # type: ignore[no-untyped-def]
    buf = BufferActor(algo, groups_per_step=4, max_off_policy_steps=0, num_ranks=1, micro_batch_tokens=64,
                      pad_id=0)

    async def go() -> list:
        await buf.put(groups(trainer, offset, biased))
        return await buf.get_batch(0)
    return asyncio.run(go())


def params(trainer) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {n: p.detach().full_tensor().clone() for n, p in trainer.model.named_parameters()}


def worker(rank: int, world: int, port: int, out: dict, algo: dict, offset: float, nan: bool,
           biased: bool) -> None:
    from rlray.actors.learner import NonFiniteError
    from rlray.actors.trainer import TrainerActor

    cfg = algo_config(loss="grpo", aggregation="token", **algo)
    t = TrainerActor(rank, world, f"127.0.0.1:{port}", MODEL, TrainerConfig(lr=3e-2, num_ranks=1,
                     max_nonfinite_steps=2), cfg, "gloo", temperature=TEMPERATURE)
    t.setup()
    mbs = batch(t, cfg, offset, biased)
    out["mu_unknown"] = all(np.isnan(mb.inference_logprobs).any() for mb in mbs)
    out["mini_batches"] = sorted({mb.mini_batch for mb in mbs})
    if not nan:
        out["metrics"] = t.train_step(mbs)
        return
    mbs[0].advantages = np.full_like(mbs[0].advantages, np.nan)
    before = params(t)
    out["metrics"] = t.train_step(mbs[:1])
    out["unchanged"] = all(torch.equal(before[n], p) for n, p in params(t).items())
    try:
        t.train_step(mbs[:1])
    except NonFiniteError as e:
        out["error"] = str(e)


def run(algo: dict, offset: float = 0.0, nan: bool = False, biased: bool = False) -> dict:
    model_path(MODEL)
    return spawn(worker, 1, algo, offset, nan, biased)


def test_one_step_per_batch_never_leaves_the_trust_region() -> None:
    """On-policy with one optimizer step, every ratio is 1: the clip cannot bind (the issue's point)."""
    out = run({"mini_batches": 1})
    assert out["metrics"]["optimizer_steps"] == 1 and out["metrics"]["ratio_outside"] == 0


def test_mini_batches_make_the_ppo_clip_bind() -> None:
    out = run({"mini_batches": 4})
    m = out["metrics"]
    assert out["mini_batches"] == [0, 1, 2, 3] and m["optimizer_steps"] == 4
    assert m["ratio_outside_first"] == 0  # the first step is on-policy
    assert m["ratio_outside"] > 0  # later steps moved the policy past 1 +- 0.2 of mu


def test_tis_composes_with_mini_batches() -> None:
    """mu is e^-0.3 of the trainer's probability: TIS truncates every weight (e^0.3 > 1.2); the PPO ratio
    is against the batch-start policy, so the first step is inside the band and later ones leave it."""
    out = run({"mini_batches": 4, "epochs": 2, "correction": "tis", "correction_high": 1.2}, offset=0.3)
    m = out["metrics"]
    assert m["optimizer_steps"] == 8
    assert m["correction_clipped"] == pytest.approx(1.0)  # per loss token: all of them
    assert m["ratio_outside_first"] == 0 and m["ratio_outside"] > 0


def test_a_nan_loss_is_skipped_counted_and_stops_after_k_in_a_row() -> None:
    out = run({"mini_batches": 1}, nan=True)
    assert out["unchanged"], "a NaN step changed the weights"
    assert out["metrics"]["skipped_steps"] == 1
    assert "2 optimizer steps in a row" in out["error"] and "trainer.max_nonfinite_steps=2" in out["error"]


def test_biased_rollouts_train_with_the_batch_start_policy_as_mu() -> None:
    """Rollouts sampled under guided decoding reach the trainer with mu unknown (NaN): the step is
    finite, nothing is skipped, the first step is on-policy by construction (mu = pi) and the clip still
    binds on later steps (against the batch-start policy, not the unknown mu)."""
    out = run({"mini_batches": 4}, offset=0.3, biased=True)
    m = out["metrics"]
    assert out["mu_unknown"] and m["skipped_steps"] == 0 and np.isfinite(m["loss"])
    assert m["ratio_outside_first"] == 0 and m["ratio_outside"] > 0
