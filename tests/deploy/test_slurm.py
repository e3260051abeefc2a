"""docker/slurm/rlray.sbatch: lints clean, and drives Ray the way a Slurm job must.

The behaviour tests run the script against stand-ins for srun, scontrol, hostname, sleep and
the ray CLI that record every call (with the auth variables each one saw), so they take a second
and need neither Slurm nor a Ray cluster. The real script was also run by hand against a real
Ray 2.60 head and worker on one machine (fake srun/scontrol only), with token auth on.
"""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "slurm" / "rlray.sbatch"
LOCAL_CLUSTER = ROOT / "docker" / "slurm" / "local_cluster.sh"  # the real cluster of test_slurm_cluster.py

FAKE_SRUN = r"""#!/bin/bash
# srun stand-in: drop the options, run --ntasks copies of the command on "this node", each
# writing to --output (%t: the task's number) when it is given.
n=1 out=
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in
    --ntasks=*) n=${1#--ntasks=}; shift ;;
    --output=*) out=${1#--output=}; shift ;;
    -w|--cpus-per-task) shift 2 ;;
    *) shift ;;
  esac
done
pids=()
for ((i = 0; i < n; i++)); do
  if [[ -n $out ]]; then SLURM_PROCID=$i "$@" > "${out//%t/$i}" 2>&1 & else SLURM_PROCID=$i "$@" & fi
  pids+=("$!")
done
trap 'kill "${pids[@]}" 2>/dev/null; exit 143' TERM INT  # srun forwards signals to its tasks
wait
"""
FAKE_SCONTROL = r"""#!/bin/bash
[[ $1 == show && $2 == hostnames ]] && { tr ',' '\n' <<<"$3"; exit 0; }
exit 1
"""
FAKE_HOSTNAME = "#!/bin/bash\necho '10.1.2.3 fe80::1'\n"
FAKE_SLEEP = "#!/bin/bash\nexec /bin/sleep 0.05\n"
FAKE_RAY = r"""#!/bin/bash
# ray stand-in: `start` joins a node (unless FAKE_JOIN=0 for workers; a worker step's first FAKE_WORKER_FAILS
# starts on each node exit 1, as Ray's 30 s for a raylet to register can run out on a loaded node) and blocks;
# `status` lists the
# joined nodes as Ray 2.60 prints them; `job submit` exits FAKE_JOB_RC. Every call goes to calls.jsonl.
record() {
  python3 - "$@" <<'EOF' >> "$FAKE_STATE/calls.jsonl"
import json, os, sys
nodes = os.path.join(os.environ["FAKE_STATE"], "nodes")
joined = len(open(nodes).read().split()) if os.path.exists(nodes) else 0
print(json.dumps({"argv": sys.argv[1:], "mode": os.environ.get("RAY_AUTH_MODE"),
                  "token": os.environ.get("RAY_AUTH_TOKEN"), "joined": joined}))
EOF
}
case "$1 $2" in
  "start --head")
    record "$@"
    if [[ ${FAKE_HEAD_DIES:-0} == 1 ]]; then echo "ERROR services.py -- Failed to start the dashboard"; exit 1; fi
    echo head >> "$FAKE_STATE/nodes"; exec /bin/sleep 60 ;;
  start\ --address=*)
    echo start >> "$FAKE_STATE/worker-starts-$SLURM_PROCID"
    if (( $(wc -l < "$FAKE_STATE/worker-starts-$SLURM_PROCID") <= ${FAKE_WORKER_FAILS:-0} )); then
      record "$@"; echo "Exception: The current node timed out during startup."; exit 1
    fi
    if [[ ${FAKE_JOIN:-1} == 1 ]]; then echo worker >> "$FAKE_STATE/nodes"; fi
    record "$@"; exec /bin/sleep 60 ;;
  "status --address")
    record "$@"
    [[ -s "$FAKE_STATE/nodes" ]] || exit 1
    printf 'Node status\n-----\nActive:\n (no active nodes)\nIdle:\n'
    awk '{printf " 1 node_%040d\n", NR}' "$FAKE_STATE/nodes"
    printf 'Pending:\n (no pending nodes)\nRecent failures:\n (no failures)\n\nResources\n-----\n'
    printf 'Total Usage:\n 0.0/8.0 GPU\n 0.0/12.0 CPU\n' ;;
  "job submit")
    record "$@"; exit "${FAKE_JOB_RC:-0}" ;;
esac
"""


def shell_tools() -> dict[str, str]:
    return {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, "hostname": FAKE_HOSTNAME, "sleep": FAKE_SLEEP,
            "ray": FAKE_RAY}


class FakeSlurm:
    """Runs the sbatch script as Slurm would, with the stand-ins first on PATH."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.bin = tmp_path / "bin"
        self.state = tmp_path / "state"
        self.home = tmp_path / "home"
        self.run_dir = tmp_path / "run"
        for d in (self.bin, self.state, self.home):
            d.mkdir()
        for name, text in shell_tools().items():
            path = self.bin / name
            path.write_text(text)
            path.chmod(path.stat().st_mode | stat.S_IXUSR)

    def __call__(self, *args: str, nodes: str = "gpu-a,gpu-b,gpu-c",
                 **env: str) -> subprocess.CompletedProcess[str]:
        base = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": str(self.home), "FAKE_STATE": str(self.state),
                "SLURM_JOB_ID": "77", "SLURM_CPUS_PER_TASK": "4", "SLURM_GPUS_ON_NODE": "8",
                "SLURM_SUBMIT_DIR": str(ROOT), "RLRAY_VENV": str(self.tmp / "no-venv"),
                "RUN_DIR": str(self.run_dir), "RAY_JOIN_TIMEOUT": "30"}
        if nodes:
            base["SLURM_JOB_NODELIST"] = nodes
        return subprocess.run(["bash", str(SCRIPT), *args], env={**base, **env}, capture_output=True,
                              text=True, timeout=60, cwd=self.tmp, check=False)

    def calls(self) -> list[dict]:
        path = self.state / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def token_files(self) -> list[Path]:
        return list((self.home / ".ray").glob("*.token"))


@pytest.fixture
def fake_slurm(tmp_path: Path) -> FakeSlurm:
    return FakeSlurm(tmp_path)


def test_bash_syntax() -> None:
    for script in (SCRIPT, LOCAL_CLUSTER):
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr


def test_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (Debian: apt-get install -y shellcheck); bash -n still ran")
    proc = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", str(SCRIPT), str(LOCAL_CLUSTER)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_fake_tools_are_shellcheck_clean_too(tmp_path: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (Debian: apt-get install -y shellcheck)")
    for name, text in shell_tools().items():
        (tmp_path / name).write_text(text)
    proc = subprocess.run(["shellcheck", "--shell=bash", *sorted(str(p) for p in tmp_path.iterdir())],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout


def test_allocation_fits_the_default_recipe() -> None:
    text = SCRIPT.read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.MULTILINE))
    default = re.search(r'^RECIPE="\$\{RECIPE:-(\w+)\}"', text, re.MULTILINE).group(1)
    recipe = yaml.safe_load((ROOT / "recipes" / f"{default}.yaml").read_text())
    assert default == "glm_moe"
    t, r = recipe["trainer"], recipe["rollout"]
    need = t["num_ranks"] * t["gpus_per_rank"] + r["num_actors"] * r["gpus_per_actor"]
    assert int(sbatch["nodes"]) * int(sbatch["gpus-per-node"]) == need == 40
    assert sbatch["ntasks-per-node"] == "1"  # one Ray node per Slurm node
    assert text.startswith("#!/bin/bash\n")


def test_starts_head_then_workers_waits_then_submits_with_token_auth(fake_slurm) -> None:
    proc = fake_slurm("trainer.lr=1e-6", "rl.steps=3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = fake_slurm.calls()
    starts = [c for c in calls if c["argv"][0] == "start"]
    [head] = [c for c in starts if "--head" in c["argv"]]
    workers = [c for c in starts if c is not head]
    assert head["argv"][1] == "--head" and "--node-ip-address=10.1.2.3" in head["argv"]
    assert "--port=6379" in head["argv"] and "--block" in head["argv"]
    assert head["argv"][head["argv"].index("--num-gpus") + 1] == "8"
    assert head["argv"][head["argv"].index("--num-cpus") + 1] == "4"
    assert len(workers) == 2 and all("--address=10.1.2.3:6379" in w["argv"] for w in workers)
    submits = [c for c in calls if c["argv"][:2] == ["job", "submit"]]
    assert len(submits) == 1
    assert submits[0]["joined"] == 3  # submitted only after every node had joined
    submit = submits[0]["argv"]
    run_dir = str(fake_slurm.run_dir)
    assert submit == ["job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".", "--",
                      "python", "-m", "rlray.launch", "+recipe=glm_moe", f"run.dir={run_dir}",
                      "trainer.lr=1e-6", "rl.steps=3"]
    tokens = {c["token"] for c in calls}
    assert len(tokens) == 1 and re.fullmatch(r"[0-9a-f]{64}", tokens.pop())  # one token everywhere
    assert {c["mode"] for c in calls} == {"token"}
    assert not any(re.search(r"[0-9a-f]{64}", a) for c in calls for a in c["argv"])  # never on a command line
    assert "all 3 node(s) joined" in proc.stdout
    assert not fake_slurm.token_files()  # removed at exit
    assert Path(run_dir).is_dir()


def test_given_token_and_recipe_are_used(fake_slurm) -> None:
    proc = fake_slurm(nodes="solo", RAY_AUTH_TOKEN="preset-token", RECIPE="tiny_moe")
    assert proc.returncode == 0, proc.stderr
    calls = fake_slurm.calls()
    assert [c["argv"][:2] for c in calls if c["argv"][0] == "start"] == [["start", "--head"]]  # one node
    assert {c["token"] for c in calls} == {"preset-token"}
    submit = next(c["argv"] for c in calls if c["argv"][:2] == ["job", "submit"])
    assert "+recipe=tiny_moe" in submit


def test_failed_job_fails_the_batch_job(fake_slurm) -> None:
    proc = fake_slurm(FAKE_JOB_RC="1")
    assert proc.returncode != 0
    assert not fake_slurm.token_files()


def test_nodes_that_never_join_time_out_before_submitting(fake_slurm) -> None:
    proc = fake_slurm(FAKE_JOIN="0", RAY_JOIN_TIMEOUT="2")
    assert proc.returncode == 1
    assert "only 1 of 3 Ray nodes up" in proc.stderr
    assert not any(c["argv"][:2] == ["job", "submit"] for c in fake_slurm.calls())


def test_a_ray_start_that_dies_fails_the_job_with_its_log(fake_slurm) -> None:
    proc = fake_slurm(FAKE_HEAD_DIES="1", RAY_START_TRIES="2")
    assert proc.returncode == 1
    assert "a ray start step exited early" in proc.stderr and "Failed to start the dashboard" in proc.stderr, proc.stderr
    assert "starting it again (try 2 of RAY_START_TRIES=2)" in proc.stderr, proc.stderr  # the head log's tail
    assert sum(c["argv"][:2] == ["start", "--head"] for c in fake_slurm.calls()) == 2  # then the job fails
    assert (fake_slurm.run_dir / "ray-head.log").is_file()
    assert not any(c["argv"][:2] == ["job", "submit"] for c in fake_slurm.calls())


def test_a_node_whose_ray_start_exits_early_starts_it_again(fake_slurm) -> None:
    """The real Slurm test's requeued job once lost its worker this way on a loaded machine (Ray's raylet did not
    register within Ray's fixed 30 s): each node's `ray start` is started again, and the job runs."""
    proc = fake_slurm(FAKE_WORKER_FAILS="1")
    assert proc.returncode == 0, proc.stderr
    assert "all 3 node(s) joined" in proc.stdout
    starts = [c for c in fake_slurm.calls() if c["argv"][0] == "start" and c["argv"][1].startswith("--address")]
    assert len(starts) == 4  # each of the two worker nodes: one start that failed, one that joined
    for task in (0, 1):
        log = (fake_slurm.run_dir / f"ray-worker-{task}.log").read_text()
        assert "timed out during startup" in log and "starting it again (try 2 of RAY_START_TRIES=3)" in log, log
    assert any(c["argv"][:2] == ["job", "submit"] for c in fake_slurm.calls())


@pytest.mark.parametrize("env, needle", [
    ({"RECIPE": "no_such_recipe"}, "no recipe recipes/no_such_recipe.yaml"),
    ({"PATH": "/usr/bin:/bin"}, None),
])
def test_user_errors_exit_1_before_starting_ray(fake_slurm, env: dict[str, str], needle: str | None) -> None:
    if needle is None:  # no ray on PATH (and no srun either): say so
        if shutil.which("ray", path="/usr/bin:/bin"):
            pytest.skip("a system-wide ray is installed")
        needle = "ray is not on PATH"
    proc = fake_slurm(**env)
    assert proc.returncode == 1 and needle in proc.stderr, proc.stderr
    assert not fake_slurm.calls()


def test_outside_slurm_exits_1(fake_slurm) -> None:
    proc = fake_slurm(nodes="")
    assert proc.returncode == 1 and "not inside a Slurm allocation" in proc.stderr
    assert not fake_slurm.calls()


def test_ray_nodes_the_tests_start_read_the_longer_dashboard_deadlines() -> None:
    """tests/conftest.py raises two of Ray's dashboard deadlines through the environment; the names
    are Ray's (private), so a Ray that renamed them would silently bring the 30 s deadline back."""
    code = ("from ray.dashboard import consts; from ray._private import ray_constants as c; "
            "print(consts.SUBPROCESS_MODULE_WAIT_READY_TIMEOUT, c.RAY_DASHBOARD_STARTUP_TIMEOUT_S)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["300.0", "600"]
