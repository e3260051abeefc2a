"""The README's run command: the default recipe learns reverse_text on this CPU machine.

Runs `python -m rlray.launch` exactly as a user does (its own local Ray cluster) and
checks the issue's bar: held-out greedy reward >= 0.85 after RL and >= 0.1 above the
post-SFT value. Several minutes: the longest test of the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys


def test_default_recipe_reward_rises(tmp_path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlray.launch", f"run.dir={run_dir}"]  # wandb offline, as a user without a key
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "held-out greedy reward before RL" in out.stdout
    assert "held-out greedy reward after RL" in out.stdout
    # a console a person can read: rlray's own lines only (Ray's two start-up lines go to stderr)
    ours = ("plan: ", "algo.loss=", "wandb (offline): ", "actors ready in ", "[sft] ", "[eval] ", "[rl] ", "SFT reached",
            "held-out greedy reward", "checkpoint ", "exported the trained model", "curves: ", "run folder: ")
    assert [line for line in out.stdout.splitlines() if not line.startswith(ours)] == []
    assert "Weave" not in out.stdout + out.stderr and "fontManager" not in out.stdout + out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    start, end = summary["rl_start_reward"], summary["rl_end_reward"]
    assert end >= 0.85, summary
    assert end - start >= 0.1, summary
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rl = [r for r in map(json.loads, lines) if r["stage"] == "rl"]
    assert len(rl) == 300 and any(r["lag_mean"] > 0 for r in rl)  # default max_off_policy_steps=1 overlaps
