"""verification/drift.py (decode drift), against independent computations: transformers' own ``generate``, a full
prefill of the same tokens, a decode re-run from scratch, numpy's median, and prompts found by hand."""

import json
import re

import numpy as np
import pytest
import torch
from builders import check_verdict_row, report_dict
from runners import QUIET
from safetensors.torch import save_file

from calibrate.capture.hooks import hooked_attention, prefill_chunks
from calibrate.fp8 import FORMATS
from calibrate.model.layers import attention_layers
from calibrate.model.load import load_model
from calibrate.verification import drift
from calibrate.verification.config import NEAR_TIE_NATS, VerifyConfig
from calibrate.verification.passes import ApplyScheme, token_kl
from calibrate.verification.report import verify_text
from calibrate.verification.report_md import verify_markdown
from calibrate.verification.run import verify
from calibrate.verification.schemes import Mode, Scheme
from calibrate.verification.verdict_table import drift_cell

E4M3 = FORMATS["e4m3fn"]
STEPS = 12
# KL(decode ‖ prefill) of one position, the same tokens and scheme, on SmolLM2-135M in float32 on CPU, 12 positions.
# Unquantized (the identity hook): at most 2.7e-10 nats measured, float32 summation order alone. With FP8 K/V/Q at
# scale 0.05: at most 1.05e-2 measured, as large as between a chunked (7 tokens) and a one-shot prefill of the same
# tokens (6.0e-3): FP8 rounding turns summation-order differences deep in the model into flipped codes. The bounds
# leave room for other CPUs' orders.
DECODE_PREFILL_KL_BOUND = {"identity": 1e-8, "fp8": 5e-2}


@pytest.fixture(scope="module")
def smol(smol_dir):
    """SmolLM2-135M in float32 on CPU, its attention layers, and a KJV prompt of 32 tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    model, _ = load_model(smol_dir, device=torch.device("cpu"), dtype=torch.float32, tokenizer=tokenizer)
    prompt = tokenizer("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
                       "and darkness was upon the face of the deep.", return_tensors="pt").input_ids[0, :32]
    return model, attention_layers(model), prompt


def static(layers, model, value: float, name: str = "static") -> Scheme:
    """A per-tensor scheme with every K, V and Q scale ``value``."""
    cfg = model.config
    heads = {"k": cfg.num_key_value_heads, "v": cfg.num_key_value_heads, "q": cfg.num_attention_heads}
    return Scheme(name, Mode.STATIC, "test", E4M3, "tensor", {k: torch.full((len(layers), h), value) for k, h in heads.items()}, True)


def hook(scheme: Scheme, layers) -> ApplyScheme:
    return ApplyScheme(scheme, {layer.layer_idx: row for row, layer in enumerate(layers)})


# ---- the decode against transformers' own generate and a prefill --------------------------------------------------


def test_identity_hooks_give_the_continuation_of_plain_generate(smol):
    model, layers, prompt = smol
    plain = model.generate(prompt[None], max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)[0, len(prompt):].tolist()
    reference = drift.reference_continuation(model, prompt, STEPS)
    identity = Scheme("bf16", Mode.REFERENCE, "none", E4M3)  # quantizes nothing: the hook only passes K and V through
    free, forced, ties = drift.scheme_continuation(model, prompt, reference, hook(identity, layers))
    assert reference.tokens == plain and free.tokens == plain
    assert ties == 0 and drift.decode_kl(reference, forced) == 0.0
    assert drift.compare(reference.tokens, reference.margins(), free.tokens) == drift.PromptDrift(None, None, 1.0)


def test_absurd_scales_diverge_within_the_first_tokens(smol, tmp_path):
    model, layers, prompt = smol
    reference = drift.reference_continuation(model, prompt, STEPS)
    free, forced, _ = drift.scheme_continuation(model, prompt, reference, hook(static(layers, model, 1e-4), layers))
    result = drift.compare(reference.tokens, reference.margins(), free.tokens)
    assert result.first_divergence is not None and result.first_divergence <= 2
    assert result.agreement < 0.5
    assert drift.decode_kl(reference, forced) > 1.0  # nats: the cache holds ±0.045 at most, attention is noise


@pytest.mark.parametrize("kind", ["identity", "fp8"])
def test_decode_token_by_token_matches_a_prefill_of_the_same_tokens(smol, kind):
    """The scheme's cache written one token at a time (decode) and all at once (prefill) over the same tokens: the same
    greedy tokens, and per-position KL under DECODE_PREFILL_KL_BOUND."""
    model, layers, prompt = smol
    scheme = static(layers, model, 0.05) if kind == "fp8" else Scheme("bf16", Mode.REFERENCE, "none", E4M3)
    reference = drift.reference_continuation(model, prompt, STEPS)
    free, forced, _ = drift.scheme_continuation(model, prompt, reference, hook(scheme, layers))
    ids = torch.cat([prompt, torch.tensor(reference.tokens[:-1])])[None]  # [1, P + N - 1]: the teacher-forced inputs
    prefill = next(prefill_chunks(model, ids, ids.shape[1], hook=hook(scheme, layers), keep_from=len(prompt) - 1))  # [N, V]
    assert prefill.argmax(-1).tolist() == forced.logits.argmax(-1).tolist()
    kl = token_kl(forced.logits, torch.softmax(forced.logits, -1), prefill)  # [N]
    assert kl.max().item() < DECODE_PREFILL_KL_BOUND[kind]


def test_the_teacher_forced_branch_equals_a_decode_fed_the_reference_tokens(smol):
    """After the first divergence the cache is copied; the copy fed the reference's tokens must give what a decode
    fed them from the start gives."""
    model, layers, prompt = smol
    scheme = static(layers, model, 0.01)
    reference = drift.reference_continuation(model, prompt, STEPS)
    free, forced, _ = drift.scheme_continuation(model, prompt, reference, hook(scheme, layers))
    assert free.tokens != reference.tokens  # the copy was made
    logits = []
    with hooked_attention(model, hook(scheme, layers)):
        decoder = drift._Decoder(model, prompt)
        for t in range(STEPS):
            logits.append(decoder.logits)
            decoder.step(torch.tensor([reference.tokens[t]]))
    torch.testing.assert_close(forced.logits, torch.stack(logits), rtol=0, atol=0)


# ---- compare and summarize: by hand ---------------------------------------------------------------------------------


CLEAR, TIE = 1.0, NEAR_TIE_NATS / 2


@pytest.mark.parametrize(
    "tokens, margins, expected",
    [
        ([1, 2, 3, 4], [CLEAR] * 4, drift.PromptDrift(None, None, 1.0)),
        ([1, 2, 9, 4], [CLEAR] * 4, drift.PromptDrift(2, None, 0.75)),
        ([9, 9, 9, 9], [CLEAR] * 4, drift.PromptDrift(0, None, 0.0)),
        ([1, 9, 3, 9], [CLEAR, TIE, CLEAR, CLEAR], drift.PromptDrift(None, 1, 0.5)),  # parted at a near-tie: stops there
        ([1, 2, 3, 9], [TIE, TIE, TIE, CLEAR], drift.PromptDrift(3, None, 0.75)),
    ],
    ids=["identical", "clear divergence", "from the start", "parted at a near-tie", "ties before a clear one"],
)
def test_compare(tokens, margins, expected):
    assert drift.compare([1, 2, 3, 4], margins, tokens) == expected


def test_compare_refuses_continuations_of_other_lengths():
    with pytest.raises(ValueError, match="3 tokens cannot be compared with the reference's 4"):
        drift.compare([1, 2, 3, 4], [CLEAR] * 4, [1, 2, 3])


def test_summarize_counts_no_divergence_as_the_whole_continuation():
    found = [drift.PromptDrift(3, None, 0.5), drift.PromptDrift(None, None, 1.0), drift.PromptDrift(7, None, 0.25),
             drift.PromptDrift(None, 5, 0.75)]
    s = drift.summarize(found, [0.1, 0.2, 0.3, 0.4], steps=16, ties_followed=2)
    assert s["first_divergence_median"] == np.median([3, 16, 7, 16]) and s["first_divergence_min"] == 3
    assert s["identical"] == 0.25 and s["parted_at_near_tie"] == 1 and s["near_ties_followed"] == 2
    assert s["agreement"] == pytest.approx(np.mean([0.5, 1.0, 0.25, 0.75]))
    assert s["decode_kl"] == pytest.approx(0.25) and s["decode_kl_stderr"] == pytest.approx(np.std([0.1, 0.2, 0.3, 0.4], ddof=1) / 2)


def test_engine_drift_compares_free_running_tokens_by_the_references_margins():
    """An engine cannot be steered through a near-tie: the comparison stops where its tokens part there."""
    reference = [{"tokens": [1, 2, 3, 4], "margins": [CLEAR] * 4}, {"tokens": [5, 6, 7, 8], "margins": [CLEAR, TIE, CLEAR, CLEAR]}]
    run = [{"tokens": [1, 2, 9, 9], "margins": [CLEAR] * 4}, {"tokens": [5, 0, 0, 0], "margins": [CLEAR] * 4}]
    s = drift.engine_drift(reference, run, steps=4)
    assert s["first_divergence"] == [2, None] and s["parted_at_near_tie"] == 1 and s["identical"] == 0
    assert s["first_divergence_median"] == np.median([2, 4]) and s["first_divergence_min"] == 2
    assert s["agreement"] == pytest.approx(np.mean([0.5, 0.25])) and "decode_kl" not in s
    assert drift.engine_drift(reference, reference, steps=4)["identical"] == 1.0
    assert drift_cell(s) == f"3 (min 2), 1 parted at a near-tie · {np.mean([0.5, 0.25]):.0%}"


# ---- prompts ----------------------------------------------------------------------------------------------------------


EOS = 0


def test_prompts_start_at_record_boundaries_taking_sequences_in_turn():
    a = torch.tensor([5, 6, EOS, 7, 8, 9, EOS, 1, 2, 3, 4, 5])
    b = torch.tensor([3, 3, 3, 3, EOS, 4, 4, 4, 4, 4, 4, 4])
    prompts, where = drift.prompts_from([a, b], EOS, 3, 4)
    assert [p.tolist() for p in prompts] == [[EOS, 7, 8, 9], [EOS, 4, 4, 4], [EOS, 1, 2, 3]]
    assert "EOS" in where


def test_prompts_need_room_after_the_boundary_and_fall_back_to_sequence_starts():
    late = torch.tensor([1, 2, 3, 4, 5, 6, EOS, 8])  # no 4 tokens after its only EOS
    prompts, where = drift.prompts_from([late], EOS, 2, 4)
    assert [p.tolist() for p in prompts] == [[1, 2, 3, 4]] and "start of a sample sequence" in where
    with pytest.raises(ValueError, match="no 9 tokens to take a prompt from: lower --prompt-len"):
        drift.prompts_from([late], EOS, 2, 9)


@pytest.mark.parametrize(
    "options, match",
    [({"generate": -1}, "--generate must be an integer ≥ 0"), ({"prompts": 0}, "--prompts must be a positive integer"),
     ({"prompt_len": 64, "seq_len": 64}, "--prompt-len 64 must be shorter than --seq-len 64"),
     ({"prompt_len": "8"}, "--prompt-len must be a positive integer"),
     ({"engine": "vllm", "backend": "cpu", "seq_len": 128, "prompt_len": 64, "generate": 100, "max_model_len": 129},
      "--engine decodes --generate 100 tokens after prompts of 64: raise --max-model-len 129 to at least 164")],
)
def test_drift_options_are_checked(options, match, tmp_path, tiny_dir, text_file):
    with pytest.raises(ValueError, match=re.escape(match)):
        VerifyConfig.from_options(tiny_dir, str(text_file), **options).validate()


def test_the_default_prompt_is_at_most_half_a_sequence(tiny_dir, text_file):
    assert VerifyConfig.from_options(tiny_dir, str(text_file), seq_len=48).validate().prompt_len == 24
    assert VerifyConfig.from_options(tiny_dir, str(text_file), seq_len=4096).validate().prompt_len == 64


# ---- through verify, and in the report --------------------------------------------------------------------------------


def test_verify_reports_drift_per_scheme(tiny_dir, text_file, tmp_path):
    absurd = tmp_path / "absurd.safetensors"
    save_file({f"model.layers.{i}.self_attn.{k}": torch.full((1,), 1e-4) for i in range(3) for k in ("k_scale", "v_scale", "q_scale")},
              str(absurd))
    verify(tiny_dir, str(text_file), schemes=f"bf16,token,{absurd}", seq_len=128, max_tokens=256, generate=6, prompts=3,
           probe_layers=0, report_dir=str(tmp_path / "report"), **QUIET)
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    assert rep["drift"]["prompts"] == 3 and rep["drift"]["steps"] == 6
    assert rep["schemes"]["bf16"]["drift"] is None  # the reference is not compared with itself
    for name in ("token", "absurd", "floor"):
        d = rep["schemes"][name]["drift"] if name != "floor" else rep["floor"]["drift"]
        assert d["prompts"] == 3 and len(d["decode_kl_per_prompt"]) == 3 and d["decode_kl"] >= 0
    assert rep["schemes"]["absurd"]["drift"]["decode_kl"] > rep["schemes"]["token"]["drift"]["decode_kl"]
    assert rep["timings"]["drift_s"] > 0
    assert "## Decode drift" in (tmp_path / "report" / "report.md").read_text()
    assert verify(tiny_dir, str(text_file), schemes="token", seq_len=128, max_tokens=128, generate=0, probe_layers=0,
                  **QUIET).report["drift"] is None


def test_the_drift_column_and_section():
    rep = report_dict()
    rep["drift"] = {"steps": 16, "prompts": 3, "prompts_asked": 4, "prompt_len": 32, "prompt_source": "records", "near_tie_nats": 0.1}
    found = {"tensor": [None, None, None], "token": [2, None, 9]}
    for name, first in found.items():
        drifts = [drift.PromptDrift(f, None, 1.0 if f is None else f / 16) for f in first]
        rep["schemes"][name]["drift"] = drift.summarize(drifts, [0.01, 0.02, 0.03], steps=16)
    rows = [re.split(r"\s{2,}", line) for line in verify_text(rep, verbose=True).splitlines()[2:2 + len(rep["schemes"])]]
    for cells, name in zip(rows, rep["schemes"]):
        check_verdict_row(cells, name, rep["schemes"][name])
    assert drift_cell(rep["schemes"]["tensor"]["drift"]) == "none in 16 · 100%"
    assert drift_cell(rep["schemes"]["token"]["drift"]) == f"9 (min 2) · {(2 / 16 + 1 + 9 / 16) / 3:.0%}"
    md = verify_markdown(rep, {})
    section = md.split("## Decode drift", 1)[1].split("\n## ", 1)[0]
    assert "Only 3 of the 4 prompts" in section and "| fp8_per_token_head | 2, —, 9 | 9 | 2 | 33% |" in section
