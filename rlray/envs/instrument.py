"""Instrumentation of a loaded verifiers environment: failures are recorded, never raised.

Contract:
- `instrument_env(env, tool_timeout_s)` (idempotent) wraps the environment's reward functions
  so an exception they raise is still scored 0 by verifiers but appended, as
  "RewardError: <func>: <type>: <message>", to the rollout state's `rlray_reward_errors`;
  wraps each tool so a call runs in its own thread pool (a hung tool never blocks the event
  loop) and fails with `ToolTimeoutError` past `tool_timeout_s`, recorded as "ToolTimeout: ..."
  on the current `Tracker` and ending the rollout; adds the stop condition `turn_truncated`
  (a model turn cut at max_tokens ends the rollout: a truncated turn has no end of turn to
  continue from); and records the rollout's state on the current `Tracker` as soon as it
  exists, so it survives a later failure.
- `CURRENT` is the `Tracker` of the rollout running in this task (a context variable).
- `error_kind("Kind: detail") == "Kind"`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlray.envs.base import Env


class ToolTimeoutError(Exception):
    """A tool call ran past `env.tool_timeout_s`."""


@dataclass
class Tracker:
    """What one rollout learned outside verifiers' state: its start version, its errors, its state."""

    version: int
    errors: list[str] = field(default_factory=list)
    state: Any = None
    images: Any = None  # the prompt's rlray.types.Images (a vision-language prompt), shared by its group


CURRENT: contextvars.ContextVar[Tracker | None] = contextvars.ContextVar("rlray_rollout", default=None)
_REWARD_ERRORS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("rlray_reward_errors", default=None)



def error_kind(error: str | None) -> str | None:
    return None if error is None else error.split(":", 1)[0]


# ---- instrumentation of a loaded verifiers environment -------------------------------
def _recording(func: Callable) -> Callable:
    """`func`, plus: an exception it raises is appended to the current reward-error list."""
    name = getattr(func, "__name__", repr(func))

    @functools.wraps(func)
    async def call(*args: Any, **kwargs: Any) -> Any:
        try:
            out = func(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out
        except Exception as e:
            sink = _REWARD_ERRORS.get()
            if sink is not None:
                sink.append(f"RewardError: {name}: {type(e).__name__}: {e}")
            raise

    call.__signature__ = inspect.signature(func)  # type: ignore[attr-defined]
    return call


def _cache_signature(func: Callable) -> None:
    """verifiers inspects every reward function's signature on every call; compute it once."""
    target = getattr(func, "__func__", func)  # a bound method's function
    try:
        if "__signature__" not in getattr(target, "__dict__", {}):
            target.__signature__ = inspect.signature(target)
    except (AttributeError, TypeError, ValueError):
        pass


def _state_errors(state: Any) -> list[str]:
    return dict.setdefault(state, "rlray_reward_errors", [])


def instrument_rubric(rubric: Any) -> None:
    """Reward functions keep failing softly (verifiers scores them 0), but rlray hears of it."""
    for child in getattr(rubric, "rubrics", None) or []:
        instrument_rubric(child)
    if getattr(rubric, "_rlray_instrumented", False):
        return
    rubric._rlray_instrumented = True
    for func in rubric.funcs:
        _cache_signature(func)
    individual, group = rubric._call_individual_reward_func, rubric._call_group_reward_func
    wrapped: dict[int, Callable] = {}

    def rec(func: Callable) -> Callable:
        if id(func) not in wrapped:
            wrapped[id(func)] = _recording(func)
        return wrapped[id(func)]

    async def call_individual(func: Callable, state: Any) -> float:
        token = _REWARD_ERRORS.set(_state_errors(state))
        try:
            return await individual(rec(func), state)
        finally:
            _REWARD_ERRORS.reset(token)

    async def call_group(func: Callable, states: list) -> list[float]:
        sink: list[str] = []
        token = _REWARD_ERRORS.set(sink)
        try:
            return await group(rec(func), states)
        finally:
            _REWARD_ERRORS.reset(token)
            for s in states:
                _state_errors(s).extend(sink)

    rubric._call_individual_reward_func = call_individual
    rubric._call_group_reward_func = call_group


_TOOL_THREADS: ThreadPoolExecutor | None = None


def _tool_threads() -> ThreadPoolExecutor:
    global _TOOL_THREADS
    if _TOOL_THREADS is None:  # its own pool: hung tools must not starve the loop's default executor
        _TOOL_THREADS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="rlray-tool")
    return _TOOL_THREADS


def _timed_tool(fn: Callable, name: str, timeout: float) -> Callable:
    """Sync tools run in a thread (a hang must not block the event loop); every call is bounded."""

    @functools.wraps(fn)
    async def call(*args: Any, **kwargs: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            work = fn(*args, **kwargs)
        else:
            ctx = contextvars.copy_context()
            work = asyncio.get_running_loop().run_in_executor(
                _tool_threads(), functools.partial(ctx.run, fn, *args, **kwargs))
        try:
            out = await asyncio.wait_for(work, timeout)
            return await asyncio.wait_for(out, timeout) if inspect.isawaitable(out) else out
        except TimeoutError:
            message = f"ToolTimeout: tool '{name}' ran past env.tool_timeout_s={timeout}s"
            tracker = CURRENT.get()
            if tracker is not None:
                tracker.errors.append(message)
            raise ToolTimeoutError(message) from None

    return call


async def turn_truncated(state: Any) -> bool:
    steps = state.get("trajectory") or []
    return bool(steps) and bool(steps[-1].get("is_truncated"))


def instrument_env(env: Env, tool_timeout_s: float) -> None:
    vf_env = env.vf
    if getattr(vf_env, "_rlray_instrumented", False):
        return
    vf_env._rlray_instrumented = True
    instrument_rubric(vf_env.rubric)
    tool_map = getattr(vf_env, "tool_map", None)
    if isinstance(tool_map, dict):
        for name, fn in list(tool_map.items()):
            tool_map[name] = _timed_tool(fn, name, tool_timeout_s)
        stop = getattr(vf_env, "stop_errors", None)
        if isinstance(stop, list) and ToolTimeoutError not in stop:
            stop.append(ToolTimeoutError)  # a timed-out tool ends the rollout
    conditions = getattr(vf_env, "_stop_conditions", None)
    if isinstance(conditions, list):  # after has_error, before every other condition
        conditions.insert(min(1, len(conditions)), turn_truncated)
    init_state = vf_env.init_state

    async def tracked_init_state(*args: Any, **kwargs: Any) -> Any:
        state = await init_state(*args, **kwargs)
        tracker = CURRENT.get()
        if tracker is not None:
            tracker.state = state  # kept even when the rollout raises later
        return state

    vf_env.init_state = tracked_init_state

