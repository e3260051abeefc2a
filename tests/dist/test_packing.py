"""Packed micro-batches (several sequences per row, block-causal attention) give the same loss
and gradients as one right-padded row per sequence, on 1 process and on 2 FSDP2 ranks, for a
token-mean, a sequence-mean and a sequence-ratio loss; and no attention crosses a packed
boundary: each packed sequence's logprobs equal that sequence scored alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rlray.data.layout import model_inputs
from rlray.algo.loss import algo_config

from rlray.algo.loss import get_loss
from rlray.config import ModelConfig, TrainerConfig
from rlray.data.packing import Sample, pack
from rlray.models.tiny import model_path
from tests.dist.common import assert_grads_close, full_grads, spawn

MODEL = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, seed=3)
LOSSES = ("dapo", "grpo", "gspo")  # token, sequence mean, sequence ratio


def samples(seed: int = 0) -> list[Sample]:
    """Uneven lengths: a few long, many short (5-26 tokens)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(10):
        p, c = rng.integers(4, 30, size=3 + i % 3), rng.integers(4, 30, size=2 + (i * 7) % 20)
        logp = rng.uniform(-4, -1, len(c)).astype(np.float32)
        out.append(Sample(p, c, (rng.random(len(c)) < 0.9).astype(np.float32), float(rng.normal()), logp))
    return out


def loss_and_grads(t, mbs: list) -> dict:
    t.learner.optimizer.zero_grad(set_to_none=True)
    sums = t.forward_backward(mbs, rl=True)
    loss = torch.tensor(sums["loss"], dtype=torch.float64)
    dist.all_reduce(loss)
    return {"loss": float(loss) / sums["_norm"], "grads": full_grads(t.model),
            "rows": sum(mb.input_ids.shape[0] for mb in mbs), "slots": sum(mb.num_slots for mb in mbs)}


def scored_alone(t, mb) -> list[tuple[list[float], list[float]]]:
    """(packed, alone) logprobs of every sequence of a packed micro-batch."""
    tensors = model_inputs(mb, t.device)
    with torch.no_grad():
        packed = t.learner._token_logprobs(tensors, 1.0)
    pairs = []
    for n in range(packed.shape[0]):
        ids = mb.input_ids[mb.segment_ids == n].tolist()
        pairs.append((packed[n, 1:len(ids)].tolist(), t.logprobs(ids, 1)))
    return pairs


def worker(rank: int, world: int, port: int, out: dict) -> None:
    from rlray.actors.trainer import TrainerActor

    t = TrainerActor(rank, world, f"127.0.0.1:{port}", MODEL, TrainerConfig(num_ranks=world), algo_config(),
                     "gloo", temperature=0.7)
    t.setup()
    for name in LOSSES:
        t.learner.algo, t.learner.loss_fn = algo_config(loss=name), get_loss(name)
        for packed in (True, False):
            mbs = pack(samples(), world, micro_batch_tokens=40, pad_id=0, packed=packed)[rank]
            result = loss_and_grads(t, mbs)
            if rank == 0:
                out[(name, packed)] = result
    if world == 1:
        mb, mb2 = (max(pack(samples(), 1, micro_batch_tokens=40, pad_id=0)[0], key=lambda m: m.segment_ids.max())
                   for _ in range(2))  # the row with the most sequences, twice
        out["alone"] = scored_alone(t, mb)
        mb2.input_ids[mb2.segment_ids == 1] = (mb2.input_ids[mb2.segment_ids == 1] + 5) % 30  # another sequence 1
        out["changed"] = scored_alone(t, mb2)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_packed_matches_padded(world: int) -> None:
    model_path(MODEL)
    out = spawn(worker, world)
    for name in LOSSES:
        packed, padded = out[(name, True)], out[(name, False)]
        assert packed["rows"] < padded["rows"] and packed["slots"] < padded["slots"], (packed["rows"], padded["rows"])
        assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-5), name
        assert_grads_close(padded["grads"], packed["grads"], rtol=1e-5)
    if world == 1:
        assert len(out["alone"]) >= 3, "a row should hold several sequences"
        for n, ((packed_lp, alone), (changed_lp, _)) in enumerate(zip(out["alone"], out["changed"])):
            np.testing.assert_allclose(packed_lp, alone, rtol=1e-5, atol=1e-6, err_msg=f"sequence {n}")
            if n != 1:
                assert changed_lp == packed_lp, f"changing sequence 1 changed sequence {n}'s logprobs"
            else:
                assert changed_lp != packed_lp
