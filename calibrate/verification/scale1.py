""""Is scale 1.0 enough, or must I calibrate?": the calibrated FP8 scales against scale 1.0, paired by sequence.

vLLM serves an FP8 cache at scale 1.0 when a checkpoint has no KV scales, so this is the question behind every
calibration. The answer is one of three, each with what to do: the calibrated scales are better (by how much, with
the paired test, ``significance.significant``), equal within noise (with the difference this sample would have
found 4 times in 5: ``significance.detectable``), or worse. Plain numbers in, a dict and a sentence out; nothing here runs a model.
"""

import math

from ..choices import scheme_label
from .significance import detectable
from .verdict import RUN_FAILED, compare

SCALE1 = "scale1"
BETTER, EQUAL, WORSE, UNTESTED = "better", "equal within noise", "worse", "not tested"


def _calibrated(results: dict[str, dict]) -> str | None:
    """The calibrated FP8 scales to set against scale 1.0: the static fp8 scheme with scales other than 1.0 (the
    checkpoint's, an observer's, a scales file) that measured the lowest finite KL and that vLLM serves as measured,
    measured as scale 1.0 was (both in the engine, or both by the emulation: a paired test needs the same baseline)."""
    by = results[SCALE1].get("measured_by") if SCALE1 in results else None
    candidates = {n: r for n, r in results.items() if n != SCALE1 and r["mode"] == "static" and r.get("kv_dtype", "fp8") == "fp8"
                  and not str(r.get("source", "")).startswith("1.0") and math.isfinite(r["kl"])
                  and r.get("servable", True) and not r.get("target_refusal") and r.get("measured_by") == by
                  and r.get("verdict") != RUN_FAILED}
    return min(candidates, key=lambda n: candidates[n]["kl"]) if candidates else None


def scale1_answer(results: dict[str, dict]) -> dict | None:
    """The answer, for report.json: which calibrated scheme, both KLs, the paired difference (calibrated − scale 1.0,
    nats/token) with its standard error, the detectable difference (``significance.detectable``: found with 80% power
    by the two-sided 5% t test), the outcome and what to do.
    None when verify did not measure scale 1.0 and calibrated FP8 scales side by side (an engine run that failed
    measured nothing)."""
    one = results.get(SCALE1)
    name = _calibrated(results)
    if one is None or name is None or not math.isfinite(one["kl"]) or one.get("verdict") == RUN_FAILED:
        return None
    mean, se, significant = compare(results[name], one)
    ka, k1 = results[name]["kl"], one["kl"]
    outcome = UNTESTED if se is None else (EQUAL if not significant else BETTER if mean < 0 else WORSE)
    n = len(one["kl_per_sequence"])
    answer = {"calibrated": name, "calibrated_kl": ka, "scale1_kl": k1, "difference": mean, "stderr": se,
              "detectable": None if se is None else detectable(se, n), "sequences": n, "outcome": outcome}
    return {**answer, "text": _sentence(answer)}


def _sentence(a: dict) -> str:
    """The answer for a person, with what to do."""
    name, ka, k1, n = scheme_label(a["calibrated"]), a["calibrated_kl"], a["scale1_kl"], a["sequences"]
    figures = f"KL {ka:.4g} vs {k1:.4g} nats/token"
    if a["outcome"] == UNTESTED:
        return (f"Is scale 1.0 enough? Not tested: {name} vs scale 1.0, {figures}, on one sequence, which gives "
                "no standard error; verify with a larger --max-tokens to answer it.")
    paired = f"difference {a['difference']:+.3g} ± {a['stderr']:.2g} nats/token (standard error), paired over {n} sequences"
    change = abs(ka / k1 - 1) if k1 > 0 else 0.0
    if a["outcome"] == BETTER:
        return (f"Is scale 1.0 enough? No: {name} lowers the KL by {change:.0%} against scale 1.0 "
                f"({figures}; {paired}, significant). Serve the calibrated scales.")
    if a["outcome"] == WORSE:
        return (f"Is scale 1.0 enough? Yes, and better here: scale 1.0 is {change:.0%} below {name} "
                f"({figures}; {paired}, significant). Serve without KV scales (vLLM then uses 1.0), or try another "
                "observer (`kvcal export OUT --out NEW --observer mse`) and verify again.")
    return (f"Is scale 1.0 enough? On this sample, yes: {name} and scale 1.0 are equal within noise "
            f"({figures}; {paired}, t test at 5%); a difference of {a['detectable']:.2g} nats/token ({a['detectable'] / k1:.0%} "
            "of scale 1.0's KL) would have shown 4 times in 5. Either serves; the calibrated scales also guard against values beyond "
            "FP8's range in other data, and a larger --max-tokens can detect a smaller difference.")
