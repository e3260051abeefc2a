"""checkpoint: how long a checkpoint holds up training, written synchronously against in the background.

`--ranks` gloo processes (torch.multiprocessing, no Ray, one torch thread per rank as Ray gives a
trainer actor) build rlray's `TrainerActor` for the default recipe's tiny model and for a twin of
~200 MB of fp32 weights, take a train step (so AdamW's moments exist), then alternate, round by
round: a synchronous save (`save(dir)`: DCP writes before it returns), a background one
(`save(dir, background=True)`: DCP's async_save over the saver's own gloo group), each followed by a
train step, and a background one waited for at once (the write alone, nothing beside it). Per save,
rank 0 times (between barriers) what blocks the caller (`save` itself: the state dict, the copy or the
write, the RNG states, the weight digest), the train step that follows (which a background write runs
beside), and the wait in `finish_save` (the rest of the write, then the CRC32s). Beside them, the
staging copy alone: DCP's `DefaultStager` (as the saver holds it, buffers reused) copying the same
state dict; the weight digest alone; and a train step with no save. The first save of each kind (the
gloo group, the staging buffers) is a warm-up, reported apart. Medians over `--rounds`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rlray.algo.loss import algo_config
from rlray.bench.common import Column, Report, free_port, median, ratio
from rlray.config import ModelConfig, TrainerConfig

MODELS: dict[str, dict[str, int]] = {
    "tiny": {},  # the default recipe's model (~1M parameters)
    # ~52M parameters, ~210 MB of fp32 weights (AdamW's two moments: ~630 MB of state in all)
    "twin-200mb": {"hidden_size": 768, "num_layers": 6, "num_heads": 12, "num_kv_heads": 4, "head_dim": 64,
                   "intermediate_size": 3072},
}
QUICK = {"models": ["tiny"], "rounds": 2, "batch": 16}
FULL = {"models": ["tiny", "twin-200mb"], "rounds": 5, "batch": 16}
MODES = ("sync", "background", "background, no step")  # the last: finish_save at once (the write alone)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), help=f"model presets (full: {FULL['models']})")
    p.add_argument("--ranks", type=int, default=2, help="FSDP2 ranks (gloo processes); the default recipe has 2")
    p.add_argument("--rounds", type=int, help="saves of each kind timed, after one warm-up each (full: 5)")
    p.add_argument("--batch", type=int, help="completions per train step (default 16)")
    p.add_argument("--dir", help="where the checkpoints are written (default: a temporary folder)")


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _staging_copy(actor: Any) -> float:
    """DCP's DefaultStager copying this rank's state dict into buffers it already holds (as the saver's does)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from rlray.actors import state

    stager = DefaultStager(StagingOptions(False, False, False, False))
    stager.stage(state._state(actor.learner))  # allocates the buffers
    t0 = time.perf_counter()
    stager.stage(state._state(actor.learner))
    seconds = time.perf_counter() - t0
    stager.close()
    return seconds


def _worker(rank: int, world: int, port: int, model_name: str, opts: dict[str, Any], root: str, out: str) -> None:
    import torch

    from rlray.actors.trainer import TrainerActor
    from rlray.bench.trainer_step import rl_batch, state_bytes

    torch.set_num_threads(1)
    actor = TrainerActor(rank, world, f"127.0.0.1:{port}", ModelConfig(**MODELS[model_name]),
                         TrainerConfig(num_ranks=world), algo_config(aggregation="token"), "gloo", 1.0)
    actor.setup()
    mbs = rl_batch(world, opts["batch"], pad_id=0)[rank]
    actor.train_step(mbs)
    times: dict[str, list[float]] = {f"{m}_{k}": [] for m in (*MODES, "warmup") for k in ("blocked", "step", "wait")}
    times.update(step_alone=[], copy=[], digest=[])
    for r in range(opts["rounds"] + 1):
        for mode in MODES[:: 1 if r % 2 == 0 else -1]:
            path = os.path.join(root, f"save{MODES.index(mode)}_{r}")
            key = mode if r else "warmup"
            times[f"{key}_blocked"].append(_timed(functools.partial(actor.save, path, background=mode != "sync")))
            if mode != MODES[2]:
                times[f"{key}_step"].append(_timed(lambda: actor.train_step(mbs)))
            times[f"{key}_wait"].append(_timed(actor.finish_save))
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        times["step_alone"].append(_timed(lambda: actor.train_step(mbs)))
        times["copy"].append(_staging_copy(actor))
        times["digest"].append(_timed(actor.weights_digest))
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "state_bytes": state_bytes(actor.learner),
                                         "params": sum(p.numel() for p in actor.model.parameters())}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)  # FSDP2 on gloo can abort in interpreter teardown after all work is done


def measure(model_name: str, world: int, opts: dict[str, Any], where: str | None) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from rlray.models.tiny import model_path

    model_path(ModelConfig(**MODELS[model_name]))  # the shared model files, built once before the ranks
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, free_port(), model_name, opts, tmp, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def run(args: argparse.Namespace) -> Report:
    preset = QUICK if args.quick else FULL
    opts = {"rounds": args.rounds or preset["rounds"], "batch": args.batch or preset["batch"]}
    models = args.models or preset["models"]
    report = Report("checkpoint", args.quick, params={"models": models, "ranks": args.ranks, **opts,
                                                       "statistic": "median over the rounds, rank 0, between barriers"})
    report.columns = [Column("model", "model"), Column("state_mb", "state MB/rank", "{:.0f}"),
                      Column("save", "save"), Column("blocked", "save blocks s", "{:.4f}"),
                      Column("step", "next step s", "{:.4f}"), Column("wait", "finish_save s", "{:.4f}"),
                      Column("warmup_blocked", "1st save blocks s", "{:.4f}")]
    for name in models:
        t0 = time.perf_counter()
        res = measure(name, args.ranks, opts, args.dir)
        print(f"  {name}: measured in {time.perf_counter() - t0:.1f}s", flush=True)
        t = {k: median(v) for k, v in res["times"].items()}
        state_mb = res["state_bytes"] / 1e6
        for i, mode in enumerate(MODES):
            report.rows.append({"model": name, "state_mb": state_mb, "save": mode, "blocked": t[f"{mode}_blocked"],
                                "step": t[f"{mode}_step"] or None, "wait": t[f"{mode}_wait"],
                                "warmup_blocked": res["times"]["warmup_blocked"][i],
                                "params_m": res["params"] / 1e6, "all": {k: res["times"][f"{mode}_{k}"]
                                                                         for k in ("blocked", "step", "wait")}})
        report.rows.append({"model": name, "state_mb": state_mb, "save": "staging copy alone", "blocked": t["copy"],
                            "step": t["step_alone"], "all": {"copy": res["times"]["copy"],
                                                             "step_alone": res["times"]["step_alone"]}})
        report.rows.append({"model": name, "state_mb": state_mb, "save": "weight digest alone", "blocked": t["digest"],
                            "all": {"digest": res["times"]["digest"]}})
        report.ratios[f"{name} background / sync: seconds a save blocks"] = ratio(t["background_blocked"],
                                                                                   t["sync_blocked"])
        report.ratios[f"{name} background save blocks / (staging copy + digest) alone"] = ratio(
            t["background_blocked"], t["copy"] + t["digest"])
        report.ratios[f"{name} step after a background save / step alone"] = ratio(t["background_step"],
                                                                                    t["step_alone"])
        report.ratios[f"{name} background / sync: save blocks + the next step"] = ratio(
            t["background_blocked"] + t["background_step"], t["sync_blocked"] + t["sync_step"])
    report.notes = [(f"{args.ranks} gloo ranks, one torch thread each; saves alternate sync/background round by round. "
                     "'save blocks': TrainerActor.save until it returns (state dict, DCP write or staging copy, RNG "
                     "states, weight digest); 'next step': the train step right after it (beside the background write); "
                     "'finish_save': what was left to wait for, then the CRC32s ('background, no step': the whole write). 'staging copy alone': DCP's "
                     "DefaultStager on the same state dict with its buffers held; its 'next step' is a step with no "
                     "save. 'weight digest alone': the sha256 every save returns (a collective). state MB/rank: parameter shards, gradients, AdamW moments. '1st save': the warm-up (the "
                     "background saver's gloo group and staging buffers are made then).")]
    return report
