"""One local Ray cluster for the whole test session (started on first use)."""

from __future__ import annotations

from typing import Iterator

import pytest

from rlray.config import ClusterConfig, Config


def tiny_config(tmp_path, **sections) -> Config:
    """The CPU default with short stages, a 2-layer model and no wandb."""
    c = Config()
    c.run.dir = str(tmp_path / "run")
    c.logging.wandb = "disabled"
    c.model.num_layers = 2
    c.sft.max_steps, c.sft.eval_every, c.sft.batch_size = 4, 2, 32
    c.rl.steps, c.rl.batch_size, c.rl.eval_every = 4, 32, 0
    c.eval.num_examples = 16
    for name, values in sections.items():
        for key, value in values.items():
            setattr(getattr(c, name), key, value)
    return c


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    import ray

    from rlray import cluster

    cluster.connect(ClusterConfig())
    yield
    ray.shutdown()
