"""Advantages and the GRPO loss against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlray.algo.advantages import group_advantages
from rlray.algo.loss import algo_config, get_loss, mismatch_kl


def test_group_advantages_by_hand() -> None:
    r = np.array([1.0, 0.0, 0.5, 0.5])
    np.testing.assert_allclose(group_advantages(r, std_normalize=False), [0.5, -0.5, 0.0, 0.0])
    std = math.sqrt((0.25 + 0.25) / 4)
    np.testing.assert_allclose(group_advantages(r, True, 1e-4), np.array([0.5, -0.5, 0, 0]) / (std + 1e-4),
                               rtol=1e-6)
    assert not np.any(group_advantages(np.array([0.3, 0.3, 0.3])))


def _inputs() -> tuple[torch.Tensor, ...]:
    logp_infer = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    # ratios 1.5, 1.0, 0.5 (the last token is masked out)
    logp_train = logp_infer + torch.log(torch.tensor([[1.5, 1.0, 0.5]]))
    adv = torch.tensor([[1.0, -2.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    return logp_train.requires_grad_(), logp_infer, adv, mask


def test_grpo_clip_by_hand() -> None:
    lt, li, adv, mask = _inputs()
    loss, stats = get_loss("grpo")(lt, li, adv, mask, algo_config(ratio_correction="clip", aggregation="token"))
    # token 0: -min(1.5*1, 1.2*1) = -1.2 ; token 1: -min(1*-2, 1*-2) = 2
    assert float(loss.detach()) == pytest.approx(-1.2 + 2.0, abs=1e-6)
    assert float(stats["ratio_outside"]) == 1.0
    loss.backward()
    # clipped token 0 has no gradient; token 1: d/dlogp (-r*A) = -r*A = 2 (gradient descent lowers its prob)
    np.testing.assert_allclose(lt.grad.numpy(), [[0.0, 2.0, 0.0]], atol=1e-6)


def test_grpo_mask_by_hand() -> None:
    lt, li, adv, mask = _inputs()
    loss, _ = get_loss("grpo")(lt, li, adv, mask, algo_config(ratio_correction="mask", aggregation="token"))
    assert float(loss.detach()) == pytest.approx(2.0, abs=1e-6)  # token 0 masked (ratio 1.5 > 1.2)
    loss.backward()
    assert lt.grad[0, 0] == 0 and lt.grad[0, 1] == pytest.approx(2.0)


def test_positive_advantage_gradient_raises_its_probability() -> None:
    lt = torch.zeros(1, 1, requires_grad=True)
    loss, _ = get_loss("grpo")(lt, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), algo_config())
    loss.backward()
    assert lt.grad.item() < 0  # descent increases logp


def test_mismatch_kl_by_hand() -> None:
    d = torch.tensor([[0.1, -0.2]])
    expected = (math.exp(0.1) - 0.1 - 1) + (math.exp(-0.2) + 0.2 - 1)
    assert float(mismatch_kl(d, torch.zeros_like(d), torch.ones_like(d))) == pytest.approx(expected, rel=1e-5)


def test_unknown_loss_names_the_key() -> None:
    with pytest.raises(ValueError, match="algo.loss"):
        get_loss("nope")
