"""The trainer on the recurrent hybrids (the gated delta-net ones, Qwen3.5 dense and MoE and Qwen3-Next, and the
Mamba-2 one, Nemotron-H with its ungated experts; fp32, gloo), each family's tiny twin as its record builds it (one
linear-attention layer, one full-attention layer; Nemotron-H's each followed by an MoE layer):

- its logprobs equal transformers' own model run on each sequence alone (an independent computation);
- packed micro-batches (several sequences per row) give the loss and gradients of one padded row per
  sequence (rtol 1e-5): each gated delta-net or Mamba mixer runs once per sequence (rlray.models.recurrent); with
  that reset switched off the packed loss is wrong, by far (the state of one sequence runs into the next);
- on 2 ranks (FSDP2, activation checkpointing, and expert parallelism EP 2 for the MoE ones) the loss and
  gradients equal one process's.
One spawn per world size runs the four families."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rlray.algo.loss import algo_config
from rlray.config import ModelConfig, TrainerConfig
from rlray.config.families import family
from rlray.data.layout import model_inputs
from rlray.data.packing import Sample, pack
from rlray.models.recurrent import switch
from rlray.models.tiny import model_path
from rlray.parallel.expert import moe_experts
from tests.dist.common import SHAPE, assert_grads_close, samples, spawn, step_sums

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h")


@torch.no_grad()
def reference_logprobs(path: str, sample: Sample) -> np.ndarray:
    """transformers alone, on the sequence alone: log p(completion[j] | prompt, completion[:j]) at temperature 0.7."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(np.concatenate([sample.prompt_ids, sample.completion_ids]))[None]
    logits = model(input_ids=ids, use_cache=False).logits[0, len(sample.prompt_ids) - 1:-1]
    lp = torch.log_softmax(logits.float() / 0.7, -1)
    return lp.gather(1, torch.tensor(sample.completion_ids)[:, None])[:, 0].numpy()


def worker(rank: int, world: int, port: int, out: dict) -> None:
    from rlray.actors.trainer import TrainerActor

    data = samples()
    for arch in ARCHS:
        model = ModelConfig(arch=arch, seed=7, **SHAPE)
        ep = world if family(arch).moe else 1
        trainer = TrainerConfig(num_ranks=world, ep=ep, activation_checkpointing=world > 1)  # recomputed: the same
        t = TrainerActor(rank, world, f"127.0.0.1:{port}", model, trainer, algo_config(loss="dapo"), "gloo",
                         temperature=0.7)
        t.setup()
        result = {packed: step_sums(t, data, world, rank, packed) for packed in (True, False)}
        result["experts"] = [m.num_experts for _, m in moe_experts(t.model)]
        if world == 1:
            switch(t.model, False)
            result["no reset"] = step_sums(t, data, world, rank, True)
            switch(t.model, True)
            mb = pack(data, 1, micro_batch_tokens=10_000, pad_id=0)[0][0]  # every sequence in one packed row
            with torch.no_grad():
                got = t.learner._token_logprobs(model_inputs(mb, t.device), 0.7).numpy()
            order = sorted(data, key=len, reverse=True)
            result["scored"] = [(got[n, len(s.prompt_ids):len(s)], reference_logprobs(model_path(model), s))
                                for n, s in enumerate(order)]
        if rank == 0:
            out[arch] = result
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one() -> dict:
    return spawn(worker, 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_process_equals_transformers_and_packed_rows_reset_the_recurrent_state(one: dict, arch: str) -> None:
    r = one[arch]
    packed, padded = r[True], r[False]
    assert packed["rows"] < padded["rows"]
    assert np.isclose(packed["loss"], padded["loss"], rtol=1e-5), (packed["loss"], padded["loss"])
    assert_grads_close(padded["grads"], packed["grads"], rtol=1e-5)
    off = r["no reset"]["loss"]
    print(f"{arch}: packed loss {packed['loss']:.6g}, padded {padded['loss']:.6g}, packed without the reset {off:.6g}")
    assert abs(off - padded["loss"]) > 1e-3 * abs(padded["loss"]), (off, padded["loss"])  # the reset is what holds
    assert len(r["scored"]) == 8
    for got, want in r["scored"]:
        assert np.abs(got - want).max() < 1e-5, np.abs(got - want).max()


def test_two_ranks_with_fsdp_and_expert_parallelism_equal_one_process(one: dict) -> None:
    two = spawn(worker, 2)
    for arch in ARCHS:
        moe = family(arch).moe is not None
        assert one[arch]["experts"] == ([4] * 2 if moe else []) and two[arch]["experts"] == ([2] * 2 if moe else [])
        for packed in (True, False):
            a, b = one[arch][packed], two[arch][packed]
            assert np.isclose(b["loss"], a["loss"], rtol=1e-5), (arch, packed, b["loss"], a["loss"])
            assert_grads_close(a["grads"], b["grads"], rtol=1e-4)  # EP and FSDP sum in another order
