"""A model's parameter counts, from its transformers config alone: the one count the plan and the
benchmarks use.

Contract: `model_shape(hf_config, name, source)` builds the model on the meta device (no weights,
no memory) and returns a `ModelShape`: every parameter (`params`, tied ones once), the routed
experts' (`expert_params`), what sits outside the decoder layers (`root_params`: a vision-language
model's vision tower too), the largest
layer's dense and expert parts, `active_params` (what one token uses: embedding and head
included, top-k of the routed experts), and the matrices a token is multiplied through
(`matrix_params`, `active_matrix_params`: the output head but not the embedding lookup; the FLOPs
of a step are 6 x the active ones plus attention's), and the MoE layers whose routing a token
carries (`moe_layers`, `routing_bytes`), the largest parameter (`largest`: what a weight sync's buffer
must hold), what the checkpoint holds beyond the parameters (`buffers`, persistent buffers) and the
vision tower's size (`tower_params`); given `trainer.lora`, the adapters' parameters
(`lora_params`; rlray.models.lora's `ValueError` for targets the model lacks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlray.config import LoraConfig
from rlray.config.families import Family, family, known
from rlray.models.lora import adapter_params
from rlray.parallel.dims import num_experts
from rlray.types import route_dtype


@dataclass
class ModelShape:
    name: str
    source: str
    arch: str
    params: int
    expert_params: int
    root_params: int  # embedding, head and final norm: outside the decoder layers
    layer_dense: int  # the largest decoder layer's non-expert parameters
    layer_experts: int  # the largest decoder layer's routed-expert parameters
    matrix_params: int  # parameters of 2 or more dimensions (weights of matmuls and the embedding)
    embedding_params: int  # the input embedding, when not tied to the head (a lookup, not a matmul)
    hf: Any = field(repr=False)
    moe_layers: int = 0  # decoder layers with routed experts
    lora_params: int = 0  # the adapters' parameters when trainer.lora.rank > 0 (on top of `params`)
    largest: tuple[str, int] = ("", 0)  # the largest parameter: (name, elements)
    buffers: tuple[str, ...] = ()  # persistent buffers: in the checkpoint, never in a weight sync
    tower_params: int = 0  # a vision-language model's vision tower (unsent with trainer.freeze_vision)

    @property
    def family(self) -> Family | None:
        """The model's family record (rlray.config.families), None for an architecture rlray has no record of."""
        return family(self.hf.model_type) if known(self.hf.model_type) else None

    @property
    def full_attention_layers(self) -> int:
        from rlray.models.cache import FULL, layer_kinds

        return layer_kinds(self.hf.get_text_config()).count(FULL)

    @property
    def routing_bytes(self) -> int:
        """Bytes of the engine's routing per token: MoE layers x top-k x rlray.types.route_dtype."""
        k = self.dim("num_experts_per_tok")
        return self.moe_layers * k * route_dtype(self.experts).itemsize if self.experts else 0

    @property
    def experts(self) -> int:
        return num_experts(self.hf)

    def _inactive(self) -> int:
        """Routed-expert parameters one token does not use."""
        k = self.dim("num_experts_per_tok")
        return self.expert_params - self.expert_params * k // self.experts if self.experts else 0

    @property
    def active_params(self) -> int:
        return self.params - self._inactive()

    @property
    def active_matrix_params(self) -> int:
        return self.matrix_params - self._inactive() - self.embedding_params

    def dim(self, key: str, default: int = 0) -> int:
        """A dimension of the language model (a vision-language model's text config)."""
        return int(getattr(self.hf.get_text_config(), key, None) or default)


def model_shape(hf: Any, name: str = "", source: str = "", lora: LoraConfig | None = None) -> ModelShape:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from rlray.models.multimodal import is_vision, vision_tower
    from rlray.parallel.expert import moe_experts
    from rlray.parallel.parallelize import decoder_layers

    with torch.device("meta"):
        model = (AutoModelForImageTextToText if is_vision(hf) else AutoModelForCausalLM).from_config(hf)
    count = lambda module: sum(p.numel() for p in module.parameters())
    experts = {n: count(m) for n, m in moe_experts(model)}
    per_layer = [(count(layer), sum(count(m) for _, m in moe_experts(layer))) for layer in decoder_layers(model)]
    dense, routed = max(per_layer, key=lambda t: t[0])
    total = count(model)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    params = {id(p) for p in model.parameters()}
    buffers = tuple(k for k, v in model.state_dict(keep_vars=True).items() if id(v) not in params)
    tower = vision_tower(model)
    return ModelShape(name, source, type(model).__name__, total, sum(experts.values()),
                      total - sum(t for t, _ in per_layer), dense - routed, routed,
                      sum(p.numel() for p in model.parameters() if p.dim() >= 2),
                      0 if tied else embedding.numel(), hf, len(experts),
                      adapter_params(model, lora) if lora is not None and lora.enabled else 0,
                      max(((n, p.numel()) for n, p in model.named_parameters()), key=lambda t: t[1]),
                      buffers, count(tower) if tower is not None else 0)


def human(n: float) -> str:
    """A parameter count for people: 512k, 1.02M, 106.85B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}" if unit != "B" else f"{n / size:.2f}B"
    return f"{n:.0f}"
