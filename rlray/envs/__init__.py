"""Environments are verifiers environments, loaded by id.

Contract:
- `load_env(id, args, python_path=()) -> Env` puts `python_path` on `sys.path`, then calls
  `vf.load_environment(module, **args)`: a built-in id (`BUILTIN`, the modules of
  rlray.envs.builtin) names the module `rlray.envs.builtin.<id>`, any other id an installed
  environment module (dashes read as underscores), exactly as verifiers loads it. An
  environment that refuses its arguments (a TypeError or its own ValueError) is a ValueError of
  one line naming the env and the arguments. verifiers' own SIGINT/SIGTERM handlers are not
  installed (they would replace Ray's).
- `load_envs(cfg) -> list[(Env | V1Env, weight)]`: `env.mix` when set, else `env.id` with weight 1;
  an env whose module imports `verifiers.v1` is a verifiers 0.4 env (rlray.envs.v1), run by a v1
  env actor in an interpreter of its own;
  an env whose sampling args bias the sampled distribution is a ValueError naming the env
  and the argument, unless `env.allow_biased_sampling`.
- rlray.envs.base.Env is the handle (rows, examples); rlray.envs.runner runs rollouts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from rlray.envs import v1
from rlray.envs.base import Env, Example, biased_sampling_args
from rlray.envs.builtin import BUILTIN
from rlray.envs.v1 import V1Env

__all__ = ["BUILTIN", "Env", "Example", "V1Env", "load_env", "load_envs", "module_name"]


def module_name(env_id: str) -> str:
    return f"rlray.envs.builtin.{env_id}" if env_id in BUILTIN else env_id


@contextlib.contextmanager
def _quiet_load() -> Iterator[None]:
    """verifiers' own SIGINT/SIGTERM handlers not installed; its log line for a failed load held back
    (the failure becomes one line of ours)."""
    original, log = signal.signal, logging.getLogger("verifiers.utils.env_utils")
    level = log.level
    signal.signal = lambda *a, **k: None  # type: ignore[assignment]
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        signal.signal = original  # type: ignore[assignment]
        log.setLevel(level)


def add_python_path(paths: Sequence[str]) -> None:
    """`paths` first on sys.path, except in a Ray actor whose runtime_env brought their modules
    (rlray.orchestration.cluster.code_env): that copy is the one every node has."""
    shipped = os.environ.get("RLRAY_SHIPPED_CODE", "").split(os.pathsep)
    for p in reversed([p for p in paths if p not in shipped]):
        if p not in sys.path:
            sys.path.insert(0, p)


def _refused(env_id: str, args: dict[str, Any], cause: BaseException | None) -> str | None:
    """One line for an environment that refused its arguments, or None for any other failure."""
    if isinstance(cause, TypeError):
        return (f"env '{env_id}' does not take env.args={args}: {cause}; fix env.args (a recipe's env.args merge "
                "with the ones set after it)")
    if isinstance(cause, ValueError):  # the env's own check of an argument
        return f"env '{env_id}' refused env.args={args}: {cause}"
    return None


def load_env(env_id: str, args: dict[str, Any] | None = None, python_path: Sequence[str] = ()) -> Env:
    add_python_path(python_path)
    import verifiers as vf

    vf.setup_logging("WARNING")
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # an environment's dataset maps would print a bar per split and rollout actor
    with _quiet_load():
        try:
            vf_env = vf.load_environment(module_name(env_id), **dict(args or {}))
        except ValueError as e:
            raise ValueError(f"env.id='{env_id}': {e} Built-in: {list(BUILTIN)}; or put the module's folder "
                             "in env.python_path") from e
        except RuntimeError as e:  # verifiers wraps what load_environment raised
            why = _refused(env_id, dict(args or {}), e.__cause__)
            if why is None:
                raise
            raise ValueError(why) from e
    vf_env.env_id = env_id
    return Env(env_id, vf_env)


def load_envs(cfg: Any, described: dict[str, dict] | None = None) -> list[tuple[Env | V1Env, float]]:
    """`described`: the v1 envs' tasks as a v1 env actor describes them; None: from a subprocess of the
    v1 interpreter (rlray.envs.v1.describe)."""
    specs = [(s.id, s.args, s.weight) for s in cfg.mix] if cfg.mix else [(cfg.id, cfg.args, 1.0)]
    add_python_path(cfg.python_path)
    v1_specs = v1.specs(cfg)
    if v1_specs and described is None:
        described = v1.describe(v1.python(cfg), v1_specs, list(cfg.python_path))
    out: list[tuple[Env | V1Env, float]] = []
    for env_id, args, weight in specs:
        if weight <= 0:
            raise ValueError(f"env.mix: weight of '{env_id}' is {weight}; weights must be > 0")
        if env_id in v1_specs:
            out.append((V1Env(env_id, v1_specs[env_id], described[env_id]), float(weight)))
            continue
        env = load_env(env_id, args, cfg.python_path)
        biased = biased_sampling_args(env.vf.sampling_args)
        if biased and not cfg.allow_biased_sampling:
            raise ValueError(f"env '{env_id}': sampling argument {', '.join(biased)} changes the distribution the "
                             "engine samples from, while the trainer scores the unconstrained model (biased ratios "
                             "and mismatch_kl); remove it, or set env.allow_biased_sampling=true to train its "
                             "rollouts with mu taken as the trainer's policy")
        out.append((env, float(weight)))
    return out
