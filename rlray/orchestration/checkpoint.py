"""Save and resume of a whole run, atomically.

Contract: a checkpoint is a folder `<root>/ckpt_<stage>_<NNNNNNNN>` holding the trainer's
DCP shards (model and optimizer, written by every rank) and `meta.json` (stage,
step, policy version, buffer and controller state). It is written under a
`.tmp` name and renamed only once complete, so `latest(root)` never returns a
half-written checkpoint, whatever was killed when. `prune(root, keep)` removes all
but the newest `keep` committed ones (and unfinished `.tmp` folders).
`meta.json` lists every file of the checkpoint with the rank that wrote it, its size and CRC32
(rlray.actors.state.checksums): a resume verifies them on the ranks before loading.
`set_aside(path)` renames a checkpoint found damaged to `<name>.damaged` (`.damaged2`, ... when
taken): never deleted, no longer committed (so `latest`, `complete` and `prune` skip it), and a
later commit of the same step gets the name back.
`finished(run_dir, stages, rl_steps, export_hf, lora)` reads a run folder before anything starts: the
one-line account of a run that has done everything its config asks (its newest checkpoint is RL's
last step, the export is there when asked for, summary.json holds the final evaluation), else None.
`exported(run_dir, lora)` says whether the HF export is there.
`Checkpoints(root, trainers, keep)` does this through a run's trainer ranks: `save(stage, step, meta)`
commits one (every rank's shards, then every rank's checksums); `newest()` is the newest committed
checkpoint whose files verify (each rank checks its own), `load(found)` loads it on every rank and
checks the weight digest. A checkpoint that fails verification, loading or the digest is set aside
with one console line and the next newest tried; with none intact left, a one-line RuntimeError.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from ray.exceptions import RayError

from rlray.actors.rollout import one_line
from rlray.orchestration.calls import get_all

PREFIX = "ckpt_"


def staging(root: Path, stage: str, step: int) -> Path:
    path = root / f"{PREFIX}{stage}_{step:08d}.tmp"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def commit(tmp: Path, meta: dict[str, Any], keep: int) -> Path:
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    final = tmp.with_suffix("")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    prune(tmp.parent, keep)
    return final


def complete(root: Path) -> list[Path]:
    """Committed checkpoints, oldest first (ordered by the time they were written)."""
    if not root.exists():
        return []
    found = [p for p in root.glob(f"{PREFIX}*") if not p.suffix and (p / "meta.json").exists()]
    return sorted(found, key=lambda p: json.loads((p / "meta.json").read_text())["saved_at"])


def latest(root: Path) -> Path | None:
    done = complete(root)
    return done[-1] if done else None


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / "meta.json").read_text())


def set_aside(path: Path) -> Path:
    n = 1
    while (target := path.with_name(f"{path.name}.damaged{n if n > 1 else ''}")).exists():
        n += 1
    path.rename(target)
    return target


def prune(root: Path, keep: int) -> None:
    for old in complete(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(f"{PREFIX}*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def exported(run_dir: Path, lora: bool) -> bool:
    return (run_dir / "hf" / ("adapter/adapter_config.json" if lora else "config.json")).is_file()


def finished(run_dir: Path, stages: list[str], rl_steps: int, export_hf: bool, lora: bool) -> str | None:
    path = latest(run_dir / "checkpoints")
    summary_file = run_dir / "summary.json"
    if path is None or "rl" not in stages or not summary_file.is_file():
        return None
    meta, summary = read_meta(path), json.loads(summary_file.read_text())
    ends = "rl_end_reward" in summary and ("eval" not in stages[stages.index("rl"):] or "eval_reward" in summary)
    if (meta["stage"], meta["step"]) != ("rl", rl_steps) or not ends or (export_hf and not exported(run_dir, lora)):
        return None
    export = f", exported to {run_dir / 'hf'}" if export_hf else ""
    return (f"run {run_dir} has finished already: RL step {rl_steps} of rl.steps={rl_steps} checkpointed ({path.name})"
            f"{export}, held-out reward after RL {summary['rl_end_reward']:.3f} (summary.json); nothing to do "
            "(raise rl.steps to train on, or give a new run.dir)")


class Checkpoints:
    def __init__(self, root: Path, trainers: list[Any], keep: int) -> None:
        self.root, self.trainers, self.keep = root, trainers, keep
        self.set_aside = 0  # damaged checkpoints found by this run

    def save(self, stage: str, step: int, meta: dict[str, Any]) -> Path:
        tmp = staging(self.root, stage, step)
        digest = get_all([t.save.remote(str(tmp)) for t in self.trainers])[0]
        files = {name: entry for part in get_all([t.checksums.remote(str(tmp)) for t in self.trainers])
                 for name, entry in part.items()}
        full = {"stage": stage, "step": step, **meta, "saved_at": time.time(), "weights": digest, "files": files}
        return commit(tmp, full, self.keep)

    def _damaged(self, path: Path, why: str) -> None:
        moved = set_aside(path)
        self.set_aside += 1
        print(f"checkpoint {path.name} is damaged: {why}; set aside as {moved.name} (kept), trying the one "
              "before it", flush=True)

    def newest(self) -> dict[str, Any] | None:
        while (path := latest(self.root)) is not None:
            meta = read_meta(path)
            problems = [p for part in get_all([t.verify.remote(str(path), meta.get("files", {}))
                                               for t in self.trainers]) for p in part]
            if not problems:
                return {**meta, "path": str(path)}
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            self._damaged(path, problems[0] + more)
        if self.set_aside:
            raise RuntimeError(f"no intact checkpoint is left in {self.root} ({self.set_aside} set aside as "
                               "*.damaged); resume from a copy, or start a new run.dir")
        return None

    def load(self, found: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """`found` (from `newest`) loaded on every rank, or the newest intact one before it; (its meta, digest)."""
        first = found["path"]
        while True:
            try:
                digest = get_all([t.load.remote(found["path"]) for t in self.trainers])[0]
                saved = found.get("weights", digest)
                why = None if digest == saved else f"the loaded weights (sha {digest}) are not the saved ones ({saved})"
            except RayError as e:
                why = f"loading failed ({one_line(getattr(e, 'cause', None) or e, 200)})"
            if why is None:
                if found["path"] != first:
                    print(f"resuming from {found['path']}: stage {found['stage']}, step {found['step']}", flush=True)
                return found, digest
            self._damaged(Path(found["path"]), why)
            before = self.newest()
            if before is None or before["stage"] != found["stage"]:
                raise RuntimeError(f"no intact {found['stage']} checkpoint is left in {self.root}; resume from a "
                                   "copy, or start a new run.dir")
            found = before
