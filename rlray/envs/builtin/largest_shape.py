"""largest_shape: which colour is the largest shape in the picture? A vision task a tiny model learns on CPU.

Prompt: one user message with a picture (PIL-drawn, `size` x `size` pixels, white ground, `shapes`
rectangles or ellipses of different colours, none overlapping, the largest by area at least `margin` times the next; an
OpenAI `image_url` part holding a PNG data URL) and the question `largest?`; answer: the colour's name (`red`, `green`, `blue`, `yellow`).
reward = 1 when the completion, stripped, is exactly the answer, else 0. Train and eval pictures come
from disjoint seeds; picture i of a split is the same on every node. Needs a vision-language model
(`model.arch=qwen3_vl` for the tiny one); a text-only model's rollouts of it fail in one line each.
With `turns` > 1 it is a multi-turn game (a verifiers `MultiTurnEnv`): after each answer the
environment replies with the next picture as a user message (image part + `largest?`) until `turns`
pictures were asked; reward = the fraction answered exactly. The row's answer is the first picture's
colour (the SFT target, rlray.envs.sft), `info["answers"]` all of them.
"""

from __future__ import annotations

import math
import random
from typing import Any

from rlray.envs.base import exact_match, message_text
from rlray.envs.images import encode_png

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220), "yellow": (230, 200, 20)}
QUESTION = "largest?"


def picture(split: str, index: int, size: int = 64, shapes: int = 2, seed: int = 0,
            margin: float = 1.3) -> tuple[Any, str]:
    """The picture of example `index` of `split` and its answer: `shapes` rectangles or ellipses of
    distinct colours that do not overlap, the largest (by area) at least `margin` times the next."""
    from PIL import Image, ImageDraw

    rng = random.Random(f"shape:{seed}:{split}:{index}")
    colours = rng.sample(sorted(COLOURS), shapes)
    while True:
        rects = [rng.random() < 0.5 for _ in range(shapes)]
        sides = [rng.randint(size // 8, size // 2) for _ in range(shapes)]
        areas = [side * side * (1.0 if rect else math.pi / 4) for side, rect in zip(sides, rects)]
        order = sorted(range(shapes), key=lambda i: -areas[i])
        boxes = _place(rng, [sides[i] for i in order], size) if areas[order[0]] >= margin * areas[order[1]] else None
        if boxes is not None:
            break
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for i, box in zip(order, boxes):
        (draw.rectangle if rects[i] else draw.ellipse)(box, fill=COLOURS[colours[i]])
    return image, colours[order[0]]


def _place(rng: random.Random, sides: list[int], size: int, tries: int = 50) -> list[tuple[int, ...]] | None:
    """Boxes of these sides inside the picture, none overlapping another; None when they do not fit."""
    boxes: list[tuple[int, ...]] = []
    for side in sides:
        for _ in range(tries):
            x, y = rng.randint(0, size - side), rng.randint(0, size - side)
            box = (x, y, x + side - 1, y + side - 1)
            if all(box[2] < b[0] or b[2] < box[0] or box[3] < b[1] or b[3] < box[1] for b in boxes):
                boxes.append(box)
                break
        else:
            return None
    return boxes


def question(image: Any) -> list[dict[str, Any]]:
    """A user message's parts asking about `image`."""
    return [{"type": "image_url", "image_url": {"url": encode_png(image)}}, {"type": "text", "text": QUESTION}]


def load_environment(size: int = 64, shapes: int = 2, seed: int = 0, margin: float = 1.3, num_train: int = 5_000,
                     num_eval: int = 500, turns: int = 1, **kwargs: Any):
    import verifiers as vf
    from datasets import Dataset

    if not 2 <= shapes <= len(COLOURS):
        raise ValueError(f"largest_shape: shapes must be in [2, {len(COLOURS)}], got {shapes}")
    if turns < 1:
        raise ValueError(f"largest_shape: turns must be >= 1, got {turns}")

    def rows(split: str, n: int):
        def build() -> Dataset:
            prompts, answers, later = [], [], []
            for i in range(n):
                drawn = [picture(split, i * turns + k, size, shapes, seed, margin) for k in range(turns)]
                prompts.append([{"role": "user", "content": question(drawn[0][0])}])
                answers.append(drawn[0][1])
                later.append({"pictures": [encode_png(image) for image, _ in drawn[1:]], "answers": [a for _, a in drawn]})
            columns = {"prompt": prompts, "answer": answers, "example_id": list(range(n))}
            return Dataset.from_dict(columns if turns == 1 else {**columns, "info": later})
        return build

    if turns == 1:
        return vf.SingleTurnEnv(dataset=rows("train", num_train), eval_dataset=rows("eval", num_eval),
                                rubric=vf.Rubric(funcs=[exact_match]), **kwargs)

    def correct(completion: Any, info: dict, **_: Any) -> float:
        said = [message_text(m).strip() for m in completion or [] if _role(m) == "assistant"]
        return sum(s == a for s, a in zip(said, info["answers"])) / turns

    class LargestShapes(vf.MultiTurnEnv):
        async def env_response(self, messages: Any, state: Any, **_: Any) -> Any:
            asked = sum(_role(m) == "assistant" for m in messages)
            url = state["info"]["pictures"][asked - 1]
            return [vf.UserMessage(content=[{"type": "image_url", "image_url": {"url": url}},
                                            {"type": "text", "text": QUESTION}])]

    return LargestShapes(dataset=rows("train", num_train), eval_dataset=rows("eval", num_eval),
                         rubric=vf.Rubric(funcs=[correct]), max_turns=turns, **kwargs)


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
