"""The vlm recipe's CPU twin (`+recipe=vlm +twin=cpu`) on the local Ray cluster: a tiny Qwen3-VL on 2
FSDP ranks, SFT then synchronous GRPO on largest_shape's pictures, two per rollout (turns=2: the
environment's reply to the first answer is a user message with the second picture, sent token in).
The images travel from the environment (PNG data URLs) through the engine and the buffer to the
trainer; every step's rollouts come from the weights just synced, so `mismatch_kl` (fp32) shows the
engine and the trainer giving the same logprobs on multi-turn image conversations, and no rollout is
a TokenMismatch. The learning criterion is a measured number (README), not this test."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlray.orchestration.controller import run
from tests.ray.conftest import tiny_config


def test_vlm_twin_trains_on_pictures(ray_cluster, tmp_path) -> None:
    c = tiny_config(tmp_path, "+recipe=vlm", "+twin=cpu", "sft.max_steps=6", "sft.eval_every=3", "sft.stop_reward=1.1",
                    "rl.steps=4", "eval.num_examples=8", "checkpoint.every=0", "async.max_off_policy_steps=0",
                    "env.mix=[{id:largest_shape,args:{size:64,shapes:3,turns:2}}]", "rollout.max_images=2")
    assert (c.model.arch, c.trainer.ep, c.stages, c.env.mix[0].id) == ("qwen3_vl", 1, ["sft", "rl"], "largest_shape")
    run(c)
    records = [json.loads(line) for line in (Path(c.run.dir) / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in records if r["stage"] == "sft"]
    rl = [r for r in records if r["stage"] == "rl"]
    assert len(sft) == 6 and sft[-1]["loss"] < 0.5 * sft[0]["loss"]  # the answers are learnt from the pictures
    assert len(rl) == 4
    for r in rl:
        assert r["completion_tokens"] > 0 and r["rollout_errors"] == 0 and r["token_mismatch_frac"] == 0, r
        assert r["lag_max"] == 0 and math.isfinite(r["mismatch_kl"]) and r["mismatch_kl"] < 1e-6, r
    assert any(r["turns_mean"] > 1 for r in rl)  # answers that end with eos get the second picture
    assert any(r["grad_norm"] > 0 for r in rl)
    evals = [r for r in records if r["stage"] == "eval"]
    assert evals and all(0.0 <= r["eval_reward"] <= 1.0 for r in evals)
