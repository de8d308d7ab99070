"""The per-token policy-loss reference against OpenRLHF 0.11.2's own functions (the installed package).

With alpha = 0 our per-token loss, token-mean aggregated, must equal openrlhf's ``PolicyLoss`` (ppo type, no
IS correction), our KL must equal ``compute_approx_kl``, and our log-probs ``log_probs_from_logits``;
values and gradients, to fp32 precision.
"""

import pytest
import torch

from openrlhf_lopti.algo import (
    approx_kl,
    policy_loss_from_logits,
    policy_loss_from_logp,
    reweight_advantages,
    token_logprobs,
)
from openrlhf_lopti.algo.policy_loss import bad_logit_row_error, check_logit_rows, first_flagged_row

from .kernel_cases import Case, make_inputs, options, textbook_policy_loss
from .numerics import Float64Shadow, assert_near_float64, assert_same_computation, fp32_error_bound


@pytest.fixture(scope="module")
def upstream():
    # openrlhf.models imports flash-attn at module top; on CPU our stand-ins let it import (see cpu_stubs).
    from openrlhf_lopti.openrlhf.cpu.stubs import install_cpu_stubs

    install_cpu_stubs()
    from openrlhf.models.loss import PolicyLoss, aggregate_loss
    from openrlhf.models.utils import compute_approx_kl, log_probs_from_logits

    return {
        "PolicyLoss": PolicyLoss,
        "aggregate_loss": aggregate_loss,
        "compute_approx_kl": compute_approx_kl,
        "log_probs_from_logits": log_probs_from_logits,
    }


def _batch(seed=0, b=4, t=9, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float32) * 4
    old = logp + torch.randn(b, t, generator=g) * spread
    ref = logp + torch.randn(b, t, generator=g) * spread
    adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[:, 0] = True
    return logp, old, ref, adv, mask


def _both_ways(compare, *tensors):
    """``compare(*tensors)`` on the fp32 inputs and on float64 copies under Float64Shadow (the rule of
    tests/numerics.py): returns both results, for :func:`_assert_same`."""
    fp32 = compare(*tensors)
    with Float64Shadow():
        fp64 = compare(*(t.double() if t.is_floating_point() else t for t in tensors))
    return fp32, fp64


def _assert_same(fp32: dict, fp64: dict) -> None:
    """Each ``name: (ours, theirs)`` of the fp32 run computes what it computes in the float64 run."""
    for name, (ours, theirs) in fp32.items():
        assert_same_computation(name, ours, theirs, *fp64[name], "ours", "openrlhf")


def _token_mean(x, mask):
    return (x * mask).sum() / mask.sum()


@pytest.mark.parametrize("eps_low, eps_high, dual_clip", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_alpha_zero_equals_openrlhf_policy_loss(upstream, eps_low, eps_high, dual_clip, seed):
    logp, old, _, adv, mask = _batch(seed)

    def compare(logp, old, adv):
        ours_logp = logp.clone().requires_grad_(True)
        theirs_logp = logp.clone().requires_grad_(True)
        out = policy_loss_from_logp(ours_logp, old, adv, mask, alpha=0.0, eps_low=eps_low, eps_high=eps_high,
                                    dual_clip=dual_clip)  # fmt: skip
        ours = _token_mean(out.loss, mask)
        loss_fn = upstream["PolicyLoss"](clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip=dual_clip)
        theirs, clip_ratio, *_ = loss_fn(theirs_logp, old, adv, action_mask=mask)
        ours.backward()
        theirs.backward()
        clip = (_token_mean(out.clipped.double(), mask), torch.as_tensor(clip_ratio, dtype=torch.float64))
        return {"loss": (ours.detach(), theirs.detach()), "grad": (ours_logp.grad, theirs_logp.grad), "clip": clip}

    fp32, fp64 = _both_ways(compare, logp, old, adv)
    _assert_same(fp32, fp64)
    assert fp32["clip"][1] > 0, "the batch must exercise the clip"


@pytest.mark.parametrize("alpha", [0.1, 0.3, 1.0])
def test_ar_equals_openrlhf_loss_on_reweighted_advantages(upstream, alpha):
    logp, old, _, adv, mask = _batch(3)

    def compare(logp, old, adv):
        ours_logp = logp.clone().requires_grad_(True)
        theirs_logp = logp.clone().requires_grad_(True)
        ours = _token_mean(policy_loss_from_logp(ours_logp, old, adv, mask, alpha=alpha).loss, mask)
        theirs = upstream["PolicyLoss"]()(theirs_logp, old, reweight_advantages(adv, old, alpha), action_mask=mask)[0]
        ours.backward()
        theirs.backward()
        return {"loss": (ours.detach(), theirs.detach()), "grad": (ours_logp.grad, theirs_logp.grad)}

    _assert_same(*_both_ways(compare, logp, old, adv))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_equals_openrlhf_compute_approx_kl(upstream, estimator):
    logp, _, ref, _, _ = _batch(4, spread=3.0)
    # include the clamp regions of every estimator
    logp = torch.cat([logp.flatten(), torch.tensor([-30.0, 0.0, -1e4, -0.5])])
    ref = torch.cat([ref.flatten(), torch.tensor([0.0, -30.0, 0.0, -1e4])])
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    ours = approx_kl(a, ref, estimator)
    theirs = upstream["compute_approx_kl"](b, ref, kl_estimator=estimator)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    ours.sum().backward()
    theirs.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_kl_term_in_loss_matches_openrlhf_actor_sum(upstream):
    # OpenRLHF's actor: loss = PolicyLoss + kl_coef * aggregate_loss(kl, mask)
    logp, old, ref, adv, mask = _batch(5)
    kl_coef = 0.01

    def compare(logp, old, ref, adv):
        ours_logp = logp.clone().requires_grad_(True)
        theirs_logp = logp.clone().requires_grad_(True)
        out = policy_loss_from_logp(ours_logp, old, adv, mask, ref_log_probs=ref, kl_coef=kl_coef, kl_estimator="k3")
        ours = _token_mean(out.loss, mask)
        pg = upstream["PolicyLoss"]()(theirs_logp, old, adv, action_mask=mask)[0]
        kl = upstream["compute_approx_kl"](theirs_logp, ref, kl_estimator="k3")
        theirs = pg + kl_coef * upstream["aggregate_loss"](kl, mask)
        kl_mean = (_token_mean(out.kl, mask), upstream["aggregate_loss"](kl, mask).detach())
        ours.backward()
        theirs.backward()
        return {"loss": (ours.detach(), theirs.detach()), "kl": kl_mean, "grad": (ours_logp.grad, theirs_logp.grad)}

    _assert_same(*_both_ways(compare, logp, old, ref, adv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equals_openrlhf_log_probs_from_logits(upstream, dtype, temperature):
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(3, 5, 50, generator=g) * 2).to(dtype)
    labels = torch.randint(0, 50, (3, 5), generator=g)
    ours, _ = token_logprobs(logits.reshape(-1, 50), labels.reshape(-1), temperature)
    theirs = upstream["log_probs_from_logits"](logits.clone(), labels, temperature=temperature)
    with Float64Shadow():  # the truth: log-softmax of the same (bf16 or fp32) values in float64
        want = torch.log_softmax(logits.double() / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)
    # Both against it, bounds derived from the computation (tests/numerics.py): ours computes in fp32 from the
    # same values; openrlhf computes a bf16 log-softmax in bf16, so it is held to bf16's unit roundoff.
    magnitude = logits.double().abs().max().item() / temperature
    scale = max(1.0, want.abs().max().item())
    assert_near_float64("logp", ours.reshape(3, 5), want, fp32_error_bound(magnitude, 50, scale), "ours")
    unit = torch.finfo(dtype).eps / 2
    assert_near_float64("logp", theirs, want, fp32_error_bound(magnitude, 50, scale, unit=unit), "openrlhf")


def test_entropy_matches_definition():
    logits = torch.randn(4, 30)
    _, entropy = token_logprobs(logits, torch.zeros(4, dtype=torch.long), temperature=0.5)
    p = torch.softmax(logits / 0.5, -1)
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1))


def test_extreme_log_probs_stay_finite(upstream):
    logp = torch.tensor([-1e4, 0.0, -50.0, -1e-8]).requires_grad_(True)
    old = torch.tensor([0.0, -1e4, -1e-8, -50.0])
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0])
    out = policy_loss_from_logp(logp, old, adv, ref_log_probs=old, kl_coef=0.1, dual_clip=3.0)
    assert torch.isfinite(out.loss).all() and torch.isfinite(out.kl).all()
    out.loss.sum().backward()
    assert torch.isfinite(logp.grad).all()
    theirs = upstream["PolicyLoss"](dual_clip=3.0)(logp.detach(), old, adv, action_mask=torch.ones(4))[0]
    pg_only = policy_loss_from_logp(logp.detach(), old, adv, dual_clip=3.0).loss.mean()
    torch.testing.assert_close(pg_only, theirs)


def test_one_token():
    out = policy_loss_from_logp(torch.tensor([-0.5]), torch.tensor([-0.5]), torch.tensor([2.0]), torch.tensor([1]))
    torch.testing.assert_close(out.loss, torch.tensor([-2.0]))  # ratio 1: loss = -A
    assert out.clipped.tolist() == [False]


def test_masked_tokens_are_zero_with_zero_gradient():
    logits = torch.randn(5, 11, requires_grad=True)
    labels = torch.tensor([1, 2, -100, 4, 99])  # masked rows may hold padding ids
    mask = torch.tensor([True, True, False, True, False])
    out = policy_loss_from_logits(logits, labels.clamp(max=10) * mask + labels * ~mask, torch.full((5,), -2.0),
                                  torch.randn(5), mask, ref_log_probs=torch.zeros(5), kl_coef=0.1,
                                  return_entropy=True)  # fmt: skip
    for field in (out.loss, out.logp, out.kl, out.entropy):
        assert torch.all(field[~mask] == 0)
    assert not out.clipped[~mask].any()
    (out.loss.sum() + out.entropy.sum()).backward()
    assert torch.all(logits.grad[~mask] == 0) and torch.all(logits.grad[mask].abs().sum(-1) > 0)


def test_all_masked_gives_zero_loss_and_gradient():
    logits = torch.randn(3, 7, requires_grad=True)
    out = policy_loss_from_logits(logits, torch.zeros(3, dtype=torch.long), torch.zeros(3), torch.ones(3),
                                  torch.zeros(3, dtype=torch.bool), return_entropy=True)  # fmt: skip
    (out.loss.sum() + out.entropy.sum()).backward()
    assert out.loss.abs().sum() == 0 and logits.grad.abs().sum() == 0


def test_kl_coef_without_reference_is_an_error():
    with pytest.raises(ValueError, match="ref_log_probs"):
        policy_loss_from_logp(torch.zeros(2), torch.zeros(2), torch.ones(2), kl_coef=0.1)


def test_unknown_kl_estimator():
    with pytest.raises(ValueError, match="kl_estimator"):
        approx_kl(torch.zeros(2), torch.zeros(2), "k4")


def test_bad_alpha_in_loss():
    with pytest.raises(ValueError, match="alpha"):
        policy_loss_from_logp(torch.zeros(2), torch.zeros(2), torch.ones(2), alpha=2.0)


# Non-finite logits (issue 15): -inf is a legal logit with exact results; NaN / +inf is a ValueError.

INF = float("inf")


def _drop_columns_case(seed=7, n=6, v=12):
    """Logits where some columns are -inf (whole columns, scattered entries, all but one in a row)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    labels = torch.randint(0, v, (n,), generator=g)
    dead = torch.zeros(n, v, dtype=torch.bool)
    dead[:, [2, 7]] = True  # whole columns (e.g. padded vocab)
    dead[1, [0, 5, 9]] = True
    dead[4] = True  # all but one column: the label's
    labels[4] = 3
    dead[torch.arange(n), labels] = False
    return logits.masked_fill(dead, -INF), labels, dead


def _loss_inputs(n, seed=8):
    g = torch.Generator().manual_seed(seed)
    return dict(
        old_log_probs=-torch.rand(n, generator=g) * 3,
        advantages=torch.randn(n, generator=g),
        mask=torch.ones(n, dtype=torch.bool),
        ref_log_probs=-torch.rand(n, generator=g) * 3,
    )


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_minus_inf_columns_are_exactly_removed_columns(estimator, temperature):
    logits, labels, dead = _drop_columns_case()
    rest = _loss_inputs(len(labels))
    mask = rest.pop("mask")
    opts = dict(kl_coef=0.1, kl_estimator=estimator, alpha=0.3, temperature=temperature, return_entropy=True)
    up = torch.randn(3, len(labels), generator=torch.Generator().manual_seed(9))

    def both(logits, rest, up):
        """Each row's outputs and live-column gradient with the -inf columns in, and with them removed."""
        full = logits.clone().requires_grad_(True)
        out = policy_loss_from_logits(full, labels, mask=mask, **rest, **opts)
        (out.loss * up[0] + out.logp * up[1] + out.entropy * up[2]).sum().backward()
        assert torch.all(full.grad[dead] == 0), "a -inf column must get exactly zero gradient"
        pairs = {name: ([], []) for name in ("loss", "logp", "kl", "entropy", "grad", "entropy (textbook)")}

        def add(name, a, b):
            pairs[name][0].append(a.reshape(-1))
            pairs[name][1].append(b.reshape(-1))

        for i in range(len(labels)):  # row by row: each row has its own set of live columns
            live = ~dead[i]
            row = logits[i : i + 1, live].clone().requires_grad_(True)
            label = live[: labels[i]].sum().view(1)  # the label's index among the live columns
            one = {k: v[i : i + 1] for k, v in rest.items()}
            want = policy_loss_from_logits(row, label, mask=mask[i : i + 1], **one, **opts)
            (want.loss * up[0, i] + want.logp * up[1, i] + want.entropy * up[2, i]).sum().backward()
            for name in ("loss", "logp", "kl", "entropy"):
                add(name, getattr(out, name)[i : i + 1].detach(), getattr(want, name).detach())
            add("grad", full.grad[i, live], row.grad[0])
            # and the entropy is the textbook one over the live columns
            p = torch.softmax(logits[i, live] / temperature, -1)
            add("entropy (textbook)", out.entropy[i : i + 1].detach(), -(p * p.log()).sum())
        return {name: (torch.cat(a), torch.cat(b)) for name, (a, b) in pairs.items()}  # every row, live columns

    # the same values by the rule of tests/numerics.py: both again on float64 copies of the inputs
    fp32 = both(logits, rest, up)
    with Float64Shadow():
        fp64 = both(logits.double(), {k: v.double() for k, v in rest.items()}, up.double())
    for name, (a, b) in fp32.items():
        assert_same_computation(name, a, b, *fp64[name], "-inf columns", "columns removed")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_minus_inf_at_the_label_is_defined(estimator):
    """logp = -inf; the ratio is clamped at exp(-20) (finite loss, no loss gradient); KL at its clamp."""
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(4, 9, generator=g)
    labels = torch.tensor([1, 4, 0, 8])
    logits[0, 1] = logits[3, 8] = -INF
    logits[3, 2] = -INF
    rest = _loss_inputs(4)
    rest["advantages"] = torch.tensor([1.5, 0.7, -0.3, -2.0])
    leaf = logits.clone().requires_grad_(True)
    out = policy_loss_from_logits(leaf, labels, **rest, kl_coef=0.1, kl_estimator=estimator, return_entropy=True)
    assert out.logp[0] == -INF and out.logp[3] == -INF and torch.isfinite(out.logp[1:3]).all()
    ratio = torch.tensor(-20.0).exp()
    kl_at_clamp = {"k1": -10.0, "k2": 10.0, "k3": 10.0}[estimator]
    # A > 0: surr1 = e^-20 A < surr2 = 0.8 A; A < 0: the clipped 0.8 A is the min.
    want = torch.stack([-ratio * 1.5, torch.tensor(-0.8 * -2.0)]) + 0.1 * kl_at_clamp
    torch.testing.assert_close(out.loss[[0, 3]], want)
    assert out.kl[0] == kl_at_clamp and out.kl[3] == kl_at_clamp
    assert torch.isfinite(out.entropy).all() and torch.isfinite(out.loss).all()

    out.loss.sum().backward()
    assert torch.isfinite(leaf.grad).all()
    assert torch.all(leaf.grad[[0, 3]] == 0), "every clamp binds: the loss sends no gradient to those rows"
    leaf.grad = None
    out = policy_loss_from_logits(leaf, labels, **rest, return_entropy=True)
    (out.logp.sum() + out.entropy.sum()).backward()
    # d logp / dz = onehot - p (p_label = 0) and dH/dz = -p (log p + H): finite, 0 on the -inf columns
    p = torch.softmax(logits[3], -1)
    logp = torch.log_softmax(logits[3], -1)
    h = -(p[p > 0] * logp[p > 0]).sum()
    want_row = torch.nn.functional.one_hot(labels[3], 9).float() - p - torch.where(p > 0, p * (logp + h), 0.0)
    torch.testing.assert_close(leaf.grad[3], want_row)
    assert leaf.grad[3, 2] == 0


@pytest.mark.parametrize(
    "row, bad, what",
    [
        (2, dict(col=5, value=float("nan")), "NaN at column 5"),
        (1, dict(col=0, value=INF), r"\+inf at column 0"),
        (3, dict(col=None, value=-INF), "-inf in every column"),
    ],
)
def test_nan_or_plus_inf_logits_are_an_error_naming_the_row(row, bad, what):
    logits = torch.randn(5, 8)
    if bad["col"] is None:
        logits[row] = bad["value"]
    else:
        logits[row, bad["col"]] = bad["value"]
    logits[4, 1] = float("nan")  # a later bad row: the first one is named
    rest = _loss_inputs(5)
    with pytest.raises(ValueError, match=rf"logits row {row} .*{what}"):
        policy_loss_from_logits(logits, torch.zeros(5, dtype=torch.long), **rest)
    rest["mask"][[row, 4]] = False  # bad values on masked rows are padding: accepted
    out = policy_loss_from_logits(logits, torch.zeros(5, dtype=torch.long), **rest, return_entropy=True)
    assert torch.isfinite(out.loss).all() and torch.isfinite(out.entropy).all()


def test_logits_overflowing_at_the_temperature_are_an_error():
    logits = torch.randn(3, 6)
    logits[1, 2] = 3e38  # finite, but / 0.5 is +inf in fp32
    with pytest.raises(ValueError, match="logits row 1 .*overflow"):
        policy_loss_from_logits(logits, torch.zeros(3, dtype=torch.long), **_loss_inputs(3), temperature=0.5)


def test_bad_row_messages_in_full():
    """The first bad row is named even when it is row 0 or the only row; the message says what it holds."""
    tail = ("; logits must be finite or -inf, with a finite value in every unmasked row (NaN / +inf logits usually "
            "mean the model diverged)")  # fmt: skip
    one = torch.zeros(1, 4)
    one[0, 2] = float("nan")
    with pytest.raises(ValueError) as error:
        policy_loss_from_logits(one, torch.zeros(1, dtype=torch.long), **_loss_inputs(1))
    assert str(error.value) == "logits row 0 (unmasked) has NaN at column 2" + tail
    logits = torch.randn(3, 5)
    logits[0] = -INF
    logits[2, 1] = INF
    with pytest.raises(ValueError) as error:
        policy_loss_from_logits(logits, torch.zeros(3, dtype=torch.long), **_loss_inputs(3))
    assert str(error.value) == "logits row 0 (unmasked) has -inf in every column (no token has a nonzero probability)" + tail
    logits[0] = 0.0
    with pytest.raises(ValueError, match=r"^logits row 2 \(unmasked\) has \+inf at column 1;"):
        policy_loss_from_logits(logits, torch.zeros(3, dtype=torch.long), **_loss_inputs(3))
    logits[2, 1] = 3e38  # finite, but not once divided by 0.5
    with pytest.raises(ValueError, match=r"^logits row 2 .* overflow float32 when divided by temperature=0\.5;"):
        policy_loss_from_logits(logits, torch.zeros(3, dtype=torch.long), **_loss_inputs(3), temperature=0.5)
    assert "temperature=1.0;" in str(bad_logit_row_error(4, torch.tensor([3e38, 0.0])))  # the default


def test_first_flagged_row():
    assert first_flagged_row(torch.zeros(0, dtype=torch.bool)) is None
    assert first_flagged_row(torch.tensor([True])) == 0
    assert first_flagged_row(torch.tensor([False])) is None
    assert first_flagged_row(torch.tensor([False, False, True, True])) == 2


@pytest.mark.parametrize(
    "case, kl_coef",
    [
        (Case(alpha=0.3, kl="k3", entropy=True, dual_clip=3.0, temperature=0.7, old_spread=1.0, seed=31), 0.05),
        (Case(alpha=1.0, kl="k1", masked_fraction=0.0, seed=32), 1.0),  # kl_coef 1: the KL term counts once
        (Case(kl="k2", entropy=True, eps_high=0.5, ref_spread=8.0, seed=33), 0.3),
        (Case(alpha=0.5, old_spread=25.0, dual_clip=2.0, seed=34), 0.0),  # the +-20 log-ratio clamp binds
    ],
    ids=str,
)
def test_loss_from_logits_with_every_option_equals_the_textbook_loss(case, kl_coef):
    """policy_loss_from_logits against the loss written out in the test (float64, literal clamp bounds), values and
    gradients, with AR, clip range, dual clip, KL, temperature and entropy; row 0's label is token 0."""
    inputs, opts = make_inputs(case), options(case)
    opts.update(kl_coef=kl_coef, return_entropy=True)
    inputs["labels"][0], inputs["mask"][0] = 0, True
    leaf = inputs["logits"].clone().requires_grad_(True)
    args = [inputs[k] for k in ("labels", "old_log_probs", "advantages", "mask")]
    out = policy_loss_from_logits(leaf, *args, ref_log_probs=inputs["ref_log_probs"], **opts)
    (out.loss.sum() + 0.5 * out.entropy.sum() - out.logp.sum()).backward()
    ref_leaf = inputs["logits"].clone().requires_grad_(True)
    want = textbook_policy_loss(inputs, opts, ref_leaf)
    (want["loss"].sum() + 0.5 * want["entropy"].sum() - want["logp"].sum()).backward()
    for name in ("loss", "logp", "kl", "entropy"):
        # relative to each value: a clamp at exp(-20) instead of none is a 1e-9 change, visible only this way
        torch.testing.assert_close(getattr(out, name).double(), want[name].detach(), rtol=1e-5, atol=1e-12, msg=name)
    assert torch.equal(out.clipped, want["clipped"])
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad.double(), rtol=1e-4, atol=1e-6)


def test_defaults():
    """Defaults: no AR, clip range [0.8, 1.2], no dual clip, no KL, temperature 1, k3, no entropy."""
    case = Case(old_spread=1.0, seed=35)
    inputs = make_inputs(case)
    args = [inputs[k] for k in ("logits", "labels", "old_log_probs", "advantages", "mask")]
    out = policy_loss_from_logits(*args)
    assert out.entropy is None
    opts = dict(alpha=0.0, eps_low=0.2, eps_high=0.2, dual_clip=None, kl_coef=0.0, kl_estimator="k3", temperature=1.0)
    want = textbook_policy_loss(dict(inputs, ref_log_probs=None), opts, inputs["logits"])
    torch.testing.assert_close(out.loss.double(), want["loss"], rtol=1e-5, atol=1e-7)
    assert out.clipped.any()
    x = torch.tensor([-0.5, 0.3, 12.0])
    torch.testing.assert_close(approx_kl(x, torch.zeros(3)), ((-x).exp() - 1 + x).clamp(max=10.0))  # k3 by default
    with pytest.raises(ValueError, match=r"^ref_log_probs is required when kl_coef != 0$"):
        policy_loss_from_logp(torch.zeros(2), torch.zeros(2), torch.ones(2), kl_coef=0.1)


def test_eps_low_no_mask_and_the_defaults_of_the_helpers():
    """(From the mutation run's survivors.) A non-default eps_low reaches the loss; mask=None with entropy; the
    default temperature of token_logprobs and check_logit_rows is 1."""
    case = Case(n=40, v=30, old_spread=2.0, entropy=True, masked_fraction=0.0, seed=36)
    inputs, opts = make_inputs(case), options(case)
    opts.update(eps_low=0.05, return_entropy=True)
    args = [inputs[k] for k in ("logits", "labels", "old_log_probs", "advantages")]
    out = policy_loss_from_logits(*args, None, ref_log_probs=inputs["ref_log_probs"], **opts)
    want = textbook_policy_loss(inputs, opts, inputs["logits"])
    for name in ("loss", "entropy"):
        torch.testing.assert_close(getattr(out, name).double(), want[name], rtol=1e-5, atol=1e-6)
    logp, entropy = token_logprobs(inputs["logits"], inputs["labels"])
    torch.testing.assert_close(logp.double(), want["logp"], rtol=1e-5, atol=1e-6)  # the case has temperature 1
    logits = torch.zeros(2, 3)
    logits[1, 0] = 3e38
    with pytest.raises(ValueError, match="temperature=1.0;"):
        check_logit_rows(torch.tensor([False, True]), logits)


def test_the_reference_refuses_the_options_the_kernels_refuse():
    """The reference is public (``openrlhf_lopti.algo``): before, a NaN kl_coef or eps_high gave a NaN loss, a
    temperature of -1 the softmax of -logits, dual_clip 0.5 a wrong bound, and a string a bare TypeError."""
    logits, labels = torch.zeros(3, 5), torch.tensor([0, 1, 2])
    old, adv, mask = torch.full((3,), -1.6), torch.ones(3), torch.ones(3, dtype=torch.bool)
    ref = torch.full((3,), -1.5)
    for options, message in (
        (dict(kl_coef=float("nan"), ref_log_probs=ref), "kl_coef must be a finite number"),
        (dict(eps_high=float("nan")), "eps_high must be a finite number >= 0"),
        (dict(eps_low=-1.0), r"eps_low must be in \[0, 1\)"),
        (dict(dual_clip=0.5), r"dual_clip must be None, inf \(no dual clip\) or a finite number > 1"),
        (dict(alpha="0.3"), "alpha must be a number"),
        (dict(eps_low="0.2"), "eps_low must be a number"),
        (dict(kl_estimator="k4"), "kl_estimator must be one of"),
    ):
        with pytest.raises(ValueError, match=message):
            policy_loss_from_logp(old, old, adv, mask, **options)
        with pytest.raises(ValueError, match=message):
            policy_loss_from_logits(logits, labels, old, adv, mask, **options)
    for temperature in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            policy_loss_from_logits(logits, labels, old, adv, mask, temperature=temperature)
