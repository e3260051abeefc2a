"""The package and its tests pass ruff with the project's settings (pyproject.toml), and pytest sees every test file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "rlray", "tests"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_test_file_is_collected() -> None:
    """pytest skips folders it considers build output (by default any named "dist") without a word."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected = {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert files == collected, sorted(files ^ collected)


def test_the_readme_names_files_that_exist() -> None:
    """The README's layout and its "where to add" paragraph name files that exist, and the package's
    top level keeps to the layout's entries."""
    import re

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1]
    named = set(re.findall(r"`((?:rlray|tests)/[\w/]+(?:\.py|/))`", section))
    assert {"rlray/algo/loss.py", "rlray/envs/builtin/", "rlray/models/tiny.py", "rlray/models/catalog.py"} <= named
    assert all((ROOT / f).exists() for f in named), sorted(f for f in named if not (ROOT / f).exists())
    tree = section.split("```", 2)[1]
    entries = {line.split()[0].rstrip("/").removesuffix(".py") for line in tree.splitlines()[2:]
               if line.startswith("  ") and not line.startswith("    ")}
    actual = {p.stem for p in (ROOT / "rlray").iterdir() if p.name not in ("__pycache__", "__init__.py")}
    assert entries == actual, sorted(entries ^ actual)
    assert len(actual) + 1 <= 14  # with __init__.py
