"""Lopti's argument checks and the quantile: the pieces the round (:mod:`.lopti_round`) is built from."""

import math
from typing import Optional

import torch

from .option_checks import real_number

LOPTI_ORDERS = ("low_first", "high_first")


def check_lopti_args(eta: float, order: str, quantile: Optional[float]) -> None:
    """Raise ``ValueError`` naming the argument unless eta in (0, 1], order known, quantile in (0, 1) (numbers, not
    bools: a config's ``true`` would read as 1)."""
    value = real_number(eta)
    if value is None or not 0.0 < value <= 1.0:  # NaN fails the comparison too
        raise ValueError(f"eta must be a probability threshold in (0, 1], got {eta!r}")
    if order not in LOPTI_ORDERS:
        raise ValueError(f"order must be one of {LOPTI_ORDERS}, got {order!r}")
    value = None if quantile is None else real_number(quantile)
    if quantile is not None and (value is None or not 0.0 < value < 1.0):
        raise ValueError(f"quantile must be in (0, 1) or None, got {quantile!r}")


def quantile_threshold(probs: torch.Tensor, q: float) -> float:
    """The q-quantile of a 1-D tensor with linear interpolation (as ``torch.quantile``, without its size cap)."""
    values, _ = torch.sort(probs.float())
    pos = q * (values.numel() - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(values[lo] + (values[hi] - values[lo]) * (pos - lo))
