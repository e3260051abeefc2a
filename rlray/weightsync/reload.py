"""Tensors a model's vLLM loader copies in bare, loaded again once a layerwise reload is finalized.

vLLM's layerwise reload (what its weight-transfer engines run between start and finish) swaps each layer's
parameters for meta tensors while an update streams in and counts what reaches them through their weight
loaders; a loader that writes a parameter with a bare `copy_` (gpt-oss's attention sinks) writes into nothing,
and the finalize puts the old tensor back ("Failed to load weights"). Contract: `KeepsBareCopies` is a mixin for a
vLLM `WeightTransferEngine` subclass (after rlray.weightsync.lora.AdapterUpdates, before the engine): while a base
update streams in, the tensors whose names end with one of the model family's `reload_after` suffixes
(rlray.config.families) are copied aside, and after the engine's own finish they are loaded into the model again,
whose parameters are real by then. A family without such names costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rlray.config.families import family, known


def reload_after(model_type: str) -> tuple[str, ...]:
    return family(model_type).reload_after if known(model_type) else ()


class _Keeping:
    """Stands in for the model during an update: loads everything, keeping copies of the `suffixes` tensors."""

    def __init__(self, model: torch.nn.Module, suffixes: tuple[str, ...]) -> None:
        self.model, self.suffixes = model, suffixes
        self.kept: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        def keep() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.endswith(self.suffixes):
                    self.kept.append((name, tensor.detach().clone()))  # receive buffers are reused
                yield name, tensor

        return self.model.load_weights(keep())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class KeepsBareCopies:
    _keeping: _Keeping | None = None

    def start_weight_update(self) -> None:
        super().start_weight_update()  # type: ignore[misc]
        config = getattr(self.model_config, "hf_config", None)  # type: ignore[attr-defined]
        suffixes = reload_after(getattr(config, "model_type", ""))
        if suffixes:
            self._keeping = _Keeping(self.model, suffixes)  # type: ignore[attr-defined]
            self.model = self._keeping

    def finish_weight_update(self) -> None:
        keeping, self._keeping = self._keeping, None
        if keeping is not None:
            self.model = keeping.model
        super().finish_weight_update()  # type: ignore[misc]
        if keeping is not None and keeping.kept:
            self.model.load_weights(iter(keeping.kept))
