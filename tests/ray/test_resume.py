"""Exact resume: the driver is SIGKILLed mid-RL and resumed from its newest intact checkpoint; the steps
after the resume train on the same prompts, at the same learning rates, from the same weights (bit for bit)
as an uninterrupted run of the same seed, and SFT is not run again. The newest checkpoint has half of a
DCP shard cut off first (a disk that filled, a copy that broke): the resume says so in one line, sets it
aside (kept as `.damaged`) and goes on from the one before it. A LoRA run SIGTERMed mid-RL (a preemption)
checkpoints where it is, exits 0, and resumes from that adapter checkpoint.

With `async.max_off_policy_steps=0` every batch is the next G tickets, each ticket names its prompt
and sampling seed, and the checkpoint holds every RNG, the scheduler and the lowest ticket not
trained on, so nothing about the prompt stream depends on when the driver died.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from rlray.orchestration.controller import run
from tests.ray.conftest import BASE, tiny_config

STEPS = 8
OVERRIDES = ["sft.max_steps=2", f"rl.steps={STEPS}", "async.max_off_policy_steps=0", "checkpoint.every=1",
             "checkpoint.keep=20", "checkpoint.export_hf=true"]


def records(run_dir: Path, stage: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    out = []
    for line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # the line the SIGKILL cut
            continue
        if r["stage"] == stage:
            out.append(r)
    return out


def digests(run_dir: Path) -> dict[int, str]:
    """Weights sha of each committed RL checkpoint, by step."""
    metas = [json.loads(p.read_text()) for p in (run_dir / "checkpoints").glob("ckpt_rl_*/meta.json")]
    return {m["step"]: m["weights"] for m in metas}


def driver_at_rl_step(run_dir: Path, step: int, *extra: str) -> subprocess.Popen:
    """`python -m rlray.launch` on the session's Ray cluster, returned once RL step `step` is logged."""
    cmd = [sys.executable, "-m", "rlray.launch", f"run.dir={run_dir}", f"cluster.address={gcs_address()}",
           *BASE, *OVERRIDES, *extra]
    log = (run_dir.parent / "driver.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir.parent)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline and len(records(run_dir, "rl")) <= step:
        time.sleep(0.2)
    tail = (run_dir.parent / "driver.log").read_text()[-3000:]
    assert proc.poll() is None and len(records(run_dir, "rl")) > step, f"the driver did not reach RL step {step}:\n{tail}"
    return proc


def kill_driver_after_rl_step(run_dir: Path, step: int, *extra: str) -> None:
    proc = driver_at_rl_step(run_dir, step, *extra)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def gcs_address() -> str:
    return ray.get_runtime_context().gcs_address


def truncate_newest_shard(run_dir: Path) -> tuple[Path, int]:
    """Cut the newest committed checkpoint's rank-1 DCP shard in half; (its folder, its step)."""
    newest = max(digests(run_dir))
    folder = run_dir / "checkpoints" / f"ckpt_rl_{newest:08d}"
    shard = folder / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    return folder, newest


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """An uninterrupted run of OVERRIDES, to completion: (its run.dir, its summary). Tests copy it before changing it."""
    c = tiny_config(tmp_path_factory.mktemp("reference"), *OVERRIDES)
    return Path(c.run.dir), run(c)


def test_sigkilled_driver_resumes_exactly(reference, tmp_path, capsys) -> None:
    ref_rl, ref_weights = records(reference[0], "rl"), digests(reference[0])

    killed_dir = tmp_path / "b" / "run"
    killed_dir.parent.mkdir()
    kill_driver_after_rl_step(killed_dir, 2)
    sft_before = records(killed_dir, "sft")
    saved = digests(killed_dir)
    damaged, newest = truncate_newest_shard(killed_dir)
    capsys.readouterr()
    resumed = tiny_config(tmp_path / "b", *OVERRIDES)
    summary = run(resumed)

    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith(f"checkpoint {damaged.name} is damaged")]
    assert len(line) == 1 and "__1_0.distcp has" in line[0] and f"set aside as {damaged.name}.damaged" in line[0], out
    assert (damaged.parent / f"{damaged.name}.damaged" / "meta.json").is_file()  # kept, beside its recommitted step
    assert summary["checkpoints_set_aside"] == 1
    rl = records(killed_dir, "rl")
    at = max(s for s in saved if s < newest)  # the intact checkpoint before the damaged one
    assert f"resuming from {killed_dir / 'checkpoints' / f'ckpt_rl_{at:08d}'}" in out
    assert at >= 1 and [r["step"] for r in rl][-(STEPS - at):] == list(range(at, STEPS))
    assert records(killed_dir, "sft") == sft_before, "SFT ran again after the resume"
    assert summary["resumed_weights"] == saved[at] == ref_weights[at]  # bit for bit, also the uninterrupted run's
    after = {r["step"]: r for r in rl[-(STEPS - at):]}
    for step in range(at, min(at + 5, STEPS)):
        ours, theirs = after[step], ref_rl[step]
        assert ours["prompts"] == theirs["prompts"], step
        assert ours["lr"] == theirs["lr"]
        assert abs(ours["reward_mean"] - theirs["reward_mean"]) < 0.2, (ours["reward_mean"], theirs["reward_mean"])
    assert digests(killed_dir)[STEPS] and (killed_dir / "hf" / "config.json").exists()


def test_a_sigterm_preempted_lora_run_resumes_from_its_adapter_checkpoint(ray_cluster, tmp_path) -> None:
    """SIGTERM (what Slurm and `ray job stop` send) mid-RL: the driver commits a checkpoint at the step it is
    at, exits 0 with one line within checkpoint.preempt_grace_s, and the same run.dir resumes from there.
    With LoRA: SFT trains the base, RL the adapters; the checkpoints hold the adapters, and the base SFT
    trained, kept once beside them, comes back under them bit for bit."""
    run_dir, steps = tmp_path / "run", 6
    run_dir.parent.mkdir(exist_ok=True)
    extra = ("trainer.lora.rank=8", f"rl.steps={steps}", "checkpoint.every=100")
    proc = driver_at_rl_step(run_dir, 2, *extra, "checkpoint.preempt_grace_s=90")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0 and time.monotonic() - t0 < 90
    out = (run_dir.parent / "driver.log").read_text()
    line = [x for x in out.splitlines() if x.startswith("preempted (SIGTERM) after RL step ")]
    assert len(line) == 1 and f"run again with run.dir={run_dir} to resume" in line[0], out[-3000:]
    at = int(line[0].split("after RL step ")[1].split(":")[0])
    assert at >= 3 and f"checkpoint at RL step {at};" in line[0]
    saved, sft_before = digests(run_dir), records(run_dir, "sft")
    assert sorted(saved) == [0, at]  # RL start, and the preemption's (checkpoint.every=100)

    summary = run(tiny_config(tmp_path, *OVERRIDES, *extra))
    assert summary["resumed_weights"] == saved[at]
    assert records(run_dir, "sft") == sft_before, "SFT ran again after the resume"
    assert [r["step"] for r in records(run_dir, "rl")][-(steps - at):] == list(range(at, steps))
    ckpt = run_dir / "checkpoints" / f"ckpt_rl_{steps:08d}"
    assert json.loads((ckpt / "base.json").read_text()) == {"base": "../lora_base"}
    rl = records(run_dir, "rl")
    assert max(r["sync_mb"] for r in rl if "sync_mb" in r) < 0.25 * max(r["sync_mb"] for r in sft_before
                                                                       if "sync_mb" in r)
    assert (run_dir / "hf" / "adapter" / "adapter_config.json").exists() and (run_dir / "hf" / "base").is_dir()


def test_a_finished_run_resumed_does_only_what_is_missing(reference, tmp_path, capsys) -> None:
    """The same command again on a finished run folder (a Slurm requeue, a user re-exporting): one line says it has
    finished, from disk, and nothing starts (no Ray actor, no wandb run, summary and metrics untouched). Stopped
    after RL's last checkpoint, before its export and final evaluation: the rerun starts the actors, runs no RL
    loop (nothing waits out a timeout, no actor is replaced) and writes only the export and the evaluation.
    The finished run is a copy of the reference run."""
    first_dir, first = reference
    c = tiny_config(tmp_path, *OVERRIDES)
    run_dir = Path(c.run.dir)
    shutil.copytree(first_dir, run_dir)
    summary, metrics = (run_dir / "summary.json").read_text(), (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    again = run(c)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"run {run_dir} has finished already: RL step {STEPS} of "
                                               f"rl.steps={STEPS} checkpointed (ckpt_rl_{STEPS:08d}), exported to "), out
    assert again["finished_already"] and again["rl_end_reward"] == first["rl_end_reward"]
    assert (run_dir / "summary.json").read_text() == summary and (run_dir / "metrics.jsonl").read_text() == metrics

    # stopped between its last checkpoint and its export: the export and the evaluation are what is left
    shutil.rmtree(run_dir / "hf")
    (run_dir / "summary.json").write_text(json.dumps({k: v for k, v in first.items() if k != "rl_end_reward"}))
    resumed = run(tiny_config(tmp_path, *OVERRIDES))
    out = capsys.readouterr().out
    assert f"resuming from {run_dir / 'checkpoints' / f'ckpt_rl_{STEPS:08d}'}: stage rl, step {STEPS}" in out
    assert "was lost" not in out and "replacing" not in out, out  # a loop waited out its timeout, then was replaced
    assert "rl_end_reward" in resumed and (run_dir / "hf" / "config.json").is_file()
    assert [r["step"] for r in records(run_dir, "rl")] == list(range(STEPS))  # no RL step ran again
    assert sorted(digests(run_dir)) == list(range(STEPS + 1))
