"""Benchmarks: `python -m rlray.bench weight-sync|async|trainer|rollout|gpu-step [--quick] [--out FILE]`.

Contract: every benchmark measures the rlray path and its baseline side by side in one
run (absolute times on shared machines are noise; the ratios are the result), prints a
table with the measured numbers and ratios, and writes the same as JSON (default
`runs/bench/<name>.json`). `--quick` is the CI smoke size. Each module `rlray.bench.<x>`
exposes `add_arguments(parser)` and `run(args) -> Report`. See BENCHMARKS.md.
"""
