"""Every RL objective, chosen by name from its paper preset, trains a few steps end to end (on one
trainer rank: the multi-rank paths are the same for every loss and are tested in tests/dist).
Losses that other runs already train get no run of their own: DAPO and Dr.GRPO in
tests/ray/test_rl_loop, GSPO and CISPO in tests/ray/test_envs, GRPO in tests/ray/test_replace, DPPO-TV in
tests/ray/test_trainer_recovery (same checks), OPD in tests/ray/test_default_recipe (it needs a trained
teacher). Today every loss has such a run, so no run starts here; a new loss gets one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlray.algo.loss import LOSSES
from rlray.orchestration.controller import run
from tests.ray.conftest import tiny_config
from tests.ray.test_default_recipe import LOSSES as IN_DISTILL
from tests.ray.test_envs import LOSSES as IN_ENVS
from tests.ray.test_replace import LOSSES as IN_REPLACE
from tests.ray.test_rl_loop import LOSSES as IN_RL_LOOP
from tests.ray.test_trainer_recovery import LOSSES as IN_RECOVERY

IN_OTHER_RUNS = {*IN_RL_LOOP, *IN_ENVS.values(), *IN_REPLACE, *IN_DISTILL, *IN_RECOVERY}
OWN_RUN = sorted(set(LOSSES) - IN_OTHER_RUNS)  # a new loss gets a run of its own


def test_the_runs_elsewhere_name_only_registered_losses() -> None:
    assert IN_OTHER_RUNS <= set(LOSSES), IN_OTHER_RUNS - set(LOSSES)


if OWN_RUN:  # collected only while some loss has no run elsewhere (pytest would report an empty set as a skip)
    @pytest.mark.parametrize("name", OWN_RUN)
    def test_loss_trains_end_to_end(ray_cluster, tmp_path, name: str) -> None:
        c = tiny_config(tmp_path, "stages=[rl]", "rl.steps=2", "trainer.num_ranks=1", algo={"loss": name})
        assert c.algo.loss == name
        run(c)
        lines = (Path(c.run.dir) / "metrics.jsonl").read_text().splitlines()
        rl = [r for r in map(json.loads, lines) if r["stage"] == "rl"]
        assert [r["step"] for r in rl] == [0, 1]
        for r in rl:
            assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
            assert r["mismatch_kl"] >= 0
