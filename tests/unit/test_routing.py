"""Router replay on one process, against hand-computed routing weights: the experts get the given
experts for routed tokens and the router's own choice elsewhere, in the forward and in the
activation-checkpoint recomputation; weights are the router's own scores at the given experts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlray.config import ModelConfig
from rlray.models.tiny import model_path
from rlray.models.vision import VISION_ARCHS
from rlray.parallel.expert import moe_experts
from rlray.parallel.routing import RouterReplay, moe_routers

SHAPE = {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
         "moe_intermediate_size": 16, "num_experts": 4, "experts_per_token": 2}
MODELS = {"qwen3_moe": ModelConfig(arch="qwen3_moe", seed=8, **SHAPE),
          "glm4_moe": ModelConfig(arch="glm4_moe", seed=9, **SHAPE),
          # vision-language, on text tokens (Qwen3-VL-MoE's experts must not be square: see rlray.models.vision)
          "qwen3_vl_moe": ModelConfig(arch="qwen3_vl_moe", seed=8, **{**SHAPE, "moe_intermediate_size": 8}),
          "glm4v_moe": ModelConfig(arch="glm4v_moe", seed=9, **SHAPE),
          "nemotron_h": ModelConfig(arch="nemotron_h", seed=9, **SHAPE),  # Mamba, MoE, attention, MoE layers
          "gpt_oss": ModelConfig(arch="gpt_oss", seed=10, **SHAPE),  # its router is `.router`, a Linear with a bias
          # a dense first layer; group-limited choice (2 groups of 2 experts, 1 kept), which replay overrides
          "deepseek_v3": ModelConfig(arch="deepseek_v3", seed=11, **SHAPE)}


def hand_weights(router: torch.nn.Module, hidden: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The routing weights of `experts` as the model card defines them, written out by hand."""
    logits = hidden.float() @ router.weight.float().T
    if type(router).__name__ == "GptOssTopKRouter":  # gpt-oss: its bias in the logits, a softmax over the top-k
        return (logits + router.bias).gather(1, experts).softmax(-1)
    if hasattr(router, "e_score_correction_bias"):  # GLM-4.5, Nemotron-H, DeepSeek-V3: sigmoid, no bias in the weights
        w = logits.sigmoid().gather(1, experts)
        return w / (w.sum(-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
    w = logits.softmax(-1).gather(1, experts)  # Qwen3-MoE: softmax, renormalised over the top-k if configured
    return w / w.sum(-1, keepdim=True) if getattr(router, "norm_topk_prob", True) else w  # Qwen3-VL-MoE: always


@torch.no_grad()
def with_choice_bias(model: torch.nn.Module) -> torch.nn.Module:
    """Sigmoid routers (GLM-4.5, Nemotron-H) with a choice bias and a scaling off their defaults (0, 1), as
    trained checkpoints have them (Nemotron-3-Nano scales by 2.5), so that both count."""
    for i, router in enumerate(moe_routers(model)):
        if hasattr(router, "e_score_correction_bias"):
            bias = torch.randn(router.num_experts, generator=torch.Generator().manual_seed(i))
            router.e_score_correction_bias.copy_(bias)
            router.routed_scaling_factor = 2.5
        if isinstance(getattr(router, "bias", None), torch.Tensor):  # gpt-oss's logits' bias, off its small init
            router.bias.copy_(torch.randn(router.num_experts, generator=torch.Generator().manual_seed(i)))
    return model


@pytest.mark.parametrize("arch", list(MODELS))
def test_replay_routes_given_tokens_to_given_experts(arch: str) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if arch in VISION_ARCHS else AutoModelForCausalLM
    model = with_choice_bias(auto.from_pretrained(model_path(MODELS[arch]), dtype=torch.float32))
    model.gradient_checkpointing_enable()
    model.train()
    routers, experts = moe_routers(model), [m for _, m in moe_experts(model)]
    assert len(routers) == len(experts) == (1 if arch.startswith(("glm", "deepseek")) else 2)  # a dense first layer
    ids = torch.randint(4, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    rng = np.random.default_rng(0)
    given = torch.tensor(np.stack([[rng.permutation(4)[:2] for _ in routers] for _ in range(ids.numel())]))
    given[::5] = 255  # no routing: these tokens route as the router would
    seen: list[list[tuple]] = [[] for _ in routers]
    inputs: list[list[torch.Tensor]] = [[] for _ in routers]
    for i, (r, e) in enumerate(zip(routers, experts)):
        r.register_forward_pre_hook(lambda _m, a, log=inputs[i]: log.append(a[0].detach().reshape(-1, a[0].shape[-1])))
        e.register_forward_pre_hook(lambda _m, a, log=seen[i]: log.append((a[1].detach(), a[2].detach())))
    replay = RouterReplay(model, replay=True)
    with replay.routing(given):
        model(input_ids=ids).logits.sum().backward()
    routed = (given < 4).all(-1).all(-1)  # per token
    for layer, router in enumerate(routers):
        assert len(seen[layer]) == 2  # the forward and the checkpointed layer's recomputation
        for (indices, weights), hidden in zip(seen[layer], inputs[layer]):
            own = type(router).forward(router, hidden)[2]  # the router's own choice, unwrapped
            assert torch.equal(indices[routed], given[routed, layer])
            assert torch.equal(indices[~routed], own[~routed])
            torch.testing.assert_close(weights, hand_weights(router, hidden, indices))
    assert routers[0].weight.grad is not None and routers[0].weight.grad.abs().max() > 0  # the router learns
    agree, pairs = replay.agreement()
    assert pairs == routed.sum() * len(routers) and agree < pairs  # random experts rarely match the router's


def test_replay_off_leaves_routing_alone_and_measures_agreement() -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path(MODELS["qwen3_moe"]), dtype=torch.float32).eval()
    ids = torch.randint(4, 40, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    routers = moe_routers(model)
    own: list[torch.Tensor] = []
    for r in routers:
        r.register_forward_hook(lambda _m, _a, out: own.append(out[2]))
    measure = RouterReplay(model, replay=False)
    with torch.no_grad():
        model(input_ids=ids)  # no routing given: untouched, nothing counted
        engine = torch.stack(own, 1).clone()  # [tokens, layers, k]: an engine that agrees everywhere
        for i in range(3):  # the two experts the router did not choose: a disagreement
            engine[i, 0] = torch.tensor(sorted(set(range(4)) - set(engine[i, 0].tolist())))
        engine[:3, 1] = engine[:3, 1].flip(-1)  # the same set in another order still agrees
        with measure.routing(engine):
            again = model(input_ids=ids).logits
    torch.testing.assert_close(again, plain)
    assert measure.agreement() == (2 * 12 - 3, 2 * 12)
    assert measure.agreement() == (0, 0)  # read and reset


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "nemotron_h", "gpt_oss", "deepseek_v3"])
def test_replaying_the_routers_own_choice_changes_no_bit(arch: str) -> None:
    """An engine that routed as the trainer's routers do (agreement 1.0): the replayed forward is the plain one."""
    from transformers import AutoModelForCausalLM

    model = with_choice_bias(AutoModelForCausalLM.from_pretrained(model_path(MODELS[arch]), dtype=torch.float32))
    ids = torch.randint(4, 40, (2, 11), generator=torch.Generator().manual_seed(2))
    own: list[torch.Tensor] = []
    routers = moe_routers(model)
    for r in routers:
        r.register_forward_hook(lambda _m, _a, out: own.append(out[2]))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        replay = RouterReplay(model, replay=True)
        with replay.routing(torch.stack(own, 1).clone()):
            again = model(input_ids=ids).logits
    assert torch.equal(again, plain)
    assert replay.agreement() == (ids.numel() * len(routers),) * 2
