"""The trainer on DeepSeek-V3's architecture (multi-head latent attention: queries through a low-rank `q_a_proj` /
`q_b_proj`, keys and values from one latent of kv_lora_rank plus a shared rope key, key heads of 96 and value heads
of 32; group-limited sigmoid routing with a correction bias; shared experts; a dense first layer; fp32, gloo), the
family's tiny twin as its record builds it, its zero-initialised `e_score_correction_bias` replaced by a random one so
that the bias moves which group and which experts each token takes:

- its logprobs equal transformers' own model run on each sequence alone;
- packed micro-batches (several sequences per row) give the loss and gradients of one padded row per sequence
  (rtol 1e-5): packed attention takes key and value heads of different widths;
- on 2 ranks with FSDP2, activation checkpointing and expert parallelism EP 2 the loss and gradients equal one
  process's, the shared experts and the dense layer included; the correction bias (a buffer) is each rank's whole;
- on 2 ranks with context parallelism CP 2 (each sequence split over both) too: the ring gathers keys and values of
  their own widths.
One spawn per world size."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rlray.algo.loss import algo_config
from rlray.config import ModelConfig, TrainerConfig
from rlray.models.tiny import model_path
from rlray.parallel.expert import moe_experts
from tests.dist.common import SHAPE, assert_grads_close, reference_logprobs, samples, scored, spawn, step_sums

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def biased_twin(folder: Path) -> str:
    """The DeepSeek-V3 twin with a random router correction bias (transformers initialises it to 0)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_path(ModelConfig(arch="deepseek_v3", seed=7, **SHAPE)), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[BIAS] = torch.randn(tensors[BIAS].shape, generator=torch.Generator().manual_seed(3)) * 0.5
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def worker(rank: int, world: int, port: int, out: dict, path: str) -> None:
    from rlray.actors.trainer import TrainerActor

    data = samples()
    t = TrainerActor(rank, world, f"127.0.0.1:{port}", ModelConfig(name=path, seed=7),
                     TrainerConfig(num_ranks=world, ep=world, activation_checkpointing=world > 1),
                     algo_config(loss="dapo"), "gloo", temperature=0.7)
    t.setup()
    result = {packed: step_sums(t, data, world, rank, packed) for packed in (True, False)}
    result["experts"] = [m.num_experts for _, m in moe_experts(t.model)]
    result["bias"] = dict(t.model.named_buffers())[BIAS].numpy().copy()
    if world == 2:
        t = TrainerActor(rank, world, f"127.0.0.1:{port}", ModelConfig(name=path, seed=7),
                         TrainerConfig(num_ranks=world, cp=world), algo_config(loss="dapo"), "gloo", temperature=0.7)
        t.setup()
        result["cp"] = step_sums(t, data, world, rank, True, cp=world)
    if world == 1:
        result["scored"] = scored(t, data)
    if rank == 0:
        out.update(result)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> str:
    return biased_twin(tmp_path_factory.mktemp("deepseek_v3") / "twin")


@pytest.fixture(scope="module")
def one(twin: str) -> dict:
    return spawn(worker, 1, twin)


def test_one_process_equals_transformers(one: dict, twin: str) -> None:
    from safetensors.torch import load_file, save_file

    data = sorted(samples(), key=len, reverse=True)
    want = reference_logprobs(twin, data)
    errors = [np.abs(got - w).max() for got, w in zip(one["scored"], want)]
    assert max(errors) < 1e-5, errors
    unbiased = Path(twin).parent / "unbiased"
    shutil.copytree(twin, unbiased)
    tensors = load_file(str(unbiased / "model.safetensors"))
    tensors[BIAS].zero_()
    save_file(tensors, str(unbiased / "model.safetensors"), metadata={"format": "pt"})
    moved = max(np.abs(got - w).max() for got, w in zip(one["scored"], reference_logprobs(str(unbiased), data)))
    assert moved > 1e-3, moved  # the bias changes which experts tokens take: its being read is what the match shows
    bias = load_file(str(Path(twin) / "model.safetensors"))[BIAS].numpy()
    assert np.array_equal(one["bias"], bias) and np.abs(bias).max() > 0.1  # read from the checkpoint, not initialised


def test_packed_rows_equal_padded_rows(one: dict) -> None:
    packed, padded = one[True], one[False]
    assert packed["rows"] < padded["rows"]
    assert np.isclose(packed["loss"], padded["loss"], rtol=1e-5), (packed["loss"], padded["loss"])
    assert_grads_close(padded["grads"], packed["grads"], rtol=1e-5)
    assert any("kv_b_proj" in n for n in packed["grads"])


def test_two_ranks_with_expert_or_context_parallelism_equal_one_process(one: dict, twin: str) -> None:
    two = spawn(worker, 2, twin)
    assert np.isclose(two["cp"]["loss"], one[True]["loss"], rtol=1e-5), (two["cp"]["loss"], one[True]["loss"])
    assert_grads_close(one[True]["grads"], two["cp"]["grads"], rtol=1e-4)
    assert one["experts"] == [4] and two["experts"] == [2]  # layer 0 is dense; layer 1's experts split over 2 ranks
    assert np.array_equal(two["bias"], one["bias"])
    for packed in (True, False):
        a, b = one[packed], two[packed]
        assert np.isclose(b["loss"], a["loss"], rtol=1e-5), (packed, b["loss"], a["loss"])
        assert_grads_close(a["grads"], b["grads"], rtol=1e-4)  # EP and FSDP sum in another order
        assert np.abs(a["grads"]["model.layers.1.mlp.shared_experts.down_proj.weight"]).max() > 0
