"""Run metrics: one record per step to metrics.jsonl, wandb and a console line.

Contract: `Metrics(run_dir, cfg, config_dict)` opens `run_dir/metrics.jsonl` (appending)
and a wandb run (online only with WANDB_API_KEY set, else offline; `disabled`
turns it off). `log(stage, step, values)` writes one JSON line, logs to wandb
under `stage/`, sets rlray's gauges in Ray's metrics system (`ray_rlray_*` at each node's
Prometheus endpoint and shown by the Ray dashboard) when Ray is up,
and prints one console line with the headline numbers.
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
           ("rollout_tokens_per_s", "gen tok/s", "{:.0f}"), ("step_seconds", "step_s", "{:.2f}"),
           ("sync_seconds", "sync_s", "{:.3f}"), ("mismatch_kl", "mis_kl", "{:.1e}"),
           ("router_agreement", "router_agree", "{:.3f}"), ("stale_kl", "stale_kl", "{:.1e}"), ("loss", "loss", "{:.4f}"),
           ("moe_load_max_mean", "moe_load", "{:.2f}"), ("turns_mean", "turns", "{:.2f}"),
           ("token_mismatch_frac", "mismatch", "{:.2f}"), ("teacher_kl", "teacher_kl", "{:.3f}"),
           ("teacher_tokens_per_s", "teacher tok/s", "{:.0f}"), ("rollout_actors", "engines", "{:.0f}")]
QUIET = {"turns_mean": 1.0, "token_mismatch_frac": 0.0}  # left off the console line at this value


# Ray gauge name -> the logged value it mirrors
RAY_GAUGES = {
    "rlray_reward_mean": ("reward_mean", "mean reward of the last RL batch"),
    "rlray_eval_reward": ("eval_reward", "held-out reward at the last evaluation"),
    "rlray_off_policy_lag": ("lag_mean", "mean policy versions between generation and training"),
    "rlray_rollout_tokens_per_s": ("rollout_tokens_per_s", "completion tokens generated per second"),
    "rlray_train_tokens_per_s": ("train_tokens_per_s", "completion tokens trained per second of step time"),
    "rlray_buffer_depth": ("queued", "groups waiting in the buffer"),
    "rlray_stale_groups_dropped": ("stale_dropped", "groups dropped as too stale, in total"),
    "rlray_rollout_errors": ("rollout_errors", "rollouts with an environment error, in total"),
    "rlray_rollout_restarts": ("rollout_restarts", "rollout actors replaced after a crash, in total"),
    "rlray_rollout_actors": ("rollout_actors", "engines in the elastic rollout pool (rollout.max_actors)"),
    "rlray_trainer_step_seconds": ("train_seconds", "trainer forward/backward/optimizer seconds"),
    "rlray_step_seconds": ("step_seconds", "wall seconds of the whole step"),
    "rlray_weight_sync_seconds": ("sync_seconds", "seconds of the last weight broadcast"),
    "rlray_weight_sync_gb_per_s": ("sync_gb_per_s", "GB/s of the last weight broadcast"),
    "rlray_mismatch_kl": ("mismatch_kl", "KL(inference || trainer) on tokens of the trainer's version"),
    "rlray_stale_kl": ("stale_kl", "KL(inference || trainer) on tokens of older versions"),
    "rlray_router_agreement": ("router_agreement", "share of (token, MoE layer) pairs routed as the engine did"),
    "rlray_teacher_kl": ("teacher_kl", "on-policy distillation: mean per-token KL(student || teacher)"),
    "rlray_teacher_tokens_per_s": ("teacher_tokens_per_s", "tokens the distillation teacher scored per second"),
    "rlray_moe_load_max_mean": ("moe_load_max_mean", "tokens of the busiest expert over the mean, per MoE layer"),
}


class RayGauges:
    """rlray's numbers as `ray.util.metrics` gauges, tagged with stage and run name."""

    def __init__(self, run: str) -> None:
        from ray.util.metrics import Gauge

        self.tags = {"run": run}
        self.gauges = {name: (key, Gauge(name, desc, tag_keys=("run", "stage")))
                       for name, (key, desc) in RAY_GAUGES.items()}

    def set(self, stage: str, values: dict[str, Any]) -> None:
        for key, gauge in self.gauges.values():
            if isinstance(values.get(key), (int, float)):
                gauge.set(float(values[key]), tags={**self.tags, "stage": stage})


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
        self.ray: RayGauges | None = None
        mode = wandb_mode(cfg.wandb)
        if mode != "disabled":
            if not cfg.verbose:  # wandb advertises its Weave tracing in three lines when verifiers is imported
                os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
            import wandb

            self.wandb = wandb.init(project=cfg.project, dir=str(run_dir), config=config, mode=mode,
                                    name=run_dir.name, settings=wandb.Settings(silent=not cfg.verbose))
            print(f"wandb ({mode}): {self.wandb.dir}", flush=True)

    def log(self, stage: str, step: int, values: dict[str, Any], total: int | None = None) -> None:
        record = {"stage": stage, "step": step, "time": round(time.time() - self.t0, 3), **values}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({f"{stage}/{k}": v for k, v in values.items() if isinstance(v, (int, float))})
        if self._ray_up():
            self._ray_gauges().set(stage, values)
        self.console(stage, step, values, total)

    @staticmethod
    def _ray_up() -> bool:
        import ray

        return ray.is_initialized()

    def _ray_gauges(self) -> RayGauges:
        if self.ray is None:
            self.ray = RayGauges(self.path.parent.name)
        return self.ray

    @staticmethod
    def console(stage: str, step: int, values: dict[str, Any], total: int | None = None) -> None:
        where = f"{step + 1}/{total}" if total else str(step)
        parts = [f"[{stage}] {values['tag']}" if "tag" in values else f"[{stage}] step {where}"]
        for key, label, fmt in CONSOLE:
            if isinstance(values.get(key), (int, float)) and values[key] != QUIET.get(key):
                parts.append(f"{label} {fmt.format(values[key])}")
        print("  ".join(parts), file=sys.stdout, flush=True)

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
