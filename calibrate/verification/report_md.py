"""report.md, the Markdown a person reads after ``kvcal verify --report``: the verdict, the recommendation, per-layer
numbers, each probe's section and the settings. The model card (``card``) shows its table and serve lines too."""

import json

from ..choices import scheme_label
from ..vllm_facts import serving
from ..vllm_facts.caveats import Q_QUANTIZERS
from .capacity import plan_text
from .config import SKIP_BASELINE
from .tails import PERCENTILES
from .verdict_table import (
    VERIFY_HEADER,
    depth_lines,
    drift_note,
    engine_lines,
    held_out_text,
    measured_schemes,
    percent_cell,
    target_text,
    thresholds_text,
    verify_rows,
)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: the header, its rule, then one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def target_serve_markdown(lines: dict[str, dict], heading: bool = True) -> list[str]:
    """The serve line of every target judged, each under its label (``serving.target_label``, which ``kvcal inspect``
    reads) with the vLLM build its facts were checked against; the model card and report.md show it."""
    if not lines:
        return []
    out = [*(["### Serve line per target", ""] if heading else []),
           "Each target's line comes from the schemes its vLLM serves as measured (docs/kv-dtypes.md, \"Serving targets\").", ""]
    for target, s in lines.items():
        out += [f"{serving.target_label(target)}: {s['label'] or 'no quantized scheme qualifies'}, checked against "
                f"{s['build']}" + (f"; {s['evidence']}" if s.get("evidence") else ""), "", "```", s["line"], "```", ""]
    return out


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
        f"Static schemes quantize {'K and V only (Triton/FlashInfer)' if th['kv_only'] else f'Q, K and V ({Q_QUANTIZERS})'}.",
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
    out += [markdown_table(["layer", *map(scheme_label, names)],
                           [[str(idx), *(f"{s[n]['layer_rel_error'][i]:.3e}" for n in names)] for i, idx in enumerate(layers)]), ""]
    out += ["## Saturation and underflow", "",
            "Fraction of values beyond the format's max (saturated) and below its smallest normal (stored as subnormal "
            "or zero), mean over layers / worst layer; — = not quantized by that scheme.", ""]
    rows = []
    for n in names:
        for kind in ("k", "v", "q"):
            f = s[n]["fractions"].get(kind)
            if f:
                rows.append([scheme_label(n), kind, f"{percent_cell(sum(f['saturated']) / len(layers), 4)} / {percent_cell(max(f['saturated']), 4)}",
                             f"{percent_cell(sum(f['underflow']) / len(layers), 4)} / {percent_cell(max(f['underflow']), 4)}"])
            else:
                rows.append([scheme_label(n), kind, "—", "—"])
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
        out += [f"K/V scales of scheme {scheme_label(name)} ({s[name]['source']}):", "", f"![K/V scales]({plots['scales']})", ""]
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
            + ", ".join(f"{scheme_label(n)} {t:.1f} s" for n, t in rep["timings"]["scheme_pass_s"].items()) + ". Every number is in report.json.", ""]
    return "\n".join(out)


def drift_markdown(rep: dict) -> list[str]:
    """Decode drift per scheme (docs/evidence.md, "Decode drift")."""
    d = rep.get("drift")
    if not d:
        return []
    rows = []
    for name, r in measured_schemes(rep).items():
        x = r.get("drift")
        if x is None:
            continue
        first = ", ".join("—" if f is None else str(f) for f in x["first_divergence"])
        kl = f"{x['decode_kl']:.4g}" + (f" ± {x['decode_kl_stderr']:.2g}" if x["decode_kl_stderr"] is not None else "")
        rows.append([scheme_label(name), first, f"{x['first_divergence_median']:g}", str(x["first_divergence_min"]), percent_cell(x["identical"], 0),
                     percent_cell(x["agreement"], 1), kl, str(x["near_ties_followed"])])
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
    for name, r in measured_schemes(rep).items():
        x = r.get("tails")
        if x is None:
            continue
        vs = x["vs_floor"]
        rows.append([scheme_label(name), str(x["tokens"]), *(value(x, p) for p in PERCENTILES), f"{x['max']:.4g}", percent_cell(x["clear_flips"], 3),
                     "—" if vs is None else f"{vs['ratio']:.3g}× ({interval(vs['interval'])})"])
    pairs = [[scheme_label(c["a"]), scheme_label(c["b"]), "—" if c["ratio"] is None else f"{c['ratio']:.3g}×", interval(c["interval"])]
             for c in t["comparisons"]]
    return ["## Tails", "",
            f"Per-token KL(reference ‖ scheme) over every position of the sample: a percentile is given only when at least "
            f"{t['min_beyond']} tokens lie beyond it; the maximum is the sample's own. Clear flips: the share of positions "
            f"whose top-1 changes where the reference's top-1 leads by more than {t['near_tie_nats']:g} nats. Intervals: "
            + (f"none, {t['too_few']}." if t.get("too_few") else
               f"{t['confidence']:.0%}, from {t['resamples']} bootstrap resamples of the sequences (seed {t['seed']}), the "
               "same resamples for every scheme."), "",
            markdown_table(["scheme", "tokens", *PERCENTILES, "max", "clear flips", f"{t['compared']} / floor's"], rows), "",
            *([f"{t['compared']} of one scheme over another's:", "", markdown_table(["a", "b", "a / b", "interval"], pairs), ""] if pairs else [])]


def _kl_cell(x: float | None) -> str:
    return "—" if x is None else f"{x:.4g}"


def depth_markdown(rep: dict, plot: str | None = None) -> list[str]:
    """KL and top-1 by context depth per scheme, packed positions apart (docs/evidence.md, "Context depth")."""
    rows, packed = [], []
    for name, r in measured_schemes(rep).items():
        d = r.get("depth")
        if d is None:
            continue
        rows += [[scheme_label(name), b["label"], str(b["sequences"]), f"{b['tokens']:,}", _kl_cell(b["kl"]), percent_cell(b["top1"])] for b in d["buckets"]]
        packed += [[scheme_label(name), b["label"], str(b["sequences"]), f"{b['tokens']:,}", _kl_cell(b["kl"]), percent_cell(b["top1"])] for b in d["packed"]]
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
    for name, r in measured_schemes(rep).items():
        for classification, c in (r.get("token_kinds") or {}).items():
            for kind, k in c["kinds"].items():
                vs = k.get("vs_rest")
                rows.append([scheme_label(name), classification, kind, f"{k['tokens']:,}", _kl_cell(k["kl"]), percent_cell(k["top1"]),
                             "—" if vs is None or vs["ratio"] is None else f"{vs['ratio']:.3g}×" + (" **much worse**" if vs["much_worse"] else
                                                                                                    f" ({vs['too_few']})" if vs.get("too_few") else "")])
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
            f"Scheme {scheme_label(probe['scheme'])} (KL {probe['kl']:.4g} nats/token with every layer quantized). Both sides "
            f"measured by {probe.get('baseline', SKIP_BASELINE)}. Estimate: the layer's own "
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
            rows.append([str(layer), scheme_label(name),
                         *(f"{modes[m]['rel_error']:.3e} ({modes[m]['bias']:+.2e})" for m in ("fp8_inputs", "two_level", "single_chain"))])
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
    out += [markdown_table(["length", "depth", "code", *map(scheme_label, names)], rows), ""]
    for m, r in n["summary"].items():
        if "lost" in r:
            out.append(f"- {scheme_label(m)}: found {r['found']}/{len(n['cases'])}, lost {r['lost']} the reference found, "
                       f"mean log-prob change {r['mean_logprob_change']:+.3f}")
    return out + [""]
