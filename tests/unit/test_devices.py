"""The GPU path, checked on CPU: device defaults, the trainer's device, the GPU probe without torch,
the stream hand-over of the gathered weights, the bucket size per backend (flash-attn's dtype:
test_hf_adapter.test_attention_choice)."""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from rlray.algo.loss import algo_config
from rlray.config import Config, ConfigError, ModelConfig, RolloutConfig, TrainerConfig, validate
from rlray.config.resources import check_local, visible_gpus
from tests.ray.conftest import tiny_config


def test_unset_engine_and_trainer_keys_take_their_device_defaults() -> None:
    cpu, gpu = RolloutConfig(), RolloutConfig(gpus_per_actor=1)
    assert (cpu.dtype, cpu.enforce_eager, cpu.kv_cache_gb, cpu.kv_cache_fraction) == ("float32", True, 0.25, 0.05)
    assert (gpu.dtype, gpu.enforce_eager, gpu.kv_cache_gb, gpu.kv_cache_fraction) == ("bfloat16", False, 0.0, 0.85)
    assert RolloutConfig(gpus_per_actor=1, dtype="float16", kv_cache_gb=8.0).dtype == "float16"
    assert RolloutConfig(gpus_per_actor=1, kv_cache_gb=8.0).kv_cache_gb == 8.0
    assert TrainerConfig().param_dtype == "float32" and TrainerConfig(gpus_per_rank=1).param_dtype == "bfloat16"


def test_device_defaults_through_the_command_line(tmp_path: Path) -> None:
    """What `python -m rlray.launch` composes: GPU bundles get GPU defaults, explicit values win."""
    gpu = tiny_config(tmp_path, "trainer.gpus_per_rank=1", "rollout.gpus_per_actor=1", "rollout.dtype=float16")
    assert (gpu.trainer.param_dtype, gpu.rollout.dtype, gpu.rollout.enforce_eager) == ("bfloat16", "float16", False)
    assert gpu.rollout.kv_cache_gb == 0.0 and gpu.rollout.kv_cache_fraction == 0.85
    cpu = tiny_config(tmp_path)
    assert (cpu.trainer.param_dtype, cpu.rollout.dtype, cpu.rollout.kv_cache_gb) == ("float32", "float32", 0.25)
    assert cpu.weights.bucket_mb is None


@pytest.mark.parametrize(("gpus", "backend", "needle"), [
    ((0.5, 0), "auto", "trainer.gpus_per_rank=0.5: each trainer rank needs a GPU of its own"),
    ((2, 2), "auto", "trainer.gpus_per_rank=2: a trainer rank drives one GPU"),
    ((1, 0), "gloo", "cluster.backend=gloo but trainer.gpus_per_rank=1"),
    ((0, 0), "nccl", "cluster.backend=nccl but trainer.gpus_per_rank=0 and rollout.gpus_per_actor=0"),
    ((1, 0), "auto", "trainer.gpus_per_rank=1 but rollout.gpus_per_actor=0"),
    ((1, 0.5), "auto", "rollout.gpus_per_actor=0.5 but rollout.tensor_parallel_size=1 makes 1 worker"),
])
def test_device_traps_are_config_errors(gpus: tuple[float, float], backend: str, needle: str) -> None:
    c = Config()
    c.trainer.gpus_per_rank, c.rollout.gpus_per_actor = gpus
    c.cluster.backend = backend
    with pytest.raises(ConfigError) as caught:
        validate(c)
    assert str(caught.value).startswith(needle) and "\n" not in str(caught.value)


def test_whole_gpus_with_a_matching_backend_pass() -> None:
    c = Config()
    c.trainer.gpus_per_rank, c.rollout.gpus_per_actor, c.cluster.backend = 1, 1, "nccl"
    validate(c)


def fake_driver(tmp_path: Path, n: int) -> Path:
    gpus = tmp_path / "gpus"
    for i in range(n):
        (gpus / f"0000:0{i}:00.0").mkdir(parents=True)
    return gpus


def test_visible_gpus_reads_the_driver_and_the_mask(tmp_path: Path) -> None:
    proc, none = fake_driver(tmp_path, 4), tmp_path / "absent"
    assert visible_gpus(proc, none, mask=None) == 4
    assert visible_gpus(proc, none, mask="2,3") == 2
    assert visible_gpus(proc, none, mask="") == 0 and visible_gpus(proc, none, mask="-1") == 0
    assert visible_gpus(none, none, mask="0,1") == 0  # no driver: no GPU, whatever the mask says
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    assert visible_gpus(none, dev, mask=None) == 2


def test_check_local_names_the_trainer_ranks_a_node_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlray.config import resources

    monkeypatch.setattr(resources, "visible_gpus", lambda: 1)
    monkeypatch.setattr(resources, "_torch_gpus", lambda: 1)  # the confirmation of a short count
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    c = Config()
    c.trainer.gpus_per_rank, c.rollout.gpus_per_actor = 1, 1
    with pytest.raises(ConfigError, match=r"^trainer.num_ranks=2 needs 2 GPUs \(one per rank\) but this machine has 1"):
        check_local(c)
    c.trainer.num_ranks, c.rl.batch_size = 1, 32
    with pytest.raises(ConfigError, match=r"needs 2 GPUs \(trainer 1 x 1, rollout 1 x 1\) but this machine has 1"):
        check_local(c)


def test_the_trainer_takes_its_device_from_its_bundle() -> None:
    from rlray.actors.trainer import TrainerActor

    def actor(gpus: float, backend: str) -> TrainerActor:
        return TrainerActor(0, 1, "127.0.0.1:1", ModelConfig(), TrainerConfig(num_ranks=1, gpus_per_rank=gpus),
                            algo_config(), backend, temperature=1.0)

    assert actor(0, "gloo").device.type == "cpu"
    assert actor(1, "nccl").device.type == "cuda"  # not read from the backend's name
    with pytest.raises(ValueError, match="holds a cuda device but the backend is gloo; set cluster.backend=nccl"):
        actor(1, "gloo").setup()
    with pytest.raises(ValueError, match="holds a cpu device but the backend is nccl; set cluster.backend=gloo"):
        actor(0, "nccl").setup()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="its bundle holds a GPU .* but torch sees none"):
            actor(1, "nccl").setup()


def test_rank_zero_holds_the_trainer_groups_port_from_the_moment_it_picks_it() -> None:
    from rlray.actors.trainer import TrainerActor

    actor = TrainerActor(0, 2, "127.0.0.1:0", ModelConfig(), TrainerConfig(num_ranks=2), algo_config(), "gloo", 1.0)
    host, port = actor.serve_group().rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0 and actor.master == f"{host}:{port}"
    with socket.socket() as s, pytest.raises(OSError, match="Address already in use"):
        s.bind(("", int(port)))  # what a vLLM engine starting meanwhile would try (a run lost its group so)
    joined = torch.distributed.TCPStore(host, int(port), 2, is_master=False, timeout=timedelta(seconds=10))
    joined.set("rank1", "here")
    assert actor._store.get("rank1") == b"here"


def test_two_ranks_on_one_gpu_are_named() -> None:
    from rlray.parallel.group import shared_gpu

    assert shared_gpu(["GPU-a", "GPU-b", "GPU-c"]) is None
    assert shared_gpu(["GPU-a", "GPU-b", "GPU-a", "GPU-b"]) == (0, 2, "GPU-a")


class RecordingStreams:
    """Stands in for torch.cuda's stream calls and logs them, with the stream work runs on."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.active = log, "side"  # the consumer iterates inside torch.cuda.stream(side), as vLLM's does

    def current(self) -> str:
        return self.active

    def default(self) -> str:
        return "default"

    @contextlib.contextmanager
    def use(self, stream: str):  # type: ignore[no-untyped-def]
        before, self.active = self.active, stream
        try:
            yield
        finally:
            self.active = before

    def wait(self, waiter: str, producer: str) -> None:
        self.log.append(f"{waiter} waits for {producer}")

    def record(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(f"{stream} uses {tensor.item():g}")


def test_the_gather_runs_on_the_default_stream_and_the_consumer_waits_for_it() -> None:
    from rlray.weightsync.transport import on_default_stream

    log: list[str] = []
    streams = RecordingStreams(log)

    def gathers():  # type: ignore[no-untyped-def]
        for i in range(2):
            log.append(f"gather {i} on {streams.current()}")
            yield f"p{i}", torch.tensor(float(i))

    got = []
    for name, _tensor in on_default_stream(gathers(), torch.device("cuda"), streams):
        log.append(f"consume {name} on {streams.current()}")
        got.append(name)
    assert got == ["p0", "p1"]
    assert log == ["gather 0 on default", "side waits for default", "side uses 0", "consume p0 on side",
                   "gather 1 on default", "side waits for default", "side uses 1", "consume p1 on side"]
    cpu = list(on_default_stream(iter([("w", torch.ones(1))]), torch.device("cpu"), streams))
    assert [n for n, _ in cpu] == ["w"] and len(log) == 8  # on CPU the pairs pass through untouched


def test_bucket_size_per_backend() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

    from rlray.weightsync.protocol import trainer_init_info
    from rlray.weightsync.transport import BUCKET_BYTES, TrainerSpec

    def info(backend: str, bucket: int | None):  # type: ignore[no-untyped-def]
        return trainer_init_info(TrainerSpec(backend, "127.0.0.1", 1, 3, bucket, 30.0), rank=0)

    assert info("gloo", None).bucket_bytes == BUCKET_BYTES == 16 << 20
    assert info("nccl", None).packed_buffer_size_bytes == DEFAULT_PACKED_BUFFER_SIZE_BYTES == 1 << 30
    assert info("gloo", 4 << 20).bucket_bytes == 4 << 20
    assert info("nccl", 256 << 20).packed_buffer_size_bytes == 256 << 20
    with pytest.raises(ValueError, match="the weight path's backend must be gloo, m2n, nccl, shm or ipc"):
        info("mpi", None)
