"""`python -m rlray.bench <name> --quick` runs, prints its table and ratios, and writes its JSON.

Each benchmark runs in its own process, as a user runs it; assertions are on the report's
shape and on numbers being positive, never on timings. The runs marked `bench_engines` start vLLM
engines (weight-sync, rollout, async, mismatch: ~6 minutes): `make test` leaves them out, `make bench-smoke`
runs them (the engine tests check the paths they take: the weight sync, generation, routing replay).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def bench(name: str, tmp_path: Path, *extra: str, timeout: float = 600.0) -> tuple[str, dict[str, Any]]:
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "rlray.bench", name, "--quick", "--out", str(out), *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: a timeout kills vLLM's children too
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout}s\n{stdout[-4000:]}\n{stderr[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    assert f"== rlray.bench {name} (quick) ==" in stdout
    assert "ratios:" in stdout
    report = json.loads(out.read_text())
    assert report["name"] == name and report["quick"] is True
    assert report["rows"] and report["ratios"] and report["seconds"] > 0
    assert report["machine"]["cpus"] >= 1 and report["machine"]["torch"]
    for key, value in report["ratios"].items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    return stdout, report


def positive(rows: list[dict[str, Any]], *keys: str) -> None:
    for row in rows:
        for key in keys:
            assert isinstance(row[key], (int, float)) and row[key] > 0, (key, row)


@pytest.mark.bench
def test_gpu_step_tiny_runs_on_cpu(tmp_path: Path) -> None:
    _, report = bench("gpu-step", tmp_path, "--cache", str(tmp_path / "models"))
    assert [r["model"] for r in report["rows"]] == ["dense-tiny", "moe-tiny"]
    positive(report["rows"], "params_b", "active_b", "tokens", "seconds", "tokens_per_s", "tflops", "vs_matmul")
    moe = report["rows"][1]
    assert moe["active_b"] < moe["params_b"]
    assert report["params"]["matmul_tflops"] > 0


@pytest.mark.bench
def test_gpu_smoke_checks_run_on_cpu(tmp_path: Path) -> None:
    """`gpu-smoke --cpu` runs every check the CPU can (gloo, fp32, tiny models); the CUDA-only ones say so."""
    stdout, report = bench("gpu-smoke", tmp_path, "--cpu", "--cache", str(tmp_path / "models"))
    results = {(r["check"], r["model"]): r["result"] for r in report["rows"]}
    skipped = {k for k, v in results.items() if v == "skipped"}
    assert skipped == {("side-stream gather", "dense-tiny"), ("side-stream gather", "moe-tiny"),
                       ("optimizer offload", "dense-tiny"), ("optimizer offload", "moe-tiny"),
                       ("two ranks, one GPU: trainer", "-"), ("CUDA IPC handover", "-"), ("ipc payload", "-"),
                       ("m2n NCCL self-exchange", "-"), ("m2n NCCL deadline and abort", "-"),
                       ("m2n staging peak (one MoE layer)", "-")}, results
    assert all(v == "ok" for k, v in results.items() if k not in skipped), results
    assert {c for c, _ in results} == {"setup", "logprobs vs transformers fp32", "train step", "DCP save and load",
                                       "DCP background save", "side-stream gather", "optimizer offload", "two ranks, one GPU: config",
                                       "two ranks, one GPU: trainer", "CUDA IPC handover", "ipc payload",
                                       "m2n NCCL self-exchange", "m2n NCCL deadline and abort",
                                       "m2n staging peak (one MoE layer)"}
    assert report["failed"] == [] and "11 ok, 0 failed, 10 skipped" in stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA: the smoke would run")
def test_gpu_smoke_without_cuda_exits_1_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "rlray.bench", "gpu-smoke"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    from rlray.bench.gpu_smoke import NO_CUDA

    assert proc.stderr.strip().splitlines() == [NO_CUDA]
    assert NO_CUDA.startswith("gpu-smoke: no CUDA device here")


@pytest.mark.bench
@pytest.mark.dist
def test_trainer_quick(tmp_path: Path) -> None:
    stdout, report = bench("trainer", tmp_path)
    paths = {r["path"] for r in report["rows"]}
    assert paths == {"rlray TrainerActor.train_step", "bare FSDP2 loop", "agentic batch, packed",
                     "agentic batch, padded", "rlray train_step, LoRA r8"}
    positive(report["rows"], "params_m", "tokens_per_step", "steps", "step_seconds", "tokens_per_s")
    assert "rlray / bare tokens/s" in stdout and "packed / padded tokens/s" in stdout
    state = {r["path"]: r["state_mb"] for r in report["rows"] if r["state_mb"]}
    # the frozen base has no gradient or AdamW moments: about a quarter of the full model's state
    assert state["rlray train_step, LoRA r8"] < 0.5 * state["rlray TrainerActor.train_step"]
    assert "lora / rlray tokens/s" in stdout
    layouts = {r["path"].split(", ")[-1]: r for r in report["rows"] if r["path"].startswith("agentic")}
    assert layouts["packed"]["tokens_per_step"] == layouts["padded"]["tokens_per_step"]  # the same sequences
    assert layouts["packed"]["padding_frac"] < 0.05 < layouts["padded"]["padding_frac"]


@pytest.mark.bench
@pytest.mark.ray
@pytest.mark.bench_engines
def test_weight_sync_quick(tmp_path: Path) -> None:
    """The gloo sizes and the end-to-end rows into vLLM; the LoRA and colocated rows start two more engines
    and are left out here (tests/engine/test_lora.py and test_colocated.py check those paths)."""
    stdout, report = bench("weight-sync", tmp_path, "--lora-rank", "0", "--no-colocated")
    rows = report["rows"]
    positive(rows, "mb", "seconds", "gb_per_s")
    for size in ("10MB",):
        methods = {(r["path"], r["method"]) for r in rows if r["size"] == size}
        assert {("sender", "memcpy"), ("gloo 2 actors", "bucketed"), ("gloo 2 actors", "per-tensor"),
                ("ray object store", "ray.put/get")} <= methods
        assert {r["bucket_mb"] for r in rows if r["size"] == size and r["method"] == "bucketed"} == {16, "1 tensor"}
    assert all(0 < r["vs_memcpy"] for r in rows)
    assert "bucketed(16MB) / per-tensor" in stdout and "x memcpy" in stdout
    e2e, m2n = report["sections"]
    paths = {r["path"]: r for r in m2n["rows"]}  # 2 trainer ranks into one bf16 TP 2 engine, each path
    assert set(paths) == {"broadcast", "m2n"} and {r["trainers"] for r in m2n["rows"]} == {2}
    positive(m2n["rows"], "seconds", "mb_busiest", "mb_worker", "raw_s", "vs_raw")  # beside the raw collectives
    assert paths["m2n"]["mb_busiest"] < 0.6 * paths["broadcast"]["mb_busiest"]  # each rank sends its own half
    assert paths["m2n"]["mb_worker"] < 0.6 * paths["broadcast"]["mb_worker"]  # each TP worker gets what it reads
    by = {(r["engine"], r["wire"], r["mode"]): r for r in e2e["rows"]}
    assert set(by) == {("raw gloo", "float32", "broadcast only"), ("raw gloo", "bfloat16", "broadcast only"),
                       ("bf16 TP1", "bfloat16", "dense"), ("bf16 TP1", "bfloat16", "delta lr=0.0001"),
                       ("bf16 TP1", "float32", "dense")}
    positive(e2e["rows"], "mb_sent", "seconds", "gb_per_s", "vs_raw")
    bf16, fp32 = by[("bf16 TP1", "bfloat16", "dense")], by[("bf16 TP1", "float32", "dense")]
    assert bf16["mb_sent"] == fp32["mb_sent"] / 2 == by[("raw gloo", "float32", "broadcast only")]["mb_sent"] / 2
    delta = by[("bf16 TP1", "bfloat16", "delta lr=0.0001")]
    assert 0 < delta["changed_frac"] <= 1 and delta["mb_sent"] <= bf16["mb_sent"]
    assert all(r["logprob_diff"] < 0.05 for r in e2e["rows"] if r["engine"] != "raw gloo")  # bf16 rounding only
    assert "10MB bf16 TP1 bfloat16 wire: end to end / raw collective" in report["ratios"]
    assert "10MB bf16 TP1 delta lr=0.0001: delta / dense bytes" in report["ratios"]
    assert "-- end to end into vLLM (10MB model, 16 MB buckets)" in stdout


@pytest.mark.bench
@pytest.mark.ray
@pytest.mark.bench_engines
def test_rollout_quick(tmp_path: Path) -> None:
    _, report = bench("rollout", tmp_path)
    paths = {r["path"] for r in report["rows"]}
    assert paths == {"vllm LLM.generate", "rlray Engine.generate", "rlray RolloutActor.run"}
    positive(report["rows"], "passes", "completions", "tokens", "seconds", "tokens_per_s")


@pytest.mark.bench
@pytest.mark.ray
@pytest.mark.bench_engines
def test_async_quick(tmp_path: Path) -> None:
    """Disaggregated k=0 and k=2; the colocated layout's run is left out here (its own test:
    tests/ray/test_colocated.py)."""
    _, report = bench("async", tmp_path, "--run-dir", str(tmp_path / "runs"), "--colocated", timeout=900.0)
    rows = report["rows"]
    assert [(r["layout"], r["k"]) for r in rows] == [("disaggregated", 0), ("disaggregated", 2)]
    positive(rows, "steps", "wall_s", "s_per_step", "train_s", "sync_s", "tokens_per_s", "speedup", "window_s")
    for r in rows:
        assert 0.0 <= r["trainer_idle"] <= 1.0 and 0.0 <= r["rollout_idle"] <= 1.0
        assert r["steps"] == report["params"]["steps"]
    assert rows[0]["lag_mean"] == 0.0
    assert rows[0]["speedup"] == 1.0


@pytest.mark.bench
@pytest.mark.dist
def test_memory_quick(tmp_path: Path) -> None:
    """The MoE model only: the dense one is the same measurement without EP (`rlray.bench memory --quick` runs both)."""
    stdout, report = bench("memory", tmp_path, "--models", "tiny-moe")
    rows = report["rows"]
    assert [(r["model"], r["ranks"]) for r in rows] == [("tiny-moe", "full load"), ("tiny-moe", 1), ("tiny-moe", 2)]
    positive([r for r in rows if r["ranks"] != "full load"], "full_gb", "params_gb", "load_gb", "step_gb")
    two = rows[2]  # half the parameters each, experts included (tiny-moe runs ep=2)
    assert two["params_gb"] <= 0.6 * two["full_gb"] and two["ep"] == 2
    assert "tiny-moe params/rank / full, 2 ranks" in stdout


@pytest.mark.bench
@pytest.mark.dist
def test_export_quick(tmp_path: Path) -> None:
    stdout, report = bench("export", tmp_path)
    rows = report["rows"]
    assert [(r["model"], r["ranks"], r["rank"]) for r in rows] == [("tiny-moe", 2, 0), ("tiny-moe", 2, 1)]
    positive(rows, "full_fp32", "layer_fp32", "params", "new_s", "old_s", "old_peak")
    assert "tiny-moe 2 ranks: gathered peak / full (rank 0)" in stdout


@pytest.mark.bench
@pytest.mark.dist
def test_checkpoint_quick(tmp_path: Path) -> None:
    stdout, report = bench("checkpoint", tmp_path)
    rows = report["rows"]
    assert [r["save"] for r in rows] == ["sync", "background", "background, no step", "staging copy alone",
                                         "weight digest alone"]
    positive(rows[:2], "blocked", "step", "wait", "warmup_blocked")
    positive(rows[2:], "blocked")
    assert "tiny background / sync: seconds a save blocks" in stdout


@pytest.mark.bench_engines
def test_mismatch_quick_replay_lowers_the_moe_mismatch(tmp_path: Path) -> None:
    """The mismatch gate in bf16: with the engine's experts replayed the Qwen3-MoE's KL(engine || trainer)
    falls (the benchmark exits 1 otherwise), over the same rollouts."""
    _, report = bench("mismatch", tmp_path, "--models", "qwen3_moe")
    off, on = report["rows"]
    assert (off["replay"], on["replay"]) == ("off", "on") and off["tokens"] == on["tokens"] > 0
    assert 0 < on["mismatch_kl"] < off["mismatch_kl"] and 0 < off["router_agreement"] <= 1


@pytest.mark.bench
@pytest.mark.ray
@pytest.mark.bench_engines
def test_weight_fit_quick(tmp_path: Path) -> None:
    """Two fit twins and one check twin, each synced by both paths: every row has its time-model terms, a measured
    and a predicted time; the fitted constants are in the JSON, each path's check error among the ratios."""
    stdout, report = bench("weight-fit", tmp_path)
    rows = report["rows"]
    assert {(r["set"], r["path"]) for r in rows} == {(s, p) for s in ("fit", "check") for p in ("broadcast", "m2n")}
    assert len(rows) == 6
    positive(rows, "fit_messages", "fit_bytes", "fit_tensors", "seconds", "predicted", "raw_s")
    assert set(report["params"]["costs"]) == {"broadcast", "m2n"}
    assert all(min(c.values()) >= 0 for c in report["params"]["costs"].values())
    assert "m2n: median |predicted / measured - 1| on the check twins" in stdout


@pytest.mark.bench
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make test installs it as root)")
def test_sandbox_quick(tmp_path: Path) -> None:
    stdout, report = bench("sandbox", tmp_path)
    rows = {(r["what"], r["runtime"]): r for r in report["rows"]}
    assert set(rows) >= {(w, rt) for w in ("start", "teardown", "command (true)", "HTTP request to the host")
                         for rt in ("sandbox", "subprocess")}
    positive([rows["command (true)", "sandbox"], rows["HTTP request to the host", "sandbox"]], "ms")
    positive([rows["2 sandboxes at once, each a command", "sandbox"]], "ms", "per_s", "per_core")
    assert "a command, sandbox / subprocess" in stdout
