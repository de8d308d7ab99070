"""Advantage Reweighting: A' = A * (alpha * exp(old) + 1 - alpha), weight detached."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_lopti.algo import ar_weight, reweight_advantages


def test_formula_by_hand():
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0])
    old = torch.log(torch.tensor([0.9, 0.1, 0.5, 0.3]))
    got = reweight_advantages(adv, old, alpha=0.3)
    want = torch.tensor([1.0 * (0.3 * 0.9 + 0.7), -2.0 * (0.3 * 0.1 + 0.7), 0.5 * (0.3 * 0.5 + 0.7), 0.0])
    torch.testing.assert_close(got, want)


def test_alpha_zero_is_identity_and_alpha_one_is_probability():
    adv = torch.randn(3, 5)
    old = -torch.rand(3, 5) * 5
    torch.testing.assert_close(reweight_advantages(adv, old, 0.0), adv, rtol=0, atol=0)
    torch.testing.assert_close(reweight_advantages(adv, old, 1.0), adv * old.exp())


def test_weight_is_detached_and_advantage_gradient_flows():
    adv = torch.randn(6, requires_grad=True)
    old = (-torch.rand(6)).requires_grad_(True)
    out = reweight_advantages(adv, old, 0.5)
    out.sum().backward()
    assert old.grad is None
    torch.testing.assert_close(adv.grad, ar_weight(old, 0.5))


def test_keeps_dtype_and_shape():
    adv = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    old = -torch.rand(2, 3, 4, dtype=torch.bfloat16)
    out = reweight_advantages(adv, old, 0.1)
    assert out.dtype == torch.bfloat16 and out.shape == adv.shape
    torch.testing.assert_close(out, (adv.double() * (0.1 * old.double().exp() + 0.9)).to(torch.bfloat16))


def test_weight_is_fp32_for_low_precision_log_probs():
    """p is computed in fp32 (fp64 stays fp64): bf16 log-probs do not give an 8-bit weight."""
    old = torch.tensor([-0.7, -0.05, -3.0], dtype=torch.bfloat16)
    w = ar_weight(old, 0.3)
    assert w.dtype == torch.float32
    want = torch.tensor([0.3 * math.exp(float(x)) + 0.7 for x in old])
    torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-7)
    assert ar_weight(old.double(), 0.3).dtype == torch.float64


def test_extreme_log_probs():
    adv = torch.tensor([1.0, 1.0, -1.0])
    old = torch.tensor([-1e4, 0.0, -float("inf")])
    out = reweight_advantages(adv, old, 0.3)
    torch.testing.assert_close(out, torch.tensor([0.7, 1.0, -0.7]))


@pytest.mark.parametrize("alpha", [-0.01, 1.01, float("nan"), float("inf"), "0.3x", None, True, False])
def test_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        reweight_advantages(torch.ones(2), torch.zeros(2), alpha)


def test_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        reweight_advantages(torch.ones(2), torch.zeros(3), 0.3)


@settings(max_examples=50, deadline=None)
@given(
    alpha=st.floats(0, 1),
    p=st.lists(st.floats(0, 1), min_size=1, max_size=8),
    a=st.floats(-10, 10),
)
def test_weight_bounds_and_sign(alpha, p, a):
    old = torch.tensor(p, dtype=torch.float64).log()
    adv = torch.full_like(old, a)
    out = reweight_advantages(adv, old, alpha)
    w = ar_weight(old, alpha)
    # The weight is the formula, token by token (so a weight of 1, i.e. AR off, fails for alpha > 0 and p < 1).
    want = torch.tensor([alpha * math.exp(lp) + 1 - alpha for lp in old.tolist()], dtype=torch.float64)
    torch.testing.assert_close(w, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, adv * want, rtol=1e-12, atol=1e-12)
    assert torch.all(w >= 1 - alpha - 1e-6) and torch.all(w <= 1 + 1e-6)
    # Reweighting never flips a sign and never grows an advantage.
    assert torch.all(out * adv >= 0)
    assert torch.all(out.abs() <= adv.abs() + 1e-9)
    assert not math.isnan(float(out.sum()))


def test_alpha_is_a_number_not_a_string_as_every_other_option():
    """A YAML ``alpha: '0.3'`` is a string. Before, ``float()`` parsed it (and bytes) where eps_low's check refused
    the same string: AR ran as if the config had a number."""
    import numpy as np

    from openrlhf_lopti.algo import check_alpha
    from openrlhf_lopti.ops import fused_policy_loss

    old, adv = torch.log(torch.tensor([0.2, 0.8])), torch.ones(2)
    for bad in ("0.3", b"0.3", True, np.True_):
        with pytest.raises(ValueError, match=r"^alpha must be a number in \[0, 1\], got "):
            check_alpha(bad)
        with pytest.raises(ValueError, match=r"^alpha must be a number"):
            reweight_advantages(adv, old, bad)
    with pytest.raises(ValueError, match=r"^alpha must be a number"):
        fused_policy_loss(torch.zeros(2, 3), torch.tensor([0, 1]), old, adv, torch.ones(2, dtype=torch.bool), alpha="0.3")
    assert check_alpha(np.float32(0.25)) == 0.25 and check_alpha(torch.tensor(0.5)) == 0.5
