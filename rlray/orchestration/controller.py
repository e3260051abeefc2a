"""The driver loop: stages (sft, rl, eval), steps, weight sync and evaluation.

Contract: `run(config) -> summary` creates the run folder (resolved config,
metrics.jsonl, eval samples), connects to Ray, spawns the actors, opens the weight
group, then runs `config.stages` in order and tears everything down. The rollout actors,
their weight group, syncs and RL loops are a `RolloutFleet` (rlray.orchestration.fleet), which replaces a
rollout actor that dies or whose engine dies, up to `rollout.max_restarts` times; training
waits meanwhile and loses no step. An RL step whose batch is not complete within
`rl.batch_timeout_s` (restarted by a replacement) fails with one line naming the step, the
groups queued and each rollout actor's last error. With
`checkpoint.every` set, RL commits a checkpoint (trainer DCP shards, policy version,
buffer counters, every file's checksum) at its start and every that many steps (with
`checkpoint.async_save` written while training goes on, committed between steps once written, the last
one waited for at RL's end, a preemption, or a failed run's close); a later run with
the same run folder resumes from the newest committed one whose files verify and load (a damaged
one is set aside, one line each: rlray.orchestration.checkpoint; an interrupted SFT restarts). A run
folder that holds a finished run (rlray.orchestration.checkpoint.finished) is said so in one line
before anything starts; one stopped after RL's last checkpoint does only the export and evaluation. The
controller moves object references and version numbers; rollouts and batches go
from actor to actor (SFT batches, built from the dataset here, are put once).
The summary holds the held-out rewards (greedy unless eval.temperature > 0) after SFT and at the end of RL.
Colocated (`cluster.colocate`) is this loop with turns when async.max_off_policy_steps=0: the engines
sleep before every training step and wake around the sync that follows (`sync`); with 1, both stay
resident and overlap as in the disaggregated layout.
On-policy distillation (algo.loss=opd) adds a teacher pool (rlray.orchestration.teachers): the buffer
has each arriving group scored by a teacher; a teacher that dies is replaced while steps wait, as a
rollout actor is (`teacher_restarts` in the metrics).
With rollout.max_actors the rollout pool is elastic (rlray.orchestration.elastic): engines join as nodes
can place them and leave with their nodes (`rollout_actors`, `rollout_joins`, `rollout_leaves`).
Every run ends, failed ones too, with its curves drawn into `curves.png` (rlray.plot).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import ray
import yaml
from ray.exceptions import RayError

from rlray.actors.rollout import resolve_chat_template
from rlray.algo.loss import resolve
from rlray.config import Config
from rlray.config.resources import needs
from rlray.data.packing import pack
from rlray.envs import load_envs
from rlray.envs.images import vision_prompt
from rlray.envs.sft import SFTData
from rlray.models.catalog import read_config
from rlray.models.multimodal import is_vision
from rlray.models.tiny import model_path
from rlray.orchestration import checkpoint, cluster, preemption, recovery
from rlray.orchestration.calls import get_all
from rlray.orchestration.fleet import RolloutFleet
from rlray.orchestration.metrics import Metrics
from rlray.orchestration.teachers import TeacherPool


def _config_dict(c: Config) -> dict[str, Any]:
    d = dataclasses.asdict(c)
    d["async"] = d.pop("async_")
    return d


class Controller:
    def __init__(self, c: Config) -> None:
        resolve(c.algo)  # the loss's preset; launch has resolved it already (a second call changes nothing)
        self.c = c
        self.run_dir = Path(c.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(_config_dict(c), sort_keys=False))
        from transformers import AutoTokenizer

        path = model_path(c.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        template = resolve_chat_template(c.env, self.tokenizer)
        vision = vision_prompt(path, template, c.rollout.max_images) if is_vision(read_config(path)) else None
        self.sft_data = SFTData(load_envs(c.env), self.tokenizer, template, c.run.seed, vision)
        self.metrics = Metrics(self.run_dir, c.logging, _config_dict(c))
        self.summary: dict[str, Any] = {"run_dir": str(self.run_dir)}
        self.ckpt_root = self.run_dir / "checkpoints"
        self.version = 0  # the trainer's policy version: optimizer steps taken in RL
        self.evals = 0  # evaluations logged so far
        self.last_eval: dict[str, Any] = {}  # the latest evaluation's logged values
        self._h: cluster.Handles | None = None
        self._fleet: RolloutFleet | None = None
        self.teachers: TeacherPool | None = None  # algo.loss=opd
        self.checkpoints = checkpoint.Checkpoints(self.ckpt_root, [], c.checkpoint.keep, c.checkpoint.async_save,
                                                  c.trainer.collective_timeout_s)  # its trainers: start()
        self.checkpointing = bool(c.checkpoint.every or c.checkpoint.every_s)
        self.saved_at = time.monotonic()  # of the last checkpoint (checkpoint.every_s)
        self.trainer_restarts = 0  # trainer groups re-created after a lost rank (rlray.orchestration.recovery)

    @property
    def h(self) -> cluster.Handles:
        assert self._h is not None, "Controller.start() spawns the actors"
        return self._h

    @property
    def fleet(self) -> RolloutFleet:
        assert self._fleet is not None, "Controller.start() spawns the rollout actors"
        return self._fleet

    # ---- set-up -------------------------------------------------------------------
    def start(self) -> None:
        cluster.connect(self.c.cluster, self.c.logging.verbose, self.c.env.python_path)
        preemption.rearm()  # ray.init replaced the driver's SIGTERM handler with its own
        cluster.check_resources(*needs(self.c))
        t0 = time.perf_counter()
        self._h = cluster.spawn(self.c, pad_id=self.tokenizer.pad_token_id)
        self.teachers = TeacherPool(self.c, self.h) if self.h.teachers else None
        setups = [t.setup.remote(self.h.master) for t in self.h.trainers]
        if self.c.cluster.colocate and self.c.trainer.gpus_per_rank:
            # vLLM profiles its GPU's memory as it starts: memory another process frees meanwhile fails its
            # assertion, memory it takes shrinks the KV cache; the trainers are built first
            ray.get(setups)
        ray.get(setups + [r.start.remote() for r in self.h.rollouts] + (self.teachers.start_refs() if self.teachers else []))
        if self.teachers:
            self.teachers.start()
        self._fleet = RolloutFleet(self.c, self.h)
        world = self.fleet.open()
        self.checkpoints.trainers = self.h.trainers
        teachers = f", {len(self.h.teachers)} teacher(s) of {self.c.teacher.name}" if self.teachers else ""
        print(f"actors ready in {time.perf_counter() - t0:.1f}s: {len(self.h.trainers)} trainer ranks, "
              f"{len(self.h.rollouts)} rollout actor{'' if len(self.h.rollouts) == 1 else 's'}, weight group of "
              f"{world}{teachers}", flush=True)

    # ---- colocated turns (cluster.colocate with async.max_off_policy_steps=0) -------------------
    @property
    def turns(self) -> bool:
        """Whether the engines and the trainer take turns on their shared devices (rlray.config.colocation)."""
        return self.c.cluster.colocate and self.c.async_.max_off_policy_steps == 0

    def _train_turn(self) -> None:
        """The engines make room (a no-op when asleep already), the optimizer state comes back."""
        if self.turns:
            self.fleet.sleep()
            if self.c.trainer.offload_optimizer:
                ray.get([t.offload_optimizer.remote(False) for t in self.h.trainers])

    def sync(self, version: int) -> dict[str, float]:
        """The trainer's weights into every engine, labelled `version`. Taking turns, the trainer first makes
        room (the optimizer state to host memory with trainer.offload_optimizer, the train step's cached
        blocks back to the device), then the engines wake for the handover (weights first: a level-2 engine
        needs room only for what it fills), the trainer returns the handover's buffer, and the KV cache wakes."""
        if not self.turns:
            return self.fleet.sync(version)
        t0 = time.perf_counter()
        ray.get([t.make_room.remote(self.c.trainer.offload_optimizer) for t in self.h.trainers])
        self.fleet.wake(["weights"])
        values = self.fleet.sync(version)
        ray.get([t.make_room.remote(False) for t in self.h.trainers])
        self.fleet.wake()
        return {**values, "handover_seconds": time.perf_counter() - t0}

    def _wait(self, refs: list[Any], step: int) -> None:
        """Wait until `refs` (step `step`'s batch) are ready while the fleet replaces lost actors."""
        timeout = self.c.rl.batch_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            if preemption.requested():
                raise preemption.Preempted
            if self.fleet.heal(self.version) or (self.teachers and self.teachers.heal()):
                deadline = time.monotonic() + timeout
            if len(ray.wait(refs, num_returns=len(refs), timeout=min(1.0, timeout))[0]) == len(refs):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(self._starved(step))

    def _starved(self, step: int) -> str:
        queued = ray.get(self.h.buffer.queued.remote(step), timeout=10)
        needed = self.c.rl.batch_size // self.c.rollout.group_size
        last = "; ".join(f"{name}: {err or 'none'}" for name, err in self.fleet.last_errors().items())
        return (f"RL step {step} waited rl.batch_timeout_s={self.c.rl.batch_timeout_s:g}s for its batch: "
                f"{queued} of {needed} groups queued; last errors: {last}{self._teacher_state()}{self.fleet.pool_line()}. "
                "Raise rl.batch_timeout_s if rollouts are just slow")

    def _teacher_state(self) -> str:
        if not self.teachers:
            return ""
        t = ray.get(self.h.buffer.teacher_state.remote(), timeout=10)
        return f"; teachers: {t['scoring']} groups being scored, last scoring error: {t['last_error'] or 'none'}"

    def evaluate(self, tag: str, at: int) -> float:
        """Every environment's eval split on the rollout actors (`eval.num_samples` per example).

        Appends one record per example (prompt, answer, completions, rewards, errors) to
        `eval_results.jsonl`, logs an `eval` record (mean reward, pass@k, per environment when
        several) to the metrics, and returns the mean reward over every sample.
        """
        from rlray.envs.evaluation import summarize

        e = self.c.eval
        records = self.fleet.evaluate(self.version, e.num_examples, e.num_samples, e.temperature, e.max_tokens)
        records.sort(key=lambda rec: (rec["env"], rec["example"]))
        with (self.run_dir / "eval_results.jsonl").open("a") as f:
            for rec in records:
                f.write(json.dumps({"tag": tag, **rec}) + "\n")
        overall = summarize(records, e.pass_k, e.pass_threshold)
        values: dict[str, Any] = {"tag": tag, "at": at, "eval_reward": overall["reward_mean"],
                                  **{k: v for k, v in overall.items() if k != "reward_mean"}}
        envs = sorted({rec["env"] for rec in records})
        if len(envs) > 1:
            for env in envs:
                per_env = summarize([rec for rec in records if rec["env"] == env], e.pass_k, e.pass_threshold)
                values.update({f"{env}/{k}": v for k, v in per_env.items()})
        self.evals += 1
        self.metrics.log("eval", self.evals - 1, values)
        self.last_eval = values
        return overall["reward_mean"]

    # ---- stages -------------------------------------------------------------------
    def _sft_batch(self, step: int) -> list[list]:
        samples = self.sft_data.batch(step, self.c.sft.batch_size)
        t = self.c.trainer
        return pack(samples, len(self.h.trainers), t.micro_batch_tokens, self.tokenizer.pad_token_id, t.packing, t.cp)

    def sft(self) -> None:
        s = self.c.sft
        ray.get([t.set_stage.remote(s.lr, s.warmup_steps, "sft") for t in self.h.trainers])
        reward = 0.0
        for step in range(s.max_steps):
            if preemption.requested():
                self.summary["preempted"] = {"signal": preemption.requested(), "stage": "sft", "step": step}
                return
            t0 = time.perf_counter()
            per_rank = self._sft_batch(step)
            self._train_turn()
            out = ray.get([t.sft_step.remote(mbs) for t, mbs in zip(self.h.trainers, per_rank)])[0]
            values = {"loss": out["loss"], "step_seconds": time.perf_counter() - t0}
            last = step + 1 == s.max_steps
            if (step + 1) % s.eval_every == 0 or last:
                values.update(self.sync(0))
                values["eval_reward"] = reward = self.evaluate(f"sft-{step + 1}", step + 1)
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
        path = self.checkpoints.save(stage, step, {"version": self.version, "summary": self.summary,
                                                   "buffer": ray.get(self.h.buffer.state.remote())})
        self.saved_at = time.monotonic()
        how = "; committed when written" if self.checkpoints.pending else ""
        print(f"checkpoint {path} ({time.perf_counter() - t0:.1f}s{how})", flush=True)

    def resume_point(self) -> dict[str, Any] | None:
        """The newest committed checkpoint whose files verify (damaged ones set aside, one line each)."""
        found = self.checkpoints.newest() if self.c.checkpoint.resume else None
        if found is not None:
            print(f"resuming from {found['path']}: stage {found['stage']}, step {found['step']}", flush=True)
        return found

    def _rl_begin(self, resume: dict[str, Any] | None) -> int:
        ray.get([t.set_stage.remote(self.c.trainer.lr, 0, "rl") for t in self.h.trainers])
        if resume is None:
            self.version = 0
            self.sync(0)
            start = self.evaluate("rl-start", 0)
            self.summary["rl_start_reward"] = start
            print(f"held-out {self._eval_kind()} reward before RL: {start:.3f}", flush=True)
            if self.checkpointing:
                self.save("rl", 0)
            return 0
        resume, digest = self.checkpoints.load(resume)
        self.summary.update(resume["summary"])
        self.summary["resumed_weights"] = digest
        self.summary["checkpoints_set_aside"] = self.checkpoints.set_aside
        self.version = resume["version"]
        ray.get(self.h.buffer.load_state.remote({**resume["buffer"], "step": resume["step"]}))
        self.sync(self.version)
        return resume["step"]

    def _check_mismatch(self, step: int, values: dict[str, Any]) -> None:
        """A step over `rl.mismatch_kl_budget` is counted (`mismatch_over_budget`) and named in one line."""
        budget, kl = self.c.rl.mismatch_kl_budget, values.get("mismatch_kl")
        if budget is None or kl is None:
            return
        over = self.summary.get("mismatch_over_budget", 0) + (kl > budget)
        self.summary["mismatch_over_budget"] = values["mismatch_over_budget"] = over
        if kl > budget:
            agree = values.get("router_agreement")
            print(f"warning: step {step}: mismatch_kl {kl:.2e} over rl.mismatch_kl_budget={budget:g}"
                  + (f" (router_agreement {agree:.3f}; trainer.router_replay={self.c.trainer.router_replay})"
                     if agree is not None else "") + ": the engine and the trainer disagree more than this recipe "
                  "was measured to; check rollout.dtype, trainer.param_dtype and trainer.router_replay", flush=True)

    def rl(self, resume: dict[str, Any] | None = None) -> None:
        """RL to rl.steps, its checkpoint, the export and the final evaluation; resumed at rl.steps (a run stopped
        after its last checkpoint), only the export (when missing) and the evaluation."""
        c = self.c
        step = self._rl_begin(resume)
        start = self.summary["rl_start_reward"]
        lags: list[float] = []
        final = step >= c.rl.steps
        if not final:
            self.fleet.start()
        while step < c.rl.steps:
            try:
                if preemption.requested():
                    return self._preempted(step)
                lags.append(self._rl_step(step))
                step += 1
            except preemption.Preempted:
                continue
            except (RayError, RuntimeError) as e:
                lost = recovery.lost_trainers(self.h.trainers)
                if not lost:
                    raise
                step = recovery.recover(self, step, lost, e)
        if not final:
            self.fleet.stop(self.version)
            if self.checkpointing:
                self.save("rl", c.rl.steps)
        self.checkpoints.wait()
        if c.checkpoint.export_hf and not (final and checkpoint.exported(self.run_dir, c.trainer.lora.enabled)):
            ray.get([t.export_hf.remote(str(self.run_dir / "hf"), c.checkpoint.export_merged) for t in self.h.trainers])
            what = "the trained LoRA adapter (PEFT) and its base" if c.trainer.lora.enabled else "the trained model"
            print(f"exported {what} to {self.run_dir / 'hf'}", flush=True)
        end = self.evaluate("rl-end", c.rl.steps)
        self.summary.update(rl_end_reward=end, lag_max=float(max(lags, default=0.0)))
        print(f"held-out {self._eval_kind()} reward after RL: {end:.3f} (before RL {start:.3f}, gain {end - start:+.3f})",
              flush=True)

    def _preempted(self, step: int) -> None:
        """A preemption signal: the checkpoint of the step the run is at, then stop (rlray.orchestration.preemption)."""
        self.fleet.stop(self.version)
        self.save("rl", step)
        self.checkpoints.wait()
        self.summary["preempted"] = {"signal": preemption.requested(), "stage": "rl", "step": step}

    def _rl_step(self, step: int) -> float:
        """One RL step: its batch, the train step, the sync, evaluation and checkpoint when due; its lag."""
        c, n, t0 = self.c, len(self.h.trainers), time.perf_counter()
        batch = self.h.buffer.get_batch.options(num_returns=n).remote(step)
        batch = [batch] if n == 1 else batch  # num_returns=1 gives one ref, not a list
        # Trainer tasks wait here, not in the actors' queues: a replacement's weight sync needs them.
        self._wait(batch, step)
        self._train_turn()
        outs = get_all([t.train_step.remote(b) for t, b in zip(self.h.trainers, batch)])
        self.checkpoints.poll()  # the checkpoint written in the background meanwhile, committed
        self.version = step + 1
        values = {**ray.get(self.h.buffer.step_stats.remote(step)), **outs[0],
                  "rollout_restarts": self.fleet.restarts, "trainer_restarts": self.trainer_restarts,
                  **self.fleet.pool_stats(),
                  **({"teacher_restarts": self.teachers.restarts} if self.teachers else {})}
        if (step + 1) % c.rl.sync_every == 0:
            values.update(self.sync(self.version))
        every = c.eval.every_n_steps  # interpolations are resolved once, in rlray.config.compose.to_config
        if every and (step + 1) % every == 0 and step + 1 < c.rl.steps:
            values["eval_reward"] = self.evaluate(f"rl-{step + 1}", step + 1)
        values["step_seconds"] = time.perf_counter() - t0
        values["train_tokens_per_s"] = values.get("completion_tokens", 0) / values["step_seconds"]
        self._check_mismatch(step, values)
        self.metrics.log("rl", step, values, c.rl.steps)
        k = c.checkpoint
        due = (k.every and (step + 1) % k.every == 0) or (k.every_s and time.monotonic() - self.saved_at >= k.every_s)
        if due and step + 1 < c.rl.steps:
            self.save("rl", step + 1)
        return values.get("lag_mean", 0.0)

    def _eval_kind(self) -> str:
        e = self.c.eval
        return "greedy" if e.temperature == 0 else f"sampled (temperature {e.temperature:g}, {e.num_samples} per example)"

    def eval_stage(self) -> None:
        """Evaluation as a stage (`stages=[eval]`, or after training): the current policy on
        every environment's eval split; the summary gets the mean reward and pass@k."""
        self.sync(self.version)
        self.summary["eval_reward"] = reward = self.evaluate("eval", self.version)
        passes = {k: v for k, v in self.last_eval.items() if k.startswith("pass@")}
        self.summary["eval"] = {k: v for k, v in self.last_eval.items() if k != "tag"}
        shown = "  ".join(f"{k} {v:.3f}" for k, v in passes.items())
        print(f"held-out reward: {reward:.3f}  {shown}  (per example: {self.run_dir / 'eval_results.jsonl'})",
              flush=True)

    def close(self) -> None:
        if self._h is not None:
            self.checkpoints.settle()  # a failed run's last checkpoint, when its write ends
            cluster.teardown(self._h)
            cluster.collect_logs(self.run_dir / "logs")
        self.metrics.close()
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))


def run(c: Config) -> dict[str, Any]:
    done = c.checkpoint.resume and checkpoint.finished(Path(c.run.dir), c.stages, c.rl.steps, c.checkpoint.export_hf,
                                                       c.trainer.lora.enabled)
    if done:  # decided from disk: no Ray, no actor, no wandb run
        print(done, flush=True)
        return {**json.loads((Path(c.run.dir) / "summary.json").read_text()), "finished_already": True}
    ctl = Controller(c)
    try:
        ctl.start()
        resume = ctl.resume_point()
        todo = c.stages[c.stages.index(resume["stage"]):] if resume else c.stages
        for name in todo:
            if "preempted" in ctl.summary:
                break
            if name == "rl":
                ctl.rl(resume)
            else:
                {"sft": ctl.sft, "eval": ctl.eval_stage}[name]()
    finally:
        ctl.close()
        _plot(ctl.run_dir)
    print(f"run folder: {ctl.run_dir.resolve()}", flush=True)
    return ctl.summary


def _plot(run_dir: Path) -> None:
    """The run's curves (rlray.plot) into the run folder, also after a failed run; a run with
    nothing logged yet has nothing to draw, which is said and is no error."""
    from rlray.plot import plot_run

    try:
        print(f"curves: {plot_run(run_dir).removeprefix('wrote ')}", flush=True)
    except ValueError as e:
        print(f"curves: none ({e})", flush=True)
