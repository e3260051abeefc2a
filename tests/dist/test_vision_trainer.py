"""The trainer on image sequences of a tiny Qwen3-VL (fp32, gloo).

- Its logprobs equal transformers' own model on the processor's inputs, computed independently:
  the prompt's forward with its images, then the completion on that KV cache (the way a completion
  holding a sampled image-pad token is a plain token, as in vLLM).
- Packed micro-batches (several image sequences per row, multimodal rotary positions restarting per
  sequence) give the same loss and gradients as one padded row per sequence (rtol 1e-5), on 1
  process and on 2 FSDP ranks, with sequences of 0, 1 and 2 images and sampled image pads.
- `trainer.freeze_vision`: the tower gets no gradient and the language model's gradients are unchanged.
- The MoE families (Qwen3-VL-MoE, GLM-4.5V): on one process packed equals padded and the logprobs equal
  transformers'; on 2 ranks with expert parallelism (EP 2) the loss and gradients equal that one process's.
  GLM-4.5V's text model hands its layers the rotary rows as positions (rlray.parallel.hf.text_positions_to_layers).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rlray.algo.loss import algo_config
from rlray.config import ModelConfig, TrainerConfig
from rlray.data.layout import model_inputs
from rlray.data.packing import Sample, pack
from rlray.models.multimodal import vision_tower
from rlray.models.tiny import model_path
from rlray.models.vision import placeholder_spans
from rlray.parallel.expert import moe_experts
from rlray.types import Images
from tests.dist.common import assert_grads_close, full_grads, spawn

pytest.importorskip("torchvision")

SHAPE = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "num_kv_heads": 1}
MODELS = {"qwen3_vl": ModelConfig(arch="qwen3_vl", seed=3, **SHAPE),
          **{arch: ModelConfig(arch=arch, moe_intermediate_size=16, num_experts=4, experts_per_token=2, seed=4, **SHAPE)
             for arch in ("qwen3_vl_moe", "glm4v_moe")}}
SIZES = [(64, 48), (48, 64), (32, 32), (96, 40)]


def picture(i: int) -> Any:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", SIZES[i % len(SIZES)], "white")
    ImageDraw.Draw(image).rectangle((2 + i, 3, 20 + 3 * i, 25), fill=("red", "blue", "green")[i % 3])
    return image


def samples(path: str) -> tuple[list[Sample], list[dict[str, Any]]]:
    """Sequences with 0, 1 or 2 images; odd ones sampled an image pad; two share one Images object
    (rollouts of one prompt). Also each one's processor inputs, for the reference."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    pad = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    rng = np.random.default_rng(0)
    out, refs, shared = [], [], None
    for i in range(9):
        pictures = [picture(i + k) for k in range(i % 3)]
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": f"shape {i}?"}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        inputs = processor(text=[text], images=pictures or None, return_tensors="pt")
        prompt = inputs["input_ids"][0].numpy()
        completion = rng.integers(4, 30, size=3 + (i * 5) % 11)
        if i % 2:
            completion[1] = pad  # a sampled image pad: a plain token
        images = None
        if pictures:
            images = Images(inputs["pixel_values"].numpy(), inputs["image_grid_thw"].numpy(),
                            placeholder_spans(prompt.tolist(), pad))
            if i == 4:
                images = shared = out[1].images if shared is None else shared  # the same prompt's images
                prompt, inputs = out[1].prompt_ids, refs[1]["inputs"]
        logp = rng.uniform(-4, -1, len(completion)).astype(np.float32)
        out.append(Sample(prompt, completion, np.ones(len(completion), np.float32), float(rng.normal()), logp,
                          images=images))
        refs.append({"inputs": {k: v for k, v in inputs.items() if k != "input_ids"}})
    return out, refs


@torch.no_grad()
def reference_logprobs(path: str, sample: Sample, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    """transformers alone: log p(completion[j] | prompt, completion[:j]) on the prompt's KV cache."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    first = model(input_ids=torch.tensor(sample.prompt_ids)[None], use_cache=True, **inputs)
    rest = model(input_ids=torch.tensor(sample.completion_ids[:-1])[None], past_key_values=first.past_key_values)
    logits = torch.cat([first.logits[0, -1:], rest.logits[0]])
    lp = torch.log_softmax(logits.float() / 0.7, -1)
    return lp.gather(1, torch.tensor(sample.completion_ids)[:, None])[:, 0].numpy()


def worker(rank: int, world: int, port: int, out: dict, freeze: bool, arch: str = "qwen3_vl", ep: int = 1) -> None:
    from rlray.actors.trainer import TrainerActor

    model = MODELS[arch]
    t = TrainerActor(rank, world, f"127.0.0.1:{port}", model,
                     TrainerConfig(num_ranks=world, freeze_vision=freeze, ep=ep), algo_config(loss="dapo"), "gloo",
                     temperature=0.7)
    t.setup()
    path = model_path(model)
    data, refs = samples(path)
    for packed in (True, False):
        mbs = pack(data, world, micro_batch_tokens=160, pad_id=0, packed=packed)[rank]
        t.learner.optimizer.zero_grad(set_to_none=True)
        sums = t.forward_backward(mbs, rl=True)
        loss = torch.tensor(sums["loss"], dtype=torch.float64)
        dist.all_reduce(loss)
        grads = full_grads(t.model)
        if rank == 0:
            out[packed] = {"loss": float(loss) / sums["_norm"], "grads": grads, "rows": sum(len(m.input_ids) for m in mbs),
                           "images": sum(len(m.image_grid_thw) for m in mbs if m.image_grid_thw is not None),
                           "vision": [n for n, p in t.model.named_parameters() if n.startswith("model.visual.")],
                           "vision_grads": [p.grad is not None for p in vision_tower(t.model).parameters()]}
    if rank == 0:
        out["experts"] = [m.num_experts for _, m in moe_experts(t.model)]  # this rank's experts per MoE layer
    if world == 1 and not freeze:
        mb = pack(data, 1, micro_batch_tokens=10_000, pad_id=0)[0][0]  # every sequence in one packed row
        with torch.no_grad():
            got = t.learner._token_logprobs(model_inputs(mb, t.device), 0.7).numpy()
        where = {id(s): i for i, s in enumerate(data)}
        out["scored"] = [(got[n, len(s.prompt_ids):len(s)], reference_logprobs(path, s, refs[where[id(s)]]["inputs"]))
                         for n, s in enumerate(sorted(data, key=len, reverse=True))]
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_image_sequences_packed_match_padded(world: int) -> None:
    out = spawn(worker, world, False)
    packed, padded = out[True], out[False]
    assert packed["images"] == padded["images"] == 9 if world == 1 else packed["images"] > 0
    assert packed["rows"] < padded["rows"]
    assert np.isclose(packed["loss"], padded["loss"], rtol=1e-5), (packed["loss"], padded["loss"])
    assert_grads_close(padded["grads"], packed["grads"], rtol=1e-5)
    vision = [n for n in packed["grads"] if n.startswith("model.visual.")]
    assert vision and max(float(np.abs(packed["grads"][n]).max()) for n in vision) > 0  # the tower trains
    if world == 1:
        assert len(out["scored"]) == 9
        for got, want in out["scored"]:
            assert np.abs(got - want).max() < 1e-5, np.abs(got - want).max()


def test_freeze_vision_leaves_the_language_gradients_alone() -> None:
    trained, frozen = spawn(worker, 1, False)[True], spawn(worker, 1, True)[True]
    assert frozen["vision"] and not any(frozen["vision_grads"]) and all(trained["vision_grads"])
    assert np.isclose(trained["loss"], frozen["loss"], rtol=1e-6)
    language = {n: g for n, g in trained["grads"].items() if not n.startswith("model.visual.")}
    assert_grads_close(language, {n: frozen["grads"][n] for n in language}, rtol=1e-6)


@pytest.mark.parametrize("arch", ["qwen3_vl_moe", "glm4v_moe"])
def test_moe_families_on_one_process_and_with_expert_parallelism(arch: str) -> None:
    one, two = spawn(worker, 1, False, arch, 1), spawn(worker, 2, False, arch, 2)
    assert one["experts"] and set(one["experts"]) == {4} and set(two["experts"]) == {2}
    assert one[True]["images"] == one[False]["images"] == 9
    assert np.isclose(one[True]["loss"], one[False]["loss"], rtol=1e-5), (one[True]["loss"], one[False]["loss"])
    assert_grads_close(one[False]["grads"], one[True]["grads"], rtol=1e-5)
    for got, want in one["scored"]:
        assert np.abs(got - want).max() < 1e-5, np.abs(got - want).max()
    assert np.isclose(two[True]["loss"], one[True]["loss"], rtol=1e-5), (two[True]["loss"], one[True]["loss"])
    assert_grads_close(one[True]["grads"], two[True]["grads"], rtol=1e-4)  # EP sums in another order
    vision = [n for n in two[True]["grads"] if n.startswith("model.visual.")]
    assert vision and max(float(np.abs(two[True]["grads"][n]).max()) for n in vision) > 0
