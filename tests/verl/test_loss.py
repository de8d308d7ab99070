"""The registered ``ar`` policy loss, through verl's own registry and config: verl's ``vanilla`` at alpha 0 (bit for
bit: values, metrics, gradients), and otherwise the reference AR loss (``algo.policy_loss_from_logp``, token mean)
in values and gradients, by the rule of TESTING.md "Numerical comparisons" (both again on float64 copies)."""

from functools import partial

import pytest
import torch

from openrlhf_lopti.algo import policy_loss_from_logp

from ..numerics import Float64Shadow, assert_same_computation
from . import harness


def actor_config(alpha: float, clip_ratio_c: float = 3.0):
    """verl's actor config (``FSDPActorConfig``) as main_ppo builds it, with the ``ar`` loss and ``ar_alpha``."""
    from verl.utils.config import omega_conf_to_dataclass

    extra = (f"{harness.ACTOR}.clip_ratio_c={clip_ratio_c}",)
    cfg = harness.compose(harness.actor_overrides("unused", mini_batch=8, micro_batch=4, lr=0.1, alpha=alpha,
                                                  loss_mode="ar", extra=extra))  # fmt: skip
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def inputs(seed: int = 0, batch: int = 6, length: int = 9):
    """Padded ``[batch, length]`` policy-loss inputs whose ratios cover every branch: inside the clip range, clipped
    on both sides, and past the dual clip's 3 with negative advantages."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g) * 4  # p from 0.02 to 1
    log_prob = old + torch.randn(batch, length, generator=g) * 0.6
    log_prob[0, :3] = old[0, :3] + 1.5  # ratio 4.5
    advantages = torch.randn(batch, 1, generator=g).expand(batch, length).clone()
    advantages[0] = -1.0
    mask = torch.ones(batch, length, dtype=torch.bool)
    for row in range(batch):
        mask[row, length - row :] = False
    return old, log_prob, advantages, mask


def verl_loss(name: str, config, old, log_prob, advantages, mask):
    """verl's registered loss ``name`` on the inputs: (loss, metrics, d loss / d log_prob)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    log_prob = log_prob.detach().clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(name)(old_log_prob=old, log_prob=log_prob, advantages=advantages,
                                             response_mask=mask, loss_agg_mode="token-mean", config=config)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), metrics, grad


def reference_loss(alpha: float, old, log_prob, advantages, mask):
    """The reference: ``algo.policy_loss_from_logp`` per token (AR weight, clip 0.2 / 0.24, dual clip 3), token mean."""
    log_prob = log_prob.detach().clone().requires_grad_(True)
    out = policy_loss_from_logp(log_prob, old, advantages, mask, alpha=alpha, eps_low=0.2, eps_high=0.24,
                                dual_clip=3.0)  # fmt: skip
    loss = out.loss[mask].sum() / mask.sum()
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad


def test_ar_is_registered_with_verl():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from openrlhf_lopti.verl import compute_policy_loss_ar

    assert get_policy_loss_fn("ar") is compute_policy_loss_ar


def test_alpha_zero_is_vanilla_bit_for_bit():
    config = actor_config(0.0)
    assert config.policy_loss.loss_mode == "ar" and config.policy_loss.ar_alpha == 0.0
    args = inputs()
    ar_loss, ar_metrics, ar_grad = verl_loss("ar", config, *args)
    vanilla_loss, vanilla_metrics, vanilla_grad = verl_loss("vanilla", config, *args)
    assert torch.equal(ar_loss, vanilla_loss)
    assert ar_metrics == vanilla_metrics
    assert torch.equal(ar_grad, vanilla_grad)
    assert vanilla_metrics["actor/pg_clipfrac"] > 0 and vanilla_metrics["actor/pg_clipfrac_lower"] > 0  # branches


@pytest.mark.parametrize("alpha", [0.1, 0.3, 1.0])
def test_ar_matches_the_reference_ar_loss(alpha):
    config = actor_config(alpha)
    args = inputs(seed=1)
    loss32, _, grad32 = verl_loss("ar", config, *args)
    ref32, ref_grad32 = reference_loss(alpha, *args)
    with Float64Shadow():
        args64 = [a.double() if a.is_floating_point() else a for a in args]
        loss64, _, grad64 = verl_loss("ar", config, *args64)
        ref64, ref_grad64 = reference_loss(alpha, *args64)
    assert_same_computation(f"ar loss, alpha {alpha}", loss32.reshape(1), ref32.reshape(1), loss64.reshape(1),
                            ref64.reshape(1), a_name="verl ar", b_name="reference")  # fmt: skip
    assert_same_computation(f"ar gradient, alpha {alpha}", grad32, ref_grad32, grad64, ref_grad64,
                            a_name="verl ar", b_name="reference")  # fmt: skip
    # and it is not vanilla: AR changed the loss
    vanilla, _, _ = verl_loss("vanilla", config, *args)
    assert not torch.allclose(loss32, vanilla)


def test_ar_keeps_nan_outside_the_response_out_of_the_loss():
    """A NaN old log-prob on padding (where verl puts 0, but a NaN must not poison the masked sum as NaN * 0)."""
    config = actor_config(0.3)
    old, log_prob, advantages, mask = inputs(seed=2)
    old = torch.where(mask, old, torch.full_like(old, float("nan")))
    log_prob = torch.where(mask, log_prob, torch.zeros_like(log_prob))
    loss, _, grad = verl_loss("ar", config, old, log_prob, advantages, mask)
    assert torch.isfinite(loss) and torch.isfinite(grad[mask]).all()


def test_ar_through_verls_ppo_loss_config_path():
    """verl's ppo_loss finds the loss by ``policy_loss.loss_mode`` and the worker's loss function carries the config:
    the worker reads AR's alpha and Lopti's settings from it."""
    from verl.workers.utils.losses import ppo_loss

    from openrlhf_lopti.verl.config import round_settings
    from openrlhf_lopti.verl.worker import loss_config

    config = actor_config(0.3)
    loss_fn = partial(ppo_loss, config=config)
    assert loss_config(loss_fn) is config
    assert round_settings(config) == (None, 0.3)
