"""significance.py: the t test every paired comparison uses, the equivalence test and the upper bound, against printed
t tables and by simulation.

The simulations draw DRAWS samples of n per-sequence differences (seeded) at 1, 2, 3 and 16 sequences: normal ones,
and the heavy-tailed ones two interchangeable measurements of KL give (each sequence's KL log-normal, varying 2.7×
between sequences, each measurement of it log-normal again). Monte-Carlo allowance: a rate over DRAWS draws has a
binomial standard error of √(p(1−p)/DRAWS), 0.0034 at p = 5% and 0.0063 at p = 80%; each check allows 3 of them (so
a rule exactly at 5% fails about 1 run in 700 per check, and the fixed seed makes each run the same), while the rules
this replaces (2 standard errors: 18% at 3 sequences; equality read from a test that found nothing: 95% at the margin)
fail by far."""

from fractions import Fraction
from math import comb

import numpy as np
import pytest

from calibrate.verification.significance import (
    LEVEL,
    MIN_SEQUENCES,
    TOO_FEW,
    critical_value,
    equivalent,
    margin,
    mcnemar_exact,
    mean_bounds,
    mean_stderr,
    one_sided,
    significant,
    t_cdf,
    t_quantile,
    too_few,
)

DRAWS = 4000
FPR_ALLOWANCE = 3 * np.sqrt(LEVEL * (1 - LEVEL) / DRAWS)  # 0.0103
POWER = 0.80  # the least share of true effects of the size simulated that a rule must find
POWER_ALLOWANCE = 3 * np.sqrt(POWER * (1 - POWER) / DRAWS)  # 0.0190


@pytest.mark.parametrize(
    "n, table",  # t₀.₉₇₅ at n − 1 degrees of freedom, from a printed table
    [pytest.param(2, 12.7062, id="1df"), pytest.param(3, 4.3027, id="2df"), pytest.param(4, 3.1824, id="3df"),
     pytest.param(11, 2.2281, id="10df"), pytest.param(16, 2.1314, id="15df"), pytest.param(31, 2.0423, id="30df"),
     pytest.param(121, 1.9799, id="120df")],
)
def test_critical_value_is_students_t(n, table):
    assert critical_value(n) == pytest.approx(table, abs=1e-4)
    assert t_cdf(critical_value(n), n - 1) == pytest.approx(1 - LEVEL / 2, abs=1e-10)


def test_t_cdf_and_quantile():
    assert t_cdf(0.0, 5) == 0.5 and t_cdf(-1.0, 1) == pytest.approx(0.25)  # Cauchy at −1
    assert t_cdf(-1.0, 3) == pytest.approx(0.1955011095)  # a table value, lower tail
    assert t_quantile(0.8, 2) == pytest.approx(1.0606602) and t_quantile(0.2, 2) == pytest.approx(-1.0606602)
    with pytest.raises(ValueError, match="at least 2 sequences"):
        critical_value(1)


def test_one_sequence_is_never_significant_and_a_zero_spread_always_is():
    assert not significant(1.0, None, 1) and margin(None, 1) == 0.0
    assert significant(1e-9, 0.0, 3) and not significant(0.0, 0.0, 3)


@pytest.mark.parametrize(
    "n, table",  # t₀.₉₅ at n − 1 degrees of freedom, from a printed table
    [pytest.param(2, 6.3138, id="1df"), pytest.param(3, 2.9200, id="2df"), pytest.param(16, 1.7531, id="15df"),
     pytest.param(121, 1.6577, id="120df")],
)
def test_one_sided_bounds_are_students_t(n, table):
    values = np.random.default_rng(n).standard_normal(n)
    reach = table * values.std(ddof=1) / np.sqrt(n)
    assert one_sided(n) == pytest.approx(table, abs=1e-4)
    assert mean_bounds(values.tolist()) == pytest.approx((values.mean() - reach, values.mean() + reach), rel=1e-4)


def test_equivalence_needs_both_bounds_inside_the_margin_and_two_sequences():
    d = [-0.1, 0.1, 0.0, 0.0]  # mean 0, standard error 0.0408
    reach = one_sided(4) * np.std(d, ddof=1) / 2  # 0.0961
    assert equivalent(d, [reach + 1e-9] * 4) and not equivalent(d, [reach - 1e-9] * 4)
    assert not equivalent([x + 0.05 for x in d], [reach + 0.01] * 4)  # the upper bound is past the margin
    assert not equivalent([x - 0.05 for x in d], [reach + 0.01] * 4)  # the lower bound is
    for w, shown in (([0.1, 0.1, 0.2, 0.2], True), ([0.05, 0.05, 0.1, 0.1], False)):  # per-sequence margins
        upper, lower = np.subtract(d, w), np.add(d, w)  # each side tested on the differences minus and plus them, by hand
        by_hand = (upper.mean() + 2.3534 * upper.std(ddof=1) / 2 < 0) and (lower.mean() - 2.3534 * lower.std(ddof=1) / 2 > 0)
        assert equivalent(d, w) == by_hand == shown
    assert mean_bounds([1.0]) is None and not equivalent([0.0], [1.0])


def test_too_few_says_so_with_the_counts():
    assert MIN_SEQUENCES == 2 and too_few(2) is None and too_few(16, 16) is None
    assert too_few(1) == f"{TOO_FEW} (1 of the 2 this rule needs)" and too_few(15, 16).startswith(TOO_FEW)


# ---- simulations --------------------------------------------------------------------------------------------------------


def _differences(kind: str, n: int, true_mean: float, seed: int) -> np.ndarray:
    """[DRAWS, n] per-sequence differences with mean ``true_mean`` (in units of the sequence KL's mean, 1)."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal((DRAWS, n)) * 0.3 + true_mean
    kl = rng.lognormal(-0.5, 1.0, (DRAWS, n))  # each sequence's KL: mean 1, 2.7× spread between sequences
    a, b = (kl * rng.lognormal(-0.02, 0.2, (DRAWS, n)) for _ in range(2))  # two measurements of it, mean ≈ kl
    return a - b + true_mean


def _rates(d: np.ndarray, rule) -> float:
    n = d.shape[1]
    mean, se = d.mean(1), (d.std(1, ddof=1) / np.sqrt(n) if n > 1 else np.full(len(d), np.nan))
    return float(np.mean([rule(m, None if np.isnan(s) else s, n) for m, s in zip(mean, se)]))


SEQUENCES = [pytest.param(n, id=f"{n}-sequences") for n in (1, 2, 3, 16)]
KINDS = [pytest.param(k, id=k) for k in ("normal", "kl-pairs")]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SEQUENCES)
def test_false_differences_at_most_five_percent(n, kind):
    assert _rates(_differences(kind, n, 0.0, seed=n), significant) <= LEVEL + FPR_ALLOWANCE


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SEQUENCES)
def test_false_equivalence_at_most_five_percent(n, kind):
    """A true difference exactly on the margin (the hardest case for TOST), either side: called equivalent at most 1
    time in 20."""
    within = 0.1
    for sign in (1, -1):
        d = _differences(kind, n, sign * within, seed=100 + n)
        assert np.mean([equivalent(row, [within] * n) for row in d]) <= LEVEL + FPR_ALLOWANCE


def test_each_bound_covers_the_truth_nineteen_times_in_twenty():
    for n in (2, 3, 16):
        bounds = np.array([mean_bounds(row) for row in _differences("normal", n, 0.2, seed=200 + n)])  # [DRAWS, 2]
        for covered in (bounds[:, 1] >= 0.2, bounds[:, 0] <= 0.2):  # exactly 95% each for normal data
            assert abs(covered.mean() - (1 - LEVEL)) <= FPR_ALLOWANCE


def test_at_sixteen_sequences_the_rules_find_true_effects():
    """Not silent: a difference of 3 standard errors is found 4 times in 5 (the t test's power there is 0.82), and a
    zero difference is shown equivalent within a margin of 3.5 standard errors (TOST's power there is about 0.9)."""
    n = 16
    se = 0.3 / np.sqrt(n)
    assert _rates(_differences("normal", n, 3 * se, seed=300), significant) >= POWER - POWER_ALLOWANCE
    assert np.mean([equivalent(row, [3.5 * se] * n) for row in _differences("normal", n, 0.0, seed=301)]) >= POWER - POWER_ALLOWANCE


def test_two_standard_errors_would_have_over_claimed():
    """The rule this replaces: |mean| > 2 s.e. on 3 sequences calls a null difference significant about 1 time in 5
    (exactly 2·P(T₂ > 2) = 18.4%)."""
    d = np.random.default_rng(0).standard_normal((DRAWS, 3))
    rate = np.mean(np.abs(d.mean(1)) > 2 * d.std(1, ddof=1) / np.sqrt(3))
    assert rate > 0.15 and 2 * (1 - t_cdf(2.0, 2)) == pytest.approx(0.1835, abs=1e-4)


def _mcnemar_by_enumeration(b: int, c: int) -> Fraction:
    """The exact two-sided McNemar p-value defined another way: the probability, under Binomial(b + c, ½), of every
    split no more likely than the one observed (exact fractions, every outcome enumerated)."""
    n = b + c
    seen = Fraction(comb(n, b), 2**n)
    return sum((Fraction(comb(n, k), 2**n) for k in range(n + 1) if Fraction(comb(n, k), 2**n) <= seen), Fraction(0))


@pytest.mark.parametrize("b,c", [(0, 0), (0, 1), (1, 9), (9, 1), (5, 5), (3, 4), (0, 12), (7, 20), (40, 61), (150, 190)],
                         ids=lambda v: str(v))
def test_mcnemar_exact_matches_the_enumerated_binomial(b, c):
    assert mcnemar_exact(b, c) == pytest.approx(float(_mcnemar_by_enumeration(b, c)), rel=1e-12, abs=0)


def test_mcnemar_exact_at_a_printed_value_and_refuses_negative_counts():
    """1 flip against 9: 2·(1 + 10)/2¹⁰ = 0.0215, the textbook value; a negative count is a caller's mistake."""
    assert mcnemar_exact(1, 9) == pytest.approx(22 / 1024, rel=1e-15)
    with pytest.raises(ValueError, match="non-negative"):
        mcnemar_exact(-1, 3)


def test_mean_stderr_is_the_textbook_float64_one_and_carries_a_nan():
    """Against numpy in float64 (sample standard deviation, n − 1), on values whose sum loses digits in a naive float
    loop; one value has no standard error; a NaN stays a NaN for the check that refuses it."""
    values = [1e8, 1.0, -1e8, 3.0, 2.5, 1e-3]
    mean, se = mean_stderr(values)
    x = np.array(values, dtype=np.float64)
    assert mean == pytest.approx(x.mean(), rel=1e-12) and se == pytest.approx(x.std(ddof=1) / np.sqrt(len(x)), rel=1e-12)
    assert mean_stderr([0.25]) == (0.25, None)
    assert all(np.isnan(v) for v in mean_stderr([1.0, float("nan"), 2.0]))
