"""rlray's gauges reach Ray's Prometheus endpoint during a run, with sensible values."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import ray

from rlray.controller import run
from tests.ray.conftest import tiny_config


def scrape() -> str:
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def values(text: str, name: str) -> list[float]:
    name = f"ray_{name}"  # Ray prefixes application metrics
    return [float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} ([-+0-9.eE]+)$", text, flags=re.MULTILINE)]


def test_metrics_endpoint_has_rlray_gauges(ray_cluster, tmp_path) -> None:
    c = tiny_config(tmp_path, rl={"steps": 30}, sft={"max_steps": 2, "eval_every": 2})
    done = threading.Event()
    worker = threading.Thread(target=lambda: (run(c), done.set()), daemon=True)
    worker.start()
    seen = ""
    deadline = time.time() + 600
    while time.time() < deadline and not done.is_set():
        text = scrape()
        if values(text, "rlray_reward_mean") and values(text, "rlray_weight_sync_seconds"):
            seen = text
            break
        time.sleep(2)
    worker.join(timeout=600)
    assert seen, "no rlray_ metrics reached the endpoint during the run"
    assert all(0.0 <= v <= 1.0 for v in values(seen, "rlray_reward_mean"))
    assert all(v > 0 for v in values(seen, "rlray_weight_sync_seconds"))
    assert all(v >= 0 for v in values(seen, "rlray_off_policy_lag"))
    assert values(seen, "rlray_step_seconds")
