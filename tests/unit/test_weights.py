"""Bucket planning, and a 2-rank gloo broadcast of a plan (two threads, one process)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from rlray.weightsync.transport import (
    Bucket,
    BufferPool,
    WeightReceiver,
    WeightSender,
    iter_bucket_views,
    open_weight_group,
    plan_buckets,
    plan_from_wire,
    plan_to_wire,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_plan_separates_dtypes_and_respects_size() -> None:
    params = [
        ("a", (4, 4), torch.float32),  # 64 B
        ("b", (8,), torch.float32),  # 32 B
        ("c", (4,), torch.bfloat16),  # 8 B, new dtype → new bucket
        ("d", (10,), torch.float32),  # 40 B
        ("e", (6,), torch.float32),  # 24 B, fits beside d
        ("f", (2,), torch.float32),  # 8 B, 72 ≤ 100 → same bucket
        ("g", (8,), torch.float32),  # 32 B, 72 + 32 > 100 → new bucket
    ]
    plan = plan_buckets(params, bucket_bytes=100)
    assert [[t.name for t in b.tensors] for b in plan] == [["a", "b"], ["c"], ["d", "e", "f"], ["g"]]
    assert [b.dtype for b in plan] == ["float32", "bfloat16", "float32", "float32"]
    for bucket in plan:
        assert len({t.dtype for t in bucket.tensors}) == 1
        assert bucket.numel == sum(t.numel for t in bucket.tensors)


def test_plan_exact_grouping_and_offsets() -> None:
    params = [("a", (4, 4), torch.float32), ("b", (8,), torch.float32), ("c", (4,), torch.bfloat16),
              ("d", (10,), torch.float32), ("e", (15,), torch.float32)]
    plan = plan_buckets(params, bucket_bytes=96)
    assert [[t.name for t in b.tensors] for b in plan] == [["a", "b"], ["c"], ["d"], ["e"]]
    a, b = plan[0].tensors
    assert (a.offset, a.numel, a.shape) == (0, 16, (4, 4))
    assert (b.offset, b.numel, b.shape) == (16, 8, (8,))
    assert plan[0].numel == 24 and plan[1].numel == 4 and plan[1].dtype == "bfloat16"
    assert plan[2].tensors[0].offset == 0


def test_big_tensor_gets_its_own_bucket() -> None:
    params = [("small", (2,), torch.float32), ("big", (100,), torch.float32), ("tail", (2,), torch.float32)]
    plan = plan_buckets(params, bucket_bytes=64)
    assert [[t.name for t in b.tensors] for b in plan] == [["small"], ["big"], ["tail"]]
    assert plan[1].numel == 100


def test_plan_rejects_bad_size() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("a", (1,), torch.float32)], bucket_bytes=0)


def test_iter_bucket_views_are_views() -> None:
    plan = plan_buckets([("x", (2, 3), torch.float32), ("y", (4,), torch.float32)], bucket_bytes=1 << 20)
    flat = torch.arange(10, dtype=torch.float32)
    views = dict(iter_bucket_views(plan[0], flat))
    assert torch.equal(views["x"], torch.arange(6.0).view(2, 3))
    assert torch.equal(views["y"], torch.arange(6.0, 10.0))
    assert views["y"].data_ptr() == flat.data_ptr() + 6 * 4


def test_pool_never_hands_out_a_viewed_buffer() -> None:
    plan = plan_buckets([("a", (4,), torch.float32), ("b", (4,), torch.float32),
                         ("c", (2,), torch.bfloat16)], bucket_bytes=16)
    pool = BufferPool(plan, torch.device("cpu"))
    first = pool.take("float32")
    assert pool.take("float32") is first  # nothing views it
    held = first[:2].view(2, 1).t()  # a view of a view still holds the storage
    second = pool.take("float32")
    assert second is not first and second.numel() == 4
    del held
    assert pool.take("float32") is first
    assert pool.take("bfloat16").dtype == torch.bfloat16 and len(pool) == 3


def test_pool_trim_keeps_free_buffers_only() -> None:
    pool = BufferPool(plan_buckets([("a", (4,), torch.float32)], bucket_bytes=16), torch.device("cpu"))
    views = []
    for _ in range(4):
        views.append(pool.take("float32")[:1])
    views.pop()
    first = views[0]
    pool.trim(keep=1)
    assert len(pool) == 1  # three buffers are still viewed; one of them is free
    first.fill_(7.0)
    assert float(first) == 7.0  # a trimmed buffer lives on through its view


def test_plan_is_picklable() -> None:
    import pickle

    plan = plan_buckets([("x", (2, 3), torch.float16)], bucket_bytes=1024)
    assert pickle.loads(pickle.dumps(plan)) == plan
    wire = plan_to_wire(plan)
    assert wire[0]["tensors"][0]["shape"] == (2, 3)
    as_msgpack = [{**b, "tensors": [{**t, "shape": list(t["shape"])} for t in b["tensors"]]} for b in wire]
    assert plan_from_wire(as_msgpack) == plan
    assert isinstance(plan[0], Bucket)


def model_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(64, 32, generator=g)),
        ("norm.weight", torch.randn(32, generator=g).to(torch.bfloat16)),
        ("layer.0.q.weight", torch.randn(32, 32, generator=g)),
        ("layer.0.k.weight", torch.randn(16, 32, generator=g)),
        ("layer.0.norm.weight", torch.randn(32, generator=g).to(torch.bfloat16)),
        ("head.weight", torch.randn(64, 32, generator=g)),
    ]


def run_pair(sender_fn, receiver_fn) -> None:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []

    def guarded(fn) -> None:  # type: ignore[no-untyped-def]
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in (sender_fn, receiver_fn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "weight group threads hung"
    if errors:
        raise errors[0]


def test_gloo_send_receive_exact() -> None:
    tensors = model_tensors()
    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in tensors], bucket_bytes=6000)
    assert len(plan) > 2
    port = free_port()
    received: dict[str, torch.Tensor] = {}
    sent_bytes: list[int] = []
    pooled: list[int] = []

    def sender() -> None:
        group = open_weight_group("127.0.0.1", port, 0, 2, timeout_s=30)
        sender = WeightSender(plan, group)
        for _ in range(2):  # buffers are reused across syncs
            sent_bytes.append(sender.send(iter(tensors)))
        group.close()

    def receiver() -> None:
        group = open_weight_group("127.0.0.1", port, 1, 2, timeout_s=30)
        recv = WeightReceiver(plan, group)
        for _ in range(2):
            received.clear()
            for name, view in recv.iter_weights():
                received[name] = view  # held across buckets, like vLLM's reload of a padded layer
            pooled.append(len(recv.pool))
        group.close()

    run_pair(sender, receiver)
    assert list(received) == [n for n, _ in tensors]
    for name, tensor in tensors:
        assert received[name].dtype == tensor.dtype
        assert torch.equal(received[name], tensor), name
    assert sent_bytes[0] == sum(t.numel() * t.element_size() for _, t in tensors)
    assert pooled == [0, 0]  # every buffer was still viewed when its sync ended


def test_sender_rejects_wrong_name_and_shape() -> None:
    tensors = model_tensors()
    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in tensors], bucket_bytes=1 << 20)
    port = free_port()
    group = open_weight_group("127.0.0.1", port, 0, 1, timeout_s=10)
    sender = WeightSender(plan, group)
    with pytest.raises(ValueError, match="expects 'embed.weight' next"):
        sender.send([("nope", tensors[0][1])])
    with pytest.raises(ValueError, match="shape"):
        sender.send([("embed.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="expects 6 tensors, got 1"):
        sender.send(tensors[:1])
    assert sender.send(tensors) > 0
    group.close()


class Work:
    def __init__(self, lost: bool) -> None:
        self.lost = lost

    def wait(self) -> None:
        if self.lost:
            raise RuntimeError("Connection closed by peer")


class FailingGroup:
    """A rank-0 weight group whose peer is lost at the second broadcast."""

    rank, device = 0, torch.device("cpu")

    def __init__(self) -> None:
        self.calls = 0

    def broadcast_async(self, tensor: torch.Tensor) -> Work:
        self.calls += 1
        return Work(self.calls == 2)

def test_sender_consumes_every_tensor_before_raising_a_lost_peer() -> None:
    tensors = model_tensors()
    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in tensors], bucket_bytes=6000)
    group = FailingGroup()
    consumed: list[str] = []

    def gathered():  # type: ignore[no-untyped-def]
        for name, t in tensors:  # on FSDP ranks each of these is an all-gather every rank joins
            consumed.append(name)
            yield name, t

    with pytest.raises(RuntimeError, match="weight broadcast failed after .* Connection closed by peer"):
        WeightSender(plan, group).send(gathered())  # type: ignore[arg-type]
    # the loss surfaces when the broadcast is waited for: when its buffer comes round again, or at the end
    assert consumed == [n for n, _ in tensors] and 2 <= group.calls <= len(plan)


def test_delta_patches_exactly_what_changed_in_the_wire_dtype() -> None:
    from rlray.weightsync.delta import apply_delta, changed_mask, delta_tensors, positions_first

    g = torch.Generator().manual_seed(0)
    last = {"a": torch.randn(64, 32, generator=g).bfloat16(), "b": (torch.randn(100, generator=g).abs() + 2).bfloat16(),
            "c": torch.randn(10, generator=g).bfloat16(), "d": torch.randn(1000, generator=g).bfloat16()}
    new = {k: v.clone() for k, v in last.items()}
    new["a"].view(-1)[[3, 700, 2047]] += 1.0  # 3 of 2048: positions are fewest bytes
    new["b"] = (new["b"].float() + 1e-4).bfloat16()  # a step below bf16's resolution: nothing changes
    new["c"] += 1.0  # every element: dense is fewest bytes
    new["d"][::2] += 1.0  # half: a bit mask (125 bytes) and 500 values beat 1000 values or 500 positions
    items, counts = [], {}
    for name, before in last.items():
        patch, counts[name] = delta_tensors(name, new[name], before)
        items += patch
    assert counts == {"a": 3, "b": 0, "c": 10, "d": 500}
    assert [n for n, _ in positions_first(items)] == ["a.delta_index", "d.delta_mask", "a.delta_value", "c",
                                                      "d.delta_value"]
    assert dict(items)["d.delta_mask"].numel() == 125
    patched = {k: v.clone() for k, v in last.items()}
    apply_delta(patched, positions_first(items))
    for name in last:
        assert torch.equal(patched[name].view(torch.int16), new[name].view(torch.int16)), name
    zero = torch.tensor([0.0, -0.0, float("nan")])
    assert changed_mask(zero, torch.tensor([0.0, 0.0, float("nan")])).tolist() == [False, True, False]  # bitwise


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss", "glm4_moe"])
def test_fused_experts_go_under_the_names_the_familys_vllm_loader_takes(arch: str) -> None:
    """DeepSeek-V3's loader knows only `experts.<e>.gate_proj.weight`, `.up_proj.weight` and `.down_proj.weight` (the
    fused (E, 2I, H) rows split in half, gate first: transformers' layout); gpt-oss's takes one fused tensor per
    expert under its own name; GLM-4.5's the fused tensors whole. The wire holds the trainer's values (bf16) exactly,
    and the routers' correction biases in float32."""
    from transformers import AutoModelForCausalLM

    from rlray.actors.publisher import WeightPublisher
    from rlray.config import ModelConfig
    from rlray.data.tokenizer import char_tokenizer
    from rlray.models.tiny import tiny_architecture

    tok = char_tokenizer()
    hf = tiny_architecture(ModelConfig(arch=arch, num_layers=2, moe_intermediate_size=32), len(tok), tok)
    model = AutoModelForCausalLM.from_config(hf)
    pub = WeightPublisher(model, torch.device("cpu"), 0, torch.bfloat16)
    sent = dict(pub.full_params(torch.bfloat16))
    assert {m.name: (m.shape, m.dtype) for m in pub._wire_meta()} == {n: (tuple(t.shape), t.dtype)
                                                                       for n, t in sent.items()}
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"  # a persistent buffer: sent, in float32 as vLLM keeps it
    assert (bias in sent) == (arch != "gpt_oss") and (arch == "gpt_oss" or sent[bias].dtype == torch.float32)
    model = model.to(torch.bfloat16)
    prefix = "model.layers.1.mlp.experts"
    fused = dict(model.named_parameters())
    gate_up, down = fused[f"{prefix}.gate_up_proj"], fused[f"{prefix}.down_proj"]
    if arch == "deepseek_v3":
        assert not any(n.startswith(f"{prefix}.gate_up_proj") for n in sent)
        for e in range(4):
            gate, up = gate_up[e].chunk(2)
            assert torch.equal(sent[f"{prefix}.{e}.gate_proj.weight"], gate) and gate.shape == (32, hf.hidden_size)
            assert torch.equal(sent[f"{prefix}.{e}.up_proj.weight"], up)
            assert torch.equal(sent[f"{prefix}.{e}.down_proj.weight"], down[e])
    elif arch == "gpt_oss":
        assert all(torch.equal(sent[f"{prefix}.{e}.gate_up_proj"], gate_up[e]) for e in range(4))
    else:
        assert torch.equal(sent[f"{prefix}.gate_up_proj"], gate_up) and f"{prefix}.0.gate_up_proj" not in sent
