"""A run that crashes mid-RL resumes from its newest committed checkpoint, not from scratch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlray.controller import run
from tests.ray.conftest import Crash, crash_at_rl_step, tiny_config


def stages(run_dir: str) -> list[tuple[str, int]]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [(r["stage"], r["step"]) for r in map(json.loads, lines)]


def test_crash_then_resume(ray_cluster, tmp_path, monkeypatch) -> None:
    c = tiny_config(tmp_path, checkpoint={"every": 2, "export_hf": True}, rl={"steps": 5})
    undo = crash_at_rl_step(monkeypatch, 3)
    with pytest.raises(Crash):
        run(c)
    first = stages(c.run.dir)
    sft_steps = [s for s in first if s[0] == "sft"]
    assert [s for s in first if s[0] == "rl"] == [("rl", 0), ("rl", 1), ("rl", 2)]

    undo()
    summary = run(c)
    both = stages(c.run.dir)
    assert [s for s in both if s[0] == "sft"] == sft_steps, "SFT ran again after resume"
    assert [s[1] for s in both if s[0] == "rl"] == [0, 1, 2, 2, 3, 4]  # resumed at the step-2 checkpoint
    assert "rl_start_reward" in summary and "rl_end_reward" in summary
    ckpts = sorted(p.name for p in (Path(c.run.dir) / "checkpoints").iterdir())
    assert ckpts == ["ckpt_rl_00000004", "ckpt_rl_00000005"]  # keep=2, no .tmp left behind
    assert (Path(c.run.dir) / "hf" / "config.json").exists()
