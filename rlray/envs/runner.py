"""The env runner: verifiers rollouts against the rollout actor's own engine, as token-exact `Rollout`s.

Contract:
- `EnvRunner(envs, engine, tokenizer, clients, cfg, version=..., server=..., chat_template=...)`
  drives verifiers environments (`Env`, weighted) with `clients`, verifiers clients of the
  actor's OpenAI endpoint (`rlray.actors.server`; `rlray.envs.client.make_clients`). `version()` is
  the actor's policy version.
- `train_row(ticket) -> (env, row)`: the training row of buffer ticket `ticket`, a pure
  function of the ticket (so a resumed run, or a replacement actor, draws the same): the
  environment drawn by weight with a generator seeded by `run_seed` and the ticket, its
  train row `ticket` (modulo its size). `group_seed(ticket)` is that group's sampling seed.
- `group(env, row, n, temperature, max_tokens, seed=None) -> list[Rollout]`: n rollouts of
  one row, scored together by the env's rubric (group reward functions see the whole group);
  with `seed`, rollout j samples with vLLM seed `seed + j` (reproducible given the weights).
  Every rollout is token-exact: prompt ids, completion ids and logprobs are what vLLM
  returned (`return_token_ids`, `logprobs`); turn after turn, the environment's tokens
  between two model turns (tool results, user turns, chat-template glue) join the
  completion with loss mask 0 and logprob 0, the model's tokens have mask 1.
- Multi-turn is token in, token out (`rlray.envs.client`): turn k+1's prompt ids are turn k's
  prompt + completion ids + the template's ids for the new messages only. The check stays as a
  guard: a turn whose prompt ids do not start with the previous prompt + completion ids gives
  the rollout error "TokenMismatch: ..." and an all-zero loss mask (counted, never trained on).
- `Rollout.turns` counts model turns, `Rollout.stop` is the verifiers stop condition that
  ended the rollout (`max_turns_reached`, `turn_truncated`, `prompt_too_long`, ...).
- MoE routing (the engine captures it): `Rollout.routing` holds the engine's experts for every
  position of prompt + completion, each turn's own over the environment's tokens before it, an
  earlier turn's where two turns computed a position; a rollout whose tokens do not line up
  (an error, a token mismatch) carries none. Prompt positions one rollout of a group found in the
  prefix cache take a sibling's routing; `counts["routing_missing"]` counts the positions left
  without (each rollout's last sampled token at least: it never went through the model).
- Failures never raise: an environment that raises, a reward function that raises, a tool
  call past `env.tool_timeout_s`, a rollout past `env.rollout_timeout_s`, an endpoint that
  returns no token ids: that rollout gets reward 0, `error` "<Kind>: ..." and an all-zero
  loss mask; `counts` counts them by kind. Malformed model output is not a failure: it is
  scored like any other output (an empty answer is an empty assistant message).
- Versions: each model token carries the policy version of the weights that sampled it
  (vLLM's weight-version spans, labelled at every sync, read back per response id; the
  direct path reads the actor's version as each token arrives); an environment token
  carries the version of the model token before it. A rollout with no token at all carries
  the version at its start.
- Fast path: with `env.fast_path` on, a plain single-turn environment (no tools, no
  overridden rollout hooks) skips HTTP: the prompt is rendered with the same chat template
  the endpoint uses, the engine samples all n completions in one request, and the env's
  rubric scores them exactly as it scores HTTP rollouts. Everything else goes over HTTP.
- Images (a vision-language model, `vision`: rlray.envs.images.VisionPrompt): on the fast path a
  prompt's image parts go to the engine with the processor's ids (placeholders expanded) and ride on
  each rollout for the trainer (`Rollout.images`, one object per group); over HTTP (multi-turn, user
  turns with images) the client sends them token in (rlray.envs.client) and each rollout carries the
  images of its last turn's prompt, placed on vLLM's expanded ids. An image that cannot be read, too
  many images or images for a text-only model give that rollout the error "ImageError: ..." (counted,
  never trained on).
- `evaluate(env, indices, n, temperature, max_tokens)` runs rows of the eval split and
  returns one record per example (prompt, answer, completions, rewards, errors).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from rlray.envs.base import SERVED_MODEL, Env, biased_sampling_args, prompt_text, render_prompt
from rlray.envs.images import ImageError, VisionPrompt, has_images, split_images
from rlray.envs.instrument import CURRENT, ToolTimeoutError, Tracker, error_kind, instrument_env
from rlray.envs.v1 import V1Env
from rlray.envs.v1_rollouts import v1_group
from rlray.types import Images, Rollout, no_route, overlay_routing

log = logging.getLogger(__name__)
TEXT_ONLY = ("the prompt has images but the model is text-only: model.name must be a vision-language model for "
             "this environment")


# ---- the runner ---------------------------------------------------------------------
class EnvRunner:
    def __init__(self, envs: list[tuple[Env, float]], engine: Any, tokenizer: Any, clients: list[Any], cfg: Any, *,
                 version: Callable[[], int], server: Any = None, chat_template: str | None = None,
                 num_actors: int = 1, run_seed: int = 0, vision: VisionPrompt | None = None) -> None:
        self.envs = [e for e, _ in envs]
        self.weights = [w for _, w in envs]
        self.by_id = {e.id: e for e in self.envs}
        self.engine, self.tokenizer, self.clients, self.cfg = engine, tokenizer, clients, cfg
        self._next_client = 0
        self.version, self.server, self.chat_template = version, server, chat_template
        self.num_actors, self.run_seed = num_actors, run_seed
        self.vision = vision  # a vision-language model's prompt renderer (its processor); None: text only
        self.counts: Counter[str] = Counter()
        for e in self.envs:
            if not isinstance(e, V1Env):  # a v1 env runs in its own actor (rlray.envs.v1_rollouts)
                instrument_env(e, cfg.tool_timeout_s)

    # ---- work -------------------------------------------------------------------
    def train_row(self, ticket: int) -> tuple[Env, dict]:
        rng = random.Random(f"{self.run_seed}:{ticket}")
        env = self.envs[0] if len(self.envs) == 1 else rng.choices(self.envs, self.weights)[0]
        return env, env.row("train", ticket)

    def group_seed(self, ticket: int) -> int:
        return ((self.run_seed * 7919 + ticket) * 1024) % 2**31  # + j < 1024 for rollout j

    def uses_fast_path(self, env: Env | V1Env) -> bool:
        return bool(self.cfg.fast_path) and env.fast_path_ok

    async def group(self, env: Env | V1Env, row: dict, n: int, temperature: float, max_tokens: int,
                    seed: int | None = None) -> list[Rollout]:
        if isinstance(env, V1Env):
            rollouts = await v1_group(env, row, n, temperature, max_tokens, seed, base_url=self.server.url,
                                      server=self.server, version=self.version, eos=self.tokenizer.eos_token_id)
            self.counts["v1_rollouts"] += n
        else:
            rollouts = await self._classic(env, row, n, temperature, max_tokens, seed)
        for r in rollouts:
            self.counts["rollouts"] += 1
            if r.routing is not None:
                self.counts["routing_missing"] += int((r.routing == no_route(r.routing.dtype)).all((1, 2)).sum())
            if r.error is not None:
                self.counts["errors"] += 1
                self.counts[f"errors/{error_kind(r.error)}"] += 1
        return rollouts

    async def _classic(self, env: Env, row: dict, n: int, temperature: float, max_tokens: int,
                       seed: int | None) -> list[Rollout]:
        sampling = self._sampling(env, temperature, max_tokens)
        self._next_client = (self._next_client + 1) % len(self.clients)
        client = self.clients[self._next_client]  # one group, one connection pool (and the prefix cache)
        if self.uses_fast_path(env):
            trackers = await self._fast(env, row, n, temperature, max_tokens, sampling, client, seed)
            self.counts["fast_rollouts"] += n
        elif self.vision is None and has_images(row.get("prompt")):
            trackers = [Tracker(self.version(), [f"ImageError: {TEXT_ONLY}"]) for _ in range(n)]
        else:
            seeded = [sampling if seed is None else {**sampling, "seed": seed + j} for j in range(n)]
            trackers = await asyncio.gather(*(self._http(env, row, sp, client) for sp in seeded))
            self.counts["http_rollouts"] += n
        await self._score(env, trackers)
        rollouts = [self._rollout(env, row, t) for t in trackers]
        share_prompt_routing(rollouts)
        return rollouts

    async def evaluate(self, env: Env, indices: list[int], n: int, temperature: float,
                       max_tokens: int) -> list[dict[str, Any]]:
        rows = [env.row("eval", i) for i in indices]
        groups = await asyncio.gather(*(self.group(env, row, n, temperature, max_tokens) for row in rows))
        return [{"env": env.id, "example": i, "prompt": prompt_text(row.get("prompt")),
                 "answer": row.get("answer", ""), "completions": [r.text for r in g],
                 "rewards": [r.reward for r in g], "errors": [r.error for r in g]}
                for i, row, g in zip(indices, rows, groups)]

    # ---- sampling ---------------------------------------------------------------
    def _sampling(self, env: Env, temperature: float, max_tokens: int) -> dict[str, Any]:
        """The env's own sampling args, with the RL-relevant ones fixed: the trainer assumes plain
        temperature sampling, and needs token ids and the logprobs of the sampled distribution."""
        base = {k: v for k, v in (env.vf.sampling_args or {}).items() if k not in ("n", "extra_body")}
        extra = dict((env.vf.sampling_args or {}).get("extra_body") or {})
        extra.update(return_token_ids=True, top_k=0, min_p=0.0, repetition_penalty=1.0)
        return {**base, "temperature": temperature, "max_tokens": max_tokens, "top_p": 1.0, "logprobs": True,
                "extra_body": extra}

    def render(self, messages: list, tools: list | None = None) -> list[int]:
        return render_prompt(self.tokenizer, messages, self.chat_template, tools)

    def prompt(self, messages: list) -> tuple[list[int], list[Any], Images | None]:
        """A single-turn prompt's ids, its images for the engine and for the trainer."""
        if self.vision is not None:
            return self.vision.render(messages)
        if has_images(messages):
            raise ImageError(TEXT_ONLY)
        return self.render(messages), [], None

    # ---- the two paths ----------------------------------------------------------
    async def _http(self, env: Env, row: dict, sampling: dict, client: Any) -> Tracker:
        tracker = Tracker(version=self.version())
        token = CURRENT.set(tracker)
        try:
            tracker.state = await asyncio.wait_for(env.vf.rollout(row, client, SERVED_MODEL, sampling),
                                                   self.cfg.rollout_timeout_s)
        except TimeoutError:
            tracker.errors.append(f"RolloutTimeout: the rollout ran past env.rollout_timeout_s="
                                  f"{self.cfg.rollout_timeout_s}s")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            tracker.errors.append(f"EnvError: {type(e).__name__}: {e}")
        finally:
            CURRENT.reset(token)
        err = tracker.state.get("error") if tracker.state is not None else None
        if err is not None and isinstance(err.__cause__, ImageError):
            tracker.errors.append(f"ImageError: {err.__cause__}")
        elif err is not None and not isinstance(err.__cause__, ToolTimeoutError):
            cause = f" ({type(err.__cause__).__name__}: {err.__cause__})" if err.__cause__ else ""
            tracker.errors.append(f"EnvError: {type(err).__name__}: {err}{cause}")
        return tracker

    async def _fast(self, env: Env, row: dict, n: int, temperature: float, max_tokens: int,
                    sampling: dict, client: Any, seed: int | None = None) -> list[Tracker]:
        import verifiers as vf
        from verifiers.types import TrajectoryStep

        start = self.version()
        trackers = [Tracker(version=start) for _ in range(n)]
        try:
            prompt_ids, images, trainer_images = self.prompt(row["prompt"])
        except ImageError as e:
            for t in trackers:
                t.errors.append(f"ImageError: {e}")
            return trackers
        except Exception as e:
            for t in trackers:
                t.errors.append(f"EnvError: rendering the prompt failed: {type(e).__name__}: {e}")
            return trackers
        samples = await self.engine.generate(prompt_ids, n=n, temperature=temperature, max_tokens=max_tokens,
                                             version=self.version, seed=seed,  # vLLM: child j gets seed + j
                                             images=images or None)
        for t in trackers:
            t.images = trainer_images
        for t, s in zip(trackers, samples):
            try:
                state = await env.vf.init_state(row, client, SERVED_MODEL, sampling)
                text = self.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
                message = vf.AssistantMessage(content=text)
                truncated = s.finish_reason == "length"
                tokens = {"prompt_ids": prompt_ids, "prompt_mask": [0] * len(prompt_ids),
                          "completion_ids": s.completion_ids, "completion_mask": [1] * len(s.completion_ids),
                          "completion_logprobs": s.logprobs, "overlong_prompt": False, "is_truncated": False,
                          "routed_experts": None}
                state["trajectory"].append(TrajectoryStep(
                    prompt=state["prompt"], completion=[message], response=None, tokens=tokens, reward=None,
                    advantage=None, is_truncated=truncated, trajectory_id=state["trajectory_id"],
                    extras={"rlray_versions": s.versions, "rlray_finish_reason": s.finish_reason,
                            "rlray_routing": s.routing}))
                state["completion"] = [message]
                state.update(is_completed=True, is_truncated=truncated, stop_condition="max_turns_reached")
                t.state = state
            except Exception as e:
                t.errors.append(f"EnvError: {type(e).__name__}: {e}")
        return trackers

    # ---- scoring and assembly ---------------------------------------------------
    async def _score(self, env: Env, trackers: list[Tracker]) -> None:
        scored = [t for t in trackers if t.state is not None and not t.errors]
        rubric = env.vf.rubric
        if scored:
            states = [t.state for t in scored]
            try:
                if env.vf.score_rollouts:
                    await rubric.score_group(states)
                else:
                    await rubric.dummy_score_group(states)
            except Exception as e:  # the rubric itself failed, not one reward function
                for t in scored:
                    t.errors.append(f"RewardError: scoring failed: {type(e).__name__}: {e}")
            for t in scored:
                t.errors.extend(dict.get(t.state, "rlray_reward_errors", []))
        for t in trackers:
            if t.state is not None:
                try:
                    await rubric.cleanup(t.state)
                except Exception as e:
                    log.warning("rubric cleanup failed: %s", e)

    def _versions(self, step: Any, n: int, default: int) -> list[int]:
        extras = step.get("extras") or {}
        if "rlray_versions" in extras:
            return list(extras["rlray_versions"])
        response = step.get("response")
        if self.server is None or response is None:
            return [default] * n
        return self.server.versions(response.id, n, default)

    def _routing(self, step: Any, num_tokens: int) -> np.ndarray | None:
        extras = step.get("extras") or {}
        if "rlray_routing" in extras:
            return extras["rlray_routing"]
        response = step.get("response")
        if self.server is None or response is None:
            return None
        return self.server.routing(response.id, num_tokens)

    def _rollout(self, env: Env, row: dict, t: Tracker) -> Rollout:
        state = t.state
        steps = list(state.get("trajectory") or []) if state is not None else []
        turns = []  # (prompt ids, completion ids, logprobs, versions, step); reading versions frees their record
        routing = None  # MoE: every turn's routing, an earlier turn's first where two overlap
        for step in steps:
            tok = step.get("tokens")
            n = len(tok["completion_ids"]) if tok is not None else 0
            versions = self._versions(step, n, t.version)
            if tok is None:
                t.errors.append("NoTokens: the endpoint returned no token ids or logprobs")
                break
            routing = overlay_routing(routing, self._routing(step, len(tok["prompt_ids"]) + n))
            turns.append((list(tok["prompt_ids"]), list(tok["completion_ids"]),
                          [float(x) for x in tok["completion_logprobs"]], versions, step))
        if not turns and not t.errors:
            too_long = state is not None and state.get("prompt_too_long")
            t.errors.append("NoTokens: no model turn" + (" (the prompt exceeds the context window)" if too_long else ""))
        prompt: list[int] = []
        ids: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[int] = []
        seen: list[int] | None = None
        finish, mismatch = "", None
        for k, (p, c, lp, v, step) in enumerate(turns):
            if seen is None:
                prompt = p
            elif p[: len(seen)] != seen:
                at = next((j for j, (a, b) in enumerate(zip(p, seen)) if a != b), min(len(p), len(seen)))
                mismatch = (f"TokenMismatch: turn {k + 1}'s prompt does not extend turn {k}'s prompt + "
                            f"completion (first difference at token {at})")
                break
            else:  # what the environment added between two model turns
                glue = p[len(seen):]
                ids += glue
                logprobs += [0.0] * len(glue)
                mask += [0] * len(glue)
                versions += [versions[-1] if versions else t.version] * len(glue)
            ids += c
            logprobs += lp
            mask += [1] * len(c)
            versions += v
            seen = p + c
            response = step.get("response")
            finish = (step.get("extras") or {}).get("rlray_finish_reason") or (
                response.message.finish_reason if response is not None else "") or ""
            if step.get("is_truncated"):
                finish = "length"
        if t.images is None and turns and not t.errors and mismatch is None:
            self._conversation_images(t, turns[-1][4], prompt + ids, [0] * len(prompt) + mask)
        failed = bool(t.errors)
        reward = 0.0 if failed or state is None else float(state.get("reward") or 0.0)
        metrics = (state.get("metrics") or {}) if state is not None else {}
        parts = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        error = "; ".join(dict.fromkeys(t.errors)) if failed else mismatch
        if not prompt:
            try:
                prompt = self.render(row.get("prompt") or [])
            except Exception:
                prompt = [self.tokenizer.eos_token_id]
        if not ids:  # nothing was sampled: one masked eos keeps every array (and the version) non-empty
            ids, logprobs, mask, versions = [self.tokenizer.eos_token_id], [0.0], [0], [t.version]
        if error is not None:
            mask = [0] * len(ids)
        return Rollout(
            prompt_ids=np.asarray(prompt, dtype=np.int64),
            completion_ids=np.asarray(ids, dtype=np.int64),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            loss_mask=np.asarray(mask, dtype=np.int8),
            versions=np.asarray(versions, dtype=np.int64),
            reward=reward, reward_parts=parts, env_id=env.id, example_id=int(row.get("example_id", -1)),
            finish_reason=finish, error=error, text=self.tokenizer.decode(ids, skip_special_tokens=True),
            biased=bool(biased_sampling_args(env.vf.sampling_args)),
            turns=len(turns), stop=str((state or {}).get("stop_condition") or ""),
            routing=routing if routing is not None and len(routing) == len(prompt) + len(ids) else None,
            images=t.images,
        )

    def _conversation_images(self, t: Tracker, last: Any, ids: list[int], mask: list[int]) -> None:
        """An HTTP rollout's images: those of its last turn's prompt, on its ids (`mask` 1: sampled)."""
        messages = last.get("prompt") or []
        if not has_images(messages):
            return
        try:
            if self.vision is None:
                raise ImageError(TEXT_ONLY)
            _, images = split_images(messages)
            t.images = self.vision.images(images, ids, [m == 1 for m in mask])
        except ImageError as e:
            t.errors.append(f"ImageError: {e}")


def share_prompt_routing(rollouts: list[Rollout]) -> None:
    """A group's rollouts share their prompt: positions one of them found in the prefix cache (no
    routing) take the routing of a sibling that computed them (the same prefill of the same tokens)."""
    routed = [r for r in rollouts if r.routing is not None]
    for r in routed:
        p = len(r.prompt_ids)
        missing = (r.routing[:p] == no_route(r.routing.dtype)).all(axis=(1, 2))
        for sibling in routed:
            if not missing.any():
                break
            if sibling is r or len(sibling.prompt_ids) != p or not np.array_equal(sibling.prompt_ids, r.prompt_ids):
                continue
            has = ~(sibling.routing[:p] == no_route(sibling.routing.dtype)).all(axis=(1, 2)) & missing
            r.routing[:p][has] = sibling.routing[:p][has]
            missing &= ~has
