"""Images in environment messages: read, rendered with the model's own processor, sent token-in.

Contract:
- `split_images(messages)`: the messages with every image part made `{"type": "image"}` (what chat
  templates render as the family's placeholder) and the PIL images in order. An image part is
  OpenAI's `{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}` or
  `{"type": "image", "image": <PIL image | data URL | bytes>}`; one that cannot be read raises
  `ImageError` naming the message and part.
- `vision_prompt(path, chat_template, max_images)`: the `VisionPrompt` of the model at `path` (its
  processor). `VisionPrompt(processor, chat_template, max_images)`: `render(messages) -> (ids, images, Images)`:
  the processor's token ids (each image's placeholders expanded, as vLLM expands them), the PIL
  images for the engine and the pixel values, grids and placeholder spans for the trainer
  (rlray.types.Images). More than `max_images` images is an `ImageError` (vLLM's
  `limit_mm_per_prompt`). Without images it renders as the tokenizer alone does.
  `images(images, ids, sampled)`: the trainer's `Images` of a multi-turn conversation's ids (vLLM's,
  pads expanded) and its images in order; image pads the model sampled are not placeholders. Runs of
  pads that do not match the images' sizes are an `ImageError`.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np

from rlray.models.vision import placeholder_spans
from rlray.types import Images

IMAGE_PARTS = ("image", "image_url")


class ImageError(ValueError):
    """An environment's image that the model cannot take."""


def _read(value: Any, where: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        value = value.get("url")
    elif hasattr(value, "url"):  # verifiers' ImageUrlSource
        value = value.url
    if isinstance(value, str):
        if not value.startswith("data:") or ";base64," not in value:
            raise ImageError(f"{where}: an image is a PIL image, bytes or a base64 data URL, not {value[:40]!r}")
        try:
            value = base64.b64decode(value.split(";base64,", 1)[1], validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"{where}: the data URL is not base64 ({e})") from None
    if not isinstance(value, (bytes, bytearray)):
        raise ImageError(f"{where}: an image is a PIL image, bytes or a base64 data URL, not a {type(value).__name__}")
    try:
        return Image.open(io.BytesIO(value)).convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ImageError(f"{where}: cannot read the image ({type(e).__name__}: {e})") from None


def _part(part: Any) -> tuple[str | None, Any]:
    get = part.get if isinstance(part, dict) else lambda k: getattr(part, k, None)
    kind = get("type")
    if kind == "image_url":
        return kind, get("image_url")
    if kind == "image":
        return kind, get("image")
    return kind, None


def split_images(messages: list[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    out, images = [], []
    for m, message in enumerate(messages):
        message = dict(message)
        content = _content(message)
        if isinstance(content, list):
            parts = []
            for p, part in enumerate(content):
                kind, value = _part(part)
                if kind in IMAGE_PARTS:
                    images.append(_read(value, f"message {m} part {p}"))
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": (part.get("text") if isinstance(part, dict)
                                                           else getattr(part, "text", "")) or ""})
            message["content"] = parts
        out.append(message)
    return out, images


def encode_png(image: Any) -> str:
    """A PIL image as the data URL environments put in an `image_url` part."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class VisionPrompt:
    def __init__(self, processor: Any, chat_template: str | None, max_images: int) -> None:
        self.processor, self.chat_template, self.max_images = processor, chat_template, max_images
        tok = processor.tokenizer
        self.pad = tok.convert_tokens_to_ids(getattr(processor, "image_token", "<|image_pad|>"))

    def render(self, messages: list[Any]) -> tuple[list[int], list[Any], Images | None]:
        messages, images = split_images(messages)
        if len(images) > self.max_images:
            raise ImageError(f"the prompt has {len(images)} images, over the engine's limit of {self.max_images} "
                             "(rollout.max_images)")
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  chat_template=self.chat_template)
        if not images:
            return list(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]), [], None
        inputs = self.processor(text=[text], images=images, return_tensors="np", add_special_tokens=False)
        ids = [int(i) for i in inputs["input_ids"][0]]
        return ids, images, Images(inputs["pixel_values"].astype(np.float32),
                                   inputs["image_grid_thw"].astype(np.int64), placeholder_spans(ids, self.pad))


    def images(self, images: list[Any], ids: list[int], sampled: list[bool]) -> Images:
        """A conversation's images for the trainer: `ids` its tokens (every image's pads expanded, as vLLM
        returned them), `sampled` which of them the model sampled (an image pad there is a plain token)."""
        pads = [i if not s else -1 for i, s in zip(ids, sampled)]
        spans = placeholder_spans(pads, self.pad)
        inputs = self.processor.image_processor(images=images, return_tensors="np")
        grids = inputs["image_grid_thw"].astype(np.int64)
        merge = getattr(self.processor.image_processor, "merge_size", 1)
        want = [int(g.prod()) // merge ** 2 for g in grids]
        if [int(n) for _, n in spans] != want:
            raise ImageError(f"the conversation's image placeholders {[int(n) for _, n in spans]} do not match its "
                             f"{len(images)} images' sizes {want}")
        return Images(inputs["pixel_values"].astype(np.float32), grids, spans)


def vision_prompt(path: str, chat_template: str | None, max_images: int) -> VisionPrompt:
    from transformers import AutoProcessor

    return VisionPrompt(AutoProcessor.from_pretrained(path), chat_template, max_images)


def has_images(messages: list[Any] | str | None) -> bool:
    if not isinstance(messages, list):
        return False
    return any(_part(p)[0] in IMAGE_PARTS for m in messages if isinstance(c := _content(m), list) for p in c)


def _content(message: Any) -> Any:
    return message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
