"""The plan's memory formulas: bytes per trainer rank and per engine GPU, from a model's shape and the config.

Contract: `trainer_memory(shape, config, n)` and `engine_memory(shape, section, gpu_memory_gb)` return estimated bytes
by part (dicts whose keys the plan prints), `activations(shape, config, checkpointing)` the trainer's activations,
`engine_weights(shape, section)` one engine's weights; `engine_shortfall(shape, section, cluster, key)` is the one
line saying why an engine cannot serve (None when it can): more GPUs per engine while one node has them
(`cluster.gpus_per_node`), else what one node cannot hold, rlray's engines being one Ray bundle each.

Trainer, per rank (N ranks, P parameters, FSDP2 shards everything over the N ranks, experts over
ep x efsdp = N as well): fp32 master weights 4P/N, fp32 gradients 4P/N, AdamW 8P/N; with LoRA
(A adapter parameters) the frozen base in trainer.lora.base_dtype, and 16A/N for the fp32
adapters, their gradients and AdamW; the gathered working set (two decoder layers in the compute
dtype, with this rank's E/ep experts, plus one layer's fp32 gradients before reduce-scatter (none
for a frozen base), plus embedding and head); activations for `micro_batch_tokens` T: per
layer T x b x (6H + 2 q-width + 2 kv-width + MLP widths: k experts of the record's width, 3 matrices
gated or 2), every layer without checkpointing, or the layer inputs plus one layer with it; with multi-head
latent attention (the record's `mla`) its attention part is 2 x q_lora_rank (the query latent and its norm) +
2 x kv_lora_rank + rope (the key-value latent with its rope key, and its norm) + 2 x heads x (nope + rope) (the
query before and after rope) + heads x (nope + v) (the expanded latent, which the values view) + heads x
(nope + rope) (the keys, rope part copied in); with
attention sinks (eager attention per sequence) heads x L^2 x b per layer and 3 more transient, L the
longest sequence (rollout.max_model_len, at most T); fp32 logits and their gradient, T x V x (b + 8); on a
GPU a fixed 4 GB for the CUDA context and NCCL.
Engine, per GPU (tensor parallel TP): weights P x b / TP (rollout.quantization=fp8: the decoder layers' P in
1 B); the KV cache gets what is left of
`kv_cache_fraction` of the GPU after weights and a 2 GB activation reserve (or exactly
`kv_cache_gb`), at 2 x layers x kv_heads x head_dim x b / TP bytes per token of a full-attention layer (with
multi-head latent attention (kv_lora_rank + qk_rope_head_dim) x b, one latent for every head, whole on each TP rank), plus
per sequence a sliding-window layer's KV of its window and a linear-attention layer's recurrent state
(rlray.models.cache). MoE activations read the record's expert width and gating (rlray.config.families).
"""

from __future__ import annotations

import dataclasses

from rlray.config import ClusterConfig, Config, RolloutConfig, TeacherConfig
from rlray.models.cache import cache_bytes
from rlray.models.shape import ModelShape
from rlray.orchestration.phases import BYTES, ENGINE_RESERVE_GB, GB

OVERHEAD_GB = 4.0  # CUDA context, NCCL buffers, allocator slack per trainer GPU


def attention_width(s: ModelShape) -> int:
    """Per token, what one attention layer keeps for backward besides its hidden-width tensors: queries before and
    after rope, keys and values; multi-head latent attention also its latents (see the module's contract)."""
    hidden, heads, kv = s.dim("hidden_size"), s.dim("num_attention_heads"), s.dim("num_key_value_heads")
    if s.family and s.family.mla:
        qk, rope = s.dim("qk_nope_head_dim") + s.dim("qk_rope_head_dim"), s.dim("qk_rope_head_dim")
        latents = 2 * s.dim("q_lora_rank") + 2 * s.dim("kv_lora_rank") + rope
        return latents + 2 * heads * qk + heads * (s.dim("qk_nope_head_dim") + s.dim("v_head_dim")) + heads * qk
    head_dim = s.dim("head_dim", hidden // max(heads, 1))
    return 2 * heads * head_dim + 2 * kv * head_dim


def activations(s: ModelShape, c: Config, checkpointing: bool) -> float:
    t, b = c.trainer.micro_batch_tokens // c.trainer.cp, BYTES[c.trainer.param_dtype]  # each cp rank: 1/cp of a row
    hidden, heads = s.dim("hidden_size"), s.dim("num_attention_heads")
    moe = s.family.moe if s.family and s.family.moe else None
    mats = 3 if moe is None or moe.gated else 2  # gate, up and down; or up and down (Nemotron-H's relu^2)
    if s.experts:
        k, inter = s.dim("num_experts_per_tok"), s.dim(moe.width if moe else "moe_intermediate_size")
        key = moe.shared_width if moe else None
        shared = 0 if key is None else s.dim(key) * (inter if key.startswith("n_") else 1)
        mlp = k * (hidden + mats * inter) + (hidden + mats * shared if shared else 0)
    else:
        mlp = hidden + mats * s.dim("intermediate_size")
    # a family with sinks attends eagerly, one sequence at a time (rlray.models.attention): per layer the L x L
    # probabilities per head of its longest sequence stay for backward, 3 more such matrices pass through
    length = min(c.rollout.max_model_len, t) if s.family and s.family.sinks else 0
    scores = heads * length * length * b
    one_layer = t * b * (6 * hidden + attention_width(s) + mlp) + scores
    layers = s.dim("num_hidden_layers")
    return (layers * t * hidden * b + one_layer if checkpointing else layers * one_layer) + 3 * scores


def trainer_memory(s: ModelShape, c: Config, n: int | None = None) -> dict[str, float]:
    """Estimated bytes per trainer rank (of `n`, default trainer.num_ranks), by part."""
    n = n or c.trainer.num_ranks
    ep, b = c.trainer.ep, BYTES[c.trainer.param_dtype]
    layer = s.layer_dense + s.layer_experts / ep
    t, vocab = c.trainer.micro_batch_tokens // c.trainer.cp, s.dim("vocab_size")
    if s.lora_params:  # frozen base in the compute dtype; fp32 adapters, their gradients and AdamW state
        base = c.trainer.lora.base_dtype or c.trainer.param_dtype
        states = {f"{base} base": BYTES[base] * s.params / n, "fp32 adapters": 4 * s.lora_params / n,
                  "adapter gradients": 4 * s.lora_params / n, "AdamW state": 8 * s.lora_params / n}
        gathered = layer * 2 * b + s.root_params * b
    else:
        states = {"fp32 weights": 4 * s.params / n, "fp32 gradients": 4 * s.params / n,
                  "AdamW state": 8 * s.params / n}
        gathered = layer * (2 * b + 4) + s.root_params * b
    return {**states, "gathered layers": gathered,
            "activations": activations(s, c, c.trainer.activation_checkpointing),
            "logits": t * vocab * (b + 8), "context": OVERHEAD_GB * GB if c.trainer.gpus_per_rank else 0.0,
            **({"cp mask": t * c.trainer.micro_batch_tokens * b} if c.trainer.cp > 1 else {})}  # local x gathered keys


def engine_memory(s: ModelShape, r: RolloutConfig | TeacherConfig, gpu_memory_gb: float) -> dict[str, float]:
    """Estimated bytes per engine GPU (a rollout or a teacher engine): weights, KV cache and the sequences
    of max_model_len it holds."""
    tp = r.tensor_parallel_size
    b = BYTES.get(str(r.dtype), 2)
    weights = engine_weights(s, r) / tp
    if r.kv_cache_gb > 0:
        kv = r.kv_cache_gb * 2**30
    else:
        kv = r.kv_cache_fraction * gpu_memory_gb * GB - weights - ENGINE_RESERVE_GB * GB
    per_token, per_sequence = cache_bytes(s.hf.get_text_config(), tp, b, r.max_model_len)
    seq = per_token * r.max_model_len + per_sequence
    return {"weights": weights, "KV cache": max(kv, 0.0), "sequences": max(kv, 0.0) / seq,
            "per token": per_token, "per sequence": per_sequence}


def engine_weights(s: ModelShape, r: RolloutConfig | TeacherConfig) -> float:
    """One engine's weights: P x b, or with rollout.quantization=fp8 1 B for each decoder-layer parameter (vLLM
    quantizes the layers' linear weights; the embedding and the head stay in b)."""
    b = BYTES.get(str(r.dtype), 2)
    if getattr(r, "quantization", "") == "fp8":
        return (s.params - s.root_params) + s.root_params * b
    return s.params * b


def _at(r: RolloutConfig | TeacherConfig, **keys: object) -> RolloutConfig | TeacherConfig:
    out = dataclasses.replace(r, **keys)
    out.tensor_parallel_size = out.gpus_per_actor = keys.get("tensor_parallel_size", r.tensor_parallel_size)
    return out


def _gpu_gb(s: ModelShape, r: RolloutConfig | TeacherConfig) -> float:
    """The GPU memory (GB) in which an engine's kv_cache_fraction holds its weights, its activations and the KV
    cache of one max_model_len sequence."""
    e = engine_memory(s, r, 0.0)
    return (e["weights"] + ENGINE_RESERVE_GB * GB + e["per token"] * r.max_model_len + e["per sequence"]) / (
        r.kv_cache_fraction * GB)


def engine_shortfall(s: ModelShape, r: RolloutConfig | TeacherConfig, cluster: ClusterConfig, key: str) -> str | None:
    """One line when a GPU engine (`key`: rollout or teacher) cannot place or holds no sequence of max_model_len:
    more GPUs while one node has them, else what one node cannot hold and what would (an engine is one Ray bundle,
    so one node's GPUs)."""
    mem, node, frac = cluster.gpu_memory_gb, cluster.gpus_per_node, r.kv_cache_fraction
    if r.gpus_per_actor > node:
        return (f"{key}.gpus_per_actor={r.gpus_per_actor:g} but cluster.gpus_per_node={node}: an engine is one Ray "
                f"bundle, which one node holds; lower {key}.tensor_parallel_size and {key}.gpus_per_actor to {node}")
    e = engine_memory(s, r, mem)
    if not r.gpus_per_actor or e["sequences"] >= 1:
        return None
    tp, length = r.tensor_parallel_size, r.max_model_len
    if tp < node and engine_memory(s, _at(r, tensor_parallel_size=node), mem)["sequences"] >= 1:
        return (f"{key}: {s.name} takes {e['weights'] / GB:.0f} GB per GPU at tensor_parallel_size={tp}, leaving no KV "
                f"cache for one {length}-token sequence in {frac:g} x {mem:g} GB; raise {key}.tensor_parallel_size and "
                f"{key}.gpus_per_actor together (up to cluster.gpus_per_node={node}), or {key}.kv_cache_fraction")
    full = _at(r, tensor_parallel_size=node)
    can_quantize = getattr(r, "quantization", None) == ""  # a rollout engine serving bf16 weights
    if can_quantize and engine_memory(s, _at(full, quantization="fp8"), mem)["sequences"] >= 1:
        fix = f"set {key}.quantization=fp8 ({engine_weights(s, _at(full, quantization='fp8')) / GB:.0f} GB)"
    else:
        fix = (f"rlray has no engine across nodes: it fits a node of GPUs of {_gpu_gb(s, full):.0f} GB or more "
               "(cluster.gpu_memory_gb)" + (f", {_gpu_gb(s, _at(full, quantization='fp8')):.0f} GB with "
                                            "rollout.quantization=fp8" if can_quantize else ""))
    what, weights = "FP8" if getattr(r, "quantization", "") == "fp8" else str(r.dtype), engine_weights(s, r) / GB
    needs = (f"{weights:.0f} GB for its {what} weights alone" if weights > node * frac * mem else
             f"{weights:.0f} GB of {what} weights, {ENGINE_RESERVE_GB:g} GB of activations per GPU and the KV cache of "
             f"one {length}-token sequence")
    return (f"{key}: {s.name} needs {needs}; one engine is one Ray bundle, on one node: cluster.gpus_per_node={node} x "
            f"{mem:g} GB, {frac:g} of each for vLLM ({node * frac * mem:.0f} GB); {fix}")
