"""LoRA adapters in vLLM's engines, synced through vLLM's weight-transfer protocol: the one module
that touches vLLM's LoRA internals (each pinned by tests/unit/test_lora.py).

Measured on vLLM 0.32: a worker loads an adapter only from a folder (`LoRARequest.lora_path`, read
by `WorkerLoRAManager._load_adapter`), and it drops every adapter at the end of each weight update
(`Worker.finish_weight_update` calls `reset_lora_state`), so an adapter the transfer engine
installed would not outlive its own update. So:
- `AdapterUpdates`, a mixin of rlray's worker-side transfer engines: an update announced by
  `expect_adapter(config)` (before its start) skips the base's layerwise reload and keeps the
  tensors it receives (PEFT names, `rlray.models.lora.peft_name`) as `adapter` instead of loading
  them into the model. Any other update loads base weights as before.
- `serve_from_memory(manager, adapter)`: the worker's LoRA manager builds the adapter of
  `LORA_PATH` from that copy (`LoRAModel.from_lora_tensors`) instead of reading a folder. vLLM
  loads it again at the first step after every update, for in-flight requests too: no file.
- `lora_request()`: what every request carries once an adapter has been synced (one adapter, one
  slot; vLLM's prefix-cache keys hold its name and path, so the engine resets the cache per sync).
- `engine_args(rank)`: vLLM's LoRA arguments; `max_lora_rank` is the smallest size vLLM allows
  (`MAX_RANKS`) that holds `rank`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

LORA_NAME, LORA_ID = "rlray-policy", 1
LORA_PATH = "/rlray/in-memory-adapter"  # never read: serve_from_memory answers for it
MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks


def engine_args(rank: int) -> dict[str, Any]:
    fits = [r for r in MAX_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"trainer.lora.rank={rank}: vLLM serves adapters up to rank {MAX_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1, "max_cpu_loras": 1}


def lora_request() -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(LORA_NAME, LORA_ID, LORA_PATH)


class AdapterSink:
    """Stands in for the model while an adapter update is received: keeps copies of the tensors."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            self.tensors[name] = tensor.detach().to("cpu", copy=True)  # receive buffers are reused
        return set(self.tensors)


class AdapterUpdates:
    """Mixin for a vLLM `WeightTransferEngine` subclass (put it first): adapter updates are kept."""

    adapter: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None  # (PEFT config, tensors)
    _expected: dict[str, Any] | None = None
    _sink: AdapterSink | None = None

    def expect_adapter(self, config: dict[str, Any] | None) -> None:
        """The next update holds the adapter of PEFT `config` (None: base weights)."""
        self._expected = config

    def start_weight_update(self) -> None:
        if self._expected is None:
            super().start_weight_update()  # type: ignore[misc]
            return
        self._sink = AdapterSink()
        # vLLM's engines load what they receive through `self.model.load_weights`; the worker
        # restores its model after finish (`reset_weight_update_target`)
        self.set_weight_update_target(self._sink, self.model_config)  # type: ignore[attr-defined]

    def finish_weight_update(self) -> None:
        if self._expected is None:
            super().finish_weight_update()  # type: ignore[misc]
            return
        assert self._sink is not None, "finish_weight_update without its start"
        self.adapter = (self._expected, self._sink.tensors)
        self._expected, self._sink = None, None


def serve_from_memory(manager: Any, adapter: Callable[[], tuple[dict[str, Any], dict[str, torch.Tensor]] | None]
                      ) -> None:
    """Make the worker's LoRA manager (`worker.model_runner.lora_manager`) build `LORA_PATH`'s adapter
    from `adapter()` (the transfer engine's copy), checking its modules as a folder's would be."""
    from vllm.lora.peft_helper import PEFTHelper

    read_folder = manager._load_adapter

    def load(request: Any) -> Any:
        if request.lora_path != LORA_PATH:
            return read_folder(request)
        held = adapter()
        if held is None:
            raise RuntimeError("no LoRA adapter has been synced to this engine yet")
        config, tensors = held
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        # vLLM scales lora_B in place when it packs the adapter: give it copies
        lora = manager._lora_model_cls.from_lora_tensors(
            request.lora_int_id, {k: v.clone() for k, v in tensors.items()}, helper, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        unknown = set(lora.loras) - _servable_modules(manager)
        if unknown:
            raise ValueError(f"the engine serves no adapter on {sorted(unknown)[:4]}: check trainer.lora.target_modules")
        return lora

    manager._load_adapter = load


def _servable_modules(manager: Any) -> set[str]:
    """Module names (full, as vLLM names them) of the layers that can take an adapter."""
    adapters = manager._adapter_manager
    packed = {child for children in adapters.packed_modules.values() for child in children}
    names = set(adapters.modules) | packed
    # an adapter on q_proj lands in the packed qkv_proj: accept the unpacked names of packed modules
    for full in list(adapters.modules):
        prefix, _, leaf = full.rpartition(".")
        for child in adapters.packed_modules_mapping.get(leaf, []):
            names.add(f"{prefix}.{child}")
    return names
