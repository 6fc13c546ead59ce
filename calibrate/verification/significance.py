"""When a paired difference counts: the one rule behind every comparison kvcal states.

Every comparison verify makes is paired by sequence (the same sequences measured two ways, one difference each). A
mean difference over n sequences is *significant* when it lies beyond ``critical_value(n)`` standard errors of zero:
Student's t at n − 1 degrees of freedom, two-sided 5%. On data with no real difference it then says "significant" at
most 1 time in 20 whatever n is; a fixed 2 standard errors says so about 1 time in 5 at 3 sequences. The test assumes
the per-sequence differences are roughly normal. One sequence has no standard error: nothing is tested.

The *detectable* difference is the one this test finds 4 times in 5 (power 80%): ``shift(n)`` standard errors, the
mean of a noncentral t at n − 1 degrees of freedom whose probability beyond ±``critical_value(n)`` is 80%, computed
here by integration. The textbook (t₀.₉₇₅ + t₀.₈₀) standard errors falls short of 80% at few sequences (77% at 3).

Plain Python (``math`` only): scipy is not a dependency.
"""

import math
from functools import lru_cache

LEVEL = 0.05  # two-sided false-positive rate of the test
POWER = 0.80  # the chance of finding a difference of the detectable size
RULE = "Student's t test on the per-sequence differences (n − 1 degrees of freedom, two-sided 5%)"


def t_cdf(t: float, df: int) -> float:
    """P(T ≤ t) for Student's t with an integer ``df`` ≥ 1: the exact finite series (Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(abs(t) / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2:  # odd: A = 2/π (θ + sinθ (cosθ + 2/3 cos³θ + ... ))
        term, series = math.cos(theta), 0.0
        for k in range(1, (df - 1) // 2 + 1):
            series += term
            term *= 2 * k / (2 * k + 1) * cos2
        inside = 2 / math.pi * (theta + math.sin(theta) * series)
    else:  # even: A = sinθ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + ...)
        term, series = 1.0, 0.0
        for k in range(1, df // 2 + 1):
            series += term
            term *= (2 * k - 1) / (2 * k) * cos2
        inside = math.sin(theta) * series
    return 0.5 + math.copysign(inside / 2, t)  # inside = P(|T| ≤ |t|)


def t_quantile(p: float, df: int) -> float:
    """The t with P(T ≤ t) = p, by bisection on ``t_cdf`` (to 1e-12)."""
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@lru_cache
def critical_value(n: int) -> float:
    """How many standard errors a mean of ``n`` paired differences (n ≥ 2) must clear: t₀.₉₇₅ at n − 1 degrees of
    freedom (12.7 at 2 sequences, 4.30 at 3, 2.13 at 16, → 1.96)."""
    if n < 2:
        raise ValueError(f"a paired test needs at least 2 sequences, not {n}")
    return t_quantile(1 - LEVEL / 2, n - 1)


def power(shift: float, n: int) -> float:
    """The chance the test finds a true mean difference of ``shift`` true standard errors (σ/√n) over ``n``
    sequences: P(|Z + shift| > c·S), Z standard normal, S² a χ² over n − 1 degrees of freedom divided by them, c the
    critical value; integrated over S by Simpson's rule."""
    df, c = n - 1, critical_value(n)
    log_norm = math.log(2) + df / 2 * math.log(df / 2) - math.lgamma(df / 2)

    def f(s: float) -> float:  # P(reject | S = s) × the density of S
        if s == 0.0:
            return 0.0 if df > 1 else math.exp(log_norm) * (_phi(shift) + _phi(-shift))
        density = math.exp(log_norm + (df - 1) * math.log(s) - df * s * s / 2)
        return (_phi(shift - c * s) + _phi(-shift - c * s)) * density

    top, steps = 1 + 12 / math.sqrt(df), 2000
    h = top / steps
    inner = sum((4 if i % 2 else 2) * f(i * h) for i in range(1, steps))
    return h / 3 * (f(0.0) + inner + f(top))


def _phi(x: float) -> float:
    """The standard normal's P(Z ≤ x)."""
    return 0.5 * math.erfc(-x / math.sqrt(2))


@lru_cache
def shift(n: int) -> float:
    """How many standard errors a true difference must be for the test over ``n`` sequences to find it with
    ``POWER`` (by bisection on ``power``): 5.6 at 3 sequences, 3.0 at 16, → 2.80."""
    lo, hi = 0.0, 2 * critical_value(n) + 2
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power(mid, n) < POWER else (lo, mid)
    return hi  # the side with at least POWER


def significant(mean: float, stderr: float | None, n: int) -> bool:
    """Whether a mean of ``n`` paired differences with standard error ``stderr`` is beyond chance (``RULE``); never
    with one sequence (``stderr`` None). A zero standard error makes any non-zero mean significant."""
    return stderr is not None and n >= 2 and abs(mean) > critical_value(n) * stderr


def margin(stderr: float | None, n: int) -> float:
    """The most a mean of ``n`` paired differences may lie from zero and still be chance: ``critical_value(n)`` ×
    ``stderr`` (0 with one sequence, where there is no standard error)."""
    return 0.0 if stderr is None or n < 2 else critical_value(n) * stderr


def detectable(stderr: float, n: int) -> float:
    """The difference the test over ``n`` sequences finds with ``POWER`` at this standard error: ``shift(n)`` ×
    ``stderr`` (the observed standard error standing for the true one)."""
    return shift(n) * stderr
