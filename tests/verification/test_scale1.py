""""Is scale 1.0 enough?" (verification/scale1.py) from hand-made numbers: the three answers, each with what to do.

The paired difference and its standard error are computed here with numpy, independently of verdict.compare."""

import numpy as np
import pytest

from calibrate.verification.scale1 import BETTER, EQUAL, UNTESTED, WORSE, scale1_answer


def static(kl_per_sequence: list[float], source: str = "checkpoint", **extra) -> dict:
    return {"mode": "static", "kl": float(np.mean(kl_per_sequence)), "kl_per_sequence": kl_per_sequence,
            "source": source, "kv_dtype": "fp8", **extra}


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    d = np.subtract(a, b)
    return d.mean(), d.std(ddof=1) / np.sqrt(len(d))


SCALE1 = [0.020, 0.024, 0.018, 0.022]
SHIFT_4 = 4.2559  # standard errors the t test over 4 sequences finds 4 times in 5 (noncentral t, 3 d.f.; test_significance)


@pytest.mark.parametrize(
    "tensor, outcome, says",
    [
        pytest.param([0.010, 0.013, 0.009, 0.012], BETTER, "No: fp8, calibrated per tensor lowers the KL by {change}", id="better"),
        pytest.param([0.021, 0.023, 0.019, 0.021], EQUAL, "On this sample, yes", id="equal"),
        pytest.param([0.030, 0.035, 0.027, 0.031], WORSE, "Yes, and better here: scale 1.0 is {change} below", id="worse"),
    ],
)
def test_the_three_answers_with_what_to_do(tensor, outcome, says):
    answer = scale1_answer({"bf16": {"mode": "reference", "kl": 0.0}, "tensor": static(tensor),
                            "scale1": static(SCALE1, source="1.0"), "token": {**static(SCALE1), "mode": "token"}})
    mean, se = paired(tensor, SCALE1)
    assert answer["outcome"] == outcome and answer["calibrated"] == "tensor"
    assert answer["difference"] == pytest.approx(mean) and answer["stderr"] == pytest.approx(se)
    assert answer["detectable"] == pytest.approx(SHIFT_4 * se, rel=1e-4) and answer["sequences"] == 4
    change = f"{abs(np.mean(tensor) / np.mean(SCALE1) - 1):.0%}"
    assert says.format(change=change) in answer["text"] and "paired over 4 sequences" in answer["text"]
    todo = {BETTER: "Serve the calibrated scales.", EQUAL: "Either serves", WORSE: "Serve without KV scales"}[outcome]
    assert todo in answer["text"]
    if outcome == EQUAL:  # the difference the sample finds 4 times in 5, in nats and against scale 1.0's KL
        found = SHIFT_4 * se
        assert (f"a difference of {found:.2g} nats/token ({found / np.mean(SCALE1):.0%} of scale 1.0's KL) would have "
                "shown 4 times in 5") in answer["text"]


def test_the_best_calibrated_scales_are_compared_and_one_sequence_is_not_tested():
    results = {"tensor": static([0.03]), "mse": static([0.01], source="the mse observer"),
               "fp8_e5m2": static([0.001], kv_dtype="fp8_e5m2"), "head": static([0.0001], servable=False),
               "scale1": static([0.02], source="1.0")}
    answer = scale1_answer(results)
    assert answer["calibrated"] == "mse" and answer["outcome"] == UNTESTED and answer["detectable"] is None
    assert "Not tested" in answer["text"] and "--max-tokens" in answer["text"]


def test_no_answer_without_both_sides():
    assert scale1_answer({"tensor": static(SCALE1)}) is None
    assert scale1_answer({"scale1": static(SCALE1, source="1.0"), "token": {**static(SCALE1), "mode": "token"}}) is None


def test_nvfp4_is_asked_apart_from_fp8():
    """vLLM serves nvfp4 at outer scale 1.0 without checkpoint scales as it does FP8: the nvfp4 answer sets the
    checkpoint's nvfp4 row against nvfp4 at 1.0 only, never an FP8 row or another cache dtype, and says which dtype."""
    def cache(kl, dtype="nvfp4", source="checkpoint"):
        return {**static(kl, source=source), "mode": "cache", "kv_dtype": dtype}

    nvfp4 = [0.030, 0.034, 0.029, 0.032]
    at_one = [0.060, 0.070, 0.058, 0.066]
    results = {"tensor": static([0.001] * 4), "scale1": static(SCALE1, source="1.0"), "nvfp4": cache(nvfp4),
               "nvfp4_4over6": cache([0.0001] * 4, dtype="nvfp4_4over6"), "nvfp4_scale1": cache(at_one, source="1.0"),
               "int8_per_token_head": {**cache([0.0001] * 4, dtype="int8_per_token_head"), "source": "computed"}}
    answer = scale1_answer(results, "nvfp4")
    mean, se = paired(nvfp4, at_one)
    assert answer["calibrated"] == "nvfp4" and answer["kv_cache_dtype"] == "nvfp4" and answer["outcome"] == BETTER
    assert answer["difference"] == pytest.approx(mean) and answer["stderr"] == pytest.approx(se)
    assert answer["text"].startswith("Is scale 1.0 enough for nvfp4? No: nvfp4 lowers the KL by")
    assert scale1_answer(results)["calibrated"] == "tensor"  # FP8's answer is untouched by the nvfp4 rows
    assert scale1_answer({"nvfp4": cache(nvfp4), "scale1": static(SCALE1, source="1.0")}, "nvfp4") is None
