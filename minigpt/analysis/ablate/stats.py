"""The statistics of ``minigpt ablate``: 95 % intervals of a mean over seeds, of a difference to the baseline, and
the verdict each difference gets.

Each variant is trained with ``n`` seeds; the seed sets the initialisation and the data order, and the baseline
and a variant trained with the same seed see the same batches. So the difference to the baseline is taken per seed
(a paired comparison) and its mean gets the Student-t interval with ``n - 1`` degrees of freedom
(``mean +- t_{0.975, n-1} * s / sqrt(n)``, ``s`` the sample standard deviation). When the two seed sets differ (a
failed run) the difference of the means gets Welch's interval instead (Welch 1947; Welch-Satterthwaite degrees of
freedom).

A difference is

* **resolved** when its interval excludes 0 (better or worse, at 95 %);
* **equal within** ``bound`` when its whole interval lies inside ``[-bound, +bound]`` (two one-sided tests at 2.5 %
  each, the confidence-interval form of an equivalence test; Schuirmann 1987);
* **unresolved** otherwise: the interval straddles 0 but is wider than the bound. More seeds or more tokens
  narrow it; :func:`seeds_to_resolve` says how many seeds an effect of the measured size would need.

The t quantile is computed here (Student's CDF for integer degrees of freedom in closed form, Abramowitz & Stegun
26.7.3-26.7.4, inverted by bisection), so the package needs no SciPy.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

CONFIDENCE = 0.95
MAX_SEEDS = 1000  # seeds_to_resolve gives up beyond this


def student_t_cdf(t: float, df: int) -> float:
    """``P(T <= t)`` for Student's t with integer ``df >= 1`` degrees of freedom (Abramowitz & Stegun 26.7.3 for
    odd, 26.7.4 for even ``df``: ``A(t|df) = P(|T| <= |t|)`` as a finite series in ``theta = atan(t / sqrt(df))``).
    """
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df!r}")
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:  # odd: A = 2/pi * (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), df - 3 >= the last power
        series, term = 0.0, 1.0
        for k in range(1, (df - 1) // 2 + 1):
            series += term
            term *= c2 * (2 * k) / (2 * k + 1)
        a = 2 / math.pi * (theta + (s * math.cos(theta) * series if df > 1 else 0.0))
    else:  # even: A = sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), up to cos^(df-2)
        series, term = 0.0, 1.0
        for k in range(1, df // 2 + 1):
            series += term
            term *= c2 * (2 * k - 1) / (2 * k)
        a = s * series
    return 0.5 + math.copysign(a / 2, t)


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``t_quantile(0.975, 2)`` = 4.3027), by
    bisection on :func:`student_t_cdf` to ~1e-10."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if student_t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-10:
            break
    return (lo + hi) / 2


@dataclass
class Interval:
    """``mean +- half`` at :data:`CONFIDENCE`; ``se`` the standard error, ``n`` the sample size, ``df`` the degrees of
    freedom (``half`` is NaN when ``n < 2``: one sample has no spread)."""

    mean: float
    half: float
    se: float
    n: int
    df: float

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half

    def text(self, digits: int = 4) -> str:
        """``"3.1234 ± 0.0123"`` (``"3.1234 (1 seed)"`` without an interval)."""
        if math.isnan(self.half):
            return f"{self.mean:.{digits}f} ({self.n} seed)"
        return f"{self.mean:.{digits}f} ± {self.half:.{digits}f}"


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """The Student-t interval of the mean of ``values`` (``n - 1`` degrees of freedom)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if n < 2:
        return Interval(mean, math.nan, math.nan, n, 0)
    se = statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, t_quantile(0.5 + confidence / 2, n - 1) * se, se, n, n - 1)


def difference_interval(variant: dict[int, float], base: dict[int, float],
                        confidence: float = CONFIDENCE) -> Interval:
    """Interval of ``mean(variant) - mean(base)``; each argument maps a seed to a value. Paired by seed when both
    have the same seeds, Welch's unequal-variance interval otherwise (see the module docstring)."""
    if set(variant) == set(base):
        return mean_interval([variant[s] - base[s] for s in sorted(base)], confidence)
    a, b = list(variant.values()), list(base.values())
    mean = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return Interval(mean, math.nan, math.nan, min(len(a), len(b)), 0)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return Interval(mean, 0.0, 0.0, min(len(a), len(b)), math.inf)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    # integer df for the closed-form CDF: rounding down is the conservative (wider) choice
    return Interval(mean, t_quantile(0.5 + confidence / 2, max(1, math.floor(df))) * se, se,
                    min(len(a), len(b)), df)


RESOLVED_BETTER, RESOLVED_WORSE, EQUAL, UNRESOLVED = "better", "worse", "equal", "unresolved"


def classify(diff: Interval, bound: float, lower_is_better: bool = True) -> str:
    """:data:`RESOLVED_BETTER` / :data:`RESOLVED_WORSE` when the interval excludes 0, :data:`EQUAL` when it lies
    within ``[-bound, bound]``, :data:`UNRESOLVED` otherwise (also without an interval: one seed)."""
    if math.isnan(diff.half):
        return UNRESOLVED
    if diff.low > 0 or diff.high < 0:
        return RESOLVED_WORSE if (diff.low > 0) == lower_is_better else RESOLVED_BETTER
    if -bound <= diff.low and diff.high <= bound:
        return EQUAL
    return UNRESOLVED


def seeds_to_resolve(diff: Interval, confidence: float = CONFIDENCE) -> Optional[int]:
    """Seeds needed for an effect of the measured size ``|mean|`` to be resolved, if the per-seed spread stays what
    it was: the smallest ``n`` with ``t_{n-1} * sd / sqrt(n) < |mean|``. None when it cannot be estimated (one
    seed, no spread or no effect) or exceeds :data:`MAX_SEEDS`."""
    if diff.n < 2 or not diff.se or not diff.mean or math.isnan(diff.se):
        return None
    sd = diff.se * math.sqrt(diff.n)
    # t_{n-1} > z, so no n below the normal-theory (z * sd / mean)^2 can do: start the search there
    z = t_quantile(0.5 + confidence / 2, 10_000)
    start = max(2, math.floor((z * sd / abs(diff.mean)) ** 2))
    if start > MAX_SEEDS:
        return None
    for n in range(start, MAX_SEEDS + 1):
        if t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n) < abs(diff.mean):
            return n
    return None


def describe(diff: Interval, bound: float, unit: str = "bpb") -> str:
    """One phrase for a difference to the baseline: ``"+0.0123 ± 0.0045 bpb: worse (resolved)"``, ``"... equal
    within ±0.0100"`` or ``"... unresolved (about N seeds would resolve it)"``."""
    verdict = classify(diff, bound)
    head = f"{diff.mean:+.4f}" + ("" if math.isnan(diff.half) else f" ± {diff.half:.4f}") + f" {unit}"
    if verdict in (RESOLVED_BETTER, RESOLVED_WORSE):
        return f"{head}: {verdict} (resolved)"
    if verdict == EQUAL:
        return f"{head}: equal within ±{bound:.4f} {unit}"
    need = seeds_to_resolve(diff)
    hint = f"; about {need} seeds would resolve an effect this size" if need else ""
    return f"{head}: unresolved{hint}"
