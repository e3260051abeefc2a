"""The trainer on gpt-oss (attention sinks, sliding windows of 4 tokens, biased experts; fp32, gloo), the family's
tiny twin as its record builds it, its zero-initialised biases and small sinks replaced by random ones so that
each of them changes every logprob:

- its logprobs equal transformers' own model (eager attention, with the sinks) run on each sequence alone;
- packed micro-batches (several sequences per row, each longer than the window) give the loss and gradients of
  one padded row per sequence (rtol 1e-5): packed attention runs gpt-oss's own eager attention per sequence under
  the windowed causal mask (rlray.models.attention); with the sinks switched off (plain SDPA per sequence) the
  logprobs are wrong, by far;
- on 2 ranks with expert parallelism EP 2 the loss and gradients equal one process's, the experts' biases sharded
  with their experts (rlray.parallel.hf.shard_and_dispatch_experts) and their gradients included.
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
from rlray.models.attention import switch_sinks
from rlray.models.tiny import model_path
from rlray.parallel.expert import moe_experts
from tests.dist.common import SHAPE, assert_grads_close, reference_logprobs, samples, scored, spawn, step_sums

WINDOW = 4  # the twin's sliding window (rlray.config.families)


def biased_twin(folder: Path) -> str:
    """The gpt-oss twin with random attention and expert biases and sinks (transformers initialises them to 0, and
    the sinks small)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_path(ModelConfig(arch="gpt_oss", seed=7, **SHAPE)), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for name, t in tensors.items():
        if name.endswith(("bias", "sinks")):
            tensors[name] = torch.randn(t.shape, generator=g, dtype=t.dtype) * (1.0 if name.endswith("sinks") else 0.3)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def worker(rank: int, world: int, port: int, out: dict, path: str) -> None:
    from rlray.actors.trainer import TrainerActor

    data = samples()
    t = TrainerActor(rank, world, f"127.0.0.1:{port}", ModelConfig(name=path, seed=7), TrainerConfig(num_ranks=world,
                     ep=world), algo_config(loss="dapo"), "gloo", temperature=0.7)
    t.setup()
    result = {packed: step_sums(t, data, world, rank, packed) for packed in (True, False)}
    result["experts"] = [(m.num_experts, m.down_proj_bias.to_local().shape[0]) for _, m in moe_experts(t.model)]
    if world == 1:
        result["scored"] = scored(t, data)
        result["sinks"] = switch_sinks(t.model, False)
        result["no sinks"] = scored(t, data)
        switch_sinks(t.model, True)
    if rank == 0:
        out.update(result)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> str:
    return biased_twin(tmp_path_factory.mktemp("gpt_oss") / "twin")


@pytest.fixture(scope="module")
def one(twin: str) -> dict:
    return spawn(worker, 1, twin)


def test_one_process_equals_transformers_with_sinks_and_windows(one: dict, twin: str) -> None:
    data = sorted(samples(), key=len, reverse=True)
    assert max(len(s) for s in data) > 4 * WINDOW
    want = reference_logprobs(twin, data, attn_implementation="eager")  # its eager attention: sinks, windows
    errors = [np.abs(got - w).max() for got, w in zip(one["scored"], want)]
    assert max(errors) < 1e-5, errors
    off = max(np.abs(got - w).max() for got, w in zip(one["no sinks"], want))
    print(f"gpt_oss trainer vs transformers: max |dlogprob| {max(errors):.2e} with the sinks, {off:.3f} with the "
          f"{one['sinks']} attention layers' sinks and windows off")
    assert one["sinks"] == 2 and off > 1e-2  # the sinks and windows are what holds


def test_packed_rows_equal_padded_rows(one: dict) -> None:
    packed, padded = one[True], one[False]
    assert packed["rows"] < padded["rows"]
    assert np.isclose(packed["loss"], padded["loss"], rtol=1e-5), (packed["loss"], padded["loss"])
    assert_grads_close(padded["grads"], packed["grads"], rtol=1e-5)
    assert any(n.endswith("sinks") for n in packed["grads"])


def test_two_ranks_with_expert_parallelism_equal_one_process_biases_included(one: dict, twin: str) -> None:
    two = spawn(worker, 2, twin)
    assert one["experts"] == [(4, 4)] * 2 and two["experts"] == [(2, 2)] * 2  # each rank holds its experts' biases
    for packed in (True, False):
        a, b = one[packed], two[packed]
        assert np.isclose(b["loss"], a["loss"], rtol=1e-5), (packed, b["loss"], a["loss"])
        assert_grads_close(a["grads"], b["grads"], rtol=1e-4)  # EP and FSDP sum in another order
        assert np.abs(a["grads"]["model.layers.0.mlp.experts.down_proj_bias"]).max() > 0
