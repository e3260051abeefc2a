"""Benchmark smoke tests: each `python -m rlray.bench <name> --quick` in a subprocess.

They assert the table and the JSON, never timings. `-m "not bench"` leaves them out.
"""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "bench: runs a benchmark's --quick size in a subprocess")
