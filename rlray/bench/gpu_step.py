"""gpu-step: the trainer's step time and MFU on one GPU, without Ray.

`python -m rlray.bench.gpu_step` (or `python -m rlray.bench gpu-step`) builds random-weight
models from a config (cached on disk once: `TrainerActor` loads a model folder), a ~1.1B dense
Qwen3 and a small Qwen3-MoE (~1.0B total, ~0.3B active), and times `TrainerActor.train_step`
(FSDP2 on one rank, bf16 compute with fp32 master weights, the GRPO loss) on a packed batch of
full-length sequences. In the same run it measures the device's own bf16 matmul throughput,
so MFU is given both against the spec peak (`--peak-tflops`, or a table of known GPUs) and
against what a plain matmul reaches here.

FLOPs per trained token = 6 * N_active + 12 * L * (heads * head_dim) * seq_len, where N_active
counts every matmul weight a token passes through (attention, the dense MLP or the top-k
experts plus router, the output head; not the embedding lookup). `--size tiny` runs tiny
models of the same architectures on CPU (gloo) in seconds: the smoke test; its MFU is
against the measured fp32 matmul only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlray.algo.loss import algo_config
from rlray.bench.common import Column, Report, free_port, median, ratio

SPEC_BF16_TFLOPS = {  # dense bf16 tensor-core peak, no sparsity
    "H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0,
    "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 70.0,
    "A10": 125.0,
}


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str
    kind: str  # dense | moe
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    tie: bool = True

    def hf_config(self) -> Any:
        from transformers import Qwen3Config, Qwen3MoeConfig

        common = {"vocab_size": self.vocab, "hidden_size": self.hidden, "num_hidden_layers": self.layers,
                  "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                  "head_dim": self.head_dim, "intermediate_size": self.intermediate,
                  "max_position_embeddings": 32768, "tie_word_embeddings": self.tie, "bos_token_id": 1,
                  "eos_token_id": 2, "pad_token_id": 0}
        if self.kind == "dense":
            return Qwen3Config(**common)
        return Qwen3MoeConfig(**common, num_experts=self.experts, num_experts_per_tok=self.top_k,
                              moe_intermediate_size=self.moe_intermediate, decoder_sparse_step=1)

    def params(self) -> dict[str, float]:
        """Every matrix weight, and those one token is multiplied through (N_active): rlray.models.shape's count."""
        return _params(self)

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * self.params()["active"] + 12.0 * self.layers * self.heads * self.head_dim * seq_len


@functools.cache
def _params(arch: Arch) -> dict[str, float]:
    from rlray.models.shape import model_shape

    shape = model_shape(arch.hf_config(), arch.name)
    return {"total": float(shape.matrix_params), "active": float(shape.active_matrix_params)}


QWEN_VOCAB = 151936
ARCHS = {
    "full": [
        Arch("dense-1.1b", "dense", hidden=2048, layers=16, heads=16, kv_heads=8, head_dim=128, intermediate=6144,
             vocab=QWEN_VOCAB),
        Arch("moe-1b-a0.3b", "moe", hidden=1024, layers=16, heads=16, kv_heads=4, head_dim=64, intermediate=3072,
             vocab=QWEN_VOCAB, experts=32, top_k=4, moe_intermediate=512),
    ],
    "tiny": [
        Arch("dense-tiny", "dense", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=384,
             vocab=1024),
        Arch("moe-tiny", "moe", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=384,
             vocab=1024, experts=4, top_k=2, moe_intermediate=96),
    ],
}
DEFAULTS = {"full": {"seq_len": 2048, "batch": 16, "steps": 5, "warmup": 2, "micro_batch_tokens": 8192},
            "tiny": {"seq_len": 64, "batch": 8, "steps": 3, "warmup": 1, "micro_batch_tokens": 256}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=["full", "tiny"], help="full (GPU) or tiny (CPU smoke); --quick means tiny")
    p.add_argument("--models", nargs="+", help="names from the size's list (default: all)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (every sequence is full length)")
    p.add_argument("--batch", type=int, help="sequences per step")
    p.add_argument("--steps", type=int, help="timed steps per model")
    p.add_argument("--micro-batch-tokens", type=int, help="trainer.micro_batch_tokens")
    p.add_argument("--peak-tflops", type=float, help="the device's bf16 dense peak (default: known GPUs)")
    p.add_argument("--experts-impl", help="transformers experts implementation (eager, grouped_mm, batched_mm)")
    p.add_argument("--cache", help="where the random-weight model folders go (default: $RLRAY_CACHE or /tmp)")


def model_dir(arch: Arch, cache: Path, device: str) -> str:
    """A saved random-weight model of `arch` (built once per cache, atomically)."""
    import torch
    from transformers import AutoModelForCausalLM

    key = hashlib.sha1(json.dumps(dataclasses.asdict(arch), sort_keys=True).encode()).hexdigest()[:12]
    final = cache / f"bench-{arch.name}-{key}"
    if final.exists():
        return str(final)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".build-"))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(arch.hf_config(), dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    del model
    try:
        tmp.rename(final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def batch(arch: Arch, n: int, seq_len: int, micro_batch_tokens: int) -> list[Any]:
    import numpy as np

    from rlray.data.packing import Sample, pack

    rng = np.random.default_rng(0)
    half = seq_len // 2
    samples = []
    for _ in range(n):
        ids = rng.integers(3, arch.vocab, size=seq_len)
        samples.append(Sample(ids[:half], ids[half:], np.ones(seq_len - half, np.float32), float(rng.normal()),
                              np.full(seq_len - half, -2.0, np.float32)))
    return pack(samples, 1, micro_batch_tokens, pad_id=0)[0]


def matmul_tflops(device: str) -> tuple[float, str]:
    """Throughput of a plain square matmul here: bf16 8192^3 on a GPU, fp32 512^3 on CPU."""
    import torch

    dtype, n, reps = (torch.bfloat16, 8192, 20) if device == "cuda" else (torch.float32, 512, 10)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2.0 * n**3 * reps / (time.perf_counter() - t0) / 1e12, f"{str(dtype).removeprefix('torch.')} {n}^3"


def spec_peak(device: str, given: float | None) -> float | None:
    if given:
        return given
    if device != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(0)
    for key, tflops in SPEC_BF16_TFLOPS.items():  # the table lists longer names first where they overlap
        if key in name:
            return tflops
    return None


def trainer(path: str, micro_batch_tokens: int, device: str) -> Any:
    """A one-rank `TrainerActor` on `device` (FSDP2; on CUDA bf16 compute over fp32 masters), set up."""
    from rlray.actors.trainer import TrainerActor
    from rlray.config import ModelConfig, TrainerConfig

    cfg = TrainerConfig(num_ranks=1, gpus_per_rank=1 if device == "cuda" else 0, micro_batch_tokens=micro_batch_tokens)
    actor = TrainerActor(0, 1, f"127.0.0.1:{free_port()}", ModelConfig(name=path), cfg, algo_config(),
                         "nccl" if device == "cuda" else "gloo", temperature=1.0)
    actor.setup()
    return actor


def time_steps(actor: Any, arch: Arch, mbs: list[Any], opts: dict[str, Any], device: str) -> dict[str, Any]:
    """`opts["warmup"]` + `opts["steps"]` train steps of `mbs`; the timed ones' throughput and peak memory."""
    import torch

    tokens = sum(mb.num_tokens for mb in mbs)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, outs = [], []
    for i in range(opts["warmup"] + opts["steps"]):
        sync()
        t0 = time.perf_counter()
        outs.append(actor.train_step(mbs))
        sync()
        if i >= opts["warmup"]:
            times.append(time.perf_counter() - t0)
    seconds = median(times)
    return {"tokens": tokens, "micro_batches": len(mbs), "seconds": seconds, "seconds_all": times,
            "tokens_per_s": tokens / seconds, "tflops": arch.flops_per_token(opts["seq_len"]) * tokens / seconds / 1e12,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
            "loss": outs[-1]["loss"], "grad_norm": outs[-1]["grad_norm"]}


def finish(device: str) -> None:
    """After the last trainer of this process is dropped: leave its process group, free the GPU's cache."""
    import torch

    torch.distributed.destroy_process_group()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure(arch: Arch, path: str, opts: dict[str, Any], device: str) -> dict[str, Any]:
    actor = trainer(path, opts["micro_batch_tokens"], device)
    if opts.get("experts_impl") and hasattr(actor.model, "set_experts_implementation"):
        actor.model.set_experts_implementation(opts["experts_impl"])
    out = time_steps(actor, arch, batch(arch, opts["batch"], opts["seq_len"], opts["micro_batch_tokens"]), opts,
                     device)
    del actor
    finish(device)
    return out


def run(args: argparse.Namespace) -> Report:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = args.size or ("tiny" if args.quick else "full")
    if size == "full" and device != "cuda":
        raise SystemExit("gpu-step: no CUDA device here; the full size needs a GPU (use --size tiny on CPU)")
    d = DEFAULTS[size]
    opts = {"seq_len": args.seq_len or d["seq_len"], "batch": args.batch or d["batch"],
            "steps": args.steps or d["steps"], "warmup": d["warmup"],
            "micro_batch_tokens": args.micro_batch_tokens or d["micro_batch_tokens"],
            "experts_impl": args.experts_impl}
    archs = [a for a in ARCHS[size] if not args.models or a.name in args.models]
    if not archs:
        raise SystemExit(f"gpu-step: no model named {args.models}; {size} has {[a.name for a in ARCHS[size]]}")
    cache = Path(args.cache or os.environ.get("RLRAY_CACHE", Path(tempfile.gettempdir()) / "rlray-models"))
    peak = spec_peak(device, args.peak_tflops)
    mm, mm_what = matmul_tflops(device)
    report = Report("gpu-step", size == "tiny", params={
        "size": size, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", **opts,
        "spec_peak_tflops": peak, "matmul_tflops": mm, "matmul": mm_what,
        "flops_per_token": "6 * N_active + 12 * layers * heads * head_dim * seq_len",
        "statistic": "median step time after warm-up"})
    report.columns = [Column("model", "model"), Column("params_b", "params B", "{:.3f}"),
                      Column("active_b", "active B", "{:.3f}"), Column("tokens", "tokens/step"),
                      Column("seconds", "s/step", "{:.4f}"), Column("tokens_per_s", "tokens/s", "{:.0f}"),
                      Column("tflops", "TFLOP/s", "{:.3g}"), Column("mfu", "MFU", "{:.3f}"),
                      Column("vs_matmul", "x matmul", "{:.3f}"), Column("peak_mem_gb", "peak GiB", "{:.1f}")]
    for arch in archs:
        t0 = time.perf_counter()
        path = model_dir(arch, cache, device)
        print(f"  {arch.name}: model folder ready in {time.perf_counter() - t0:.1f}s ({path})", flush=True)
        res = measure(arch, path, opts, device)
        p = arch.params()
        row = {"model": arch.name, "params_b": p["total"] / 1e9, "active_b": p["active"] / 1e9, **res,
               "mfu": ratio(res["tflops"], peak) if peak else None, "vs_matmul": ratio(res["tflops"], mm)}
        report.rows.append(row)
        if peak:
            report.ratios[f"{arch.name} MFU (spec peak {peak:g} TFLOP/s)"] = row["mfu"]
        report.ratios[f"{arch.name} TFLOP/s / measured matmul"] = row["vs_matmul"]
    report.notes = [f"measured matmul ({mm_what}): {mm:.3g} TFLOP/s on {device}"]
    if device != "cuda":
        report.notes.append("CPU smoke run (no GPU): the numbers only show the script works")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlray.bench.gpu_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="same as --size tiny")
    p.add_argument("--out", help="JSON file to write (default runs/bench/gpu-step.json)")
    add_arguments(p)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    report = run(args)
    report.seconds = round(time.perf_counter() - t0, 2)
    report.print()
    report.write(args.out)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
