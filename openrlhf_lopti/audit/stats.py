"""Confidence intervals of a mean over seeds: Student's t, without scipy.

The t distribution's CDF for an integer number of degrees of freedom has a closed form (Abramowitz and
Stegun 26.7.3 / 26.7.4, a finite sum of powers of cos(theta) with theta = atan(t / sqrt(df))); the quantile
is found by bisection on it. Degrees of freedom here are (seeds - 1), always integers.
"""

import math
from typing import Optional, Sequence


def t_two_sided_mass(t: float, df: int) -> float:
    """``P(|T| <= t)`` for Student's t with ``df`` (integer >= 1) degrees of freedom, ``t >= 0``."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be an integer >= 1, got {df!r}")
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 1:  # odd: (2 / pi) * (theta + sin * cos * (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= (2 * k) / (2 * k + 1) * c * c
            total += term
        return (2 / math.pi) * (theta + s * c * total) if df > 1 else 2 * theta / math.pi
    # even: sin * (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), df/2 terms
    term, total = 1.0, 1.0
    for k in range(1, df // 2):
        term *= (2 * k - 1) / (2 * k) * c * c
        total += term
    return s * total


def t_quantile(prob: float, df: int) -> float:
    """The ``prob`` quantile (``prob`` in (0.5, 1)) of Student's t with ``df`` degrees of freedom, e.g.
    ``t_quantile(0.975, 4) = 2.776``; accurate to about 1e-10."""
    if not 0.5 < prob < 1.0:
        raise ValueError(f"prob must be in (0.5, 1), got {prob!r}")
    mass = 2 * prob - 1  # P(|T| <= t)
    lo, hi = 0.0, 1.0
    while t_two_sided_mass(hi, df) < mass:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_mass(mid, df) < mass else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def mean_ci(values: Sequence[float], level: float = 0.95) -> dict:
    """Mean of ``values`` with its two-sided ``level`` confidence interval ``mean -+ t * sd / sqrt(n)``
    (Student's t, n - 1 degrees of freedom, sd the sample standard deviation).

    Returns:
        ``{"mean", "lo", "hi", "half_width", "sd", "n"}``; with fewer than 2 values the interval is None
        (and the mean None without values). Non-finite values are dropped first.
    """
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    out: dict = {"mean": None, "lo": None, "hi": None, "half_width": None, "sd": None, "n": n}
    if n == 0:
        return out
    mean = sum(xs) / n
    out["mean"] = mean
    if n < 2:
        return out
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    out.update(lo=mean - half, hi=mean + half, half_width=half, sd=sd)
    return out


def paired_differences(values: dict, baseline: dict) -> list:
    """``values[s] - baseline[s]`` for the keys (seeds) both have, in sorted key order; non-finite or
    missing entries are skipped."""
    diffs = []
    for key in sorted(set(values) & set(baseline)):
        a, b = values[key], baseline[key]
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
            diffs.append(a - b)
    return diffs


def format_ci(ci: dict, spec: str = ".3f", signed: bool = False) -> str:
    """``0.512 [0.478, 0.546]`` (``-`` without a mean, no interval with one value)."""
    mean: Optional[float] = ci.get("mean")
    if mean is None:
        return "-"
    f = ("+" if signed else "") + spec
    text = format(mean, f)
    if ci.get("lo") is not None:
        text += f" [{format(ci['lo'], f)}, {format(ci['hi'], f)}]"
    return text
