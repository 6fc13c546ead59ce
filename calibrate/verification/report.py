"""verify's report as it leaves kvcal: the text the terminal shows, and the folder ``--report`` writes (report.json,
the plots, report.md)."""

import errno
import json
import os
import shutil
import textwrap
from collections.abc import Sequence
from pathlib import Path

from ..choices import scheme_label
from ..layout import sibling, swap_in, sweep
from ..vllm_facts import serving
from .capacity import plan_text
from .plots import plot_kl_by_depth, plot_layer_error, plot_position_profile, plot_scale_heatmap
from .report_md import verify_markdown
from .verdict import floor_of, short_evidence
from .verdict_table import (
    ENGINE_FAILURES,
    SHORT_COLUMNS,
    VERIFY_HEADER,
    depth_lines,
    disagreement_lines,
    drift_note,
    engine_brief,
    engine_lines,
    held_out_text,
    measured_schemes,
    other_target_lines,
    other_targets,
    serve_run_lines,
    target_text,
    thresholds_text,
    verify_rows,
)


def verify_text(rep: dict, report_md: Path | None = None, *, verbose: bool = False, risks: Sequence[str] = ()) -> str:
    """What the terminal shows: the verdict table, then the answer (``answer_lines``: the serve command last);
    ``verbose``: the full table and every detail report.md holds between them. ``report_md``: where the report was
    written; ``risks``: the caller's own warnings (calibrate's little-data line), weighed for the answer's one risk."""
    brief = engine_brief(rep["engine"]) + [""] if rep.get("engine") and not verbose else []
    return "\n".join([*table_lines(rep, full=verbose), "", *(detail_lines(rep) + [""] if verbose else []), *brief,
                      *answer_lines(rep, report_md, risks=risks, verbose=verbose)])


def table_lines(rep: dict, *, full: bool = False) -> list[str]:
    """The verdict table as aligned text: every column when ``full``, else ``SHORT_COLUMNS`` (about 110 wide)."""
    keep = list(range(len(VERIFY_HEADER))) if full else [VERIFY_HEADER.index(name) for name in SHORT_COLUMNS]
    rows = [[row[i] for i in keep] for row in (VERIFY_HEADER, *verify_rows(rep))]
    widths = [max(len(row[i]) for row in rows) for i in range(len(keep))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def detail_lines(rep: dict) -> list[str]:
    """Everything behind the answer, as report.md says it: sample, thresholds, drift, depth, the engine's run, the
    recommendation's reasoning, does it pay, the other targets' serve lines (``--verbose``)."""
    sample = rep["sample"]
    return [
        f"reference: {rep['reference'].get('model', 'unquantized model')} in {rep['reference']['dtype']} on {rep['reference']['device']}; "
        f"{sample['sequences']} sequences of {sample['seq_len']} tokens; FP8 {rep['fp8_format']}, "
        f"{rep.get('backend', 'cuda')} writer",
        *held_out_text(rep),
        thresholds_text(rep),
        *([note] if (note := drift_note(rep)) else []),
        *depth_lines(rep),
        *[f"skipped {scheme_label(name)}: {why}" for name, why in rep["skipped"].items()],
        *(["", *engine_lines(rep.get("engine")), ""] if rep.get("engine") else []),
        *rep["recommendation"],
        *(["", "does it pay (KV memory and bytes per decoded token, per GPU):", plan_text(rep["does_it_pay"])]
          if rep["does_it_pay"] else []),
        *other_target_lines(rep),
    ]


def answer_lines(rep: dict, report_md: Path | None = None, *, risks: Sequence[str] = (), verbose: bool = False) -> list[str]:
    """At most ten lines a person acts on: the target and its vLLM build, what to serve and the evidence for it, the
    one risk worth checking, where the full report is, and the serve command (last)."""
    target = rep.get("target", serving.DEFAULT_TARGET)
    line = rep.get("serve_lines", {}).get(target)  # None: a report written before kvcal chose per target
    answer = ([] if line is None or "scheme" not in line else
              [f"recommended: {scheme_label(line['scheme'])}: "
               f"{short_evidence(r := rep['schemes'][line['scheme']], floor_of(r, rep['floor'], rep.get('engine')))}"]
              if line["scheme"] in rep["schemes"] else
              ["recommended: keep the KV cache unquantized (no quantized scheme qualifies on this target)"])
    found = risk_lines(rep, risks)
    risk = [] if not found else textwrap.wrap(f"check: {found[0]}" + (f" (+{len(found) - 1} more in the report)" if len(found) > 1 else ""),
                                              RISK_WIDTH, subsequent_indent="  ", max_lines=3, placeholder=" …")
    where = (f"full report: {report_md}" + ("" if verbose else " (--verbose prints its details here)") if report_md
             else "" if verbose else "details: --verbose (--report DIR writes them to report.md)")
    return [target_text(rep), *answer, *serve_run_lines(rep), *risk, *([where] if where else []), "serve it with:",
            f"  {rep['serve_command']}"]


RISK_WIDTH = 118  # the answer's risk line is wrapped to this width, at most three lines


def risk_lines(rep: dict, risks: Sequence[str] = ()) -> list[str]:
    """The warnings behind the recommendation, the most serious first: the engine's failures (load audit, delivery,
    a failed run), the schemes where the engine and the emulation disagree, a sample that may hold the calibration's
    own records, the caller's ``risks``, other targets whose
    serve line differs (a reader serving there must not take this one), the target's vLLM caveats, then "not run in
    vLLM's engine"."""
    target = rep.get("target", serving.DEFAULT_TARGET)
    lines = rep["recommendation"]
    failed = [line for line in lines if line.startswith(ENGINE_FAILURES)]
    caveats = [line for line in lines if line.startswith(serving.caveat_prefix(target))]
    unrun = [line for line in lines if line.startswith(serving.UNRUN_PREFIX)]
    elsewhere = [t + (f" ({s['evidence'].split(' (')[0]})" if s.get("evidence") else "") for t, s in other_targets(rep).items()]
    other = [f"serving on {' or '.join(elsewhere)}? its serve line differs; --verbose gives it"] if elsewhere else []
    seen = [line for line in held_out_text(rep) if line.startswith("the sample may hold")]  # data the scales have seen
    return [*failed, *disagreement_lines(rep.get("engine")), *seen, *risks, *other, *caveats, *unrun]


def write_verify_report(directory: Path, rep: dict) -> None:
    """report.json (every number), the PNG plots and report.md into ``directory`` (created with its parents if
    needed), whole or not at all, as an output is written (``layout``): into a hidden folder beside it, renamed into
    its place in one step where it is missing or empty; a previous report is swapped out by two renames (between them
    ``directory`` is missing, never half-written; ``layout.sweep`` puts back one a killed run left aside). A full
    disk midway leaves ``directory`` as it was. ``config.check_report_dir`` refuses a folder holding anything but a
    report, which the swap would remove."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--report {directory} is a file; pass a directory for report.json, report.md and the plots")
    directory.parent.mkdir(parents=True, exist_ok=True)
    sweep(directory)
    staging = sibling(directory, "tmp")
    staging.mkdir()
    try:
        _write_files(staging, rep)
        try:
            os.rename(staging, directory)  # replaces a missing or empty directory in one step
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        swap_in(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already where the rename happened


def _write_files(directory: Path, rep: dict) -> None:
    """Every file of the report into ``directory`` (``layout.VERIFY_REPORT_FILES``)."""
    (directory / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
    layers = [layer["layer_idx"] for layer in rep["layers"]]
    plots = {"layer_error": "layer_error.png"}
    plot_layer_error(directory / plots["layer_error"], rep)
    with_scales = [n for n in ("head", "tensor") if n in rep["schemes"]] + [n for n, r in rep["schemes"].items() if r["mode"] == "static" and n != "scale1"]
    if with_scales:
        name = with_scales[0]
        plots["scales"], plots["scales_scheme"] = "scales.png", name
        plot_scale_heatmap(directory / plots["scales"], layers, rep["schemes"][name]["scales"],
                           f"K/V scales of scheme {scheme_label(name)} (dequantization multipliers)")
    if any(r.get("depth") for r in measured_schemes(rep).values()):
        plots["depth"] = "kl_by_depth.png"
        plot_kl_by_depth(directory / plots["depth"], rep)
    if rep["position_profile"]:
        plots["position"] = "position_profile.png"
        plot_position_profile(directory / plots["position"], layers, rep["position_profile"])
    (directory / "report.md").write_text(verify_markdown(rep, plots))
