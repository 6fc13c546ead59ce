"""verification/judgment.py: the engine's figures judged in a new value, the emulation's judgment left as it was."""

import copy

from calibrate.thresholds import Thresholds
from calibrate.verification.judgment import Judged, judge_engine
from calibrate.verification.verdict import RUN_FAILED

LIMITS = Thresholds(max_kl=0.05, fail_kl=1.0, min_top1=0.0, fail_top1=0.0).resolve(None, 1000)


def emulated(kl: float) -> dict:
    return {"mode": "static", "kl": kl, "kl_stderr": 0.001, "kl_per_sequence": [kl, kl], "top1": 0.99,
            "ppl_change": 0.01, "verdict": "pass", "reasons": ["emulated reason"], "tails": None, "needle_lost": None}


def engine_row(kl: float, **extra) -> dict:
    return {"kl": kl, "kl_stderr": 0.002, "kl_per_sequence": [kl, kl], "top1": 0.98, "ppl_change": 0.02,
            "as_named": True, "within_tolerance": True, "emulated_kl": 0.01, "ratio": kl / 0.01, "tolerance_kl": 0.005,
            "stored": {"reasons": []}, **extra}


def test_the_engines_figures_take_the_emulations_place_in_a_new_judged_and_the_old_one_is_untouched():
    before = Judged({"bf16": {"mode": "reference", "kl": 0.0, "reasons": []}, "tensor": emulated(0.01),
                     "scale1": emulated(0.02), "head": emulated(0.03)}, None, LIMITS, {}, {})
    kept = copy.deepcopy(before.results)
    engine = {"vllm_version": "X", "attention_backend": "CPU_ATTN", "ranking_flips": [("tensor", "scale1")],
              "schemes": {"tensor": engine_row(2.0, within_tolerance=False),  # fails on the engine's figures
                          "scale1": {"why": "the engine's run failed: killed", "failed": True},
                          "head": {"why": "not offered"}}}
    after = judge_engine(before, engine, LIMITS)
    assert before.results == kept  # the emulation's judgment is as it was
    tensor = after.results["tensor"]
    assert tensor["kl"] == 2.0 and tensor["verdict"] == "fail" and tensor["measured_by"] == "vLLM X engine (CPU_ATTN)"
    assert tensor["emulated"]["kl"] == 0.01 and tensor["emulated"]["verdict"] == "pass"
    assert any("outside the measured tolerance" in r for r in tensor["reasons"])
    assert "the engine ranks this scheme differently from the emulation" in tensor["reasons"]
    assert after.results["scale1"]["verdict"] == RUN_FAILED and after.results["scale1"]["emulated"] == {"verdict": "pass"}
    assert after.results["head"]["reasons"] == ["emulated reason", "not measured in the engine: not offered"]
    assert after.results["bf16"] is before.results["bf16"]  # a scheme the engine did not run is the same value
    # judged twice from the same emulation, the engine's reasons are said once
    assert judge_engine(before, engine, LIMITS).results["head"]["reasons"] == after.results["head"]["reasons"]
