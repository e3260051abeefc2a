"""The colocated plan (`cluster.colocate`): memory per device in each phase of the turns, the handover's buffer.

Contract, for a `rlray.orchestration.plan.Plan` (GB per device; estimates, like the plan's):
- `phases(plan)`: "train" (the trainer at its peak; the engines asleep hold nothing on the GPU),
  "handover" (the trainer's resident state, without activations and logits, and without AdamW state
  when trainer.offload_optimizer, which leaves before the engines wake; the engines' weights awake; on
  GPUs vLLM's ipc buffer on the trainer's side and its clone in the engine), "generate" (the trainer's
  resident state beside the engine awake: kv_cache_fraction of the GPU, or its weights, KV cache and
  reserve) and "both" (nothing asleep, async.max_off_policy_steps=1: trainer and engine at their peaks,
  the handover's buffers too). On CPU, with no sleep mode and a shared-memory handover, "both" is their sum.
- `handover(plan)`: (bytes of the ipc buffer, or None with the one-line problem) on GPUs, (0, None) on CPU.
- `problems(plan)`: what does not fit, one line each with a fix, and sleep level 2 refused when the
  engines hold what no sync refills (`unsent`: persistent buffers such as GLM's `e_score_correction_bias`,
  a parameter in vLLM; a frozen vision tower); `lines(plan)`: what `render()` prints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlray.weightsync.handover import handover_bytes

if TYPE_CHECKING:
    from rlray.orchestration.plan import Plan

GB = 1e9
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ENGINE_RESERVE_GB = 2.0  # vLLM's activation peak per GPU, beside weights and KV


def handover(plan: Plan) -> tuple[int | None, str | None]:
    if not plan.on_gpu:
        return 0, None
    name, elements = plan.shape.largest
    wire = BYTES.get(str(plan.c.rollout.dtype), 2)
    bucket = plan.c.weights.bucket_mb
    try:
        return handover_bytes(bucket and bucket << 20, [(name, elements * wire)]), None
    except ValueError as e:
        return None, f"cluster.colocate=true: {e}"


def _engine_awake_gb(plan: Plan) -> float:
    """The engine worker's share of its device while awake (vLLM's fraction on GPU; weights + KV on CPU)."""
    r, e = plan.c.rollout, plan.engine
    if plan.on_gpu and r.kv_cache_gb <= 0:
        return r.kv_cache_fraction * plan.c.cluster.gpu_memory_gb
    return (e["weights"] + e["KV cache"]) / GB + (ENGINE_RESERVE_GB if plan.on_gpu else 0.0)


def phases(plan: Plan) -> dict[str, float]:
    t = plan.trainer
    trainer, engine = sum(t.values()) / GB, _engine_awake_gb(plan)
    resident = trainer - (t["activations"] + t["logits"]) / GB
    if plan.c.trainer.offload_optimizer:
        resident -= t.get("AdamW state", 0.0) / GB
    buffers = 2 * (handover(plan)[0] or 0) / GB  # the trainer's, and the engine's clone of it
    return {"train": trainer, "handover": resident + plan.engine["weights"] / GB + buffers,
            "generate": resident + engine, "both": trainer + engine + buffers}


def overlap_fits(plan: Plan) -> bool:
    """Whether trainer and engine fit a device at once (what async.max_off_policy_steps=1 needs colocated)."""
    return not plan.on_gpu or phases(plan)["both"] <= plan.c.cluster.gpu_memory_gb


def unsent(plan: Plan) -> list[str]:
    """What the engines hold that no weight sync refills: persistent buffers, and a frozen vision tower."""
    tower = plan.c.trainer.freeze_vision and plan.shape.tower_params
    return list(plan.shape.buffers) + (["the vision tower (trainer.freeze_vision=true)"] if tower else [])


def problems(plan: Plan) -> list[str]:
    problem = handover(plan)[1]
    if problem is not None:
        return [problem]
    missing = unsent(plan)
    if plan.c.rollout.sleep_level == 2 and missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return [(f"rollout.sleep_level=2 discards the engines' weights and a sync refills only what the trainer sends, "
                 f"which leaves out {missing[0]}{more} (wrong outputs, no error); set rollout.sleep_level=1")]
    p, mem = phases(plan), plan.c.cluster.gpu_memory_gb
    turns = {k: v for k, v in p.items() if k != "both"}
    over = [k for k, v in turns.items() if v > mem]
    if len(over) == len(turns):
        return [(f"cluster.colocate=true: the train phase needs ~{p['train']:.0f} GB, the handover ~{p['handover']:.0f} "
                 f"GB and the generate phase ~{p['generate']:.0f} GB per GPU but cluster.gpu_memory_gb={mem:g}; raise "
                 "trainer.num_ranks (each rank's share shrinks) or lower rollout.kv_cache_fraction and "
                 "trainer.micro_batch_tokens")]
    fixes = {"train": "raise trainer.num_ranks or lower trainer.micro_batch_tokens",
             "handover": "raise trainer.num_ranks, or set trainer.offload_optimizer=true",
             "generate": "lower rollout.kv_cache_fraction or set trainer.offload_optimizer=true"}
    return [(f"cluster.colocate=true: the {k} phase needs ~{p[k]:.0f} GB per GPU but cluster.gpu_memory_gb={mem:g}; "
             f"{fixes[k]}") for k in over]


def weight_sync_line(plan: Plan) -> str:
    """How the handover moves the weights (GPU: vLLM's ipc buffer and what sized it)."""
    size = handover(plan)[0]
    if size is None:
        return "ipc, weights.bucket_mb too small for the largest tensor (see the problem below)"
    name, elements = plan.shape.largest
    wire = elements * BYTES.get(str(plan.c.rollout.dtype), 2)
    default, tensor = handover_bytes(None, []), f"{name}, {wire / 2**20:.0f} MiB in {plan.c.rollout.dtype}"
    how = (f"weights.bucket_mb; the largest tensor: {tensor}" if plan.c.weights.bucket_mb else
           f"vLLM's default; the largest tensor: {tensor}" if size == default else
           f"sized to the largest tensor, {tensor}; vLLM's default is {default >> 20} MiB")
    return f"ipc, a packed buffer of {size / 2**20:.0f} MiB on each trainer GPU ({how}), each chunk cloned in the engine"


def lines(plan: Plan) -> list[str]:
    p, k = phases(plan), plan.c.async_.max_off_policy_steps
    if not plan.on_gpu:
        return [(f"memory per colocated bundle (CPU: no sleep mode, so their sum): {p['both']:.2f} GB; "
                 f"async.max_off_policy_steps={k}" + (": both resident, generation overlaps training" if k else
                                                       ": generation pauses while the trainer trains"))]
    size = handover(plan)[0] or 0
    buffers = f"the ipc buffer, {size / GB:.2f} GB, on each side"
    if k:
        return [(f"memory per GPU (colocated, both resident: async.max_off_policy_steps=1): {p['both']:.1f} GB, "
                 f"{buffers} included")]
    return [(f"memory per GPU (colocated, taking turns, vLLM sleep mode level {plan.c.rollout.sleep_level}): train "
             f"phase {p['train']:.1f} GB, handover {p['handover']:.1f} GB (the engine's weights and {buffers}), generate "
             f"phase {p['generate']:.1f} GB" + (" (optimizer state in host memory)" if plan.c.trainer.offload_optimizer
                                                else "") + f"; peak {max(p['train'], p['handover'], p['generate']):.1f} GB")]
