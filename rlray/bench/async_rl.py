"""async: wall-clock of the same RL steps at `async.max_off_policy_steps` 0, 1 and 2, and colocated.

Colocated runs (`cluster.colocate=true`, `--colocated` ks) place the engine in trainer rank 0's bundle
and hand weights over in shared memory; at k=0 the engine pauses while the trainer trains (turns).

Each k is one `rlray.orchestration.controller.run(config)` of the default recipe (`conf/config.yaml` on the
schema, then this benchmark's settings and any `--set key=value`), all three on one local Ray
cluster. From each run's metrics.jsonl:
- RL wall = the sum of `step_seconds` over the RL steps (the loop only: no start-up, no
  evaluation); speedup = wall(k=0) / wall(k);
- trainer busy = sum of `train_seconds` + `sync_seconds` (rank 0 training or sending weights);
  trainer idle = 1 - busy / wall (waiting for a batch).
The rollout actors' idle fraction needs a probe (no metric holds it): `RolloutActor` is
observed by a subclass (`ProbedRolloutActor`, swapped into `rlray.orchestration.cluster` for this process
only; it changes nothing it observes) that counts group tickets in flight through the
documented buffer calls (`reserve` adds, `put`/`cancel` remove) and times each weight update (start to finish).
rollout busy = time with a group in flight and no weight update under way, clipped to the RL
loop's window (the records' own clock, anchored to wall time by the ends of the loop's weight
loads, see `metrics_clock`); rollout idle = 1 - busy / wall. `--no-probe` runs the plain actor and leaves it out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlray.actors.rollout import RolloutActor
from rlray.bench.common import Column, Report, median, ratio
from rlray.config import RECIPES_DIR, Config

CONF = RECIPES_DIR.parent / "conf" / "config.yaml"
QUICK = {"steps": 3, "ks": [0, 2], "colocated": [0],
         "set": ["model.num_layers=2", "rl.batch_size=16", "eval.num_examples=8"]}
FULL = {"steps": 30, "ks": [0, 1, 2], "colocated": [0, 1], "set": ["eval.num_examples=32"]}
# Every run starts fresh and spends its time on the steps: no resume, checkpoints or export
# (where the schema has them), no evaluation inside the loop.
FRESH = ["checkpoint.every=0", "checkpoint.resume=false", "checkpoint.export_hf=false", "rl.eval_every=0",
         "logging.wandb=disabled"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ks", nargs="+", type=int, help="max_off_policy_steps values (full: 0 1 2; quick: 0 2, "
                   "one vLLM start fewer)")
    p.add_argument("--colocated", nargs="*", type=int, help="max_off_policy_steps values of colocated runs "
                   "(cluster.colocate=true; full: 0 1, quick: 0; none: --colocated with no value)")
    p.add_argument("--steps", type=int, help="RL steps per run (quick 3, full 30)")
    p.add_argument("--sft", action="store_true", help="keep the SFT warm-up stage (default: stages=[rl])")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides, e.g. rl.batch_size=64 trainer.num_ranks=1")
    p.add_argument("--repeats", type=int, default=1, help="run every k this many times, alternating k")
    p.add_argument("--no-probe", action="store_true", help="no rollout busy probe (no rollout idle column)")
    p.add_argument("--run-dir", help="where the runs' folders go (default: next to --out)")


def in_schema(override: str) -> bool:
    node: Any = Config()
    for part in override.split("=", 1)[0].split("."):
        part = "async_" if part == "async" else part
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


def default_config(overrides: list[str]) -> Config:
    """`conf/config.yaml` on the schema plus dotlist overrides, validated like the launcher does."""
    from omegaconf import OmegaConf

    from rlray.algo.loss import resolve
    from rlray.config import schema_node, to_config

    if not OmegaConf.has_resolver("now"):  # Hydra's, for a run.dir default like runs/x/${now:%H%M%S}
        OmegaConf.register_new_resolver("now", lambda pattern: time.strftime(pattern), use_cache=True)
    conf = OmegaConf.load(CONF)
    for key in ("defaults", "hydra"):
        conf.pop(key, None)
    merged = OmegaConf.merge(schema_node(), conf, OmegaConf.from_dotlist(overrides))
    c = to_config(merged)
    resolve(c.algo)
    return c


# ---- the rollout probe ------------------------------------------------------------------------
def probe_dir(job_id: str) -> Path:
    return Path(tempfile.gettempdir()) / "rlray-bench-probe" / job_id


class _CountingBuffer:
    """Forwards the buffer calls the rollout loop makes, counting tickets in flight."""

    def __init__(self, inner: Any, mark: Any) -> None:
        self.inner, self.mark = inner, mark

    async def reserve(self, version: int, want: int) -> list[int]:
        granted = await self.inner.reserve(version, want)
        self.mark(len(granted))
        return granted

    async def put(self, groups: list) -> Any:
        self.mark(-len(groups))
        return await self.inner.put(groups)

    async def cancel(self, tickets: list[int]) -> Any:
        self.mark(-len(tickets))
        return await self.inner.cancel(tickets)


class ProbedRolloutActor(RolloutActor):
    """A RolloutActor that records when it has groups in flight and when it loads weights."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_flight, self._since = 0, 0.0
        self._busy: list[tuple[float, float]] = []
        self._paused: list[tuple[float, float]] = []
        self._pause_start = 0.0

    def _mark(self, delta: int) -> None:
        before = self._in_flight
        self._in_flight += delta
        if before <= 0 < self._in_flight:
            self._since = time.time()
        elif self._in_flight <= 0 < before:
            self._busy.append((self._since, time.time()))

    async def run(self, buffer: Any, loop: int = 0) -> dict[str, Any]:
        return await super().run(_CountingBuffer(buffer, self._mark), loop)

    async def start_weight_update(self, adapter: dict[str, Any] | None = None) -> None:
        self._pause_start = time.time()
        await super().start_weight_update(adapter)

    async def finish_weight_update(self, weight_version: str) -> dict[str, float]:
        try:
            return await super().finish_weight_update(weight_version)
        finally:
            self._paused.append((self._pause_start, time.time()))

    async def stop(self, loop: int | None = None) -> None:
        await super().stop(loop)
        import ray

        busy = self._busy + ([(self._since, time.time())] if self._in_flight > 0 else [])
        stats = self.stats() if callable(getattr(self, "stats", None)) else getattr(self, "stats", {})
        stats = await stats if hasattr(stats, "__await__") else stats
        out = probe_dir(ray.get_runtime_context().get_job_id())
        out.mkdir(parents=True, exist_ok=True)
        record = {"busy": busy, "paused": self._paused, "stats": stats}
        (out / f"rollout-{self.index}.json").write_text(json.dumps(record))


@contextlib.contextmanager
def probed_rollouts(enabled: bool) -> Iterator[None]:
    from rlray.orchestration import cluster

    original = cluster.RolloutActor
    if enabled:
        cluster.RolloutActor = ProbedRolloutActor
    try:
        yield
    finally:
        cluster.RolloutActor = original


def _overlap(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def rollout_busy(record: dict[str, Any], lo: float, hi: float) -> float:
    """Seconds in [lo, hi] with a group in flight, minus the weight updates inside them."""
    busy = _overlap(record["busy"], lo, hi)
    for a, b in record["paused"]:  # a pause counts only where it overlaps in-flight time
        busy -= sum(max(0.0, min(b, y, hi) - max(a, x, lo)) for x, y in record["busy"])
    return max(0.0, busy)


def metrics_clock(rl: list[dict[str, Any]], paused: list[tuple[float, float]]) -> float:
    """The wall time at which metrics.jsonl's `time` is 0, from the probe's weight loads.

    The last len(synced) loads are the RL loop's syncs (stop() comes right after the loop); each
    ends just before its step's record is logged, so `end - record.time` is at most the clock's
    zero, and closest to it for the promptest log.
    """
    synced = [r for r in rl if "sync_seconds" in r]
    if not synced or len(paused) < len(synced):
        raise ValueError("the rollout probe saw fewer weight loads than the RL loop synced; rerun with --no-probe")
    return max(end - r["time"] for (_, end), r in zip(paused[-len(synced):], synced))


# ---- one run ----------------------------------------------------------------------------------
def measure(c: Config, probe: bool) -> dict[str, Any]:
    import ray

    from rlray.orchestration.controller import run

    t0 = time.perf_counter()
    with probed_rollouts(probe):
        summary = run(c)
    total = time.perf_counter() - t0
    path = Path(c.run.dir) / "metrics.jsonl"
    rl = [r for r in map(json.loads, path.read_text().splitlines()) if r["stage"] == "rl"]
    wall = sum(r["step_seconds"] for r in rl)
    train = sum(r.get("train_seconds", 0.0) for r in rl)
    sync = sum(r.get("sync_seconds", 0.0) for r in rl)
    tokens = sum(r.get("completion_tokens", 0) for r in rl)
    out: dict[str, Any] = {
        "k": c.async_.max_off_policy_steps, "steps": len(rl), "wall_s": wall, "s_per_step": wall / max(1, len(rl)),
        "steady_s_per_step": sum(r["step_seconds"] for r in rl[1:]) / max(1, len(rl) - 1),
        "train_s": train, "sync_s": sync, "trainer_idle": 1.0 - (train + sync) / wall if wall else None,
        "tokens_per_s": tokens / wall if wall else 0.0, "completion_tokens": tokens,
        "lag_mean": sum(r.get("lag_mean", 0.0) for r in rl) / max(1, len(rl)),
        "stale_dropped": rl[-1].get("stale_dropped", 0) if rl else 0,
        "reward_first": rl[0].get("reward_mean") if rl else None, "reward_last": rl[-1].get("reward_mean") if rl else None,
        "run_total_s": total, "run_dir": c.run.dir, "summary": summary,
    }
    if probe:
        folder = probe_dir(ray.get_runtime_context().get_job_id())
        records = [json.loads(p.read_text()) for p in sorted(folder.glob("rollout-*.json"))]
        for p in folder.glob("rollout-*.json"):
            p.unlink()
        t0 = metrics_clock(rl, records[0]["paused"]) if records else 0.0
        lo, hi = t0 + rl[0]["time"] - rl[0]["step_seconds"], t0 + rl[-1]["time"]
        busy = [rollout_busy(rec, lo, hi) for rec in records]
        out.update(window_s=hi - lo, rollout_busy_s=sum(busy) / max(1, len(busy)),
                   rollout_idle=1.0 - sum(busy) / max(1, len(busy)) / (hi - lo) if records else None,
                   rollout_stats=[rec["stats"] for rec in records])
    return out


def run(args: argparse.Namespace) -> Report:
    from rlray.orchestration import cluster

    preset = QUICK if args.quick else FULL
    steps = args.steps or preset["steps"]
    ks = args.ks or preset["ks"]
    out_json = Path(args.out) if args.out else Path("runs/bench/async.json")
    run_root = Path(args.run_dir) if args.run_dir else out_json.parent / f"{out_json.stem}-runs"
    base = [*preset["set"], f"rl.steps={steps}", *(o for o in FRESH if in_schema(o)), *args.set]
    if not args.sft:
        base.append("stages=[rl]")
    colocated = preset["colocated"] if args.colocated is None else args.colocated
    runs = [("disaggregated", k) for k in ks] + [("colocated", k) for k in colocated]
    configs = {(layout, k): default_config([*base, f"async.max_off_policy_steps={k}",
                                            f"cluster.colocate={str(layout == 'colocated').lower()}",
                                            f"run.dir={run_root / (layout[:5] + f'-k{k}')}"]) for layout, k in runs}
    c0 = configs[runs[0]]
    report = Report("async", args.quick, params={
        "ks": ks, "colocated_ks": colocated, "steps": steps, "repeats": args.repeats, "stages": c0.stages, "overrides": base,
        "rl_batch_size": c0.rl.batch_size, "trainer_ranks": c0.trainer.num_ranks,
        "rollout_actors": c0.rollout.num_actors, "model_layers": c0.model.num_layers, "probe": not args.no_probe,
        "run_root": str(run_root)})
    report.columns = [Column("layout", "layout"), Column("k", "k"), Column("rep", "rep"), Column("steps", "steps"),
                      Column("wall_s", "RL wall s", "{:.2f}"), Column("s_per_step", "s/step", "{:.3f}"),
                      Column("steady_s_per_step", "s/step 2+", "{:.3f}"), Column("speedup", "speedup", "{:.2f}"),
                      Column("train_s", "train s", "{:.2f}"), Column("sync_s", "sync s", "{:.2f}"),
                      Column("trainer_idle", "trainer idle", "{:.2f}"),
                      Column("rollout_idle", "rollout idle", "{:.2f}"), Column("lag_mean", "lag", "{:.2f}"),
                      Column("tokens_per_s", "tokens/s", "{:.0f}"), Column("run_total_s", "run total s", "{:.1f}")]
    cluster.connect(c0.cluster, benchmarks=True)  # one Ray cluster for every run
    for rep in range(args.repeats):  # k = 0, 1, 2, 0, 1, 2, ...: load drift hits every k alike
        for (layout, k), c in configs.items():
            print(f"--- {layout}, async.max_off_policy_steps={k}: {steps} RL steps (repeat {rep + 1}/{args.repeats})",
                  flush=True)
            report.rows.append({**measure_once(c, not args.no_probe, report.notes), "layout": layout, "rep": rep})
    walls = {run: median([r["wall_s"] for r in report.rows if (r["layout"], r["k"]) == run]) for run in runs}
    steady = {run: median([r["steady_s_per_step"] for r in report.rows if (r["layout"], r["k"]) == run])
              for run in runs}
    for row in report.rows:
        row["speedup"] = ratio(walls[runs[0]], row["wall_s"])
    for run in runs[1:]:
        name = f"k={run[1]}" if run[0] == "disaggregated" else f"colocated k={run[1]}"
        report.ratios[f"speedup {name} vs k={ks[0]} (RL wall)"] = ratio(walls[runs[0]], walls[run])
        report.ratios[f"speedup {name} vs k={ks[0]} (steps 2+)"] = ratio(steady[runs[0]], steady[run])
    report.notes += [
        ("RL wall: sum of step_seconds of the RL loop (start-up and evaluations excluded; 'run total s' has them); "
        "s/step 2+ leaves out the first step, which waits for the first batch at every k."),
        ("trainer idle = 1 - (train_seconds + sync_seconds) / wall, rank 0; rollout idle = 1 - (time with a group "
        "in flight outside weight loads) / wall, from the probe."),
        f"speedups use the median over {args.repeats} repeat(s) per run; the runs alternate on a shared machine.",
    ]
    return report


def measure_once(c: Config, probe: bool, notes: list[str]) -> dict[str, Any]:
    for attempt in (1, 2):
        shutil.rmtree(c.run.dir, ignore_errors=True)  # metrics.jsonl appends; a checkpoint would resume
        try:
            return measure(c, probe)
        except Exception as e:  # a port picked free can be taken by another process before it is bound
            if attempt == 2 or "EADDRINUSE" not in str(e):
                raise
            print(f"run failed ({type(e).__name__}: address in use); once more", flush=True)
            notes.append(f"k={c.async_.max_off_policy_steps}: a first attempt hit EADDRINUSE and was rerun")
    raise AssertionError("unreachable")
