"""The driver loop: stages (sft, rl, eval), steps, weight sync and evaluation.

Contract: `run(config) -> summary` creates the run folder (resolved config,
metrics.jsonl, eval samples), connects to Ray, spawns the actors, opens the weight
group, then runs `config.stages` in order and tears everything down. A rollout
actor that dies (with any engine whose weight load its death broke) is replaced in its
bundle, up to `rollout.max_restarts` times: its buffer tickets are returned, the weight
group is re-formed, the current policy is loaded and its RL loop resumes; training
waits meanwhile and loses no step. With
`checkpoint.every` set, RL commits a checkpoint (trainer DCP shards, policy version,
buffer counters) at its start and every that many steps; a later run with the same
run folder resumes from the newest committed one (an interrupted SFT restarts). The
controller moves object references and version numbers; rollouts and batches go
from actor to actor (SFT batches, built from the dataset here, are put once).
The summary holds the held-out greedy rewards after SFT and at the end of RL.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import yaml
from ray.exceptions import RayActorError, RayError

from rlray import checkpoint, cluster
from rlray.config import Config
from rlray.data.packing import Sample, pack
from rlray.data.tokenizer import encode_prompt
from rlray.envs import load_env
from rlray.metrics import Metrics
from rlray.models.tiny import model_path
from rlray.plan import needs


def _config_dict(c: Config) -> dict[str, Any]:
    d = dataclasses.asdict(c)
    d["async"] = d.pop("async_")
    return d


class Controller:
    def __init__(self, c: Config) -> None:
        self.c = c
        self.run_dir = Path(c.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(_config_dict(c), sort_keys=False))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path(c.model))
        self.env = load_env(c.env.id, c.env.args, c.env.python_path)
        self.metrics = Metrics(self.run_dir, c.logging, _config_dict(c))
        self.summary: dict[str, Any] = {"run_dir": str(self.run_dir)}
        self.ckpt_root = self.run_dir / "checkpoints"
        self.version = 0
        self.restarts = 0  # rollout actors replaced so far
        self.runs: list[Any] = []  # each rollout actor's RL loop while RL runs (None while it is replaced)

    # ---- set-up -------------------------------------------------------------------
    def start(self) -> None:
        cluster.connect(self.c.cluster, self.c.logging.verbose)
        cluster.check_resources(*needs(self.c))
        t0 = time.perf_counter()
        self.h = cluster.spawn(self.c, pad_id=self.tokenizer.pad_token_id)
        ray.get([t.setup.remote() for t in self.h.trainers] + [r.start.remote() for r in self.h.rollouts])
        self.plan = ray.get(self.h.trainers[0].weight_plan.remote(self.c.weights.bucket_mb))
        world = self._open_weight_group()
        print(f"actors ready in {time.perf_counter() - t0:.1f}s: {len(self.h.trainers)} trainer ranks, "
              f"{len(self.h.rollouts)} rollout actors, weight group of {world}", flush=True)

    def _open_weight_group(self) -> int:
        host, port = cluster.free_address(self.h.trainer_pg, 0)
        tp = self.c.rollout.tensor_parallel_size  # engine i's workers are ranks 1 + i*tp .. i*tp + tp
        world = 1 + len(self.h.rollouts) * tp
        args = (cluster.backend(self.c), self.c.weights.timeout_s, self.plan)
        ray.get([t.init_weight_group.remote(host, port, world, *args) for t in self.h.trainers]
                + [r.init_weight_group.remote(host, port, 1 + i * tp, world, *args)
                   for i, r in enumerate(self.h.rollouts)])
        return world

    def sync(self, version: int) -> dict[str, float]:
        self._heal()
        refs = [t.broadcast_weights.remote() for t in self.h.trainers]
        pulls = [r.update_weights.remote(version) for r in self.h.rollouts]
        try:
            out = ray.get(refs + pulls, timeout=self.c.weights.timeout_s)
        except RayError:
            # A lost receiver fails the broadcast; closing the sender's end releases the others,
            # whose half-loaded engines are replaced too.
            ray.wait(refs, num_returns=len(refs), timeout=self.c.weights.timeout_s)
            ray.get(self.h.trainers[0].close_weight_group.remote())
            failed = _failed(pulls, self.c.weights.timeout_s)
            if not any(isinstance(e, RayActorError) for e in failed.values()):
                raise  # no receiver died: the broadcast itself is broken
            return self.replace(sorted(failed), "lost during a weight sync")
        sent = out[0]
        return {"sync_seconds": max(o.get("sync_seconds", o.get("load_seconds", 0.0)) for o in out),
                "sync_gb_per_s": sent["sync_bytes"] / max(sent["sync_seconds"], 1e-9) / 1e9}

    # ---- rollout actor replacement ---------------------------------------------------
    def _heal(self) -> None:
        """Replace rollout actors whose RL loop ended early: they died (or their loop crashed)."""
        live = [ref for ref in self.runs if ref is not None]
        ready, _ = ray.wait(live, num_returns=len(live), timeout=0) if live else ([], [])
        dead = [i for i, ref in enumerate(self.runs) if ref is not None and ref in ready]
        if dead:
            self.replace(dead, "died during RL")

    def _wait(self, refs: list[Any]) -> None:
        """Wait until `refs` are ready, replacing rollout actors that die meanwhile."""
        while len(ray.wait(refs, num_returns=len(refs), timeout=1.0)[0]) < len(refs):
            self._heal()

    def replace(self, indices: list[int], reason: str) -> dict[str, float]:
        """Kill rollout actors `indices`, return their tickets, start new ones in their bundles,
        re-form the weight group, load the current policy everywhere and resume their RL loops."""
        c = self.c
        if self.restarts + len(indices) > c.rollout.max_restarts:
            raise RuntimeError(f"rollout actors {indices} {reason}; rollout.max_restarts={c.rollout.max_restarts} "
                               f"replacements allowed and {self.restarts} used. Raise rollout.max_restarts, "
                               "or resume the run from its last checkpoint.")
        t0 = time.perf_counter()
        print(f"rollout actors {indices} {reason}: replacing them", flush=True)
        self.restarts += len(indices)
        for i in indices:
            ray.kill(self.h.rollouts[i], no_restart=True)
            ray.get(self.h.buffer.forget.remote(i))
            if self.runs:
                self.runs[i] = None
        ray.get(self.h.trainers[0].close_weight_group.remote())
        ray.get([r.close_weight_group.remote() for i, r in enumerate(self.h.rollouts) if i not in indices])
        for i in indices:
            self.h.rollouts[i] = cluster.spawn_rollout(c, i, self.h.rollout_pg, self.restarts)
        ray.get([self.h.rollouts[i].start.remote() for i in indices])
        self._open_weight_group()
        values = self.sync(self.version)
        if self.runs:
            for i in indices:
                self.runs[i] = self.h.rollouts[i].run.remote(cluster.BufferClient(self.h.buffer, i))
        print(f"rollout actors {indices} replaced in {time.perf_counter() - t0:.1f}s "
              f"({self.restarts} of rollout.max_restarts={c.rollout.max_restarts} used)", flush=True)
        return values

    def evaluate(self, tag: str) -> float:
        """Every environment's eval split on the rollout actors (`eval.num_samples` per example).

        Appends one record per example (prompt, answer, completions, rewards, errors) to
        `eval_results.jsonl`, logs an `eval` record (mean reward, pass@k, per environment when
        several) to the metrics, and returns the mean reward over every sample.
        """
        from rlray.envs.evaluation import summarize

        e = self.c.eval
        max_tokens = e.max_tokens if isinstance(e.max_tokens, int) else self.c.rollout.max_tokens
        refs = [r.evaluate.remote(e.num_examples, e.num_samples, e.temperature, max_tokens) for r in self.h.rollouts]
        try:
            outs = ray.get(refs)
        except RayActorError:
            self.replace(sorted(_failed(refs, None)), "died during an evaluation")
            return self.evaluate(tag)
        records = sorted((rec for out in outs for rec in out), key=lambda rec: (rec["env"], rec["example"]))
        with (self.run_dir / "eval_results.jsonl").open("a") as f:
            for rec in records:
                f.write(json.dumps({"tag": tag, **rec}) + "\n")
        overall = summarize(records, e.pass_k, e.pass_threshold)
        values: dict[str, Any] = {"tag": tag, "eval_reward": overall["reward_mean"],
                                  **{k: v for k, v in overall.items() if k != "reward_mean"}}
        envs = sorted({rec["env"] for rec in records})
        if len(envs) > 1:
            for env in envs:
                per_env = summarize([rec for rec in records if rec["env"] == env], e.pass_k, e.pass_threshold)
                values.update({f"{env}/{k}": v for k, v in per_env.items()})
        self.evals = getattr(self, "evals", 0) + 1
        self.metrics.log("eval", self.evals - 1, values)
        self.last_eval = values
        return overall["reward_mean"]

    # ---- stages -------------------------------------------------------------------
    def _sft_batch(self, step: int) -> list[list]:
        n = self.c.sft.batch_size
        eos = self.tokenizer.eos_token_id
        samples = []
        for i in range(step * n, (step + 1) * n):
            ex = self.env.example("train", i)
            answer = list(self.tokenizer(ex.answer, add_special_tokens=False)["input_ids"]) + [eos]
            samples.append(Sample(np.asarray(encode_prompt(self.tokenizer, ex.prompt)), np.asarray(answer),
                                  np.ones(len(answer), np.float32), 0.0, np.zeros(len(answer), np.float32)))
        return pack(samples, len(self.h.trainers), self.c.trainer.micro_batch_tokens, self.tokenizer.pad_token_id)

    def sft(self) -> None:
        s = self.c.sft
        ray.get([t.set_stage.remote(s.lr, s.warmup_steps) for t in self.h.trainers])
        reward = 0.0
        for step in range(s.max_steps):
            t0 = time.perf_counter()
            per_rank = self._sft_batch(step)
            out = ray.get([t.sft_step.remote(mbs) for t, mbs in zip(self.h.trainers, per_rank)])[0]
            values = {"loss": out["loss"], "step_seconds": time.perf_counter() - t0}
            last = step + 1 == s.max_steps
            if (step + 1) % s.eval_every == 0 or last:
                values.update(self.sync(0))
                values["eval_reward"] = reward = self.evaluate(f"sft-{step + 1}")
            self.metrics.log("sft", step, values, s.max_steps)
            if reward >= s.stop_reward:
                print(f"SFT reached held-out reward {reward:.3f} >= sft.stop_reward={s.stop_reward} "
                      f"at step {step + 1}; stopping SFT", flush=True)
                break
        self.summary["sft_reward"] = reward

    # ---- checkpoints ---------------------------------------------------------------
    def save(self, stage: str, step: int) -> None:
        """Commit a checkpoint from which `stage` resumes at `step`."""
        t0 = time.perf_counter()
        tmp = checkpoint.staging(self.ckpt_root, stage, step)
        ray.get([t.save.remote(str(tmp)) for t in self.h.trainers])
        meta = {"stage": stage, "step": step, "version": self.version, "saved_at": time.time(),
                "buffer": ray.get(self.h.buffer.state.remote()), "summary": self.summary}
        path = checkpoint.commit(tmp, meta, self.c.checkpoint.keep)
        print(f"checkpoint {path} ({time.perf_counter() - t0:.1f}s)", flush=True)

    def resume_point(self) -> dict[str, Any] | None:
        path = checkpoint.latest(self.ckpt_root) if self.c.checkpoint.resume else None
        if path is None:
            return None
        meta = checkpoint.read_meta(path)
        print(f"resuming from {path}: stage {meta['stage']}, step {meta['step']}", flush=True)
        return {**meta, "path": str(path)}

    def _rl_begin(self, resume: dict[str, Any] | None) -> int:
        ray.get([t.set_stage.remote(self.c.trainer.lr, 0) for t in self.h.trainers])
        if resume is None:
            self.version = 0
            self.sync(0)
            start = self.evaluate("rl-start")
            self.summary["rl_start_reward"] = start
            print(f"held-out greedy reward before RL: {start:.3f}", flush=True)
            if self.c.checkpoint.every:
                self.save("rl", 0)
            return 0
        ray.get([t.load.remote(resume["path"]) for t in self.h.trainers])
        self.summary.update(resume["summary"])
        self.version = resume["version"]
        ray.get(self.h.buffer.load_state.remote({**resume["buffer"], "step": resume["step"]}))
        self.sync(self.version)
        return resume["step"]

    def rl(self, resume: dict[str, Any] | None = None) -> None:
        c = self.c
        first = self._rl_begin(resume)
        start = self.summary["rl_start_reward"]
        self.runs = [r.run.remote(cluster.BufferClient(self.h.buffer, i)) for i, r in enumerate(self.h.rollouts)]
        n = len(self.h.trainers)
        lags = []
        for step in range(first, c.rl.steps):
            t0 = time.perf_counter()
            batch = self.h.buffer.get_batch.options(num_returns=n).remote(step)
            batch = [batch] if n == 1 else batch  # num_returns=1 gives one ref, not a list
            # Trainer tasks wait here, not in the actors' queues: a replacement's weight sync needs them.
            self._wait(batch)
            outs = ray.get([t.train_step.remote(b) for t, b in zip(self.h.trainers, batch)])
            values = {**ray.get(self.h.buffer.step_stats.remote(step)), **outs[0], "rollout_restarts": self.restarts}
            if (step + 1) % c.rl.sync_every == 0:
                self.version = step + 1
                values.update(self.sync(self.version))
            every = c.eval.every_n_steps if isinstance(c.eval.every_n_steps, int) else c.rl.eval_every
            if every and (step + 1) % every == 0 and step + 1 < c.rl.steps:
                values["eval_reward"] = self.evaluate(f"rl-{step + 1}")
            values["step_seconds"] = time.perf_counter() - t0
            values["tokens_per_s"] = values.get("completion_tokens", 0) / values["step_seconds"]
            lags.append(values.get("lag_mean", 0.0))
            self.metrics.log("rl", step, values, c.rl.steps)
            if c.checkpoint.every and (step + 1) % c.checkpoint.every == 0 and step + 1 < c.rl.steps:
                self.save("rl", step + 1)
        self._heal()
        ray.get([r.stop.remote() for r in self.h.rollouts])
        ray.get(self.runs)
        self.runs = []
        if c.checkpoint.every:
            self.save("rl", c.rl.steps)
        if c.checkpoint.export_hf:
            ray.get([t.export_hf.remote(str(self.run_dir / "hf")) for t in self.h.trainers])
            print(f"exported the trained model to {self.run_dir / 'hf'}", flush=True)
        end = self.evaluate("rl-end")
        self.summary.update(rl_end_reward=end, lag_max=float(max(lags, default=0.0)))
        print(f"held-out greedy reward after RL: {end:.3f} (before RL {start:.3f}, gain {end - start:+.3f})",
              flush=True)

    def eval_stage(self) -> None:
        """Evaluation as a stage (`stages=[eval]`, or after training): the current policy on
        every environment's eval split; the summary gets the mean reward and pass@k."""
        self.sync(self.version)
        self.summary["eval_reward"] = reward = self.evaluate("eval")
        passes = {k: v for k, v in self.last_eval.items() if k.startswith("pass@")}
        self.summary["eval"] = {k: v for k, v in self.last_eval.items() if k != "tag"}
        shown = "  ".join(f"{k} {v:.3f}" for k, v in passes.items())
        print(f"held-out reward: {reward:.3f}  {shown}  (per example: {self.run_dir / 'eval_results.jsonl'})",
              flush=True)

    def close(self) -> None:
        if hasattr(self, "h"):
            cluster.teardown(self.h)
        self.metrics.close()
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))


def _failed(refs: list[Any], timeout: float | None) -> dict[int, RayError]:
    """The error of each of `refs` whose task raised (or did not finish within `timeout` s; None: wait)."""
    failed = {}
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=timeout)
        except RayError as e:
            failed[i] = e
    return failed


def run(c: Config) -> dict[str, Any]:
    ctl = Controller(c)
    try:
        ctl.start()
        resume = ctl.resume_point()
        todo = c.stages[c.stages.index(resume["stage"]):] if resume else c.stages
        for name in todo:
            if name == "rl":
                ctl.rl(resume)
            else:
                {"sft": ctl.sft, "eval": ctl.eval_stage}[name]()
    finally:
        ctl.close()
    print(f"run folder: {ctl.run_dir.resolve()}", flush=True)
    return ctl.summary
