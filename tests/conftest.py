"""Shared test settings: wandb never goes online from a test; Ray's dashboard gets the time a
loaded 2-core machine needs to start.

Ray's dashboard waits 30 s for each of its 9 module processes and `ray start`/`ray.init` 60 s for
the dashboard; a module that misses its 30 s kills the dashboard, and with it `ray start --block`
(exit 1, ~65 s after the start) or `ray.init(include_dashboard=True)`. Measured: 2 s on an idle
machine, 7 s under six busy loops; a fresh-clone CI run lost test_slurm_cluster's Ray head this
way while the other batch job's head and driver started on the same two cores. Every Ray node a
test starts inherits these from the environment (sbatch and srun pass it on).
"""

import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT", "300")
os.environ.setdefault("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "600")
