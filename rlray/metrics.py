"""Run metrics: one record per step to metrics.jsonl, wandb and a console line.

Contract: `Metrics(run_dir, cfg, config_dict)` opens `run_dir/metrics.jsonl` (appending)
and a wandb run (online only with WANDB_API_KEY set, else offline; `disabled`
turns it off). `log(stage, step, values)` writes one JSON line, logs to wandb
under `stage/` and prints one console line with the headline numbers.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rlray.config import LoggingConfig

CONSOLE = [("reward_mean", "reward", "{:.3f}"), ("eval_reward", "eval", "{:.3f}"), ("lag_mean", "lag", "{:.2f}"),
           ("tokens_per_s", "tok/s", "{:.0f}"), ("step_seconds", "step_s", "{:.2f}"),
           ("sync_seconds", "sync_s", "{:.3f}"), ("mismatch_kl", "mis_kl", "{:.1e}"), ("loss", "loss", "{:.4f}")]


def wandb_mode(setting: str) -> str:
    if setting != "auto":
        return setting
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class Metrics:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, config: dict[str, Any]) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.file = self.path.open("a")
        self.t0 = time.time()
        self.wandb = None
        mode = wandb_mode(cfg.wandb)
        if mode != "disabled":
            import wandb

            self.wandb = wandb.init(project=cfg.project, dir=str(run_dir), config=config, mode=mode,
                                    name=run_dir.name)

    def log(self, stage: str, step: int, values: dict[str, Any], total: int | None = None) -> None:
        record = {"stage": stage, "step": step, "time": round(time.time() - self.t0, 3), **values}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({f"{stage}/{k}": v for k, v in values.items() if isinstance(v, (int, float))})
        self.console(stage, step, values, total)

    @staticmethod
    def console(stage: str, step: int, values: dict[str, Any], total: int | None = None) -> None:
        where = f"{step + 1}/{total}" if total else str(step)
        parts = [f"[{stage}] step {where}"]
        for key, label, fmt in CONSOLE:
            if isinstance(values.get(key), (int, float)):
                parts.append(f"{label} {fmt.format(values[key])}")
        print("  ".join(parts), file=sys.stdout, flush=True)

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
