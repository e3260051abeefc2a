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
`Checkpoints(root, trainers, keep, background, timeout_s)` does this through a run's trainer ranks:
`save(stage, step, meta)` takes one (every rank's shards, then every rank's checksums) and returns
its final path. What meta.json holds is taken at the save step: `meta` (copied), the weight digest,
the time. Synchronously (`background=False`) `save` commits before it returns; with `background`
(`checkpoint.async_save`) each rank's shards are written after its `save` returned (DCP's async_save,
rlray.actors.saver) and the checkpoint is pending until every rank's write has ended: `poll()` commits
it then (called between steps), `wait()` waits for it and commits it (the run's end, a preemption,
before an export). One save in flight: `save` first waits for and commits the one before. A write that
fails on any rank is never committed: its `.tmp` folder is removed and `wait` (or the `save`/`poll`
that found it) raises one line naming the checkpoint; committed checkpoints are untouched. `settle()`
(a failed run's end, `newest`) commits the pending one if every rank's write ends within `timeout_s`,
else drops it with one line. `newest()` is the newest committed
checkpoint whose files verify (each rank checks its own), `load(found)` loads it on every rank and
checks the weight digest. A checkpoint that fails verification, loading or the digest is set aside
with one console line and the next newest tried; with none intact left, a one-line RuntimeError.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from rlray.actors.rollout import one_line
from rlray.orchestration.calls import errors, get_all
from rlray.orchestration.cluster import CHECKPOINT

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


@dataclass
class Pending:
    """A checkpoint whose writes may still run: its `.tmp` folder, its meta.json as of the save step
    (without `files`), and every rank's `finish_save` (its checksums once its write ended)."""

    tmp: Path
    meta: dict[str, Any]
    finishes: list[Any]

    @property
    def name(self) -> str:
        return self.tmp.with_suffix("").name


class Checkpoints:
    def __init__(self, root: Path, trainers: list[Any], keep: int, background: bool = False,
                 timeout_s: float = 3600.0) -> None:
        self.root, self.trainers, self.keep = root, trainers, keep
        self.background, self.timeout_s = background, timeout_s
        self.set_aside = 0  # damaged checkpoints found by this run
        self.pending: Pending | None = None

    def save(self, stage: str, step: int, meta: dict[str, Any]) -> Path:
        self.wait()
        tmp = staging(self.root, stage, step)
        digest = get_all([t.save.remote(str(tmp), self.background) for t in self.trainers])[0]
        full = {"stage": stage, "step": step, **json.loads(json.dumps(meta)), "saved_at": time.time(),
                "weights": digest}
        finishes = [t.finish_save.options(concurrency_group=CHECKPOINT).remote() for t in self.trainers]
        self.pending = Pending(tmp, full, finishes)
        return tmp.with_suffix("") if self.background else self._commit()

    def poll(self) -> Path | None:
        """The pending checkpoint committed if every rank's write has ended (its path), else None."""
        p = self.pending
        if p is None or len(ray.wait(p.finishes, num_returns=len(p.finishes), timeout=0)[0]) < len(p.finishes):
            return None
        return self._commit()

    def wait(self) -> Path | None:
        """The pending checkpoint committed once every rank's write has ended (its path); None when none."""
        return None if self.pending is None else self._commit()

    def settle(self) -> None:
        p = self.pending
        if p is None:
            return
        if failed := errors(p.finishes, self.timeout_s):
            self.pending = None
            shutil.rmtree(p.tmp, ignore_errors=True)
            i = next((i for i, e in failed.items() if not isinstance(e, GetTimeoutError)), min(failed))  # the cause
            print(f"checkpoint {p.name} was not committed: trainer-{i}'s write did not end "
                  f"({one_line(getattr(failed[i], 'cause', None) or failed[i], 200)})", flush=True)
            return
        self._commit()

    def _commit(self) -> Path:
        p, self.pending = self.pending, None
        assert p is not None
        try:
            parts = get_all(p.finishes)
        except RayError as e:
            shutil.rmtree(p.tmp, ignore_errors=True)
            raise RuntimeError(f"checkpoint {p.name} was not committed: "
                               f"{one_line(getattr(e, 'cause', None) or e, 400)}") from e
        p.meta["files"] = {name: entry for part in parts for name, entry in part.items()}
        return commit(p.tmp, p.meta, self.keep)

    def _damaged(self, path: Path, why: str) -> None:
        moved = set_aside(path)
        self.set_aside += 1
        print(f"checkpoint {path.name} is damaged: {why}; set aside as {moved.name} (kept), trying the one "
              "before it", flush=True)

    def newest(self) -> dict[str, Any] | None:
        self.settle()
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
