"""`ray job submit` onto a `ray start --head` cluster runs the tiny recipe to SUCCEEDED, and
rlray's gauges reach that head node's Prometheus endpoint while it runs, with sensible values."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_cluster(temp_dir: str) -> None:
    """Stop only this cluster's processes (`ray stop` would also stop the session's cluster)."""
    import psutil

    procs = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
    for p in procs:
        p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        p.kill()


@pytest.fixture
def head_node():
    temp_dir = tempfile.mkdtemp(prefix="rlray-job-", dir="/tmp")  # short: unix socket paths are limited
    # Gauges reach the endpoint each report interval (10 s by default): 1 s sees a short run's.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_metrics_report_interval_ms": "1000"}
    env.pop("RAY_ADDRESS", None)
    dash, metrics = free_port(), free_port()
    start = [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
             f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--num-cpus=8",
             # every port of its own: the test session's cluster is up on the defaults
             f"--metrics-export-port={metrics}",
             *(f"--{name}={free_port()}" for name in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                      "runtime-env-agent-port", "ray-client-server-port")),
             f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    try:
        subprocess.run(start, env=env, check=True, capture_output=True, timeout=600)
        yield f"http://127.0.0.1:{dash}", env, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()
    except OSError:  # the endpoint comes up with the node's agent
        return ""


def values(text: str, name: str) -> list[float]:
    name = f"ray_{name}"  # Ray prefixes application metrics
    return [float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} ([-+0-9.eE]+)$", text, flags=re.MULTILINE)]


def test_job_submit_runs_the_tiny_recipe_and_exports_gauges(head_node, tmp_path) -> None:
    address, env, metrics_url = head_node
    run_dir = tmp_path / "run"
    entry = [sys.executable, "-m", "rlray.launch", f"run.dir={run_dir}", "logging.wandb=disabled",
             "model.num_layers=2", "sft.max_steps=2", "sft.eval_every=2", "rl.steps=8", "rl.batch_size=32",
             "eval.num_examples=8", "checkpoint.every=0", "checkpoint.export_hf=false"]
    job_id = f"rlray-test-{uuid.uuid4().hex[:8]}"
    submit = [str(BIN / "ray"), "job", "submit", "--address", address, "--submission-id", job_id, "--no-wait",
              "--", *entry]
    for _ in range(30):  # the job agent comes up a little after `ray start` returns
        out = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=120)
        if out.returncode == 0 or "No available agent" not in out.stderr:
            break
        time.sleep(2)
    assert out.returncode == 0, out.stderr[-3000:]
    status, seen = "", ""
    for _ in range(600):
        if not seen:
            text = scrape(metrics_url)
            if values(text, "rlray_reward_mean") and values(text, "rlray_weight_sync_seconds"):
                seen = text
        out = subprocess.run([str(BIN / "ray"), "job", "status", "--address", address, job_id], env=env,
                             capture_output=True, text=True, timeout=60)
        ended = re.search(rf"Job '{job_id}' (succeeded|failed|was stopped)", out.stdout + out.stderr)
        if ended:
            status = ended.group(1)
            break
        time.sleep(1)
    logs = subprocess.run([str(BIN / "ray"), "job", "logs", "--address", address, job_id], env=env,
                          capture_output=True, text=True, timeout=60).stdout
    assert status == "succeeded", logs[-3000:]
    assert "held-out greedy reward after RL" in logs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= summary["rl_end_reward"] <= 1.0
    assert seen, "no rlray_ metrics reached the head node's endpoint during the run"
    assert all(0.0 <= v <= 1.0 for v in values(seen, "rlray_reward_mean"))
    assert all(v > 0 for v in values(seen, "rlray_weight_sync_seconds"))
    assert all(v >= 0 for v in values(seen, "rlray_off_policy_lag"))
    assert values(seen, "rlray_step_seconds")
