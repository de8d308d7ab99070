"""Advantage estimators of the local trainer: GRPO (group-normalised) and REINFORCE++ (batch-whitened).

Both follow OpenRLHF 0.11.2 (``experience_maker.py``: ``group_norm`` and ``reinforce``) so that a local run
and a Ray run of the same method train on the same numbers.
"""

import torch

ESTIMATORS = ("grpo", "reinforce++")


def grpo_advantages(rewards: torch.Tensor, group_size: int, action_mask: torch.Tensor) -> torch.Tensor:
    """GRPO: ``A_i = (R_i - mean(group)) / (std(group) + 1e-9)`` broadcast to every response token.

    Args:
        rewards: ``[B]`` one scalar reward per response; rows ``g * group_size ..`` share a prompt.
        group_size: responses per prompt (>= 2; the std is the unbiased one, as in OpenRLHF).
        action_mask: ``[B, T]`` response tokens.

    Returns:
        ``[B, T]`` fp32 advantages, 0 outside ``action_mask``. A group whose rewards are all equal gets 0.
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"group_size must be >= 2 and divide the batch ({rewards.numel()}), got {group_size}")
    grouped = rewards.float().view(-1, group_size)
    adv = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-9)
    return adv.view(-1, 1) * action_mask.float()


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """REINFORCE++ (paper appendix D): per-token reward ``-kl_coef * (old - ref)`` (the k1 KL folded into
    the reward), the scalar reward added on the last response token, reward-to-go with gamma = 1, then
    whitened over all response tokens of the batch.

    Args:
        rewards: ``[B]`` scalar rewards.
        action_mask: ``[B, T]`` bool response tokens (each row's True entries are contiguous from 0).
        old_log_probs, ref_log_probs: ``[B, T]`` rollout / reference log-probs (nats).
        kl_coef: weight of the KL penalty in the reward (>= 0).

    Returns:
        ``[B, T]`` fp32 advantages, 0 outside ``action_mask``.
    """
    mask = action_mask.float()
    token_reward = -kl_coef * (old_log_probs.float() - ref_log_probs.float()) * mask
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    token_reward[torch.arange(len(rewards)), last] += rewards.float() * (mask.sum(-1) > 0)
    returns = token_reward.flip(-1).cumsum(-1).flip(-1) * mask
    count = mask.sum().clamp(min=1)
    mean = returns.sum() / count
    var = ((returns - mean) ** 2 * mask).sum() / count
    return (returns - mean) * var.clamp(min=1e-8).rsqrt() * mask
