"""On-policy distillation on the shared Ray cluster: a teacher pool of its own scores every group, a
teacher killed mid-RL is replaced in its bundle while the run goes on (its groups in flight dropped
and counted), and every step logs the teacher's KL, rate and restarts. The learning run (a trained
teacher, the reward rising) is tests/ray/test_default_recipe.py's second command.

The teacher here is a random tiny model of another seed and size than the student, with the
student's tokenizer: the run checks the machinery, not what it learns.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ray

from rlray.config import ModelConfig
from rlray.models.tiny import model_path
from rlray.orchestration.controller import run
from rlray.orchestration.metrics import Metrics
from tests.ray.conftest import tiny_config

LOSSES = ("opd",)  # trained here: tests/ray/test_losses_e2e.py gives it no run of its own


def test_a_killed_teacher_is_replaced_and_every_step_is_scored(ray_cluster, tmp_path, monkeypatch, capsys) -> None:
    teacher = model_path(ModelConfig(num_layers=1, seed=3))
    c = tiny_config(tmp_path, "stages=[rl]", "rl.steps=5", "algo.loss=opd", f"teacher.name={teacher}",
                    "teacher.max_restarts=1")
    assert c.rollout.temperature == 1.0  # opd's default: the teacher's prompt logprobs are temperature 1
    real_log = Metrics.log

    def log(self: Metrics, stage: str, at: int, values: dict, total: int | None = None) -> None:
        real_log(self, stage, at, values, total)
        if stage == "rl" and at == 1:
            ray.kill(ray.get_actor("teacher-0"), no_restart=True)

    monkeypatch.setattr(Metrics, "log", log)
    run(c)
    out = capsys.readouterr().out
    assert "1 teacher(s) of " + teacher in out
    assert "teacher-0 was lost: its process died" in out and "teacher-0.1 started in" in out
    records = [r for r in map(json.loads, (Path(c.run.dir) / "metrics.jsonl").read_text().splitlines())
               if r["stage"] == "rl"]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    for r in records:
        assert math.isfinite(r["teacher_kl"]) and r["teacher_kl"] > 0  # a random teacher disagrees
        assert r["teacher_tokens_per_s"] >= 0 and r["teacher_seconds"] >= 0  # since the last batch: may be none
        assert r["mismatch_kl"] < 1e-6 and math.isfinite(r["loss"])
    assert sum(r["teacher_tokens_per_s"] for r in records) > 0 and max(r["teacher_seconds"] for r in records) > 0
    assert records[0]["teacher_restarts"] == 0 and records[-1]["teacher_restarts"] == 1
    assert "teacher_failed_groups" in records[-1]
