"""GRPO advantages and the clipped loss, on values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rltune.workload.grpo import ADV_EPS, clipped_policy_loss, group_advantages


def test_advantages_of_a_half_right_group_are_plus_and_minus_one():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    # mean 0.5, population std 0.5 -> (r - 0.5) / (0.5 + eps)
    expected = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64) * 0.5 / (0.5 + ADV_EPS)
    assert torch.allclose(adv, expected, rtol=0, atol=1e-12)


def test_advantages_with_partial_credit_values():
    adv = group_advantages(torch.tensor([0.1, 0.5, 0.0], dtype=torch.float64))
    mean = 0.2
    std = math.sqrt(((0.1 - mean) ** 2 + (0.5 - mean) ** 2 + (0.0 - mean) ** 2) / 3)
    assert adv.tolist() == pytest.approx([(0.1 - mean) / (std + ADV_EPS), (0.5 - mean) / (std + ADV_EPS),
                                          (0.0 - mean) / (std + ADV_EPS)], abs=1e-9)
    assert float(adv.sum()) == pytest.approx(0.0, abs=1e-9)


def test_a_group_with_equal_rewards_has_zero_advantages():
    assert group_advantages(torch.tensor([0.3, 0.3, 0.3])).abs().max() == 0
    assert group_advantages(torch.tensor([0.7])).tolist() == [0.0]


def test_unnormalised_advantages_are_only_centred():
    assert group_advantages(torch.tensor([2.0, 0.0]), normalize_std=False).tolist() == [1.0, -1.0]


def test_clipped_loss_takes_the_pessimistic_side_of_the_clip():
    # Four tokens of one row: ratios 1.5, 1.5, 0.5, 0.5 with advantages +1, -1, +1, -1, eps 0.2.
    # per-token -min(r*A, clip(r)*A): -1.2, +1.5, -0.5, +0.8 -> mean 0.15
    logp_new = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))
    logp_old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, stats = clipped_policy_loss(logp_new, logp_old, adv, mask, clip_eps=0.2)
    assert float(loss) == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4, abs=1e-6)
    # clipped value differs from unclipped for all four tokens
    assert stats["clip_frac"] == pytest.approx(1.0)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_masked_tokens_do_not_count_and_the_denominator_is_the_given_token_count():
    logp_new = torch.log(torch.tensor([[1.1, 3.0], [0.9, 1.0]]))
    logp_old = torch.zeros(2, 2)
    adv_rows = torch.tensor([2.0, -1.0])  # one advantage per row
    mask = torch.tensor([[True, False], [True, True]])
    # row 0 tok 0: r=1.1 inside the clip -> -2.2 ; row 1: r=0.9 -> +0.9, r=1.0 -> +1.0
    loss, _ = clipped_policy_loss(logp_new, logp_old, adv_rows, mask, clip_eps=0.2, token_count=6)
    assert float(loss) == pytest.approx((-2.2 + 0.9 + 1.0) / 6, abs=1e-6)


def test_loss_gradient_is_zero_where_the_clip_is_active():
    logp_new = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    loss, _ = clipped_policy_loss(logp_new, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), 0.2)
    loss.backward()
    # token 0 is clipped (ratio 1.5 > 1.2 with A > 0): no gradient; token 1: d(-r/2)/dlogp = -r/2
    assert logp_new.grad[0, 0] == 0
    assert float(logp_new.grad[0, 1]) == pytest.approx(-1.1 / 2, abs=1e-6)
