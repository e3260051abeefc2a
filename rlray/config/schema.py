"""The configuration schema: one dataclass per section, every default, and the device defaults.

Contract: `Config` holds one typed section per component (each component is handed only its
own). A section's keys left unset take their device's default where they have one
(`RolloutConfig.CPU_DEFAULTS` / `GPU_DEFAULTS`, `TrainerConfig.param_dtype`) when the section is
built; the algorithm's presets are applied by rlray.algo (config knows no algorithm, except that
`rollout.temperature` defaults to 1 under algo.loss=opd, whose teacher scores at temperature 1). User errors
are `ConfigError`, one line naming the key and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import II


class ConfigError(ValueError):
    """A user error in the configuration; the message names the key and the fix."""


@dataclass
class ModelConfig:
    name: str = "tiny"  # "tiny" builds a random-weight model of `arch`; else an HF id or path
    arch: str | None = None  # a tiny model's family (rlray.config.families; None: qwen3); else the model's own
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 128
    tie_word_embeddings: bool = False
    init_std: float = 0.02  # a tiny model's weight init (transformers' initializer_range)
    seed: int = 0


@dataclass
class LoraConfig:
    """trainer.lora: low-rank adapters on a frozen base (PEFT); rank 0 trains the full weights."""

    rank: int = 0
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # must be 0 in RL: the engine samples without dropout
    # module names (the last part of the name); null: every attention and dense-MLP projection the model
    # has (DEFAULT_TARGETS). MoE experts never take an adapter (rlray.models.lora)
    target_modules: list[str] | None = None
    # the frozen base's dtype; null: trainer.param_dtype, or float32 when the sft stage trains the base
    # (with LoRA, SFT trains the full weights and RL the adapters on that base)
    base_dtype: str | None = None

    DEFAULT_TARGETS: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class TrainerConfig:
    num_ranks: int = 2
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    lr: float = 1e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 8192  # tokens per micro-batch row (packed: several sequences, no padding)
    packing: bool = True  # False: one right-padded row per sequence (the baseline packing is measured against)
    param_dtype: str | None = None  # compute dtype; None: bfloat16 on GPUs, float32 on CPU (masters stay fp32)
    ep: int = 1  # expert parallelism: ranks that split each MoE layer's experts (divides num_ranks)
    cp: int = 1  # context parallelism: ranks that split each sequence (divides num_ranks; they share a batch)
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    router_replay: bool = False  # MoE (R3): every token goes through the experts the engine routed it to
    freeze_vision: bool = False  # a vision-language model: its vision tower is not trained (nor synced)
    lora: LoraConfig = field(default_factory=LoraConfig)
    node_labels: dict[str, str] = field(default_factory=dict)  # ranks only on Ray nodes with these labels
    # cluster.colocate on GPUs: the optimizer state waits in host memory while the engines generate
    offload_optimizer: bool = False
    max_nonfinite_steps: int = 3  # NaN/inf loss or gradient: the step is skipped; this many in a row stop the run
    # a lost trainer rank: the trainer group is re-created from the newest checkpoint this many times in all
    max_restarts: int = 2
    # The trainer's own process group (FSDP, EP and CP collectives, the HF export's exchanges and barriers):
    # a collective waits at most this long before it fails. Apart from the weight group's timeouts.
    collective_timeout_s: float = 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.param_dtype is None:
            self.param_dtype = "bfloat16" if self.gpus_per_rank > 0 else "float32"


@dataclass
class RolloutConfig:
    num_actors: int = 1  # with max_actors: the minimum the pool keeps (README "Elastic rollout pool")
    # None: exactly num_actors engines. Else the pool grows to this many as nodes join (an engine bundle
    # placed: KubeRay's autoscaler, `ray start --address`) and shrinks when an engine's node is gone
    max_actors: int | None = None
    scale_every_s: float = 30.0  # with max_actors: how often the pool looks for a placed engine bundle
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    group_size: int = 8
    # None: DEFAULT_TEMPERATURE, or 1 under algo.loss=opd (the teacher's prompt logprobs are temperature 1)
    temperature: float | None = None
    max_tokens: int = 16
    max_model_len: int = 128
    # None below: the engine's device default (GPU_DEFAULTS when gpus_per_actor > 0, else CPU_DEFAULTS)
    dtype: str | None = None  # vLLM's weights and compute (vLLM's GPU attention refuses float32)
    enforce_eager: bool | None = None  # True skips torch.compile and CUDA graphs (fast start, tiny CPU models)
    kv_cache_fraction: float | None = None  # share of the GPU (CPU: of RAM) for weights + KV cache
    kv_cache_gb: float | None = None  # > 0: an exact KV-cache size, what the CPU backend needs; 0: by the fraction
    tensor_parallel_size: int = 1  # tensor-parallel workers per engine: = gpus_per_actor on GPUs, <= cpus_per_actor on CPU
    data_parallel_size: int = 1  # vLLM data-parallel replicas inside each engine (an engine core each), x TP workers
    expert_parallel: bool = False  # vLLM's expert parallelism across the TP workers (GPU engines only)
    quantization: str = ""  # "fp8": vLLM serves FP8 weights quantized from each sync's bf16 ones (GPU only)
    max_concurrent_groups: int = 64
    max_images: int = 4  # a vision-language model: images per prompt (vLLM's limit_mm_per_prompt)
    max_restarts: int = 3  # rollout actors replaced after a crash during RL, in all; 0: a crash ends the run
    node_labels: dict[str, str] = field(default_factory=dict)  # engines only on Ray nodes with these labels
    max_failed_groups: int = 3  # an engine failing this many groups in a row is replaced like a dead one
    # cluster.colocate on GPUs, while the trainer trains: vLLM's sleep mode level 1 (weights to host memory,
    # KV cache dropped) or 2 (both dropped; the next sync refills the weights)
    sleep_level: int = 1
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    CPU_DEFAULTS: ClassVar[dict[str, Any]] = {"dtype": "float32", "enforce_eager": True, "kv_cache_fraction": 0.05,
                                              "kv_cache_gb": 0.25}
    GPU_DEFAULTS: ClassVar[dict[str, Any]] = {"dtype": "bfloat16", "enforce_eager": False, "kv_cache_fraction": 0.85,
                                              "kv_cache_gb": 0.0}
    DEFAULT_TEMPERATURE: ClassVar[float] = 0.7

    def __post_init__(self) -> None:
        _device_defaults(self, self.gpus_per_actor)


def _device_defaults(section: Any, gpus: float) -> None:
    """An engine section's keys left None take their device's default (RolloutConfig.*_DEFAULTS); `defaulted`
    names them (a family may need another CPU dtype: Config.__post_init__)."""
    defaults = RolloutConfig.GPU_DEFAULTS if gpus > 0 else RolloutConfig.CPU_DEFAULTS
    section.defaulted = {key for key in defaults if getattr(section, key) is None}
    for key in section.defaulted:
        setattr(section, key, defaults[key])


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher pool (algo.loss=opd): vLLM engines that only score the student's
    rollouts (prompt logprobs), never generate and never take a weight sync. README "Distillation"."""

    name: str = ""  # an HF id or local folder (a run's exported hf/); "": no teacher
    num_actors: int = 1
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    tensor_parallel_size: int = 1  # = gpus_per_actor on GPUs
    max_model_len: int = II("rollout.max_model_len")  # the student's prompt + completion must fit
    # None below: the device default, as for rollout.*
    dtype: str | None = None
    enforce_eager: bool | None = None
    kv_cache_fraction: float | None = None
    kv_cache_gb: float | None = None
    max_restarts: int = 3  # teacher actors replaced after a crash, in all; 0: a crash ends the run
    node_labels: dict[str, str] = field(default_factory=dict)  # teacher engines only on Ray nodes with these labels
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _device_defaults(self, self.gpus_per_actor)

    @property
    def enabled(self) -> bool:
        return bool(self.name)


@dataclass
class AlgoConfig:
    """The RL objective. Keys left None take `algo.loss`'s paper preset when the config is resolved
    (rlray.algo.loss.resolve, which also validates every key and lists the keys it set in `from_preset`)."""

    loss: str = "grpo"
    # None: the loss's paper preset
    aggregation: str | None = None  # token | sequence | constant (Dr.GRPO's sum / (G * L_max))
    std_normalize: bool | None = None
    eps_low: float | None = None
    eps_high: float | None = None
    filter_zero_advantage: bool | None = None  # DAPO dynamic sampling: drop groups whose rewards are all equal
    mismatch_kl_coef: float | None = None  # coefficient of (log pi_train/pi_infer)^2 (Kimi K2.5; dppo_tv)
    ratio_cap: float | None = None  # dppo_tv: kept tokens' ratio is capped here (0: no cap)
    # the rest is read by rlray.algo (see the README's "RL objectives" table)
    std_eps: float = 1e-4
    ratio_correction: str = "clip"  # clip: PPO-clipped ratio; mask: drop tokens outside the band
    mini_batches: int = 1  # optimizer steps per batch, each on 1/mini_batches of its sequences
    epochs: int = 1  # passes over the batch's mini-batches
    baseline: str = "mean"  # mean: group mean; rloo: leave-one-out mean
    max_tokens: int = II("rollout.max_tokens")  # L_max of Dr.GRPO's normaliser and DAPO's overlong penalty
    overlong_filter: bool = False  # DAPO: completions cut at max_tokens (finish_reason "length") get no loss
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N tokens before max_tokens (0: off)
    overlong_penalty: float = 1.0  # reward penalty at max_tokens
    correction: str = "none"  # inference/trainer mismatch: none | tis (truncate) | mis (mask)
    correction_level: str = "token"  # token | sequence (product) | geometric (mean of log ratios)
    correction_low: float = 0.0  # mis: mask weights below this
    correction_high: float = 2.0  # tis: truncate at this; mis: mask weights above this
    kl_coef: float = 0.0  # k3 KL to a frozen reference model (the policy at the first RL step); 0: no reference
    opd_reward_coef: float = 0.0  # opd: weight of the environment's group advantage beside the teacher's (0: teacher alone)


@dataclass
class AsyncConfig:
    max_off_policy_steps: int = 1


@dataclass
class SFTConfig:
    max_steps: int = 200
    batch_size: int = 128
    lr: float = 1e-3
    warmup_steps: int = 50
    stop_reward: float = 0.7
    eval_every: int = 10


@dataclass
class RLConfig:
    steps: int = 300
    batch_size: int = 128  # completions per step: prompts x group_size
    sync_every: int = 1
    eval_every: int = 50
    batch_timeout_s: float = 600.0  # a step waiting this long for its batch fails (a replacement restarts it)
    # engine/trainer mismatch budget: a step whose mismatch_kl exceeds it prints a warning and is counted
    # (mismatch_over_budget); MoE recipes set it from measurement, and CI holds their bf16 CPU twins to it
    mismatch_kl_budget: float | None = None


@dataclass
class EvalConfig:
    """Held-out evaluation of every training environment's eval split (rlray.envs.runner)."""

    num_examples: int = 128  # per environment (fewer when its eval split is smaller)
    temperature: float = 0.0  # 0: greedy
    num_samples: int = 1  # completions per example (n of pass@k)
    pass_k: list[int] = field(default_factory=lambda: [1])  # k values of pass@k, each <= num_samples
    pass_threshold: float = 1.0  # a sample passes when its reward >= this
    every_n_steps: int = II("rl.eval_every")  # during RL; 0: only before and after
    max_tokens: int = II("rollout.max_tokens")  # per model turn

    def __post_init__(self) -> None:
        if self.num_examples < 1 or self.num_samples < 1:
            raise ConfigError("eval.num_examples and eval.num_samples must be >= 1")
        bad = [k for k in self.pass_k if not 1 <= k <= self.num_samples]
        if bad:
            raise ConfigError(f"eval.pass_k={list(self.pass_k)}: each k must be in [1, eval.num_samples="
                              f"{self.num_samples}]; raise eval.num_samples or drop {bad}")


@dataclass
class EnvSpec:
    """One environment of a mixture."""

    id: str = "reverse_text"
    args: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    v1: dict[str, Any] = field(default_factory=dict)  # a v1 env's options over env.v1 (harness, eval_args, ...)


@dataclass
class SandboxConfig:
    """The sandbox of a v1 harness that executes commands (rlray.envs.sandbox: bubblewrap, per episode)."""

    network: str = "none"  # none: the model endpoint only (relayed); host: the node's network
    wall_s: float = 600.0  # per command (the bash harness's whole episode is one): killed past it, exit 124
    cpu_s: int = 300  # RLIMIT_CPU of each process
    memory_mb: int = 2048  # the episode's cgroup (or RLIMIT_AS per process where no cgroup is writable)
    nproc: int = 256  # processes of the episode (its cgroup's pids.max, or RLIMIT_NPROC)
    nofile: int = 1024  # open files per process
    fsize_mb: int = 256  # the largest file
    disk_mb: int = 512  # the episode's files in all (checked after each command)
    keep_failed: bool = False  # keep a failed episode's folder (~/.cache/rlray/sandbox/<trace>) for a look
    # commands running at once per v1 env actor, the others waiting their turn (before their wall time starts);
    # 0: as many as half the node's memory holds at memory_mb each, at most 4 per core (rlray.envs.sandbox)
    max_running: int = 0

    def __post_init__(self) -> None:
        if self.network not in ("none", "host"):
            raise ConfigError(f"env.v1.sandbox.network={self.network!r}: choose none (the model endpoint only) or host")
        if self.max_running < 0:
            raise ConfigError(f"env.v1.sandbox.max_running={self.max_running}: give 0 (from the node's memory) or a "
                              "positive count")
        small = [k for k in ("wall_s", "cpu_s", "memory_mb", "nproc", "nofile", "fsize_mb", "disk_mb")
                 if getattr(self, k) <= 0]
        if small:
            raise ConfigError(f"env.v1.sandbox.{small[0]}={getattr(self, small[0])}: must be positive")


@dataclass
class V1Config:
    """verifiers v1 (0.4) environments: an env module importing `verifiers.v1` runs in a v1 env actor
    beside each rollout actor, with an interpreter of its own (rlray.envs.v1)."""

    python: str | None = None  # a prepared interpreter with verifiers 0.4 and this Ray; None: .venv-v1, built once
    harness: str = "chat"  # rlray's in-process chat harness, or a verifiers harness id (bash, codex, ...)
    # fields of the harness's verifiers config (bash: edit, search, ...); `compaction` is off unless given here
    # (a summarised context is a re-rendered prompt: token in, token out would end in TokenMismatch)
    harness_args: dict[str, Any] = field(default_factory=dict)
    # auto: the sandbox for a harness that executes commands (verifiers' EXECUTES_CODE: bash, ...), verifiers'
    # subprocess runtime for rlray's chat harness (it executes nothing); sandbox; subprocess (unsandboxed: the
    # policy's commands run on the node as this user, with one warning line); any other verifiers runtime type
    # (docker, prime, ... need their own setup)
    runtime: str = "auto"
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    max_turns: int | None = None  # verifiers' AgentConfig.max_turns; None: the env's own
    role: str = "agent"  # the env's agent role that rlray trains and configures
    eval_args: dict[str, Any] = field(default_factory=dict)  # taskset fields over env.args for the eval split
    max_tasks: int = 100_000  # tasks read from a taskset per split (an endless taskset stops there)


@dataclass
class EnvConfig:
    """Which verifiers environments to train and evaluate on, and how rollouts reach them.

    `id` is a built-in environment (a module of rlray/envs/builtin/) or any installed verifiers
    environment module, loaded as `vf.load_environment(id, **args)`. A non-empty
    `mix` replaces id/args with several environments, each group drawn by `weight`.
    """

    id: str = "reverse_text"
    args: dict[str, Any] = field(default_factory=dict)
    mix: list[EnvSpec] = field(default_factory=list)
    python_path: list[str] = field(default_factory=list)  # folders put on sys.path (driver and actors) first
    fast_path: bool = True  # plain single-turn envs generate through the engine directly instead of HTTP
    rollout_timeout_s: float = 300.0  # a rollout (every turn) running longer gets reward 0 and an error
    tool_timeout_s: float = 30.0  # a tool call running longer ends its rollout with reward 0 and an error
    server_host: str = "127.0.0.1"  # the rollout actors' OpenAI endpoint; "node": the node's address
    server_port: int = 0  # 0: any free port
    chat_template: str | None = None  # None: the tokenizer's own, else rlray.actors.server.PLAIN_CHAT_TEMPLATE
    tool_call_parser: str = "auto"  # vLLM's --tool-call-parser; auto: "rlray" with the plain template, else none
    # An env whose sampling args bias the distribution (guided decoding, logit bias, penalties) is rejected
    # at load; true: train it anyway, its rollouts' mu taken as the trainer's policy (README "Environments")
    allow_biased_sampling: bool = False
    v1: V1Config = field(default_factory=V1Config)

    def __post_init__(self) -> None:
        t = self.chat_template
        if t and "{{" not in t and "{%" not in t and not Path(t).is_file():
            raise ConfigError(f"env.chat_template='{t}': no such file; give a Jinja template file or its text")
        if self.rollout_timeout_s <= 0 or self.tool_timeout_s <= 0:
            raise ConfigError("env.rollout_timeout_s and env.tool_timeout_s must be > 0")
        for spec in self.mix:
            weight = spec["weight"] if isinstance(spec, dict) else spec.weight
            if weight <= 0:
                raise ConfigError(f"env.mix: every weight must be > 0, got {weight}")


@dataclass
class WeightSyncConfig:
    # None: 16 on gloo (the measured best, BENCHMARKS.md), vLLM's packed buffer size (1 GiB) on nccl
    bucket_mb: int | None = None
    # A whole sync's deadline: past it, or once an engine dies during it, the fleet acts (gloo: the engines
    # that did not finish are replaced, as with m2n on either backend; nccl broadcast: the run stops, vLLM's
    # NCCL group cannot be abandoned).
    sync_timeout_s: float = 300.0
    # gloo, and m2n on gloo or NCCL: the longest one join, broadcast or m2n batch of the weight group waits (vLLM's
    # NCCL broadcast group has no timeout)
    group_timeout_s: float = 300.0
    delta: bool = False  # after a full sync, send only the elements whose value in the engine's dtype changed
    full_every: int = 10  # with delta: every this many syncs is a full one (bounds any drift)
    # broadcast: trainer rank 0 sends every full tensor to every worker; m2n: every trainer rank sends its own slices
    # to the workers that read them (rlray.weightsync.m2n; point-to-point over gloo on CPUs, NCCL on GPUs); auto: the
    # plan picks at launch, m2n on GPU trainers where the run allows it, its forecast is faster and its staging fits
    # beside the engines, else broadcast (rlray.orchestration.weights_plan.WeightsPlan.auto)
    transport: str = "auto"


@dataclass
class CheckpointConfig:
    every: int = 100  # RL steps between checkpoints (0: none); also one at RL start and end
    every_s: float = 0.0  # also one when this many seconds passed since the last (0: off); bounds what a loss costs
    # SIGTERM / SIGUSR1 (preemption): the driver checkpoints the current RL step and exits 0 within this long
    preempt_grace_s: float = 120.0
    keep: int = 2
    # the trainer's shards written in the background (DCP's async_save): a step waits only for the copy of
    # the state; the checkpoint is committed (meta.json, renamed into place) once every rank's write ended
    async_save: bool = True
    resume: bool = True  # resume from the newest committed checkpoint in run.dir/checkpoints
    export_hf: bool = True  # write the final policy as a transformers folder to run.dir/hf (LoRA: hf/adapter)
    export_merged: bool = False  # LoRA: also write the adapters merged into the base to run.dir/hf/merged


@dataclass
class ClusterConfig:
    address: str | None = None  # None: start a local Ray, unless RAY_ADDRESS is set
    num_cpus: int = 8  # logical CPUs declared for a local Ray (fractional bundles fit)
    num_gpus: int | None = None  # GPUs a local Ray declares; None: what torch sees (never more)
    gpu_memory_gb: float = 80.0  # memory of one GPU, for the plan's fit check (H100 80, H200 141)
    host_memory_gb: float = 2048.0  # host RAM of one node, for the plan's HF-export check (DGX H100/H200: 2 TB)
    gpus_per_node: int = 8  # GPUs of one node, for the plan: an engine is one Ray bundle, which one node holds
    dashboard_host: str = "127.0.0.1"
    backend: str = "auto"  # auto: nccl when the bundles have GPUs, else gloo
    # true: one placement group, a trainer rank and an engine worker in each bundle, taking turns; weights
    # handed over in memory (GPU: vLLM's ipc engine and sleep mode; CPU: shared memory). README "Colocated"
    colocate: bool = False


@dataclass
class LoggingConfig:
    project: str = "rlray"
    wandb: str = "auto"  # auto: online with WANDB_API_KEY, else offline; or online/offline/disabled
    verbose: bool = False  # vLLM's INFO lines and wandb's banners on the console (always in Ray's session logs)


@dataclass
class RunConfig:
    name: str = "default"
    dir: str = "runs/${run.name}/${now:%Y%m%d-%H%M%S}"  # reuse an old run.dir to resume it
    seed: int = 0


@dataclass
class Config:
    dry_run: bool = False  # print the placement and memory plan, check it (and the cluster, if connected), exit
    run: RunConfig = field(default_factory=RunConfig)
    stages: list[str] = field(default_factory=lambda: ["sft", "rl"])
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        if self.rollout.temperature is None:  # on-policy distillation scores teacher and student at temperature 1
            self.rollout.temperature = 1.0 if self.algo.loss == "opd" else RolloutConfig.DEFAULT_TEMPERATURE
        lora = self.trainer.lora
        if lora.base_dtype is None:
            lora.base_dtype = "float32" if "sft" in self.stages else self.trainer.param_dtype
