"""Groups of a verifiers v1 env as token-exact `Rollout`s (the v1 side of rlray.envs.runner).

Contract:
- `v1_group(env, row, n, temperature, max_tokens, seed, *, base_url, server, version, eos) -> list[Rollout]`:
  `env.actor` (the rollout actor's v1 env actor, rlray.envs.v1_worker) runs n episodes of the row's task,
  each with plain temperature sampling (seed `seed + j` for rollout j when seeded) through the TrainClient
  on `base_url`; the server's session record (rlray.actors.server: the generate requests each trace made,
  by `X-Session-ID`) gives every sampled token the policy version that sampled it.
- `to_rollout(record, calls, env_id, example_id, start_version, eos)`: the branch's ids split at the first
  sampled token (prompt before it), loss mask = `sampled_mask`, logprobs from the branch. Every request of
  the session must line up with the branch (its prompt ids a prefix of the branch, its output ids the
  sampled tokens right after): else the rollout gets the error "TokenMismatch: ...". Environment tokens
  take the version of the model token before them. A rollout with an error has reward 0 and an all-zero
  loss mask; one with no sampled token carries one masked eos.
- An env actor that died (Ray restarts it) or any other failure of the call: every rollout of the group
  gets the error "EnvActorError: ..." (counted like every error, never raised).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from rlray.envs.base import SERVED_MODEL
from rlray.envs.v1 import V1Env
from rlray.envs.v1_worker import empty_result
from rlray.types import Rollout, overlay_routing


def sampling(n: int, temperature: float, max_tokens: int, seed: int | None) -> list[dict[str, Any]]:
    """Plain temperature sampling, as the trainer scores it (no top-p/top-k/min-p, no penalties)."""
    base = {"temperature": temperature, "max_tokens": max_tokens, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
            "repetition_penalty": 1.0}
    return [base if seed is None else {**base, "seed": seed + j} for j in range(n)]


async def v1_group(env: V1Env, row: dict, n: int, temperature: float, max_tokens: int, seed: int | None, *,
                   base_url: str, server: Any, version: Callable[[], int], eos: int) -> list[Rollout]:
    start = version()
    try:
        records = await env.actor.group.remote(env.id, row.get("v1_split", "train"), row["v1_index"], base_url,
                                                SERVED_MODEL, sampling(n, temperature, max_tokens, seed))
    except Exception as e:  # the env actor died under the call (Ray restarts it) or failed outright
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        records = [empty_result(f"EnvActorError: {why}")] * n
    out = []
    for rec in records:
        calls = server.session(rec["session"], start) if rec["session"] else []
        routing = None
        for call in calls:
            routing = overlay_routing(routing, server.routing(call["id"], len(call["prompt"]) + len(call["out"])))
        out.append(to_rollout(rec, calls, env.id, int(row.get("example_id", -1)), start, eos, routing))
    return out


def _line_up(ids: list[int], mask: list[int], calls: list[dict], start: int) -> tuple[list[int], str | None]:
    """Every branch position's policy version (sampled ones from their request's spans), or a mismatch."""
    versions: list[int | None] = [None] * len(ids)
    for k, call in enumerate(calls):
        p, o = call["prompt"], call["out"]
        end = len(p) + len(o)
        if ids[:len(p)] != p or ids[len(p):end] != o or not all(mask[len(p):end]):
            at = next((j for j, (a, b) in enumerate(zip(ids, p + o)) if a != b), min(len(ids), end))
            return [], (f"TokenMismatch: request {k + 1} of the session does not line up with the trace's branch "
                        f"(first difference at token {at})")
        versions[len(p):end] = call["versions"]
    missing = [i for i, m in enumerate(mask) if m and versions[i] is None]
    if missing:
        return [], f"TokenMismatch: sampled token {missing[0]} of the branch came from no request of its session"
    last, filled = start, []
    for v in versions:
        last = last if v is None else v
        filled.append(last)
    return filled, None


def to_rollout(rec: dict[str, Any], calls: list[dict], env_id: str, example_id: int, start: int, eos: int,
               routing: np.ndarray | None = None) -> Rollout:
    ids, mask, logprobs = list(rec["ids"]), [int(m) for m in rec["mask"]], [float(x) for x in rec["logprobs"]]
    error = rec.get("error")
    first = mask.index(1) if 1 in mask else len(ids)
    versions = [start] * len(ids)
    if error is None and first < len(ids):
        lined, mismatch = _line_up(ids, mask, calls, start)
        versions, error = (lined, None) if mismatch is None else (versions, mismatch)
    elif error is None:
        error = "NoTokens: the episode sampled no token" + (f" ({rec['stop']})" if rec.get("stop") else "")
    prompt = ids[:first] or [eos]
    completion, mask, logprobs, versions = ids[first:], mask[first:], logprobs[first:], versions[first:]
    if not completion:
        completion, mask, logprobs, versions = [eos], [0], [0.0], [start]
    if error is not None:
        mask = [0] * len(completion)
    return Rollout(
        prompt_ids=np.asarray(prompt, dtype=np.int64), completion_ids=np.asarray(completion, dtype=np.int64),
        logprobs=np.asarray(logprobs, dtype=np.float32), loss_mask=np.asarray(mask, dtype=np.int8),
        versions=np.asarray(versions, dtype=np.int64), reward=0.0 if error else float(rec["reward"]),
        reward_parts=dict(rec.get("parts") or {}), env_id=env_id, example_id=example_id,
        finish_reason=rec.get("finish") or "", error=error, text=rec.get("text") or "", biased=False,
        turns=int(rec.get("turns") or 0), stop=rec.get("stop") or "",
        routing=routing if routing is not None and len(routing) == len(prompt) + len(completion) else None,
    )
