"""Environments are verifiers environments, loaded by id.

Contract:
- `load_env(id, args, python_path=()) -> Env` puts `python_path` on `sys.path`, then calls
  `vf.load_environment(module, **args)`: a built-in id (`BUILTIN`: reverse_text,
  arithmetic, calculator, guess_number) names the module `rlray.envs.<id>`, any other id an installed
  environment module (dashes read as underscores), exactly as verifiers loads it.
  verifiers' own SIGINT/SIGTERM handlers are not installed (they would replace Ray's).
- `load_envs(cfg) -> list[(Env, weight)]`: `env.mix` when set, else `env.id` with weight 1;
  an env whose sampling args bias the sampled distribution is a ValueError naming the env
  and the argument, unless `env.allow_biased_sampling`.
- rlray.envs.base.Env is the handle (rows, examples); rlray.envs.runner runs rollouts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from rlray.envs.base import Env, Example, biased_sampling_args

BUILTIN = ("reverse_text", "arithmetic", "calculator", "guess_number")

__all__ = ["BUILTIN", "Env", "Example", "load_env", "load_envs", "module_name"]


def module_name(env_id: str) -> str:
    return f"rlray.envs.{env_id}" if env_id in BUILTIN else env_id


@contextlib.contextmanager
def _no_signal_handlers() -> Iterator[None]:
    original = signal.signal
    signal.signal = lambda *a, **k: None  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = original  # type: ignore[assignment]


def add_python_path(paths: Sequence[str]) -> None:
    """`paths` first on sys.path, except in a Ray actor whose runtime_env brought their modules
    (rlray.cluster.code_env): that copy is the one every node has."""
    shipped = os.environ.get("RLRAY_SHIPPED_CODE", "").split(os.pathsep)
    for p in reversed([p for p in paths if p not in shipped]):
        if p not in sys.path:
            sys.path.insert(0, p)


def load_env(env_id: str, args: dict[str, Any] | None = None, python_path: Sequence[str] = ()) -> Env:
    add_python_path(python_path)
    import verifiers as vf

    vf.setup_logging("WARNING")
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # an environment's dataset maps would print a bar per split and rollout actor
    with _no_signal_handlers():
        try:
            vf_env = vf.load_environment(module_name(env_id), **dict(args or {}))
        except ValueError as e:
            raise ValueError(f"env.id='{env_id}': {e} Built-in: {list(BUILTIN)}; or put the module's folder "
                             "in env.python_path") from e
        except RuntimeError as e:  # verifiers wraps what load_environment raised
            if not isinstance(e.__cause__, TypeError):
                raise
            raise ValueError(f"env '{env_id}' does not take env.args={dict(args or {})}: {e.__cause__}; fix "
                             "env.args (a recipe's env.args merge with the ones set after it)") from e
    vf_env.env_id = env_id
    return Env(env_id, vf_env)


def load_envs(cfg: Any) -> list[tuple[Env, float]]:
    specs = [(s.id, s.args, s.weight) for s in cfg.mix] if cfg.mix else [(cfg.id, cfg.args, 1.0)]
    out = []
    for env_id, args, weight in specs:
        if weight <= 0:
            raise ValueError(f"env.mix: weight of '{env_id}' is {weight}; weights must be > 0")
        env = load_env(env_id, args, cfg.python_path)
        biased = biased_sampling_args(env.vf.sampling_args)
        if biased and not cfg.allow_biased_sampling:
            raise ValueError(f"env '{env_id}': sampling argument {', '.join(biased)} changes the distribution the "
                             "engine samples from, while the trainer scores the unconstrained model (biased ratios "
                             "and mismatch_kl); remove it, or set env.allow_biased_sampling=true to train its "
                             "rollouts with mu taken as the trainer's policy")
        out.append((env, float(weight)))
    return out
