"""Low-Probability Token Isolation (Lopti, paper Algorithm 1): split response tokens into update phases."""

import math
from typing import Optional

import torch

LOPTI_ORDERS = ("low_first", "high_first")


def check_lopti_args(eta: float, order: str, quantile: Optional[float]) -> None:
    """Raise ``ValueError`` naming the argument unless eta in (0, 1], order known, quantile in (0, 1)."""
    if not isinstance(eta, (int, float)) or not 0.0 < float(eta) <= 1.0:  # NaN fails the comparison too
        raise ValueError(f"eta must be a probability threshold in (0, 1], got {eta!r}")
    if order not in LOPTI_ORDERS:
        raise ValueError(f"order must be one of {LOPTI_ORDERS}, got {order!r}")
    if quantile is not None and (not isinstance(quantile, (int, float)) or not 0.0 < float(quantile) < 1.0):
        raise ValueError(f"quantile must be in (0, 1) or None, got {quantile!r}")


def quantile_threshold(probs: torch.Tensor, q: float) -> float:
    """The q-quantile of a 1-D tensor with linear interpolation (as ``torch.quantile``, without its size cap)."""
    values, _ = torch.sort(probs.float())
    pos = q * (values.numel() - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(values[lo] + (values[hi] - values[lo]) * (pos - lo))


def lopti_phases(
    old_log_probs: torch.Tensor,
    action_mask: Optional[torch.Tensor],
    eta: float = 0.5,
    order: str = "low_first",
    quantile: Optional[float] = None,
) -> list[torch.Tensor]:
    """Token masks of the Lopti update phases, in the order they must be trained.

    A token is "low" when its rollout probability ``exp(old_log_probs)`` is below ``eta`` and "high"
    otherwise; only tokens with a true ``action_mask`` belong to either. Lopti updates on the low tokens
    first, then recomputes the forward pass and updates on the high ones (the paper's ablation shows that
    the reverse order collapses training; ``order="high_first"`` exists to reproduce it).

    Args:
        old_log_probs: ``[B, T]`` (any shape) log-probs of the sampled tokens under the rollout policy, nats.
        action_mask: same shape, bool or 0/1; None means every token is a response token.
        eta: probability threshold in (0, 1]; the paper recommends 0.5.
        order: ``"low_first"`` (Lopti) or ``"high_first"`` (the ablation).
        quantile: if set, in (0, 1): ignore ``eta`` and use the q-quantile of the masked tokens'
            probabilities as the threshold, so that about a fraction q of them is "low".

    Returns:
        Two bool tensors of ``old_log_probs``' shape, ``[low, high]`` or ``[high, low]``. Each is a subset
        of ``action_mask``, they are disjoint and cover it. A phase with no tokens is still returned
        (all False) so the caller can skip it and keep phase indices stable.

    Raises:
        ValueError: eta outside (0, 1], unknown order, quantile outside (0, 1), mismatched shapes,
            or NaN log-probs on masked tokens.
    """
    check_lopti_args(eta, order, quantile)
    if action_mask is None:
        mask = torch.ones_like(old_log_probs, dtype=torch.bool)
    else:
        if action_mask.shape != old_log_probs.shape:
            raise ValueError(
                f"action_mask must have the shape of old_log_probs {tuple(old_log_probs.shape)}, "
                f"got {tuple(action_mask.shape)}"
            )
        mask = action_mask.bool()
    probs = old_log_probs.detach().to(torch.promote_types(old_log_probs.dtype, torch.float32)).exp()
    masked_probs = probs[mask]
    if torch.isnan(masked_probs).any():
        raise ValueError("old_log_probs contains NaN on masked (response) tokens")

    threshold = float(eta)
    if quantile is not None and masked_probs.numel() > 0:
        threshold = quantile_threshold(masked_probs, float(quantile))

    low = mask & (probs < threshold)
    high = mask & ~low
    return [low, high] if order == "low_first" else [high, low]
