"""Every loss, aggregation and off-policy correction against values computed by hand.

Shared inputs: two sequences (rows), inference probability 0.5 for every token.
  row 0: ratios r = pi_train/mu = [1.5, 0.9, (pad)], advantage +1, two loss tokens
  row 1: ratios r = [1.0, 0.7, 1.1], advantage -2, three loss tokens
The gradient is taken with respect to the trainer's logprobs: a negative gradient
means gradient descent raises that token's probability.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlray.algo.correction import PRESETS as CORRECTIONS
from rlray.algo.loss import (
    LOSSES,
    PRESET_KEYS,
    algo_config,
    get_loss,
    k3_kl,
    loss_normalizer,
    preset_line,
    resolve,
)
from rlray.config import AlgoConfig
from rlray.types import MicroBatch

RATIOS = [[1.5, 0.9, 1.0], [1.0, 0.7, 1.1]]


def inputs(ratios=RATIOS) -> tuple[torch.Tensor, ...]:
    logp_infer = torch.log(torch.full((2, 3), 0.5))
    logp_train = (logp_infer + torch.log(torch.tensor(ratios))).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return logp_train, logp_infer, adv, mask


def run(name: str, **algo) -> tuple[float, dict[str, float], np.ndarray]:
    lt, li, adv, mask = inputs()
    loss, stats = get_loss(name)(lt, li, adv, mask, algo_config(loss=name, **algo))
    loss.backward()
    return float(loss.detach()), {k: float(v) for k, v in stats.items()}, lt.grad.numpy()


def test_grpo_token_and_sequence_aggregation() -> None:
    # l = -min(rA, clip(r, 0.8, 1.2)A): row 0 [-1.2 (clipped), -0.9]; row 1 [2, 1.6 (clipped), 2.2]
    loss, stats, grad = run("grpo", aggregation="token")
    assert loss == pytest.approx(-1.2 - 0.9 + 2 + 1.6 + 2.2, abs=1e-5)
    assert stats["ratio_outside"] == 2
    # clipped tokens get no gradient; the others -r*A
    np.testing.assert_allclose(grad, [[0, -0.9, 0], [2.0, 0, 2.2]], atol=1e-6)
    loss, _, grad = run("grpo")  # the preset: GRPO's paper averages token means per sequence
    assert loss == pytest.approx((-1.2 - 0.9) / 2 + (2 + 1.6 + 2.2) / 3, abs=1e-5)
    np.testing.assert_allclose(grad, [[0, -0.45, 0], [2 / 3, 0, 2.2 / 3]], atol=1e-6)


def test_dapo_clip_higher() -> None:
    # eps_high 0.6: the 1.5 ratio of a positive token is no longer clipped
    loss, stats, grad = run("dapo", eps_low=0.2, eps_high=0.6)
    assert loss == pytest.approx(-1.5 - 0.9 + 2 + 1.6 + 2.2, abs=1e-5)
    assert stats["ratio_outside"] == 1
    np.testing.assert_allclose(grad, [[-1.5, -0.9, 0], [2.0, 0, 2.2]], atol=1e-6)


def test_dr_grpo_sums_tokens_for_a_constant_normaliser() -> None:
    loss, _, grad = run("dr_grpo", max_tokens=4)  # L_max enters the normaliser, not the sum
    assert loss == pytest.approx(3.7, abs=1e-5)
    np.testing.assert_allclose(grad, [[0, -0.9, 0], [2.0, 0, 2.2]], atol=1e-6)


def test_loss_normalizer_per_aggregation() -> None:
    z = np.zeros((1, 1))
    mb = MicroBatch(z, z, z, z, z, num_loss_tokens_global=5.0, num_sequences_global=2.0)
    assert loss_normalizer(algo_config(loss="dapo"), mb) == 5.0
    assert loss_normalizer(algo_config(loss="grpo"), mb) == 2.0
    assert loss_normalizer(algo_config(loss="gspo"), mb) == 2.0
    assert loss_normalizer(algo_config(loss="dr_grpo", max_tokens=4), mb) == 8.0
    assert loss_normalizer(algo_config(loss="grpo", aggregation="token"), mb) == 5.0
    with pytest.raises(ValueError, match="algo.max_tokens"):
        loss_normalizer(algo_config(loss="dr_grpo"), mb)  # not composed by Hydra: no rollout.max_tokens to read


def test_gspo_sequence_ratio() -> None:
    s0, s1 = math.sqrt(1.5 * 0.9), (1.0 * 0.7 * 1.1) ** (1 / 3)  # geometric means of the ratios
    loss, stats, grad = run("gspo", eps_low=0.2, eps_high=0.2)  # both inside the band
    assert loss == pytest.approx(-s0 + 2 * s1, abs=1e-5)
    assert stats["ratio_outside"] == 0
    # d(-s A)/dlogp_t = -A s / |y|, the same for every token of a sequence
    np.testing.assert_allclose(grad, [[-s0 / 2, -s0 / 2, 0], [2 * s1 / 3] * 3], atol=1e-6)
    loss, stats, grad = run("gspo")  # the paper's band (3e-4, 4e-4), its preset: both clipped
    assert loss == pytest.approx(-1.0004 + 2 * 0.9997, abs=1e-5)
    assert stats["ratio_outside"] == 5
    np.testing.assert_allclose(grad, 0, atol=1e-7)


def test_cispo_clips_the_weight_but_keeps_every_gradient() -> None:
    # weight sg(clip(r, 0, 1.2)): row 0 [1.2, 0.9], row 1 [1.0, 0.7, 1.1]; l = -w A
    loss, stats, grad = run("cispo", eps_low=1.0, eps_high=0.2)
    assert loss == pytest.approx(-1.2 - 0.9 + 2 + 1.4 + 2.2, abs=1e-5)
    assert stats["ratio_outside"] == 1
    np.testing.assert_allclose(grad, [[-1.2, -0.9, 0], [2.0, 1.4, 2.2]], atol=1e-6)


def test_dppo_tv_masks_by_probability_difference_in_the_advantage_direction() -> None:
    # pi - mu: row 0 [0.25, -0.05] (A > 0), row 1 [0, -0.15, 0.05] (A < 0)
    # dropped: row 0 token 0 (0.25 > eps_high 0.2), row 1 token 1 (-0.15 < -eps_low -0.1)
    loss, stats, grad = run("dppo_tv", eps_low=0.1, eps_high=0.2, mismatch_kl_coef=0.0)
    assert loss == pytest.approx(-0.9 + 2 + 2.2, abs=1e-5)
    assert stats["ratio_outside"] == 2
    np.testing.assert_allclose(grad, [[0, -0.9, 0], [2.0, 0, 2.2]], atol=1e-6)


def test_dppo_tv_caps_the_ratio_of_a_rare_token() -> None:
    # pi 0.1, mu 0.001: pi - mu = 0.099 passes the probability test, but the ratio is 100
    lt = torch.log(torch.tensor([[0.1, 0.5]])).requires_grad_()
    li = torch.log(torch.tensor([[0.001, 0.5]]))
    for cap, kept in ((0.0, [100.0, 1.0]), (10.0, [0.0, 1.0])):  # the preset caps at 10
        cfg = algo_config(loss="dppo_tv", mismatch_kl_coef=0.0, ratio_cap=cap)
        lt.grad = None
        loss, stats = get_loss("dppo_tv")(lt, li, torch.ones(1, 2), torch.ones(1, 2), cfg)
        loss.backward()
        np.testing.assert_allclose(lt.grad.numpy(), [[-k for k in kept]], rtol=1e-4)  # a sum: -r A
        assert stats["ratio_outside"] == (cap > 0)
    assert algo_config(loss="dppo_tv").ratio_cap == 10.0


def test_mismatch_kl_penalty_by_hand() -> None:
    lt = torch.log(torch.tensor([[0.75]])).requires_grad_()
    li = torch.log(torch.tensor([[0.5]]))
    cfg = algo_config(loss="dppo_tv", mismatch_kl_coef=0.5)
    loss, _ = get_loss("dppo_tv")(lt, li, torch.zeros(1, 1), torch.ones(1, 1), cfg)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.5 * math.log(1.5) ** 2, rel=1e-5)
    assert lt.grad.item() == pytest.approx(math.log(1.5), rel=1e-5)  # 2 c log r: pulls pi_train back to mu


def test_reference_kl_k3_by_hand() -> None:
    lt = torch.log(torch.tensor([[0.5]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25]]))
    assert float(k3_kl(lt.detach(), ref)) == pytest.approx(0.5 + math.log(2) - 1, rel=1e-5)
    cfg = algo_config(kl_coef=0.1, aggregation="token")
    loss, stats = get_loss("grpo")(lt, lt.detach(), torch.zeros(1, 1), torch.ones(1, 1), cfg, logp_ref=ref)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.1 * (0.5 + math.log(2) - 1), rel=1e-5)
    assert float(stats["kl_ref"]) == pytest.approx(0.5 + math.log(2) - 1, rel=1e-5)
    assert lt.grad.item() == pytest.approx(0.1 * (1 - 0.5), rel=1e-5)  # 1 - pi_ref/pi > 0: back towards ref
    with pytest.raises(ValueError, match="logp_ref"):
        get_loss("grpo")(lt, lt.detach(), torch.zeros(1, 1), torch.ones(1, 1), cfg)


def test_tis_token_truncates_the_mismatch_weight() -> None:
    # the loss ratio is against sg(pi_train) (value 1, never clipped); weight min(r, 1.2)
    loss, stats, grad = run("grpo", aggregation="token", correction="tis", correction_high=1.2)
    assert loss == pytest.approx(-1.2 - 0.9 + 2 + 1.4 + 2.2, abs=1e-5)
    assert stats["correction_clipped"] == 1 and stats["ratio_outside"] == 0
    np.testing.assert_allclose(grad, [[-1.2, -0.9, 0], [2.0, 1.4, 2.2]], atol=1e-6)


def test_mis_token_masks_outside_the_band() -> None:
    loss, stats, grad = run("grpo", aggregation="token", correction="mis", correction_low=0.8,
                            correction_high=1.2)
    assert loss == pytest.approx(-0.9 + 2 + 2.2, abs=1e-5)
    assert stats["correction_masked"] == 2
    np.testing.assert_allclose(grad, [[0, -0.9, 0], [2.0, 0, 2.2]], atol=1e-6)


def test_sequence_and_geometric_correction_levels() -> None:
    # sequence weight: product of ratios, row 0 1.35 -> truncated to 1.2, row 1 0.77
    loss, stats, _ = run("grpo", aggregation="token", correction="tis", correction_level="sequence",
                         correction_high=1.2)
    assert loss == pytest.approx(-2 * 1.2 + 3 * 2 * 0.77, abs=1e-5)
    assert stats["correction_clipped"] == 2
    loss, stats, _ = run("grpo", aggregation="token", correction="tis", correction_level="geometric",
                         correction_high=1.2)
    assert loss == pytest.approx(-2 * math.sqrt(1.35) + 3 * 2 * 0.77 ** (1 / 3), abs=1e-5)
    assert stats["correction_clipped"] == 0
    loss, stats, grad = run("grpo", correction="mis", correction_level="sequence", correction_low=0.8,
                            correction_high=1.2)
    assert loss == 0 and stats["correction_masked"] == 5
    np.testing.assert_allclose(grad, 0)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
def test_every_preset_pushes_probability_with_the_advantage(name: str, correction: str) -> None:
    cfg = algo_config(loss=name, **CORRECTIONS[correction], max_tokens=8)
    for sign in (1.0, -1.0):
        lt = torch.full((1, 2), -1.0, requires_grad=True)
        loss, stats = get_loss(name)(lt, lt.detach() - 1e-5, torch.full((1, 2), sign), torch.ones(1, 2), cfg)
        loss.backward()
        assert torch.all(torch.sign(lt.grad) == -sign), (name, sign, lt.grad)
        assert "mismatch_kl" in stats and "ratio_outside" in stats


def test_every_registered_preset_is_valid_config() -> None:
    for name, entry in LOSSES.items():
        assert set(entry.preset) == set(PRESET_KEYS) and entry.paper
        cfg = algo_config(loss=name, max_tokens=64)
        assert cfg.from_preset == list(PRESET_KEYS)
        assert {k: getattr(cfg, k) for k in PRESET_KEYS} == entry.preset


@pytest.mark.parametrize("overrides, key", [
    ({"loss": "nope"}, "algo.loss"),
    ({"aggregation": "mean"}, "algo.aggregation"),
    ({"baseline": "median"}, "algo.baseline"),
    ({"correction": "is"}, "algo.correction"),
    ({"correction_level": "batch"}, "algo.correction_level"),
    ({"correction_high": 0.5}, "algo.correction_high"),
    ({"overlong_buffer": 16, "max_tokens": 16}, "algo.overlong_buffer"),
    ({"loss": "dr_grpo"}, "algo.max_tokens"),
])
def test_resolve_names_the_key(overrides: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        algo_config(**overrides)


def composed(*overrides: str) -> AlgoConfig:
    """`algo` as `python -m rlray.launch OVERRIDES` composes it from the shipped conf/config.yaml."""
    from hydra import compose, initialize_config_dir

    from rlray.config import register, to_config
    from rlray.launch import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return resolve(to_config(compose("config", overrides=list(overrides))).algo)  # as launch does


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_the_shipped_config_applies_each_papers_preset(name: str) -> None:
    algo = composed(f"algo.loss={name}", *(["teacher.name=some/teacher"] if name == "opd" else []))
    assert {k: getattr(algo, k) for k in PRESET_KEYS} == LOSSES[name].preset


def test_dr_grpo_under_the_shipped_config_is_sum_over_G_times_L_max() -> None:
    """The README's Dr.GRPO line: a hand-made batch's loss is sum / (G * L_max), advantages r - mean."""
    from rlray.algo.advantages import group_advantages

    algo = composed("algo.loss=dr_grpo", "rollout.max_tokens=4")
    assert (algo.aggregation, algo.std_normalize, algo.max_tokens) == ("constant", False, 4)
    adv = group_advantages(np.array([1.0, 0.0]), algo.std_normalize, algo.std_eps, algo.baseline)
    np.testing.assert_allclose(adv, [0.5, -0.5])  # no std division
    lt, li, _, mask = inputs()
    a = torch.tensor(adv)[:, None].expand(2, 3) * mask
    loss_sum, _ = get_loss("dr_grpo")(lt, li, a, mask, algo)
    mb = MicroBatch(*(np.zeros((2, 3)),) * 5, num_loss_tokens_global=5.0, num_sequences_global=2.0)
    # l = -min(rA, clip(r)A): row 0 A=.5 r [1.5->1.2, .9]; row 1 A=-.5 r [1.0, .7->.8, 1.1]
    by_hand = (-0.5 * 1.2 - 0.5 * 0.9 + 0.5 * 1.0 + 0.5 * 0.8 + 0.5 * 1.1) / (2 * 4)
    assert float(loss_sum.detach()) / loss_normalizer(algo, mb) == pytest.approx(by_hand, abs=1e-6)


def test_explicit_keys_win_over_the_preset() -> None:
    algo = composed("algo.loss=dr_grpo", "algo.aggregation=token", "rollout.max_tokens=4")
    assert (algo.aggregation, algo.std_normalize) == ("token", False)
    assert "aggregation" not in algo.from_preset and "std_normalize" in algo.from_preset
    assert "set explicitly: aggregation=token" in preset_line(algo)
    assert composed("+recipe=glm_moe").aggregation == "token"  # the recipe sets it
    assert composed("algo.loss=gspo", "+recipe=glm_moe").eps_high == 4e-4


def test_the_readme_table_is_the_registry() -> None:
    """The README's table of losses is generated from the registry: a new loss appears there, or this fails."""
    from pathlib import Path

    from rlray.algo.loss import preset_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- losses: generated from rlray.algo.loss.LOSSES -->\n", 1)[1]
    assert block.split("\n<!-- end of losses -->", 1)[0] == preset_table(), (
        "README.md's table of losses differs from the registry; paste rlray.algo.loss.preset_table() between "
        "its markers")
