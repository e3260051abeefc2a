"""`python -m rlray.bench <benchmark> [--quick] [--out FILE] [options]`; `-h` lists each one's options."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

BENCHMARKS = {  # subcommand: (module, one line)
    "weight-sync": ("rlray.bench.weight_sync", ("trainer -> vLLM weight broadcast GB/s vs per-tensor, "
                                                "object store and memcpy")),
    "weight-fit": ("rlray.bench.weight_fit", ("the CPU constants of the plan's sync time model, fitted on some "
                                              "twins (broadcast and m2n into a bf16 TP 2 engine), checked on others")),
    "async": ("rlray.bench.async_rl", "wall-clock of the same RL steps at max_off_policy_steps 0, 1, 2"),
    "trainer": ("rlray.bench.trainer_step", "TrainerActor.train_step tokens/s vs a bare FSDP2 loop"),
    "rollout": ("rlray.bench.rollout_gen", "rlray rollout path tokens/s vs vLLM's LLM.generate"),
    "memory": ("rlray.bench.memory", ("peak memory per trainer rank loading and stepping a dense and an MoE "
                                      "model on 1, 2, 4 ranks, against the full model")),
    "export": ("rlray.bench.export", ("HF export seconds and peak RSS per trainer rank: streamed (every rank its "
                                      "own tensors) vs gathered on rank 0")),
    "mismatch": ("rlray.bench.mismatch", ("engine/trainer mismatch KL and router agreement in bf16, router replay "
                                          "off vs on, dense vs MoE, over the same rollouts")),
    "checkpoint": ("rlray.bench.checkpoint", ("seconds a DCP checkpoint blocks the trainer, written synchronously vs "
                                              "in the background, tiny and ~200 MB models")),
    "sandbox": ("rlray.bench.sandbox", ("the sandbox of v1 harnesses that execute commands: start, teardown, a "
                                        "command, a relayed request, commands/s with sandboxes at once")),
    "gpu-step": ("rlray.bench.gpu_step", ("trainer step time and MFU of a ~1B dense model and a small MoE "
                                          "(one GPU, no Ray; --size tiny runs on CPU)")),
    "gpu-smoke": ("rlray.bench.gpu_smoke", ("the trainer half of the GPU path checked on one CUDA GPU without Ray "
                                            "or vLLM: setup, logprobs, step, DCP, side-stream gather, one GPU per "
                                            "rank (--cpu tests the script)")),
}


def parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """Only the chosen benchmark's module is imported (their imports are heavy)."""
    p = argparse.ArgumentParser(prog="python -m rlray.bench", description=__doc__)
    sub = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module, help_) in BENCHMARKS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--quick", action="store_true", help="the small CI smoke size")
        sp.add_argument("--out", help="JSON file to write (default runs/bench/<name>.json)")
        if name == chosen:
            importlib.import_module(module).add_arguments(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in BENCHMARKS), None)
    args = parser(chosen).parse_args(argv)
    module = importlib.import_module(BENCHMARKS[args.benchmark][0])
    t0 = time.perf_counter()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    report = module.run(args)
    report.seconds = round(time.perf_counter() - t0, 2)
    report.print()
    report.write(args.out)
    print(f"{args.benchmark} took {report.seconds:.1f}s", flush=True)
    if report.failed:
        print(f"{args.benchmark}: failed: {', '.join(report.failed)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: FSDP/gloo/vLLM threads can abort it after the work is done
