"""verify's report as it leaves kvcal: the text the terminal shows, and the folder ``--report`` writes (report.json,
the plots, report.md)."""

import json
from pathlib import Path

from .capacity import plan_text
from .plots import plot_kl_by_depth, plot_layer_error, plot_position_profile, plot_scale_heatmap
from .report_md import verify_markdown
from .verdict_table import (
    VERIFY_HEADER,
    depth_lines,
    drift_note,
    engine_lines,
    held_out_text,
    measured_schemes,
    other_target_lines,
    target_text,
    thresholds_text,
    verify_rows,
)


def verify_text(rep: dict, report_md: Path | None = None) -> str:
    """The verdict table, recommendation and serve command (the last line) as plain text; ``report_md``: where the
    report was written."""
    rows = [VERIFY_HEADER, *verify_rows(rep)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(VERIFY_HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    sample = rep["sample"]
    lines += [
        "",
        f"reference: {rep['reference'].get('model', 'unquantized model')} in {rep['reference']['dtype']} on {rep['reference']['device']}; "
        f"{sample['sequences']} sequences of {sample['seq_len']} tokens; FP8 {rep['fp8_format']}, "
        f"{rep.get('backend', 'cuda')} writer",
        *held_out_text(rep),
        thresholds_text(rep),
        *([note] if (note := drift_note(rep)) else []),
        *depth_lines(rep),
        *[f"skipped {name}: {why}" for name, why in rep["skipped"].items()],
        *(["", *engine_lines(rep.get("engine")), ""] if rep.get("engine") else []),
        target_text(rep),
        *rep["recommendation"],
        *(["", "does it pay (KV memory and bytes per decoded token, per GPU):", plan_text(rep["does_it_pay"]), ""]
          if rep["does_it_pay"] else []),
        *([f"report: {report_md}"] if report_md else []),
        *other_target_lines(rep),
        "serve it with:",
        f"  {rep['serve_command']}",
    ]
    return "\n".join(lines)


def write_verify_report(directory: Path, rep: dict) -> None:
    """report.json (every number), the PNG plots and report.md into ``directory`` (created with its parents if needed)."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--report {directory} is a file; pass a directory for report.json, report.md and the plots")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
    layers = [layer["layer_idx"] for layer in rep["layers"]]
    plots = {"layer_error": "layer_error.png"}
    plot_layer_error(directory / plots["layer_error"], rep)
    with_scales = [n for n in ("head", "tensor") if n in rep["schemes"]] + [n for n, r in rep["schemes"].items() if r["mode"] == "static" and n != "scale1"]
    if with_scales:
        name = with_scales[0]
        plots["scales"], plots["scales_scheme"] = "scales.png", name
        plot_scale_heatmap(directory / plots["scales"], layers, rep["schemes"][name]["scales"], f"K/V scales of scheme {name!r} (dequantization multipliers)")
    if any(r.get("depth") for r in measured_schemes(rep).values()):
        plots["depth"] = "kl_by_depth.png"
        plot_kl_by_depth(directory / plots["depth"], rep)
    if rep["position_profile"]:
        plots["position"] = "position_profile.png"
        plot_position_profile(directory / plots["position"], layers, rep["position_profile"])
    (directory / "report.md").write_text(verify_markdown(rep, plots))
