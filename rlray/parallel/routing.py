"""Router replay (R3): the trainer's MoE routers use the experts the engine routed each token to.

Contract:
- `moe_routers(model)` lists the router of every MoE layer, in layer order: the router of a block that
  also holds fused experts, by the attribute names of the family records (rlray.config.families: `gate`
  or gpt-oss's `router`, and `experts`; transformers' Qwen3MoeTopKRouter, Glm4MoeTopkRouter,
  GptOssTopKRouter, ... each return `(logits, weights, indices)`, the logits with the router's bias if it
  has one). A router class no family record names is a ValueError naming it when replay is on.
- `RouterReplay(model, replay)` wraps each router's forward. Inside `with rr.routing(r)` (`r` a
  LongTensor [N, L, K]: for each of the N tokens of a forward, in the model's flattened [B, T]
  order, and each of the L MoE layers, the engine's K experts; `no_route` where the engine had none)
  - with `replay` on, a token with a route uses exactly those experts, weighted by the router's own
    scores at them (rlray.parallel.hf.router_weights), so the router still learns; a token without
    one routes as the router would;
  - on or off, `agreement()` counts the (token, layer) pairs with a route whose top-k set the router
    itself chose equals the engine's: `router_agree` of `router_pairs`, during the model's forward
    only (not in activation-checkpoint recomputation, which replays the same routing: keep the
    context open over backward).
  Outside a `routing` context, or for a forward whose token count is not N, routers run untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from rlray.config.families import moe_attrs, router_classes, router_rule
from rlray.parallel.hf import router_weights


def moe_routers(model: nn.Module) -> list[nn.Module]:
    found = []
    for m in model.modules():
        for router_attr, experts_attr in moe_attrs():
            router = getattr(m, router_attr, None)
            if (router is not None and hasattr(m, experts_attr) and hasattr(router, "top_k")
                    and getattr(router, "weight", None) is not None):
                found.append(router)
                break
    return found


class RouterReplay:
    def __init__(self, model: nn.Module, replay: bool) -> None:
        self.routers, self.replay = moe_routers(model), replay
        if replay:
            unknown = sorted({type(r).__name__ for r in self.routers if router_rule(type(r).__name__) is None})
            if unknown:
                raise ValueError(f"trainer.router_replay: no replay for router {', '.join(unknown)} (known: "
                                 f"{', '.join(router_classes())}); set trainer.router_replay=false")
        self.current: Tensor | None = None
        self.active = False
        self.counts = torch.zeros(2, dtype=torch.float64)  # (pairs agreeing, pairs with a route)
        model.register_forward_pre_hook(lambda *_: setattr(self, "active", True))
        model.register_forward_hook(lambda *_: setattr(self, "active", False))
        for layer, router in enumerate(self.routers):
            router.forward = self._wrap(layer, router.forward)

    @contextmanager
    def routing(self, routing: Tensor | None) -> Iterator[None]:
        previous, self.current = self.current, routing
        try:
            yield
        finally:
            self.current = previous

    def _wrap(self, layer: int, forward: Any) -> Any:
        router = self.routers[layer]

        def replayed(hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            logits, weights, indices = forward(hidden_states)
            r = self.current
            if r is None or r.shape[0] != indices.shape[0]:
                return logits, weights, indices
            route = r[:, layer].to(indices.device)
            has = (route < router.num_experts).all(-1)  # no_route is past every expert index
            if self.active:
                same = (indices.sort(-1).values == route.sort(-1).values).all(-1) & has
                counts = torch.stack([same.sum(), has.sum()]).double()  # on the device: no sync per layer
                self.counts = self.counts.to(counts.device) + counts
            if not self.replay:
                return logits, weights, indices
            chosen = torch.where(has[:, None], route, indices)
            replayed_weights = router_weights(router, logits, chosen).to(weights.dtype)
            return logits, torch.where(has[:, None], replayed_weights, weights), chosen

        return replayed

    def agreement(self, reset: bool = True) -> tuple[float, float]:
        agree, pairs = (float(x) for x in self.counts)
        if reset:
            self.counts.zero_()
        return agree, pairs
