"""On-policy distillation (algo.loss=opd) against hand computations: advantages, the loss of a packed
batch through the buffer, the teacher's scoring as the buffer drives it (a failing teacher costs its
group only), the temperature rule, the config refusals and the plan's teacher pool."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from rlray.actors.buffer import BufferActor
from rlray.algo.advantages import opd_advantages, teacher_kl
from rlray.algo.loss import algo_config, get_loss, loss_normalizer
from rlray.config import ConfigError
from rlray.types import Group, Rollout
from tests.unit.test_losses import composed


def rollout(behaviour: list[float], teacher: list[float] | None, mask: list[int], reward: float = 0.0) -> Rollout:
    n = len(behaviour)
    return Rollout(prompt_ids=np.array([1, 2]), completion_ids=np.arange(10, 10 + n),
                   logprobs=np.array(behaviour, np.float32), loss_mask=np.array(mask, np.int8),
                   versions=np.zeros(n, np.int64), reward=reward,
                   teacher_logprobs=None if teacher is None else np.array(teacher, np.float32))


def test_opd_advantages_are_teacher_minus_behaviour_on_model_tokens() -> None:
    """Token 1 of rollout a is an environment token (mask 0): no advantage, and not in teacher_kl.
    Rewards 1 and 0 give group advantages +-1 (std-normalised, eps 0), mixed in at opd_reward_coef."""
    a = rollout([-0.5, -2.0, -1.0], [-0.2, -0.1, -3.0], [1, 0, 1], reward=1.0)
    b = rollout([-1.0, -1.0], [-1.5, -0.5], [1, 1], reward=0.0)
    g = Group([a, b])
    alone = opd_advantages(g, algo_config(loss="opd", std_eps=0.0, max_tokens=8))
    np.testing.assert_allclose(alone[0], [0.3, 0.0, -2.0], atol=1e-6)
    np.testing.assert_allclose(alone[1], [-0.5, 0.5], atol=1e-6)
    mixed = opd_advantages(g, algo_config(loss="opd", std_eps=0.0, opd_reward_coef=0.5, max_tokens=8))
    np.testing.assert_allclose(mixed[0], [0.3 + 0.5, 0.0, -2.0 + 0.5], atol=1e-6)
    np.testing.assert_allclose(mixed[1], [-0.5 - 0.5, 0.5 - 0.5], atol=1e-6)
    # KL(student || teacher), k1 over the four model tokens: (-0.3 + 2.0 + 0.5 - 0.5) / 4
    assert teacher_kl(g.rollouts) == pytest.approx((-0.3 + 2.0 + 0.5 - 0.5) / 4, abs=1e-6)
    b.error = "EnvError: boom"  # a failed rollout: no advantage, not in the KL
    assert not opd_advantages(g, algo_config(loss="opd", max_tokens=8))[1].any()
    assert teacher_kl(g.rollouts) == pytest.approx((-0.3 + 2.0) / 2, abs=1e-6)


def test_opd_loss_of_a_constructed_batch_equals_the_hand_computation() -> None:
    """The trainer at the behaviour policy (ratio 1, inside the clip): the loss is -sum_t A_t / tokens, and
    its gradient on each token's logprob is -A_t / tokens: it raises the tokens the teacher likes more
    than the student did (A > 0) and lowers the others."""
    cfg = algo_config(loss="opd", max_tokens=8)
    a = rollout([-0.5, -2.0, -1.0], [-0.2, -0.1, -3.0], [1, 0, 1])
    b = rollout([-1.0, -1.0], [-1.5, -0.5], [1, 1])
    adv = opd_advantages(Group([a, b]), cfg)
    logp_infer = torch.tensor([[-0.5, -2.0, -1.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([list(adv[0]), [*adv[1], 0.0]])
    logp = logp_infer.clone().requires_grad_(True)
    loss_sum, stats = get_loss("opd")(logp, logp_infer, advantages, mask, cfg)
    from rlray.types import MicroBatch

    mb = MicroBatch(*(np.zeros((2, 3)),) * 5, num_loss_tokens_global=4.0, num_sequences_global=2.0)
    loss = loss_sum / loss_normalizer(cfg, mb)
    loss.backward()
    by_hand = -(0.3 - 2.0 - 0.5 + 0.5) / 4
    assert float(loss.detach()) == pytest.approx(by_hand, abs=1e-6)
    np.testing.assert_allclose(logp.grad.numpy(), [[-0.3 / 4, 0.0, 2.0 / 4], [0.5 / 4, -0.5 / 4, 0.0]], atol=1e-6)
    assert float(stats["ratio_outside"]) == 0


class Teacher:
    """A teacher that gives every token logprob `value` (or raises), counting its calls."""

    def __init__(self, value: float | None) -> None:
        self.value, self.calls = value, 0

    async def score(self, sequences):
        self.calls += 1
        await asyncio.sleep(0)
        if self.value is None:
            raise RuntimeError("ActorDiedError: the teacher's process died")
        return [np.full(len(ids) - start, self.value, np.float32) for ids, start in sequences]


def test_buffer_scores_arriving_groups_and_packs_per_token_advantages() -> None:
    """Groups go round robin to the teachers; a failing teacher's group is dropped and counted (its ticket
    granted again), the others reach the trainer with advantage teacher - behaviour on every model token."""
    async def go() -> None:
        buf = BufferActor(algo_config(loss="opd", max_tokens=8), 1, 1, 1, 64, 0)
        good, dead = Teacher(-0.25), Teacher(None)
        await buf.set_teachers([good, dead])
        tickets = await buf.reserve(0, 2)
        groups = [Group([rollout([-1.0, -1.0], None, [1, 0], 1.0), rollout([-0.5, -2.0], None, [1, 1])], ticket=t)
                  for t in tickets]
        await buf.put(groups)
        mb = (await asyncio.wait_for(buf.get_batch(0), 5))[0]
        assert (good.calls, dead.calls) == (1, 1)
        assert buf.counts["teacher_failed_groups"] == 1 and buf.released == 1
        adv = mb.advantages[mb.loss_mask > 0]
        np.testing.assert_allclose(sorted(adv), sorted([0.75, 0.25, 1.75]), atol=1e-6)
        stats = await buf.step_stats(0)
        assert stats["teacher_kl"] == pytest.approx((-0.75 - 0.25 - 1.75) / 3, abs=1e-6)
        assert stats["teacher_failed_groups"] == 1 and stats["teacher_tokens_per_s"] > 0
        assert "ActorDiedError" in (await buf.teacher_state())["last_error"]

    asyncio.run(go())


def test_opd_samples_at_temperature_one_and_refuses_another() -> None:
    from hydra import compose, initialize_config_dir

    from rlray.config import register, to_config
    from rlray.launch import CONF_DIR

    def config(*overrides: str):
        register()
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return to_config(compose("config", overrides=list(overrides)))

    assert config().rollout.temperature == 0.7
    assert config("algo.loss=opd", "teacher.name=t").rollout.temperature == 1.0
    assert config("algo.loss=grpo", "rollout.temperature=0.9").rollout.temperature == 0.9
    with pytest.raises(ConfigError, match=r"algo.loss=opd with rollout.temperature=0.7: .*temperature 1"):
        config("algo.loss=opd", "teacher.name=t", "rollout.temperature=0.7")
    with pytest.raises(ConfigError, match=r"algo.loss=opd distills from a teacher: set teacher.name"):
        config("algo.loss=opd")
    with pytest.raises(ConfigError, match=r"teacher.name='t' but algo.loss=grpo"):
        config("teacher.name=t")
    with pytest.raises(ConfigError, match=r"teacher.max_model_len=64 is shorter than rollout.max_model_len=128"):
        config("algo.loss=opd", "teacher.name=t", "teacher.max_model_len=64")
    with pytest.raises(ConfigError, match=r"teacher.gpus_per_actor=1 but teacher.tensor_parallel_size=2"):
        config("algo.loss=opd", "teacher.name=t", "teacher.gpus_per_actor=1", "teacher.tensor_parallel_size=2")
    with pytest.raises(ValueError, match="algo.opd_reward_coef"):
        composed("algo.loss=opd", "teacher.name=t", "algo.opd_reward_coef=-1")


def test_a_teacher_of_another_tokenizer_is_one_line(tmp_path) -> None:
    from transformers import AutoTokenizer

    from rlray.config import ModelConfig
    from rlray.models.tiny import model_path
    from rlray.orchestration.teachers import check_tokenizer

    student = model_path(ModelConfig())
    check_tokenizer(student, student)  # the same tokenizer passes
    tok = AutoTokenizer.from_pretrained(student)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"has another tokenizer than the student \(\d+ vs \d+ tokens"):
        check_tokenizer(student, str(tmp_path))
    with pytest.raises(ConfigError, match=r"teacher.name='/no/such/folder': no tokenizer loads from it"):
        check_tokenizer(student, "/no/such/folder")


def test_plan_holds_the_teacher_pool_and_its_memory() -> None:
    """The distill recipe's real pair: a Qwen3-30B-A3B teacher in bf16 on 1 GPU each (61 GB of weights at
    2 bytes per parameter, hand-computed from the catalog's count) beside the student's plan."""
    from hydra import compose, initialize_config_dir

    from rlray.config import register, to_config
    from rlray.launch import CONF_DIR
    from rlray.orchestration.plan import GB, make_plan

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        c = to_config(compose("config", overrides=["+recipe=distill"]))
    plan = make_plan(c)
    assert plan.teacher_shape is not None and plan.teacher is not None
    params = plan.teacher_shape.params
    assert 30.0e9 < params < 31.0e9
    assert plan.teacher["weights"] == pytest.approx(params * 2 / c.teacher.tensor_parallel_size)
    kv = c.teacher.kv_cache_fraction * c.cluster.gpu_memory_gb * GB - plan.teacher["weights"] - 2 * GB
    assert plan.teacher["KV cache"] == pytest.approx(kv)
    text = plan.render()
    assert f"rlray-teacher: {c.teacher.num_actors} bundles" in text and "memory per teacher engine GPU" in text
    assert plan.problems() == []
    assert math.isclose(plan.gpus, c.trainer.num_ranks + c.rollout.num_actors * c.rollout.gpus_per_actor
                        + c.teacher.num_actors * c.teacher.gpus_per_actor)
