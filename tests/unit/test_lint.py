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
