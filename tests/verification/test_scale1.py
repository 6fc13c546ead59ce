""""Is scale 1.0 enough?" (verification/scale1.py) from hand-made numbers: the answers, each with what to do, and by
simulation: how often it claims what is not so at 1, 2, 3 and 16 sequences.

The paired difference, its standard error and the t quantiles are computed here with numpy and printed tables,
independently of verdict.compare and significance.py."""

import numpy as np
import pytest

from calibrate.verification.scale1 import BETTER, EQUAL, EQUIVALENCE, UNDECIDED, UNTESTED, WORSE, scale1_answer


def static(kl_per_sequence: list[float], source: str = "checkpoint", **extra) -> dict:
    return {"mode": "static", "kl": float(np.mean(kl_per_sequence)), "kl_per_sequence": kl_per_sequence,
            "source": source, "kv_dtype": "fp8", **extra}


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    d = np.subtract(a, b)
    return d.mean(), d.std(ddof=1) / np.sqrt(len(d))


SCALE1 = [0.020, 0.024, 0.018, 0.022]
T95_3DF = 2.3534  # t₀.₉₅ at 3 degrees of freedom (4 sequences), from a printed table


def results(tensor: list[float], scale1: list[float] = SCALE1) -> dict:
    return {"bf16": {"mode": "reference", "kl": 0.0}, "tensor": static(tensor), "scale1": static(scale1, source="1.0"),
            "token": {**static(scale1), "mode": "token"}}


@pytest.mark.parametrize(
    "tensor, outcome, says, todo",
    [
        pytest.param([0.010, 0.013, 0.009, 0.012], BETTER, "No: fp8, calibrated per tensor lowers the KL by {change}",
                     "Serve the calibrated scales.", id="better"),
        pytest.param([0.021, 0.023, 0.019, 0.021], EQUAL, "Yes, equivalent within 10%: two one-sided t tests at 5% show what "
                     "scale 1.0 costs over fp8, calibrated per tensor to lie within ±10% of its KL", "Either serves", id="equivalent"),
        pytest.param([0.023, 0.021, 0.021, 0.019], UNDECIDED, "Cannot tell on this sample: scale 1.0 may cost up to",
                     "verify with a larger --max-tokens", id="cannot-tell"),
        pytest.param([0.030, 0.035, 0.027, 0.031], WORSE, "Yes, and better here: scale 1.0 is {change} below",
                     "Serve without KV scales", id="worse"),
    ],
)
def test_the_answers_with_what_to_do(tensor, outcome, says, todo):
    answer = scale1_answer(results(tensor))
    mean, se = paired(tensor, SCALE1)
    assert answer["outcome"] == outcome and answer["calibrated"] == "tensor"
    assert answer["difference"] == pytest.approx(mean) and answer["stderr"] == pytest.approx(se) and answer["sequences"] == 4
    assert answer["margin"] == pytest.approx(0.1 * np.mean(tensor))
    # What scale 1.0 costs over the calibrated scales, 95% each side: −mean ± t₀.₉₅ × se.
    assert answer["cost_high"] == pytest.approx(-mean + T95_3DF * se, rel=1e-4)
    assert answer["cost_low"] == pytest.approx(-mean - T95_3DF * se, rel=1e-4)
    change = f"{abs(np.mean(tensor) / np.mean(SCALE1) - 1):.0%}"
    assert says.format(change=change) in answer["text"] and "paired over 4 sequences" in answer["text"] and todo in answer["text"]
    if outcome == UNDECIDED:  # the bound, in nats and against the calibrated KL
        high = -mean + T95_3DF * se
        assert f"up to {high:+.2g} nats/token more than fp8, calibrated per tensor ({high / np.mean(tensor):+.0%} of its KL; 95% upper bound)" in answer["text"]
        assert f"equivalence within 10% (±{0.1 * np.mean(tensor):.2g} nats/token) is not shown" in answer["text"]


def test_one_sequence_is_too_few_to_tell_and_the_best_calibrated_scales_are_compared():
    results = {"tensor": static([0.03]), "mse": static([0.01], source="the mse observer"),
               "fp8_e5m2": static([0.001], kv_dtype="fp8_e5m2"), "head": static([0.0001], servable=False),
               "scale1": static([0.02], source="1.0")}
    answer = scale1_answer(results)
    assert answer["calibrated"] == "mse" and answer["outcome"] == UNTESTED and answer["cost_high"] is None
    assert answer["text"].startswith("Is scale 1.0 enough? Too few sequences to tell:") and "--max-tokens" in answer["text"]


def test_no_answer_without_both_sides():
    assert scale1_answer({"tensor": static(SCALE1)}) is None
    assert scale1_answer({"scale1": static(SCALE1, source="1.0"), "token": {**static(SCALE1), "mode": "token"}}) is None


# ---- simulation: what the answer claims that is not so ------------------------------------------------------------------

TRIALS = 1000
ALLOWANCE = 3 * np.sqrt(0.05 * 0.95 / TRIALS)  # 3 binomial standard errors of a 5% rate over TRIALS: 0.0207


def _claims(n: int, cost: float, seed: int, noise: float = 0.2) -> dict[str, float]:
    """The share of each outcome over TRIALS samples of ``n`` sequences where scale 1.0 truly costs ``cost`` × the
    calibrated KL more: each sequence's KL log-normal (mean 0.02 nats, 2.7× spread between sequences), each scheme's
    measurement of it log-normal again (``noise``)."""
    rng = np.random.default_rng(seed)
    counts = dict.fromkeys((BETTER, EQUAL, WORSE, UNDECIDED, UNTESTED), 0)
    for _ in range(TRIALS):
        kl = rng.lognormal(np.log(0.02) - 0.5, 1.0, n)
        tensor, one = (kl * f * rng.lognormal(-noise**2 / 2, noise, n) for f in (1.0, 1.0 + cost))
        counts[scale1_answer(results(tensor.tolist(), one.tolist()))["outcome"]] += 1
    return {k: v / TRIALS for k, v in counts.items()}


@pytest.mark.parametrize("n", [pytest.param(n, id=f"{n}-sequences") for n in (1, 2, 3, 16)])
def test_at_most_five_percent_false_claims(n):
    """No true difference: "better" or "worse" at most 1 time in 20. A true cost exactly on the margin, either way:
    "equivalent" at most 1 time in 20 (the old reading, equal whenever the t test found nothing, said so 19 times in
    20 here). One sequence: always too few to tell."""
    null = _claims(n, 0.0, seed=n)
    assert null[BETTER] + null[WORSE] <= 0.05 + ALLOWANCE
    for sign in (1, -1):
        assert _claims(n, sign * EQUIVALENCE, seed=10 + n, noise=0.05)[EQUAL] <= 0.05 + ALLOWANCE
    assert (null[UNTESTED] == 1.0) == (n == 1)


def test_at_sixteen_sequences_it_answers():
    """Not silent: at 16 sequences a 30% cost is found (better) and no cost, measured precisely, shown equivalent, each
    at least 4 times in 5."""
    assert _claims(16, 0.3, seed=20, noise=0.1)[BETTER] >= 0.8
    assert _claims(16, 0.0, seed=21, noise=0.03)[EQUAL] >= 0.8


def test_nvfp4_is_asked_apart_from_fp8():
    """vLLM serves nvfp4 at outer scale 1.0 without checkpoint scales as it does FP8: the nvfp4 answer sets the
    checkpoint's nvfp4 row against nvfp4 at 1.0 only, never an FP8 row or another cache dtype, and says which dtype."""
    def cache(kl, dtype="nvfp4", source="checkpoint"):
        return {**static(kl, source=source), "mode": "cache", "kv_dtype": dtype}

    nvfp4 = [0.030, 0.034, 0.029, 0.032]
    at_one = [0.060, 0.070, 0.058, 0.066]
    rows = {"tensor": static([0.001] * 4), "scale1": static(SCALE1, source="1.0"), "nvfp4": cache(nvfp4),
            "nvfp4_4over6": cache([0.0001] * 4, dtype="nvfp4_4over6"), "nvfp4_scale1": cache(at_one, source="1.0"),
            "int8_per_token_head": {**cache([0.0001] * 4, dtype="int8_per_token_head"), "source": "computed"}}
    answer = scale1_answer(rows, "nvfp4")
    mean, se = paired(nvfp4, at_one)
    assert answer["calibrated"] == "nvfp4" and answer["kv_cache_dtype"] == "nvfp4" and answer["outcome"] == BETTER
    assert answer["difference"] == pytest.approx(mean) and answer["stderr"] == pytest.approx(se)
    assert answer["text"].startswith("Is scale 1.0 enough for nvfp4? No: nvfp4 lowers the KL by")
    assert scale1_answer(rows)["calibrated"] == "tensor"  # FP8's answer is untouched by the nvfp4 rows
    assert scale1_answer({"nvfp4": cache(nvfp4), "scale1": static(SCALE1, source="1.0")}, "nvfp4") is None
