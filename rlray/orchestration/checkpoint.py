"""Save and resume of a whole run, atomically.

Contract: a checkpoint is a folder `<root>/ckpt_<stage>_<NNNNNNNN>` holding the trainer's
DCP shards (model and optimizer, written by every rank) and `meta.json` (stage,
step, policy version, buffer and controller state). It is written under a
`.tmp` name and renamed only once complete, so `latest(root)` never returns a
half-written checkpoint, whatever was killed when. `prune(root, keep)` removes all
but the newest `keep`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

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
    found = [p for p in root.glob(f"{PREFIX}*") if p.suffix != ".tmp" and (p / "meta.json").exists()]
    return sorted(found, key=lambda p: json.loads((p / "meta.json").read_text())["saved_at"])


def latest(root: Path) -> Path | None:
    done = complete(root)
    return done[-1] if done else None


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / "meta.json").read_text())


def prune(root: Path, keep: int) -> None:
    for old in complete(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(f"{PREFIX}*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
