"""Colocated mode without Ray: its bundles, its one-line refusals, its plan and memory phases (hand-computed),
the k=1 -> 0 resolution, the handover engines' registration, and the GPU path's vLLM API (sleep mode, the
ipc engine, the Ray executor's bundle placement) pinned against the vLLM the tests run."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from rlray.config import Colocation, ConfigError, validate, weight_backend
from rlray.config.resources import needs
from rlray.orchestration.plan import GB, make_plan
from tests.unit.test_config import launch
from tests.unit.test_plan import composed

GPU = ["trainer.gpus_per_rank=1", "rollout.gpus_per_actor=1", "cluster.colocate=true"]


def test_bundles_hold_a_trainer_rank_each_and_the_engine_workers_spread_evenly() -> None:
    where = Colocation(composed("cluster.colocate=true", "trainer.num_ranks=4", "rollout.num_actors=2"))
    assert where.stride == 2 and where.engine_bundles(0) == [0] and where.engine_bundles(1) == [2]
    assert [where.hosts_worker(r) for r in range(4)] == [True, False, True, False]
    assert where.bundles() == [{"CPU": 2.0}, {"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 1.0}]
    tp = Colocation(composed(*GPU, "trainer.num_ranks=4", "rollout.tensor_parallel_size=2",
                             "rollout.gpus_per_actor=2", "rollout.num_actors=2"))
    assert tp.stride == 1 and tp.engine_bundles(1) == [2, 3] and tp.first_bundle(1) == 2
    assert tp.bundles()[1] == {"CPU": 1.0, "GPU": 1.0} and tp.bundles()[2] == {"CPU": 2.0, "GPU": 1.0}
    assert tp.describe(3) == "trainer-3 + engine 1's worker 1"


def test_colocated_runs_ask_only_for_the_trainers_gpus_and_name_their_handover() -> None:
    c = composed(*GPU, "trainer.num_ranks=4", "rollout.num_actors=2")
    assert needs(c) == (4, 6) and weight_backend(c) == "ipc"
    assert weight_backend(composed("cluster.colocate=true")) == "shm" and weight_backend(composed()) == "gloo"


@pytest.mark.parametrize(("overrides", "message"), [
    (["async.max_off_policy_steps=2"], "cluster.colocate=true with async.max_off_policy_steps=2"),
    (["rollout.num_actors=3"], (r"3 engine workers \(rollout.num_actors=3 x tensor_parallel_size=1 x "
                                r"data_parallel_size=1\) do not divide the trainer's 2 bundles")),
    ([*GPU[:2], "rollout.data_parallel_size=2", "rollout.gpus_per_actor=2", "trainer.num_ranks=4"],
     "raise rollout.num_actors instead"),
    (["rollout.node_labels={pool: rollout}"], "set rollout.node_labels={}"),
    (["rollout.sleep_level=3"], "rollout.sleep_level=3; choose 1"),
    (["rollout.sleep_level=2", "trainer.lora.rank=8"], "with LoRA a sync sends only the adapters"),
    (["weights.delta=true"], "weights.delta=true with cluster.colocate=true"),
    (["trainer.offload_optimizer=true"], "trainer.offload_optimizer=true needs GPUs"),
])
def test_bad_colocated_configs_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        validate(composed("cluster.colocate=true", *overrides))
    assert "\n" not in str(e.value)


def test_offloading_needs_colocation() -> None:
    with pytest.raises(ConfigError, match="set cluster.colocate=true, or drop it"):
        validate(composed("trainer.offload_optimizer=true"))


def test_the_cli_refuses_a_bad_colocated_config_before_ray() -> None:
    result = launch("cluster.colocate=true", "async.max_off_policy_steps=3")
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "async.max_off_policy_steps=3" in result.stderr and "Ray" not in result.stdout


def test_the_plan_shows_one_group_with_trainer_and_engine_per_bundle_and_their_summed_memory_on_cpu() -> None:
    plan = make_plan(composed("cluster.colocate=true"))
    out = plan.render()
    for needle in ("placement group (colocated: a trainer rank and an engine worker per bundle)",
                   "rlray-colocated: 2 bundles", "bundle 0 {CPU: 2}: trainer-0 + rollout-0 (engine 0, worker 0)",
                   "bundle 1 {CPU: 1}: trainer-1", "weight sync: shm, 256 MB rounds in /dev/shm",
                   "memory per colocated bundle (CPU: no sleep mode, so their sum)"):
        assert needle in out, (needle, out)
    assert "rlray-trainer" not in out and "rlray-rollout" not in out
    trainer = sum(plan.trainer.values()) / GB
    engine = (plan.engine["weights"] + plan.engine["KV cache"]) / GB
    assert plan.phases()["both"] == pytest.approx(trainer + engine) and plan.overlap_fits()


def test_gpu_phases_take_the_maximum_and_refuse_what_fits_neither() -> None:
    c = composed(*GPU, "+recipe=qwen3_moe_lora", "trainer.num_ranks=8", "rollout.num_actors=8",
                 "rollout.tensor_parallel_size=1", "rollout.gpus_per_actor=1", "rollout.kv_cache_fraction=0.4",
                 "async.max_off_policy_steps=0", "trainer.offload_optimizer=true")
    plan = make_plan(c)
    t, gpu = plan.trainer, c.cluster.gpu_memory_gb
    p = plan.phases()
    assert p["train"] == pytest.approx(sum(t.values()) / GB)
    resident = sum(t.values()) - t["activations"] - t["logits"] - t["AdamW state"]
    assert p["generate"] == pytest.approx(resident / GB + 0.4 * gpu)
    assert "train phase" in plan.render() and "(optimizer state in host memory)" in plan.render()
    small = make_plan(dataclasses.replace(c, cluster=dataclasses.replace(c.cluster, gpu_memory_gb=10.0)))
    assert any(x.startswith("cluster.colocate=true: the train phase needs") and "and the generate phase" in x
               for x in small.problems()), small.problems()


def test_a_gpu_run_whose_sides_do_not_fit_at_once_takes_turns() -> None:
    from rlray.launch import _plan

    # the engine's 0.85 of the GPU beside the trainer's state fits; beside its activations too, it does not
    c = composed(*GPU, "trainer.micro_batch_tokens=1048576", "dry_run=true")
    plan = make_plan(c)
    assert plan.phases()["generate"] <= 80 < plan.phases()["both"]
    assert c.async_.max_off_policy_steps == 1 and not plan.overlap_fits()
    _plan(c)
    assert c.async_.max_off_policy_steps == 0
    fits = composed(*GPU, "dry_run=true")
    _plan(fits)
    assert fits.async_.max_off_policy_steps == 1


def test_handover_engines_are_registered_and_built_from_the_spec() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    from rlray.weightsync.nccl_lora import IPCAdapterWeightTransferEngine
    from rlray.weightsync.protocol import register, trainer_init_info
    from rlray.weightsync.shm import (
        ShmTrainerInitInfo,
        ShmTrainerWeightTransferEngine,
        ShmWeightTransferEngine,
    )
    from rlray.weightsync.transport import SHM_BUCKET_BYTES, TrainerSpec, engine_init_infos

    register()
    assert WeightTransferEngineFactory._registry["shm"]() is ShmWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["shm"]() is ShmTrainerWeightTransferEngine
    assert WeightTransferEngineFactory._registry["rlray_ipc"]() is IPCAdapterWeightTransferEngine
    assert "ipc" in WeightTransferTrainerFactory._registry  # the GPU handover is vLLM's own
    spec = TrainerSpec("shm", "h", 4242, 3, None, 30.0, stride=2, workers=2)
    infos = [trainer_init_info(spec, r) for r in range(4)]
    assert all(isinstance(i, ShmTrainerInitInfo) and i.prefix == "rlray-weights-4242" for i in infos)
    assert [i.writes for i in infos] == [True, False, True, False] and infos[0].bucket_bytes == SHM_BUCKET_BYTES
    ipc = trainer_init_info(dataclasses.replace(spec, backend="ipc", bucket_bytes=64 << 20), 1)
    assert isinstance(ipc, IPCTrainerInitInfo) and ipc.packed and ipc.packed_buffer_size_bytes == 64 << 20
    assert ipc.rank == 1 and not ipc.is_sender
    # vLLM's ipc engine needs no rank offsets: each engine gets the same info
    assert engine_init_infos({"packed": True}, [1, 2]) == [{"packed": True}, {"packed": True}]
    assert [i["rank_offset"] for i in engine_init_infos({"rank_offset": 0, "stride": 2}, [2, 1])] == [0, 2]


def test_the_gpu_paths_vllm_api() -> None:
    """What colocated GPU engines use of vLLM: sleep mode (engine arg, AsyncLLM.sleep/wake_up with levels,
    pause modes and tags), the Ray executor's bundle placement, the ipc engine's init and update info."""
    pytest.importorskip("vllm")
    from vllm import envs
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine import PauseMode
    from vllm.v1.engine.async_llm import AsyncLLM

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert {"enable_sleep_mode", "distributed_executor_backend"} <= fields
    assert list(inspect.signature(AsyncLLM.sleep).parameters) == ["self", "level", "mode"]
    assert list(inspect.signature(AsyncLLM.wake_up).parameters) == ["self", "tags"]
    assert "keep" in PauseMode.__args__
    assert "VLLM_RAY_BUNDLE_INDICES" in envs.environment_variables
    assert "VLLM_RAY_PER_WORKER_GPUS" in envs.environment_variables
    assert {"names", "dtype_names", "shapes", "ipc_handles", "tensor_sizes"} <= {
        f.name for f in dataclasses.fields(IPCWeightTransferUpdateInfo)}


def test_colocated_gpu_engines_use_vllms_ray_workers_with_sleep_mode() -> None:
    from rlray.actors.rollout import RolloutActor

    c = composed(*GPU)
    actor = RolloutActor(0, 1, c.model, c.rollout, c.env, 0, weights_backend="ipc", colocated=True)
    kwargs = actor._engine_kwargs()
    assert kwargs["distributed_executor_backend"] == "ray" and kwargs["enable_sleep_mode"] is True
    cpu = RolloutActor(0, 1, c.model, composed("cluster.colocate=true").rollout, c.env, 0, colocated=True)
    assert "enable_sleep_mode" not in cpu._engine_kwargs()  # vLLM's sleep mode is CUDA-only


def test_the_optimizer_state_moves_and_adamw_step_counts_stay() -> None:
    from types import SimpleNamespace

    from rlray.actors.learner import Learner

    model = torch.nn.Linear(4, 3)
    learner = SimpleNamespace(optimizer=torch.optim.AdamW(model.parameters()))
    model(torch.ones(2, 4)).sum().backward()
    learner.optimizer.step()
    moved = Learner.move_optimizer_state(learner, torch.device("meta"))  # type: ignore[arg-type]
    assert moved == 2 * (12 + 3) * 4  # exp_avg and exp_avg_sq of weight and bias, fp32
    for st in learner.optimizer.state.values():
        assert st["exp_avg"].is_meta and st["exp_avg_sq"].is_meta and not st["step"].is_meta
    assert Learner.move_optimizer_state(learner, torch.device("meta")) == 0  # already there  # type: ignore[arg-type]


def test_a_dev_shm_without_room_for_a_round_is_one_line(tmp_path, monkeypatch) -> None:
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from rlray.weightsync import shm

    monkeypatch.setattr(shm.os, "statvfs", lambda _: SimpleNamespace(f_bavail=16, f_frsize=4096))  # 64 KiB free
    with pytest.raises(RuntimeError, match=r"has 0 MiB free but one weight handover round needs 1 MiB") as e:
        shm.map_file(tmp_path / "round", 1 << 20, create=True)
    assert "\n" not in str(e.value) and "--shm-size" in str(e.value) and "weights.bucket_mb" in str(e.value)
    assert not (tmp_path / "round").exists()
    monkeypatch.undo()
    mapped = shm.map_file(tmp_path / "round", 1 << 20, create=True)
    mapped[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert shm.map_file(tmp_path / "round", 1 << 20)[:4].tolist() == [1, 2, 3, 4]  # another mapping sees it


IPC_PAYLOAD = """
import uuid, torch
from torch.multiprocessing.reductions import reduce_tensor
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
payload = {"update_info": {"ipc_handles": {str(uuid.uuid4()): reduce_tensor(torch.empty(4, device="meta"))[1]}}}
try:
    frames = MsgpackEncoder().encode(payload)
except TypeError as e:
    print("refused:", e)
else:
    (args,) = MsgpackDecoder().decode(frames)["update_info"]["ipc_handles"].values()  # tuples arrive as lists
    print("round trip:", args[0] is torch.Tensor and args[4] is torch.float32 and args[1] == [4])
"""


def test_colocated_gpu_engines_may_receive_ipc_handles_through_vllms_rpc() -> None:
    """The ipc handover's payload (what torch's reduce_tensor returns: type objects and a dtype) goes through
    vLLM's msgpack RPC only with VLLM_ALLOW_INSECURE_SERIALIZATION=1, which the rollout actor's environment
    carries when colocated on GPUs (vLLM reads it once, at start: it must be there before the engine starts)."""
    pytest.importorskip("vllm")
    import os
    import subprocess
    import sys

    from rlray.orchestration.cluster import rollout_env

    env = rollout_env(composed(*GPU, "trainer.num_ranks=4", "rollout.num_actors=2"), 1)
    assert env == {"VLLM_RAY_BUNDLE_INDICES": "2", "VLLM_RAY_PER_WORKER_GPUS": "0.5",
                   "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    assert rollout_env(composed("cluster.colocate=true"), 0) == {} and rollout_env(composed(), 0) == {}
    base = {k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_INSECURE_SERIALIZATION"}
    said = {}
    for name, extra in (("bare", {}), ("rollout actor", env)):
        out = subprocess.run([sys.executable, "-c", IPC_PAYLOAD], env={**base, **extra}, capture_output=True,
                             text=True, timeout=300)
        said[name] = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert said["bare"].startswith("refused:") and "VLLM_ALLOW_INSECURE_SERIALIZATION" in said["bare"], said
    assert said["rollout actor"] == "round trip: True", said


def test_the_handover_buffer_holds_the_largest_tensor_in_the_plan_and_in_the_trainers_init_info() -> None:
    """vLLM's ipc engine refuses a tensor larger than its packed buffer: with weights.bucket_mb unset the buffer
    is max(vLLM's 1 GiB, the largest tensor), for the plan and the trainer alike; a smaller bucket_mb is one line."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.base import ParamMeta
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

    from rlray.weightsync.handover import VLLM_PACKED_BYTES, handover_bytes
    from rlray.weightsync.protocol import trainer_init_info
    from rlray.weightsync.transport import TrainerSpec

    assert VLLM_PACKED_BYTES == DEFAULT_PACKED_BUFFER_SIZE_BYTES
    embedding = 151936 * 4096 * 2  # Qwen3-VL-8B's, in bf16: 1187 MiB
    c = composed(*GPU, "model.name=Qwen/Qwen3-VL-8B-Instruct", "trainer.num_ranks=8", "rollout.num_actors=8",
                 "cluster.gpu_memory_gb=141", "rollout.kv_cache_fraction=0.5", "async.max_off_policy_steps=0")
    plan = make_plan(c)
    assert plan.shape.largest == ("model.language_model.embed_tokens.weight", 151936 * 4096)
    out = plan.render()
    assert "weight sync: ipc, a packed buffer of 1187 MiB on each trainer GPU (sized to the largest tensor, " \
           "model.language_model.embed_tokens.weight, 1187 MiB in bfloat16" in out, out
    p = plan.phases()
    resident = sum(plan.trainer.values()) - plan.trainer["activations"] - plan.trainer["logits"]
    assert p["handover"] == pytest.approx((resident + plan.engine["weights"] + 2 * embedding) / GB)
    assert "handover 46.7 GB (the engine's weights and the ipc buffer, 1.24 GB, on each side)" in out, out
    wire = [ParamMeta("model.language_model.embed_tokens.weight", torch.bfloat16, (151936, 4096)),
            ParamMeta("lm_head.weight", torch.bfloat16, (4096, 4096))]
    spec = TrainerSpec("ipc", "h", 1, 9, None, 30.0)
    assert trainer_init_info(spec, 3, wire).packed_buffer_size_bytes == embedding
    assert trainer_init_info(spec, 3, wire[1:]).packed_buffer_size_bytes == DEFAULT_PACKED_BUFFER_SIZE_BYTES
    small = dataclasses.replace(c, weights=dataclasses.replace(c.weights, bucket_mb=16))
    problems = make_plan(small).problems()
    assert problems == [("cluster.colocate=true: weights.bucket_mb=16 is smaller than model.language_model.embed_tokens"
                         ".weight (1187 MiB on the wire), which vLLM's ipc handover packs whole; set weights.bucket_mb >= "
                         "1187, or unset it (the buffer is then sized to the largest tensor)")], problems
    with pytest.raises(ValueError, match=r"weights.bucket_mb=16 is smaller than model.language_model.embed_tokens"):
        trainer_init_info(dataclasses.replace(spec, bucket_bytes=16 << 20), 0, wire)
    assert handover_bytes(2048 << 20, [("x", embedding)]) == 2048 << 20


@pytest.mark.parametrize("name", ["zai-org/GLM-4.5-Air", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-4B", "Qwen/Qwen3-VL-8B-Instruct",
                                  "Qwen/Qwen3-VL-30B-A3B-Instruct", "zai-org/GLM-4.5V"])
def test_every_catalog_models_largest_tensor_sizes_its_handover(name: str) -> None:
    """Hand-computed: the largest bf16 tensor a sync sends, and so the ipc buffer; three are over vLLM's 1 GiB."""
    from rlray.models.catalog import architecture
    from rlray.models.shape import model_shape
    from rlray.weightsync.handover import VLLM_PACKED_BYTES, handover_bytes

    largest = {"zai-org/GLM-4.5-Air": ("model.layers.1.mlp.experts.gate_up_proj", 128 * 2 * 1408 * 4096),
               "Qwen/Qwen3-30B-A3B": ("model.layers.0.mlp.experts.gate_up_proj", 128 * 2 * 768 * 2048),
               "Qwen/Qwen3-4B": ("model.embed_tokens.weight", 151936 * 2560),
               "Qwen/Qwen3-VL-8B-Instruct": ("model.language_model.embed_tokens.weight", 151936 * 4096),
               "Qwen/Qwen3-VL-30B-A3B-Instruct": ("model.language_model.layers.0.mlp.experts.gate_up_proj",
                                                  128 * 2 * 768 * 2048),
               "zai-org/GLM-4.5V": ("model.language_model.layers.1.mlp.experts.gate_up_proj", 128 * 2 * 1408 * 4096)}
    shape = model_shape(architecture(name)[0], name)
    assert shape.largest == largest[name]
    size = handover_bytes(None, [(shape.largest[0], 2 * shape.largest[1])])
    over = name in ("zai-org/GLM-4.5-Air", "Qwen/Qwen3-VL-8B-Instruct", "zai-org/GLM-4.5V")
    assert (size > VLLM_PACKED_BYTES) == over and size >= 2 * shape.largest[1]


def test_sleep_level_2_is_refused_when_the_engines_hold_what_no_sync_refills() -> None:
    """Level 2 discards the engines' weights and a wake-up restores only vLLM's buffers: GLM's
    e_score_correction_bias (a buffer in transformers, never sent; a parameter in vLLM) and a frozen vision
    tower would stay garbage. Qwen3-VL with its tower trained has neither: level 2 is allowed."""
    gpu = [*GPU, "trainer.num_ranks=8", "rollout.num_actors=8", "cluster.gpu_memory_gb=141",
           "rollout.kv_cache_fraction=0.4", "rollout.sleep_level=2", "async.max_off_policy_steps=0"]
    glm = make_plan(composed(*gpu, "model.name=zai-org/GLM-4.5-Air", "trainer.ep=8")).problems()
    assert [p for p in glm if p.startswith("rollout.sleep_level=2")] == [(
        "rollout.sleep_level=2 discards the engines' weights and a sync refills only what the trainer sends, which "
        "leaves out model.layers.1.mlp.gate.e_score_correction_bias and 44 more (wrong outputs, no error); set "
        "rollout.sleep_level=1")], glm
    vl = ["model.name=Qwen/Qwen3-VL-8B-Instruct", "trainer.offload_optimizer=true"]
    frozen = make_plan(composed(*gpu, *vl, "trainer.freeze_vision=true")).problems()
    assert len(frozen) == 1 and "leaves out the vision tower (trainer.freeze_vision=true)" in frozen[0], frozen
    assert make_plan(composed(*gpu, *vl)).problems() == []
    assert not any("sleep_level" in p for p in make_plan(composed(*gpu, *vl, "trainer.freeze_vision=true",
                                                                  "rollout.sleep_level=1")).problems())


def test_the_trainer_returns_cached_memory_after_moving_the_optimizer_state(monkeypatch) -> None:
    """make_room: the optimizer state to host memory first, then torch's cached blocks back to the device (what
    vLLM's wake-up maps; memory_allocated cannot see them, memory_reserved can); on a CPU trainer nothing to empty."""
    from types import SimpleNamespace

    from rlray.actors.trainer import TrainerActor

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    actor = object.__new__(TrainerActor)
    actor.device = torch.device("cuda")
    actor.learner = SimpleNamespace(move_optimizer_state=lambda d: calls.append(f"optimizer to {d}") or 120)
    assert actor.make_room(True) == 120 and calls == ["optimizer to cpu", "empty_cache"]
    assert actor.make_room(False) == 0 and calls[2:] == ["empty_cache"]
    actor.device = torch.device("cpu")
    assert actor.make_room(False) == 0 and len(calls) == 3


def test_taking_turns_the_trainer_makes_room_before_the_engines_wake_and_after_the_handover(monkeypatch) -> None:
    """The colocated sync's order: optimizer out and cache emptied, weights woken, the handover, the handover's
    buffer returned, the KV cache woken (the offload used to run after the handover, at the trainer's peak)."""
    from types import SimpleNamespace

    from rlray.orchestration import controller
    from rlray.orchestration.controller import Controller

    calls: list[str] = []
    remote = lambda name: SimpleNamespace(remote=lambda *a: calls.append(f"{name}{a}"))
    trainer = SimpleNamespace(make_room=remote("make_room"), offload_optimizer=remote("offload_optimizer"))
    fleet = SimpleNamespace(wake=lambda tags=None: calls.append(f"wake {tags}"),
                            sync=lambda v: calls.append(f"sync {v}") or {"sync_seconds": 1.0},
                            sleep=lambda: calls.append("sleep"))
    monkeypatch.setattr(controller.ray, "get", lambda refs: refs)
    ctl = object.__new__(Controller)
    ctl.c = composed(*GPU, "async.max_off_policy_steps=0", "trainer.offload_optimizer=true")
    ctl._h, ctl._fleet = SimpleNamespace(trainers=[trainer, trainer]), fleet
    ctl.sync(3)
    assert calls == ["make_room(True,)", "make_room(True,)", "wake ['weights']", "sync 3", "make_room(False,)",
                     "make_room(False,)", "wake None"]
    calls.clear()
    ctl._train_turn()
    assert calls == ["sleep", "offload_optimizer(False,)", "offload_optimizer(False,)"]
