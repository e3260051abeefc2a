"""`python -m rlray.plot RUN_DIR` turns a run's metrics.jsonl into RUN_DIR/curves.png."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rlray.plot import read_records, series

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir: Path) -> None:
    lines = [{"stage": "sft", "step": s, "time": 0.1 * s, "loss": 2.0 / (s + 1)} for s in range(10)]
    lines[9]["eval_reward"] = 0.71
    for s in range(30):
        rec = {"stage": "rl", "step": s, "time": 2.0 + 0.6 * s, "reward_mean": 0.5 + 0.01 * s,
               "lag_mean": 0.9, "lag_max": 1, "rollout_tokens_per_s": 2100.0 + s, "train_tokens_per_s": 900.0 + s,
               "step_seconds": 0.6, "sync_seconds": 0.02}
        if s % 10 == 0:
            rec["eval_reward"] = 0.75 + 0.005 * s
        lines.append(rec)
    text = "\n".join(json.dumps(r) for r in lines) + "\n"
    text += '{"stage": "rl", "step": 30, "reward_me'  # a run killed mid-write
    (run_dir / "metrics.jsonl").write_text(text)


def run_plot(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "rlray.plot", *args], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG file"
    assert data[12:16] == b"IHDR"
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND", "PNG is truncated"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_curves_png(tmp_path: Path) -> None:
    write_metrics(tmp_path)
    proc = run_plot(str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "curves.png"
    assert out.is_file() and out.stat().st_size > 1000
    width, height = png_size(out)
    assert width >= 400 and height >= 400
    assert "5 panels" in proc.stdout  # reward, lag, throughput, sync seconds (rl) and sft; no mismatch KL logged


def test_plot_out_option_and_rl_only(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"stage": "rl", "step": s, "reward_mean": 0.1 * s, "rollout_tokens_per_s": 10.0})
                  for s in range(5)) + "\n")
    out = tmp_path / "sub" / "x.png"
    proc = run_plot(str(tmp_path), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    png_size(out)
    assert "2 panels" in proc.stdout  # no lag values, no sft stage: those panels are left out
    assert not (tmp_path / "curves.png").exists()


def test_plot_missing_or_empty_metrics_exits_1(tmp_path: Path) -> None:
    proc = run_plot(str(tmp_path))
    assert proc.returncode == 1
    assert "metrics" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"stage": "rl", "step": 0, "note": "x"}) + "\n")
    proc = run_plot(str(tmp_path))
    assert proc.returncode == 1 and "no values to plot" in proc.stderr
    assert not (tmp_path / "curves.png").exists()


def test_resumed_run_keeps_last_record_per_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    recs = [{"stage": "rl", "step": s, "reward_mean": 0.0} for s in range(4)]
    recs += [{"stage": "rl", "step": s, "reward_mean": 1.0} for s in (2, 3, 4)]  # resumed from step 2
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    steps, values = series(read_records(path), "rl", ["reward_mean"])["reward_mean"]
    assert steps == [0, 1, 2, 3, 4]
    assert values == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_held_out_rewards_come_from_every_evaluation_at_its_step(tmp_path: Path) -> None:
    """The evaluations before the first RL step and after the last are drawn too, at the number of steps
    taken when each ran (the policy version); the SFT ones on the SFT axis."""
    path = tmp_path / "metrics.jsonl"
    recs = [{"stage": "rl", "step": s, "reward_mean": 0.5, "eval_reward": 0.99 if s == 1 else None} for s in range(4)]
    recs += [{"stage": "eval", "step": i, "tag": tag, "at": at, "eval_reward": r}
             for i, (tag, at, r) in enumerate([("sft-2", 2, 0.4), ("rl-start", 0, 0.6), ("rl-2", 2, 0.7),
                                               ("rl-end", 4, 0.8)])]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    records = read_records(path)
    assert series(records, "rl", ["eval_reward"]) == {"eval_reward": ([0, 2, 4], [0.6, 0.7, 0.8])}
    assert series(records, "sft", ["eval_reward"]) == {"eval_reward": ([2], [0.4])}


def test_non_numeric_values_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    recs = [{"stage": "rl", "step": 0, "lag_mean": None}, {"stage": "rl", "step": 1, "lag_mean": "NaN"},
            {"stage": "rl", "step": 2, "lag_mean": float("nan")}, {"stage": "rl", "step": 3, "lag_mean": 2}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert series(read_records(path), "rl", ["lag_mean"]) == {"lag_mean": ([3], [2.0])}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
