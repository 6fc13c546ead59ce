"""significance.py: the t test every paired comparison uses, against printed t tables and by simulation.

The simulations draw 1,000 samples of n per-sequence differences (normal, seed 0) at the demo's 3 sequences and at 16.
Monte-Carlo allowance: a rate over 1,000 draws has a binomial standard error of √(p(1−p)/1000), 0.0069 at p = 5% and
0.0126 at p = 80%; each check allows 2 of them (so a correct rule fails about 1 run in 40 per check, and the fixed seed
makes each run the same)."""

import numpy as np
import pytest

from calibrate.verification.significance import (
    LEVEL,
    POWER,
    critical_value,
    detectable,
    margin,
    power,
    shift,
    significant,
    t_cdf,
    t_quantile,
)

DRAWS = 1000
FPR_ALLOWANCE = 2 * np.sqrt(LEVEL * (1 - LEVEL) / DRAWS)  # 0.0138
POWER_ALLOWANCE = 2 * np.sqrt(POWER * (1 - POWER) / DRAWS)  # 0.0253


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


def _simulate(n: int, true_mean: float, seed: int = 0) -> float:
    """The share of DRAWS samples of n normal differences (σ 1, mean ``true_mean``) the rule calls significant."""
    d = np.random.default_rng(seed).standard_normal((DRAWS, n)) + true_mean
    mean, se = d.mean(1), d.std(1, ddof=1) / np.sqrt(n)
    return float(np.mean([significant(m, s, n) for m, s in zip(mean, se)]))


@pytest.mark.parametrize("n", [pytest.param(3, id="demo-3-sequences"), pytest.param(16, id="16-sequences")])
def test_false_positives_at_most_five_percent(n):
    rate = _simulate(n, 0.0)
    assert rate <= LEVEL + FPR_ALLOWANCE
    assert power(0.0, n) == pytest.approx(LEVEL, abs=1e-6)  # exactly the level, by integration


def test_two_standard_errors_would_have_over_claimed():
    """The rule this replaces: |mean| > 2 s.e. on 3 sequences calls a null difference significant about 1 time in 5
    (exactly 2·P(T₂ > 2) = 18.4%)."""
    d = np.random.default_rng(0).standard_normal((DRAWS, 3))
    rate = np.mean(np.abs(d.mean(1)) > 2 * d.std(1, ddof=1) / np.sqrt(3))
    assert rate > 0.15 and 2 * (1 - t_cdf(2.0, 2)) == pytest.approx(0.1835, abs=1e-4)


@pytest.mark.parametrize(
    "n, expected",  # the noncentral-t shift: larger than the textbook t₀.₉₇₅ + t₀.₈₀ (5.363 at 3, 2.998 at 16)
    [pytest.param(3, 5.653, id="demo-3-sequences"), pytest.param(4, 4.256, id="4-sequences"),
     pytest.param(16, 2.998, id="16-sequences")],
)
def test_the_detectable_difference_is_found_four_times_in_five(n, expected):
    assert shift(n) == pytest.approx(expected, abs=1e-3) and power(shift(n), n) >= POWER - 1e-9
    assert detectable(0.5, n) == pytest.approx(0.5 * shift(n))
    true_se = 1 / np.sqrt(n)  # σ = 1
    assert _simulate(n, shift(n) * true_se) >= POWER - POWER_ALLOWANCE
