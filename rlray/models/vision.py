"""Vision-language models: tiny random-weight twins with an offline processor, and the token-in
form of an image prompt.

Contract: `build_tiny(cfg, out)` writes a random-weight model of a vision-language family
(`VISION_ARCHS`, transformers' classes) with rlray's character tokenizer plus the family's vision
tokens, a processor (`AutoProcessor.from_pretrained(out)`: the family's image processor, video
processor and a plain chat template that renders an image part as
`<|vision_start|><|image_pad|><|vision_end|>`) and nothing downloaded; transformers and vLLM both
load the folder. A processed prompt holds one image pad per merged patch; vLLM takes a token-in
image prompt with one pad per image and expands it itself (`collapse_image_pads`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlray.config import ModelConfig

VISION_TOKENS = ("<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH, MERGE, TEMPORAL = 16, 2, 2  # Qwen3-VL's patch size, spatial merge and temporal patch
MAX_PIXELS = 128 * 128  # a tiny model's image processor resizes larger images down to this
# A message's parts: text as it is, an image part as the family's vision tokens (one pad per image).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")


def vision_tokenizer() -> Any:
    from rlray.data.tokenizer import char_tokenizer

    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's split of the rotary half-dimension over (time, height, width): 24/20/20 of 64."""
    half = head_dim // 2
    hw = half * 5 // 16
    return [half - 2 * hw, hw, hw]


def _qwen3_vl(cfg: ModelConfig, tok: Any) -> Any:
    from transformers import Qwen3VLConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = {"vocab_size": len(tok), "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size, "max_position_embeddings": 2048,
            "initializer_range": cfg.init_std, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": mrope_section(cfg.head_dim), "mrope_interleaved": True}}
    vision = {"depth": 2, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128, "out_hidden_size": cfg.hidden_size,
              "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL,
              "num_position_embeddings": 64, "deepstack_visual_indexes": [0], "initializer_range": cfg.init_std}
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=cfg.tie_word_embeddings)


def _qwen3_vl_processor(tok: Any) -> Any:
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl import Qwen3VLVideoProcessor

    images = Qwen2VLImageProcessor(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE,
                                   min_pixels=(PATCH * MERGE) ** 2, max_pixels=MAX_PIXELS,
                                   image_mean=[0.5] * 3, image_std=[0.5] * 3)
    videos = Qwen3VLVideoProcessor(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE)
    return Qwen3VLProcessor(image_processor=images, tokenizer=tok, video_processor=videos, chat_template=CHAT_TEMPLATE)


# family -> (its tiny config, its processor); transformers' AutoModelForImageTextToText builds the model
VISION_ARCHS = {"qwen3_vl": (_qwen3_vl, _qwen3_vl_processor)}


def build_tiny(cfg: ModelConfig, out: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    make_config, make_processor = VISION_ARCHS[str(cfg.arch)]
    tok = vision_tokenizer()
    torch.manual_seed(cfg.seed)
    model = AutoModelForImageTextToText.from_config(make_config(cfg, tok), dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    make_processor(tok).save_pretrained(out)
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
