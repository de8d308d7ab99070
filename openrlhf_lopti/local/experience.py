"""One batch of experience: sample, score, then the frozen log-probs and advantages the update trains on."""

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .advantages import grpo_advantages, reinforce_pp_advantages
from .config import TrainConfig
from .reward import RewardOutput
from .rollout import Rollout, generate_rollouts, response_logprobs
from .task import score


@dataclass
class Experience:
    """Everything the update needs, fixed at sampling time (tensors on the model's device).

    Fields:
        rollout: the sampled sequences (``action_mask [B, T]``).
        old_log_probs: ``[B, T]`` log-probs under the sampling policy (the PPO anchor, AR's and Lopti's p).
        ref_log_probs: ``[B, T]`` under the frozen reference, or None when there is no reference.
        advantages: ``[B, T]`` per-token advantages (0 outside the action mask), before AR.
        rewards: ``[B]`` the paper's K&K reward in [-3, 3], or a reward file's ``rewards``.
        correct: ``[B]`` bool, answer score +2 (every role right); with a reward file its float ``scores``
            (1 right, 0 wrong), or None when it gives none. Accuracy is its mean.
        format_ok: ``[B]`` bool, well-formed K&K tags; None with a reward file.
        extra: a reward file's ``extra_logs`` (name -> ``[B]`` values), else empty.
    """

    rollout: Rollout
    old_log_probs: torch.Tensor
    ref_log_probs: Optional[torch.Tensor]
    advantages: torch.Tensor
    rewards: torch.Tensor
    correct: Optional[torch.Tensor]
    format_ok: Optional[torch.Tensor]
    extra: dict = field(default_factory=dict)


def make_experience(
    policy,
    ref,
    tokenizer,
    records: list,
    prompts: list,
    cfg: TrainConfig,
    reward: Optional[Callable[[Rollout], RewardOutput]] = None,
) -> Experience:
    """Sample ``cfg.n_samples`` responses for each prompt and score them.

    Args:
        policy: the model being trained (sampling policy = current weights).
        ref: frozen reference model or None (then no KL term is possible).
        tokenizer: left-padding tokenizer of both models.
        records: K&K records (one per prompt) holding the labels.
        prompts: the prompt strings of ``records``.
        cfg: sizes, temperature, estimator and KL settings.
        reward: scores a rollout (e.g. through a reward file); None scores K&K ``records`` with the paper's rule.
    """
    rollout = generate_rollouts(policy, tokenizer, prompts, cfg.n_samples, cfg.max_new_tokens, cfg.temperature)
    micro = cfg.micro_batch_size or cfg.mini_batch_size
    passes = dict(fused_lm_head=cfg.fused_lm_head, backend=cfg.loss_backend)
    old = response_logprobs(policy, rollout, cfg.temperature, micro, **passes)
    ref_lp = response_logprobs(ref, rollout, cfg.temperature, micro, **passes) if ref is not None else None

    device = old.device
    extra = {}
    if reward is not None:
        out = reward(rollout)
        rewards, extra = out.rewards.to(device), out.extra
        correct, format_ok = (None if out.scores is None else out.scores.to(device)), None
    else:
        scored = [score(text, records[i // cfg.n_samples]) for i, text in enumerate(rollout.responses)]
        rewards = torch.tensor([s[0] for s in scored], dtype=torch.float32, device=device)
        correct = torch.tensor([s[1] for s in scored], dtype=torch.bool, device=device)
        format_ok = torch.tensor([s[2] for s in scored], dtype=torch.bool, device=device)

    if cfg.estimator == "grpo":
        advantages = grpo_advantages(rewards, cfg.n_samples, rollout.action_mask)
    else:
        if ref_lp is None and cfg.kl_coef != 0:
            raise ValueError("reinforce++ with kl_coef != 0 needs a reference model")
        advantages = reinforce_pp_advantages(
            rewards, rollout.action_mask, old, old if ref_lp is None else ref_lp, cfg.kl_coef
        )
    return Experience(rollout, old, ref_lp, advantages, rewards, correct, format_ok, extra)
