"""The weight path from trainer rank 0 to every vLLM worker, on vLLM's weight-transfer protocol.
`protocol` registers rlray's gloo engine (both ends) in vLLM's factories and builds either
backend's trainer end (gloo: ours, nccl: vLLM's own); `transport` is the gloo group, the bucket plan,
the double-buffered sender and the pooled receiver, and the stream hand-over of a CUDA gather;
`delta` encodes the changed elements of a delta sync; `shm` is the colocated handover on CPUs (vLLM's
"ipc" on GPUs); `lora` and `nccl_lora` keep LoRA adapter updates. torch and vLLM only.
"""
