""""Is scale 1.0 enough, or must I calibrate?": the calibrated scales against scale 1.0, paired by sequence, for
an FP8 cache and for nvfp4.

vLLM serves an FP8 cache at scale 1.0 when a checkpoint has no KV scales, and an nvfp4 cache at outer scale 1.0
(docs/vllm-notes.md, "NVFP4 caches"), so this is the question behind every calibration. The answer is one of
five, each with what to do: the calibrated scales are better (the paired t test, ``significance.significant``),
scale 1.0 is better (the same test), the two are equivalent within ``EQUIVALENCE`` of the calibrated KL (two
one-sided tests, ``significance.equivalent``), the sample cannot tell (with the 95% upper bound of what scale 1.0
may cost, ``significance.mean_bounds``), or too few sequences to test at all. A test that finds no difference is
never read as "yes". Plain numbers in, a dict and a sentence out; nothing here runs a model.
"""

import math

from ..choices import scheme_label
from .significance import MIN_SEQUENCES, TOO_FEW, equivalent, mean_bounds
from .verdict import compare

SCALE1 = "scale1"
# The scale-1.0 scheme of each cache dtype asked about (choices.SCHEMES), keyed by its --kv-cache-dtype.
AT_ONE = {"fp8": SCALE1, "nvfp4": "nvfp4_scale1"}
BETTER, EQUAL, WORSE, UNDECIDED, UNTESTED = "better", "equivalent", "worse", "cannot tell", TOO_FEW
# Scale 1.0 is "enough" when what it costs over the calibrated scales is shown to lie within ± this share of the
# calibrated scales' KL: the KL calibrating achieves is what skipping it is measured against (scale 1.0's own KL would
# widen the margin exactly when scale 1.0 is bad). 10%: a choice, said in every answer; small against how much KL
# varies between sequences (several-fold), large enough that 16 closely measured sequences can show it.
EQUIVALENCE = 0.10


def _calibrated(results: dict[str, dict], dtype: str) -> str | None:
    """The calibrated scales of cache ``dtype`` to set against its scale 1.0: the scheme of that dtype with stored
    scales other than 1.0 (the checkpoint's, an observer's, a scales file) that measured the lowest finite KL and that
    vLLM serves as measured, measured as scale 1.0 was (both in the engine, or both by the emulation: a paired test
    needs the same baseline)."""
    at_one = AT_ONE[dtype]
    by = results[at_one].get("measured_by") if at_one in results else None
    candidates = {n: r for n, r in results.items() if n != at_one and r["mode"] in ("static", "cache")
                  and r.get("kv_dtype", "fp8") == dtype
                  and not str(r.get("source", "")).startswith("1.0") and math.isfinite(r["kl"])
                  and r.get("servable", True) and not r.get("target_refusal") and r.get("measured_by") == by}
    return min(candidates, key=lambda n: candidates[n]["kl"]) if candidates else None


def scale1_answer(results: dict[str, dict], dtype: str = "fp8") -> dict | None:
    """The answer for cache ``dtype`` (a key of AT_ONE), for report.json: which calibrated scheme, both KLs, the paired difference (calibrated − scale 1.0,
    nats/token) with its standard error, the equivalence margin (``EQUIVALENCE`` × the calibrated KL), the one-sided
    95% bounds of what scale 1.0 costs over the calibrated scales (``cost_low``, ``cost_high``; None under
    ``MIN_SEQUENCES``), whether the equivalence test's lower side passed (``cheaper_shown``: scale 1.0 is not more than
    the margin cheaper), the outcome and what to do. None when verify did not measure that dtype's scale 1.0 and
    calibrated scales side by side."""
    one = results.get(AT_ONE[dtype])
    name = _calibrated(results, dtype)
    if one is None or name is None or not math.isfinite(one["kl"]):
        return None
    mean, se, significant = compare(results[name], one)
    ka, k1 = results[name]["kl"], one["kl"]
    cal, ones = results[name]["kl_per_sequence"], one["kl_per_sequence"]
    n = len(ones)
    cost = [b - a for a, b in zip(cal, ones)]  # what scale 1.0 costs over the calibrated scales, per sequence
    within = [EQUIVALENCE * a for a in cal]  # the margin, per sequence: it moves with the sequence's KL
    bounds = mean_bounds(cost) if se is not None else None
    if bounds is None:
        outcome = UNTESTED
    elif significant:
        outcome = BETTER if mean < 0 else WORSE
    else:
        outcome = EQUAL if equivalent(cost, within) else UNDECIDED
    answer = {"kv_cache_dtype": dtype, "calibrated": name, "calibrated_kl": ka, "scale1_kl": k1, "difference": mean, "stderr": se, "sequences": n,
              "margin": EQUIVALENCE * ka, "cost_low": bounds and bounds[0], "cost_high": bounds and bounds[1],
              "cheaper_shown": bounds is not None and mean_bounds([c + w for c, w in zip(cost, within)])[0] > 0,
              "outcome": outcome}
    return {**answer, "text": _sentence(answer)}


def _sentence(a: dict) -> str:
    """The answer for a person, with what to do."""
    name, ka, k1, n = scheme_label(a["calibrated"]), a["calibrated_kl"], a["scale1_kl"], a["sequences"]
    dtype = a["kv_cache_dtype"]
    ask = "Is scale 1.0 enough?" if dtype == "fp8" else f"Is scale 1.0 enough for {dtype}?"
    figures = f"KL {ka:.4g} vs {k1:.4g} nats/token"
    if a["outcome"] == UNTESTED:
        return (f"{ask} {TOO_FEW.capitalize()}: {name} vs scale 1.0, {figures}, on {n} sequence"
                f"{'s' if n != 1 else ''}; the paired test needs at least {MIN_SEQUENCES}: verify with a larger "
                "--max-tokens to answer it.")
    paired = f"difference {a['difference']:+.3g} ± {a['stderr']:.2g} nats/token (standard error), paired over {n} sequences"
    change = abs(ka / k1 - 1) if k1 > 0 else 0.0
    if a["outcome"] == BETTER:
        return (f"{ask} No: {name} lowers the KL by {change:.0%} against scale 1.0 "
                f"({figures}; {paired}, significant). Serve the calibrated scales.")
    if a["outcome"] == WORSE:
        return (f"{ask} Yes, and better here: scale 1.0 is {change:.0%} below {name} "
                f"({figures}; {paired}, significant). Serve without KV scales (vLLM then uses 1.0), or try another "
                "observer (`kvcal export OUT --out NEW --observer mse`) and verify again.")
    low, high, within = a["cost_low"], a["cost_high"], a["margin"]
    if a["outcome"] == EQUAL:
        return (f"{ask} Yes, equivalent within {EQUIVALENCE:.0%}: two one-sided t tests at 5% show what "
                f"scale 1.0 costs over {name} to lie within ±{EQUIVALENCE:.0%} of its KL (±{within:.2g} nats/token); 95% "
                f"bounds of the cost {low:+.2g} to {high:+.2g} nats/token ({figures}; {paired}). Either serves; the "
                f"calibrated scales also guard against values beyond {'FP8' if dtype == 'fp8' else dtype}'s range in other data.")
    other_side = "" if a["cheaper_shown"] else f", or be more than {EQUIVALENCE:.0%} cheaper (95% lower bound {low:+.2g})"
    return (f"{ask} Cannot tell on this sample: scale 1.0 may cost up to {high:+.2g} nats/token more than "
            f"{name} ({f'{high / ka:+.0%} of its KL; ' if ka > 0 else ''}95% upper bound){other_side}, so equivalence "
            f"within {EQUIVALENCE:.0%} (±{within:.2g} nats/token) is not shown. {figures[0].upper()}{figures[1:]}; "
            f"{paired}. Serve the calibrated scales, or verify with a larger --max-tokens to narrow the bound.")
