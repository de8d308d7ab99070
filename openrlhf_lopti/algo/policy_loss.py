"""The per-token policy loss, in plain torch: the single source of truth every kernel is tested against.

Per response token (all fp32, nats):

    A'      = A * (alpha * exp(old) + 1 - alpha)                  # AR weight, detached
    ratio   = exp(clamp(logp - old, -20, 20))
    surr1   = ratio * A'
    surr2   = clamp(ratio, 1 - eps_low, 1 + eps_high) * A'
    pg      = -min(surr1, surr2)                                  # PPO clip, DAPO clip-higher
    pg      = -max(min(surr1, surr2), dual_clip * A')  if dual_clip and A' < 0
    kl      = clamp(estimator(logp - ref), -10, 10)               # OpenRLHF's k1 / k2 / k3
    loss    = mask * (pg + kl_coef * kl)
    clipped = mask & (surr2 < surr1)

With alpha = 0 this is, token for token, OpenRLHF 0.11.2's ``PolicyLoss`` (``policy_loss_type="ppo"``,
no IS correction) plus ``kl_coef * compute_approx_kl`` before aggregation; ``tests/test_algo_policy_loss.py``
checks that against the installed openrlhf.

Non-finite logits (what every backend of ``ops.fused_policy_loss`` must reproduce):

- ``-inf`` is a legal logit (padded vocab rows, logit processors). Its column has probability exactly 0,
  adds exactly 0 to the entropy (``0 * log 0 = 0``, the limit) and gets gradient exactly 0: every output
  and gradient equals the one computed with that column removed.
- ``-inf`` at the label: ``logp = -inf`` (the token had probability 0). The log ratio clamps at -20, so
  ``ratio = exp(-20)`` and the loss is finite; each KL estimate sits at its clamp (k1 -10, k2 and k3 +10).
  Every clamp binds there, so ``loss`` sends no gradient to the row; ``logp`` sends its exact derivative
  ``onehot - p`` (finite) and the entropy is that of the other columns.
- NaN or +inf in an unmasked row, a row whose logits are all -inf, or finite logits that overflow fp32
  when divided by the temperature: the row has no finite log-sum-exp, and :func:`check_logit_rows` raises
  a ``ValueError`` naming the first such row. Masked rows are never looked at.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .advantage import ar_weight
from .option_checks import KL_ESTIMATORS, check_options, check_temperature, dual_clip_bound

LOG_RATIO_CLAMP = 20.0  # OpenRLHF clamps log(pi/pi_old) before exp
KL_CLAMP = 10.0  # OpenRLHF clamps the KL estimate to [-10, 10]


@dataclass
class PolicyLossOutput:
    """Per-token results of the policy loss; the caller aggregates (token mean, sequence mean, ...).

    Fields are ``[N]`` (or the input's leading shape). ``loss`` is 0 where the mask is 0 and includes
    ``kl_coef * kl``; ``logp``, ``kl`` and ``entropy`` are 0 where the mask is 0 too (those rows are
    skipped). ``kl`` and ``clipped`` are for logging and carry no gradient; gradients reach the logits
    through ``loss``, ``logp`` and ``entropy``.
    """

    loss: torch.Tensor
    logp: torch.Tensor
    kl: torch.Tensor
    clipped: torch.Tensor
    entropy: Optional[torch.Tensor] = None


def approx_kl(logp: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """OpenRLHF's KL estimate between the current and the reference policy, per token, clamped to [-10, 10].

    Args:
        logp: ``[...]`` log-probs of the sampled tokens under the current policy (nats).
        ref_log_probs: same shape, under the reference policy.
        estimator: ``"k1"`` (log ratio), ``"k2"`` (half squared log ratio) or ``"k3"``
            (``exp(-x) - 1 + x`` with ``x = logp - ref``, the paper's low-variance KL).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio = logp.float() - ref_log_probs.float()
    if estimator == "k1":
        value = log_ratio
    elif estimator == "k2":
        # Clamped first at a bound past sqrt(2 * KL_CLAMP), where the value clamp binds anyway: same values,
        # and a gradient of 0 rather than 0 * inf = NaN when logp = -inf (a -inf logit at the label).
        log_ratio = log_ratio.clamp(min=-2 * KL_CLAMP, max=2 * KL_CLAMP)
        value = log_ratio**2 / 2.0
    else:
        log_ratio = log_ratio.clamp(min=-KL_CLAMP)  # beyond -10 k3 exceeds the cap anyway; keeps exp finite
        value = (-log_ratio).exp() - 1 + log_ratio
    return value.clamp(min=-KL_CLAMP, max=KL_CLAMP)


def policy_loss_from_logp(
    logp: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    ref_log_probs: Optional[torch.Tensor] = None,
    alpha: float = 0.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> PolicyLossOutput:
    """Per-token clipped surrogate with AR weight and KL, from the sampled tokens' log-probs.

    Args:
        logp: ``[...]`` current-policy log-probs of the sampled tokens (nats); gradients flow through it.
        old_log_probs: same shape, rollout-policy log-probs (the PPO anchor and the AR probability).
        advantages: same shape, per-token advantages.
        mask: same shape, bool or 0/1; None means all ones.
        ref_log_probs: same shape, reference-policy log-probs; required when ``kl_coef != 0``.
        alpha: AR strength in [0, 1] (0 = plain PPO/GRPO).
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` of the ratio.
        dual_clip: lower bound ``dual_clip * A'`` on the surrogate of negative advantages (> 1), or None.
        kl_coef: weight of the KL term folded into ``loss``.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        :class:`PolicyLossOutput` with fp32 ``loss``, ``logp`` (masked copy of the input), ``kl``,
        bool ``clipped``; ``entropy`` is None.

    Raises:
        ValueError: an option that is not a number in its range (:func:`.option_checks.check_options`). The
            values are the formula's (no host sync): a NaN input gives a NaN loss; ``ops.fused_policy_loss``
            flags such rows (``LossOptions.check``).
    """
    check_options(alpha, eps_low, eps_high, dual_clip, kl_coef, kl_estimator, 1.0)
    dual_clip = dual_clip_bound(dual_clip)
    keep = torch.ones_like(logp, dtype=torch.bool) if mask is None else mask.bool()
    zero = logp.new_zeros((), dtype=torch.float32)
    # Masked rows are inert: padding may hold inf/NaN, and 0 * inf in a backward would be NaN.
    logp = torch.where(keep, logp.float(), zero)
    old_log_probs = torch.where(keep, old_log_probs.float(), zero)
    advantages = torch.where(keep, advantages.float(), zero)
    if ref_log_probs is not None:
        ref_log_probs = torch.where(keep, ref_log_probs.float(), zero)
    weighted_adv = advantages * ar_weight(old_log_probs, alpha)

    log_ratio = (logp - old_log_probs).clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    surr1 = ratio * weighted_adv
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * weighted_adv
    surrogate = torch.min(surr1, surr2)
    if dual_clip is not None:
        surrogate = torch.where(weighted_adv < 0, torch.max(surrogate, dual_clip * weighted_adv), surrogate)
    loss = -surrogate

    if ref_log_probs is not None:
        kl = approx_kl(logp, ref_log_probs, kl_estimator)
    else:
        if kl_coef != 0:
            raise ValueError("ref_log_probs is required when kl_coef != 0")
        kl = torch.zeros_like(logp)
    if kl_coef != 0:
        loss = loss + kl_coef * kl

    return PolicyLossOutput(
        loss=torch.where(keep, loss, zero),
        logp=torch.where(keep, logp, zero),
        kl=torch.where(keep, kl, zero).detach(),
        clipped=(surr2 < surr1) & keep,
    )


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> tuple:
    """Log-prob of each label and the entropy of each row of ``softmax(logits / temperature)``, in fp32.

    Args:
        logits: ``[N, V]`` in any float dtype.
        labels: ``[N]`` integer token ids; ids outside ``[0, V)`` are clamped (only masked-out rows may
            carry them, e.g. -100 padding; ``ops.fused_policy_loss`` validates the others).
        temperature: > 0; the sampling temperature the rollout used.

    Returns:
        ``(logp [N], entropy [N])`` fp32 tensors, differentiable w.r.t. ``logits``. -inf logits are exact
        (probability 0, no entropy term, zero gradient; see the module docstring). ``entropy`` is NaN
        exactly on the rows with no finite log-sum-exp (a NaN or +inf logit, or all -inf), which is how
        :func:`policy_loss_from_logits` finds them without another pass over ``[N, V]``.
    """
    log_softmax = torch.log_softmax(logits.float() / temperature, dim=-1)
    index = labels.long().clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
    logp = log_softmax.gather(-1, index).squeeze(-1)
    probs = log_softmax.exp()
    # p log p -> 0 as p -> 0; log p is replaced (not multiplied by 0) so neither the value nor the gradient
    # evaluates 0 * -inf. A NaN p (bad row) fails `probs > 0` but still makes the product NaN.
    entropy = -(probs * torch.where(probs > 0, log_softmax, 0.0)).sum(-1)
    return logp, entropy


def first_flagged_row(flags: torch.Tensor) -> Optional[int]:
    """Index of the first True of ``[N]`` bool ``flags``, or None if there is none: one device-to-host sync."""
    if flags.numel() == 0:
        return None
    first = int(torch.where(flags.any(), flags.to(torch.int32).argmax(), -1))
    return None if first < 0 else first


def bad_logit_row_error(row: int, row_logits: torch.Tensor, temperature: float = 1.0) -> ValueError:
    """The ``ValueError`` for a logits row without a finite log-sum-exp, saying what it holds.

    Args:
        row: the row's index, as the caller's user knows it (a chunked caller passes the global index).
        row_logits: ``[V]`` that row's logits, any float dtype and device.
        temperature: > 0, what the logits are divided by.
    """
    values = row_logits.detach().float().cpu()
    nan, pos_inf = torch.isnan(values).nonzero(), (values == float("inf")).nonzero()
    if nan.numel():
        holds = f"NaN at column {nan[0].item()}"
    elif pos_inf.numel():
        holds = f"+inf at column {pos_inf[0].item()}"
    elif bool((values == float("-inf")).all()):
        holds = "-inf in every column (no token has a nonzero probability)"
    else:
        holds = f"finite values that overflow float32 when divided by temperature={temperature}"
    return ValueError(
        f"logits row {row} (unmasked) has {holds}; logits must be finite or -inf, with a finite value in "
        "every unmasked row (NaN / +inf logits usually mean the model diverged)"
    )


def check_logit_rows(bad_rows: torch.Tensor, logits: torch.Tensor, temperature: float = 1.0) -> None:
    """Raise the ``ValueError`` for the first unmasked logits row without a finite log-sum-exp, if any.

    Every backend flags such rows inside the pass it already makes over each row, then calls this: one
    device-to-host sync, and nothing else is read unless a row is bad.

    Args:
        bad_rows: ``[N]`` bool, True on unmasked rows where ``logits / temperature`` holds a NaN or +inf,
            or only -inf (its log-sum-exp is not finite).
        logits: ``[N, V]`` the logits the flags describe; only the first bad row is read, to say what it holds.
        temperature: > 0, what the logits were divided by.

    Raises:
        ValueError: ``"logits row i ..."`` (:func:`bad_logit_row_error`), naming what row ``i`` holds (NaN /
            +inf and its column, all -inf, or an overflow at this temperature).
    """
    first = first_flagged_row(bad_rows)
    if first is not None:
        raise bad_logit_row_error(first, logits[first], temperature)


def policy_loss_and_bad_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    ref_log_probs: Optional[torch.Tensor] = None,
    alpha: float = 0.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> Tuple[PolicyLossOutput, torch.Tensor]:
    """:func:`policy_loss_from_logits` without its check: the output and the ``[N]`` bool flags of the unmasked rows
    without a finite log-sum-exp (the caller decides when to read them; nothing here syncs with the host)."""
    if mask is not None:
        # Masked rows may be padding with garbage logits; zero them so nothing non-finite reaches autograd.
        logits = torch.where(mask.bool().unsqueeze(-1), logits, logits.new_zeros(()))
    logp, entropy = token_logprobs(logits, labels, temperature)
    out = policy_loss_from_logp(
        logp,
        old_log_probs,
        advantages,
        mask,
        ref_log_probs=ref_log_probs,
        alpha=alpha,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=dual_clip,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
    )
    if return_entropy:
        out.entropy = entropy if mask is None else torch.where(mask.bool(), entropy, entropy.new_zeros(()))
    return out, torch.isnan(entropy)  # masked rows were zeroed: never flagged


def policy_loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    **options,
) -> PolicyLossOutput:
    """The whole loss head from logits, eager torch: the reference of ``ops.fused_policy_loss``.

    Materialises fp32 ``[N, V]`` temporaries; the fused kernels compute the same numbers without them.
    Shapes: ``logits [N, V]``, every other tensor ``[N]``. Masked rows give 0 in every output field and
    no gradient. -inf logits are legal and exact; the module docstring defines a -inf at the label.
    ``options``: ``ref_log_probs``, ``alpha``, ``eps_low``, ``eps_high``, ``dual_clip``, ``kl_coef``,
    ``kl_estimator`` as :func:`policy_loss_from_logp`; ``temperature`` and ``return_entropy`` as
    :func:`policy_loss_and_bad_rows`.

    Raises:
        ValueError: an option out of its range, as :func:`policy_loss_from_logp` (``temperature`` a finite number
            > 0); an unmasked logits row holds a NaN or +inf, or only -inf (:func:`check_logit_rows`). Labels
            outside ``[0, V)`` are clamped and other values not checked (:func:`token_logprobs`): the kernels'
            status bits do that.
    """
    check_temperature(options.get("temperature", 1.0))  # the other options: policy_loss_from_logp
    out, bad_rows = policy_loss_and_bad_rows(logits, labels, old_log_probs, advantages, mask, **options)
    check_logit_rows(bad_rows, logits, options.get("temperature", 1.0))
    return out
