""""Is scale 1.0 enough, or must I calibrate?": the calibrated scales against scale 1.0, paired by sequence, for
an FP8 cache and for nvfp4.

vLLM serves an FP8 cache at scale 1.0 when a checkpoint has no KV scales, and an nvfp4 cache at outer scale 1.0
(docs/vllm-notes.md, "NVFP4 caches"), so this is the question behind every calibration. The answer is one of
three, each with what to do: the calibrated scales are better (by how much, with the paired test,
``significance.significant``), equal within noise (with the difference this sample would have found 4 times in 5:
``significance.detectable``), or worse. Plain numbers in, a dict and a sentence out; nothing here runs a model.
"""

import math

from ..choices import scheme_label
from .significance import detectable
from .verdict import compare

SCALE1 = "scale1"
# The scale-1.0 scheme of each cache dtype asked about (choices.SCHEMES), keyed by its --kv-cache-dtype.
AT_ONE = {"fp8": SCALE1, "nvfp4": "nvfp4_scale1"}
BETTER, EQUAL, WORSE, UNTESTED = "better", "equal within noise", "worse", "not tested"


def _calibrated(results: dict[str, dict], dtype: str) -> str | None:
    """The calibrated scales of cache ``dtype`` to set against its scale 1.0: the scheme of that dtype with stored
    scales other than 1.0 (the checkpoint's, an observer's, a scales file) that measured the lowest finite KL and that
    vLLM serves as measured, measured as scale 1.0 was (both in the engine, or both by the emulation: a paired test
    needs the same baseline)."""
    one = AT_ONE[dtype]
    by = results[one].get("measured_by") if one in results else None
    candidates = {n: r for n, r in results.items() if n != one and r["mode"] in ("static", "cache")
                  and r.get("kv_dtype", "fp8") == dtype
                  and not str(r.get("source", "")).startswith("1.0") and math.isfinite(r["kl"])
                  and r.get("servable", True) and not r.get("target_refusal") and r.get("measured_by") == by}
    return min(candidates, key=lambda n: candidates[n]["kl"]) if candidates else None


def scale1_answer(results: dict[str, dict], dtype: str = "fp8") -> dict | None:
    """The answer for cache ``dtype`` (a key of AT_ONE), for report.json: which calibrated scheme, both KLs, the
    paired difference (calibrated − scale 1.0, nats/token) with its standard error, the detectable difference
    (``significance.detectable``: found with 80% power by the two-sided 5% t test), the outcome and what to do.
    None when verify did not measure that dtype's scale 1.0 and calibrated scales side by side."""
    one = results.get(AT_ONE[dtype])
    name = _calibrated(results, dtype)
    if one is None or name is None or not math.isfinite(one["kl"]):
        return None
    mean, se, significant = compare(results[name], one)
    ka, k1 = results[name]["kl"], one["kl"]
    outcome = UNTESTED if se is None else (EQUAL if not significant else BETTER if mean < 0 else WORSE)
    n = len(one["kl_per_sequence"])
    answer = {"kv_cache_dtype": dtype, "calibrated": name, "calibrated_kl": ka, "scale1_kl": k1, "difference": mean,
              "stderr": se, "detectable": None if se is None else detectable(se, n), "sequences": n, "outcome": outcome}
    return {**answer, "text": _sentence(answer)}


def _sentence(a: dict) -> str:
    """The answer for a person, with what to do."""
    name, ka, k1, n = scheme_label(a["calibrated"]), a["calibrated_kl"], a["scale1_kl"], a["sequences"]
    dtype = a["kv_cache_dtype"]
    ask = "Is scale 1.0 enough?" if dtype == "fp8" else f"Is scale 1.0 enough for {dtype}?"
    figures = f"KL {ka:.4g} vs {k1:.4g} nats/token"
    if a["outcome"] == UNTESTED:
        return (f"{ask} Not tested: {name} vs scale 1.0, {figures}, on one sequence, which gives "
                "no standard error; verify with a larger --max-tokens to answer it.")
    paired = f"difference {a['difference']:+.3g} ± {a['stderr']:.2g} nats/token (standard error), paired over {n} sequences"
    change = abs(ka / k1 - 1) if k1 > 0 else 0.0
    if a["outcome"] == BETTER:
        return (f"{ask} No: {name} lowers the KL by {change:.0%} against scale 1.0 "
                f"({figures}; {paired}, significant). Serve the calibrated scales.")
    if a["outcome"] == WORSE:
        return (f"{ask} Yes, and better here: scale 1.0 is {change:.0%} below {name} "
                f"({figures}; {paired}, significant). Serve without KV scales (vLLM then uses 1.0), or try another "
                "observer (`kvcal export OUT --out NEW --observer mse`) and verify again.")
    return (f"{ask} On this sample, yes: {name} and scale 1.0 are equal within noise "
            f"({figures}; {paired}, t test at 5%); a difference of {a['detectable']:.2g} nats/token ({a['detectable'] / k1:.0%} "
            "of scale 1.0's KL) would have shown 4 times in 5. Either serves; the calibrated scales also guard against values beyond "
            f"{'FP8' if dtype == 'fp8' else dtype}'s range in other data, and a larger --max-tokens can detect a smaller difference.")
