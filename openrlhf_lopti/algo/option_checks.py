"""The loss's options checked once, for every caller: the reference (:mod:`.policy_loss`), the kernels (``ops``) and
the front ends' configs. A one-line ``ValueError`` naming the option, never a NaN loss later."""

import math
from typing import Optional

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
FLOAT32_MAX = torch.finfo(torch.float32).max


def real_number(value) -> Optional[float]:
    """``value`` as a float if it is a real number (a Python or numpy number, a one-element tensor), else None: a bool
    (a config's ``true`` is not 1, numpy's and torch's bools neither), a string (YAML's ``1e-3`` is the string
    ``'1e-3'``), bytes, or anything ``float`` refuses."""
    if isinstance(value, (bool, str, bytes)) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def number_option(name: str, value) -> float:
    """``value`` as a float, or a one-line ``ValueError`` naming ``name`` unless it is a real number
    (:func:`real_number`)."""
    number = real_number(value)
    if number is None:
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return number


def in_float32(value: float) -> bool:
    """Finite once rounded to float32, the precision of the loss (a float64 1e39 is finite, its float32 is inf)."""
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def check_alpha(alpha: float) -> float:
    """Return ``alpha`` as a float, or raise ``ValueError`` unless it is a number in [0, 1] (:func:`real_number`)."""
    value = real_number(alpha)
    if value is None:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    return value


def clip_range_supported(eps_low: float, eps_high: float) -> bool:
    """Whether the kernel clips the ratio to ``[1 - eps_low, 1 + eps_high]``: ``eps_low`` in [0, 1) (a lower bound
    above 0: the kernel clips the log-ratio) and ``eps_high`` a finite number >= 0. The frameworks' own losses take
    other values too (``eps_low = 1``: no lower clip); a front end runs those on its framework's loss."""
    return 0.0 <= eps_low < 1.0 and eps_high >= 0.0 and in_float32(eps_high)


def check_options(
    alpha: float,
    eps_low: float,
    eps_high: float,
    dual_clip: Optional[float],
    kl_coef: float,
    kl_estimator: str,
    temperature: float,
) -> None:
    """The loss's options, checked: a one-line ``ValueError`` starting with the option's name unless each is a number
    (not a bool or a string) that float32 holds, in its range (``ops.fused_policy_loss``'s docstring)."""
    check_alpha(alpha)
    eps_low, eps_high, kl_coef = (
        number_option(name, value) for name, value in (("eps_low", eps_low), ("eps_high", eps_high), ("kl_coef", kl_coef))
    )
    if not clip_range_supported(eps_low, 0.0):
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low!r}")
    if not clip_range_supported(0.0, eps_high):
        raise ValueError(f"eps_high must be a finite number >= 0, got {eps_high!r}")
    if dual_clip is not None:
        clip = number_option("dual_clip", dual_clip)
        if not (clip > 1.0 and (in_float32(clip) or clip == math.inf)):
            raise ValueError(f"dual_clip must be None, inf (no dual clip) or a finite number > 1, got {dual_clip!r}")
    if not in_float32(kl_coef):
        raise ValueError(f"kl_coef must be a finite number, got {kl_coef!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    check_temperature(temperature)


def dual_clip_bound(dual_clip: Optional[float]) -> Optional[float]:
    """The dual clip the loss applies: None for None or +inf (no bound: OpenRLHF's and verl's own losses take an
    infinite one, whose floor ``inf * A'`` never binds), else the (checked) number as a float."""
    return None if dual_clip is None or float(dual_clip) == math.inf else float(dual_clip)


def check_temperature(temperature: float) -> float:
    """``temperature`` as a float, or a one-line ``ValueError`` unless it is a finite number > 0 whose inverse float32
    holds too (the logits are divided by it)."""
    value = number_option("temperature", temperature)
    if not (value > 0 and in_float32(value) and in_float32(1.0 / value)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return value
