"""Plot a run's curves: `python -m rlray.plot RUN_DIR [--out PATH]`.

Contract: reads `RUN_DIR/metrics.jsonl` (the records `rlray.orchestration.metrics.Metrics.log`
writes) and renders one PNG, `RUN_DIR/curves.png` unless `--out` says otherwise,
with one panel each for the RL reward (batch mean, and held-out `eval_reward`
where logged), the off-policy lag, the throughput, the weight-sync seconds and the
trainer-vs-engine mismatch KL, all against the RL step, plus an SFT panel (loss,
eval reward) when the run had an SFT stage; panels without data are left out. The
controller calls `plot_run(run_dir)` at the end of every run. A resumed
run appends to the same file: the last record of each (stage, step) wins. A
truncated last line (a run still writing) is skipped. Exits 1 with one line on
stderr when the file is missing or holds nothing to plot.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

Series = dict[str, tuple[list[int], list[float]]]

# (panel title, y label, [(record key, legend label, drawn as markers)])
RL_PANELS = [
    ("Reward", "reward", [("reward_mean", "batch mean", False), ("eval_reward", "held-out (greedy)", True)]),
    ("Off-policy lag", "policy versions", [("lag_mean", "mean", False), ("lag_max", "max", False)]),
    ("Throughput", "tokens / s", [("rollout_tokens_per_s", "generated", False),
                                  ("train_tokens_per_s", "trained", False),
                                  ("teacher_tokens_per_s", "scored by the teacher", False)]),
    ("Distillation: KL(student || teacher)", "nats / token", [("teacher_kl", "batch mean", False)]),
    ("Weight sync", "seconds", [("sync_seconds", "trainer -> engines", False)]),
    ("Mismatch KL(engine || trainer)", "nats / token", [("mismatch_kl", "same policy version", False),
                                                        ("stale_kl", "older versions", False)]),
]
SFT_PANEL = ("Supervised warm-up", "loss", [("loss", "loss", False), ("eval_reward", "held-out reward", True)])
RIGHT_AXIS = {("sft", "eval_reward")}  # (stage, key) drawn against a y axis of its own, on the right
MARKERS: dict[str, Any] = {"marker": "o", "linestyle": "none", "markersize": 4}
LINE: dict[str, Any] = {"linewidth": 1.2}


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, last one per (stage, step), in step order."""
    if not path.is_file():
        raise ValueError(f"no metrics file at {path}: pass the run folder (run.dir) of an rlray run")
    by_key: dict[tuple[str, int], dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_key[(str(record.get("stage", "")), record["step"])] = record
    return [by_key[k] for k in sorted(by_key, key=lambda k: (k[0], k[1]))]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(records: list[dict[str, Any]], stage: str, keys: list[str]) -> Series:
    """For each key: the steps of `stage` where it is a finite number, and its values. The held-out
    reward comes from the evaluations (stage `eval`), each at the `stage` step it was taken at, the
    ones before the first and after the last step included."""
    evals = [r for r in records if r.get("stage") == "eval" and str(r.get("tag", "")).startswith(f"{stage}-")
             and isinstance(r.get("at"), int)]
    out: Series = {}
    for key in keys:
        if key == "eval_reward" and evals:
            points = sorted((r["at"], float(r[key])) for r in evals if _number(r.get(key)))
        else:
            points = [(r["step"], float(r[key])) for r in records if r.get("stage") == stage and _number(r.get(key))]
        if points:
            out[key] = ([s for s, _ in points], [v for _, v in points])
    return out


def render(records: list[dict[str, Any]], out: Path, title: str) -> int:
    """Draw the panels that have data into `out`; returns the number of panels drawn."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # "generated new fontManager" on a fresh machine
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(p, "rl") for p in RL_PANELS] + [(SFT_PANEL, "sft")]
    drawn = [(p, stage, s) for p, stage in panels
             if (s := series(records, stage, [k for k, _, _ in p[2]]))]
    if not drawn:
        raise ValueError("metrics.jsonl holds no values to plot (rl reward, lag, throughput, sync, mismatch; sft loss)")
    cols = 1 if len(drawn) <= 3 else 2
    rows = -(-len(drawn) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 2.8 * rows), squeeze=False)
    for ax in axes.flat[len(drawn):]:
        ax.set_visible(False)
    for ax, (panel, stage, data) in zip(axes.flat, drawn):
        _panel(ax, panel, stage, data)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return len(drawn)


def _panel(ax: Any, panel: tuple[str, str, list[tuple[str, str, bool]]], stage: str, data: Series) -> None:
    from matplotlib.ticker import MaxNLocator

    name, ylabel, lines = panel
    handles, right = [], None
    for i, (key, label, markers) in enumerate(lines):
        if key not in data:
            continue
        on = ax
        if (stage, key) in RIGHT_AXIS:
            on = right = ax.twinx()
            right.set_ylabel(label)
        steps, values = data[key]
        handles += on.plot(steps, values, label=label, color=f"C{i}", **(MARKERS if markers else LINE))
    ax.set_title(f"{name} ({stage})", fontsize=10)
    ax.set_xlabel(f"{stage} step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for y in filter(None, (ax, right)):
        y.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, fontsize=8, loc="best")


def plot_run(run_dir: Path, out: Path | None = None) -> str:
    """Render `run_dir`'s curves (default `run_dir/curves.png`); returns the line saying what was
    written. Raises ValueError when there is nothing to plot."""
    out = out or run_dir / "curves.png"
    records = read_records(run_dir / "metrics.jsonl")
    where = run_dir.resolve()
    n = render(records, out, title=f"{where.parent.name}/{where.name}")
    return f"wrote {out} ({n} panels from {len(records)} records)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlray.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run folder (run.dir) holding metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    try:
        print(plot_run(args.run_dir, args.out))
    except ValueError as e:
        print(f"plot error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
