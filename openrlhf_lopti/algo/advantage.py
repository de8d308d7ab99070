"""Advantage Reweighting (AR, paper Eq. 4): scale each token's advantage by its sampling probability."""

import torch

from .option_checks import check_alpha

# The largest old log-prob the loss, the kernels and the round accept: a probability is at most 1, so a log-prob at
# most 0, and a computed one is above it by rounding only (~1e-7 in fp32). Above this, ``exp`` makes AR's weight
# (and Lopti's p) exceed 1, and 89 overflows it to inf (a NaN loss even at alpha = 0): a sign-flipped NLL, not a
# log-prob.
OLD_LOG_PROB_MAX = 1e-3


def ar_weight(old_log_probs: torch.Tensor, alpha: float) -> torch.Tensor:
    """The AR weight ``alpha * exp(old_log_probs) + 1 - alpha``, detached, in fp32.

    Args:
        old_log_probs: log-probabilities of the sampled tokens under the rollout policy, any shape, nats.
        alpha: AR strength in [0, 1]; 0 gives a weight of exactly 1 (plain GRPO / PPO).

    Returns:
        Tensor of ``old_log_probs``' shape with values in [1 - alpha, 1], fp32 (fp64 for fp64 input).
    """
    alpha = check_alpha(alpha)
    # The weight is a constant of the batch: the authors' code takes p from the sampling policy, no gradient.
    p = old_log_probs.detach().to(torch.promote_types(old_log_probs.dtype, torch.float32)).exp()
    return alpha * p + (1.0 - alpha)


def reweight_advantages(advantages: torch.Tensor, old_log_probs: torch.Tensor, alpha: float) -> torch.Tensor:
    """Advantage Reweighting: ``A' = A * (alpha * exp(old_log_probs) + 1 - alpha)``.

    Low-probability tokens have the largest logit gradients (paper Prop. 4.2); shrinking their advantage
    lets high-probability tokens steer the update. Positive and negative advantages are scaled alike.

    Args:
        advantages: ``[...]`` per-token advantages (any shape, any float dtype).
        old_log_probs: ``[...]`` same shape, log-probs of the sampled tokens under the rollout policy (nats).
        alpha: in [0, 1]; 0 returns the advantages unchanged (in value).

    Returns:
        Tensor of ``advantages``' shape and dtype. The weight carries no gradient; ``advantages`` may.

    Raises:
        ValueError: ``alpha`` outside [0, 1], or shapes that differ.
    """
    if advantages.shape != old_log_probs.shape:
        raise ValueError(
            f"advantages and old_log_probs must have the same shape, got {tuple(advantages.shape)} "
            f"and {tuple(old_log_probs.shape)}"
        )
    weight = ar_weight(old_log_probs, alpha)
    compute_dtype = torch.promote_types(advantages.dtype, weight.dtype)
    return (advantages.to(compute_dtype) * weight.to(compute_dtype)).to(advantages.dtype)
