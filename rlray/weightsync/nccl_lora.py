"""The workers' end of vLLM's own GPU weight-transfer engines, with LoRA adapter updates
(rlray.weightsync.lora.AdapterUpdates) and a family's bare copies loaded again (rlray.weightsync.reload): backends
"rlray_nccl" (NCCL broadcast) and "rlray_ipc" (CUDA IPC, colocated) of vLLM's worker factory, which rlray's engines
use on GPUs when they serve an adapter or their family has such copies (gpt-oss's sinks). The
trainer's ends are vLLM's "nccl" and "ipc" ones. Imported by vLLM's factory when it builds one
(rlray.weightsync.protocol.register)."""

from __future__ import annotations

from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

from rlray.weightsync.lora import AdapterUpdates
from rlray.weightsync.reload import KeepsBareCopies


class NCCLAdapterWeightTransferEngine(AdapterUpdates, KeepsBareCopies, NCCLWeightTransferEngine):
    """vLLM's NCCL engine; an update announced as an adapter is kept, not loaded into the model."""


class IPCAdapterWeightTransferEngine(AdapterUpdates, KeepsBareCopies, IPCWeightTransferEngine):
    """vLLM's CUDA IPC engine; an update announced as an adapter is kept, not loaded into the model."""
