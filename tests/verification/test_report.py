"""Tests for calibrate/verification/report.py: the per-layer scale table, and verify's report as text,
Markdown, JSON and plots.

The report dict is built here by hand with numbers chosen so that every printed value can be checked against
the test's own arithmetic (worst layer = max of a list, mean over layers, scale = absmax / 448); printed tables
are parsed back into numbers rather than compared with text copied from a run.
"""

import json
import re

import pytest
import torch

import calibrate.verification.report
from calibrate.capture.stats import NUM_POS_BUCKETS, position_bucket_starts
from calibrate.choices import scheme_label
from calibrate.verification.report import (
    kvcal_version,
    scale_table,
    thresholds_text,
    verify_markdown,
    verify_text,
    write_verify_report,
)

E4M3_MAX = 448.0

def test_kvcal_version(monkeypatch):
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("kvcal")
    except PackageNotFoundError:
        installed = "unknown (not installed)"
    assert kvcal_version() == installed

    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(calibrate.verification.report, "version", missing)
    assert kvcal_version() == "unknown (not installed)"


# ---------------------------------------------------------------------------------------------------------------
# The scale table


def parse_table(text: str) -> tuple[str, list[list[float]]]:
    """Header line, and each row after the rule as numbers."""
    header, rule, *rows = text.splitlines()
    assert set(rule) == {"-"} and len(rule) == len(header)
    return header, [[float(cell) for cell in row.split()] for row in rows]


ABSMAX = {  # [L, H] per head
    "k": [[0.5, 2.0], [3.0, 1.0], [0.0, 0.25]],
    "v": [[7.5, 0.125], [1e-3, 2e-3], [100.0, 99.0]],
    "q": [[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0], [0.5, 0.5, 0.5, 0.5]],
}
SATURATED = {"k": [[0.0, 1e-3], [0.02, 0.0], [0.0, 0.0]], "v": [[0.0, 0.0], [0.5, 0.25], [0.0, 1e-5]], "q": [[0.0] * 4] * 3}


@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
@pytest.mark.parametrize("kinds", [("k", "v", "q"), ("k", "v")], ids=["with-q", "kv-only"])
def test_scale_table_shows_each_layers_absmax_scale_and_saturation(per_head, kinds):
    layers = [0, 5, 7]
    absmax = {k: torch.tensor(v, dtype=torch.float64) for k, v in ABSMAX.items()}
    # Scales as the max observer makes them, computed here in float64: absmax / 448 (per head, or of the layer's max).
    scales = {k: (a if per_head else a.amax(1)) / E4M3_MAX for k, a in absmax.items() if k in kinds}
    saturated = {k: torch.tensor(v) if per_head else torch.tensor(v).amax(1) for k, v in SATURATED.items() if k in kinds}
    shown_absmax = {k: a if per_head else a.amax(1) for k, a in absmax.items()}

    header, rows = parse_table(scale_table(layers, {k: v.float() for k, v in shown_absmax.items()},
                                           {k: v.float() for k, v in scales.items()}, saturated))
    columns = ["layer"] + [c for k in kinds for c in (f"{k} absmax", f"{k}_scale", f"{k} sat%")]
    positions = [header.find(c) for c in columns]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), header
    assert ("q absmax" in header) == ("q" in kinds)
    for row, layer in zip(rows, layers):
        i = layers.index(layer)
        assert row[0] == layer and len(row) == 1 + 3 * len(kinds)
        for j, k in enumerate(kinds):
            top = max(ABSMAX[k][i])
            got_absmax, got_scale, got_sat = row[1 + 3 * j: 4 + 3 * j]
            assert got_absmax == pytest.approx(top, rel=1e-3, abs=1e-12)
            assert got_scale == pytest.approx(top / E4M3_MAX, rel=1e-3, abs=1e-12)
            assert got_sat == pytest.approx(100 * max(SATURATED[k][i]), abs=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# verify's report

LAYERS = [0, 1, 2]
THRESHOLDS = {"max_kl": 0.02, "fail_kl": 0.1, "min_top1": 0.95, "fail_top1": 0.9}


def scheme(mode: str, kl: float, se: float | None, ppl_change: float, top1: float, fractions: dict, verdict: str,
           reasons: list[str], errors: list[float], scales: dict | None = None) -> dict:
    return {"mode": mode, "granularity": None, "source": f"{mode} source", "note": f"{mode} note", "kl": kl, "kl_stderr": se,
            "ppl_change": ppl_change, "top1": top1, "fractions": fractions, "verdict": verdict, "reasons": reasons,
            "layer_rel_error": errors, "scales": scales or {},
            # SmolLM2's shape (30 layers, 3 KV heads of 64): bf16 for the reference, else fp8 or per-token-head
            "bytes_per_token": 30 * 3 * {"reference": 256, "token": 136}.get(mode, 128),
            "bytes_vs_bf16": {"reference": 1.0, "token": 136 / 256}.get(mode, 0.5)}


def fractions(kinds: str, saturated: list[float], underflow: list[float]) -> dict:
    return {k: {"saturated": [s * (i + 1) for s in saturated], "underflow": [u * (i + 1) for u in underflow]} for i, k in enumerate(kinds)}


def report_dict(*, static: bool = True, profile: bool = True, needle: bool = False) -> dict:
    """A verify report with the keys report.py reads; verdicts agree with THRESHOLDS (KL and top-1 below)."""
    L = len(LAYERS)
    schemes = {"bf16": scheme("reference", 0.0, None, 0.0, 1.0, {}, "reference", [], [0.0] * L)}
    if static:
        schemes["tensor"] = scheme("static", 0.005, 0.001, 0.0042, 0.985, fractions("kvq", [0.0, 1e-4, 3e-4], [0.01, 0.02, 0.03]),
                                   "pass", [], [1.5e-3, 2.5e-3, 3.5e-3],
                                   {"k": [[0.01, 0.02]] * L, "v": [[0.03, 0.04]] * L, "q": [[0.1] * 4] * L})
        schemes["scale1"] = scheme("static", 0.05, 0.01, 0.031, 0.93, fractions("kvq", [0.0, 0.0, 0.0], [0.5, 0.6, 0.7]),
                                   "warn", ["KL 0.05 > 0.02 nats/token", "top-1 93.00% < 95%"], [0.2, 0.3, 0.4],
                                   {"k": [[1.0, 1.0]] * L, "v": [[1.0, 1.0]] * L, "q": [[1.0] * 4] * L})
    schemes["token"] = scheme("token", 0.3, None, -0.015, 0.8, fractions("kv", [0.0, 0.0, 0.0], [2e-3, 0.0, 1e-3]),
                              "fail", ["KL 0.3 > 0.1 nats/token"], [5e-4, 6e-4, 7e-4])
    rep = {
        "kvcal_version": "test",
        "checkpoint": "/models/out",
        "reference": {"name": "bf16", "dtype": "float32", "device": "cpu", "note": "n"},
        "fp8_format": "e4m3fn",
        "backend": "cpu",
        "settings": {**THRESHOLDS, "kv_only": False, "seq_len": 64},
        "data": [{"source": "data.jsonl"}],
        "sample": {"sequences": 2, "seq_len": 64, "tokens": 128},
        "layers": [{"layer_idx": i, "prefix": f"model.layers.{i}.self_attn", "sliding_window": False} for i in LAYERS],
        "checkpoint_scales": {"granularity": "tensor", "notes": ["checkpoint note"], "statistics": profile},
        "floor": None,
        "thresholds": {**THRESHOLDS, "origin": {name: "set" for name in THRESHOLDS}, "floor_pass": 10.0, "floor_fail": 100.0,
                       "relative_to_floor": False},
        "schemes": schemes,
        "skip_layers": None,
        "does_it_pay": None,
        "skipped": {"head": "no per-head scales"},
        "fa3": None,
        "needle": None,
        "recommendation": ["serve with tensor scales", "second line"],
        "serve_command": "vllm serve /models/out --kv-cache-dtype fp8",
        "position_profile": None,
        "timings": {"total_s": 12.0, "reference_pass_s": 3.0, "scheme_pass_s": {n: 1.0 for n in schemes}},
    }
    if profile:
        P = NUM_POS_BUCKETS
        used = 8  # positions 0..63: buckets 0-3 (sinks) and 4..7, [8, 16), [16, 32), [32, 64)
        rep["position_profile"] = {
            "bucket_starts": position_bucket_starts(),
            "tokens": [[2 if b < 4 else 2 ** (b - 1) if b < used else 0 for b in range(P)] for _ in LAYERS],
            **{k: [[(b + 1) * 0.5 if b < used else 0.0 for b in range(P)] for _ in LAYERS] for k in "kvq"},
        }
    if needle:
        names = list(schemes)
        rep["needle"] = {
            "needle": "The secret code is {code}.", "question": "What is the code?",
            "cases": [{"length": 64, "depth": 0.5, "code": "4711", "schemes": {n: {"logprob": -0.5 * i, "greedy": i < 2} for i, n in enumerate(names)}}],
            "summary": {n: {"found": int(i < 2), "lost": int(i >= 2), "mean_logprob_change": -0.5 * i} for i, n in enumerate(names) if i},
        }
    return rep


def percent(cell: str) -> float | None:
    """A percentage cell as a fraction; None for the dash of an unquantized kind."""
    return None if cell == "—" else float(cell.rstrip("%")) / 100


def check_verdict_row(cells: list[str], name: str, r: dict, floor: float | None = None) -> None:
    """One row of the verdict table against the scheme's own numbers."""
    assert cells[0] == scheme_label(name)
    kl, _, se = cells[1].partition(" ± ")
    assert float(kl) == pytest.approx(r["kl"], rel=1e-3)
    assert (float(se) == pytest.approx(r["kl_stderr"], rel=0.05)) if r["kl_stderr"] is not None else se == ""
    assert cells[2] == ("—" if floor is None or r["mode"] == "reference" else f"{r['kl'] / floor:.3g}×")
    size, ratio = cells[3].split(" (")
    assert float(size.replace(",", "")) == r["bytes_per_token"] and ratio == f"{r['bytes_vs_bf16']:.2f}×)"
    assert cells[4][0] in "+-" and percent(cells[4]) == pytest.approx(r["ppl_change"], abs=1e-5)
    assert percent(cells[5]) == pytest.approx(r["top1"], abs=1e-4)
    check_drift_cell(cells[6], r.get("drift"))
    worst = [percent(c) for c in cells[7].split(" / ")]
    for kind, got in zip("kvq", worst):
        f = r["fractions"].get(kind)
        assert got is None if not f else got == pytest.approx(max(f["saturated"]), abs=1e-5), (name, kind)
    assert cells[8] == r["verdict"]
    assert (cells[9] if len(cells) > 9 else "") == "; ".join(r["reasons"])


def check_drift_cell(cell: str, d: dict | None) -> None:
    """The drift cell: the median and minimum first divergence over prompts, or none within the steps, then agreement."""
    if d is None:
        assert cell == "—"
        return
    first, agree = cell.split(" · ")
    assert percent(agree) == pytest.approx(d["agreement"], abs=0.005)
    first, _, ties = first.partition(", ")
    assert ties == (f"{d['parted_at_near_tie']} parted at a near-tie" if d.get("parted_at_near_tie") else "")
    if min(f if f is not None else d["steps"] for f in d["first_divergence"]) == d["steps"]:
        assert first == f"none in {d['steps']}"
    else:
        median, _, low = first.partition(" (min ")
        values = sorted(f if f is not None else d["steps"] for f in d["first_divergence"])
        assert float(median) == pytest.approx((values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2)
        assert int(low.rstrip(")")) == values[0]


def test_verify_text_has_a_row_per_scheme_with_its_numbers_and_verdict():
    rep = report_dict()
    lines = verify_text(rep).splitlines()
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
    assert rest[3:] == ["skipped head: no per-head scales",
                        "serving target: gpu, NVIDIA GPU, vLLM 0.32.0 (the default; --target rocm or cpu for the others)",
                        "serve with tensor scales", "second line", "serve it with:", "  vllm serve /models/out --kv-cache-dtype fp8"]


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


def test_skip_layers_section_lists_estimates_and_measured_gains():
    rep = report_dict()
    rep["skip_layers"] = {"scheme": "tensor", "kl": 0.01, "layers": LAYERS, "estimate": [0.1, 0.5, 0.2], "skip": [LAYERS[1]],
                          "share_limit": 2 * 0.01 / 3, "rank_correlation": None, "top_agrees": True,
                          "measured": [{"layer": LAYERS[1], "row": 1, "estimate": 0.5, "kl_without": 0.004, "gain": 0.006, "gain_stderr": 0.001}]}
    md = verify_markdown(rep, {})
    header, *rows = markdown_table(md, "layer")
    assert header == ["layer", "estimate", "KL without it", "gain", "keep"]
    assert rows == [[str(LAYERS[0]), "1.000e-01", "—", "—", ""], [str(LAYERS[1]), "5.000e-01", "0.004", "+0.006 ± 0.001", "yes"],
                    [str(LAYERS[2]), "2.000e-01", "—", "—", ""]]
    assert "significant gain above 0.00667" in md


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
    assert "- **fp8 (head)** skipped: no per-head scales" in md
    assert "```\nvllm serve /models/out --kv-cache-dtype fp8\n```" in md
    assert "- checkpoint note" in md and "kvcal statistics in the checkpoint: yes" in md
    assert json.loads(md.split("```json\n")[1].split("```")[0]) == rep["settings"]


def test_verify_markdown_per_layer_error_and_saturation_tables():
    rep = report_dict()
    md = verify_markdown(rep, {})
    quantized = [n for n, r in rep["schemes"].items() if r["mode"] != "reference"]

    header, *rows = markdown_table(md, "layer")
    assert header == ["layer", *quantized]
    assert [int(row[0]) for row in rows] == LAYERS
    for i, row in enumerate(rows):
        for name, cell in zip(quantized, row[1:]):
            assert float(cell) == pytest.approx(rep["schemes"][name]["layer_rel_error"][i], rel=1e-3)

    header, *rows = markdown_table(md, "scheme | kind")
    assert header == ["scheme", "kind", "saturated", "underflow"]
    assert [(row[0], row[1]) for row in rows] == [(n, k) for n in quantized for k in "kvq"]
    for name, kind, saturated, underflow in rows:
        f = rep["schemes"][name]["fractions"].get(kind)
        if f is None:
            assert saturated == underflow == "—"
            continue
        for cell, values in ((saturated, f["saturated"]), (underflow, f["underflow"])):
            mean, worst = (percent(c) for c in cell.split(" / "))
            assert mean == pytest.approx(sum(values) / len(LAYERS), abs=1e-6)
            assert worst == pytest.approx(max(values), abs=1e-6)


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
    assert header == ["length", "depth", "code", *names]
    case = rep["needle"]["cases"][0]
    assert row[:3] == ["64", "0.5", "4711"]
    for name, cell in zip(names, row[3:]):
        logprob, mark = cell.split(" ")
        assert float(logprob) == pytest.approx(case["schemes"][name]["logprob"])
        assert mark == ("✓" if case["schemes"][name]["greedy"] else "✗")
    for name, s in rep["needle"]["summary"].items():
        assert f"- {name}: found {s['found']}/1, lost {s['lost']} the reference found" in md


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
    assert "K/V scales of scheme tensor (static source):" in md  # the tensor scheme's, not scale 1.0's


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
