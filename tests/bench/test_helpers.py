"""The benchmarks' pure parts: the report, the async probe's arithmetic, the FLOPs count."""

from __future__ import annotations

import json

import pytest

from rlray.bench.async_rl import default_config, in_schema, metrics_clock, rollout_busy
from rlray.bench.common import Column, Report
from rlray.bench.gpu_step import ARCHS


def test_report_prints_table_and_ratios_and_writes_json(tmp_path) -> None:
    r = Report("demo", quick=True, params={"n": 1})
    r.columns = [Column("name", "name"), Column("x", "x/s", "{:.1f}"), Column("y", "y")]
    r.rows = [{"name": "a", "x": 1.25, "y": None}, {"name": "bbbb", "x": 10.0, "y": 3}]
    r.ratios = {"a / b": 0.125}
    text = r.text()
    lines = text.splitlines()
    assert lines[0] == "== rlray.bench demo (quick) =="
    assert lines[1].startswith("host: ") and " ISA " in lines[1] and "AMX" in lines[1]  # engine numbers depend on it
    assert lines[2].split() == ["name", "x/s", "y"] and set(lines[3].replace(" ", "")) == {"-"}
    assert lines[4].split() == ["a", "1.2", "-"] and lines[5].split() == ["bbbb", "10.0", "3"]
    assert "a / b  0.125" in text
    data = json.loads(r.write(tmp_path / "x" / "demo.json").read_text())
    assert data["rows"][1]["x"] == 10.0 and data["columns"] == ["name", "x", "y"] and data["ratios"]["a / b"] == 0.125


def test_rollout_busy_clips_to_window_and_drops_weight_loads() -> None:
    record = {"busy": [(0.0, 2.0), (3.0, 6.0)], "paused": [(1.0, 1.5), (2.5, 3.5), (5.0, 9.0)]}
    # in [1, 5.5]: busy 1..2 and 3..5.5 = 3.5; minus loads inside busy time: 1..1.5 and 3..3.5 and 5..5.5
    assert rollout_busy(record, 1.0, 5.5) == pytest.approx(3.5 - 1.5)
    assert rollout_busy({"busy": [], "paused": []}, 0.0, 1.0) == 0.0


def test_metrics_clock_takes_the_promptest_log() -> None:
    rl = [{"time": 10.0, "sync_seconds": 0.1}, {"time": 11.0, "sync_seconds": 0.1}]
    paused = [(0.0, 100.0), (1000.0, 1009.99), (1010.5, 1010.98)]  # the first is the pre-loop sync
    assert metrics_clock(rl, paused) == pytest.approx(999.99)
    with pytest.raises(ValueError):
        metrics_clock(rl, paused[:1])


def test_default_config_is_conf_yaml_plus_overrides() -> None:
    c = default_config(["async.max_off_policy_steps=2", "stages=[rl]", "rl.steps=3"])
    assert c.async_.max_off_policy_steps == 2 and c.stages == ["rl"] and c.rl.steps == 3
    assert (c.algo.loss, c.algo.aggregation) == ("grpo", "sequence")  # conf/config.yaml's loss, its preset
    assert in_schema("async.max_off_policy_steps=1") and in_schema("rl.steps=2")
    assert not in_schema("nope.key=1") and not in_schema("rl.nope=1")


def test_gpu_step_parameter_counts_by_hand() -> None:
    """The tiny models, counted by hand: attention q, k, v, o = 128x128, 2 x 128x64, 128x128 per layer;
    the dense MLP 3 x 128x384; an expert 3 x 128x96 and the router 128x4; the tied 1024x128 embedding
    once, as the head (its lookup is no matmul). The MoE's token uses 2 of its 4 experts."""
    dense, moe = ARCHS["tiny"]
    attn, embed = 128 * 128 * 2 + 2 * 128 * 64, 1024 * 128
    assert dense.params() == {"total": 2 * (attn + 3 * 128 * 384) + embed, "active": 2 * (attn + 3 * 128 * 384) + embed}
    expert, router = 3 * 128 * 96, 128 * 4
    assert moe.params() == {"total": 2 * (attn + 4 * expert + router) + embed,
                            "active": 2 * (attn + 2 * expert + router) + embed}
    assert moe.flops_per_token(128) > 6 * moe.params()["active"]