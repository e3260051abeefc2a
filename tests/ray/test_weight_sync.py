"""The broadcast is real: after training and a sync, vLLM scores tokens as the trainer does."""

from __future__ import annotations

import numpy as np
import ray

from rlray.data.tokenizer import encode_prompt
from rlray.orchestration.controller import Controller
from tests.ray.conftest import tiny_config


def test_sync_makes_vllm_logprobs_equal_the_trainers(ray_cluster, tmp_path) -> None:
    ctl = Controller(tiny_config(tmp_path))
    try:
        ctl.start()
        tok = ctl.tokenizer
        prompt = encode_prompt(tok, "rev:abcdef=")
        ids = prompt + list(tok("fedcba", add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
        trainers, rollout = ctl.h.trainers, ctl.h.rollouts[0]

        def trainer_logprobs() -> np.ndarray:  # every FSDP rank joins the forward
            return np.array(ray.get([t.logprobs.remote(ids, len(prompt)) for t in trainers])[0])

        ctl.sync(0)
        synced = trainer_logprobs()
        np.testing.assert_allclose(ray.get(rollout.score.remote(ids, len(prompt))), synced, atol=1e-3)

        ray.get([t.set_stage.remote(1e-2, 0) for t in trainers])
        for step in range(3):  # the trainer moves on; vLLM keeps the old weights
            ray.get([t.sft_step.remote(mbs) for t, mbs in zip(trainers, ctl._sft_batch(step))])
        trained = trainer_logprobs()
        stale = np.array(ray.get(rollout.score.remote(ids, len(prompt))))
        assert np.abs(trained - synced).max() > 1e-2, "training did not change the trainer's logprobs"
        assert np.abs(stale - trained).max() > 1e-2, "vLLM had the new weights before any sync"

        ctl.sync(1)
        fresh = np.array(ray.get(rollout.score.remote(ids, len(prompt))))
        np.testing.assert_allclose(fresh, trained, atol=1e-3)
    finally:
        ctl.close()
