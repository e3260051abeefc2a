"""docker/slurm/rlray.sbatch on a real Slurm cluster: two Slurm nodes on this machine
(docker/slurm/local_cluster.sh: munged, slurmctld, three slurmd), a real `sbatch`.

The batch job starts a Ray head (node1, labelled pool=train) and a Ray worker (node2, labelled
pool=rollout) with srun and token auth, and `ray job submit`s the tiny recipe with the trainer
on node1 and the rollout actor on node2 (trainer.node_labels / rollout.node_labels). While it
runs, Prometheus (Debian's) scrapes the nodes listed in the config Ray wrote, so rlray's gauges
must reach it, and headless Chromium logs into the Ray dashboard with the token and reads the
actors and placement groups (tests/deploy/dashboard.py), leaving screenshots in the run folder. The
environment module comes from `env.python_path`: the rollout actor on node2 must import the
copy Ray's runtime_env shipped, not the driver's folder. Once the dashboard is read, mid-RL, the job
is preempted as Slurm does it (`scancel --signal=USR1 --batch`): the batch shell hands the signal to
the driver, which checkpoints and exits 0, and the job requeues itself; its second start resumes
from that checkpoint and finishes. Meanwhile, on node3, a batch job whose run has a bad override fails with the run's
one-line error. Needs root (slurmd runs jobs as their user); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy import dashboard

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "slurm" / "rlray.sbatch"
LOCAL_CLUSTER = ROOT / "docker" / "slurm" / "local_cluster.sh"
VENV = Path(sys.executable).parent.parent
TINY = ["logging.wandb=disabled", "model.num_layers=2", "sft.max_steps=2", "sft.eval_every=2", "rl.batch_size=32",
        "eval.num_examples=8", "checkpoint.every=0", "checkpoint.export_hf=false"]
ENV_MODULE = '''"""The reverse_text environment, recording which process on which Slurm node imported it from where."""
import json
import os

import rlray
from rlray.envs.builtin.reverse_text import load_environment as reverse_text


def load_environment(**kwargs):
    record = {{"file": __file__, "rlray": rlray.__file__, "node": os.environ.get("SLURMD_NODENAME"), "pid": os.getpid(),
              "bench": os.path.isdir(os.path.join(os.path.dirname(rlray.__file__), "bench"))}}
    with open({record!r}, "a") as f:
        f.write(json.dumps(record) + "\\n")
    return reverse_text(**kwargs)
'''

ACTORS = ("trainer-0", "trainer-1", "rollout-0", "buffer")
GROUPS = ("rlray-trainer", "rlray-rollout")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: slurmd runs each job as its user "
                                "(run the tests as root to start a real Slurm cluster)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_processes(marker: str) -> None:
    """Stop every process whose command line holds `marker` (this test's Ray nodes)."""
    import psutil

    procs = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    for p in procs:
        p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        p.kill()


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, str]]:
    state = tempfile.mkdtemp(prefix="rlray-slurm-", dir="/tmp")
    env = {**os.environ, "SLURM_CONF": f"{state}/slurm.conf"}
    try:
        out = subprocess.run([str(LOCAL_CLUSTER), "start", state, "3"], capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout + out.stderr
        yield env
    finally:
        subprocess.run([str(LOCAL_CLUSTER), "stop", state], capture_output=True, timeout=120)
        stop_processes(state)
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def bad_run(slurm: dict[str, str], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A batch job on node3 whose run has a bad override, submitted first so that it runs while
    the good one starts on node1 and node2."""
    work, temp_dir = tmp_path_factory.mktemp("bad_run"), tempfile.mkdtemp(prefix="rlray-sb-", dir="/tmp")
    job = sbatch(batch_env(slurm, work / "run", temp_dir), work / "out.txt", ["node3"], "rollout.temperature=-1")
    try:
        yield job, work / "out.txt"
    finally:
        if job.poll() is None:
            job.kill()
        stop_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def ray_args(temp_dir: str, labels: str, metrics_port: int) -> str:
    """Ports of its own for one Ray node (two share this host, and the test session's may be up)."""
    ports = " ".join(f"--{name}={free_port()}" for name in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port"))
    return (f"--metrics-export-port={metrics_port} {ports} --labels={labels} --object-store-memory={256 << 20} "
            f"--temp-dir={temp_dir}")


def batch_env(slurm: dict[str, str], run_dir: Path, temp_dir: str) -> dict[str, str]:
    """rlray.sbatch's environment; RLRAY_TEST_METRICS_PORT is the head's metrics endpoint."""
    metrics = free_port()
    env = {**slurm, "RECIPE": "tiny_moe", "RLRAY_DIR": str(ROOT), "RLRAY_VENV": str(VENV), "RUN_DIR": str(run_dir),
           "RAY_PORT": str(free_port()), "RAY_DASHBOARD_PORT": str(free_port()), "RAY_JOIN_TIMEOUT": "120",
           "RAY_AUTH_TOKEN": os.urandom(16).hex(), "RAY_metrics_report_interval_ms": "1000",
           "RAY_HEAD_ARGS": f"{ray_args(temp_dir, 'pool=train', metrics)} --ray-client-server-port={free_port()}",
           "RAY_WORKER_ARGS": ray_args(temp_dir, "pool=rollout", free_port()), "RLRAY_TEST_METRICS_PORT": str(metrics)}
    env.pop("RAY_ADDRESS", None)
    return env


GOOD_JOB = "rlray-good"
RL_STEPS = 24  # the job name of the run that is preempted and requeued


def sbatch(env: dict[str, str], out: Path, nodes: list[str], *overrides: str, name: str = "rlray-bad"
           ) -> subprocess.Popen[str]:
    cmd = ["sbatch", "--wait", f"--job-name={name}", f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}", "--cpus-per-task=2",
           "--gpus-per-node=0", f"--output={out}", str(SCRIPT), *overrides]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def slurm_errors(slurm: dict[str, str], lines: int = 30) -> str:
    """The Slurm daemons' error lines (which daemon refused what), for a failing job's message."""
    logs = sorted(Path(slurm["SLURM_CONF"]).parent.glob("log/slurm*.log"))
    found = [f"{p.name}: {line}" for p in logs for line in read(p).splitlines()
             if re.search(r"error|invalid|fatal", line, re.IGNORECASE)]
    return "\n-- Slurm daemons' errors --\n" + "\n".join(found[-lines:])


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def ensure_prometheus() -> None:
    """Debian's prometheus (`ray metrics launch-prometheus` would download one; there is no internet)."""
    if shutil.which("prometheus"):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]
    if subprocess.run(apt, env=env, capture_output=True, timeout=900).returncode != 0:  # stale package lists
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(apt, env=env, capture_output=True, timeout=900, check=True)


def start_prometheus(ray_temp: str, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Prometheus on the config the Ray head wrote (its nodes from Ray's service-discovery file),
    scraping every second instead of every 10 s so that a one-minute run leaves samples."""
    ray_conf = Path(ray_temp) / "session_latest" / "metrics" / "prometheus" / "prometheus.yml"
    conf = work / "prometheus.yml"
    conf.write_text(ray_conf.read_text().replace("scrape_interval: 10s", "scrape_interval: 1s"))
    address = f"127.0.0.1:{free_port()}"
    cmd = ["prometheus", f"--config.file={conf}", f"--storage.tsdb.path={work / 'tsdb'}",
           f"--web.listen-address={address}"]
    return subprocess.Popen(cmd, stdout=(work / "prometheus.log").open("wb"), stderr=subprocess.STDOUT), address


def last_values(address: str, metric: str) -> list[float]:
    """The last sample of each series of `metric` Prometheus holds (Ray prefixes it with ray_)."""
    query = urllib.parse.quote(f"last_over_time(ray_{metric}[30m])")
    with urllib.request.urlopen(f"http://{address}/api/v1/query?query={query}", timeout=10) as r:
        result = json.load(r)["data"]["result"]
    return [float(series["value"][1]) for series in result]


def watch(job: subprocess.Popen[str], out: Path, env: dict[str, str], run_dir: Path, temp_dir: str,
          work: Path, started: list[subprocess.Popen[bytes]]) -> tuple[dashboard.DashboardView | None, str | None]:
    """While the batch job runs: once its actors are up, Prometheus starts on Ray's config (into
    `started`) and Chromium reads the dashboard; returns the view and Prometheus' address."""
    view, address, deadline, preempted, released = None, None, time.monotonic() + 900, "", False
    url = f"http://127.0.0.1:{env['RAY_DASHBOARD_PORT']}"
    while job.poll() is None and time.monotonic() < deadline:
        if view is not None and not preempted and "[rl] step " in read(out):
            ids = subprocess.run(["squeue", "-h", "-n", GOOD_JOB, "-o", "%i"], env=env, capture_output=True, text=True,
                                 timeout=30).stdout.split()
            assert len(ids) == 1, ids
            preempted = ids[0]
            subprocess.run(["scancel", "--signal=USR1", "--batch", preempted], env=env, check=True, timeout=30)
        if preempted and not released and "requeueing job" in read(out):
            # Slurm holds a requeued job back for a while (its begin time); a test need not wait for it
            time.sleep(2)
            released = subprocess.run(["scontrol", "update", f"JobId={preempted}", "StartTime=now"], env=env,
                                      capture_output=True, timeout=30).returncode == 0
        if view is None and "actors ready in" in read(out):
            prometheus, address = start_prometheus(temp_dir, work)
            started.append(prometheus)
            view = dashboard.look(url, env["RAY_AUTH_TOKEN"], run_dir / "dashboard", timeout_s=120,
                                  expect_actors=ACTORS, expect_placement_groups=GROUPS)
        time.sleep(1)
    return view, address


def test_sbatch_runs_the_recipe_on_two_ray_nodes(slurm: dict[str, str], bad_run: object, tmp_path: Path) -> None:
    dashboard.ensure_chromium()
    ensure_prometheus()
    run_dir, out, record = tmp_path / "run", tmp_path / "out.txt", tmp_path / "imports.jsonl"
    modules = tmp_path / "envs"
    modules.mkdir()
    (modules / "where_env.py").write_text(ENV_MODULE.format(record=str(record)))
    temp_dir = tempfile.mkdtemp(prefix="rlray-sb-", dir="/tmp")
    env = batch_env(slurm, run_dir, temp_dir)
    job = sbatch(env, out, ["node1", "node2"], *TINY, f"rl.steps={RL_STEPS}", "env.id=where_env", f"env.python_path=[{modules}]",
                 "trainer.node_labels={pool: train}", "rollout.node_labels={pool: rollout}", name=GOOD_JOB)
    started: list[subprocess.Popen[bytes]] = []
    try:
        view, prometheus = watch(job, out, env, run_dir, temp_dir, tmp_path, started)
        job.wait(timeout=60)
        gauges = {m: last_values(prometheus, m) for m in ("rlray_reward_mean", "rlray_weight_sync_seconds")} \
            if prometheus else {}
    finally:
        for proc in [job, *started]:
            if proc.poll() is None:
                proc.kill()
        stop_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    text = read(out)
    assert job.returncode == 0, text[-4000:] + slurm_errors(slurm)
    assert "all 2 node(s) joined" in text and "stopping Ray" in text
    # preempted mid-RL, requeued, resumed from that step's checkpoint, finished
    stopped = re.search(r"preempted \(SIGUSR1\) after RL step (\d+): checkpoint at RL step \1", text)
    assert stopped and 0 < int(stopped.group(1)) < RL_STEPS, text[-4000:]
    assert "preemption (USR1): asking the rlray driver" in text and "requeueing job" in text, text[-4000:]
    assert f"stage rl, step {stopped.group(1)}" in text.split("requeueing job", 1)[1], text[-4000:]
    assert f"[rl] step {RL_STEPS}/{RL_STEPS}" in text and "held-out greedy reward after RL" in text, text[-3000:]
    assert (run_dir / "curves.png").is_file() and (run_dir / "ray-head.log").is_file()
    assert 0 <= json.loads((run_dir / "summary.json").read_text())["rl_end_reward"] <= 1

    imports = [json.loads(line) for line in read(record).splitlines()]
    on_node2 = [i for i in imports if i["node"] == "node2"]  # the rollout actor: rollout.node_labels
    assert on_node2, f"no import of the env module on node2: {imports}"
    for i in on_node2:  # both from the copies the runtime_env shipped, not from this checkout's folders
        assert "runtime_resources" in i["file"] and not i["file"].startswith(str(modules)), i
        assert "runtime_resources" in i["rlray"] and not i["rlray"].startswith(str(ROOT)), i
        assert not i["bench"], i  # rlray/bench stays behind: a run ships the run's code

    assert view is not None, "the dashboard was never looked at: no 'actors ready in' line in the job's output"
    assert set(ACTORS) <= set(view.actors) and set(GROUPS) <= set(view.placement_groups), view
    assert all(p.stat().st_size > 10_000 for p in view.screenshots), view.screenshots
    assert gauges["rlray_reward_mean"] and all(0 <= v <= 1 for v in gauges["rlray_reward_mean"]), gauges
    assert gauges["rlray_weight_sync_seconds"] and all(v > 0 for v in gauges["rlray_weight_sync_seconds"]), gauges


def test_sbatch_fails_the_batch_job_on_a_bad_override(bad_run: tuple[subprocess.Popen[str], Path]) -> None:
    job, out = bad_run
    job.wait(timeout=600)
    text = read(out)
    assert job.returncode != 0, text[-3000:]
    assert re.search(r"config error: rollout\.temperature must be >= 0", text), text[-3000:]
    assert "stopping Ray" in text
