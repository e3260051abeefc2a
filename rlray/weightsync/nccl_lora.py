"""The workers' end of vLLM's own NCCL weight-transfer engine, with LoRA adapter updates
(rlray.weightsync.lora.AdapterUpdates): backend "rlray_nccl" of vLLM's worker factory, which
rlray's engines use on GPUs when they serve an adapter. The trainer's end is vLLM's "nccl" one.
Imported by vLLM's factory when it builds one (rlray.weightsync.protocol.register)."""

from __future__ import annotations

from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

from rlray.weightsync.lora import AdapterUpdates


class NCCLAdapterWeightTransferEngine(AdapterUpdates, NCCLWeightTransferEngine):
    """vLLM's NCCL engine; an update announced as an adapter is kept, not loaded into the model."""
