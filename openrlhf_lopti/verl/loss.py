"""AR as a verl policy loss: ``actor_rollout_ref.actor.policy_loss.loss_mode=ar``.

Registered in verl's ``POLICY_LOSS_REGISTRY`` (``core_algos.register_policy_loss``) when this package is imported.
It is verl's ``vanilla`` loss (clipped surrogate with dual clip, ``loss_agg_mode``, rollout-correction weights,
verl's metrics) on the advantages reweighted by ``openrlhf_lopti.algo.reweight_advantages``:

    A' = (alpha * exp(old_log_prob) + 1 - alpha) * A,   alpha = policy_loss.ar_alpha

with ``old_log_prob`` the log-probs verl anchors the PPO ratio at (the rollout policy's), detached. At alpha 0
it is ``vanilla`` exactly.
"""

from typing import Optional

import torch

from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, register_policy_loss

from openrlhf_lopti.algo import reweight_advantages

from .config import ar_alpha_of

LOSS_MODE = "ar"


@register_policy_loss(LOSS_MODE)
def compute_policy_loss_ar(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Optional[torch.Tensor] = None,
):
    """verl's policy-loss signature: ``[batch, response_len]`` tensors and the actor config; returns
    ``(loss, metrics)`` as verl's ``vanilla`` does, on AR-weighted advantages."""
    alpha = ar_alpha_of(config)
    # outside the response the advantages stay as they are (verl pads log-probs with 0, but a NaN there would
    # otherwise reach the masked sum as NaN * 0)
    weighted = torch.where(response_mask.bool(), reweight_advantages(advantages, old_log_prob, alpha), advantages)
    return compute_policy_loss_vanilla(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=weighted,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
