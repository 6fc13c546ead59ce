"""scripts/gpu_check --tiny: the GPU check's own code, on CPU at toy size, writes every figure with a sane value.

The full run needs a GPU (and a few minutes of one); this keeps it runnable for the first GPU lent:
it imports, builds its model, measures, and its JSON has the fields the report is read for.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[dict, str]:
    """(the JSON, stdout) of one --tiny run, started outside the checkout: the script must find ``calibrate`` itself."""
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", str(out)], capture_output=True, text=True, cwd=out, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), done.stdout


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_tiny_run_is_complete_and_imports_no_optional_packages(tiny_run):
    report, stdout = tiny_run
    assert report["tiny"] is True and report["complete"] is True
    assert report["skipped"] == [] and report["errors"] == []
    assert report["environment"]["imported"] == {"datasets": False, "compressed_tensors": False}
    assert report["environment"]["device"] == "cpu"
    assert _positive(report["elapsed_s"]) and report["elapsed_s"] < report["budget_s"]
    assert "complete in" in stdout.splitlines()[-1]


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
