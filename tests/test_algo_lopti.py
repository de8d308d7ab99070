"""Lopti's token partition: low = exp(old) < eta, high = the rest of the masked tokens, in update order."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_lopti.algo import LoptiSettings, lopti_phases, plan_round
from openrlhf_lopti.algo.lopti import quantile_threshold


def _probs_to_logp(p):
    return torch.tensor(p).log()


def test_low_first_by_hand():
    old = _probs_to_logp([[0.1, 0.5, 0.9, 0.49], [0.2, 0.7, 0.3, 0.3]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    low, high = lopti_phases(old, mask, eta=0.5)
    assert low.tolist() == [[True, False, False, True], [True, False, False, False]]
    assert high.tolist() == [[False, True, True, False], [False, True, False, False]]


def test_high_first_is_the_reverse_order():
    old = -torch.rand(4, 7) * 3
    mask = torch.rand(4, 7) > 0.3
    low, high = lopti_phases(old, mask, eta=0.4)
    first, second = lopti_phases(old, mask, eta=0.4, order="high_first")
    assert torch.equal(first, high) and torch.equal(second, low)


def test_masks_are_bool_disjoint_and_cover_the_action_mask():
    old = -torch.rand(5, 9) * 4
    mask = (torch.rand(5, 9) > 0.5).float()  # float masks are accepted
    low, high = lopti_phases(old, mask)
    assert low.dtype == torch.bool and high.dtype == torch.bool
    assert not torch.any(low & high)
    assert torch.equal(low | high, mask.bool())


def test_none_mask_means_all_tokens():
    old = _probs_to_logp([0.2, 0.8])
    low, high = lopti_phases(old, None)
    assert low.tolist() == [True, False] and high.tolist() == [False, True]


def test_empty_phase_is_returned():
    old = _probs_to_logp([0.9, 0.95, 0.99])
    low, high = lopti_phases(old, torch.ones(3, dtype=torch.bool), eta=0.5)
    assert low.sum() == 0 and high.sum() == 3


def test_all_masked_gives_two_empty_phases():
    old = -torch.rand(3, 4)
    low, high = lopti_phases(old, torch.zeros(3, 4, dtype=torch.bool), quantile=0.5)
    assert low.sum() == 0 and high.sum() == 0


def test_one_token():
    low, high = lopti_phases(torch.tensor([-0.1]), torch.tensor([True]), eta=0.5)
    assert high.tolist() == [True] and low.tolist() == [False]


def test_extreme_log_probs():
    old = torch.tensor([-1e4, 0.0, -float("inf"), 1e-7])
    low, high = lopti_phases(old, None, eta=1.0)
    # eta=1: every token with p < 1 is low; p = 1 (log 0) and p > 1 from rounding are high.
    assert low.tolist() == [True, False, True, False]


def test_eta_one_puts_nearly_everything_low_and_tiny_eta_everything_high():
    old = -torch.rand(50) * 3 - 1e-3
    low, high = lopti_phases(old, None, eta=1.0)
    assert low.all() and not high.any()
    low, high = lopti_phases(old, None, eta=1e-6)
    assert high.all() and not low.any()


def test_unmasked_nan_is_ignored_but_masked_nan_is_an_error():
    old = torch.tensor([-0.1, float("nan")])
    low, high = lopti_phases(old, torch.tensor([True, False]))
    assert low.tolist() == [False, False] and high.tolist() == [True, False]  # p = 0.905: high; NaN row: neither
    with pytest.raises(ValueError, match=r"^old_log_probs contains NaN on 1 response token\(s\)$"):
        lopti_phases(old, torch.tensor([True, True]))


@pytest.mark.parametrize("ar_alpha, lopti", [(0.3, None), (0.0, 0.5)])
def test_a_positive_old_log_prob_is_an_error_of_the_round_not_an_inf_metric(ar_alpha, lopti):
    """old = 89 logged ar/mean_weight = inf and 0.5 (a sign-flipped NLL) a weight of 1.2 > 1, silently; a log-prob up
    to 1e-3 above 0 is rounding and stays legal, and on padding anything is."""
    settings = None if lopti is None else LoptiSettings(eta=lopti)
    mask = torch.tensor([True, True, False])
    for bad in (89.0, 0.5, float("inf")):
        with pytest.raises(ValueError, match=r"^old_log_probs must be log-probabilities \(<= 0, up to 0.001 of "
                                             r"rounding\): 1 response token\(s\) hold more$"):  # fmt: skip
            plan_round(torch.tensor([-0.1, bad, -1.0]), mask, settings, ar_alpha=ar_alpha)
    fine = plan_round(torch.tensor([-0.1, 5e-4, 89.0]), mask, settings, ar_alpha=ar_alpha)
    assert sum(phase.tokens for phase in fine.phases) == 2


@pytest.mark.parametrize("seed", [0, 155])  # 155: q * (n - 1) is a whole number, the quantile is a token's p
def test_quantile_threshold_matches_torch_quantile(seed):
    """The threshold is torch.quantile's (linear interpolation) up to its rounding, and the low phase is the tokens
    strictly below it. (Unseeded, this test compared with torch's value itself and failed on 5% of draws: where the
    quantile lands on a token's p, torch's interpolation returns it 1 ulp high, and that token read as low.)"""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 40, generator=gen) * 5
    mask = torch.rand(6, 40, generator=gen) > 0.2
    q = 0.3
    probs = old.exp()[mask]
    eta = quantile_threshold(probs, q)
    assert eta == pytest.approx(torch.quantile(probs, q).item(), rel=1e-6)
    low, high = lopti_phases(old, mask, eta=0.5, quantile=q)
    assert torch.equal(low, mask & (old.exp() < eta))
    frac = low.sum().item() / mask.sum().item()
    assert abs(frac - q) < 0.02


def test_quantile_threshold_by_hand():
    # sorted p = 0.1 .. 0.5; q = 0.3: position 0.3 * 4 = 1.2, threshold 0.2 + 0.2 * (0.3 - 0.2) = 0.22
    probs = torch.tensor([0.5, 0.1, 0.4, 0.2, 0.3])
    assert quantile_threshold(probs, 0.3) == pytest.approx(0.22)
    assert quantile_threshold(probs, 0.5) == pytest.approx(0.3)  # an exact position: that value
    assert quantile_threshold(torch.tensor([0.7]), 0.3) == pytest.approx(0.7)
    mask = torch.tensor([True, True, True, True, True, False])
    old = torch.tensor([0.5, 0.1, 0.4, 0.2, 0.3, 0.15]).log()  # the masked 0.15 takes no part in the quantile
    low, high = lopti_phases(old, mask, eta=0.9, quantile=0.3)
    assert low.tolist() == [False, True, False, True, False, False]  # p < 0.22
    assert high.tolist() == [True, False, True, False, True, False]
    # one masked token: the quantile of one value is that value, and p < p is false
    low, high = lopti_phases(old[:1], mask[:1], eta=0.9, quantile=0.3)
    assert low.tolist() == [False] and high.tolist() == [True]


def test_probabilities_are_compared_in_fp32_for_bf16_log_probs():
    # bf16(log 0.5) = -0.69140625, p = 0.50088 in fp32; exp in bf16 would round p to 0.5, below eta = 0.5005
    old = torch.tensor([math.log(0.5)], dtype=torch.bfloat16)
    assert math.exp(float(old[0])) > 0.5005
    low, high = lopti_phases(old, None, eta=0.5005)
    assert low.tolist() == [False] and high.tolist() == [True]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"eta": 0.0}, "eta"),
        ({"eta": -0.5}, "eta"),
        ({"eta": 1.5}, "eta"),
        ({"eta": float("nan")}, "eta"),
        ({"eta": "0.5"}, "eta"),
        ({"eta": True}, "eta"),  # a config's `true` is not the threshold 1.0
        ({"order": "low-first"}, "order"),
        ({"quantile": 0.0}, "quantile"),
        ({"quantile": 1.0}, "quantile"),
        ({"quantile": float("nan")}, "quantile"),
        ({"quantile": True}, "quantile"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lopti_phases(torch.zeros(3), None, **kwargs)


def test_shape_mismatch():
    with pytest.raises(ValueError, match="response_mask"):
        lopti_phases(torch.zeros(3), torch.ones(4, dtype=torch.bool))


@settings(max_examples=60, deadline=None)
@given(
    p=st.lists(st.floats(0, 1), min_size=1, max_size=20),
    eta=st.floats(1e-6, 1.0),
    data=st.data(),
)
def test_partition_property(p, eta, data):
    old = torch.tensor(p, dtype=torch.float64).log()
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(p), max_size=len(p))))
    low, high = lopti_phases(old, mask, eta=eta)
    assert torch.equal(low | high, mask) and not torch.any(low & high)
    probs = old.exp()  # what the partition sees (exp(log p) may round away from p)
    assert torch.all(probs[low] < eta) and torch.all(probs[high] >= eta)


@pytest.mark.parametrize("padding", [float("nan"), float("inf"), -float("inf")])
def test_whatever_masked_positions_hold_the_rounds_metrics_are_those_of_its_response_tokens(padding):
    """``ar/mean_weight`` and the counts read only the response tokens: NaN or inf padding in a masked position
    (ar_weight(inf) = inf, and inf * 0 or NaN * 0 is NaN) changes nothing."""
    from openrlhf_lopti.algo import LoptiSettings, plan_round

    old = _probs_to_logp([[0.1, 0.6, 0.9, 0.3], [0.2, 0.7, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    padded = torch.where(mask, old, padding)
    for settings_ in (LoptiSettings(0.5), LoptiSettings(0.5, quantile=0.5)):
        clean, dirty = plan_round(old[mask], None, settings_, 0.3), plan_round(padded, mask, settings_, 0.3)
        assert dirty.metrics == clean.metrics and dirty.threshold == clean.threshold
        assert all(math.isfinite(value) for value in dirty.metrics.values())
        assert [(p.name, p.tokens) for p in dirty.phases] == [(p.name, p.tokens) for p in clean.phases]
        assert all(torch.equal(d.mask[mask], c.mask) and not d.mask[~mask].any() for d, c in zip(dirty.phases, clean.phases))
    assert dirty.metrics["ar/mean_weight"] == pytest.approx(0.3 * (0.1 + 0.6 + 0.9 + 0.2 + 0.7) / 5 + 0.7)
    assert plan_round(padded, mask, None, 0.3).metrics == plan_round(old[mask], None, None, 0.3).metrics


def test_the_token_at_a_quantile_ties_with_it_whatever_the_log_probs_dtype():
    """p = [0.1, 0.3, 0.7], the median: the threshold is the middle token's p and a tie is high (LOPTI_ROUND.md).
    Before, float64 log-probs compared their float64 p with the fp32 quantile (0.30000001 > 0.3): the tie went low."""
    from openrlhf_lopti.algo import LoptiSettings, plan_round

    p = torch.tensor([0.1, 0.3, 0.7], dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        low = plan_round(p.log().to(dtype), None, LoptiSettings(quantile=0.5)).low
        assert low.tolist() == [True, False, False], dtype


def test_plan_round_refuses_an_alpha_or_settings_it_cannot_use():
    """Before: ar_alpha -0.5 or NaN silently logged no ar/mean_weight, '0.3' and None raised a bare TypeError, a float
    for ``lopti`` an AttributeError."""
    from openrlhf_lopti.algo import plan_round

    old = torch.log(torch.tensor([0.2, 0.8]))
    for alpha, message in ((-0.5, "alpha must be in"), (float("nan"), "alpha must be in"),
                           ("0.3", "alpha must be a number"), (None, "alpha must be a number")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            plan_round(old, None, None, ar_alpha=alpha)
    with pytest.raises(ValueError, match=r"^lopti must be a LoptiSettings or None, got 0.5 \(float\)$"):
        plan_round(old, None, 0.5)


def test_lopti_settings_take_numpy_numbers_and_refuse_bools_and_strings():
    """numpy's float32 is a number as the loss options read it (before: "eta must be ... got np.float32(0.5)")."""
    import numpy as np

    from openrlhf_lopti.algo import LoptiSettings

    assert float(LoptiSettings(eta=np.float32(0.5)).eta) == 0.5
    assert float(LoptiSettings(quantile=np.float32(0.25)).quantile) == 0.25
    for bad in (np.True_, "0.5", True):
        with pytest.raises(ValueError, match="eta must be a probability threshold"):
            LoptiSettings(eta=bad)
