"""Hydra entry point: `python -m rlray.launch [+recipe=NAME] [+twin=cpu] [key=value ...]`.

Contract: composes `conf/config.yaml` with the recipe, its CPU twin and the overrides,
validates the result into a typed `Config` and its plan (rlray.orchestration.plan: mesh, engines, memory
per GPU), exiting 1 with one line naming the bad key or the shortfall, before Ray starts; what the run survives
but should know (an HF export larger than a node's host RAM) is printed as one `warning:` line each. Colocated with
async.max_off_policy_steps=1, a plan in which trainer and engine do not fit a GPU at once sets it to 0
(one line says so).
`dry_run=true` prints the plan (checked against the cluster's resources when connected to
one) and exits. Otherwise the plan goes to the run folder (`plan.txt`) and the controller
runs; a run that cannot go on (a rollout actor lost past `rollout.max_restarts`, a starved
step, non-finite steps in a row) exits 1 with one line, its traceback in `error.log`. SIGTERM or
SIGUSR1 preempts it (rlray.orchestration.preemption): a checkpoint at the current RL step, exit 0
with one line, within `checkpoint.preempt_grace_s`.
Works from any working directory and under `ray job submit`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from rlray.config import Config, ConfigError, register, to_config

if TYPE_CHECKING:
    from rlray.orchestration.plan import Plan

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

register()


def _fail(message: str) -> None:
    print(f"config error: {message}", file=sys.stderr)
    sys.exit(1)


def _plan(config: Config) -> Plan:
    """Every check, cheapest first: torch, verifiers and vLLM are imported only once the checks that
    need no import have passed (a GPU recipe on a laptop is refused in about a second)."""
    if not config.dry_run:  # a dry run plans for the cluster the recipe names, not this machine
        from rlray.config.resources import check_local
        from rlray.envs import load_envs
        from rlray.envs.v1 import console_line as v1_line

        check_local(config, " ".join(["python -m rlray.launch", *sys.argv[1:]]))
        envs = load_envs(config.env)  # an unknown env id, a missing package or biasing sampling args: one line, no Ray
        if line := v1_line([e for e, _ in envs], config.env):
            print(line, flush=True)
        if config.teacher.enabled:
            from rlray.models.tiny import model_path
            from rlray.orchestration.teachers import check_tokenizer

            check_tokenizer(model_path(config.model), config.teacher.name)
    from rlray.algo.loss import resolve
    from rlray.orchestration.plan import make_plan

    resolve(config.algo)  # the loss's paper preset into the keys left unset, every algo key checked

    try:
        plan = make_plan(config)
    except OSError as e:
        raise ConfigError(f"cannot read the architecture of model.name='{config.model.name}': "
                          f"{str(e).splitlines()[0]} (give a local checkpoint folder)") from e
    problems = plan.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    for warning in plan.warnings():
        print(f"warning: {warning}", flush=True)
    if config.cluster.colocate and config.async_.max_off_policy_steps == 1 and not plan.overlap_fits():
        config.async_.max_off_policy_steps = 0
        print(f"cluster.colocate=true: trainer and engine need ~{plan.phases()['both']:.0f} GB at once, more than "
              f"cluster.gpu_memory_gb={config.cluster.gpu_memory_gb:g}, so async.max_off_policy_steps is 0: they take "
              f"turns (the engines in vLLM's sleep mode, level {config.rollout.sleep_level}, while the trainer trains)",
              flush=True)
    return plan


def _dry_run(config: Config, plan: Plan) -> None:
    from rlray.config.resources import is_local

    print(plan.render())
    if not is_local(config):
        from rlray.orchestration import cluster

        cluster.connect(config.cluster)
        print(cluster.check_resources(plan.gpus, plan.cpus))
    print("plan fits; dry run, nothing started")


@hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        config = to_config(cfg)
        plan = _plan(config)
        if config.dry_run:
            _dry_run(config, plan)
            return
    except (ConfigError, ValueError) as e:
        _fail(str(e))
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "plan.txt").write_text(plan.render() + "\n")
    (run_dir / "driver.pid").write_text(f"{os.getpid()}\n")  # whom rlray.sbatch passes a preemption signal to
    print(f"{plan.summary()} (all of it: {run_dir / 'plan.txt'})", flush=True)
    from rlray.algo.loss import preset_line

    print(preset_line(config.algo), flush=True)
    from rlray.actors.engine import version_warning

    warning = version_warning()
    if warning:
        print(warning, flush=True)
    from rlray.orchestration import preemption
    from rlray.orchestration.controller import run

    preemption.install(config.checkpoint.preempt_grace_s)
    try:
        summary = run(config)
    except (RuntimeError, TimeoutError) as e:  # a run that cannot go on: rlray's own one-line reasons
        _stopped(e, run_dir)
    if "preempted" in summary:
        p = summary["preempted"]
        kept = (f"checkpoint at RL step {p['step']}" if p["stage"] == "rl" else
                "SFT keeps no checkpoint and starts again")
        print(f"preempted ({p['signal']}) after {p['stage'].upper()} step {p['step']}: {kept}; run again with "
              f"run.dir={run_dir} to resume", flush=True)


def _stopped(error: BaseException, run_dir: Path) -> None:
    """One line on the console (the actor's own error for a failed task); the traceback to error.log."""
    import traceback

    cause = getattr(error, "cause", None)  # ray's RayTaskError carries the actor's exception
    reason = cause if isinstance(cause, BaseException) else error
    (run_dir / "error.log").write_text("".join(traceback.format_exception(error)))
    first = str(reason).strip().splitlines()[0] if str(reason).strip() else type(reason).__name__
    print(f"run stopped: {first} (traceback: {run_dir / 'error.log'})", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
    main()
