"""rollout: completion tokens/s through rlray's rollout path against vLLM's own `LLM.generate`.

Same model, prompts and sampling everywhere: `--groups` reverse_text prompts per pass,
`group_size` completions each at the default recipe's temperature and max_tokens, the
sampled token's logprob requested (rlray always asks for it), prefix caching on, the
same engine settings as `RolloutActor` (fp32, eager, fixed KV cache). Every pass uses new
prompts (pass r takes examples r*groups ... (r+1)*groups - 1, the same for every path), so
no path gets another's prefix-cache hits. One engine at a time, each in its own process:
1. `vllm LLM.generate`: the offline `LLM` with every prompt in one call;
2. then one process holding a `RolloutActor` (no Ray; a local stand-in for the buffer):
   - `rlray Engine.generate`: all groups of a pass at once through the actor's engine;
   - `rlray RolloutActor.run`: the actor's own loop (ticket, generate, decode, score,
     Rollout records, `put`) for exactly one pass worth of groups; it draws its own next
     prompts from the reverse_text environment (the same task, the same prompt lengths);
   these two alternate pass by pass (and which goes first). Prompts (at most 14 tokens) fill no
   KV block, so the second path on a block gets no prefix-cache hits. Engine start-up is
   excluded; one warm-up pass each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlray.bench.common import Column, Report, median, ratio
from rlray.config import ModelConfig, RolloutConfig

MODELS: dict[str, dict[str, int]] = {
    "tiny": {},  # the default recipe's model (~1M parameters)
    "small": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "head_dim": 64,
              "intermediate_size": 1536},  # ~25M parameters
}
QUICK = {"models": ["tiny"], "groups": 8, "passes": 1}
PASS_TIMEOUT_S = 600.0  # a pass that takes longer has hung; fail with what is known
WORKER_TIMEOUT_S = 1800.0
FULL = {"models": ["tiny", "small"], "groups": 64, "passes": 4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), help=f"model presets (full: {FULL['models']})")
    p.add_argument("--groups", type=int, help="prompts per pass (the default recipe keeps up to 64 in flight)")
    p.add_argument("--passes", type=int, help="timed passes per path (after one warm-up pass)")


def _prompts(groups: int, index: int) -> list[list[int]]:
    from rlray.data.tokenizer import char_tokenizer, encode_prompt
    from rlray.envs.builtin.reverse_text import ReverseText

    tok, env = char_tokenizer(), ReverseText()
    return [encode_prompt(tok, env.example("train", i).prompt) for i in range(index * groups, (index + 1) * groups)]


def _vllm_worker(path: str, rc: RolloutConfig, groups: int, passes: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=path, max_model_len=rc.max_model_len, seed=0, gpu_memory_utilization=rc.kv_cache_fraction,
              logprobs_mode="processed_logprobs", enable_prefix_caching=True, dtype=rc.dtype,
              enforce_eager=rc.enforce_eager, kv_cache_memory_bytes=int(rc.kv_cache_gb * 2**30))
    params = SamplingParams(n=rc.group_size, temperature=rc.temperature, max_tokens=rc.max_tokens, logprobs=0,
                            detokenize=False)
    out: dict[str, Any] = {"vllm LLM.generate": []}
    try:
        for r in range(passes + 1):
            prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(groups, r)]
            t0 = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for res in results for c in res.outputs)
            print(f"    vllm LLM.generate: pass {r} {tokens} tokens in {seconds:.3f}s", flush=True)
            if r:
                out["vllm LLM.generate"].append({"seconds": seconds, "tokens": tokens})
    finally:  # the engine core process outlives an exiting parent unless told to stop
        llm.llm_engine.engine_core.shutdown()
    return out


class PassBuffer:
    """A stand-in for the BufferActor that grants one pass worth of group tickets at a time."""

    def __init__(self) -> None:
        self.granted = 0
        self.limit = 0
        self.put_groups = 0
        self.tokens = 0
        self.failed = 0
        self.done = asyncio.Event()

    def open_pass(self, groups: int) -> None:
        self.limit += groups
        self.done.clear()

    async def reserve(self, version: int, want: int) -> list[int]:
        n = max(0, min(want, self.limit - self.granted))
        self.granted += n
        return list(range(self.granted - n, self.granted))  # ticket numbers, as BufferActor grants them

    async def put(self, groups: list[Any]) -> None:
        self.put_groups += len(groups)
        self.tokens += sum(len(r.completion_ids) for g in groups for r in g.rollouts)
        if self.put_groups >= self.limit:
            self.done.set()

    async def cancel(self, tickets: list[int]) -> None:
        """A group failed: the pass cannot complete, so end it now (the caller raises)."""
        self.failed += len(tickets)
        self.done.set()


async def _rlray_passes(model: ModelConfig, rc: RolloutConfig, groups: int, passes: int) -> dict[str, Any]:
    from rlray.actors.rollout import RolloutActor
    from rlray.config import EnvConfig

    actor = RolloutActor(0, 1, model, rc, EnvConfig(), seed=0)
    await actor.start()
    try:
        return await _alternate(actor, rc, groups, passes)
    finally:
        await asyncio.wait_for(actor.shutdown(), 120)


async def _alternate(actor: Any, rc: RolloutConfig, groups: int, passes: int) -> dict[str, Any]:
    engine = actor.engine
    buffer = PassBuffer()
    loop_task = asyncio.create_task(actor.run(buffer))
    out: dict[str, Any] = {"rlray Engine.generate": [], "rlray RolloutActor.run": []}

    async def engine_pass(block: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        calls = [engine.generate(p, n=rc.group_size, temperature=rc.temperature, max_tokens=rc.max_tokens)
                 for p in _prompts(groups, block)]
        results = await asyncio.gather(*calls)
        return time.perf_counter() - t0, sum(len(s.completion_ids) for samples in results for s in samples)

    async def actor_pass() -> tuple[float, int]:
        before = buffer.tokens
        t0 = time.perf_counter()
        buffer.open_pass(groups)
        await asyncio.wait_for(buffer.done.wait(), PASS_TIMEOUT_S)
        if buffer.failed:
            raise RuntimeError(f"RolloutActor failed {buffer.failed} group(s); last error: {actor.last_error}")
        return time.perf_counter() - t0, buffer.tokens - before

    for r in range(passes + 1):
        order = [("rlray RolloutActor.run", actor_pass), ("rlray Engine.generate", lambda r=r: engine_pass(r))]
        for path, one_pass in order if r % 2 == 0 else order[::-1]:
            seconds, tokens = await asyncio.wait_for(one_pass(), PASS_TIMEOUT_S)
            print(f"    {path}: pass {r} {tokens} tokens in {seconds:.3f}s", flush=True)
            if r:
                out[path].append({"seconds": seconds, "tokens": tokens})
    await actor.stop()
    await asyncio.wait_for(loop_task, 60)
    return out


def _worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=["vllm", "rlray"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--passes", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from rlray.models.tiny import model_path

    model, rc = ModelConfig(**MODELS[a.model]), RolloutConfig(temperature=RolloutConfig.DEFAULT_TEMPERATURE)
    if a.worker == "vllm":
        result = _vllm_worker(model_path(model), rc, a.groups, a.passes)
    else:
        result = asyncio.run(_rlray_passes(model, rc, a.groups, a.passes))
    Path(a.out).write_text(json.dumps(result))


def run_in_own_group(cmd: list[str], timeout: float) -> None:
    """Run `cmd`; past `timeout`, kill it with every process it started (vLLM's engine core too)."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if code:
        raise subprocess.CalledProcessError(code, cmd)


def _spawn(worker: str, model: str, groups: int, passes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "rlray.bench.rollout_gen", "--worker", worker, "--model", model,
               "--groups", str(groups), "--passes", str(passes), "--out", out]
        t0 = time.perf_counter()
        run_in_own_group(cmd, WORKER_TIMEOUT_S)
        print(f"  {model}: {worker} process took {time.perf_counter() - t0:.1f}s (engine start-up included)",
              flush=True)
        return json.loads(Path(out).read_text())


def run(args: argparse.Namespace) -> Report:
    from rlray.models.tiny import model_path

    preset = QUICK if args.quick else FULL
    models = args.models or preset["models"]
    groups, passes = args.groups or preset["groups"], args.passes or preset["passes"]
    rc = RolloutConfig(temperature=RolloutConfig.DEFAULT_TEMPERATURE)
    report = Report("rollout", args.quick, params={
        "models": models, "groups_per_pass": groups, "group_size": rc.group_size, "passes": passes,
        "temperature": rc.temperature, "max_tokens": rc.max_tokens, "kv_cache_gb": rc.kv_cache_gb,
        "statistic": "median (and best) of per-pass tokens/s"})
    report.columns = [Column("model", "model"), Column("path", "path"), Column("passes", "passes"),
                      Column("completions", "completions/pass"), Column("tokens", "tokens/pass", "{:.0f}"),
                      Column("seconds", "s/pass", "{:.3f}"), Column("tokens_per_s", "tokens/s", "{:.0f}"),
                      Column("best_tokens_per_s", "best tokens/s", "{:.0f}")]
    for name in models:
        model_path(ModelConfig(**MODELS[name]))  # build the model files once, before either process
        results = {**_spawn("vllm", name, groups, passes), **_spawn("rlray", name, groups, passes)}
        rates, best = {}, {}
        for path, runs in results.items():
            rates[path] = median([x["tokens"] / x["seconds"] for x in runs])
            best[path] = max(x["tokens"] / x["seconds"] for x in runs)
            report.rows.append({"model": name, "path": path, "passes": len(runs), "completions": groups * rc.group_size,
                                "tokens": median([x["tokens"] for x in runs]),
                                "seconds": median([x["seconds"] for x in runs]), "tokens_per_s": rates[path],
                                "best_tokens_per_s": best[path],
                                "runs": runs})
        for stat, values in (("median", rates), ("best", best)):
            base = values["vllm LLM.generate"]
            for path, short in (("rlray Engine.generate", "Engine.generate"), ("rlray RolloutActor.run", "RolloutActor.run")):
                report.ratios[f"{name} {short} / LLM.generate ({stat})"] = ratio(values[path], base)
    report.notes = [("each path's engine runs alone in its own process (vLLM first, then rlray); random-weight "
                    "models, so completion lengths vary: compare tokens/s, not seconds."),
                    "ratio < 1 means the rlray path is slower than vLLM's offline LLM.generate."]
    return report


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # vLLM's background threads must not hold the process open
