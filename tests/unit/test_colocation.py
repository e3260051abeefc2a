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
