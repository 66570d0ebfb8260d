"""The gate's statistics (pure): paired one-sided t-tests of a candidate against a reference over
the same probes, and the stricter significance an early look at part of the probes needs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist


@dataclass(frozen=True)
class GroupFigures:
    candidate: float
    reference: float
    delta: float
    p_worse: float  # one-sided p-value of "the candidate is no worse" (small: it is worse)
    # one-sided p-value of "the candidate is worse by the margin or more" (small: it is shown to
    # lose less than the margin; the burden of proof a comparison with v0 puts on the candidate)
    p_inferior: float


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with df degrees of freedom (regularised incomplete beta)."""
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    x = df / (df + t * t)
    tail = 0.5 * betainc(df / 2.0, 0.5, x)
    return tail if t > 0 else 1.0 - tail


def betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b) by the continued fraction (Numerical Recipes' betacf)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1 - x)
    front = math.exp(ln)
    if x > (a + 1) / (a + b + 2):
        return 1.0 - betainc(b, a, 1.0 - x)
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > 1e-30 else 1e-30)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > 1e-30 else 1e-30)
            c = 1.0 + num / c
            c = c if abs(c) > 1e-30 else 1e-30
            h *= d * c
        if abs(d * c - 1.0) < 1e-12:
            break
    return front * h / a


def paired_worse(
    candidate: Sequence[float], reference: Sequence[float], margin: float = 0.05
) -> GroupFigures:
    """Mean candidate − reference over paired probes and two one-sided paired t-tests of it:
    `p_worse` of "the mean difference is >= 0" (identical scores give 1: no evidence of harm), and
    `p_inferior` of "the mean difference is <= −margin" (non-inferiority: small only when the
    candidate is shown to lose less than the margin). Without spread, each p is 0 or 1 by which
    side of its bound the difference is on."""
    if len(candidate) != len(reference) or not candidate:
        raise ValueError("need the same, non-empty probes for both versions")
    d = [c - r for c, r in zip(candidate, reference, strict=True)]
    n = len(d)
    mean = sum(d) / n
    c_rate, r_rate = sum(candidate) / n, sum(reference) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n >= 2 else 0.0
    if sd == 0.0:
        return GroupFigures(c_rate, r_rate, mean, 1.0 if mean >= 0 else 0.0, 0.0 if mean > -margin else 1.0)
    se = sd / math.sqrt(n)
    return GroupFigures(c_rate, r_rate, mean, 1.0 - t_sf(mean / se, n - 1), t_sf((mean + margin) / se, n - 1))


def early(alpha: float, share: float) -> float:
    """The significance a rejection needs when only `share` of the probes are in: O'Brien and
    Fleming's boundary for a two-look sequential test, z = z_alpha / sqrt(share), so that a look
    at a third of the evidence rejects only a loss that all of it would almost surely confirm."""
    if share >= 1.0:
        return alpha
    z = NormalDist().inv_cdf(1.0 - alpha) / math.sqrt(max(share, 1e-9))
    return 1.0 - NormalDist().cdf(z)


def price(plain: Sequence[float], prompted: Sequence[float]) -> float:
    """What the preferences cost on the general probe: plain v0's rate − the twin's, as a rate
    difference over the same probes (positive: asking for them costs answers)."""
    if len(plain) != len(prompted) or not plain:
        raise ValueError("need the same, non-empty probes for both")
    return (sum(plain) - sum(prompted)) / len(plain)


__all__ = ["GroupFigures", "betainc", "early", "paired_worse", "price", "t_sf"]
