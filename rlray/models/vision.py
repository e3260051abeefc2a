"""Vision-language models: tiny random-weight twins with an offline processor, and the token-in
form of an image prompt.

Contract: `build_tiny(cfg, out)` writes a random-weight model of a vision-language family
(`VISION_ARCHS`: Qwen3-VL, Qwen3-VL-MoE, GLM-4.5V, transformers' classes) with rlray's character
tokenizer plus the family's vision tokens, a processor (`AutoProcessor.from_pretrained(out)`: the
family's image and video processors and a plain chat template that renders an image part as the
family's image tokens, e.g. `<|vision_start|><|image_pad|><|vision_end|>`) and nothing downloaded;
transformers and vLLM both load the folder. A processed prompt holds one image pad per merged patch;
vLLM takes a token-in image prompt with one pad per image and expands it itself (`collapse_image_pads`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlray.config.families import family

if TYPE_CHECKING:
    from rlray.config import ModelConfig

QWEN_TOKENS = ("<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
GLM_TOKENS = ("<|im_start|>", "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>",
              "<|end_of_video|>", "<|video|>")  # GLM's video prompt updates look each one up
PATCH, MERGE, TEMPORAL = 16, 2, 2  # Qwen3-VL's patch size, spatial merge and temporal patch
GLM_PATCH = 14
MAX_PIXELS = 128 * 128  # a tiny model's image processor resizes larger images down to this


def chat_template(image: str) -> str:
    """A plain template: a message's parts as they are, an image part as `image` (one pad per image)."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}:"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
            "{% if c['type'] == 'image' %}" + image + "{% else %}{{ c['text'] }}{% endif %}"
            "{% endfor %}{% endif %}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")


CHAT_TEMPLATE = chat_template("<|vision_start|><|image_pad|><|vision_end|>")


def mrope_section(head_dim: int, rotary_fraction: float = 1.0) -> list[int]:
    """The split of the rotary half-dimension over (time, height, width): Qwen3-VL's 24/20/20 of 64 (all of
    the head rotates), GLM-4.5V's 8/12/12 of 32 (half of it does)."""
    half = int(head_dim * rotary_fraction) // 2
    hw = half * 5 // 16 if rotary_fraction == 1.0 else (half - half // 4) // 2
    return [half - 2 * hw, hw, hw]


def _text(cfg: ModelConfig, tok: Any) -> dict[str, Any]:
    return {"vocab_size": len(tok), "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size, "max_position_embeddings": 2048,
            "initializer_range": cfg.init_std, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id}


def _tower(cfg: ModelConfig, patch: int) -> dict[str, Any]:
    return {"depth": 2, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128, "out_hidden_size": cfg.hidden_size,
            "patch_size": patch, "spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL,
            "initializer_range": cfg.init_std}


def _qwen3_vl(cfg: ModelConfig, tok: Any, moe: bool = False) -> Any:
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    text = {**_text(cfg, tok), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": mrope_section(cfg.head_dim), "mrope_interleaved": True}}
    if moe:
        if cfg.hidden_size in (cfg.moe_intermediate_size, 2 * cfg.moe_intermediate_size):
            raise ValueError(f"model.hidden_size={cfg.hidden_size} with model.moe_intermediate_size="
                             f"{cfg.moe_intermediate_size}: Qwen3-VL-MoE's transposed experts would load ambiguously "
                             "in transformers (it tells the layouts apart by shape); choose another moe_intermediate_size")
        text |= {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
                 "moe_intermediate_size": cfg.moe_intermediate_size, "decoder_sparse_step": 1, "norm_topk_prob": True}
    vision = {**_tower(cfg, PATCH), "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=cfg.tie_word_embeddings)


def _qwen3_vl_processor(tok: Any) -> Any:
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl import Qwen3VLVideoProcessor

    images = Qwen2VLImageProcessor(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE,
                                   min_pixels=(PATCH * MERGE) ** 2, max_pixels=MAX_PIXELS,
                                   image_mean=[0.5] * 3, image_std=[0.5] * 3)
    videos = Qwen3VLVideoProcessor(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE)
    return Qwen3VLProcessor(image_processor=images, tokenizer=tok, video_processor=videos, chat_template=tok.chat_template)


def _glm4v_moe(cfg: ModelConfig, tok: Any) -> Any:
    from transformers import Glm4vMoeConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in GLM_TOKENS}
    text = {**_text(cfg, tok), "moe_intermediate_size": cfg.moe_intermediate_size, "n_routed_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.experts_per_token, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
            "attention_bias": True, "use_qk_norm": False,  # vLLM's glm4_moe reads it; transformers' config lacks it
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                "mrope_section": mrope_section(cfg.head_dim, 0.5)}}
    vision = {**_tower(cfg, GLM_PATCH), "image_size": 8 * GLM_PATCH}  # 64 position embeddings
    return Glm4vMoeConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image|>"],
                          video_token_id=ids["<|video|>"], image_start_token_id=ids["<|begin_of_image|>"],
                          image_end_token_id=ids["<|end_of_image|>"], video_start_token_id=ids["<|begin_of_video|>"],
                          video_end_token_id=ids["<|end_of_video|>"], tie_word_embeddings=cfg.tie_word_embeddings)


def _glm4v_processor(tok: Any) -> Any:
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    # GLM's resize bounds temporal x height x width, with 2 frames even for an image
    size = {"shortest_edge": TEMPORAL * (GLM_PATCH * MERGE) ** 2, "longest_edge": TEMPORAL * MAX_PIXELS}
    images = Glm4vImageProcessor(size=size, patch_size=GLM_PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE)
    videos = Glm4vVideoProcessor(size=size, max_image_size={"longest_edge": TEMPORAL * MAX_PIXELS}, patch_size=GLM_PATCH,
                                 temporal_patch_size=TEMPORAL, merge_size=MERGE)
    return Glm4vProcessor(image_processor=images, tokenizer=tok, video_processor=videos, chat_template=tok.chat_template)


@dataclass(frozen=True)
class Twin:
    config: Callable[[ModelConfig, Any], Any]  # the tiny transformers config over the family's tokenizer
    processor: Callable[[Any], Any]  # the offline processor over that tokenizer
    tokens: tuple[str, ...]  # the vision tokens added to rlray's character tokenizer
    template: str  # the plain chat template, an image part rendered as the family's tokens


# a family's `vision` key (rlray.config.families) -> its tiny twin; AutoModelForImageTextToText builds the model
VISION_ARCHS = {
    "qwen3_vl": Twin(_qwen3_vl, _qwen3_vl_processor, QWEN_TOKENS, CHAT_TEMPLATE),
    "qwen3_vl_moe": Twin(partial(_qwen3_vl, moe=True), _qwen3_vl_processor, QWEN_TOKENS, CHAT_TEMPLATE),
    "glm4v_moe": Twin(_glm4v_moe, _glm4v_processor, GLM_TOKENS, chat_template("<|begin_of_image|><|image|><|end_of_image|>")),
}


def vision_tokenizer(arch: str = "qwen3_vl") -> Any:
    from rlray.data.tokenizer import char_tokenizer

    twin = VISION_ARCHS[arch]
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(twin.tokens)})
    tok.chat_template = twin.template
    return tok


def build_tiny(cfg: ModelConfig, out: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    from rlray.models.load import to_checkpoint_layout

    key = family(cfg.arch).vision
    twin = VISION_ARCHS[str(key)]
    tok = vision_tokenizer(str(key))
    torch.manual_seed(cfg.seed)
    model = AutoModelForImageTextToText.from_config(twin.config(cfg, tok), dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    to_checkpoint_layout(out)  # Qwen3-VL-MoE's experts as its checkpoints (and vLLM) hold them
    twin.processor(tok).save_pretrained(out)
    tok.save_pretrained(out)


def collapse_image_pads(ids: list[int], pad_id: int) -> list[int]:
    """A processed prompt's ids with each run of image pads cut to one (vLLM's token-in image form)."""
    return [t for i, t in enumerate(ids) if t != pad_id or i == 0 or ids[i - 1] != pad_id]


def placeholder_spans(ids: list[int], pad_id: int) -> Any:
    """int64 [I, 2]: (first position, length) of each run of image pads in a processed prompt."""
    import numpy as np

    pads = np.asarray(ids) == pad_id
    edges = np.flatnonzero(np.diff(np.concatenate([[0], pads.astype(np.int8), [0]])))
    starts, ends = edges[::2], edges[1::2]
    return np.stack([starts, ends - starts], axis=1).astype(np.int64).reshape(-1, 2)
