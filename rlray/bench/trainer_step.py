"""trainer: tokens/s of rlray's `TrainerActor.train_step` against a bare FSDP2 loop, same model and batch;
and of packed against padded micro-batches on an agentic length distribution (a few long, many short).

Both run in the same `--ranks` gloo processes (torch.multiprocessing, no Ray), on the same
packed RL batch (the default recipe's shape: `--batch` completions of reverse_text prompts,
completions of 4-16 tokens, packed by `rlray.data.packing.pack` as the buffer does), one
torch thread per rank as Ray gives each trainer actor. The bare loop is what any FSDP2 user
would write: `fully_shard` per decoder layer and the root, AdamW, tempered log-softmax,
advantage-weighted token sum over the global token count, backward, clip, step. The packed
and padded paths are `train_step` on one agentic-shaped batch laid out both ways. Timed blocks
of steps alternate between the paths (in order, then in reverse) so load changes hit all
alike; a step is timed on rank 0 between barriers. tokens/s counts real (unpadded) tokens of the
whole step over every rank. A third path is the same `train_step` with LoRA (rank 8 on every
projection, the base frozen): its step time, and the training state per rank (parameter shards,
gradients, AdamW moments) beside the full model's.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlray.algo.loss import algo_config
from rlray.bench.common import Column, Report, free_port, median, ratio
from rlray.config import LoraConfig, ModelConfig, TrainerConfig

MODELS: dict[str, dict[str, int]] = {
    "tiny2": {"num_layers": 2},  # the test suite's 2-layer tiny model
    "tiny": {},  # the default recipe's model (~1M parameters)
    "small": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "head_dim": 64,
              "intermediate_size": 1536},  # ~25M parameters
}
QUICK = {"models": ["tiny2"], "batch": 32, "rounds": 3, "steps": 1, "warmup": 1, "agentic_batch": 16}
FULL = {"models": ["tiny", "small"], "batch": 128, "rounds": 12, "steps": 1, "warmup": 2, "agentic_batch": 128}
TEMPERATURE = 0.7


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), help=f"model presets (full: {FULL['models']})")
    p.add_argument("--ranks", type=int, default=2, help="FSDP2 ranks (gloo processes); the default recipe has 2")
    p.add_argument("--batch", type=int, help="completions per step (the default recipe: 128)")
    p.add_argument("--rounds", type=int, help="rounds; each times a block of each path, in alternating order")
    p.add_argument("--steps", type=int, help="timed steps per block (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (Ray gives actors 1)")
    p.add_argument("--agentic-batch", type=int, help="sequences of the packed/padded batch (full: 128)")
    p.add_argument("--micro-batch-tokens", type=int, default=TrainerConfig().micro_batch_tokens,
                   help="trainer.micro_batch_tokens of the packed/padded batch (default: the config's)")


def rl_batch(num_ranks: int, n: int, pad_id: int, seed: int = 0) -> list[list[Any]]:
    """`n` reverse_text completions with random tokens, advantages and logprobs, packed per rank."""
    from rlray.data.packing import Sample, pack
    from rlray.data.tokenizer import char_tokenizer, encode_prompt
    from rlray.envs.builtin.reverse_text import ReverseText

    tok, env = char_tokenizer(), ReverseText()
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        prompt = np.asarray(encode_prompt(tok, env.example("train", i // 8).prompt))
        completion = rng.integers(4, len(tok), size=int(rng.integers(4, 17)))
        samples.append(Sample(prompt, completion, np.ones(len(completion), np.float32), float(rng.normal()),
                              np.full(len(completion), -2.0, np.float32)))
    return pack(samples, num_ranks, micro_batch_tokens=8192, pad_id=pad_id)


def agentic_batch(num_ranks: int, n: int, packed: bool, micro_batch_tokens: int, seed: int = 1) -> list[list[Any]]:
    """`n` sequences shaped like agentic rollouts: one in eight long (a 64-token prompt, 192-440
    completion tokens: many turns), the rest short (16-32 + 8-40), random tokens."""
    from rlray.data.packing import Sample, pack

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        long = i % 8 == 0
        prompt = rng.integers(4, 40, size=64 if long else int(rng.integers(16, 33)))
        completion = rng.integers(4, 40, size=int(rng.integers(192, 441) if long else rng.integers(8, 41)))
        samples.append(Sample(prompt, completion, np.ones(len(completion), np.float32), float(rng.normal()),
                              np.full(len(completion), -2.0, np.float32)))
    return pack(samples, num_ranks, micro_batch_tokens, pad_id=0, packed=packed)


class BareLoop:
    """A plain FSDP2 policy-gradient step, with nothing of rlray but the model files."""

    def __init__(self, path: str, world: int, lr: float) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    def step(self, micro_batches: list[Any]) -> float:
        torch = self.torch
        self.model.train()
        for mb in micro_batches:
            ids = torch.from_numpy(mb.input_ids)
            mask, adv = torch.from_numpy(mb.loss_mask), torch.from_numpy(mb.advantages)
            pos = torch.from_numpy(mb.position_ids)  # restarting per packed sequence: transformers masks block-causally
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
            logp = torch.log_softmax(logits[:, :-1] / TEMPERATURE, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss = -(logp * adv[:, 1:] * mask[:, 1:]).sum() / mb.num_loss_tokens_global
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def _worker(rank: int, world: int, port: int, model_name: str, opts: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist

    from rlray.actors.trainer import TrainerActor
    from rlray.models.tiny import model_path

    torch.set_num_threads(opts["threads"])
    cfg = ModelConfig(**MODELS[model_name])
    actor = TrainerActor(rank, world, f"127.0.0.1:{port}", cfg, TrainerConfig(num_ranks=world),
                         algo_config(aggregation="token"), "gloo", TEMPERATURE)
    actor.setup()
    lora = TrainerActor(rank, world, f"127.0.0.1:{port}", cfg, TrainerConfig(num_ranks=world, lora=LoraConfig(rank=8)),
                        algo_config(aggregation="token"), "gloo", TEMPERATURE)
    lora.setup()  # the same model with rank-8 adapters on every projection, the base frozen
    bare = BareLoop(model_path(cfg), world, lr=TrainerConfig().lr)
    params = sum(p.numel() for p in bare.model.parameters())  # DTensor.numel() is the full tensor's
    batches = {"rlray": rl_batch(world, opts["batch"], pad_id=0)}
    batches["bare"] = batches["lora"] = batches["rlray"]
    for layout in ("packed", "padded"):
        batches[layout] = agentic_batch(world, opts["agentic_batch"], layout == "packed", opts["agentic_tokens"])
    sizes = {k: {"tokens": int(sum(mb.num_tokens for mbs in b for mb in mbs)),
                 "slots": int(sum(mb.num_slots for mbs in b for mb in mbs))} for k, b in batches.items()}
    paths = {"rlray": lambda: actor.train_step(batches["rlray"][rank]),
             "bare": lambda: bare.step(batches["bare"][rank]),
             "lora": lambda: lora.train_step(batches["lora"][rank]),
             "packed": lambda: actor.train_step(batches["packed"][rank]),
             "padded": lambda: actor.train_step(batches["padded"][rank])}
    times: dict[str, list[float]] = {k: [] for k in paths}
    for name, step in paths.items():
        for _ in range(opts["warmup"]):
            step()
    for r in range(opts["rounds"]):  # forward, then backward order: no path always goes first
        for name, step in list(paths.items())[:: 1 if r % 2 == 0 else -1]:
            for _ in range(opts["steps"]):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
    state = {"rlray": state_bytes(actor.learner), "lora": state_bytes(lora.learner)}
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "sizes": sizes, "params": params, "state": state,
                                         "threads": torch.get_num_threads()}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # FSDP2 on gloo can abort in interpreter teardown after all work is done


def state_bytes(learner: Any) -> int:
    """This rank's training state after a step: parameter shards, the trainable ones' gradients (as
    large as they are) and AdamW's moments."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    size = lambda t: local(t).numel() * local(t).element_size()
    params = sum(size(p) for p in learner.model.parameters())
    grads = sum(size(p) for p in learner.trainable())
    moments = sum(size(v) for st in learner.optimizer.state.values() for v in st.values() if v.dim() > 0)
    return int(params + grads + moments)


def measure(model_name: str, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from rlray.models.tiny import model_path

    model_path(ModelConfig(**MODELS[model_name]))  # build the shared model files once, before the ranks
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, free_port(), model_name, opts, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


LABELS = {"rlray": "rlray TrainerActor.train_step", "bare": "bare FSDP2 loop", "lora": "rlray train_step, LoRA r8",
          "packed": "agentic batch, packed", "padded": "agentic batch, padded"}


def run(args: argparse.Namespace) -> Report:
    preset = QUICK if args.quick else FULL
    opts = {"batch": args.batch or preset["batch"], "rounds": args.rounds or preset["rounds"],
            "steps": args.steps or preset["steps"], "warmup": preset["warmup"], "threads": args.threads,
            "agentic_batch": args.agentic_batch or preset["agentic_batch"], "agentic_tokens": args.micro_batch_tokens}
    models = args.models or preset["models"]
    report = Report("trainer", args.quick, params={"models": models, "ranks": args.ranks, **opts,
                                                    "statistic": "median (and best) step time over every timed step"})
    report.columns = [Column("model", "model"), Column("params_m", "params M", "{:.2f}"), Column("path", "path"),
                      Column("tokens_per_step", "tokens/step"), Column("padding_frac", "padding", "{:.2f}"),
                      Column("steps", "steps"), Column("step_seconds", "s/step", "{:.4f}"),
                      Column("tokens_per_s", "tokens/s", "{:.0f}"), Column("best_tokens_per_s", "best tokens/s", "{:.0f}"),
                      Column("state_mb", "state MB/rank", "{:.2f}")]
    for name in models:
        t0 = time.perf_counter()
        res = measure(name, args.ranks, opts)
        print(f"  {name}: measured in {time.perf_counter() - t0:.1f}s", flush=True)
        rates, best = {}, {}
        for path, times in res["times"].items():
            size, seconds = res["sizes"][path], median(times)
            rates[path], best[path] = size["tokens"] / seconds, size["tokens"] / min(times)
            report.rows.append({"model": name, "params_m": res["params"] / 1e6, "path": LABELS[path],
                                "tokens_per_step": size["tokens"], "slots_per_step": size["slots"],
                                "padding_frac": 1 - size["tokens"] / size["slots"],
                                "steps": len(times), "step_seconds": seconds, "step_seconds_all": times,
                                "tokens_per_s": rates[path], "best_tokens_per_s": best[path],
                                "state_mb": res["state"].get(path, 0) / 1e6 or None})
        report.ratios[f"{name} lora / full training state per rank"] = ratio(res["state"]["lora"], res["state"]["rlray"])
        for a, b in (("rlray", "bare"), ("lora", "rlray"), ("packed", "padded")):
            report.ratios[f"{name} {a} / {b} tokens/s (median)"] = ratio(rates[a], rates[b])
            report.ratios[f"{name} {a} / {b} tokens/s (best)"] = ratio(best[a], best[b])
    report.notes = [(f"{args.ranks} gloo ranks (torch.multiprocessing, no Ray), {args.threads} torch thread(s) per "
                    "rank; the paths alternate step by step (forward, then backward order); ratio < 1 means the first "
                    "is slower. 'best' uses each path's fastest step, the least disturbed by other load."),
                    ("state MB/rank: parameter shards + the trainable parameters' gradients + AdamW moments on "
                     "rank 0 after the steps (LoRA: a frozen fp32 base, rank-8 adapters on every projection)."),
                    (f"rlray / bare: the default recipe's batch ({opts['batch']} reverse_text completions, packed). "
                     f"packed / padded: the same {opts['agentic_batch']} agentic-shaped sequences (1 in 8 of 256-504 "
                     "tokens, the rest 24-72) through train_step, packed into rows of "
                     f"{opts['agentic_tokens']} tokens (trainer.micro_batch_tokens) or one padded row per sequence, "
                     "longest first, at most that many padded tokens per micro-batch; padding = the share of "
                     "computed positions that are padding.")]
    return report
