"""Tests for calibrate/verification/report_md.py: report.md's sections, parsed back into numbers and checked against
the hand-built report of builders.py."""

import json

import pytest
from builders import REPORT_LAYERS, check_verdict_row, parse_percent, report_dict

from calibrate.choices import scheme_label
from calibrate.verification.report_md import verify_markdown


def markdown_table(md: str, first: str) -> list[list[str]]:
    """Rows (header first) of the Markdown table whose header starts with column ``first``."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first} |"))
    assert set(lines[start + 1]) <= set("|-")
    table = [lines[start]]
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        table.append(line)
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in table]


def test_verify_markdown_states_thresholds_and_each_schemes_verdict():
    rep = report_dict()
    md = verify_markdown(rep, {})
    assert md.startswith("# kvcal verify: `/models/out`\n")
    assert "pass when KL ≤ 0.02 nats/token and top-1 agreement ≥ 95%" in md
    assert "fail when KL > 0.1 or top-1 < 90%; warn in between." in md  # no needle: no needle clause
    assert "Static schemes quantize Q, K and V (FA3 on Hopper)" in md
    assert "(128 tokens) from data.jsonl" in md
    header, *rows = markdown_table(md, "scheme")
    assert header[0] == "scheme" and header[-2:] == ["verdict", "why"]
    assert [row[0] for row in rows] == [scheme_label(n) for n in rep["schemes"]]  # vLLM's names (choices.SCHEMES)
    for cells, name in zip(rows, rep["schemes"]):
        check_verdict_row(cells, name, rep["schemes"][name])
    for name, r in rep["schemes"].items():
        assert f"- **{scheme_label(name)}**: {r['note']}; scales: {r['source']}" in md
    assert "- **fp8, per head** skipped: no per-head scales" in md
    assert "```\nvllm serve /models/out --kv-cache-dtype fp8\n```" in md
    assert "- checkpoint note" in md and "kvcal statistics in the checkpoint: yes" in md
    assert json.loads(md.split("```json\n")[1].split("```")[0]) == rep["settings"]


def test_verify_markdown_per_layer_error_and_saturation_tables():
    rep = report_dict()
    md = verify_markdown(rep, {})
    quantized = [n for n, r in rep["schemes"].items() if r["mode"] != "reference"]

    header, *rows = markdown_table(md, "layer")
    assert header == ["layer", *map(scheme_label, quantized)]
    assert [int(row[0]) for row in rows] == REPORT_LAYERS
    for i, row in enumerate(rows):
        for name, cell in zip(quantized, row[1:]):
            assert float(cell) == pytest.approx(rep["schemes"][name]["layer_rel_error"][i], rel=1e-3)

    header, *rows = markdown_table(md, "scheme | kind")
    assert header == ["scheme", "kind", "saturated", "underflow"]
    assert [(row[0], row[1]) for row in rows] == [(scheme_label(n), k) for n in quantized for k in "kvq"]
    for (name, _), (_, kind, saturated, underflow) in zip(((n, k) for n in quantized for k in "kvq"), rows):
        f = rep["schemes"][name]["fractions"].get(kind)
        if f is None:
            assert saturated == underflow == "—"
            continue
        for cell, values in ((saturated, f["saturated"]), (underflow, f["underflow"])):
            mean, worst = (parse_percent(c) for c in cell.split(" / "))
            assert mean == pytest.approx(sum(values) / len(REPORT_LAYERS), abs=1e-6)
            assert worst == pytest.approx(max(values), abs=1e-6)


def test_skip_layers_section_lists_estimates_and_measured_gains():
    rep = report_dict()
    rep["skip_layers"] = {"scheme": "tensor", "kl": 0.01, "layers": REPORT_LAYERS, "estimate": [0.1, 0.5, 0.2], "skip": [REPORT_LAYERS[1]],
                          "share_limit": 2 * 0.01 / 3, "rank_correlation": None, "top_agrees": True,
                          "measured": [{"layer": REPORT_LAYERS[1], "row": 1, "estimate": 0.5, "kl_without": 0.004, "gain": 0.006, "gain_stderr": 0.001}]}
    md = verify_markdown(rep, {})
    header, *rows = markdown_table(md, "layer")
    assert header == ["layer", "estimate", "KL without it", "gain", "keep"]
    assert rows == [[str(REPORT_LAYERS[0]), "1.000e-01", "—", "—", ""], [str(REPORT_LAYERS[1]), "5.000e-01", "0.004", "+0.006 ± 0.001", "yes"],
                    [str(REPORT_LAYERS[2]), "2.000e-01", "—", "—", ""]]
    assert "significant gain above 0.00667" in md


def test_verify_markdown_without_plots_or_statistics_says_so():
    rep = report_dict(static=False, profile=False)
    md = verify_markdown(rep, {})
    assert "No K/V scales to plot: no static scheme with scales ran." in md
    assert "No position profile: the checkpoint has no kvcal statistics." in md
    assert "kvcal statistics in the checkpoint: no" in md
    assert "![" not in md


def test_verify_markdown_needle_section():
    rep = report_dict(needle=True)
    md = verify_markdown(rep, {})
    assert "or when a needle the reference found is lost" in md
    header, row = markdown_table(md, "length")
    names = list(rep["schemes"])
    assert header == ["length", "depth", "code", *map(scheme_label, names)]
    case = rep["needle"]["cases"][0]
    assert row[:3] == ["64", "0.5", "4711"]
    for name, cell in zip(names, row[3:]):
        logprob, mark = cell.split(" ")
        assert float(logprob) == pytest.approx(case["schemes"][name]["logprob"])
        assert mark == ("✓" if case["schemes"][name]["greedy"] else "✗")
    for name, s in rep["needle"]["summary"].items():
        assert f"- {scheme_label(name)}: found {s['found']}/1, lost {s['lost']} the reference found" in md
