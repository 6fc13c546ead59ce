"""When a paired difference counts: the one rule behind every comparison kvcal states.

Every comparison verify makes is paired by sequence (the same sequences measured two ways, one difference each). A
mean difference over n sequences is *significant* when it lies beyond ``critical_value(n)`` standard errors of zero:
Student's t at n − 1 degrees of freedom, two-sided 5%. On data with no real difference it then says "significant" at
most 1 time in 20 whatever n is; a fixed 2 standard errors says so about 1 time in 5 at 3 sequences. The test assumes
the per-sequence differences are roughly normal. One sequence has no standard error: nothing is tested.

Two things the same test cannot say, each with its own rule here. *Equal*: a difference that is not significant is not
shown to be small, so equality is claimed only by two one-sided tests at 5% each (``equivalent``: the mean's 90%
interval inside ± a stated margin), never from a test that found nothing. *How much it may cost*: the one-sided 95%
bounds of a mean difference (``mean_bounds``).

Every rule built on these states the fewest sequences it judges (``MIN_SEQUENCES`` for the t test: one sequence has no
standard error; a rule with another test, such as the tails' bootstrap, sets its own) and below it says ``TOO_FEW``
(``too_few``), never a verdict. On symmetric per-sequence differences (what two interchangeable measurements give) the
t test holds its 5% at any n ≥ 2 however heavy the tails (it grows conservative); a difference that is skewed while
its mean is zero (rare sequences carrying it) is the case it is not made for, and no minimum fixes that.

Plain Python (``math`` and ``statistics`` only): scipy is not a dependency.
"""

import math
import statistics
from collections.abc import Sequence
from functools import lru_cache

LEVEL = 0.05  # two-sided false-positive rate of the test
RULE = "Student's t test on the per-sequence differences (n − 1 degrees of freedom, two-sided 5%)"
MIN_SEQUENCES = 2  # the fewest sequences the t test judges: one has no standard error
TOO_FEW = "too few sequences to tell"


def mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean over sequences and its standard error (None with a single sequence); a NaN or Inf among ``values`` carries
    through, so a broken measurement stays visible to the check that refuses it."""
    n = len(values)
    mean = math.fsum(values) / n
    return mean, (math.sqrt(math.fsum((x - mean) ** 2 for x in values) / (n - 1) / n) if n > 1 else None)


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
    if n < MIN_SEQUENCES:
        raise ValueError(f"a paired test needs at least 2 sequences, not {n}")
    return t_quantile(1 - LEVEL / 2, n - 1)


def significant(mean: float, stderr: float | None, n: int) -> bool:
    """Whether a mean of ``n`` paired differences with standard error ``stderr`` is beyond chance (``RULE``); never
    with one sequence (``stderr`` None). A zero standard error makes any non-zero mean significant."""
    return stderr is not None and n >= MIN_SEQUENCES and abs(mean) > critical_value(n) * stderr


def margin(stderr: float | None, n: int) -> float:
    """The most a mean of ``n`` paired differences may lie from zero and still be chance: ``critical_value(n)`` ×
    ``stderr`` (0 with one sequence, where there is no standard error)."""
    return 0.0 if stderr is None or n < MIN_SEQUENCES else critical_value(n) * stderr


def too_few(n: int, minimum: int = MIN_SEQUENCES) -> str | None:
    """``TOO_FEW`` with the counts, when ``n`` sequences are under a rule's ``minimum``; None when they are enough."""
    return f"{TOO_FEW} ({n} of the {minimum} this rule needs)" if n < minimum else None


@lru_cache
def one_sided(n: int) -> float:
    """How many standard errors bound a mean of ``n`` paired differences (n ≥ 2) on one side at 95%: t₀.₉₅ at n − 1
    degrees of freedom (6.31 at 2 sequences, 2.92 at 3, 1.75 at 16, → 1.645)."""
    if n < MIN_SEQUENCES:
        raise ValueError(f"a paired test needs at least 2 sequences, not {n}")
    return t_quantile(1 - LEVEL, n - 1)


def mean_bounds(values: Sequence[float]) -> tuple[float, float] | None:
    """The one-sided 95% lower and upper bounds of the true mean of ``values`` (per-sequence, paired): mean ∓
    ``one_sided(n)`` standard errors, each side alone at 95% (together a 90% interval); None under ``MIN_SEQUENCES``."""
    n = len(values)
    if n < MIN_SEQUENCES:
        return None
    mean = statistics.fmean(values)
    reach = one_sided(n) * statistics.stdev(values) / math.sqrt(n)
    return mean - reach, mean + reach


def equivalent(differences: Sequence[float], within: Sequence[float]) -> bool:
    """Whether the true mean of per-sequence ``differences`` is shown to lie inside ± the mean of per-sequence margins
    ``within`` (≥ 0): two one-sided t tests at 5% each (TOST), on each difference minus its margin (shown below zero)
    and plus it (shown above). A margin that is a share of a measured KL varies with each sequence as the difference
    does, so it is tested per sequence, not taken as a constant. On differences whose true mean lies on the margin or
    beyond it says yes at most 1 time in 20; never under ``MIN_SEQUENCES``."""
    above = mean_bounds([d - w for d, w in zip(differences, within)])
    below = mean_bounds([d + w for d, w in zip(differences, within)])
    return above is not None and below is not None and above[1] < 0 < below[0]


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided p-value of the exact McNemar test on paired right/wrong outcomes: of the ``only_first`` +
    ``only_second`` discordant items (right one way, wrong the other), how unlikely a split this uneven or more is when
    each way is equally likely (binomial, n discordant, p ½). Concordant items carry no evidence and are not passed.
    1.0 with no discordant item. Exact integer sums, so small counts get no normal approximation."""
    if min(only_first, only_second) < 0:
        raise ValueError(f"discordant counts must be non-negative, got {only_first} and {only_second}")
    n, low = only_first + only_second, min(only_first, only_second)
    tail = sum(math.comb(n, k) for k in range(low + 1))  # P(X ≤ low) × 2ⁿ
    return min(1.0, 2 * tail / 2**n)
