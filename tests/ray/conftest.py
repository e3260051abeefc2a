"""Each test process's local Ray cluster (started by the first test that asks, kept for the next), and tiny configs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rlray.algo.loss import resolve
from rlray.config import ClusterConfig, Config, register, to_config

BASE = ["logging.wandb=disabled", "model.num_layers=2", "sft.max_steps=4", "sft.eval_every=2",
        "sft.batch_size=32", "rl.steps=4", "rl.batch_size=32", "rl.eval_every=0", "eval.num_examples=16",
        "checkpoint.every=0", "checkpoint.export_hf=false"]
# For runs whose subject is not the trainer's ranks (engines lost, environments): one torch process fewer on 2 cores.
ONE_RANK = "trainer.num_ranks=1"


def _value(v: Any) -> str:
    if isinstance(v, str):
        return v
    return json.dumps(v)  # bools, numbers, lists and dicts in a form Hydra's override grammar reads


def tiny_config(tmp_path, *overrides: str, **sections: dict[str, Any]) -> Config:
    """The CPU default composed like `python -m rlray.launch` does, with short stages and a 2-layer model.

    Extra settings come as Hydra overrides (`"rl.steps=6"`) or as sections (`rl={"steps": 6}`;
    `async_` for the `async` section).
    """
    from hydra import compose, initialize_config_dir

    from rlray.launch import CONF_DIR

    extra = [f"{name.rstrip('_')}.{key}={_value(v)}" for name, values in sections.items()
             for key, v in values.items()]
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=[f"run.dir={tmp_path / 'run'}", *BASE, *overrides, *extra])
    c = to_config(cfg)
    resolve(c.algo)  # as launch does
    return c


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """This process's local Ray cluster, started by the first test that asks (a test module that needs a cluster
    of its own, tests/engine/test_env_runner.py, shuts this one down and starts it again after)."""
    import ray

    from rlray.orchestration import cluster

    cluster.connect(ClusterConfig())
    yield
    ray.shutdown()


def named_actor_exists(name: str) -> bool:
    """Whether an actor named `name` is registered (spawned and not killed) in the connected cluster."""
    import ray

    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


class Crash(RuntimeError):
    """Raised by `crash_at_rl_step`, standing in for a driver killed mid-run."""


def crash_at_rl_step(monkeypatch: pytest.MonkeyPatch, step: int) -> Callable[[], None]:
    """Make the run raise `Crash` when it logs RL step `step`; returns the undo."""
    from rlray.orchestration.metrics import Metrics

    real_log = Metrics.log

    def log(self: Metrics, stage: str, at: int, values: dict, total: int | None = None) -> None:
        if stage == "rl" and at == step:
            raise Crash("killed")
        real_log(self, stage, at, values, total)

    monkeypatch.setattr(Metrics, "log", log)
    return lambda: monkeypatch.setattr(Metrics, "log", real_log)


def kill_engine(actor: Any, timeout: float = 60) -> float:
    """SIGKILL rollout actor `actor`'s EngineCore process (what an OOM or a CUDA fault does: the engine
    is gone, the actor lives on) and wait until the actor knows (or the driver, having seen it first, has
    replaced the actor); returns the time of the kill."""
    import psutil
    import ray

    pid = ray.get(actor.pid.remote(), timeout=timeout)
    cores = [p for p in psutil.Process(pid).children() if p.name() == "VLLM::EngineCore"]
    assert len(cores) == 1, f"rollout actor (pid {pid}) has EngineCore children {cores}"
    cores[0].kill()
    killed = deadline = time.monotonic()
    deadline += timeout
    while True:
        try:
            if ray.get(actor.stats.remote(), timeout=timeout)["failure"] is not None:
                return killed
        except ray.exceptions.RayActorError:  # the driver saw the engine's death first and replaced the actor
            return killed
        assert time.monotonic() < deadline, "the rollout actor did not notice its engine's death"
        time.sleep(0.05)
